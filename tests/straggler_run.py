"""A straggler run under torchrun's restart, shared by the framework trees' tests
(tests/test_resume_replan.py: Megatron-LM core_v0.19.0; tests/test_mindspeed_llm_resume.py:
MindSpeed-LLM v26.1.0): each rank under a shell that prints its exit status, the launch's log
streamed while the test slows one emulated rank through the emulation's live slowdown file
(``POSEIDON_EMULATE_SLOWDOWN_FILE``) once Megatron has logged a given iteration, and the checks
of the straggler's exit (75), torchrun's relaunch and its resume."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# each rank under a shell that prints its exit status (torchrun restarts the group silently)
STATUS = ('"$0" -u -m poseidon_plugin.launch "$@"; rc=$?; '
          'echo "[launch rank $LOCAL_RANK] exit status $rc"; exit $rc')

LINE = re.compile(r"straggler: iteration (\d+): rank (\d+)(?: = launch rank (\d+))? "
                  r"\((emu-\w+) on [^,]+, stage (\d+)\) computes ([0-9.]+) ms per micro-batch, "
                  r"planned ([0-9.]+) ms")


def run_slowed(cmd: list[str], env: dict[str, str], slow_file, iters: int, slowdown: str,
               at: int = 2, timeout: float = 900, cwd: str = ROOT) -> tuple[int, str]:
    """Runs the torchrun ``cmd``; once Megatron logs iteration ``at`` writes ``slowdown``
    ("<launch rank> <factor>") into the emulation's live slowdown file. (returncode, log)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=cwd)
    # past the timeout every process under torchrun is killed (its ranks run in sessions of
    # their own), which ends the output: a launch that hangs silently cannot hang the test
    killer = threading.Timer(timeout, _kill_tree, (proc.pid,))
    killer.start()
    lines = []
    try:
        for line in proc.stdout:   # type: ignore[union-attr]
            lines.append(line)
            if not slow_file.exists() and re.search(rf"iteration +{at}/ +{iters} \|", line):
                tmp = slow_file.parent / (slow_file.name + ".tmp")
                tmp.write_text(slowdown + "\n")
                os.replace(tmp, slow_file)
    finally:
        killer.cancel()
        if proc.poll() is None:
            _kill_tree(proc.pid)
        proc.wait()
    out = "".join(lines)
    (slow_file.parent / "launch.log").write_text(out)
    sys.stdout.write(out[-4000:])
    print("\n".join(ln for ln in out.splitlines()
                    if "straggler: iteration" in ln or "resume from iteration" in ln
                    or "exitcode" in ln or re.search(r"lm loss", ln)))
    assert slow_file.exists(), f"Megatron never logged iteration {at}\n" + out[-5000:]
    return proc.returncode, out


def _kill_tree(pid: int) -> None:
    import psutil

    try:
        top = psutil.Process(pid)
        procs = [*top.children(recursive=True), top]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


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

