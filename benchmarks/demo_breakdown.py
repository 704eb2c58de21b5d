"""Where the `make demo` iteration goes: the emulated 4-rank launch with every part of Megatron's
iteration time-stamped, then the plan's prediction taken apart against it.

    .venv/bin/python benchmarks/demo_breakdown.py OUTDIR [--train-iters 8]

runs ``examples/run_emulated.sh``'s launch (same model, same emulation file) with this file as
the training script: in that role (``DEMO_BREAKDOWN_DIR`` set) it wraps, in every rank, Megatron's
``train_step``, ``forward_step`` / ``backward_step``, the p2p calls, ``finalize_model_grads``
(the DP all-reduce, the tied-embedding all-reduce), the optimizer's ``prepare_grads`` /
``get_grad_norm_fp32`` / ``step_with_ready_grads``, ``training_log`` and every
``torch.distributed.all_reduce`` with wall and CPU clocks, runs ``examples/pretrain_gpt.py``
unchanged, and writes ``OUTDIR/rank<N>.json``. Then it prints, from iteration 2 on:

* per stage: the plan's forward / backward per micro-batch against the measured wall and CPU
  time (wall / CPU = the contention the ops saw; for a slow emulated type it includes the
  padding sleep);
* the pipeline re-timed with the measured compute (``iteration_fit.retimed_ms``) against the
  measured iteration (its longest rank), and where the rest goes: the critical rank's tail
  (finalize = DP + embedding all-reduce, including the wait for the other replica; optimizer:
  grad norm with its all-reduce, update; the rest of ``train_step``), the delay of each p2p
  hand-off (receiver already waiting) and the time outside ``train_step`` (``training_log``).

A diagnostic, not a test: nothing is asserted, and the numbers are the host's of the moment.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import statistics as st
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_ARGS = ("--num-layers 8 --hidden-size 128 --num-attention-heads 4 --seq-length 128 "
             "--max-position-embeddings 128 --micro-batch-size 1 --global-batch-size 16 "
             "--lr 2e-3 --lr-decay-style constant --mock-data --tokenizer-type NullTokenizer "
             "--vocab-size 512 --log-interval 1 --eval-iters 0 --eval-interval 1000 "
             "--num-workers 0 --bf16 --seed 1234").split()

# ---------------------------------------------------------------------------------- train role

EVENTS: list = []   # (name, wall0, wall1, cpu0, cpu1, extra)


def _wrap(owner, attr, name, extra=None):
    orig = getattr(owner, attr)

    @functools.wraps(orig)
    def timed(*a, **k):
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            return orig(*a, **k)
        finally:
            EVENTS.append((name, t0, time.perf_counter(), c0, time.process_time(),
                           extra(a, k) if extra else None))
    setattr(owner, attr, timed)


def _install() -> None:
    import importlib

    import torch.distributed as dist
    from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
    from megatron.core.optimizer import optimizer as opt
    from megatron.core.pipeline_parallel import p2p_communication as p2p
    from megatron.core.pipeline_parallel import schedules
    from megatron.training import training

    fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")

    def group_size(a, k):
        try:
            return dist.get_world_size(a[2] if len(a) > 2 else k.get("group"))
        except Exception:  # noqa: BLE001 - an odd call signature
            return None

    _wrap(dist, "all_reduce", "all_reduce", group_size)
    _wrap(schedules, "forward_step", "F")
    _wrap(schedules, "backward_step", "B")
    for m in dir(p2p.P2PCommunicator):
        if m.startswith(("send_", "recv_")):
            _wrap(p2p.P2PCommunicator, m, "p2p:" + m)
    _wrap(training, "finalize_model_grads", "finalize")
    _wrap(DistributedDataParallel, "finish_grad_sync", "dp_sync")
    _wrap(fmg, "_allreduce_word_embedding_grads", "embedding_ar")
    _wrap(opt.MixedPrecisionOptimizer, "prepare_grads", "opt_prepare")
    _wrap(opt.MixedPrecisionOptimizer, "step_with_ready_grads", "opt_update")
    _wrap(opt, "get_grad_norm_fp32", "grad_norm")
    _wrap(training, "train_step", "train_step")
    _wrap(training, "training_log", "training_log")


def _dump(out: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    rank = dist.get_rank()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "stage": ps.get_pipeline_model_parallel_rank(),
                   "type": os.environ.get("POSEIDON_DEVICE_TYPE"), "events": EVENTS}, f)


def train_role(out: str) -> None:
    import atexit
    import runpy

    _install()
    atexit.register(_dump, out)
    script = os.path.join(ROOT, "examples", "pretrain_gpt.py")
    sys.argv[0] = script
    runpy.run_path(script, run_name="__main__")


# ---------------------------------------------------------------------------------- analysis

def _ms(x: float) -> float:
    return 1e3 * x


def analyse(out: str, skip: int = 1) -> None:
    sys.path.insert(0, ROOT)
    from poseidon_plugin.iteration_fit import retimed_ms
    from poseidon_plugin.plan import Plan

    plan = Plan.from_json(open(os.path.join(out, "plan.json")).read())
    ranks = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(out, "rank*.json")))]
    steps = {r["rank"]: sorted((e for e in r["events"] if e[0] == "train_step"),
                               key=lambda e: e[1]) for r in ranks}
    n_it = min(len(s) for s in steps.values())
    n = plan.pp
    per = {s: {"F": [], "B": [], "Fc": [], "Bc": []} for s in range(n)}
    for r in ranks:
        for t in steps[r["rank"]][skip:]:
            for e in r["events"]:
                if e[0] in ("F", "B") and t[1] <= e[1] <= t[2]:
                    per[r["stage"]][e[0]].append(_ms(e[2] - e[1]))
                    per[r["stage"]][e[0] + "c"].append(_ms(e[4] - e[3]))
    m = plan.num_microbatches
    print(f"plan: {plan.schedule} pp={n} dp={plan.dp} m={m}, predicted "
          f"{plan.predicted_iteration_time_ms:.1f} ms")
    print("stage  type        plan F/B ms     measured wall F/B (mean)  CPU F/B      wall/CPU")
    ratios_f, ratios_b = [], []
    for s, sp in enumerate(plan.stages):
        # per micro-batch: chunks of a device summed (ops per iteration / micro-batches)
        fw = sum(per[s]["F"]) / (len(per[s]["F"]) / plan.virtual_stages)
        bw = sum(per[s]["B"]) / (len(per[s]["B"]) / plan.virtual_stages)
        fc = sum(per[s]["Fc"]) / (len(per[s]["Fc"]) / plan.virtual_stages)
        bc = sum(per[s]["Bc"]) / (len(per[s]["Bc"]) / plan.virtual_stages)
        ratios_f.append(fw / sp.forward_ms)
        ratios_b.append(bw / sp.backward_ms)
        print(f"{s:>5}  {sp.device_type:<10} {sp.forward_ms:6.1f}/{sp.backward_ms:6.1f}   "
              f"{fw:6.1f}/{bw:6.1f}                 {fc:5.1f}/{bc:5.1f}    "
              f"{(fw + bw) / (fc + bc):.2f}")
    pipe = retimed_ms(plan, ratios_f, ratios_b)
    # an iteration's time as the live calibration takes it: its period (start to the next
    # start), the mean over the ranks
    periods = [st.fmean(_ms(steps[r][k + 1][1] - steps[r][k][1]) for r in steps)
               for k in range(n_it - 1)]
    meas = st.fmean(periods[skip:])
    print(f"pipeline re-timed with the measured compute (plan's DP all-reduce + optimizer, no "
          f"overhead): {pipe:.1f} ms; measured iteration (mean period of iterations "
          f"{skip + 1}-{n_it - 1}): {meas:.1f} ms; the rest: {meas - pipe:.1f} ms")
    print(f"plan's post-pipeline term per stage: "
          + ", ".join(f"s{s.index} {s.allreduce_ms:.1f} + {s.optimizer_ms:.1f} ms"
                      for s in plan.stages))
    print("per rank, mean over the iterations (ms): tail = last op to the end of train_step")
    print("rank stage  tail  finalize(dp/emb)  grad-norm  update  rest   p2p-wait  outside")
    for r in ranks:
        ev = r["events"]
        rows = []
        ss = steps[r["rank"]]
        for k in range(skip, n_it):
            t = ss[k]
            inside = [e for e in ev if t[1] <= e[1] <= t[2]]
            if not any(e[0] in ("F", "B") for e in inside):
                continue   # after the live calibration reported (it unwraps forward/backward)
            last = max(e[2] for e in inside if e[0] in ("F", "B"))
            g = {nm: sum(_ms(e[2] - e[1]) for e in inside if e[0] == nm)
                 for nm in ("finalize", "dp_sync", "embedding_ar", "grad_norm", "opt_update",
                            "opt_prepare")}
            p2p = sum(_ms(e[2] - e[1]) for e in inside if e[0].startswith("p2p:"))
            tail = _ms(t[2] - last)
            rest = tail - g["finalize"] - g["grad_norm"] - g["opt_update"] - g["opt_prepare"]
            outside = _ms(ss[k + 1][1] - t[2]) if k + 1 < len(ss) else float("nan")
            rows.append((tail, g["finalize"], g["dp_sync"], g["embedding_ar"], g["grad_norm"],
                         g["opt_update"] + g["opt_prepare"], rest, p2p, outside))
        mean = [st.fmean(x for x in col if x == x) if any(x == x for x in col) else float("nan")
                for col in zip(*rows)]
        print(f"{r['rank']:>4} {r['stage']:>5} {mean[0]:6.1f}  {mean[1]:5.1f} ({mean[2]:4.1f}/"
              f"{mean[3]:4.1f})  {mean[4]:8.1f}  {mean[5]:6.1f} {mean[6]:5.1f}  {mean[7]:8.1f}"
              f"  {mean[8]:6.1f}")
    _handoffs(ranks, plan, skip * m)


def _handoffs(ranks: list, plan, skip_msgs: int) -> None:
    """Delay of each p2p hand-off whose receiver was already waiting: its receive returned this
    long after the matching send was posted (1f1b, the order megatron-core pairs them in)."""
    if plan.virtual_stages > 1:
        return
    by_rank = {r["rank"]: r for r in ranks}
    stage_of = {r["rank"]: r["stage"] for r in ranks}
    calls = lambda r, names: sorted((e for e in by_rank[r]["events"] if e[0] in names),
                                    key=lambda e: e[1])
    sf = ("p2p:send_forward", "p2p:send_forward_recv_backward")
    rf = ("p2p:recv_forward", "p2p:send_backward_recv_forward")
    sb = ("p2p:send_backward", "p2p:send_backward_recv_forward")
    rb = ("p2p:recv_backward", "p2p:send_forward_recv_backward")
    delays = []
    for a in by_rank:
        for b in by_rank:
            if stage_of[b] != stage_of[a] + 1 or b - a != plan.dp * plan.stages[0].tp:
                continue
            for snd, rcv in ((calls(a, sf), calls(b, rf)), (calls(b, sb), calls(a, rb))):
                pairs = list(zip(snd, rcv))[skip_msgs:]
                delays += [_ms(r[2] - max(s[1], r[1])) for s, r in pairs]
    if delays:
        delays.sort()
        print(f"p2p hand-offs: {len(delays)}, delay median {st.median(delays):.2f} ms, mean "
              f"{st.fmean(delays):.2f} ms, 90th percentile {delays[int(0.9 * len(delays))]:.2f} "
              f"ms, max {delays[-1]:.1f} ms")


def launch(out: str, iters: str) -> int:
    os.makedirs(out, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "DEMO_BREAKDOWN_DIR": out,
           "POSEIDON_PROFILE_DIR": os.environ.get("POSEIDON_PROFILE_DIR")
           or os.path.join(out, "profiles")}
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--nproc-per-node", "4", "--master-addr", "127.0.0.1", "--master-port",
           str(29500 + os.getpid() % 2000), "-m", "poseidon_plugin.launch",
           os.path.abspath(__file__), *DEMO_ARGS, "--train-iters", iters, "--poseidon-auto",
           "--poseidon-emulate", os.path.join(ROOT, "examples", "emulate-2types.yaml"),
           "--poseidon-save-plan", os.path.join(out, "plan.json")]
    with open(os.path.join(out, "log.txt"), "w") as log:
        rc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    with open(os.path.join(out, "log.txt"), errors="replace") as log:
        for line in log:
            if "calibration: iteration" in line or "host contention" in line:
                print(line.rstrip())
    return rc


if __name__ == "__main__":
    if os.environ.get("DEMO_BREAKDOWN_DIR"):
        train_role(os.environ["DEMO_BREAKDOWN_DIR"])
    else:
        if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
            sys.exit("usage: benchmarks/demo_breakdown.py OUTDIR [--train-iters N]")
        iters = sys.argv[sys.argv.index("--train-iters") + 1] if "--train-iters" in sys.argv \
            else "8"
        if launch(sys.argv[1], iters) != 0:
            sys.exit(f"the launch failed; see {sys.argv[1]}/log.txt")
        analyse(sys.argv[1])
