"""Bad input: what each gets and how long it takes to get it; printed as Markdown.

Run: ``.venv/bin/python benchmarks/bench_reliability.py [--only SUBSTRING]``.

Every case builds one hostile or mistyped input in a temporary directory (the rows of issue 12,
plus a few more found while fixing them) and runs the real command in a fresh process:
``python -m poseidon_plugin.cli plan ...`` on the small example cluster and the tiny model, or
``python -m poseidon_plugin.launch`` for the launch options. The launch's profile cache is read
in process (``profile_gather.load_cache``, what rank 0 runs). Columns: ``exit`` = the exit
status, ``what it gets`` = the first line of stderr (or the warning), abbreviated; ``s`` = the
wall time of the whole process (Python start-up and imports included, ~0.3-1 s).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

SMALL = os.path.join(ROOT, "examples", "clusters", "small-two-type.yaml")
TINY = os.path.join(ROOT, "examples", "models", "tiny-gpt.yaml")
SMALL_TEXT = open(SMALL, encoding="utf-8").read()


def _plan(cluster=SMALL, *extra):
    return ["-m", "poseidon_plugin.cli", "plan", "--cluster", cluster, "--model", TINY,
            "--global-batch-size", "16", "--seq-length", "128", "--no-baselines", *extra]


def _db(d: str, name: str, **patch) -> str:
    """Measured records at the estimator's times, ``patch`` applied to every record."""
    from poseidon_plugin.cluster import load_cluster
    from poseidon_plugin.model import load_model
    from poseidon_plugin.profiles import estimate_profile, profile_key, profile_to_record

    cluster, model = load_cluster(SMALL), load_model(TINY)
    records = []
    for t in ("fast", "slow"):
        for kind in ("decoder", "embedding", "output"):
            rec = profile_to_record(estimate_profile(cluster, model,
                                                     profile_key(model, t, kind, 1, 1, 128)))
            rec.update(source="measured", **patch)
            records.append(rec)
    return _write(d, name, json.dumps({"version": 1, "records": records}))


def _write(d: str, name: str, text) -> str:
    path = os.path.join(d, name)
    with open(path, "wb") as f:
        f.write(text if isinstance(text, bytes) else text.encode())
    return path


def _cluster(d: str, old: str, new: str, name: str = "c.yaml") -> str:
    assert old in SMALL_TEXT, old
    return _write(d, name, SMALL_TEXT.replace(old, new, 1))


def _bomb() -> str:
    parts = ["&a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    parts += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    return "[" + ", ".join(parts) + "]"


def cases(d: str):
    """(input, argv for ``python``) pairs; argv None: an in-process case (see ``run``)."""
    deep = "[" * 200_000 + "]" * 200_000
    fast = "  fast: {memory_gib: 16, peak_tflops: 200, efficiency: 0.5, intra_node_gbps: 800}"
    big = os.path.join(d, "big.yaml")
    with open(big, "w", encoding="utf-8") as f:
        f.write(SMALL_TEXT + "# " + "x" * (50 << 20) + "\n")
    afile = _write(d, "afile", "x")
    script = _write(d, "train.py", "raise SystemExit('not reached')\n")
    return [
        ("(valid input, for scale: a plan)", _plan(SMALL, "--time-budget", "5")),
        ("profile DB whose times are all 0",
         _plan(SMALL, "--profiles", _db(d, "zero.json", forward_ms=0, backward_ms=0), "--time-budget", "5")),
        ("profile times of 1e300", _plan(SMALL, "--profiles", _db(d, "huge.json", forward_ms=1e300))),
        ("profile `activation_bytes` 1e30",
         _plan(SMALL, "--profiles", _db(d, "act.json", activation_bytes=10**30))),
        ("profile 1e6 x faster than the device's peak",
         _plan(SMALL, "--profiles", _db(d, "fast.json", forward_ms=1e-9, backward_ms=1e-9))),
        ("profile DB nested 200k deep",
         _plan(SMALL, "--profiles", _write(d, "deep.json", '{"version": 1, "records": '
                                           + deep + "}"))),
        ("cluster YAML nested 200k deep",
         _plan(_cluster(d, "name: small-two-type", "name: " + deep, "deep.yaml"))),
        ("a 459-byte YAML alias bomb (9^9 strings) in a cluster `name`",
         _plan(_cluster(d, "name: small-two-type", "name: " + _bomb(), "bomb.yaml"))),
        ("a 50 MB cluster YAML, `--time-budget 30`", _plan(big, "--time-budget", "30")),
        ("`count: 100000000` nodes",
         _plan(_cluster(d, "devices_per_node: 4, count: 2}", "devices_per_node: 4, "
                        "count: 100000000}", "count.yaml"))),
        ("`devices_per_node: 1000000000000`",
         _plan(_cluster(d, "devices_per_node: 4, count: 2}", "devices_per_node: "
                        "1000000000000, count: 2}", "dpn.yaml"))),
        ("`memory_gib: 1e300`",
         _plan(_cluster(d, "memory_gib: 16", "memory_gib: 1e300", "mem.yaml"))),
        ("a device type declared twice in `device_types`",
         _plan(_cluster(d, fast, fast + "\n" + fast.replace("16", "80"), "twice.yaml"))),
        ("non-UTF-8 (Latin-1) cluster YAML",
         _plan(_write(d, "latin1.yaml", SMALL_TEXT.replace("small-two-type", "café")
                      .encode("latin-1")))),
        ("`--time-budget nan`", _plan(SMALL, "--time-budget", "nan")),
        ("`--time-budget inf`", _plan(SMALL, "--time-budget", "inf")),
        ("`--gantt` into a missing directory",
         _plan(SMALL, "--gantt", os.path.join(d, "missing", "g.png"))),
        ("`--gantt` under a file", _plan(SMALL, "--gantt", os.path.join(afile, "g.png"))),
        ("`--out` to an unwritable path (`/proc/no/plan.json`)",
         _plan(SMALL, "--out", "/proc/no/plan.json")),
        ("`--global-batch-size 100000000`",
         _plan(SMALL, "--global-batch-size", "100000000", "--time-budget", "5")),
        ("`--max-virtual-stages 1000000000`",
         _plan(SMALL, "--max-virtual-stages", "1000000000", "--time-budget", "5")),
        ("launch: a profile cache nested 100k deep", None),
        ("launch: `--poseidon-timeout nan`",
         ["-m", "poseidon_plugin.launch", script, "--poseidon-auto", "--poseidon-timeout",
          "nan"]),
        ("launch: `--poseidon-timeout 1e-9`",
         ["-m", "poseidon_plugin.launch", script, "--poseidon-auto", "--poseidon-timeout",
          "1e-9"]),
    ]


def _cache_case(d: str) -> tuple[int, str, float]:
    """What rank 0 does with a profile cache nested 100k deep (in this process)."""
    import io
    import logging

    from poseidon_plugin.megatron.profile import profile_gather

    path = _write(d, "profiles-x.json", '{"version": 1, "records": ' + "[" * 100_000
                  + "]" * 100_000 + "}")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logging.getLogger("poseidon").addHandler(handler)
    t0 = time.perf_counter()
    db = profile_gather.load_cache(path, reprofile=False)
    took = time.perf_counter() - t0
    logging.getLogger("poseidon").removeHandler(handler)
    moved = not os.path.exists(path)
    return 0, (f"warning: {stream.getvalue().strip()} ({len(db)} records, re-profiled; "
               f"moved aside: {moved})"), took


def run(label: str, argv, d: str) -> dict:
    if argv is None:
        rc, line, took = _cache_case(d)
        return dict(input=label, rc=rc, line=line, s=took)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=900)
    took = time.perf_counter() - t0
    err = proc.stderr.strip().splitlines()
    line = err[0] if err else proc.stdout.strip().splitlines()[0]
    return dict(input=label, rc=proc.returncode, line=line, lines=len(err), s=took,
                traceback="Traceback" in proc.stderr)


def _abbreviate(line: str, d: str, width: int = 150) -> str:
    line = line.replace(d + os.sep, "").replace(ROOT + os.sep, "")
    return line if len(line) <= width else line[:width - 1] + "…"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="run the cases whose label contains this")
    args = ap.parse_args()
    from _machine import cpu_model

    rows = []
    with tempfile.TemporaryDirectory() as d:
        for label, argv in cases(d):
            if args.only and args.only not in label:
                continue
            r = run(label, argv, d)
            rows.append(r)
            print(f"{r['s']:7.2f} s  exit {r['rc']}  {label}", file=sys.stderr, flush=True)
        print(f"\nMachine: {cpu_model()}, {os.cpu_count()} cores; Python "
              f"{sys.version.split()[0]}\n")
        print("| bad input | exit | what it gets | s |")
        print("| --- | --- | --- | --- |")
        for r in rows:
            line = _abbreviate(r["line"], d).replace("|", "\\|")
            flags = " (traceback!)" if r.get("traceback") else ""
            print(f"| {r['input']} | {r['rc']} | `{line}`{flags} | {r['s']:.2f} |")


if __name__ == "__main__":
    main()
