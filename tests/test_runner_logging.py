"""One rank vocabulary in Poseidon's logs: Megatron's (new) rank first, the launch rank beside it."""

from __future__ import annotations

import logging

import pytest

from poseidon_plugin.megatron.launch import runner


def test_rank_label():
    assert runner.rank_label(2) == "rank 2"
    assert runner.rank_label(0, 2) == "rank 0 (launch rank 2)"
    assert runner.rank_label("3", "3") == "rank 3"
    assert runner.rank_label(None) == ""


@pytest.mark.integration   # torch / megatron-core
def test_log_prefix_follows_the_renumbering(monkeypatch, capsys):
    monkeypatch.setattr(runner._setup_logging, "handler", None, raising=False)
    saved = list(runner.log.handlers)
    try:
        runner._setup_logging(2)
        runner.log.info("before")
        runner._set_log_rank(0, 2)
        runner.log.info("after")
        err = capsys.readouterr().err.splitlines()
    finally:
        for h in list(runner.log.handlers):
            if h not in saved:
                runner.log.removeHandler(h)
        runner._setup_logging.handler = None  # type: ignore[attr-defined]
    assert err[-2:] == ["[poseidon rank 2] before", "[poseidon rank 0 (launch rank 2)] after"]


def test_fail_names_both_ranks(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("POSEIDON_LAUNCH_RANK", "2")
    assert runner._fail(runner.PoseidonError("boom")) == runner.EXIT_USER_ERROR
    assert capsys.readouterr().err == "[poseidon rank 0 (launch rank 2)] error: boom\n"
    monkeypatch.delenv("POSEIDON_LAUNCH_RANK")
    runner._fail(runner.PoseidonError("boom"))
    assert capsys.readouterr().err == "[poseidon rank 0] error: boom\n"
