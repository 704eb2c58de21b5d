"""Megatron's per-call p2p costs and per-op overheads measured at profiling time (``poseidon
profile`` and the ``--poseidon-auto`` launch), stored as the profile DB's ``p2p_calls`` and
``op_overheads`` records (``callcosts.py``); the search charges them.

Per-call costs, between two ranks (``a`` sends, ``b`` receives), with megatron-core's own
``P2PCommunicator`` calls on the pair's two-rank group (``send_forward`` / ``recv_forward``, the
round trip's ``send_backward`` / ``recv_backward``: its default ``batch_p2p_comm``, the ops
posted with ``torch.distributed.batch_isend_irecv``, then waited on, the receive buffer
allocated per call); without a pair group or on a megatron-core without ``P2PCommunicator``
(before 0.14) the bare ``batch_isend_irecv``; for one activation-sized message (``numel``
elements of ``dtype``), medians over ``reps`` after one warm-up:

- ``send_call_ms``: a send whose receiver has long posted its receive;
- ``recv_ready_ms``: a receive posted after the data was sent (no waiting for it);
- ``latency_ms``: half a send-then-receive round trip minus ``recv_ready_ms`` (>= 0).

On a GPU / NPU every timed call ends with a device synchronisation. One representative rank pair
per link kind the ranks offer (:func:`link_pairs`: ``intra-node``, ``inter-node``, ``cross-type``,
the link probe's pairs, ``discovery.probe_pairs``), at the activation bytes of each micro-batch
size (:func:`activation_messages`), one pair at a time (:func:`measure_link_calls`): the pair's
own group, behind a deadline barrier of the launch's store before each pair, so a rank that
never answers is named within the launch's timeout. The per-op overheads:
:func:`.op_overhead.measure_op_overheads` on every rank at once; :func:`measure_engine_costs`
runs both on the device's backend and gathers them.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Sequence

PAUSE_S = 0.004   # long enough for the other side to be waiting / the data to have arrived


def _call(ops) -> None:
    import torch.distributed as dist

    for req in dist.batch_isend_irecv(ops):
        req.wait()


def _megatron_calls(a: int, b: int, x: Any, group: Any, dtype: Any):
    """The four blocking calls as megatron-core issues them (``P2PCommunicator`` on the pair's
    own two-rank group: ``a``'s next and previous rank are ``b`` and the other way round):
    (send a -> b, receive on b from a, send b -> a, receive on a from b); None where this
    megatron-core has no ``P2PCommunicator`` (before 0.14) or without a group of two."""
    import torch.distributed as dist

    if group is None or dist.get_world_size(group) != 2:
        return None
    try:
        from megatron.core.model_parallel_config import ModelParallelConfig
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    except ImportError:
        return None
    config = ModelParallelConfig(pipeline_model_parallel_size=2, pipeline_dtype=dtype)
    p2p = P2PCommunicator(pp_group=group, config=config)
    shape = tuple(x.shape)
    got: dict[str, Any] = {}

    def recv_fwd() -> None:
        got["y"] = p2p.recv_forward(shape, is_first_stage=False)

    return (lambda: p2p.send_forward(x, is_last_stage=False), recv_fwd,
            lambda: p2p.send_backward(got["y"], is_first_stage=False),
            lambda: p2p.recv_backward(shape, is_last_stage=False))


def measure_p2p_call(a: int, b: int, numel: int, *, device: Any = None, dtype: Any = None,
                     reps: int = 8, group: Any = None) -> tuple[float, float, float] | None:
    """(send_call_ms, recv_ready_ms, latency_ms) on rank ``a`` (None on every other rank).
    ``group``: the process group of the barriers and calls (default: the default group, every
    rank of which calls this, the calls ``batch_isend_irecv``; with the pair's own group of
    two, only its members do, and the calls are megatron-core's ``P2PCommunicator``'s
    ``send_forward`` / ``recv_forward`` / ``send_backward`` / ``recv_backward`` where it has
    one: the calls training makes, their buffer allocation included)."""
    import torch
    import torch.distributed as dist

    from poseidon_plugin.megatron.profile.profiler import _sync

    me = dist.get_rank()
    dtype = dtype or torch.float32
    dev = device if device is not None else torch.device("cpu")
    x = torch.zeros(max(int(numel), 1), dtype=dtype, device=dev)
    y = torch.empty_like(x)
    calls = _megatron_calls(a, b, x, group, dtype) if me in (a, b) else None
    if calls is not None:
        send_to_b, recv_from_a, send_to_a, recv_from_b = calls
    else:
        ops = ([dist.P2POp(dist.isend, x, b, group=group)],
               [dist.P2POp(dist.irecv, y, a, group=group)],
               [dist.P2POp(dist.isend, y, a, group=group)],
               [dist.P2POp(dist.irecv, x, b, group=group)])
        send_to_b, recv_from_a, send_to_a, recv_from_b = (
            (lambda o=o: _call(o)) for o in ops)
    sc, rr, rt = [], [], []
    for _ in range(reps + 1):
        dist.barrier(group=group)
        if me == a:                              # 1. send into a posted receive
            time.sleep(PAUSE_S)
            t0 = time.perf_counter()
            send_to_b()
            _sync(dev)
            sc.append(time.perf_counter() - t0)
        elif me == b:
            recv_from_a()
            _sync(dev)
        dist.barrier(group=group)
        if me == b:                              # 2. receive of data already sent (b times it)
            time.sleep(PAUSE_S)
            t0 = time.perf_counter()
            recv_from_a()
            _sync(dev)
            rr.append(time.perf_counter() - t0)
        elif me == a:
            send_to_b()
            _sync(dev)
        dist.barrier(group=group)
        if me == a:                              # 3. round trip
            t0 = time.perf_counter()
            send_to_b()
            recv_from_b()
            _sync(dev)
            rt.append((time.perf_counter() - t0) / 2)
        elif me == b:
            recv_from_a()
            send_to_a()
            _sync(dev)
    # b's receive-ready times to a (on the device: NCCL / HCCL broadcast device tensors)
    got = torch.tensor([statistics.median(rr[1:]) if rr else 0.0], dtype=torch.float32,
                       device=dev)
    dist.broadcast(got, src=b, group=group)
    if me != a:
        return None
    ready = float(got.cpu()) * 1e3
    return (statistics.median(sc[1:]) * 1e3, ready,
            max(0.0, statistics.median(rt[1:]) * 1e3 - ready))


def p2p_call_records(device_type: str, link: str, message_bytes: dict[int, int], *,
                     a: int = 0, b: int = 1, device: Any = None, reps: int = 8,
                     group: Any = None) -> list:
    """``callcosts.P2PCall`` records of ``device_type`` over ``link`` for each message size
    (``{bytes: numel of bf16}``; measured in bf16 on a device, fp32 on the CPU: the bytes are
    the key either way), on rank ``a``; [] on the other ranks (``group``: as
    :func:`measure_p2p_call`)."""
    import torch
    import torch.distributed as dist

    from poseidon_plugin.callcosts import P2PCall

    on_cpu = getattr(device, "type", "cpu") == "cpu"
    out = []
    for nbytes in sorted(message_bytes):
        numel = nbytes // 4 if on_cpu else message_bytes[nbytes]
        got = measure_p2p_call(a, b, numel, device=device,
                               dtype=torch.float32 if on_cpu else torch.bfloat16, reps=reps,
                               group=group)
        if got is not None:
            out.append(P2PCall(device_type, link, int(nbytes), *got))
    dist.barrier(group=group)
    return out


LINK_OF_PROBE = {"intra": "intra-node", "inter": "inter-node", "cross": "cross-type"}


def link_pairs(topo: Any) -> list[tuple[str, str, int, int]]:
    """(link kind, device type of the sender, rank a, rank b): one representative pair per link
    kind of the launch's topology (``discovery.Topology``; the link probe's pairs: per type an
    intra-node and an inter-node pair where it has them, one cross-type pair)."""
    from poseidon_plugin.megatron.launch.discovery import probe_pairs

    return [(LINK_OF_PROBE[cat], topo.infos[a].device_type, a, b)
            for cat, _, a, b in probe_pairs(topo)]


def activation_messages(hidden_size: int, seq_lengths: Sequence[int],
                        micro_batch_sizes: Sequence[int]) -> dict[int, int]:
    """{message bytes: bf16 elements} of the activations a plan sends: b x seq x hidden for each
    micro-batch size (and sequence, e.g. seq / CP), the search's message size
    (``costs.CostModel.activation_bytes``)."""
    from poseidon_plugin.costs import BYTES_PER_ACTIVATION

    return {int(BYTES_PER_ACTIVATION * b * s * hidden_size): int(b * s * hidden_size)
            for b in micro_batch_sizes for s in seq_lengths}


def measure_link_calls(boot: Any, pairs: Sequence[tuple[str, str, int, int]],
                       messages: dict[int, int], *, device: Any = None,
                       reps: int = 8) -> list:
    """The ``P2PCall`` records of every pair (:func:`link_pairs`), on their ranks ``a`` ([]
    elsewhere). Every rank takes part: before each pair a deadline barrier of ``boot``
    (``bootstrap.Bootstrap``: a rank that never comes is named within its timeout), the pair's
    own group (its barriers time out after the same timeout), made by every rank."""
    from datetime import timedelta

    import torch.distributed as dist

    me = boot.env.rank
    out: list = []
    for i, (link, dtype, a, b) in enumerate(pairs):
        boot.barrier(f"p2p-calls-{i}")
        group = dist.new_group([a, b], timeout=timedelta(seconds=boot.timeout_s))
        if me in (a, b):
            out.extend(p2p_call_records(dtype, link, messages, a=a, b=b, device=device,
                                        reps=reps, group=group))
    boot.barrier("p2p-calls-done")
    return out


def measure_engine_costs(boot: Any, pairs: Sequence[tuple[str, str, int, int]],
                         messages: dict[int, int], *, device: Any, backend: str,
                         reps: int = 8) -> list[tuple[dict, list]]:
    """Every rank's (op overheads, p2p call records), by launch rank, on every rank: the op
    overheads (:func:`.op_overhead.measure_op_overheads`) and the pairs' calls on the device's
    backend (the default group switched to it, as the layers are timed:
    ``bootstrap.Bootstrap.device_group``; gloo on the CPU), each phase guarded
    (``op-overheads``, ``p2p-calls``: a rank that fails is named by the others), then gathered
    on the probe group."""
    import contextlib

    from poseidon_plugin.megatron.launch import bootstrap
    from poseidon_plugin.megatron.profile.op_overhead import measure_op_overheads

    def measure() -> tuple[dict, list]:
        with (boot.device_group(backend) if backend != "gloo" else contextlib.nullcontext()):
            boot.barrier("op-overheads-start")
            ov = bootstrap.run_guarded(boot, "op-overheads", lambda: measure_op_overheads(device))
            calls = bootstrap.run_guarded(
                boot, "p2p-calls",
                lambda: measure_link_calls(boot, pairs, messages, device=device, reps=reps))
            return ov, calls

    mine = bootstrap.run_guarded(boot, "engine-costs", measure)
    return bootstrap.run_guarded(boot, "engine-costs-gather",
                                 lambda: boot.all_gather_object(mine, "engine-costs-gather"))


def engine_cost_records(gathered: Sequence[tuple[dict, list]], type_of: dict[int, str]
                        ) -> tuple[list, list]:
    """(``callcosts.OpOverhead`` records, ``callcosts.P2PCall`` records) of the gathered
    measurements (:func:`measure_engine_costs`): each type's op overheads the median over its
    ranks, the call records as measured."""
    from poseidon_plugin.callcosts import OpOverhead

    per_type: dict[str, list[dict]] = {}
    calls: list = []
    for rank, (ov, recs) in enumerate(gathered):
        if ov:
            per_type.setdefault(type_of[rank], []).append(ov)
        calls.extend(recs)
    ops = [OpOverhead(t, float(statistics.median(o["forward_ms"] for o in ovs)),
                      float(statistics.median(o["backward_ms"] for o in ovs)))
           for t, ovs in sorted(per_type.items())]
    return ops, calls


def engine_costs_cached(db: Any, types: Sequence[str], pairs: Sequence[tuple[str, str, int, int]],
                        messages: dict[int, int]) -> bool:
    """Whether ``db`` holds measured op overheads of every type and a measured call record of
    every pair's (sender type, link kind) at every message size (then nothing is measured)."""
    ops = {o.device_type for o in db.op_overheads() if o.source == "measured"}
    calls = {c.key for c in db.p2p_calls() if c.source == "measured"}
    return (all(t in ops for t in types)
            and all((t, link, n) in calls for link, t, _, _ in pairs for n in messages))


__all__ = ["measure_p2p_call", "p2p_call_records", "link_pairs", "activation_messages",
           "measure_link_calls", "measure_engine_costs", "engine_cost_records",
           "engine_costs_cached"]
