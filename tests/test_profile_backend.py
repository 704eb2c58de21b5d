"""The collective backend TP groups are timed on: NCCL on a GPU, HCCL on an NPU, gloo on the CPU,
in the ``--poseidon-auto`` launch and in ``poseidon profile`` under torchrun; afterwards the
process groups are as the rest of the launch (and Megatron's ``initialize_megatron``) expect.

No GPU or NPU here: the devices are faked (``torch.cuda.is_available``, ``bootstrap.npu_module``)
and ``torch.distributed`` records the backend every default group and every group was asked for
(a group made without one, as megatron-core makes its TP groups, inherits the default group's),
with gloo underneath. megatron-core's own ``initialize_model_parallel`` makes the TP groups.
A last test runs the default-group switch for real, on gloo, with two processes
(integration: torch + megatron-core; about 30 s on a 2-core box)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.integration
torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

import torch.distributed as dist  # noqa: E402

from poseidon_plugin.errors import PoseidonError  # noqa: E402
from poseidon_plugin.megatron.launch import bootstrap, runner
from poseidon_plugin.megatron.profile import group_profile, offline, profiler  # noqa: E402
from poseidon_plugin.megatron.launch.options import PoseidonOptions  # noqa: E402
from poseidon_plugin.megatron.profile.profile_tps import Processes  # noqa: E402
from test_megatron_bootstrap import free_port  # noqa: E402
from test_launch_e2e import ROOT, TORCHRUN  # noqa: E402


class Backends:
    """``torch.distributed`` that records the backend asked for, and runs gloo underneath."""

    def __init__(self, monkeypatch) -> None:
        self.default: str | None = None      # what the current default group was asked for
        self.inits: list[str] = []           # every init_process_group's backend, in order
        self.groups: dict[int, tuple[str, object]] = {}   # id(group) -> (its backend, group)
        real_init, real_new = dist.init_process_group, dist.new_group
        real_destroy = dist.destroy_process_group

        def init_process_group(backend=None, *args, **kwargs):
            self.inits.append(backend)
            self.default = backend
            return real_init("gloo", *args, **kwargs)

        def new_group(*args, backend=None, **kwargs):
            group = real_new(*args, backend=None if backend in ("nccl", "hccl") else backend,
                             **kwargs)
            self.groups[id(group)] = (backend or self.default, group)
            return group

        def destroy_process_group(group=None):
            real_destroy(group)
            if group is None:
                self.default = None

        monkeypatch.setattr(dist, "init_process_group", init_process_group)
        monkeypatch.setattr(dist, "new_group", new_group)
        monkeypatch.setattr(dist, "destroy_process_group", destroy_process_group)

    def of(self, group) -> str:
        return self.groups[id(group)][0]


@pytest.fixture()
def backends(monkeypatch):
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)   # torch wraps it at every init
    out = Backends(monkeypatch)
    yield out
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture()
def seen(monkeypatch, backends):
    """``profiler.profile_rank`` replaced: per TP degree, megatron-core's own parallel state is
    set up (and torn down, as the profiler does) and what its TP group runs on is recorded."""
    from megatron.core import parallel_state

    calls: list[dict] = []

    def profile_rank(args, tps, micro_batch_sizes, *, world_size, rank, device, iters,
                     seed=1234, checkpoint=None, turns=None, contention=None, kinds=None,
                     progress=None):
        out = []
        for tp in tps:
            if checkpoint is not None:
                checkpoint(f"profiling-tp{tp}")
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
            try:
                tp_group = parallel_state.get_tensor_model_parallel_group()
                calls.append({"default": backends.default, "tp_group": backends.of(tp_group),
                              "device": device, "world": dist.group.WORLD})
                t = torch.ones(1)
                dist.all_reduce(t, group=tp_group)   # the group works
            finally:
                parallel_state.destroy_model_parallel()
            out += [profiler.LayerTiming(tp, b, 1.0, 2.0, 3, 4) for b in micro_batch_sizes]
        return out

    monkeypatch.setattr(profiler, "profile_rank", profile_rank)
    return calls


def one_rank_env() -> dict[str, str]:
    return {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}


def fake_cuda(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: SimpleNamespace(name="NVIDIA H100 80GB HBM3",
                                                      total_memory=80 << 30))


def fake_npu(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    npu = SimpleNamespace(set_device=lambda index: None,
                          get_device_properties=lambda index: SimpleNamespace(
                              name="Ascend910B", total_memory=64 << 30))
    monkeypatch.setattr(bootstrap, "npu_module", lambda: npu)


def no_accelerator(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(bootstrap, "npu_module", lambda: None)


# ----------------------------------------------------------------------------------------------
# the one backend rule
# ----------------------------------------------------------------------------------------------


def test_device_backend_rule():
    assert [bootstrap.device_backend(k) for k in ("cuda", "npu", "cpu", "emulated")] == \
        ["nccl", "hccl", "gloo", "gloo"]
    with pytest.raises(PoseidonError, match="no collective backend known for device kind 'xpu'"):
        bootstrap.device_backend("xpu")


# ----------------------------------------------------------------------------------------------
# the launch (--poseidon-auto)
# ----------------------------------------------------------------------------------------------


def launch_context(device: bootstrap.LocalDevice) -> runner.LaunchContext:
    """A started one-rank launch, as ``_all_ranks_profile`` finds it."""
    env = bootstrap.LaunchEnv.from_environ(one_rank_env())
    ctx = runner.LaunchContext("pretrain_gpt.py", [], PoseidonOptions(auto=True, timeout_s=30),
                               env, 0.0)
    ctx.device = device
    ctx.args = SimpleNamespace()
    ctx.tps = (1,)
    ctx.micro_batch_sizes = (1, 2)
    ctx.boot = bootstrap.Bootstrap(env, 30).start()
    return ctx


@pytest.mark.parametrize("kind, fake, backend", [
    ("cuda", fake_cuda, "nccl"),
    ("npu", fake_npu, "hccl"),
])
def test_launch_times_tp_groups_on_the_device_backend_then_hands_megatron_a_clean_state(
        monkeypatch, backends, seen, kind, fake, backend):
    from megatron.core import parallel_state

    fake(monkeypatch)
    device = bootstrap.setup_device(0)
    assert device.kind == kind
    if kind == "npu":   # torch.device("npu") needs torch_npu's device type
        monkeypatch.setattr(runner, "_torch_device", lambda d: ("npu", d.index))
    ctx = launch_context(device)
    probe = dist.group.WORLD
    assert backends.inits == ["gloo"]   # the probe group

    gathered = runner._all_ranks_measure(ctx)

    # timed with the default group on NCCL / HCCL, the TP group inheriting it (not gloo)
    (call,) = seen
    assert (call["default"], call["tp_group"]) == (backend, backend)
    assert call["world"] is not probe
    assert call["device"] == (torch.device("cuda", 0) if kind == "cuda" else ("npu", 0))
    assert [(t.tp, t.micro_batch_size) for t in gathered[0]] == [(1, 1), (1, 2)]
    # then a fresh gloo probe group is the default group again; the launch goes on with it
    assert backends.inits == ["gloo", backend, "gloo"]
    assert backends.default == "gloo" and ctx.boot.probe_up and dist.get_backend() == "gloo"
    assert ctx.boot.broadcast_object("plan", "plan-broadcast") == "plan"
    # and hands over what Megatron's initialize_megatron expects: torch.distributed initialised
    # once more on the training's backend (as runner._all_ranks_apply does), no model-parallel
    # state left
    ctx.boot.init_main(0, 1, bootstrap.device_backend(ctx.device.kind), 1)
    assert backends.inits == ["gloo", backend, "gloo", backend]
    assert dist.is_initialized() and backends.default == backend and not ctx.boot.probe_up
    assert not parallel_state.model_parallel_is_initialized()


def test_emulated_launch_times_tp_groups_on_the_gloo_probe_group(monkeypatch, backends, seen):
    no_accelerator(monkeypatch)
    device = bootstrap.setup_device(0, emulated_name="emu-fast", emulated_memory_bytes=1 << 30)
    ctx = launch_context(device)
    probe = dist.group.WORLD

    runner._all_ranks_measure(ctx)

    (call,) = seen
    assert (call["default"], call["tp_group"], call["device"]) == ("gloo", "gloo",
                                                                   torch.device("cpu"))
    assert call["world"] is probe and dist.group.WORLD is probe   # no switch: the probe group
    assert backends.inits == ["gloo"]
    ctx.boot.finish_probe()


def test_a_rank_failing_while_timing_on_the_device_group_leaves_no_group(monkeypatch, backends):
    fake_cuda(monkeypatch)
    ctx = launch_context(bootstrap.setup_device(0))

    def boom(*args, **kwargs):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(profiler, "profile_rank", boom)
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        runner._all_ranks_measure(ctx)
    # the NCCL group is gone and the probe group not re-made (that would wait for every rank);
    # the launch's error path (finish_probe) has nothing left to do
    assert backends.inits == ["gloo", "nccl"] and not dist.is_initialized()
    assert not ctx.boot.probe_up
    ctx.boot.finish_probe()


# ----------------------------------------------------------------------------------------------
# poseidon profile (the backend picked by the same rule)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fake, kind, backend", [
    (fake_cuda, "cuda", "nccl"),
    (fake_npu, "npu", "hccl"),
    (no_accelerator, "cpu", "gloo"),
])
def test_profile_command_times_tp_groups_on_the_device_backend(monkeypatch, tmp_path, backends,
                                                              seen, fake, kind, backend):
    fake(monkeypatch)
    assert offline._pick_device("auto") == kind
    for name, value in one_rank_env().items():
        monkeypatch.setenv(name, value)
    req = SimpleNamespace(timeout_s=30.0, micro_batch_sizes=(1,), iters=2, seed=1)
    gathered = offline._profile_group(req, (1,), SimpleNamespace(), kind, "dev",
                                      Processes(0, 1, 0, 1))
    (call,) = seen
    assert (call["default"], call["tp_group"]) == (backend, backend)
    assert len(gathered) == 1 and not dist.is_initialized()
    assert backends.inits == (["gloo"] if backend == "gloo" else ["gloo", backend, "gloo"])

    offline._init_alone(kind, str(tmp_path))   # one process: TP 1 on the same backend
    assert backends.default == backend
    dist.destroy_process_group()


def test_group_profile_switches_only_for_a_device_backend(monkeypatch, backends, seen):
    env = bootstrap.LaunchEnv.from_environ(one_rank_env())
    boot = bootstrap.Bootstrap(env, 30).start()
    try:
        for backend in ("gloo", "nccl", "hccl"):
            group_profile.profile_and_gather(boot, SimpleNamespace(), (1,), (1,), device="d",
                                             iters=1, backend=backend)
    finally:
        boot.finish_probe()
    assert [c["tp_group"] for c in seen] == ["gloo", "nccl", "hccl"]
    assert backends.inits == ["gloo", "nccl", "gloo", "hccl", "gloo"]


# ----------------------------------------------------------------------------------------------
# the switch for real: two processes, gloo standing in for NCCL
# ----------------------------------------------------------------------------------------------

SWITCH = textwrap.dedent("""
    import os, sys, warnings
    warnings.simplefilter("ignore")
    import torch, torch.distributed as dist
    from megatron.core import parallel_state
    from poseidon_plugin.errors import DistributedError
    from poseidon_plugin.megatron.launch import bootstrap

    env = bootstrap.LaunchEnv.from_environ()
    boot = bootstrap.Bootstrap(env, 20).start()
    fail = os.environ.get("FAIL_RANK") == str(env.rank)

    def timed():
        with boot.device_group("gloo"):   # production: NCCL / HCCL
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
            t = torch.ones(1)
            dist.all_reduce(t, group=parallel_state.get_tensor_model_parallel_group())
            parallel_state.destroy_model_parallel()
            assert t.item() == 2.0
            if fail:
                raise RuntimeError("injected")

    try:
        bootstrap.run_guarded(boot, "profiling", timed)
    except (RuntimeError, DistributedError) as e:
        print(f"rank {env.rank} FAILED {type(e).__name__}: {e}", flush=True)
        print(f"rank {env.rank} initialized={dist.is_initialized()} probe_up={boot.probe_up}",
              flush=True)
        sys.exit(3)
    got = boot.all_gather_object(env.rank, "gather")      # on the re-made probe group
    plan = boot.broadcast_object("plan" if env.rank == 0 else None, "plan")
    boot.init_main(1 - env.rank, 2, "gloo", 1)            # renumbered: ranks swapped
    t = torch.tensor([float(env.rank)])
    dist.all_reduce(t)
    print(f"rank {env.rank} OK gathered={got} plan={plan} new_rank={dist.get_rank()} "
          f"sum={t.item()}", flush=True)
    dist.destroy_process_group()
""")


def run_switch(tmp_path, extra_env: dict[str, str] | None = None):
    script = tmp_path / "switch.py"
    script.write_text(SWITCH)
    cmd = [TORCHRUN, "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
           str(free_port()), str(script)]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", **(extra_env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    return proc, proc.stdout + proc.stderr


def test_two_ranks_switch_the_default_group_and_back_for_real(tmp_path):
    proc, out = run_switch(tmp_path)
    assert proc.returncode == 0, out[-4000:]
    for rank in (0, 1):
        assert (f"rank {rank} OK gathered=[0, 1] plan=plan new_rank={1 - rank} sum=1.0"
                in out), out[-4000:]


def test_a_rank_failing_on_the_device_group_is_named_by_the_others(tmp_path):
    proc, out = run_switch(tmp_path, {"FAIL_RANK": "1"})
    assert proc.returncode != 0
    assert "rank 1 FAILED RuntimeError: injected" in out, out[-4000:]
    assert ("rank 0 FAILED DistributedError: rank 1 failed during profiling: RuntimeError: "
            "injected") in out, out[-4000:]
    for rank in (0, 1):
        assert f"rank {rank} initialized=False probe_up=False" in out, out[-4000:]
