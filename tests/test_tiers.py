"""The test tiers say what they skip, and together run every test.

* Every pytest run in the Makefile prints each skip's reason (``-rs``).
* No test waits for an opt-in variable that neither the Makefile nor ``.ci/run`` sets (setting 6
  was behind ``POSEIDON_SLOW=1``, which nothing set: 15 tests CI never ran). The environment
  variables the tests read are either set by the Makefile / ``.ci/run``, or name where the
  framework trees and side environments are (absent in a user's clone: those tests skip and say
  why), or are tuning knobs with a default that runs the test.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAKEFILE = (ROOT / "Makefile").read_text()
CI = (ROOT / ".ci" / "run").read_text()

# read by tests, not set by the Makefile for every tier: why that is fine
NOT_AN_OPT_IN = {
    # where the framework trees / side environments are: absent -> the test skips, saying so
    "POSEIDON_FRAMEWORKS": "the framework trees (Makefile FRAMEWORKS)",
    "POSEIDON_MSLLM_PYTHON": "MindSpeed-LLM's side environment (make test)",
    "POSEIDON_MCORE_PYTHON": "Megatron-LM's side environment (make test-mcore-versions)",
    "POSEIDON_MCORE_VERSIONS": "the Megatron-LM versions (make test-mcore-versions)",
    "POSEIDON_MEGATRON_TREES": "a user's own Megatron-LM checkouts (default: FRAMEWORKS)",
    # knobs with a default that runs the test
    "POSEIDON_SLOW_BUDGET_S": "setting 6's search budget (default 300 s)",
    "TORCH_CUDA_ARCH_LIST": "passed on to megatron-core 0.15's import (default 8.0)",
    # read to check that the code under test restores it (test_moe_judge)
    "CUDA_DEVICE_MAX_CONNECTIONS": "",
    # passed through to / set for child processes
    "PYTHONPATH": "", "PATH": "", "RANK": "", "WORLD_SIZE": "", "PROBE_PORT": "", "PROBE_STAGE": "",
    "FAIL_RANK": "", "POSEIDON_SEARCH_SPLIT_NODES": "",
}


def _pytest_lines() -> list[str]:
    return [ln for ln in MAKEFILE.splitlines() if re.search(r"-m pytest\b", ln)]


def test_every_makefile_pytest_run_prints_skip_reasons():
    lines = _pytest_lines()
    assert len(lines) >= 4, lines          # test, test-slow, test-core, test-py310, mcore
    for ln in lines:
        assert re.search(r"\s-r[a-zA-Z]*s", ln), f"no -rs (skip reasons): {ln.strip()}"


def _env_reads(src: str) -> set[str]:
    """``os.environ.get("X")`` / ``os.environ["X"]`` / ``os.getenv("X")`` reads in ``src``."""
    out = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            f = node.func
            if isinstance(f, ast.Attribute) and (
                    (f.attr == "get" and isinstance(f.value, ast.Attribute)
                     and f.value.attr == "environ") or f.attr == "getenv"):
                out.add(node.args[0].value)
        elif (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load)
              and isinstance(node.value, ast.Attribute) and node.value.attr == "environ"
              and isinstance(node.slice, ast.Constant)):
            out.add(node.slice.value)
    return out


def test_no_test_waits_for_a_variable_ci_never_sets():
    set_by_ci = set(re.findall(r"\b([A-Z][A-Z0-9_]+)=", MAKEFILE + CI))
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for var in sorted(_env_reads(path.read_text())):
            assert var in set_by_ci or var in NOT_AN_OPT_IN, (
                f"{path.relative_to(ROOT)} reads ${var}, which neither the Makefile nor .ci/run "
                f"sets: a test behind it runs in no CI tier (a variable that gates nothing: "
                f"add it to NOT_AN_OPT_IN, saying why)")


def test_setting_6_runs_in_the_slow_tier():
    spec = importlib.util.spec_from_file_location("_settings", ROOT / "tests" / "test_settings.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    six = [p for p in mod.CASES if p.values[0].startswith("6")]
    assert len(six) == 3
    for p in six:
        names = {m.name for m in p.marks}
        assert "slow" in names
        assert not [m for m in p.marks if m.name in ("skip", "skipif")
                    and (m.name == "skip" or m.args[0])], p
