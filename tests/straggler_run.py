"""Runs under torchrun's restart, shared by the framework trees' tests
(tests/test_resume_replan.py: Megatron-LM core_v0.19.0; tests/test_mindspeed_llm_resume.py:
MindSpeed-LLM v26.1.0), each rank under a shell that prints its exit status:

* a straggler: the launch's log streamed while the test slows one emulated rank through the
  emulation's live slowdown file (``POSEIDON_EMULATE_SLOWDOWN_FILE``) once Megatron has logged a
  given iteration, and the checks of the straggler's exit (75), torchrun's relaunch and its
  resume;
* a dead node: two torchrun agents stand for two nodes (``--nnodes 1:2``, c10d rendezvous, 2
  ranks each, ``--max-restarts 1``); once Megatron has saved a checkpoint the second agent and
  its ranks are killed (SIGKILL), and the first agent restarts its ranks in a new rendezvous
  with the one node left."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from typing import Callable

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



def dead_node_agent(python: str, port: int, launch: list[str]) -> list[str]:
    """One of the two agents of a dead-node run: torchrun, 2 ranks, ``launch`` (the script and
    its arguments) under :data:`STATUS`."""
    return [python, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2",
            "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{port}", "--rdzv-id", "poseidon-dead-node", "--rdzv-conf",
            "last_call_timeout=20", "--no-python", "bash", "-c", STATUS, python, *launch]


def run_dead_node(agent: Callable[[int], list[str]], env: dict[str, str], log_dir,
                  saved_at: int = 2, timeout: float = 900,
                  cwd: str = ROOT, record=None) -> tuple[int, str, str]:
    """Starts ``agent(port)`` twice (the first hosts the rendezvous store: the node that dies
    must not be the one holding it; the second joins within ``last_call_timeout``, so both are
    in the first round), kills the second once Megatron has saved at ``saved_at``, waits for the
    first. (the first agent's returncode, its log, the second's log); both are written under
    ``log_dir``. ``record``: Poseidon's record of that save (a path) must exist too before the
    kill -- rank 0 writes it after Megatron's closing barrier, and rank 0 may sit on the node
    that dies (torchrun's rendezvous orders the nodes as they join): killed in between, the
    relaunch resumes without knowing what changed (seen once in CI)."""
    from test_launch_e2e import free_port

    port = free_port()
    logs: tuple[list[str], list[str]] = ([], [])
    procs: list[subprocess.Popen] = []
    readers = []
    killed = False
    try:
        for i in range(2):
            procs.append(subprocess.Popen(agent(port), stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd,
                                          start_new_session=True))
            readers.append(_drain(procs[-1], logs[i]))
            if i == 0:
                _wait_listening(port, procs[0])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and procs[0].poll() is None:
            both = "".join(logs[0] + logs[1])
            if "is not used by the plan" in both:
                break      # the first plan left a node out: no restart would follow
            if not killed and re.search(rf"successfully saved checkpoint from iteration +"
                                        rf"{saved_at}\b", both) and (
                                            record is None or os.path.exists(record)):
                _kill_tree(procs[1].pid)   # the node: its agent and its ranks
                killed = True
            time.sleep(0.5)
    finally:
        for proc in procs:
            if proc.poll() is None:
                _kill_tree(proc.pid)
            proc.wait()
        for t in readers:
            t.join(5)
    out = "".join(logs[0])
    (log_dir / "node-a.log").write_text(out)
    (log_dir / "node-b.log").write_text("".join(logs[1]))
    sys.stdout.write(out[-4000:])
    print("\n".join(ln for ln in out.splitlines()
                    if "resume from iteration" in ln or "lm loss" in ln or "exitcode" in ln))
    assert "is not used by the plan" not in "".join(logs[0] + logs[1]), \
        "the first plan left devices unused\n" + out[-6000:]
    assert killed, f"Megatron never saved at iteration {saved_at}\n" + out[-6000:]
    return procs[0].returncode, out, "".join(logs[1])


def check_dead_node_resume(out: str, saved_at: int, iters: int, lost: str = "2 x emu-slow",
                           until: int | None = None) -> tuple[int, str]:
    """The surviving node's relaunch: one line naming the lost devices, Megatron's load of the
    last checkpoint (``saved_at`` or a later one saved before the kill), every iteration after
    it up to ``until`` (``--exit-interval``; default ``iters``), none after it: (that
    iteration, the relaunch's log)."""
    found = re.search(r"resume from iteration (\d+): ", out)
    assert found, out[-6000:]
    saved_at = max(saved_at, int(found.group(1)))
    assert int(found.group(1)) == saved_at, found.group(0)
    relaunch = out[found.end():]
    line = found.group(0) + relaunch.splitlines()[0]
    print(line)
    assert f"lost {lost} (host " in line and " ms predicted" in line, line
    assert re.search(rf"successfully loaded checkpoint from .* at iteration {saved_at}\b",
                     relaunch), relaunch[-6000:]
    until = until or iters
    for i in range(saved_at + 1, until + 1):
        assert re.search(rf"iteration +{i}/ +{iters} \|", relaunch), (i, relaunch[-6000:])
    assert not re.search(rf"iteration +{until + 1}/ +{iters} \|", relaunch)
    statuses = re.findall(r"\[launch rank (\d)\] exit status (-?\d+)", out)
    assert statuses[-2:] and {c for _, c in statuses[-2:]} == {"0"}, statuses
    return saved_at, relaunch


def _drain(proc: subprocess.Popen, into: list[str]) -> threading.Thread:
    def run():
        for line in proc.stdout:   # type: ignore[union-attr]
            into.append(line)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _wait_listening(port: int, agent: subprocess.Popen, timeout: float = 300) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and agent.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"the first agent's rendezvous store never listened on port {port}")
