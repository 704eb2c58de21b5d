"""``poseidon plan`` end to end: through ``cli.main([...])`` and as a ``python -m`` subprocess.

Covers the table, ``--json`` (required keys), ``--out``, the two baselines beside the plan,
determinism, and every user-error path (exit 2, ONE line ``poseidon: error: ...``, no traceback).

Determinism: the table's ``search:`` line and the JSON's ``search.seconds`` carry the search's
wall-clock seconds, so those are masked. With one worker everything else is byte-identical. With
several workers (the default is one per core) the plan is identical but the search counters
(``nodes``, ``cut_bound``, ``plans_simulated``, ...) depend on when each worker saw the improving
threshold, so the ``search`` statistics are masked too in that test.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from poseidon_plugin import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = os.path.join(ROOT, "examples/clusters/small-two-type.yaml")
TINY = os.path.join(ROOT, "examples/models/tiny-gpt.yaml")
SETTING1 = os.path.join(ROOT, "examples/clusters/paper-setting1.yaml")
BASE = ["plan", "--cluster", SMALL, "--model", TINY, "--global-batch-size", "16",
        "--seq-length", "128", "--workers", "1"]

REQUIRED_TOP = ("predicted_iteration_time_ms", "schedule", "dp", "micro_batch_size",
                "num_microbatches", "stages", "megatron_args", "mindspeed_llm_args", "search")
REQUIRED_STAGE = ("device_type", "tp", "layers", "forward_ms", "backward_ms", "send_forward_ms",
                  "send_backward_ms", "allreduce_ms", "memory_bytes", "memory_capacity_bytes")


def run_main(capsys, argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def run_module(argv, module="poseidon_plugin.cli"):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=300)


def mask_seconds(text: str) -> str:
    text = re.sub(r", [0-9.]+ s, exhaustive", ", <s> s, exhaustive", text)
    # the wall-clock fields of the statistics: the search's time, its first plan's, the runner-up's
    return re.sub(r'"(seconds|first_plan_s|runner_up_s)": [0-9.]+', r'"\1": <s>', text)


# --------------------------------------------------------------------------- happy paths

def test_table_with_baselines(capsys):
    rc, out, err = run_main(capsys, BASE)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("Plan for tiny-gpt on small-two-type: ")
    assert re.match(r"predicted iteration [0-9.]+ ms", lines[1])
    assert any(ln.split()[:3] == ["stage", "type", "tp"] for ln in lines)
    assert any(ln.startswith("megatron:   --tensor-model-parallel-size") for ln in lines)
    assert any(ln.startswith("mindspeed:  --tensor-model-parallel-size") for ln in lines)
    assert any(ln.startswith("search: ") for ln in lines)
    t = float(re.search(r"predicted iteration ([0-9.]+) ms", out).group(1))
    for name in ("megatron-default", "best-single-type"):
        m = re.search(rf"^baseline {name}: ([0-9.]+) ms \(pp=\d+, dp=\d+, tp=\d+\) -> "
                      rf"speed-up x([0-9.]+)$", out, re.M)
        assert m, f"baseline {name} missing:\n{out}"
        bt, speedup = float(m.group(1)), float(m.group(2))
        assert bt >= t - 0.01            # the plan beats or equals the baseline
        assert speedup >= 1.0
        # printed to 2 decimals (tiny-gpt iterations are ~0.3 ms): allow the rounding
        assert speedup == pytest.approx(bt / t, rel=0.05)
    # baselines come after the plan
    assert out.index("baseline megatron-default") > out.index("search: ")


def test_no_baselines_flag(capsys):
    rc, out, _ = run_main(capsys, BASE + ["--no-baselines"])
    assert rc == 0
    assert "baseline" not in out


def test_json_has_required_keys(capsys):
    rc, out, err = run_main(capsys, BASE + ["--json"])
    assert rc == 0, err
    d = json.loads(out)
    for k in REQUIRED_TOP:
        assert k in d, k
    assert d["stages"], "no stages"
    for s in d["stages"]:
        for k in REQUIRED_STAGE:
            assert k in s, k
        assert s["memory_bytes"] <= s["memory_capacity_bytes"]
        assert s["layers"] >= 1
    assert sum(s["layers"] for s in d["stages"]) == 8          # tiny-gpt
    assert d["dp"] * d["micro_batch_size"] * d["num_microbatches"] == 16
    assert isinstance(d["megatron_args"], list) and isinstance(d["mindspeed_llm_args"], list)
    assert d["megatron_args"][:2] == ["--tensor-model-parallel-size", str(d["stages"][0]["tp"])]
    assert d["search"]["exhaustive"] is True
    assert [b["name"] for b in d["baselines"]] == ["megatron-default", "best-single-type"]
    assert all(b["status"] == "ok" and b["speedup"] >= 1.0 for b in d["baselines"])
    assert out.endswith("}\n")


def test_out_file(capsys, tmp_path):
    path = tmp_path / "plan.json"
    rc, out, _ = run_main(capsys, BASE + ["--out", str(path)])
    assert rc == 0
    assert out.startswith("Plan for ")          # the table still goes to stdout
    written = path.read_text(encoding="utf-8")
    d = json.loads(written)
    assert set(REQUIRED_TOP) <= set(d)
    # --json and --out write the same bytes (up to the wall-clock seconds)
    path2 = tmp_path / "plan2.json"
    rc, out2, _ = run_main(capsys, BASE + ["--json", "--out", str(path2)])
    assert rc == 0
    assert path2.read_text(encoding="utf-8") == out2
    assert mask_seconds(out2) == mask_seconds(written)


def test_out_file_round_trips_through_plan_from_json(capsys, tmp_path):
    from poseidon_plugin.plan import Plan
    path = tmp_path / "p.json"
    assert run_main(capsys, BASE + ["--json", "--out", str(path)])[0] == 0
    plan = Plan.from_json(path.read_text(encoding="utf-8"))
    assert plan.to_json() == path.read_text(encoding="utf-8")


def _text_baselines(out: str) -> dict:
    got = {}
    for m in re.finditer(r"^baseline (\S+): ([0-9.]+) ms \(pp=(\d+), dp=(\d+), tp=(\d+)\) -> "
                         r"speed-up x([0-9.]+)$", out, re.M):
        got[m.group(1)] = (float(m.group(2)), *map(int, m.group(3, 4, 5)), float(m.group(6)))
    return got


def test_json_carries_the_baselines_the_text_shows(capsys):
    rc, out, err = run_main(capsys, BASE)
    assert rc == 0, err
    text = _text_baselines(out)
    rc, js, err = run_main(capsys, BASE + ["--json"])
    assert rc == 0, err
    entries = json.loads(js)["baselines"]
    assert set(text) == {e["name"] for e in entries} == {"megatron-default", "best-single-type"}
    for e in entries:
        t, pp, dp, tp, speedup = text[e["name"]]
        assert e["status"] == "ok" and e["reason"] is None and e["schedule"]
        assert (e["pp"], e["dp"], e["tp"]) == (pp, dp, tp)
        assert f"{e['predicted_iteration_time_ms']:.2f}" == f"{t:.2f}"
        assert f"{e['speedup']:.2f}" == f"{speedup:.2f}"


def test_no_baselines_marks_them_skipped_in_the_json(capsys, tmp_path):
    from poseidon_plugin.plan import Plan

    path = tmp_path / "p.json"
    rc, out, err = run_main(capsys, BASE + ["--no-baselines", "--json", "--out", str(path)])
    assert rc == 0, err
    d = json.loads(out)
    assert [(b["name"], b["status"], b["reason"]) for b in d["baselines"]] == [
        ("megatron-default", "skipped", "--no-baselines"),
        ("best-single-type", "skipped", "--no-baselines")]
    assert all(b["predicted_iteration_time_ms"] is None for b in d["baselines"])
    assert Plan.from_json(path.read_text(encoding="utf-8")).baselines[0]["status"] == "skipped"


def test_a_baseline_without_plan_says_why(capsys, tmp_path):
    """TP 1 and micro-batch 1 on 16 devices: every even split has DP 2, 4 or 8, none dividing a
    global batch of 3. The text and the JSON give the same reason; Plan.from_json keeps it."""
    from poseidon_plugin.plan import Plan

    argv = ["plan", "--cluster", SMALL, "--model", TINY, "--global-batch-size", "3",
            "--seq-length", "128", "--workers", "1", "--tp", "1", "--micro-batch-sizes", "1"]
    rc, out, err = run_main(capsys, argv)
    assert rc == 0, err
    m = re.search(r"^baseline megatron-default: no feasible plan: (.+)$", out, re.M)
    assert m and m.group(1).startswith("the global batch 3 is not a multiple of DP x "
                                       "micro-batch size"), out
    assert "best-single-type" in _text_baselines(out)
    path = tmp_path / "p.json"
    rc, js, err = run_main(capsys, argv + ["--json", "--out", str(path)])
    entry = json.loads(js)["baselines"][0]
    assert entry["status"] == "no plan" and entry["reason"] == m.group(1)
    assert entry["pp"] is None and entry["speedup"] is None
    plan = Plan.from_json(path.read_text(encoding="utf-8"))
    assert plan.baselines[0]["reason"] == m.group(1)
    assert plan.to_json() == path.read_text(encoding="utf-8")


def test_every_plan_option_has_help_and_presets_are_listed():
    from poseidon_plugin.model import PRESETS

    parser = cli._build_parser()
    sub = next(a for a in parser._actions if isinstance(a, cli.argparse._SubParsersAction))
    for name in ("plan", "validate"):
        for action in sub.choices[name]._actions:
            if action.option_strings:
                assert action.help and action.help != cli.argparse.SUPPRESS, \
                    (name, action.option_strings)
    from poseidon_plugin.fidelity.command import _parser as validate_parser
    for action in validate_parser()._actions:
        assert action.help, action.option_strings
    plan = sub.choices["plan"]
    helps = {a.dest: a.help for a in plan._actions}
    assert all(p in helps["model"] for p in PRESETS)
    for dest in ("max_virtual_stages", "warmup_samples", "seed", "micro_batch_sizes",
                 "schedules", "pruning", "type_order", "time_budget", "workers", "tp_degrees"):
        assert "default" in helps[dest], dest          # every default is said
    for dest, unit in (("global_batch_size", "samples"), ("seq_length", "tokens"),
                       ("time_budget", "seconds"), ("micro_batch_sizes", "samples")):
        assert unit in helps[dest], dest
    text = plan.format_help()
    assert "examples:" in text and "per micro-batch" in text
    assert "default: 500" in text and "default: 1 2 4" in text   # %(default)s filled in


def test_verbose_before_or_after_the_command():
    """-v anywhere turns on debug logging; without it there is none."""
    quiet = run_module(BASE + ["--no-baselines"])
    after = run_module(BASE + ["--no-baselines", "-v"])
    before = run_module(["--verbose"] + BASE + ["--no-baselines"])
    for r in (quiet, after, before):
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("Plan for ")
    assert "DEBUG" not in quiet.stderr
    assert "poseidon: DEBUG: " in after.stderr and "poseidon: DEBUG: " in before.stderr
    r = run_module(["validate", "-v", "--list"])
    assert r.returncode == 0 and "pp2-1f1b-m4" in r.stdout, r.stderr


def test_tp_flag_limits_the_plan_and_its_baselines(capsys):
    """--tp 2: the plan and the Megatron baseline use TP 2 (the flags say so); --tp 3 is a
    one-line error naming the valid degrees."""
    argv = ["plan", "--cluster", SETTING1, "--model", "llama3-8b", "--global-batch-size", "32",
            "--seq-length", "2048", "--workers", "1", "--tp", "2"]
    rc, out, err = run_main(capsys, argv + ["--json"])
    assert rc == 0, err
    d = json.loads(out)
    assert {s["tp"] for s in d["stages"]} == {2}
    assert d["megatron_args"][:2] == ["--tensor-model-parallel-size", "2"]
    rc, out, err = run_main(capsys, argv)
    assert rc == 0, err
    assert "tp=2" in out.splitlines()[0]
    rc, out, err = run_main(capsys, argv[:-1] + ["3"])
    _check_one_line_error(rc, out, err,
                          r"--tp / tp_degrees.*none of \[3\] is valid.*valid: \[1, 2, 4, 8\]")


def test_deterministic_single_worker(capsys):
    outs = [mask_seconds(run_main(capsys, BASE)[1]) for _ in range(2)]
    assert outs[0] == outs[1]
    outs = [mask_seconds(run_main(capsys, BASE + ["--json"])[1]) for _ in range(2)]
    assert outs[0] == outs[1]


def test_deterministic_plan_with_parallel_workers(capsys):
    """Default workers (one per core): the plan is the same; the search counters may differ."""
    argv = ["plan", "--cluster", SETTING1, "--model", "llama3-8b", "--global-batch-size", "32",
            "--seq-length", "2048", "--json"]
    plans = []
    for workers in ([], ["--workers", "2"], ["--workers", "1"]):
        rc, out, err = run_main(capsys, argv + workers)
        assert rc == 0, err
        d = json.loads(out)
        d.pop("search")
        plans.append(json.dumps(d, sort_keys=True))
    assert plans[0] == plans[1] == plans[2]


def test_subprocess_table_and_json():
    r = run_module(BASE)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Plan for tiny-gpt on small-two-type")
    assert "baseline megatron-default" in r.stdout and "baseline best-single-type" in r.stdout
    assert "Traceback" not in r.stderr
    r2 = run_module(BASE + ["--json"], module="poseidon_plugin")   # __main__.py
    assert r2.returncode == 0, r2.stderr
    d = json.loads(r2.stdout)
    assert set(REQUIRED_TOP) <= set(d)
    # the subprocess and the in-process run agree: the plan exactly; the search statistics
    # (masking wall-clock seconds) where neither run's statistics depend on timing (a loaded
    # host can cut a time-limited part, e.g. the runner-up, at a different node)
    r3 = run_module(BASE + ["--json"])
    d3 = json.loads(r3.stdout)
    s2, s3 = d.pop("search"), d3.pop("search")
    assert d == d3
    if not (s2["statistics_depend_on_timing"] or s3["statistics_depend_on_timing"]):
        assert mask_seconds(json.dumps(s2, sort_keys=True)) == mask_seconds(
            json.dumps(s3, sort_keys=True))


# --------------------------------------------------------------------------- error paths

def _write(tmp_path, name, text, write=True):
    p = tmp_path / name
    if write:
        p.write_text(text, encoding="utf-8")
    return str(p)


SMALL_TEXT = open(SMALL, encoding="utf-8").read()


def error_cases(tmp_path, write=True):
    """(id, argv, regex the one error line must match); files written under tmp_path."""
    bad_yaml = _write(tmp_path, "bad.yaml", "name: x\ndevice_types: [1, 2\n", write)
    bad_field = _write(tmp_path, "badfield.yaml",
                       SMALL_TEXT.replace("memory_gib: 16", "memory_gib: -3"), write)
    unknown_key = _write(tmp_path, "typo.yaml",
                         SMALL_TEXT.replace("cross_type_gbps: 50", "cross_type_gbs: 50"), write)
    tiny_mem = _write(tmp_path, "tinymem.yaml", (
        "name: tinymem\ndevice_types:\n"
        "  fast: {memory_gib: 0.01, peak_tflops: 200, intra_node_gbps: 800}\n"
        "  slow: {memory_gib: 0.005, peak_tflops: 100, intra_node_gbps: 400}\n"
        "nodes:\n  - {device_type: fast, devices_per_node: 4}\n"
        "  - {device_type: slow, devices_per_node: 4}\n"
        "links: {inter_node_gbps: 100, cross_type_gbps: 50}\n"), write)
    bad_model = _write(tmp_path, "badmodel.yaml",
                       "num_layers: 0\nhidden_size: 64\nffn_hidden_size: 128\n"
                       "num_attention_heads: 4\nvocab_size: 100\nseq_length: 16\n", write)

    def plan(cluster=SMALL, model=TINY, gbs="16", seq="128", extra=()):
        return ["plan", "--cluster", cluster, "--model", model, "--global-batch-size", gbs,
                "--seq-length", seq, "--workers", "1", *extra]

    return [
        ("missing-cluster", plan(cluster=str(tmp_path / "nope.yaml")),
         r"nope\.yaml: .*readable cluster YAML.*No such file"),
        ("cluster-is-dir", plan(cluster=str(tmp_path)), r"readable cluster YAML"),
        ("malformed-yaml", plan(cluster=bad_yaml), r"bad\.yaml: line \d+: expected valid YAML"),
        ("bad-field", plan(cluster=bad_field),
         r"badfield\.yaml: device_types\.fast\.memory_gib: expected a number > 0, got -3"),
        ("unknown-key", plan(cluster=unknown_key), r"typo\.yaml: links\.cross_type_gbs: "),
        ("unknown-model", plan(model="llama-99b"),
         r"model: expected a preset \(.*llama3-8b.*\) or a YAML file path, got 'llama-99b'"),
        ("bad-model-field", plan(model=bad_model), r"badmodel\.yaml: num_layers: "),
        ("missing-model-file", plan(model=str(tmp_path / "m.yaml")), r"m\.yaml: .*readable"),
        ("batch-not-divisible", plan(gbs="6", extra=["--micro-batch-sizes", "4"]),
         r"global batch size 6 is not divisible by any micro-batch size in \[4\]"),
        ("batch-zero", plan(gbs="0"), r"--global-batch-size.*>= 1"),
        ("seq-negative", plan(seq="-1"), r"--seq-length.*>= 1"),
        ("nothing-fits", plan(cluster=tiny_mem, extra=["--no-baselines"]),
         r"no plan fits in device memory: the closest \(pp=\d+, tp=\S+, dp=\d+, micro-batch \d+,"
         r" [a-z0-9-]+\) lacks [0-9.]+ GiB on stage \d+ \((fast|slow): needs [0-9.]+ GiB of "
         r"[0-9.]+ GiB\)"),
        ("batch-not-int", plan(gbs="abc"), r"argument --global-batch-size: invalid int"),
        ("bad-schedule", plan(extra=["--schedules", "foo"]),
         r"argument --schedules: invalid choice: 'foo'"),
        ("bad-pruning", plan(extra=["--pruning", "maybe"]), r"argument --pruning: invalid"),
        ("bad-type-order", plan(extra=["--type-order", "x"]), r"argument --type-order"),
        ("workers-zero", plan(extra=["--workers", "0"]), r"--workers.*expected an integer >= 1"),
        ("time-budget-negative", plan(extra=["--time-budget", "-1"]), r"time.budget"),
        ("mbs-zero", plan(extra=["--micro-batch-sizes", "0"]), r"micro.batch.sizes"),
        ("virtual-zero", plan(extra=["--max-virtual-stages", "0"]), r"virtual.stages"),
        ("tp-both", plan(extra=["--uniform-tp", "--per-stage-tp"]), r"not allowed with"),
        ("unknown-flag", plan(extra=["--bogus"]), r"unrecognized arguments: --bogus"),
        ("missing-required", ["plan"], r"required: --cluster, --model"),
        ("no-command", [], r"expected a command"),
        ("bad-command", ["frobnicate"], r"invalid choice: 'frobnicate'"),
        ("missing-profiles", plan(extra=["--profiles", str(tmp_path / "p.json")]),
         r"p\.json: cannot read profile DB"),
        ("unwritable-out", plan(extra=["--no-baselines", "--out",
                                       str(tmp_path / "no" / "dir" / "x.json")]),
         r"--out .*x\.json: cannot write"),
    ]


CASE_IDS = [c[0] for c in error_cases(pathlib.Path("/nonexistent"), write=False)]


def _check_one_line_error(rc, out, err, pattern):
    assert rc == 2, (out, err)
    assert "Traceback" not in err and "Traceback" not in out
    assert err.endswith("\n") and err.count("\n") == 1, f"not one line: {err!r}"
    assert err.startswith("poseidon: error: "), err
    assert re.search(pattern, err), f"{pattern!r} not in {err!r}"
    assert out == "" or not out.strip().startswith("{"), "no JSON on error"


@pytest.mark.parametrize("case", CASE_IDS)
def test_error_paths_in_process(capsys, tmp_path, case):
    cases = {c[0]: c for c in error_cases(tmp_path)}
    _, argv, pattern = cases[case]
    rc, out, err = run_main(capsys, argv)
    _check_one_line_error(rc, out, err, pattern)
    if case == "unwritable-out":
        assert out == ""   # nothing printed before the error


@pytest.mark.parametrize("case", ["missing-cluster", "malformed-yaml", "bad-field",
                                  "unknown-model", "batch-not-divisible", "nothing-fits",
                                  "bad-schedule"])
def test_error_paths_subprocess(tmp_path, case):
    cases = {c[0]: c for c in error_cases(tmp_path)}
    _, argv, pattern = cases[case]
    r = run_module(argv)
    _check_one_line_error(r.returncode, r.stdout, r.stderr, pattern)


def test_nothing_fits_names_a_real_shortfall(capsys, tmp_path):
    """The closest plan's 'lacks X GiB' equals needs - capacity (to the printed precision)."""
    cases = {c[0]: c for c in error_cases(tmp_path)}
    rc, _, err = run_main(capsys, cases["nothing-fits"][1])
    assert rc == 2
    m = re.search(r"lacks ([0-9.]+) GiB .* needs ([0-9.]+) GiB of ([0-9.]+) GiB", err)
    lacks, needs, cap = map(float, m.groups())
    assert needs > cap
    assert lacks == pytest.approx(needs - cap, abs=0.011)


def test_negative_warmup_samples_is_rejected(capsys):
    rc, out, err = run_main(capsys, BASE + ["--no-baselines", "--warmup-samples", "-5"])
    _check_one_line_error(rc, out, err, r"warmup")


def test_validate_argument_errors_are_one_line(capsys):
    rc, out, err = run_main(capsys, ["validate", "--bogus"])
    assert rc == 2 and out == ""
    assert err == "poseidon: error: validate: unrecognized arguments: --bogus\n"
