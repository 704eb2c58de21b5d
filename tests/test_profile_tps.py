"""``poseidon profile --tp``: which TP degrees a run can measure (``profile_tps.check_tps``),
checked before torch is imported, every refusal one line naming the fix (no torch needed)."""

from __future__ import annotations

import pytest

from poseidon_plugin import cli
from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.megatron.profile.profile_tps import Processes, check_tps
from poseidon_plugin.model import get_model

ONE = Processes()
NODE4 = Processes(rank=0, world_size=4, local_rank=0, local_world_size=4)
TWO_NODES_OF_2 = Processes(rank=3, world_size=4, local_rank=1, local_world_size=2)
LLAMA = get_model("llama3-8b")   # 32 heads, 8 query groups


def test_processes_from_torchrun_environment():
    assert Processes.from_environ({}) == ONE
    assert Processes.from_environ({"WORLD_SIZE": "1", "RANK": "0"}) == ONE
    env = {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert Processes.from_environ(env) == TWO_NODES_OF_2
    # LOCAL_WORLD_SIZE missing: one node
    assert Processes.from_environ({"WORLD_SIZE": "4", "RANK": "2"}).local_world_size == 4
    with pytest.raises(PoseidonError, match="malformed torchrun environment"):
        Processes.from_environ({"WORLD_SIZE": "four"})


@pytest.mark.parametrize("tps, procs, expected", [
    ([1], ONE, (1,)),
    ([4, 1, 2, 2], NODE4, (1, 2, 4)),      # sorted, once each
    ([1, 2], TWO_NODES_OF_2, (1, 2)),      # TP groups inside each node
])
def test_accepted(tps, procs, expected):
    assert check_tps(tps, procs, LLAMA) == expected


@pytest.mark.parametrize("tps, procs, message", [
    ([2], ONE, r"^--tp 2: TP 2 needs 2 processes on one node \(one per TP rank\) and this run is "
               r"one process: run it with torchrun --nproc-per-node >= 2, a multiple of every "
               r"TP degree \(e\.g\. torchrun --nproc-per-node 2 -m poseidon_plugin profile"),
    ([1, 2, 8], NODE4, r"^--tp 8: TP 8 needs 8 processes on one node .* this run has 4 "
                       r"process\(es\) per node: run it with torchrun --nproc-per-node >= 8"),
    ([4], TWO_NODES_OF_2, r"^--tp 4: TP 4 needs 4 processes on one node .* has 2 process\(es\) "
                          r"per node: run it with torchrun --nproc-per-node >= 4"),
    ([1, 3], NODE4, r"^--tp 3: TP 3 does not divide the 4 processes per node .*: run with "
                    r"--nproc-per-node 3 or drop TP 3$"),
    ([0, 1], NODE4, r"^--tp: expected integers >= 1, got \[0, 1\]$"),
    ([], NODE4, r"^--tp: expected integers >= 1, got \[\]$"),
])
def test_refused_naming_the_fix(tps, procs, message):
    with pytest.raises(PoseidonError, match=message) as err:
        check_tps(tps, procs, LLAMA)
    assert "\n" not in str(err.value)


def test_degrees_the_model_cannot_split():
    six = Processes(rank=0, world_size=6, local_rank=0, local_world_size=6)
    with pytest.raises(PoseidonError, match=r"^--tp 3 6: TP 3 does not divide the model's 32 "
                                            r"attention heads"):
        check_tps([1, 3, 6], six, LLAMA)
    sixteen = Processes(rank=0, world_size=16, local_rank=0, local_world_size=16)
    with pytest.raises(PoseidonError, match=r"^--tp 16: TP 16 does not divide the model's 8 "
                                            r"query groups"):
        check_tps([8, 16], sixteen, LLAMA)   # 16 divides the 32 heads, not the 8 KV groups
    assert check_tps([1, 3, 6], six) == (1, 3, 6)   # no model: only the processes count


def test_cli_refuses_before_torch_one_line_exit_2(tmp_path, capsys, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    out = str(tmp_path / "db.json")
    argv = ["profile", "--model", "llama3-8b", "--seq-length", "128", "--device-type", "cpu",
            "--device", "cpu", "-o", out]
    assert cli.main([*argv, "--tp", "1", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("poseidon: error: --tp 2: TP 2 needs 2 ")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    assert cli.main([*argv, "--tp", "1", "3"]) == 2
    assert "does not divide the 4 processes per node" in capsys.readouterr().err
    assert cli.main([*argv, "--tp", "1,2"]) == 2
    assert capsys.readouterr().err == "poseidon: error: argument --tp: invalid int value: '1,2'\n"
    assert cli.main([*argv, "--timeout", "0.5"]) == 2
    assert "--timeout: expected a number of seconds in [1, 604800]" in capsys.readouterr().err
    assert not (tmp_path / "db.json").exists()


def test_a_failing_rank_above_0_waits_for_rank_0_to_report(capsys, monkeypatch):
    """Under torchrun every rank finds an argument error alike: rank 0 reports it, the others
    wait (torchrun stops them when rank 0 exits) and report only if still running."""
    slept = []
    monkeypatch.setattr(cli.time, "sleep", slept.append)
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = ["profile", "--model", "llama3-8b", "--seq-length", "128", "--device-type", "cpu",
            "-o", "db.json", "--tp", "4"]
    monkeypatch.setenv("RANK", "0")
    assert cli.main(argv) == 2 and slept == []
    monkeypatch.setenv("RANK", "1")
    assert cli.main(argv) == 2 and slept == [cli.REPORT_GRACE_S]
    assert capsys.readouterr().err.count("poseidon: error: --tp 4") == 2
    assert cli.main(["plan", "--bogus"]) == 2 and slept == [cli.REPORT_GRACE_S]   # not profile
