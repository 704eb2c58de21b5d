"""Bad input, row by row (issue 12): every hostile or mistyped file and flag ends in one line
``poseidon: error: ...`` (exit 2) or, in launch mode, is handled like a truncated cache, and
does so fast (no hang, no traceback, no multi-gigabyte expansion).

Each test names the row of the issue's table it covers. The fuzz test over mutated files is
``test_fuzz_inputs.py``.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import subprocess
import sys
import time

import pytest
import yaml

from poseidon_plugin import cli
from poseidon_plugin.cluster import (
    MAX_DEVICE_TYPES, MAX_DEVICES, MAX_NODES, cluster_from_dict, load_cluster,
)
from poseidon_plugin.errors import PoseidonError, ProfileDBError, SpecError, short_repr
from poseidon_plugin.model import PRESETS, load_model, model_from_dict
from poseidon_plugin.profile_checks import check_profiles
from poseidon_plugin.profiles import ProfileDB, estimate_profile, profile_key, profile_to_record
from poseidon_plugin.search.options import SearchOptions
from poseidon_plugin.specfile import MAX_SPEC_BYTES, MAX_SPEC_DEPTH, load_yaml_mapping

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = os.path.join(ROOT, "examples/clusters/small-two-type.yaml")
TINY = os.path.join(ROOT, "examples/models/tiny-gpt.yaml")
SMALL_TEXT = open(SMALL, encoding="utf-8").read()
TINY_TEXT = open(TINY, encoding="utf-8").read()
# refusing an oversized input must not expand it first: those failures took minutes and GBs
# (MemoryError); a wide deadline detects them on a loaded host without timing the refusal
FAULT_DEADLINE_S = 30.0

PLAN = ["plan", "--cluster", SMALL, "--model", TINY, "--global-batch-size", "16",
        "--seq-length", "128", "--workers", "1", "--no-baselines"]


def one_line_error(capsys, argv, pattern=None, max_s=60.0):
    """Run ``cli.main(argv)``: exit 2, one line ``poseidon: error: ...``, within ``max_s`` (a
    fault-detection deadline, not a benchmark: CI hosts are loaded)."""
    start = time.perf_counter()
    rc = cli.main(list(argv))
    took = time.perf_counter() - start
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    # poseidon profile's progress lines ("poseidon: profiling 1/2: ...", issue 38 item 10) come
    # before the error when it is met while profiling; they are not part of it
    err = "".join(line for line in err.splitlines(True)
                  if not line.startswith("poseidon: profiling "))
    assert err.startswith("poseidon: error: ") and err.count("\n") == 1, err[:2000]
    assert len(err) < 600, f"a 'one-line' error of {len(err)} characters"
    assert out == ""
    assert took < max_s, f"{took:.1f} s to the error"
    if pattern is not None:
        import re
        assert re.search(pattern, err), f"{pattern!r} not in {err!r}"
    return err


def write(tmp_path, name, text):
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return str(path)


def spec_error(load, path) -> SpecError:
    with pytest.raises(SpecError) as info:
        load(path)
    return info.value


# ------------------------------------------------------------------ YAML: depth, aliases, size

@pytest.mark.parametrize("body", ["[" * 100_000 + "]" * 100_000,
                                  "{a: " * 100_000 + "1" + "}" * 100_000])
def test_yaml_nested_100k_deep_is_refused_without_recursion(tmp_path, body):
    """Row 'cluster YAML nested 100k-200k deep': was a RecursionError traceback."""
    path = write(tmp_path, "deep.yaml", SMALL_TEXT.replace("name: small-two-type",
                                                           "name: " + body))
    start = time.perf_counter()
    err = spec_error(load_cluster, path)
    assert time.perf_counter() - start < FAULT_DEADLINE_S
    assert err.field == "line 4"
    assert f"nested at most {MAX_SPEC_DEPTH} deep" in err.expected


def test_block_style_nesting_is_bounded_too(tmp_path):
    text = "".join(" " * i + "a:\n" for i in range(200)) + " " * 200 + "b: 1\n"
    err = spec_error(lambda p: load_yaml_mapping(p, "model"), write(tmp_path, "m.yaml", text))
    assert "nested at most" in err.expected


def _alias_bomb(levels=9) -> str:
    """A flow list whose last entry expands to 9**levels strings (a 'billion laughs')."""
    parts = ["&a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, levels):
        parts.append(f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    return "[" + ", ".join(parts) + "]"


def test_yaml_alias_bomb_is_refused_before_expansion(tmp_path):
    """Row '962-byte YAML alias bomb in a cluster name': was 3.4 GB then MemoryError."""
    bomb = _alias_bomb()
    path = write(tmp_path, "bomb.yaml", SMALL_TEXT.replace("name: small-two-type",
                                                           "name: " + bomb))
    assert len(bomb) < 1000
    start = time.perf_counter()
    err = spec_error(load_cluster, path)
    assert time.perf_counter() - start < FAULT_DEADLINE_S
    assert "aliases expanded" in err.expected and "alias bomb" in str(err)
    assert len(str(err)) < 300


def test_a_smaller_alias_expansion_gives_a_short_error(tmp_path):
    """Row '... a smaller one gives a 53 KB one-line error': the value is cut in the message."""
    text = SMALL_TEXT.replace("name: small-two-type", "name: " + _alias_bomb(5))
    err = spec_error(load_cluster, write(tmp_path, "b.yaml", text))
    assert err.field == "name" and len(str(err)) < 400, str(err)


def test_recursive_alias_is_refused(tmp_path):
    err = spec_error(load_cluster, write(tmp_path, "r.yaml", "name: &n [1, *n]\n"))
    assert "recursive alias" in str(err)


def test_merge_keys_still_work(tmp_path):
    text = SMALL_TEXT.replace(
        "  fast: {memory_gib: 16, peak_tflops: 200, efficiency: 0.5, intra_node_gbps: 800}",
        "  fast: &f {memory_gib: 16, peak_tflops: 200, efficiency: 0.5, intra_node_gbps: 800}"
    ).replace("  slow: {memory_gib: 8, peak_tflops: 100, efficiency: 0.5, intra_node_gbps: 400}",
              "  slow: {<<: *f, memory_gib: 8, peak_tflops: 100, intra_node_gbps: 400}")
    assert text != SMALL_TEXT
    cluster = load_cluster(write(tmp_path, "m.yaml", text))
    assert cluster.device_types["slow"].memory_gib == 8
    assert cluster.device_types["slow"].efficiency == 0.5


def test_50_mb_cluster_file_is_refused_at_once(tmp_path, capsys):
    """Row 'a 50 MB cluster YAML with --time-budget 30': was 198 s."""
    path = tmp_path / "huge.yaml"
    with open(path, "w", encoding="utf-8") as f:
        f.write(SMALL_TEXT)
        f.write("# " + "x" * (50 << 20) + "\n")
    err = one_line_error(capsys, [*PLAN[:2], str(path), *PLAN[3:], "--time-budget", "600"],
                         r"expected a cluster YAML file of at most 2 MiB, got '50\.0 MiB'",
                         max_s=FAULT_DEADLINE_S)
    assert str(MAX_SPEC_BYTES >> 20) + " MiB" in err


def test_a_file_just_under_the_size_limit_loads(tmp_path):
    pad = "# " + "x" * (MAX_SPEC_BYTES - len(SMALL_TEXT) - 10) + "\n"
    cluster = load_cluster(write(tmp_path, "c.yaml", SMALL_TEXT + pad))
    assert cluster.total_devices == 16


def test_endless_input_is_bounded(tmp_path):
    """A character device (no size, endless) is refused by its kind before it is read (issue
    31 row 6: an input must be a regular file)."""
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero")
    err = spec_error(load_cluster, "/dev/zero")
    assert err.expected == "a readable cluster YAML file (a regular file)"
    assert err.got == "a character device"


def test_non_utf8_yaml_names_the_line(tmp_path, capsys):
    """Row 'non-UTF-8 YAML': was a UnicodeDecodeError traceback."""
    raw = SMALL_TEXT.encode().replace(b"name: small-two-type", b"name: caf\xe9")
    path = write(tmp_path, "latin1.yaml", raw)
    one_line_error(capsys, [*PLAN[:2], path, *PLAN[3:]],
                   r"latin1\.yaml: line 4: expected UTF-8 text, got 'byte 0xe9'")
    model = write(tmp_path, "m.yaml", b"\xff\xfe" + TINY_TEXT.encode("utf-16-le"))
    assert "UTF-8" in spec_error(load_model, model).expected


def test_utf8_bom_is_accepted(tmp_path):
    cluster = load_cluster(write(tmp_path, "bom.yaml", "\ufeff" + SMALL_TEXT))
    assert cluster.name == "small-two-type"


@pytest.mark.parametrize("text, phrase", [
    ("a: !!python/object:os.system x\n", "could not determine a constructor"),
    ("a: 2001-13-45\n", "month must be in 1..12"),
    ("a: " + "9" * 5000 + "\n", "(4300"),
    ("a: \x01\n", "control characters"),
])
def test_odd_yaml_scalars_are_one_line_errors(tmp_path, text, phrase):
    err = spec_error(lambda p: load_yaml_mapping(p, "model"), write(tmp_path, "o.yaml", text))
    assert "valid YAML" in err.expected and phrase in str(err), str(err)


# ------------------------------------------------------------------ duplicate keys and types

def test_device_type_declared_twice_is_refused(tmp_path, capsys):
    """Row 'a device type declared twice in device_types': the second silently won."""
    text = SMALL_TEXT.replace(
        "  slow: {memory_gib: 8,",
        "  fast: {memory_gib: 80, peak_tflops: 900, intra_node_gbps: 900}\n"
        "  slow: {memory_gib: 8,")
    path = write(tmp_path, "twice.yaml", text)
    one_line_error(capsys, [*PLAN[:2], path, *PLAN[3:]],
                   r"twice\.yaml: line 7: expected unique keys in a mapping, got "
                   r"\"duplicate key 'fast'\"")


def test_duplicate_keys_in_a_model_file_are_refused(tmp_path):
    err = spec_error(load_model, write(tmp_path, "m.yaml", TINY_TEXT + "num_layers: 80\n"))
    assert err.expected == "unique keys in a mapping" and "num_layers" in str(err.got)


def test_too_many_device_types(tmp_path):
    data = yaml.safe_load(SMALL_TEXT)
    for i in range(MAX_DEVICE_TYPES):
        data["device_types"][f"t{i}"] = dict(data["device_types"]["fast"])
    with pytest.raises(SpecError, match=f"at most {MAX_DEVICE_TYPES} device types"):
        cluster_from_dict(data)


# ------------------------------------------------------------------ sizes and numbers

def _cluster(**changes):
    data = yaml.safe_load(SMALL_TEXT)
    for path, value in changes.items():
        node = data
        *head, last = path.split("__")
        for part in head:
            node = node[int(part)] if isinstance(node, list) else node[part]
        node[last] = value
    return data


@pytest.mark.parametrize("changes, field, phrase", [
    ({"nodes__0__count": 100_000_000}, "nodes[0].count", f"<= {MAX_NODES}"),
    ({"nodes__0__devices_per_node": 10**12}, "nodes[0].devices_per_node", "<= 4096"),
    ({"nodes__0__count": 100_000, "nodes__0__devices_per_node": 4096}, "nodes[0]",
     f"at most {MAX_DEVICES} devices"),
    ({"nodes__0__count": MAX_NODES, "nodes__1__count": 1}, "nodes[1].count",
     f"at most {MAX_NODES} nodes"),
    ({"device_types__fast__memory_gib": 1e300}, "device_types.fast.memory_gib", "<= 65536"),
    ({"device_types__fast__memory_gib": "1e300"}, "device_types.fast.memory_gib", "<= 65536"),
    ({"device_types__fast__memory_gib": float("nan")}, "device_types.fast.memory_gib", "finite"),
    ({"device_types__fast__peak_tflops": 1e-300}, "device_types.fast.peak_tflops", ">= 1e-06"),
    ({"device_types__fast__peak_tflops": 1e300}, "device_types.fast.peak_tflops", "<= 1e+06"),
    ({"device_types__slow__intra_node_gbps": float("inf")},
     "device_types.slow.intra_node_gbps", "finite"),
    ({"links__cross_type_gbps": 1e-30}, "links.cross_type_gbps", ">= 1e-06"),
    ({"links__inter_node_gbps__fast": 1e30}, "links.inter_node_gbps.fast", "<= 1e+09"),
    ({"links__latency_ms": 1e300}, "links.latency_ms", "<= 100000"),
    ({"name": "x" * 10_000}, "name", "at most 200 characters"),
])
def test_cluster_sizes_and_numbers_are_bounded(changes, field, phrase):
    """Row 'count: 100000000 nodes; devices_per_node: 1e12; memory_gib: 1e300': were
    MemoryError at 7.7 GB / MemoryError / OverflowError tracebacks."""
    start = time.perf_counter()
    with pytest.raises(SpecError) as info:
        cluster_from_dict(_cluster(**changes), source="c.yaml")
    assert time.perf_counter() - start < FAULT_DEADLINE_S
    assert info.value.field == field
    assert phrase in info.value.expected
    assert len(str(info.value)) < 300


def test_largest_allowed_cluster_loads_fast():
    start = time.perf_counter()
    c = cluster_from_dict(_cluster(nodes__0__count=MAX_NODES // 2,
                                   nodes__1__count=MAX_NODES // 2,
                                   nodes__0__devices_per_node=8, nodes__1__devices_per_node=8))
    assert c.total_devices == MAX_DEVICES
    assert time.perf_counter() - start < FAULT_DEADLINE_S


@pytest.mark.parametrize("field, value, phrase", [
    ("num_layers", 10**9, "<= 4096"),
    ("hidden_size", 2**40, "<= 1048576"),
    ("vocab_size", 10**30, "<= 16777216"),
    ("seq_length", 10**12, "<= 16777216"),
    ("name", "n" * 5000, "at most 200 characters"),
])
def test_model_sizes_are_bounded(field, value, phrase):
    data = yaml.safe_load(TINY_TEXT)
    data[field] = value
    with pytest.raises(SpecError) as info:
        model_from_dict(data, source="m.yaml")
    assert info.value.field == field and phrase in info.value.expected


def test_presets_are_inside_the_model_limits():
    for spec in PRESETS.values():
        model_from_dict({f: getattr(spec, f) for f in spec.__dataclass_fields__})


def test_short_repr_bounds_any_value():
    nested: list = []
    nested.append(nested)
    assert len(short_repr("x" * 10**6)) < 120
    assert len(short_repr(list(range(10**5)))) < 120
    assert short_repr(nested)            # no RecursionError
    assert short_repr(1e300) == "1e+300"


# ------------------------------------------------------------------ profile DB

def _db_payload(**patch):
    """A valid profile DB (measured records for tiny-gpt on the small cluster, at the
    estimator's times) with ``patch`` applied to every record."""
    cluster = load_cluster(SMALL)
    model = load_model(TINY)
    records = []
    for device in ("fast", "slow"):
        for kind in ("decoder", "embedding", "output"):
            p = estimate_profile(cluster, model, profile_key(model, device, kind, 1, 1, 128))
            rec = profile_to_record(p)
            rec["source"] = "measured"
            rec.update(patch)
            records.append(rec)
    return {"version": 1, "records": records}


def _db(tmp_path, payload, name="db.json"):
    text = payload if isinstance(payload, str) else json.dumps(payload)
    return write(tmp_path, name, text)


@pytest.mark.parametrize("patch, pattern", [
    ({"forward_ms": 0, "backward_ms": 0},
     r"records\[0\]\.forward_ms: expected a time > 0 and <= 3\.6e\+06 ms"),
    ({"forward_ms": 1e300}, r"records\[0\]\.forward_ms: expected a time > 0 .*got 1e\+300"),
    ({"backward_ms": float("nan")}, r"records\[0\]\.backward_ms: expected a number >= 0"),
    ({"activation_bytes": 1e30}, r"records\[0\]\.activation_bytes: expected an integer"),
    ({"activation_bytes": 10**30}, r"records\[0\]\.activation_bytes: expected at most "),
    ({"tp": 10**20}, r"records\[0\]\.tp: expected an integer <= 16777216"),
])
def test_profile_records_are_validated_on_load(tmp_path, capsys, patch, pattern):
    """Rows 'profile DB whose times are all 0' (was: no output in 600 s, MFU 66789.8 %, then
    ZeroDivisionError), 'profile times of 1e300' (was: 300-digit time, 0 tokens/s),
    'activation_bytes 1e30' (was: silently accepted)."""
    path = _db(tmp_path, _db_payload(**patch))
    one_line_error(capsys, [*PLAN, "--profiles", path, "--time-budget", "600"], pattern,
                   max_s=FAULT_DEADLINE_S)


def test_profile_faster_than_the_peak_is_refused(tmp_path, capsys):
    """A measured layer that would beat the device's peak (an MFU above 100 %)."""
    payload = _db_payload()
    for rec in payload["records"]:
        rec["forward_ms"] = rec["forward_ms"] * 1e-6
    path = _db(tmp_path, payload)
    one_line_error(capsys, [*PLAN, "--profiles", path],
                   r"db\.json: record \(fast, decoder, tp=1, micro-batch 1, seq 128\): "
                   r"forward_ms \S+ implies \S+ TFLOP/s per device, above fast's peak_tflops "
                   r"\(200\)")


def test_plausible_profiles_pass_and_give_a_sane_plan(tmp_path, capsys):
    path = _db(tmp_path, _db_payload())
    rc = cli.main([*PLAN, "--profiles", path, "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    plan = json.loads(out)
    assert 0 < plan["mfu"] <= 1 and plan["predicted_tokens_per_s"] > 0


def test_check_profiles_ignores_other_models_and_estimates():
    cluster = load_cluster(SMALL)
    model = load_model(TINY)
    db = ProfileDB.from_json(json.dumps(_db_payload(forward_ms=1e-9, source="estimated")))
    check_profiles(db, cluster, model)                       # estimated: not used by the search
    db = ProfileDB.from_json(json.dumps(_db_payload(forward_ms=1e-9, model_signature="other")))
    check_profiles(db, cluster, model)                       # another model's records
    db = ProfileDB.from_json(json.dumps(_db_payload(forward_ms=1e-9)))
    with pytest.raises(ProfileDBError, match="above fast's peak_tflops"):
        check_profiles(db, cluster, model)


def test_profile_db_nested_100k_deep(tmp_path, capsys):
    """Row 'profile DB nested 100k-200k deep': was a RecursionError traceback."""
    path = _db(tmp_path, '{"version": 1, "records": ' + "[" * 100_000 + "]" * 100_000 + "}")
    one_line_error(capsys, [*PLAN, "--profiles", path], r"db\.json: .*nested too deeply",
                   max_s=FAULT_DEADLINE_S)


@pytest.mark.parametrize("text, pattern", [
    ('{"version": 1, "version": 1, "records": []}',
     r"expected unique keys in a JSON object, got duplicate key 'version'"),
    ('{"version": 1, "records": [], "x": ' + "9" * 5000 + "}", r"not valid JSON \("),
])
def test_profile_db_duplicate_keys_and_huge_ints(tmp_path, text, pattern):
    with pytest.raises(ProfileDBError, match=pattern):
        ProfileDB.load(_db(tmp_path, text))


def test_profile_db_size_is_bounded(tmp_path, monkeypatch):
    from poseidon_plugin import profiles

    monkeypatch.setattr(profiles, "MAX_DB_BYTES", 1000)
    path = _db(tmp_path, json.dumps(_db_payload()))
    with pytest.raises(ProfileDBError, match="expected a profile DB of at most 0 MiB"):
        ProfileDB.load(path)


# ------------------------------------------------------------------ flags

@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0", "-1", "1e-400"])
def test_time_budget_must_be_finite_and_positive(capsys, value):
    """Row '--time-budget nan / inf': was accepted."""
    one_line_error(capsys, [*PLAN, f"--time-budget={value}"],
                   r"argument --time-budget: expected a finite number of seconds > 0")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0, -3.0])
def test_search_options_refuse_non_finite_budgets(value):
    with pytest.raises(PoseidonError, match="time budget"):
        SearchOptions(global_batch_size=16, seq_length=128, time_budget_s=value)


@pytest.mark.parametrize("field, value, phrase", [
    ("global_batch_size", 100_000_000, "expected an integer <= 131072"),
    ("seq_length", 10**12, "expected an integer <= 16777216"),
    ("max_virtual_stages", 10**9, "expected an integer <= 4096"),
    ("warmup_samples", 10**12, r"expected an integer in \[0, 1000000\]"),
])
def test_search_sizes_are_bounded(field, value, phrase):
    """--global-batch-size 1e8 ran 7 min; --max-virtual-stages 1e9 ignored the time budget;
    --warmup-samples 1e12 samples for days without a budget."""
    kwargs = dict(global_batch_size=16, seq_length=128)
    kwargs[field] = value
    with pytest.raises(PoseidonError, match=phrase):
        SearchOptions(**kwargs)


def forbid(monkeypatch, module, name: str, what: str) -> None:
    """``module.name`` must not run (the arguments are checked before it): a call fails the
    test, naming ``what`` ran too early."""
    def boom(*args, **kwargs):
        raise AssertionError(f"{what} ran before its inputs were checked")

    monkeypatch.setattr(module, name, boom)


@pytest.fixture
def no_search(monkeypatch):
    """The search must not start: any call fails the test."""
    import poseidon_plugin.search as search

    forbid(monkeypatch, search, "search_plan", "the search")


@pytest.mark.parametrize("flag", ["--gantt", "--out"])
def test_output_path_in_a_missing_directory(tmp_path, capsys, no_search, flag):
    """Row '--gantt to a missing directory' (was FileNotFoundError) and '--out to an
    unwritable path' (was reported only after the whole search)."""
    path = str(tmp_path / "missing" / "x.png")
    one_line_error(capsys, [*PLAN, flag, path],
                   rf"{flag} \S+x\.png: cannot write \(no such directory: ")


@pytest.mark.parametrize("flag", ["--gantt", "--out"])
def test_output_path_under_a_file(tmp_path, capsys, no_search, flag):
    """Row '--gantt ... under a file': was FileExistsError."""
    afile = write(tmp_path, "afile", "x")
    one_line_error(capsys, [*PLAN, flag, os.path.join(afile, "x.svg")],
                   rf"{flag} \S+: cannot write \(not a directory: ")


def test_output_path_is_a_directory(tmp_path, capsys, no_search):
    one_line_error(capsys, [*PLAN, "--out", str(tmp_path)], r"cannot write \(is a directory\)")


def test_gantt_extension_checked_before_the_search(tmp_path, capsys, no_search):
    one_line_error(capsys, [*PLAN, "--gantt", str(tmp_path / "x.pdf")],
                   r"--gantt \S+x\.pdf: expected a file name ending in \.png or \.svg")


def test_writable_out_is_untouched_on_error(tmp_path, capsys):
    out = tmp_path / "plan.json"
    out.write_text("old")
    one_line_error(capsys, [*PLAN, "--out", str(out), "--time-budget", "nan"])
    assert out.read_text() == "old"


# ------------------------------------------------------------------ launch mode

def test_launch_profile_cache_nested_100k_deep_is_moved_aside(tmp_path, caplog):
    """Row 'launch: a profile cache nested 100k deep': was a RecursionError on rank 0 on every
    relaunch; now handled like a truncated cache (moved aside, warning, re-profiled)."""
    from poseidon_plugin.megatron.profile import profile_gather

    cache = tmp_path / "profiles-x.json"
    cache.write_text('{"version": 1, "records": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with caplog.at_level(logging.WARNING, logger="poseidon"):
        db = profile_gather.load_cache(str(cache), reprofile=False)
    assert len(db) == 0
    assert not cache.exists()
    assert len(list(tmp_path.glob("profiles-x.json.corrupt-*"))) == 1
    assert "profile cache is unreadable, re-profiling" in caplog.text
    assert "nested too deeply" in caplog.text


@pytest.mark.parametrize("payload", [
    {"version": 1, "records": [{"forward_ms": 0}]},
    '{"version": 1, "version": 1, "records": []}',
])
def test_launch_other_bad_caches_are_moved_aside(tmp_path, payload):
    from poseidon_plugin.megatron.profile import profile_gather

    cache = tmp_path / "c.json"
    cache.write_text(payload if isinstance(payload, str) else json.dumps(payload))
    assert len(profile_gather.load_cache(str(cache), reprofile=False)) == 0
    assert not cache.exists()


@pytest.mark.parametrize("value, phrase", [
    ("nan", "expected a number > 0 and finite"),
    ("inf", "expected a number > 0 and finite"),
    ("1e-9", r"expected a number of seconds in \[1, 604800\]"),
    ("1e300", r"expected a number of seconds in \[1, 604800\]"),
])
def test_launch_timeout_is_validated(value, phrase):
    """Row 'launch: --poseidon-timeout nan / 1e-9': was a ValueError traceback on every rank /
    a 242-line DistNetworkError."""
    from poseidon_plugin.megatron.launch.options import extract_options

    with pytest.raises(PoseidonError, match=phrase):
        extract_options(["--poseidon-auto", "--poseidon-timeout", value])
    with pytest.raises(PoseidonError, match=phrase):
        extract_options(["--poseidon-auto", f"--poseidon-timeout={value}"])


def test_launch_time_budget_must_be_finite_and_profile_iters_bounded():
    from poseidon_plugin.megatron.launch.options import extract_options

    with pytest.raises(PoseidonError, match="finite"):
        extract_options(["--poseidon-auto", "--poseidon-time-budget", "nan"])
    with pytest.raises(PoseidonError, match="expected an integer <= 1000"):
        extract_options(["--poseidon-auto", "--poseidon-profile-iters", "1000000000"])


def test_launch_bad_timeout_is_one_line_on_stderr(tmp_path):
    """Through the launcher, before torch or any rendezvous: one line, exit 2."""
    script = write(tmp_path, "train.py", "raise SystemExit('the script must not run')\n")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "poseidon_plugin.launch", script,
                           "--poseidon-auto", "--poseidon-timeout", "nan"],
                          capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "--poseidon-timeout: expected a number > 0 and finite, got 'nan'" in proc.stderr


def test_examples_still_load():
    for name in sorted(os.listdir(os.path.join(ROOT, "examples/clusters"))):
        load_cluster(os.path.join(ROOT, "examples/clusters", name))
    copy.deepcopy(load_model(TINY))


@pytest.mark.parametrize("loader", ["emulation", "overrides"])
def test_launch_yaml_files_use_the_bounded_loader(tmp_path, loader):
    """--poseidon-emulate and --poseidon-cluster files: same limits as a cluster file."""
    from poseidon_plugin.megatron.launch.discovery import load_overrides
    from poseidon_plugin.megatron.emulate.emulation import load_emulation

    load = load_emulation if loader == "emulation" else load_overrides
    deep = write(tmp_path, "deep.yaml", "name: " + "[" * 100_000 + "]" * 100_000 + "\n")
    assert "nested at most" in spec_error(load, deep).expected
    bomb = write(tmp_path, "bomb.yaml", "name: " + _alias_bomb() + "\n")
    assert "aliases expanded" in spec_error(load, bomb).expected
    dup = write(tmp_path, "dup.yaml", "name: a\nname: b\n")
    assert "unique keys" in spec_error(load, dup).expected


# ------------------------------------------------------------------ command-line arguments (issue 31)

PROFILE = ["profile", "-o", "db.json", "--model", TINY, "--device-type", "cpu", "--device", "cpu"]


@pytest.fixture
def no_profiling(monkeypatch):
    """The profiler must not start: any call fails the test."""
    from poseidon_plugin.megatron.profile import offline

    forbid(monkeypatch, offline, "profile_layers", "the profiler")


@pytest.mark.parametrize("extra, pattern", [
    (["--seq-length", "99999999999"], r"--seq-length: expected integers <= 16777216"),
    (["--seq-length", "128", "--iters", "1000000000000"], r"--iters: expected integers <= 1000"),
    (["--seq-length", "128", "--micro-batch-sizes", "1000000000"],
     r"--micro-batch-sizes: expected integers <= 131072"),
    (["--seq-length", "128", "--iters", "1000", "--micro-batch-sizes", *map(str, range(1, 12))],
     r"--iters 1000 x 11 configurations .* = 11000 timed repetitions; expected at most 10000"),
])
def test_profile_sizes_are_bounded_up_front(tmp_path, capsys, no_profiling, extra, pattern):
    """Row 13: `poseidon profile --seq-length 99999999999` was a traceback at 802 MB after 15 s,
    `--iters 1e12` ran for ever: refused before the model is built."""
    argv = [*PROFILE, *extra]
    argv[2] = str(tmp_path / "db.json")
    one_line_error(capsys, argv, pattern)


def test_plan_and_profile_share_the_sequence_bound(tmp_path, capsys, no_search, no_profiling):
    from poseidon_plugin.search.options import MAX_SEQ_LENGTH

    too_long = str(MAX_SEQ_LENGTH + 1)
    plan = [*PLAN]
    plan[plan.index("--seq-length") + 1] = too_long
    one_line_error(capsys, plan, rf"expected an integer <= {MAX_SEQ_LENGTH}\b")
    one_line_error(capsys, [*PROFILE[:2], str(tmp_path / "db.json"), *PROFILE[3:],
                            "--seq-length", too_long], rf"expected integers <= {MAX_SEQ_LENGTH}\b")


@pytest.fixture
def no_validate_run(monkeypatch):
    """`poseidon validate` must not start a measured run: any call fails the test."""
    from poseidon_plugin.fidelity import harness

    forbid(monkeypatch, harness, "run_cases", "validate's measured runs")


@pytest.mark.parametrize("args, pattern", [
    (["--layer-ms", "nan", "nan"], r"--layer-ms: expected milliseconds > 0 and <= 1000, got 'nan'"),
    (["--layer-ms", "-1", "1e300"], r"--layer-ms: expected milliseconds > 0 .* got '-1'"),
    (["--layer-ms", "4", "1e300"], r"--layer-ms: expected milliseconds > 0 .* got '1e300'"),
    (["--layer-ms", "inf", "8"], r"--layer-ms: .* got 'inf'"),
    (["--iterations", "1000000000"], r"--iterations: expected an integer in \[1, 1000\]"),
    (["--iterations", "0"], r"--iterations: expected an integer in \[1, 1000\]"),
    (["--discard", "-1"], r"--discard: expected an integer >= 0 and below --iterations"),
    (["--iterations", "5", "--discard", "5"], r"--discard: .* below --iterations \(5\), got 5"),
    (["--json", "{tmp}"], r"--json \S+: cannot write \(is a directory\)"),
    (["--json", "{tmp}/missing/x.json"], r"--json \S+: cannot write \(no such directory"),
    (["--profile-db", "{tmp}"], r"--profile-db \S+: cannot write \(is a directory\)"),
    (["--gantt", "{tmp}/x.txt"], r"--gantt \S+x\.txt: expected a file name ending in \.png or \.svg"),
    (["--gantt", "{tmp}/missing/x.png"], r"--gantt \S+: cannot write \(no such directory"),
])
def test_validate_arguments_are_checked_before_any_run(tmp_path, capsys, no_validate_run, args,
                                                       pattern):
    """Row 14 (and 15's `--gantt x.txt`): `--layer-ms nan nan` printed a table of meaningless
    numbers (exit 0), `-1 1e300` was an OverflowError, `--json DIR` an IsADirectoryError after
    every run, `--iterations 1e9` had no bound, `--gantt x.txt` was refused after the runs."""
    argv = ["validate", "--cases", "pp2-1f1b-m4", *[a.replace("{tmp}", str(tmp_path))
                                                    for a in args]]
    one_line_error(capsys, argv, pattern)


@pytest.mark.parametrize("flag, value, pattern", [
    ("--poseidon-pruning", "bogus", r"--poseidon-pruning: expected one of safe, ridge, none, "
                                    r"got 'bogus'"),
    ("--poseidon-schedules", "1f1b,gpipe", r"--poseidon-schedules: Megatron can run .* got gpipe"),
    ("--poseidon-schedules", "nonsense", r"--poseidon-schedules: .* got nonsense"),
    ("--poseidon-schedules", ",", r"--poseidon-schedules: expected at least one schedule"),
])
def test_launch_search_flags_are_refused_as_the_launch_starts(flag, value, pattern):
    """Row 15: a bad --poseidon-pruning / --poseidon-schedules was refused only after the
    discovery and the profiling (where the search options are built)."""
    from poseidon_plugin.megatron.launch.options import extract_options

    with pytest.raises(PoseidonError, match=pattern):
        extract_options(["--poseidon-auto", flag, value])
    with pytest.raises(PoseidonError, match=pattern):
        extract_options(["--poseidon-auto", f"{flag}={value}"])
    extract_options(["--poseidon-auto", "--poseidon-pruning", "ridge", "--poseidon-schedules",
                     "1f1b,interleaved-1f1b"])   # good values pass


LAUNCH_ENV = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}


def test_launch_save_plan_path_is_checked_at_the_start(tmp_path):
    """--poseidon-save-plan to a directory was an IsADirectoryError after the search."""
    script = write(tmp_path, "train.py", "raise SystemExit('the script must not run')\n")
    env = dict(os.environ, **LAUNCH_ENV,
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "poseidon_plugin.launch", script,
                           "--poseidon-auto", "--poseidon-save-plan", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"--poseidon-save-plan {tmp_path}: cannot write (is a directory)" in proc.stderr


@pytest.mark.parametrize("field, value, pattern", [
    ("seq_length", 99_999_999_999, r"seq_length: expected an integer <= 16777216"),
    ("global_batch_size", 10**9, r"--global-batch-size / global_batch_size\): expected an "
                                 r"integer <= 131072"),
])
def test_launch_sequence_and_batch_are_bounded_before_discovery(monkeypatch, field, value,
                                                                pattern):
    """Row 13 for the launch: the script's --global-batch-size (and every search option) is
    bounded as `poseidon plan` bounds it when the model is read (before the rendezvous, the
    discovery and the profiling), not when the search starts; --seq-length by the model's
    bound (the same MAX_SEQ_LENGTH)."""
    from argparse import Namespace

    from poseidon_plugin.megatron import framework_state
    from poseidon_plugin.megatron.launch import bootstrap, runner
    from poseidon_plugin.megatron.profile import profiler
    from poseidon_plugin.megatron.launch.options import extract_options

    args = Namespace(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=128,
                     vocab_size=128, global_batch_size=16, micro_batch_size=1)
    setattr(args, field, value)
    monkeypatch.setattr(runner, "require_megatron", lambda *a, **k: None)
    monkeypatch.setattr(profiler, "parse_megatron_args", lambda script, argv: args)
    monkeypatch.setattr(framework_state, "hold", lambda a: None)
    opts, rest = extract_options(["--poseidon-auto"])
    env = bootstrap.LaunchEnv.from_environ(LAUNCH_ENV)
    ctx = runner.LaunchContext("train.py", rest, opts, env, 0.0)
    ctx.backend = "megatron"   # set by _all_ranks_setup_device, which this test skips
    with pytest.raises(PoseidonError, match=pattern):
        runner._all_ranks_read_model(ctx)
    setattr(args, field, 128 if field == "seq_length" else 16)
    runner._all_ranks_read_model(ctx)   # sane values pass
    assert ctx.seq_length == 128 and ctx.global_batch_size == 16


@pytest.mark.parametrize("text, field", [
    (SMALL_TEXT.replace("latency_ms: 0.01", "latency_ms: 1:30"), "links.latency_ms"),
    (SMALL_TEXT.replace("memory_gib: 16,", "memory_gib: 1:30,"), "device_types.fast.memory_gib"),
    (SMALL_TEXT.replace("cross_type_gbps: 50", "cross_type_gbps: 1:30.5"),
     "links.cross_type_gbps"),
])
def test_sexagesimal_cluster_numbers_are_refused(tmp_path, text, field):
    """`latency_ms: 1:30` read as 90 ms (YAML 1.1 base-60 ints): now the string '1:30', which
    the field check refuses by name."""
    err = spec_error(load_cluster, write(tmp_path, "c.yaml", text))
    assert err.field == field and "1:30" in str(err), str(err)


def test_sexagesimal_model_numbers_are_refused(tmp_path):
    text = TINY_TEXT.replace("num_layers: 8", "num_layers: 1:30")
    err = spec_error(load_model, write(tmp_path, "m.yaml", text))
    assert err.field == "num_layers" and "'1:30'" in str(err)
    assert load_yaml_mapping(write(tmp_path, "t.yaml", "a: 12\nb: 0.5\nc: 1_000\n"),
                             "model") == {"a": 12, "b": 0.5, "c": 1000}


def test_gantt_microbatches_are_bounded():
    """--gantt on global batch 131,072 drew for 50 s and 753 MB outside --time-budget: the
    chart draws at most MAX_GANTT_BOXES boxes (fewer micro-batches, a multiple of PP)."""
    assert cli.gantt_microbatches(4, 1, 64) == 64
    for pp, v, m in ((8, 1, 131072), (63, 2, 4096), (4, 2, 1 << 20)):
        k = cli.gantt_microbatches(pp, v, m)
        assert 0 < k < m and k % pp == 0
        assert 2 * pp * v * k <= cli.MAX_GANTT_BOXES < 2 * pp * v * (k + pp)
    assert cli.gantt_microbatches(1000, 1, 100_000) == 0


def test_gantt_of_a_huge_batch_is_drawn_downsampled(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(cli, "MAX_GANTT_BOXES", 16)
    path, out = str(tmp_path / "g.svg"), str(tmp_path / "plan.json")
    argv = [*PLAN, "--gantt", path, "--out", out]
    argv[argv.index("--global-batch-size") + 1] = "256"
    assert cli.main(argv) == 0
    _, err = capsys.readouterr()
    plan = json.load(open(out, encoding="utf-8"))
    pp, v, m = plan["pp"], plan["virtual_stages"], plan["num_microbatches"]
    drawn = cli.gantt_microbatches(pp, v, m)
    assert 0 < drawn < m, (pp, v, m)
    assert (f"poseidon: note: --gantt {path}: drawn as a pipeline of {drawn} micro-batches, "
            f"not the plan's {m}") in err, err
    assert f"M={drawn} (the plan's M={m})" in open(path, encoding="utf-8").read()


# ------------------------------------------------------------------ issue 31

def _types_cluster(tmp_path, n: int) -> str:
    """The small cluster with ``n`` device types, one node of 4 devices each."""
    data = yaml.safe_load(SMALL_TEXT)
    fast = data["device_types"]["fast"]
    data["device_types"] = {f"t{i}": dict(fast, peak_tflops=100 + i) for i in range(n)}
    data["nodes"] = [{"device_type": f"t{i}", "devices_per_node": 4, "count": 1}
                     for i in range(n)]
    data["links"]["inter_node_gbps"] = {f"t{i}": 100 for i in range(n)}
    return write(tmp_path, f"types{n}.yaml", yaml.safe_dump(data))


def test_seventeen_device_types_are_refused_at_load(tmp_path, capsys, no_search):
    """Issue 31 row 1: 17-32 device types loaded, then the search's root core raised
    'root_core: expected 1 to 16 device types' (a traceback)."""
    assert MAX_DEVICE_TYPES == 16
    path = _types_cluster(tmp_path, MAX_DEVICE_TYPES + 1)
    one_line_error(capsys, [*PLAN[:2], path, *PLAN[3:]],
                   r"types17\.yaml: device_types: expected at most 16 device types, got "
                   r"'17 types'")
    assert len(load_cluster(_types_cluster(tmp_path, MAX_DEVICE_TYPES)).type_names) == 16


def test_the_search_core_holds_the_cluster_limit_of_device_types():
    """The loader's limit is the typed search core's (``MAXT``): one more type is refused there."""
    from poseidon_plugin.search import _roots

    one = (1.0, 1, 4, ((1.0, 1),))
    with pytest.raises(ValueError, match="device types"):
        _roots.root_core([one] * (MAX_DEVICE_TYPES + 1), 2, 4, 1, 4, 0.0, 0.0, 0.0)
    _roots.root_core([one] * MAX_DEVICE_TYPES, 2, 4, 1, 4, 0.0, 0.0, 0.0)


def _saved_plan(tmp_path, capsys) -> dict:
    out = tmp_path / "plan.json"
    assert cli.main([*PLAN, "--out", str(out)]) == 0
    capsys.readouterr()
    return json.loads(out.read_text())


def _patched(plan: dict, path: str, value) -> dict:
    plan = copy.deepcopy(plan)
    node = plan
    *head, last = path.split(".")
    for part in head:
        node = node[int(part)] if isinstance(node, list) else node[part]
    node[int(last) if isinstance(node, list) else last] = value
    return plan


@pytest.mark.parametrize("path, value, pattern", [
    ("stages.0.provenance", [], r"stages\[0\]\.provenance: expected an object, got \[\]"),
    ("stages.0.memory", "x", r"stages\[0\]\.memory: expected an object, got 'x'"),
    ("stages.0.layers", None, r"stages\[0\]\.layers: expected an integer >= 0, got None"),
    ("stages.1.devices", [[{"node": "0"}]],
     r"stages\[1\]\.devices\[0\]\[0\]\.node: expected an integer >= 0, got '0'"),
    ("stages", [], r"stages: expected at least one stage, got \[\]"),
    ("dp", 2.5, r"dp: expected an integer >= 1, got 2\.5"),
    ("stages.0.forward_ms", float("nan"),
     r"stages\[0\]\.forward_ms: expected a finite number >= 0"),
])
def test_keep_plan_of_the_wrong_shape_is_refused_before_the_search(tmp_path, capsys, path,
                                                                    value, pattern,
                                                                    monkeypatch):
    """Issue 31 row 3: a --keep plan with 'provenance': [] / 'memory': 'x' / 'layers': null
    was an AttributeError / AttributeError / TypeError traceback (the last after the whole
    search)."""
    plan = _saved_plan(tmp_path, capsys)
    bad = write(tmp_path, "bad.json", json.dumps(_patched(plan, path, value)))
    import poseidon_plugin.search as search

    forbid(monkeypatch, search, "search_plan", "the search")   # (after the plan was saved)
    one_line_error(capsys, [*PLAN, "--keep", bad], r"--keep \S+bad\.json: plan JSON: "
                   + pattern)


@pytest.mark.parametrize("body", ["[" * 200_000 + "]" * 200_000,
                                  '{"a": ' * 200_000 + "1" + "}" * 200_000])
def test_keep_plan_nested_200k_deep(tmp_path, capsys, no_search, body):
    """Issue 31 row 3: a --keep plan nested 200k deep was a RecursionError traceback."""
    bad = write(tmp_path, "deep.json", body)
    one_line_error(capsys, [*PLAN, "--keep", bad],
                   r"--keep \S+deep\.json: plan JSON: malformed \(nested too deeply\)",
                   max_s=FAULT_DEADLINE_S)


def test_a_valid_keep_plan_still_passes_the_check(tmp_path, capsys):
    from poseidon_plugin.plan import Plan, check_plan_dict

    plan = _saved_plan(tmp_path, capsys)
    check_plan_dict(plan)
    assert Plan.from_json(json.dumps(plan)).to_dict()["stages"] == plan["stages"]


@pytest.mark.parametrize("text", [
    "[" * 200_000 + "]" * 200_000,
    '{"stages": [{"layers": null}]}',
    b"\xff\xfe not utf-8",
    "layers-null",
])
def test_launch_damaged_cached_plan_is_moved_aside(tmp_path, capsys, caplog, text):
    """Issue 31 row 4: a damaged plan-<hash>.json beside the profile cache crashed every later
    --poseidon-auto launch; now it is moved aside with a warning and the launch plans afresh
    (as a damaged profile cache is)."""
    from poseidon_plugin.megatron.launch.runner import _load_previous

    if text == "layers-null":
        text = json.dumps(_patched(_saved_plan(tmp_path, capsys), "stages.0.layers", None))
    path = write(tmp_path, "plan-0123456789abcdef.json", text)
    with caplog.at_level(logging.WARNING, logger="poseidon"):
        assert _load_previous(path) is None
    assert not os.path.exists(path)
    assert len(list(tmp_path.glob("plan-0123456789abcdef.json.corrupt-*"))) == 1
    assert "is unreadable, planning afresh" in caplog.text
    assert _load_previous(path) is None          # the next launch: no file, no warning


def test_launch_cached_plan_that_is_fine_is_read(tmp_path, capsys):
    from poseidon_plugin.megatron.launch.runner import _load_previous

    plan = _saved_plan(tmp_path, capsys)
    path = write(tmp_path, "plan-x.json", json.dumps(plan))
    assert _load_previous(path).to_dict()["stages"] == plan["stages"]
    assert os.path.exists(path)


@pytest.mark.integration
def test_launch_save_plan_into_a_missing_directory_is_refused_before_profiling(tmp_path):
    """Issue 31 row 5: --poseidon-save-plan into a missing directory was a traceback after the
    profiling and the search; now one line before any profiling (as --out is checked)."""
    from tests.test_launch_e2e import GPT_ARGS, _single, write_emulation

    emu = write_emulation(tmp_path / "emu.yaml", ["emu-fast"])
    target = tmp_path / "missing" / "plan.json"
    proc = _single([*GPT_ARGS, "--poseidon-emulate", emu, "--poseidon-dry-run",
                    "--poseidon-save-plan", str(target)], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert re.search(r"error: --poseidon-save-plan \S+plan\.json: cannot write \(no such "
                     r"directory: \S+missing\)", proc.stderr), proc.stderr[-3000:]
    assert "profiling:" not in proc.stderr and "search:" not in proc.stderr
    assert not list(tmp_path.glob("profiles-*.json"))


def _conflicting_payload(second_forward_factor=2.0):
    """The valid DB with its first record repeated, the repeat's forward time scaled."""
    payload = _db_payload()
    twin = dict(payload["records"][0])
    twin["forward_ms"] = twin["forward_ms"] * second_forward_factor
    payload["records"].append(twin)
    return payload


def test_conflicting_duplicate_records_are_refused(tmp_path, capsys):
    """Issue 31 row 10: two records of one key with different values were accepted, the last
    winning (the plan depended on the records' order)."""
    path = _db(tmp_path, _conflicting_payload())
    one_line_error(capsys, [*PLAN, "--profiles", path],
                   r"db\.json: records\[0\] and records\[6\] both give \(fast decoder tp1 mbs1 "
                   r"seq128 bf16/flash/none, measured\), with different values \(forward "
                   r"\S+ ms, .* vs forward \S+ ms, .*\); the plan would depend on their order")


def test_identical_duplicates_and_sources_of_one_key_still_load(tmp_path):
    db = ProfileDB.load(_db(tmp_path, _conflicting_payload(1.0)))
    assert len(db) == 6
    payload = _conflicting_payload(3.0)
    payload["records"][-1]["source"] = "estimated"      # the merge rule decides: measured
    db = ProfileDB.load(_db(tmp_path, payload, "mixed.json"))
    first = payload["records"][0]
    (kept,) = [p for p in db.profiles() if p.key.device_type == first["device_type"]
               and p.key.layer_kind == first["layer_kind"]]
    assert kept.source == "measured" and kept.forward_ms == first["forward_ms"]


def test_profile_merge_of_bad_inputs_gives_the_same_errors(tmp_path, capsys):
    """``poseidon profile --merge``: a conflicting DB is refused in one line, nothing written;
    the same DB merged twice is fine."""
    good = _db(tmp_path, _db_payload(), "good.json")
    bad = _db(tmp_path, _conflicting_payload(), "bad.json")
    out = tmp_path / "merged.json"
    one_line_error(capsys, ["profile", "--merge", good, bad, "-o", str(out)],
                   r"bad\.json: records\[0\] and records\[6\] both give")
    assert not out.exists()
    empty = _db(tmp_path, _db_payload(device_type=""), "empty.json")
    one_line_error(capsys, ["profile", "--merge", empty, "-o", str(out)],
                   r"empty\.json: records\[0\]\.device_type: expected a non-empty string")
    assert cli.main(["profile", "--merge", good, good, "-o", str(out)]) == 0
    assert len(ProfileDB.load(str(out))) == 6


@pytest.mark.parametrize("field", ["forward_ms", "backward_ms"])
def test_absurdly_slow_measured_record_is_refused(tmp_path, capsys, field):
    """Issue 31 row 11: a measured record of 3.5e6 ms for a tiny layer was accepted (and a note
    then spoke of estimates 'scaled from that rate')."""
    payload = _db_payload()
    payload["records"][3][field] = 3.5e6                  # slow's decoder
    path = _db(tmp_path, payload)
    one_line_error(capsys, [*PLAN, "--profiles", path],
                   rf"db\.json: record \(slow, decoder, tp=1, micro-batch 1, seq 128\): "
                   rf"{field} 3\.5e\+06 implies \S+ TFLOP/s per device, below 1e-06 TFLOP/s: "
                   r"implausibly slow")


def test_slow_but_real_records_pass_the_floor():
    """A CPU-speed record (1e-4 of the peak, far slower than the device) is still accepted:
    the floor is for absurd records, not for slow machines."""
    cluster = load_cluster(SMALL)
    model = load_model(TINY)
    payload = _db_payload()
    for rec in payload["records"]:
        rec["forward_ms"] *= 1e4
        rec["backward_ms"] *= 1e4
    check_profiles(ProfileDB.from_json(json.dumps(payload)), cluster, model)


def test_scaled_note_names_a_tiny_rate_truthfully():
    from poseidon_plugin.profiles import scaled_text

    model = load_model(TINY)
    cluster = load_cluster(SMALL)
    key = profile_key(model, "fast", "decoder", 1, 1, 128)
    p = estimate_profile(cluster, model, key)
    import dataclasses
    text = scaled_text(dataclasses.replace(p, scaled_from=(key,), rate_tflops=6e-8))
    assert "(rate 6e-08 TFLOP/s)" in text
    text = scaled_text(dataclasses.replace(p, scaled_from=(key,), rate_tflops=41.26))
    assert "(rate 41.3 TFLOP/s)" in text


def test_profile_device_type_is_checked_before_profiling(tmp_path, capsys, no_profiling):
    """Issue 31 row 12: `poseidon profile --device-type ''` exited 0 and wrote a record its own
    loader refused (every later use of the DB failed)."""
    out = tmp_path / "db.json"
    for value, got in (("", "''"), ("x" * 2000, "'xxx")):
        one_line_error(capsys, ["profile", "--model", TINY, "--seq-length", "128",
                                "--device-type", value, "-o", str(out)],
                       rf"--device-type: expected a (non-empty string|string of at most \d+ "
                       rf"characters), got {got}")
    assert not out.exists()


def test_a_db_the_loader_would_refuse_is_never_written(tmp_path):
    import dataclasses

    db = ProfileDB.from_json(json.dumps(_db_payload()))
    first = db.profiles()[0]
    bad = dataclasses.replace(first, key=dataclasses.replace(first.key, device_type=""))
    db.put(bad)
    out = tmp_path / "db.json"
    with pytest.raises(ProfileDBError, match=r"db\.json \(not written\): records\[0\]\."
                                             r"device_type: expected a non-empty string"):
        db.save(str(out))
    assert not out.exists()
    db = ProfileDB.from_json(json.dumps(_db_payload()))
    db.save(str(out))
    assert len(ProfileDB.load(str(out))) == 6


@pytest.mark.integration
def test_launch_with_a_damaged_cached_plan_plans_afresh(tmp_path):
    """Issue 31 row 4 through a real (emulated, one-process) launch: the second launch finds
    its plan-<hash>.json damaged ('layers': null, which crashed every later launch), warns,
    moves it aside and writes a fresh plan."""
    import glob

    from tests.test_launch_e2e import GPT_ARGS, _single, write_emulation

    emu = write_emulation(tmp_path / "emu.yaml", ["emu-fast"])
    args = [*GPT_ARGS, "--poseidon-emulate", emu, "--poseidon-dry-run"]
    proc = _single(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (plan,) = glob.glob(str(tmp_path / "plan-*.json"))
    data = json.loads(open(plan).read())
    data["stages"][0]["layers"] = None
    with open(plan, "w") as f:
        json.dump(data, f)
    proc = _single(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert re.search(r"previous plan \S+plan-\w+\.json is unreadable, planning afresh: plan "
                     r"JSON: stages\[0\]\.layers: expected an integer >= 0, got None; old file "
                     r"kept as \S+\.corrupt-\d+", proc.stderr), proc.stderr[-3000:]
    assert len(glob.glob(plan + ".corrupt-*")) == 1
    assert json.loads(open(plan).read())["stages"][0]["layers"] >= 0   # a fresh plan


@pytest.mark.parametrize("src, noted", [("scaled", True), ("calibrated", False),
                                        ("estimated", False), ("measured", False)])
def test_scaled_note_only_for_decoders_scaled_from_the_records(src, noted):
    """Issue 31 row 11: the note said a stage's decoder was 'scaled from that type's measured
    rate' for any non-measured decoder of a measured type, scaled or not."""
    from types import SimpleNamespace

    from poseidon_plugin.profiles import scaled_estimate_note

    db = ProfileDB.from_json(json.dumps(_db_payload()))        # fast and slow at tp 1 mbs 1
    st = SimpleNamespace(index=0, device_type="fast", tp=2,
                         provenance=(("decoder", src, "fast decoder tp2 ..."),))
    note = scaled_estimate_note(SimpleNamespace(stages=[st], micro_batch_size=1), db,
                                load_model(TINY), 128)
    assert (note is not None) == noted, note
    if noted:
        assert note.startswith("stage(s) 0 run fast at TP 2, measured only at TP 1: its decoder "
                               "is scaled from that type's measured rate")


# ------------------------------------------------------------------ issue 31: files and the terminal

@pytest.fixture
def plan_json(tmp_path_factory, capsys):
    """A plan JSON of ``PLAN`` (for --keep)."""
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    assert cli.main([*PLAN, "--json", "--out", str(path)]) == 0
    capsys.readouterr()
    return str(path)


@pytest.fixture
def db_json(tmp_path):
    return _db(tmp_path, _db_payload(), name="profiles.json")


@pytest.mark.parametrize("victim", ["--cluster", "--model", "--keep", "--profiles"])
def test_out_naming_an_input_is_refused(tmp_path, capsys, plan_json, db_json, victim):
    """Row 2: ``--out`` naming an input file overwrote it with the plan (exit 0, data lost)."""
    cluster, model = write(tmp_path, "c.yaml", SMALL_TEXT), write(tmp_path, "m.yaml", TINY_TEXT)
    paths = {"--cluster": cluster, "--model": model, "--keep": plan_json, "--profiles": db_json}
    argv = [*PLAN, "--keep", plan_json, "--profiles", db_json, "--allow-estimates"]
    argv[argv.index("--cluster") + 1], argv[argv.index("--model") + 1] = cluster, model
    before = open(paths[victim], "rb").read()
    # a symbolic link to the input is the same file
    link = str(tmp_path / "link.json")
    os.symlink(paths[victim], link)
    for out in (paths[victim], link):
        err = one_line_error(capsys, [*argv, "--out", out])
        assert f"the same file as the input {victim}" in err, err
    assert open(paths[victim], "rb").read() == before


def test_out_and_gantt_naming_one_file_are_refused(tmp_path, capsys, no_search):
    """Row 2: ``--out x.svg --gantt x.svg`` wrote the chart, then the JSON over it."""
    path = str(tmp_path / "x.svg")
    one_line_error(capsys, [*PLAN, "--out", path, "--gantt", path],
                   r"--gantt \S+x\.svg: the same file as --out ")
    assert not os.path.exists(path)


def test_hard_linked_input_is_the_same_file(tmp_path, capsys, no_search):
    cluster = write(tmp_path, "c.yaml", SMALL_TEXT)
    os.link(cluster, tmp_path / "hard.json")
    argv = list(PLAN)
    argv[argv.index("--cluster") + 1] = cluster
    one_line_error(capsys, [*argv, "--out", str(tmp_path / "hard.json")], "--cluster")
    assert open(cluster, encoding="utf-8").read() == SMALL_TEXT


def test_outputs_are_replaced_not_rewritten_in_place(tmp_path, capsys):
    """Row 2: --out and --gantt are written to a temporary file and renamed over the old one
    (os.replace): a reader never sees a torn file, and a hard link to the old file keeps the
    old contents (an in-place write would have changed it)."""
    pytest.importorskip("matplotlib")
    out, gantt = tmp_path / "plan.json", tmp_path / "plan.svg"
    for path in (out, gantt):
        path.write_text("old")
        os.link(path, str(path) + ".old")
    assert cli.main([*PLAN, "--out", str(out), "--gantt", str(gantt)]) == 0
    capsys.readouterr()
    assert json.loads(out.read_text())["stages"]
    assert gantt.read_text().lstrip().startswith("<?xml")
    for path in (out, gantt):
        assert open(str(path) + ".old").read() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "plan.json", "plan.json.old", "plan.svg", "plan.svg.old"]   # no temporary file left


def test_atomic_write_leaves_the_old_file_on_failure(tmp_path, monkeypatch):
    from poseidon_plugin import safeio

    path = tmp_path / "db.json"
    path.write_text("old")
    os.chmod(path, 0o640)

    def fail(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safeio.os, "replace", fail)
    with pytest.raises(OSError):
        safeio.write_atomic(str(path), "new")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["db.json"]
    monkeypatch.undo()
    safeio.write_atomic(str(path), "new")
    assert path.read_text() == "new" and os.stat(path).st_mode & 0o777 == 0o640


def test_launch_plan_files_are_written_atomically(tmp_path):
    """Row 2: the launch's cached plan (and --poseidon-save-plan, the same helper)."""
    from poseidon_plugin.megatron.launch import runner

    path = tmp_path / "plan-x.json"
    path.write_text("old")
    os.link(path, tmp_path / "keep")
    runner._save_previous(str(path), "new")
    assert path.read_text() == "new" and (tmp_path / "keep").read_text() == "old"


def test_out_to_a_device_is_refused_before_the_search(capsys, no_search):
    """An existing non-regular output (os.replace would replace /dev/null itself, as root)."""
    one_line_error(capsys, [*PLAN, "--out", "/dev/null"],
                   r"--out /dev/null: cannot write \(a character device, not a regular file\)")


@pytest.fixture
def alarm():
    """A read that blocks (a FIFO without a writer) fails the test instead of hanging it."""
    import signal

    class Blocked(BaseException):   # not an OSError (TimeoutError is): no loader catches it
        pass

    def timeout(signum, frame):
        raise Blocked("blocked on an input")

    old = signal.signal(signal.SIGALRM, timeout)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("flag", ["--cluster", "--model", "--keep", "--profiles"])
def test_fifo_input_is_refused_not_waited_on(tmp_path, capsys, alarm, no_search, flag):
    """Row 6: a FIFO with no writer as an input hung forever (--time-budget ignored)."""
    fifo = str(tmp_path / "in.yaml")
    os.mkfifo(fifo)
    argv = list(PLAN)
    if flag in argv:
        argv[argv.index(flag) + 1] = fifo
    else:
        argv += [flag, fifo]
    one_line_error(capsys, argv, r"in\.yaml.*(FIFO \(named pipe\)|a FIFO)")


def test_fifo_merge_input_is_refused(tmp_path, capsys, alarm):
    fifo = str(tmp_path / "db.json")
    os.mkfifo(fifo)
    one_line_error(capsys, ["profile", "--merge", fifo, "-o", str(tmp_path / "out.json")],
                   r"db\.json: cannot read \(a FIFO \(named pipe\), not a regular file\)")
    assert not os.path.exists(tmp_path / "out.json")


@pytest.mark.parametrize("path, kind", [("/dev/zero", "a character device"),
                                        (".", "a directory")])
def test_device_and_directory_inputs_name_their_kind(capsys, no_search, path, kind):
    one_line_error(capsys, [*PLAN, "--profiles", path], re_escape(kind))


def re_escape(text):
    import re
    return re.escape(text)


def _run_cli(args, stdout=None, env=None, shell_tail=""):
    """``python -m poseidon_plugin ARGS`` in a subprocess (the real interpreter exit: its
    final flush of stdout is part of what is tested)."""
    import shlex
    cmd = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "poseidon_plugin", *args])
    full_env = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
    return subprocess.run(["bash", "-c", cmd + shell_tail], stdout=stdout,
                          stderr=subprocess.PIPE, env=full_env, timeout=120, text=True)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
@pytest.mark.parametrize("tail, message", [
    (" > /dev/full", "cannot write to standard output: No space left on device"),
    (" >&-", "cannot write to standard output: "),
])
def test_stdout_full_or_closed_is_one_line(tail, message):
    """Row 7: stdout full (OSError traceback) or closed (AttributeError on None)."""
    r = _run_cli(PLAN, shell_tail=tail)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("poseidon: error: " + message), r.stderr


def test_stdout_closed_pipe_is_quiet():
    """Row 7: the reader of a pipe left (``| head``): no traceback, no message."""
    r_fd, w_fd = os.pipe()
    os.close(r_fd)
    try:
        r = _run_cli(PLAN, stdout=w_fd)
    finally:
        os.close(w_fd)
    assert r.stderr == "" and r.returncode == 141


def test_non_ascii_names_on_an_ascii_stdout(tmp_path):
    """Row 8: a non-ASCII cluster name under PYTHONIOENCODING=ascii: UnicodeEncodeError."""
    data = yaml.safe_load(SMALL_TEXT)
    data["name"] = "集群-ü"
    cluster = write(tmp_path, "c.yaml", yaml.safe_dump(data, allow_unicode=True))
    argv = list(PLAN)
    argv[argv.index("--cluster") + 1] = cluster
    r = _run_cli(argv, stdout=subprocess.PIPE, env={"PYTHONIOENCODING": "ascii"})
    assert r.returncode == 0, r.stderr
    assert "on \\u96c6\\u7fa4-\\xfc:" in r.stdout


ESC = "\x1b]0;pwned\x07\x1b[2J"


def _no_raw_controls(err):
    assert "\x1b" not in err and "\x07" not in err, repr(err)


@pytest.mark.parametrize("name", [ESC + "A2-2", "a,b --tp 8", "A2 2"])
def test_profile_db_device_type_follows_the_yaml_name_rule(tmp_path, capsys, name):
    """Row 9: a profile DB's device_type was echoed raw (YAML names are checked, JSON ones were
    not); a name with commas or spaces broke the table and the comma lists."""
    path = _db(tmp_path, _db_payload(device_type=name))
    err = one_line_error(capsys, [*PLAN, "--profiles", path], r"records\[0\]\.device_type: "
                         "expected a (printable name|device type name without spaces or commas)")
    _no_raw_controls(err)


def test_keep_plan_stage_type_follows_the_name_rule(tmp_path, capsys, plan_json):
    data = json.load(open(plan_json, encoding="utf-8"))
    data["stages"][0]["device_type"] = ESC + "fast"
    keep = write(tmp_path, "keep.json", json.dumps(data))
    err = one_line_error(capsys, [*PLAN, "--keep", keep],
                         r"--keep \S+: stages\[0\]\.device_type: expected a printable name")
    _no_raw_controls(err)


@pytest.mark.parametrize("name", [ESC, "a,b --tp 8"])
def test_profile_device_type_flag_follows_the_name_rule(tmp_path, capsys, name):
    out = str(tmp_path / "db.json")
    err = one_line_error(capsys, ["profile", "--model", TINY, "--seq-length", "128",
                                  "--device-type", name, "-o", out], r"--device-type: expected a ")
    assert not os.path.exists(out)
    _no_raw_controls(err)


def test_cluster_device_type_name_without_commas_or_spaces():
    data = yaml.safe_load(SMALL_TEXT)
    name = next(iter(data["device_types"]))
    data["device_types"]["a,b --tp 8"] = data["device_types"].pop(name)
    with pytest.raises(SpecError, match="a device type name without spaces or commas"):
        cluster_from_dict(data, source="c.yaml")


def test_paths_echoed_in_errors_are_escaped(tmp_path, capsys, no_search):
    err = one_line_error(capsys, [*PLAN, "--keep", str(tmp_path / (ESC + "x.json"))])
    _no_raw_controls(err)
    assert "\\x1b]0;pwned\\x07" in err


def test_previous_plan_line_is_bounded(tmp_path, capsys, plan_json):
    """A --keep plan of 3000 stages printed every stage's type on one 24 KB line."""
    data = json.load(open(plan_json, encoding="utf-8"))
    data["stages"] = [dict(data["stages"][0], index=i) for i in range(3000)]
    keep = write(tmp_path, "keep.json", json.dumps(data))
    assert cli.main([*PLAN, "--keep", keep]) == 0
    out, err = capsys.readouterr()
    line = next(x for x in out.splitlines() if x.startswith("previous plan:"))
    assert len(line) < 400 and "(2992 more)" in line, line[:500]
    assert max(len(x) for x in (out + err).splitlines()) < 2100


def test_bound_line_and_bounded_join():
    from poseidon_plugin.safeio import bound_line, bounded_join

    assert bounded_join("abc", ",", 2) == "a,b,... (1 more)"
    assert bounded_join("ab", ",", 2) == "a,b"
    text = bound_line("x" * 5000 + "\x1b", 100)
    assert text == "x" * 100 + "... (4904 more characters)"
    assert bound_line("a\x1bb\n") == "a\\x1bb\\n"


@pytest.mark.parametrize("exc", [
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
                 "allocate memory: you tried to allocate 8589934592 bytes. Error code 12"),
    MemoryError(),
])
def test_profile_out_of_memory_is_one_line(tmp_path, capsys, monkeypatch, exc):
    """Row 13 within the bounds: `poseidon profile --seq-length 16777216` on CPU was an
    allocator traceback; now one line naming the sizes to lower."""
    from poseidon_plugin.megatron.profile import offline

    def oom(*args, **kwargs):
        raise exc

    monkeypatch.setattr(offline, "profile_layers", oom)
    # the up-front warning of a large layer on a CPU (test_profile_command) is not this row's
    monkeypatch.setattr(cli, "_warn_large_cpu_profile", lambda *a: None)
    argv = [*PROFILE, "--seq-length", "16777216"]
    argv[2] = str(tmp_path / "db.json")
    err = one_line_error(capsys, argv, r"out of memory profiling --seq-length 16777216 at "
                                       r"micro-batch sizes 1 on --device cpu")
    assert ("tried to allocate 8589934592 bytes" in err) == isinstance(exc, RuntimeError)
    assert not os.path.exists(argv[2])


@pytest.mark.integration   # torch / megatron-core
def test_profile_other_errors_are_not_called_out_of_memory(tmp_path, monkeypatch):
    from poseidon_plugin.megatron.profile import offline

    def broken(*args, **kwargs):
        raise RuntimeError("something else broke")

    monkeypatch.setattr(offline, "profile_layers", broken)
    argv = [*PROFILE, "--seq-length", "128"]
    argv[2] = str(tmp_path / "db.json")
    with pytest.raises(RuntimeError, match="something else broke"):
        cli.main(argv)


def test_launch_provenance_index_fifo_is_skipped(tmp_path, alarm):
    """Row 6 in launch mode: a FIFO in place of the profile dir's cache-versions.json hung
    every launch; now it is read as no index (and, not a regular file, never replaced)."""
    from poseidon_plugin.megatron.profile import profile_gather
    from poseidon_plugin.megatron.profile.profile_gather import CacheKey
    from poseidon_plugin.megatron.provenance import Component

    fifo = tmp_path / profile_gather.PROVENANCE_FILE
    os.mkfifo(fifo)
    key = CacheKey(("impl:local",), (Component("megatron-core", "0.19.2"),))
    profile_gather.note_provenance(str(tmp_path), key, cached=False)
    assert profile_gather.provenance_changes(str(tmp_path), key) == []
    assert os.path.exists(fifo) and not os.path.isfile(fifo)
    # a regular index is still written atomically and read back
    os.unlink(fifo)
    profile_gather.note_provenance(str(tmp_path), key, cached=False)
    assert json.loads(fifo.read_text())[key.base]["megatron-core"]["version"] == "0.19.2"


# ------------------------------------------------------------------ issue 38: round 4
# (rows 1-8 of "Bad input that ends badly today"; docs/reliability.md, the issue 38 table)

TINY_MOE = os.path.join(ROOT, "examples/models/tiny-moe.yaml")
TINY_MOE_TEXT = open(TINY_MOE, encoding="utf-8").read()
GPU_MOE = os.path.join(ROOT, "examples/models/gpu-moe.yaml")
GPU_MOE_DB = os.path.join(ROOT, "examples/profiles/gpu-moe-H100.json")
MOE_PLAN = ["plan", "--cluster", SMALL, "--model", TINY_MOE, "--global-batch-size", "16",
            "--seq-length", "128", "--workers", "1", "--no-baselines", "--no-runner-up"]


def _launch(tmp_path, *argv, env=None):
    """``python -m poseidon_plugin.launch train.py ARGV`` as rank 0 of 1 (the script must not
    run): the completed process."""
    script = tmp_path / "train.py"
    if not script.exists():
        script.write_text("raise SystemExit('the script must not run')\n")
    env = dict(os.environ, **LAUNCH_ENV, **(env or {}),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "poseidon_plugin.launch", str(script), *argv],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)


def _one_launch_line(proc, pattern):
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert re.search(pattern, proc.stderr), proc.stderr


# row 1: the launch's and `poseidon profile`'s outputs never overwrite an input

def test_launch_save_plan_naming_the_script_is_refused(tmp_path):
    """--poseidon-save-plan train.py wrote plan JSON over the training script, exit 0."""
    proc = _launch(tmp_path, "--poseidon-auto", "--poseidon-save-plan", "train.py")
    _one_launch_line(proc, r"--poseidon-save-plan train\.py: the same file as the input \(the "
                           r"training script\)")
    assert "must not run" in (tmp_path / "train.py").read_text()


@pytest.mark.parametrize("victim", ["emulate", "cluster", "tokenizer", "cache", "cache-new"])
def test_launch_save_plan_naming_an_input_or_the_cache_is_refused(tmp_path, victim):
    """The --poseidon-emulate / --poseidon-cluster file, a tokenizer file, a profile-cache file
    (existing, or a name the cache uses) as --poseidon-save-plan: refused before anything runs."""
    from poseidon_plugin.megatron.launch import runner
    from poseidon_plugin.megatron.launch.options import extract_options

    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "profiles-abc.json").write_text("{}")
    files = {"emulate": write(tmp_path, "emu.yaml", "x: 1\n"),
             "cluster": write(tmp_path, "c.yaml", "x: 1\n"),
             "tokenizer": write(tmp_path, "tok.model", "x"),
             "cache": str(cache / "profiles-abc.json"),
             "cache-new": str(cache / "plan-0123456789abcdef.json")}
    argv = ["--poseidon-auto", "--poseidon-emulate", files["emulate"], "--poseidon-cluster",
            files["cluster"], "--poseidon-profile-dir", str(cache),
            "--poseidon-save-plan", files[victim], "--tokenizer-model", files["tokenizer"]]
    opts, rest = extract_options(argv)
    with pytest.raises(PoseidonError, match=r"--poseidon-save-plan .*(the same file as the "
                                            r"input|a file of the profile cache)"):
        runner._check_save_plan_is_no_input(str(tmp_path / "train.py"), rest, opts)
    opts, rest = extract_options([*argv[:-3], str(tmp_path / "plan.json")])
    runner._check_save_plan_is_no_input(str(tmp_path / "train.py"), rest, opts)   # fine


@pytest.mark.parametrize("victim", ["--model", "--merge"])
def test_profile_out_naming_an_input_is_refused(tmp_path, capsys, no_profiling, victim):
    """`poseidon profile -o` naming its --model file (or a --merge input) wrote over it."""
    model = write(tmp_path, "m.yaml", TINY_TEXT)
    db = _db(tmp_path, _db_payload())
    before = {model: TINY_TEXT, db: open(db).read()}
    argv = (["profile", "--model", model, "-o", model, "--seq-length", "128", "--device-type",
             "cpu", "--device", "cpu"] if victim == "--model" else
            ["profile", "--merge", db, "-o", os.path.join(tmp_path, ".", "db.json")])
    one_line_error(capsys, argv, rf"-o \S+: the same file as the input {victim} ")
    assert all(open(p).read() == text for p, text in before.items())


# row 2: a mixed MoE model's per-kind records are usable and checked

def _h100_cluster(tmp_path) -> str:
    return write(tmp_path, "h100.yaml", """name: h100-8
device_types:
  NVIDIA-H100-80GB-HBM3: {memory_gib: 80, intra_node_gbps: 3600, peak_tflops: 989}
nodes:
  - {device_type: NVIDIA-H100-80GB-HBM3, devices_per_node: 8, count: 1}
links: {inter_node_gbps: 400, cross_type_gbps: 400, latency_ms: 0.01}
""")


def test_the_repositorys_mixed_moe_profile_is_usable(tmp_path, capsys):
    """examples/profiles/gpu-moe-H100.json (what `poseidon profile` wrote for gpu-moe.yaml:
    one record set per layer kind, keyed by the kind's signature) was refused: "no measured
    record is usable ... differs" (each was compared with the whole model's signature)."""
    rc = cli.main(["plan", "--cluster", _h100_cluster(tmp_path), "--model", GPU_MOE,
                   "--profiles", GPU_MOE_DB, "--global-batch-size", "8", "--seq-length", "2048",
                   "--attention", "unfused", "--tp", "1", "--micro-batch-sizes", "1", "2",
                   "--no-baselines", "--no-runner-up", "--workers", "1", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "unusable" not in err
    plan = json.loads(out)
    assert {s["provenance"]["decoder"]["source"] for s in plan["stages"]} == {"measured"}


def _mixed_moe_payload(**patch):
    """Measured records of tiny-moe's two layer kinds (keyed by each kind's uniform model, as
    `poseidon profile` and the launch key them) on the small cluster, ``patch`` applied."""
    cluster, model = load_cluster(SMALL), load_model(TINY_MOE)
    assert model.is_mixed
    records = []
    for device in ("fast", "slow"):
        for i in range(len(model.layer_kinds)):
            one = model.kind_model(i)
            rec = profile_to_record(estimate_profile(
                cluster, one, profile_key(one, device, "decoder", 1, 1, 128)))
            rec.update(source="measured", **patch)
            records.append(rec)
    return {"version": 1, "records": records}


@pytest.mark.parametrize("patch, pattern", [
    ({"forward_ms": 1e-9}, r"forward_ms 1e-09 implies \S+ TFLOP/s per device, above fast's "
                           r"peak_tflops \(200\)"),
    ({"backward_ms": 3.5e6}, r"backward_ms 3\.5e\+06 implies .* implausibly slow"),
])
def test_mixed_moe_records_are_rate_checked(tmp_path, capsys, patch, pattern):
    """Per-kind MoE records of 1e-9 ms passed the rate check dense records fail (a rate of
    265,027,584 TFLOP/s against a peak of 200 was used with --allow-estimates); without it
    both DBs were refused for the wrong reason ("no measured record is usable")."""
    path = _db(tmp_path, _mixed_moe_payload(**patch))
    for extra in ([], ["--allow-estimates"]):
        one_line_error(capsys, [*MOE_PLAN, "--profiles", path, *extra], pattern)
    path = _db(tmp_path, _mixed_moe_payload(), name="good.json")   # plausible ones pass
    assert cli.main([*MOE_PLAN, "--profiles", path]) == 0, capsys.readouterr().err
    assert "unusable" not in capsys.readouterr().err


# row 3: requests are never silently changed

@pytest.fixture
def ep2_plan(tmp_path_factory, capsys):
    path = tmp_path_factory.mktemp("ep2") / "plan.json"
    assert cli.main([*MOE_PLAN, "--ep", "2", "--json", "--out", str(path)]) == 0
    capsys.readouterr()
    assert json.loads(path.read_text())["ep"] == 2
    return path


def _kept(capsys, argv) -> tuple[dict, str]:
    assert cli.main([*MOE_PLAN, "--json", *argv]) == 0
    out, err = capsys.readouterr()
    plan = json.loads(out)
    return plan, plan["search"]["previous_plan"]


def test_keep_never_returns_a_moe_plan_at_another_ep(capsys, ep2_plan):
    """--keep of a plan made with --ep 2 reported "kept" and returned ep=1 (its layout priced
    and returned at the search's EP)."""
    plan, state = _kept(capsys, ["--ep", "1", "--keep", str(ep2_plan), "--keep-within", "20"])
    assert state.startswith("unusable:") and "ep=2" in state and plan["ep"] == 1
    plan, state = _kept(capsys, ["--ep", "2", "--keep", str(ep2_plan)])
    assert state == "kept" and plan["ep"] == 2


def test_keep_of_an_invalid_ep_is_not_kept(tmp_path, capsys, ep2_plan):
    """An ep=3 plan (3 divides neither the DP degree nor the 8 experts) was "kept"."""
    bad = json.loads(ep2_plan.read_text())
    bad["ep"] = 3
    path = write(tmp_path, "ep3.json", json.dumps(bad))
    plan, state = _kept(capsys, ["--keep", path, "--keep-within", "20"])
    assert state.startswith("unusable:") and "ep=3" in state and plan["ep"] != 3


def test_ep_with_cp_is_kept_or_refused(capsys):
    """``--ep 4 --cp 2``: ep=1 came back with no note (EP was checked against DP alone; Megatron
    sets expert-DP = DP x CP / EP). A global batch of one micro-batch (DP 1): EP 2 is kept over
    the two CP ranks; EP 8, which DP x CP = 2 does not admit, is one line naming DP x CP."""
    base = [*MOE_PLAN, "--cp", "2", "--micro-batch-sizes", "2", "--json"]
    base[base.index("--global-batch-size") + 1] = "2"
    assert cli.main([*base, "--ep", "2"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["ep"], plan["cp"], plan["dp"]) == (2, 2, 1), (plan["ep"], plan["cp"], plan["dp"])
    one_line_error(capsys, [*base, "--ep", "8"], r"DP x CP")


@pytest.mark.parametrize("name, record", [
    ("op_overheads", {"device_type": "fast", "forward_ms": 1.0, "backward_ms": 2.0}),
    ("p2p_calls", {"device_type": "fast", "link": "intra-node", "message_bytes": 64,
                   "send_call_ms": 0.1, "recv_ready_ms": 0.1}),
])
def test_duplicate_call_cost_records_with_different_values_are_refused(tmp_path, capsys, name,
                                                                       record):
    """Two op_overheads of one device type: the last one won (100.68 vs 1.58 ms by order)."""
    payload = _db_payload()
    other = dict(record, **{k: v * 50 for k, v in record.items() if k.endswith("_ms")})
    payload[name] = [record, other]
    path = _db(tmp_path, payload)
    one_line_error(capsys, [*PLAN, "--profiles", path],
                   rf"{name}\[0\] and {name}\[1\] both give .*, with different values; the "
                   r"plan would depend on their order")
    payload[name] = [record, dict(record)]   # identical ones are kept once
    db = ProfileDB.load(_db(tmp_path, payload, name="same.json"))
    assert len(db.op_overheads() if name == "op_overheads" else db.p2p_calls()) == 1


# row 4: errors name the cause

@pytest.mark.parametrize("extra, pattern", [
    (["--cp", "8"], r"CP 8 \(--cp / --context-parallel-size\): no node can hold a CP group "
                    r"\(.*the largest node has 4 devices\)"),
    (["--cp", "4", "--tp", "2"], r"CP 4 \(--cp / --context-parallel-size\): no configuration "
                                 r"fits: a TP x CP group stays in one node"),
])
def test_a_cp_no_node_can_hold_names_cp(capsys, extra, pattern):
    """"check the device counts, TP divisibility ..." never named CP."""
    one_line_error(capsys, [*PLAN, *extra], pattern)


# row 5: one line, not a traceback

def test_unicode_digits_in_moe_layer_freq_are_one_line(tmp_path, capsys, no_search,
                                                       no_profiling):
    """`[²]*8` ('²'.isdigit() but int('²') fails) was a ValueError traceback in plan and
    profile."""
    model = write(tmp_path, "m.yaml", TINY_MOE_TEXT.replace('"[0]*2+[1]*6"', '"[²]*8"'))
    pattern = r"m\.yaml: moe_layer_freq: expected .*found '²'"
    argv = list(MOE_PLAN)
    argv[argv.index("--model") + 1] = model
    one_line_error(capsys, argv, pattern)
    one_line_error(capsys, ["profile", "--model", model, "-o", str(tmp_path / "db.json"),
                            "--seq-length", "128", "--device-type", "cpu"], pattern)


def test_launch_poseidon_tp_must_divide_the_heads(monkeypatch):
    """--poseidon-tp 3 on a 4-head model: a RuntimeError from parallel_state on every rank
    (the offline --tp 3 got its line); now refused as the model is read."""
    from argparse import Namespace

    from poseidon_plugin.megatron import framework_state
    from poseidon_plugin.megatron.profile import profiler
    from poseidon_plugin.megatron.launch import runner
    from poseidon_plugin.megatron.launch import bootstrap
    from poseidon_plugin.megatron.launch.options import extract_options

    args = Namespace(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=128,
                     vocab_size=128, global_batch_size=16, micro_batch_size=1)
    monkeypatch.setattr(runner, "require_megatron", lambda *a, **k: None)
    monkeypatch.setattr(profiler, "parse_megatron_args", lambda script, argv: args)
    monkeypatch.setattr(framework_state, "hold", lambda a: None)
    env = bootstrap.LaunchEnv.from_environ(LAUNCH_ENV)
    for tps, ok in (("3", False), ("1,2,4", True)):
        opts, rest = extract_options(["--poseidon-auto", "--poseidon-tp", tps])
        ctx = runner.LaunchContext("train.py", rest, opts, env, 0.0)
        ctx.backend = "megatron"
        if ok:
            runner._all_ranks_read_model(ctx)
            continue
        with pytest.raises(PoseidonError, match=r"--poseidon-tp 3: TP 3 does not divide the "
                                                r"model's 4 attention heads"):
            runner._all_ranks_read_model(ctx)


def test_launch_bad_log_level_is_one_line(tmp_path):
    """POSEIDON_LOG_LEVEL=bogus: a ValueError traceback from logging on every rank."""
    proc = _launch(tmp_path, "--poseidon-auto", env={"POSEIDON_LOG_LEVEL": "bogus"})
    _one_launch_line(proc, r"POSEIDON_LOG_LEVEL='bogus': expected one of .*DEBUG")


@pytest.mark.integration   # torch / megatron-core
@pytest.mark.parametrize("where", ["helpers-cache-is-a-file", "home-unwritable"])
def test_unusable_helpers_cache_is_one_line(tmp_path, monkeypatch, where):
    """An unusable POSEIDON_HELPERS_CACHE (or, without it, a HOME nobody may write): an
    os.makedirs traceback while Megatron's dataset helpers were built."""
    from poseidon_plugin.megatron.launch.compat import build_helpers_cached

    source = write(tmp_path, "helpers.cpp", "// not compiled: the cache is refused first\n")
    if where == "helpers-cache-is-a-file":
        monkeypatch.setenv("POSEIDON_HELPERS_CACHE", write(tmp_path, "afile", "x"))
    else:
        home = tmp_path / "home"
        if os.geteuid() == 0:
            # root writes into any directory (CI runs as root): a HOME that is a file is
            # as unusable, and the same os.makedirs traceback came from it
            home.write_text("not a directory\n")
        else:
            home.mkdir()
            home.chmod(0o500)
        monkeypatch.delenv("POSEIDON_HELPERS_CACHE", raising=False)
        monkeypatch.setenv("HOME", str(home))
    with pytest.raises(PoseidonError, match=r"cannot build Megatron's dataset helpers into .*: "
                                            r"set POSEIDON_HELPERS_CACHE to a writable"):
        build_helpers_cached(source)


@pytest.mark.integration   # torch / megatron-core
def test_profile_of_an_mla_model_on_cpu_is_one_line(tmp_path, capsys):
    """megatron-core's local DotProductAttention takes no k_channels: MLASelfAttention failed
    with a TypeError traceback when `poseidon profile` built the layer on the CPU."""
    model = write(tmp_path, "mla.yaml", TINY_TEXT + "".join(
        f"{k}: {v}\n" for k, v in (("multi_latent_attention", "true"), ("q_lora_rank", 64),
                                   ("kv_lora_rank", 32), ("qk_head_dim", 32),
                                   ("qk_pos_emb_head_dim", 16), ("v_head_dim", 32))))
    one_line_error(capsys, ["profile", "--model", model, "-o", str(tmp_path / "db.json"),
                            "--seq-length", "128", "--device-type", "cpu", "--device", "cpu"],
                   r"an MLA layer \(multi_latent_attention\) needs Transformer Engine's attention")
    assert not os.path.exists(tmp_path / "db.json")


@pytest.mark.integration   # torch / megatron-core
def test_profile_of_moe_experts_with_bias_is_one_line(tmp_path, capsys):
    """Biased experts (Megatron's default add_bias_linear) at TP 1 and EP 1: megatron-core
    0.15+'s own MLP.forward adds the bias in place on a view autograd forbids (a RuntimeError
    traceback); the real layer is built and run here."""
    model = write(tmp_path, "m.yaml", TINY_MOE_TEXT.replace("add_bias_linear: false",
                                                            "add_bias_linear: true")
                  .replace("moe_shared_expert_intermediate_size: 256\n", ""))
    one_line_error(capsys, ["profile", "--model", model, "-o", str(tmp_path / "db.json"),
                            "--seq-length", "128", "--device-type", "cpu", "--device", "cpu",
                            "--iters", "1"],
                   r"MoE experts with bias \(add_bias_linear.*\) fail in its own forward at TP "
                   r"1 and EP 1", max_s=600)


@pytest.mark.parametrize("env, pattern", [
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "abc"},
     r"--distributed: LOCAL_WORLD_SIZE='abc' is not set to a number"),
    ({"RANK": "3", "WORLD_SIZE": "2"}, r"--distributed: RANK=3 is outside WORLD_SIZE=2"),
])
def test_distributed_environment_is_checked(capsys, monkeypatch, env, pattern):
    """LOCAL_WORLD_SIZE=abc: a ValueError traceback; RANK >= WORLD_SIZE was not checked."""
    for name, value in {**LAUNCH_ENV, **env}.items():
        monkeypatch.setenv(name, value)
    one_line_error(capsys, [*PLAN, "--distributed"], pattern)


# row 6: the distributed search keeps to --time-budget

def test_distributed_inputs_are_read_before_the_rendezvous(tmp_path, capsys, monkeypatch):
    """A bad input was read only after a hard-coded 120 s rendezvous."""
    from poseidon_plugin.megatron.launch import search_transport

    forbid(monkeypatch, search_transport, "searchers_from_environ", "the rendezvous")
    model = write(tmp_path, "m.yaml", TINY_TEXT.replace("num_layers: 8", "num_layers: -8"))
    argv = [*PLAN, "--distributed"]
    argv[argv.index("--model") + 1] = model
    one_line_error(capsys, argv, r"m\.yaml: num_layers: expected")


def test_distributed_waits_follow_the_time_budget():
    from poseidon_plugin.megatron.launch.search_transport import (MIN_WAIT_S, RENDEZVOUS_S,
                                                           wait_seconds)

    assert wait_seconds(None) == RENDEZVOUS_S == 120
    assert wait_seconds(30) == 30 and wait_seconds(1e6) == RENDEZVOUS_S
    assert wait_seconds(0.5) == MIN_WAIT_S


def test_a_missing_coordinator_is_reported_in_time(monkeypatch):
    """A rank whose coordinator never starts (or whose MASTER_ADDR does not resolve) waited
    past 180 s at --time-budget 10 (c10d's client retries past its timeout)."""
    from test_launch_e2e import free_port

    from poseidon_plugin.megatron.launch.search_transport import _await_coordinator

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    start = time.monotonic()
    with pytest.raises(PoseidonError, match=r"no coordinator \(rank 0\) listening at "
                                            r"127\.0\.0\.1:\d+ after 0\.5 s"):
        _await_coordinator(time.monotonic() + 0.5, 0.5)
    assert time.monotonic() - start < FAULT_DEADLINE_S
    monkeypatch.setenv("MASTER_ADDR", "no-such-host.invalid")
    with pytest.raises(PoseidonError, match=r"MASTER_ADDR='no-such-host\.invalid' does not "
                                            r"resolve"):
        _await_coordinator(time.monotonic() + 600, 600)


@pytest.mark.integration   # torch / megatron-core
def test_a_peer_that_never_starts_is_reported_within_the_budget(tmp_path):
    """Rank 0 of 2 alone at --time-budget 1: reported after 124.5 s; now the wait is the
    budget's (at least MIN_WAIT_S = 10 s), named in the line."""
    from test_launch_e2e import free_port

    env = dict(os.environ, RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "poseidon_plugin", *PLAN[:], "--distributed",
                           "--time-budget", "1"], capture_output=True, text=True,
                          timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "poseidon: error: --distributed: rank 0 cannot join the process group in 10 s" \
        in proc.stderr, proc.stderr[-3000:]


def test_a_finished_distributed_search_leaves_at_once(monkeypatch, capsys):
    """The process left 3-5 s after writing its plan: torch's teardown of the group and its
    store at interpreter exit. A program that joined a group (argv from the command line)
    now exits straight after flushing its output; a call (argv given) returns."""
    from poseidon_plugin.megatron.launch import search_transport

    class Group:
        coordinator = False

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def serve(self):
            return 0

    left = []
    monkeypatch.setattr(search_transport, "searchers_from_environ", lambda **k: Group())
    monkeypatch.setattr(cli, "_leave", left.append)
    monkeypatch.setattr(cli, "_LEAVE_AT_ONCE", [])
    monkeypatch.setattr(sys, "argv", ["poseidon", *PLAN, "--distributed"])
    assert cli.main() == 0 and left == [0]
    monkeypatch.setattr(cli, "_LEAVE_AT_ONCE", [])
    assert cli.main([*PLAN, "--distributed"]) == 0 and left == [0]   # a call: no exit


# row 7: one set of rules for plan --megatron-args and the launch, before anything heavy

@pytest.mark.parametrize("flags, pattern", [
    ("--expert-tensor-parallel-size 1", r"does not plan expert tensor parallelism"),
    ("--cp-comm-type a2a", r"not --cp-comm-type a2a"),
    ("--use-checkpoint-args", r"cannot be combined with --use-checkpoint-args"),
    ("--yaml-cfg x.yaml", r"cannot be combined with --yaml-cfg"),
    ("--hybrid-override-pattern M*4", r"--hybrid-override-pattern: the planner models GPT"),
    ("--moe-layer-freq [1]*08", r"--moe-layer-freq: expected .*without leading zeros"),
    ("--moe-layer-freq '[1]*999999999'", r"--moe-layer-freq: expected .*at most 4096 layers"),
])
def test_megatron_args_the_launch_refuses_are_refused(capsys, no_search, flags, pattern):
    """`poseidon plan --megatron-args` accepted flags the launch refuses."""
    one_line_error(capsys, [*PLAN, "--megatron-args", flags],
                   r"--megatron-args: .*" + pattern + r".*\(the launch refuses it too\)")


@pytest.mark.parametrize("text", ["[0]*1+[1]*3", "([1]*3+[0]*1)*3", "[1,0,1]", "[1]*00+[1]",
                                  "[²]*4", "[٣]*2", "[1]*08", "[1 0]", "[1]*0_8", "[1]+2",
                                  "[[1]]", "[1]*-1+[0]"])
def test_moe_layer_freq_rules_are_megatrons(text):
    """Our list-expression reader accepts exactly what Megatron's --moe-layer-freq parser
    (``moe_freq_type``: Python's ``eval``) turns into a list of 0/1 (non-ASCII digits and
    `[1]*08` were accepted here, refused there). White space between tokens is read here, as
    megatron-core 0.12-0.15 read it (0.19 refuses it in its own line)."""
    from poseidon_plugin.layers import PatternError, parse_layer_pattern

    arguments = pytest.importorskip("megatron.training.arguments")
    try:
        theirs = arguments.moe_freq_type(text)
        theirs = tuple(theirs) if isinstance(theirs, list) and all(
            type(v) is int and v in (0, 1) for v in theirs) else None
    except Exception:  # noqa: BLE001 - SyntaxError, TypeError, ...
        theirs = None
    try:
        ours = parse_layer_pattern(text)
        ours = ours if all(v in (0, 1) for v in ours) else None
    except PatternError:
        ours = None
    assert ours == theirs


def test_launch_checks_moe_layer_freq_before_megatrons_parser(tmp_path):
    """In the launch, Megatron's own parser eval'd --moe-layer-freq '[1]*999999999' (a
    MemoryError after gigabytes) before the plugin checked it."""
    proc = _launch(tmp_path, "--poseidon-auto", "--moe-layer-freq", "[1]*999999999")
    _one_launch_line(proc, r"--moe-layer-freq: expected .*at most 4096 layers.*got "
                           r"'\[1\]\*999999999'")


# row 8: a damaged launch cache that is a directory or a FIFO is moved aside, as documented

@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_launch_cache_that_is_a_directory_or_fifo_is_moved_aside(tmp_path, caplog, alarm,
                                                                  kind):
    """docs/reliability.md: a damaged cache is moved aside and profiled again; a directory or
    a FIFO in its place was an error line on every launch instead."""
    from poseidon_plugin.megatron.profile import profile_gather

    path = tmp_path / "profiles-abc.json"
    path.mkdir() if kind == "directory" else os.mkfifo(path)
    with caplog.at_level(logging.WARNING, logger="poseidon"):
        db = profile_gather.load_cache(str(path), reprofile=False)
    assert len(db) == 0 and not os.path.lexists(path)
    aside = [p for p in os.listdir(tmp_path) if p.startswith("profiles-abc.json.corrupt-")]
    assert len(aside) == 1 and "re-profiling" in caplog.text
