"""Records that say where they came from, and imports that say what is missing.

* The megatron-core version in a record's ``env`` and in the profile cache's key is the imported
  ``megatron.core``'s own ``package_info`` (a Megatron-LM tree first on the path, not the wheel pip
  installed), with a hash of the tree's path when it is not the distribution's files; MindSpeed
  and MindSpeed-LLM likewise on that backend; a change of any of them is one log line.
* Each record's ``env.device`` is the device of the ranks that measured its type.
* A failed import on a launch or ``poseidon profile`` is one line naming what is missing and the
  fix, exit 2, no traceback.

Core tests build small fake trees and wheels (no torch); the integration ones run the real
Megatron-LM tree of ``../shared/frameworks`` where it is at hand.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from poseidon_plugin.megatron import imports, provenance
from poseidon_plugin.megatron.profile import profile_gather
from poseidon_plugin.megatron.launch.discovery import DeviceInfo
from poseidon_plugin.megatron.profile.profile_gather import CacheKey
from poseidon_plugin.megatron.profile.profiler import Aggregate
from poseidon_plugin.megatron.provenance import Component

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FRAMEWORKS = os.path.join(os.path.dirname(ROOT), "shared", "frameworks")
TREE_0121 = os.path.join(FRAMEWORKS, "megatron-lm-core_v0.12.1")


def fake_megatron(root, version=(0, 12, 3), wheel=True):
    """``root/megatron/core`` with a package_info of ``version``; with ``wheel`` a
    megatron_core dist-info whose RECORD lists those files (as pip installs the wheel)."""
    core = root / "megatron" / "core"
    core.mkdir(parents=True)
    (root / "megatron" / "__init__.py").write_text("")
    (core / "__init__.py").write_text("from megatron.core.package_info import __version__\n")
    (core / "package_info.py").write_text(textwrap.dedent(f"""\
        MAJOR, MINOR, PATCH, PRE_RELEASE = {version[0]}, {version[1]}, {version[2]}, ''
        VERSION = (MAJOR, MINOR, PATCH, PRE_RELEASE)
        __version__ = '.'.join(map(str, VERSION[:3])) + ''.join(VERSION[3:]) + '+deadbee'
        """))
    if wheel:
        v = ".".join(map(str, version))
        info = root / f"megatron_core-{v}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: megatron-core\nVersion: {v}\n")
        (info / "RECORD").write_text("megatron/__init__.py,,\nmegatron/core/__init__.py,,\n"
                                     "megatron/core/package_info.py,,\n")
    return root


def run_py(code: str, pythonpath: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*pythonpath, ROOT]),
               TORCH_CUDA_ARCH_LIST=os.environ.get("TORCH_CUDA_ARCH_LIST", "8.0"))
    return subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)


PRINT_MCORE = ("import json; from poseidon_plugin.megatron import provenance as p; "
               "c = p.megatron_core(); print(json.dumps([c.version, c.path, c.describe()]))")


# ------------------------------------------------------------------------- versions, core


def test_a_wheel_is_named_by_its_package_info_without_a_tree(tmp_path):
    site = fake_megatron(tmp_path / "site", (0, 12, 3), wheel=True)
    proc = run_py(PRINT_MCORE, [str(site)])
    assert proc.returncode == 0, proc.stderr
    version, path, env = json.loads(proc.stdout)
    # the git suffix package_info appends from 0.16 on is dropped (it is the enclosing repo's HEAD)
    assert (version, path, env) == ("0.12.3", "", "0.12.3")


def test_a_checkout_is_named_by_its_package_info_and_its_path(tmp_path):
    tree = fake_megatron(tmp_path / "Megatron-LM", (0, 12, 1), wheel=False)
    proc = run_py(PRINT_MCORE, [str(tree)])
    assert proc.returncode == 0, proc.stderr
    version, path, env = json.loads(proc.stdout)
    assert version == "0.12.1" and os.path.samefile(path, tree)
    assert env == f"0.12.1 (tree {provenance.path_hash(str(tree))})"
    other = fake_megatron(tmp_path / "other" / "Megatron-LM", (0, 12, 1), wheel=False)
    proc = run_py(PRINT_MCORE, [str(other)])
    assert json.loads(proc.stdout)[2] != env   # two checkouts of one version: two trees


def test_mindspeed_versions_from_the_distribution_the_tree_or_its_path(tmp_path):
    # a bare tree (as in ../shared/frameworks: the package only): unknown, with its path
    bare = tmp_path / "MindSpeed"
    (bare / "mindspeed").mkdir(parents=True)
    (bare / "mindspeed" / "__init__.py").write_text("")
    c = provenance.package_component("mindspeed", "mindspeed", ("mindspeed",))
    assert c.version == "not installed"
    sys.path.insert(0, str(bare))
    try:
        c = provenance.package_component("mindspeed", "mindspeed", ("mindspeed",))
        assert c.version == "unknown" and os.path.samefile(c.path, bare)
        assert c.describe() == f"unknown (tree {provenance.path_hash(str(bare))})"
        # a checkout with its setup.py: that version, still with the tree's hash
        (bare / "setup.py").write_text("setuptools.setup(name='mindspeed', version='0.12.1')\n")
        c = provenance.package_component("mindspeed", "mindspeed", ("mindspeed",))
        assert c.version == "0.12.1" and c.path
        # installed from a wheel: the distribution's version, no tree
        info = bare / "mindspeed-2.3.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mindspeed\nVersion: 2.3.0\n")
        (info / "RECORD").write_text("mindspeed/__init__.py,,\n")
        c = provenance.package_component("mindspeed", "mindspeed", ("mindspeed",))
        assert (c.version, c.path) == ("2.3.0", "")
    finally:
        sys.path.remove(str(bare))
        sys.modules.pop("mindspeed", None)


@pytest.mark.skipif(not os.path.isdir(FRAMEWORKS),
                    reason=f"{FRAMEWORKS} is absent (a clone outside the project's workplace)")
def test_the_shared_mindspeed_trees_are_named_by_their_paths():
    ms = os.path.join(FRAMEWORKS, "mindspeed-2.3.0_core_r0.12.1")
    llm = os.path.join(FRAMEWORKS, "mindspeed-llm-v2.3.0")
    proc = run_py("import json; from poseidon_plugin.megatron import provenance as p; "
                  "print(json.dumps([[c.name, c.version, c.path] "
                  "for c in p.mindspeed_components()]))", [ms, llm])
    assert proc.returncode == 0, proc.stderr
    got = {n: (v, p) for n, v, p in json.loads(proc.stdout)}
    assert got["mindspeed"][0] == "unknown" and os.path.samefile(got["mindspeed"][1], ms)
    assert got["mindspeed-llm"][0] == "unknown" and os.path.samefile(got["mindspeed-llm"][1], llm)


# ------------------------------------------------------------------ the cache's one line


def key(mcore: Component, *more: Component) -> CacheKey:
    return CacheKey(("impl:local", "bf16:True"),
                    (Component("torch", "2.9.0"), mcore, *more, Component("poseidon", "0.1")))


def test_a_version_change_is_one_line_saying_which(tmp_path, caplog):
    wheel = Component("megatron-core", "0.19.2")
    tree = Component("megatron-core", "0.12.1", "/src/Megatron-LM")
    d = str(tmp_path)
    caplog.set_level(logging.INFO, logger="poseidon")
    profile_gather.note_provenance(d, key(wheel), cached=False)      # the first launch: silent
    profile_gather.note_provenance(d, key(wheel), cached=True)       # nothing changed: silent
    assert not [r for r in caplog.records if "profile cache" in r.getMessage()]
    assert key(wheel).tag != key(tree).tag and key(wheel).base == key(tree).base
    profile_gather.note_provenance(d, key(tree), cached=False)
    lines = [r.getMessage() for r in caplog.records if "profile cache" in r.getMessage()]
    assert lines == ["profile cache: megatron-core changed 0.19.2 -> 0.12.1 (/src/Megatron-LM), "
                     "re-profiling"]
    caplog.clear()
    # another checkout of the same version is a change too; back to the wheel: its own cache
    profile_gather.note_provenance(d, key(Component("megatron-core", "0.12.1", "/b/M")), False)
    profile_gather.note_provenance(d, key(wheel), cached=True)
    lines = [r.getMessage() for r in caplog.records if "profile cache" in r.getMessage()]
    assert lines == ["profile cache: megatron-core changed 0.12.1 (/src/Megatron-LM) -> "
                     "0.12.1 (/b/M), re-profiling",
                     "profile cache: megatron-core changed 0.12.1 (/b/M) -> 0.19.2, using the "
                     "cache measured with these before"]
    caplog.clear()
    ms = (Component("mindspeed", "unknown", "/ms"), Component("mindspeed-llm", "unknown", "/llm"))
    profile_gather.note_provenance(d, key(wheel, *ms), cached=False)   # first time with them
    profile_gather.note_provenance(d, key(wheel, ms[0], Component("mindspeed-llm", "unknown",
                                                                  "/llm2")), cached=False)
    lines = [r.getMessage() for r in caplog.records if "profile cache" in r.getMessage()]
    assert lines == ["profile cache: mindspeed-llm changed unknown (/llm) -> unknown (/llm2), "
                     "re-profiling"]


def test_an_unreadable_versions_file_is_no_line_and_is_rewritten(tmp_path, caplog):
    (tmp_path / profile_gather.PROVENANCE_FILE).write_text("{not json")
    caplog.set_level(logging.INFO, logger="poseidon")
    profile_gather.note_provenance(str(tmp_path), key(Component("megatron-core", "0.19.2")), False)
    assert not [r for r in caplog.records if "profile cache" in r.getMessage()]
    saved = json.loads((tmp_path / profile_gather.PROVENANCE_FILE).read_text())
    assert list(saved.values())[0]["megatron-core"] == {"version": "0.19.2"}


# ------------------------------------------------------------------ each record's device


def test_each_record_names_the_device_of_its_own_ranks():
    infos = [DeviceInfo(0, 0, "h", "emu-slow", 1 << 30, "emulated", 0.25, "emu-slow"),
             DeviceInfo(1, 1, "h", "emu-fast", 1 << 30, "emulated", 1.0, "emu-fast"),
             DeviceInfo(2, 0, "g", "A100", 1 << 30, "cuda", 1.0, "NVIDIA A100-SXM4-40GB"),
             DeviceInfo(3, 1, "g", "A100", 1 << 30, "cuda", 1.0, "NVIDIA A100-SXM4-80GB")]
    devices = profile_gather.devices_by_type(infos)
    assert devices == {"emu-slow": "emu-slow", "emu-fast": "emu-fast",
                       "A100": "NVIDIA A100-SXM4-40GB, NVIDIA A100-SXM4-80GB"}
    aggs = [Aggregate(t, 1, 1, 1.0, 2.0, 10, 10, 1) for t in ("emu-slow", "emu-fast", "A100")]
    env = [("device", "emu-slow"), ("torch", "2.9.0"), ("megatron_core", "0.19.2")]
    recs = profile_gather.measured_records(aggs, 128, "sig", env=env, devices=devices)
    got = {r.key.device_type: dict(r.env) for r in recs}
    assert {t: e["device"] for t, e in got.items()} == devices
    assert all(e["megatron_core"] == "0.19.2" and e["torch"] == "2.9.0" for e in got.values())


# ------------------------------------------------------------------ imports: one line


@pytest.mark.parametrize("name, expected", [
    ("einops", "megatron.training.arguments (--poseidon-auto) needs einops, which is not "
               "installed: pip install einops"),
    ("yaml", "megatron.training.arguments (--poseidon-auto) needs yaml, which is not installed: "
             "pip install pyyaml"),
    ("torch_npu", "cannot import torch_npu (--poseidon-auto): install Ascend's PyTorch adapter"),
    ("mindspeed", "cannot import mindspeed (--poseidon-auto): MindSpeed is not installed"),
    ("torch", "cannot import torch (--poseidon-auto): PyTorch is not installed: pip install torch"),
    ("poseidon_plugin._core", "Poseidon's own module poseidon_plugin._core is "
                              "missing (--poseidon-auto): its compiled core is not built"),
])
def test_a_missing_module_is_named_with_its_fix(name, expected):
    e = ModuleNotFoundError(f"No module named '{name}'", name=name)
    msg = str(imports.explain(e, "megatron.training.arguments", "--poseidon-auto"))
    assert msg.startswith(expected) and "\n" not in msg, msg
    assert isinstance(imports.explain(e), imports.MissingImportError)


def test_no_megatron_at_all_says_install_or_checkout():
    e = ModuleNotFoundError("No module named 'megatron'", name="megatron")
    msg = str(imports.explain(e, "megatron.core", "poseidon profile"))
    assert msg.startswith("cannot import megatron (poseidon profile): neither megatron-core nor a "
                          "Megatron-LM checkout is importable"), msg
    assert "PYTHONPATH" in msg


def fake_012_wheel(tmp_path):
    return fake_megatron(tmp_path / "site", (0, 12, 3), wheel=True)


@pytest.mark.integration
def test_poseidon_profile_on_a_012_wheel_is_one_line(tmp_path):
    site = fake_012_wheel(tmp_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), ROOT]))
    proc = subprocess.run([sys.executable, "-m", "poseidon_plugin.cli", "profile", "--model",
                           "llama3-8b", "--seq-length", "64", "--device-type", "cpu", "--device",
                           "cpu", "-o", str(tmp_path / "db.json")], capture_output=True,
                          text=True, timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("poseidon: error:")]
    assert errors == [f"poseidon: error: megatron-core 0.12's wheel ({site / 'megatron'}) ships "
                      "no megatron.training (poseidon profile): put a Megatron-LM checkout on "
                      "PYTHONPATH, or install megatron-core 0.18 or later"], proc.stderr
    assert "Traceback" not in proc.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.integration
def test_a_launch_on_a_012_wheel_is_one_line(tmp_path):
    site = fake_012_wheel(tmp_path)
    emu = tmp_path / "emu.yaml"
    emu.write_text("device_types:\n  emu-a: {speed: 1.0, memory_gib: 4}\nranks: [emu-a]\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), ROOT]), RANK="0",
               WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), POSEIDON_PROFILE_DIR=str(tmp_path / "profiles"))
    proc = subprocess.run([sys.executable, "-m", "poseidon_plugin.launch",
                           os.path.join(ROOT, "examples", "pretrain_gpt.py"), "--num-layers", "2",
                           "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length",
                           "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
                           "--global-batch-size", "2", "--poseidon-auto", "--poseidon-dry-run",
                           "--poseidon-emulate", str(emu)], capture_output=True, text=True,
                          timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert errors == [f"[poseidon rank 0] error: megatron-core 0.12's wheel ({site / 'megatron'}) "
                      "ships no megatron.training (--poseidon-auto): put a Megatron-LM checkout "
                      "on PYTHONPATH, or install megatron-core 0.18 or later"], proc.stderr
    assert "Traceback" not in proc.stderr


# ------------------------------------------------------------------ the real 0.12.1 tree


@pytest.mark.integration
@pytest.mark.skipif(not os.path.isdir(TREE_0121),
                    reason=f"{TREE_0121} is absent (a clone outside the project's workplace)")
def test_a_real_checkout_first_on_the_path_is_what_records_say():
    """The venv has the megatron-core 0.19.2 wheel; the 0.12.1 checkout first on the path is
    the megatron imported, and what the env of a record says."""
    proc = run_py("import json; from poseidon_plugin.megatron.profile import profile_gather as g; "
                  "print(json.dumps(dict(g.measurement_env('emu-a', 'emulated'))))", [TREE_0121])
    assert proc.returncode == 0, proc.stderr[-3000:]
    env = json.loads(proc.stdout.strip().splitlines()[-1])
    assert env["megatron_core"] == f"0.12.1 (tree {provenance.path_hash(TREE_0121)})", env
    assert env["device"] == "emu-a" and env["torch"]
