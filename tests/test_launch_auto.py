"""The one-line patch: ``import poseidon_plugin.auto`` at the top of the script, plain torchrun."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from test_launch_e2e import GPT_ARGS, ROOT, TORCHRUN, free_port, write_emulation

pytestmark = pytest.mark.integration


def patched_script(tmp_path) -> str:
    src = open(os.path.join(ROOT, "examples", "pretrain_gpt.py")).read()
    line = "# import poseidon_plugin.auto  # noqa: E402  <- the one-line patch (see patches/README.md)"
    assert line in src
    path = tmp_path / "pretrain_gpt.py"
    path.write_text(src.replace(line, "import poseidon_plugin.auto  # noqa: E402"))
    return str(path)


def test_one_line_patch_plans_and_trains(tmp_path):
    script = patched_script(tmp_path)
    emu = write_emulation(tmp_path / "emu.yaml", ["emu-slow", "emu-fast"])
    cmd = [TORCHRUN, "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
           str(free_port()), script, *GPT_ARGS, "--train-iters", "3", "--poseidon-auto",
           "--poseidon-emulate", emu]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1",
           "POSEIDON_PROFILE_DIR": str(tmp_path / "profiles")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=str(tmp_path))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "Poseidon plan" in out and "rank -> stage" in out
    assert re.search(r"iteration\s+3/\s*3 \|.*lm loss", out), out[-4000:]
    assert "unrecognized arguments" not in out


def test_one_line_patch_without_auto_only_strips_options(tmp_path):
    """No --poseidon-auto: the import strips --poseidon-* options and changes nothing else."""
    script = tmp_path / "s.py"
    script.write_text("import poseidon_plugin.auto\nimport sys\nprint('ARGV', sys.argv[1:])\n")
    proc = subprocess.run([sys.executable, str(script), "--lr", "1", "--poseidon-timeout", "5"],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr
    assert "ARGV ['--lr', '1']" in proc.stdout


def test_launcher_without_auto_runs_the_script_unchanged_with_its_dir_on_path(tmp_path):
    (tmp_path / "sibling.py").write_text("VALUE = 42\n")
    script = tmp_path / "train.py"
    script.write_text("import sys\nimport sibling\nprint('RESULT', __name__, sibling.VALUE, sys.argv)\n")
    proc = subprocess.run([sys.executable, "-m", "poseidon_plugin.launch", str(script), "--lr", "1",
                           "--poseidon-profile-dir", "x"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert f"RESULT __main__ 42 ['{script}', '--lr', '1']" in proc.stdout


def test_launcher_plans_with_the_megatron_next_to_the_script(tmp_path):
    """Run from a Megatron-LM checkout, the planning imports the checkout's megatron (as the
    script and the one-line patch do), not the installed megatron-core."""
    (tmp_path / "megatron").mkdir()
    local = tmp_path / "megatron" / "__init__.py"
    local.write_text("import sys\n"
                     "sys.stderr.write('LOCAL MEGATRON ' + __file__ + '\\n')\n"
                     "raise SystemExit(7)\n")
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("raise RuntimeError('the script must not run')\n")
    emu = write_emulation(tmp_path / "emu.yaml", ["emu-slow"])
    proc = subprocess.run([sys.executable, "-m", "poseidon_plugin.launch", str(script), *GPT_ARGS,
                           "--poseidon-auto", "--poseidon-emulate", emu],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT, "RANK": "0", "WORLD_SIZE": "1",
                               "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                               "MASTER_PORT": str(free_port())})
    assert proc.returncode == 7, proc.stdout + proc.stderr
    assert f"LOCAL MEGATRON {local}" in proc.stderr
