"""Each one-line patch in patches/ applies with `patch --dry-run -p1`, without fuzz, to the
`pretrain_gpt.py` shapes it is documented for (tests/patch_targets/), and puts the import where
patches/README.md says: before the first megatron / mindspeed_llm import, after the docstring."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATCHES = os.path.join(ROOT, "patches")
TARGETS = os.path.join(ROOT, "tests", "patch_targets")
LINE = "import poseidon_plugin.auto"

# patch -> (target directory, offset `patch` reports or 0), one per pretrain_gpt.py shape
CASES = [
    ("megatron-lm-core-0.13-0.15.patch", "megatron-lm-core_v0.13-0.14", 0),
    ("megatron-lm-core-0.13-0.15.patch", "megatron-lm-core_v0.15", 0),
    ("megatron-lm-core-0.16-0.17.patch", "megatron-lm-core_v0.16-0.17", 0),
    ("megatron-lm-core-ge-0.18.patch", "megatron-lm-core_v0.18-main", 0),
    ("mindspeed-llm.patch", "mindspeed-llm-2.0-2.1", -1),
    ("mindspeed-llm.patch", "mindspeed-llm-2.2-master", 0),
]
# the versions patches/README.md must name for each patch (tests/patch_targets/README.md)
DOCUMENTED = {
    "megatron-lm-core-0.13-0.15.patch": ["core_v0.13.0", "core_v0.13.1", "core_v0.14.0",
                                         "core_v0.15.0", "core_v0.15.3"],
    "megatron-lm-core-0.16-0.17.patch": ["core_v0.16.0", "core_v0.16.1", "core_v0.17.0",
                                         "core_v0.17.1"],
    "megatron-lm-core-ge-0.18.patch": ["core_v0.18.0", "core_v0.18.2", "core_v0.19.0", "main"],
    "mindspeed-llm.patch": ["v2.0.0", "v2.1.0", "v2.2.0", "v2.3.0", "v26.0.0", "v26.1.0", "master"],
}

pytestmark = pytest.mark.skipif(shutil.which("patch") is None, reason="GNU patch is not installed")


def _patch(tree: str, name: str, dry_run: bool) -> subprocess.CompletedProcess:
    cmd = ["patch", "-p1", "--batch"] + (["--dry-run"] if dry_run else [])
    with open(os.path.join(PATCHES, name), "rb") as f:
        return subprocess.run(cmd, stdin=f, cwd=tree, capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("name,target,offset", CASES, ids=[f"{p}:{t}" for p, t, _ in CASES])
def test_patch_applies_without_fuzz(tmp_path, name, target, offset):
    tree = tmp_path / "tree"
    shutil.copytree(os.path.join(TARGETS, target), tree)
    dry = _patch(str(tree), name, dry_run=True)
    out = dry.stdout + dry.stderr
    assert dry.returncode == 0, out
    assert "fuzz" not in out and "FAILED" not in out, out
    got = re.search(r"offset (-?\d+) line", out)
    assert (int(got.group(1)) if got else 0) == offset, out

    assert _patch(str(tree), name, dry_run=False).returncode == 0
    src = (tree / "pretrain_gpt.py").read_text()
    lines = src.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith(LINE))
    first = next(i for i, ln in enumerate(lines)
                 if re.match(r"(from|import) (megatron|mindspeed_llm)\b", ln))
    assert at < first, src
    assert ast.get_docstring(ast.parse(src)), "the module docstring must stay the docstring"
    if "_PROGRAM_START_TIME" in src:  # >= 0.16: the startup timer includes planning
        assert lines.index(next(ln for ln in lines if ln.startswith("_PROGRAM_START_TIME"))) < at


FRAMEWORKS = os.path.join(os.path.dirname(ROOT), "shared", "frameworks")
# patch -> the real release tree in ../shared/frameworks (unchanged upstream checkouts)
REAL = [("megatron-lm-core-0.13-0.15.patch", "megatron-lm-core_v0.15.3"),
        ("megatron-lm-core-ge-0.18.patch", "megatron-lm-core_v0.19.0"),
        ("mindspeed-llm.patch", "mindspeed-llm-v2.3.0"),
        ("mindspeed-llm.patch", "mindspeed-llm-v26.1.0")]


@pytest.mark.skipif(not os.path.isdir(FRAMEWORKS),
                    reason=f"{FRAMEWORKS} is absent (a clone outside the project's workplace)")
@pytest.mark.parametrize("name,target", REAL, ids=[f"{p}:{t}" for p, t in REAL])
def test_patch_applies_to_the_real_release_script(tmp_path, name, target):
    """The release's own pretrain_gpt.py (a copy: shared/ is read-only), not a stand-in shape."""
    tree = tmp_path / "tree"
    tree.mkdir()
    shutil.copy(os.path.join(FRAMEWORKS, target, "pretrain_gpt.py"), tree / "pretrain_gpt.py")
    dry = _patch(str(tree), name, dry_run=True)
    out = dry.stdout + dry.stderr
    assert dry.returncode == 0 and "fuzz" not in out and "FAILED" not in out, out
    assert _patch(str(tree), name, dry_run=False).returncode == 0
    lines = (tree / "pretrain_gpt.py").read_text().splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith(LINE))
    first = next(i for i, ln in enumerate(lines)
                 if re.match(r"(from|import) (megatron|mindspeed_llm)\b", ln))
    assert at < first


def test_patches_readme_names_the_checked_versions():
    readme = open(os.path.join(PATCHES, "README.md"), encoding="utf-8").read()
    for name, versions in DOCUMENTED.items():
        row = next((ln for ln in readme.splitlines() if ln.startswith(f"| `{name}`")), "")
        assert row, f"patches/README.md has no table row for {name}"
        missing = [v for v in versions if v not in row]
        assert not missing, f"{name}: README row lacks {missing}"
    assert sorted(os.listdir(PATCHES)) == sorted([*DOCUMENTED, "README.md"])
