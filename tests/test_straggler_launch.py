"""The straggler line in an emulated launch (slow tier): examples/pretrain_gpt.py on 2 CPU ranks
of two emulated types; after iteration 2 the test slows the emu-fast rank 6x through the
emulation's live slowdown file (``POSEIDON_EMULATE_SLOWDOWN_FILE``); rank 0 names it and, with
``--poseidon-replan-on-straggler --save``, Megatron saves a checkpoint at that iteration and
every rank exits with 75; with torchrun's --max-restarts 1 the relaunch plans with the measured
speed and resumes. One launch shows all of it (each rank's exit status printed by a shell
around it: torchrun does not log a restarted group's exit codes); a global batch of 8 and 7
iterations keep it short."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from test_launch_e2e import GPT_ARGS, ROOT, SCRIPT, TORCHRUN, free_port, with_value, write_emulation

ITERS = 7
ARGS = with_value(GPT_ARGS, "--global-batch-size", "8")
# each rank under a shell that prints its exit status (torchrun restarts the group silently)
STATUS = ('"$0" -u -m poseidon_plugin.launch "$@"; rc=$?; '
          'echo "[launch rank $LOCAL_RANK] exit status $rc"; exit $rc')

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LINE = re.compile(r"straggler: iteration (\d+): rank (\d+)(?: = launch rank (\d+))? "
                  r"\((emu-\w+) on [^,]+, stage (\d+)\) computes ([0-9.]+) ms per micro-batch, "
                  r"planned ([0-9.]+) ms")


def run_slowed(cmd: list[str], env: dict[str, str], slow_file, iters: int, slowdown: str,
               at: int = 2, timeout: float = 900, cwd: str = ROOT) -> tuple[int, str]:
    """Runs the torchrun ``cmd``; once Megatron logs iteration ``at`` writes ``slowdown``
    ("<launch rank> <factor>") into the emulation's live slowdown file. (returncode, log)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=cwd)
    lines, deadline = [], time.monotonic() + timeout
    try:
        for line in proc.stdout:   # type: ignore[union-attr]
            lines.append(line)
            if not slow_file.exists() and re.search(rf"iteration +{at}/ +{iters} \|", line):
                tmp = slow_file.parent / (slow_file.name + ".tmp")
                tmp.write_text(slowdown + "\n")
                os.replace(tmp, slow_file)
            if time.monotonic() > deadline:
                break
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    out = "".join(lines)
    (slow_file.parent / "launch.log").write_text(out)
    sys.stdout.write(out[-4000:])
    print("\n".join(ln for ln in out.splitlines()
                    if "straggler: iteration" in ln or "resume from iteration" in ln
                    or "exitcode" in ln or re.search(r"lm loss", ln)))
    assert slow_file.exists(), f"Megatron never logged iteration {at}\n" + out[-5000:]
    return proc.returncode, out


def check_restart(out: str, it: int, nranks: int, iters: int) -> str:
    """The straggler's exit (75 from every rank torchrun did not stop first), torchrun's
    relaunch (0 from all ``nranks``), its resume line, Megatron's load at ``it`` and the
    iterations after it: returns the relaunch's log."""
    assert f"checkpoint at iteration {it}, then every rank exits with 75" in out, out[-6000:]
    first, _, relaunch = out.partition(f"checkpoint at iteration {it}, then every rank exits")
    # the first group's exit: 75 from every rank that was not stopped by torchrun (SIGTERM
    # kills the shell too, which then prints nothing); the relaunch's: 0 from every rank
    statuses = re.findall(r"\[launch rank (\d)\] exit status (-?\d+)", out)
    first_group = statuses[:len(statuses) - nranks]
    assert first_group and {c for _, c in first_group} == {"75"}, statuses
    assert statuses[-nranks:] and {c for _, c in statuses[-nranks:]} == {"0"}, statuses
    assert re.search(rf"resume from iteration {it}: ", relaunch), relaunch[-6000:]
    assert re.search(rf"successfully loaded checkpoint from .* at iteration {it}\b", relaunch), \
        relaunch[-6000:]
    for i in range(it + 1, iters + 1):
        assert re.search(rf"iteration +{i}/ +{iters} \|", relaunch), (i, relaunch[-6000:])
    assert not re.search(rf"iteration +{it + 1}/ +{iters} \|", first)   # nothing past it
    return relaunch


def test_the_restart_after_a_straggler_exit_plans_with_the_measured_speed_and_resumes(tmp_path):
    """Issue 37 item 3 end to end: torchrun's own restart (``--max-restarts 1``) relaunches the
    group after the straggler exit (75); the relaunch plans with the measured speed rank 0 wrote
    into the profile cache, loads the checkpoint saved at the straggler's iteration (``--load``)
    and trains to the end; torchrun exits 0. The device stays slow (the slowdown file is left
    in place): the new plan is made for it, and no straggler is named again."""
    emu = write_emulation(tmp_path / "emu.yaml", ["emu-slow", "emu-fast"], slow_speed=0.5)
    slow_file = tmp_path / "slowdown"
    ckpt = str(tmp_path / "ckpt")
    cmd = [TORCHRUN, "--nproc-per-node", "2", "--max-restarts", "1", "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), "--no-python", "bash", "-c", STATUS,
           sys.executable, SCRIPT, *ARGS, "--train-iters", str(ITERS), "--poseidon-auto",
           "--poseidon-emulate", emu, "--poseidon-straggler-pct", "200", "--poseidon-straggler-iters", "2",
           "--poseidon-replan-on-straggler", "--save", ckpt, "--load", ckpt,
           "--ckpt-format", "torch_dist", "--save-interval", "100"]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "POSEIDON_PROFILE_DIR": str(tmp_path / "profiles"),
           "POSEIDON_EMULATE_SLOWDOWN_FILE": str(slow_file)}
    rc, out = run_slowed(cmd, env, slow_file, ITERS, "1 6")
    found = [m for m in LINE.finditer(out)]
    assert len(found) == 1, out[-6000:]          # named once; the relaunch's plan fits it
    it, rank, launch_rank, dtype, _, measured, planned = found[0].groups()
    assert (launch_rank or rank) == "1" and dtype == "emu-fast"
    assert float(measured) > 3 * float(planned)
    it = int(it)
    assert 4 <= it < ITERS                       # slowed after 2, named after K=2 slow ones
    check_restart(out, it, 2, ITERS)
    assert rc == 0, out[-6000:]
