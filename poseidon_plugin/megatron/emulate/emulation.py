"""CPU emulation of a heterogeneous accelerator cluster (``--poseidon-emulate FILE``).

Two independent pieces:

* **CPU shims** (:func:`install_cpu_shims`): megatron-core and megatron.training assume CUDA. A
  :class:`torch.overrides.TorchFunctionMode` redirects every ``device="cuda"`` / ``device=<int>`` /
  ``tensor.cuda()`` / ``tensor.to("cuda")`` to the CPU, and the ``torch.cuda`` entry points Megatron
  calls (``is_available``, ``current_device``, ``Event``, ``Stream``, RNG state, memory statistics, ...)
  are replaced by CPU equivalents. Megatron's RNG tracker then forks the CPU generator instead of a
  CUDA one. The collectives run on gloo.
* **Device-type emulation** (:func:`install_slowdown`): the emulation file assigns a device type to
  every launch rank and a relative speed to every type. Each transformer layer's forward and backward
  are padded with ``sleep`` so that their compute takes ``measured / speed`` seconds (compute = wall
  time capped by the process's CPU time, so waiting in collectives is not scaled); training feels
  them. The profiler suspends the padding and computes the same emulated time from the CPU time
  (``profiler.EmulatedClock``), so its numbers do not depend on the host's other load.

File format (YAML)::

    device_types:
      emu-fast: {speed: 1.0, memory_gib: 16}
      emu-slow: {speed: 0.25, memory_gib: 16}
    ranks: [emu-slow, emu-slow, emu-fast, emu-fast]   # device type of each launch RANK
    hosts: [node-a, node-a, node-b, node-b]           # optional: emulated host of each RANK

A device slowing down mid-run: ``POSEIDON_EMULATE_SLOWDOWN_FILE=PATH`` names a file of lines
``LAUNCH_RANK FACTOR``; while it says so, that rank's padding is its type's slowdown x FACTOR
(re-read whenever the file changes; the straggler tests write it during training).

This is a rehearsal tool: a laptop can run the whole ``--poseidon-auto`` flow (discovery, profiling,
search, renumbering, argv rewrite, training) before a real cluster is booked.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import types
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from poseidon_plugin.errors import SpecError

# ----------------------------------------------------------------------------------------------
# the emulation file
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EmulatedType:
    name: str
    speed: float          # relative to the host CPU: 1.0 = as fast as the host, 0.25 = 4x slower
    memory_gib: float

    @property
    def slowdown(self) -> float:
        return 1.0 / self.speed


@dataclass(frozen=True)
class EmulationSpec:
    types: Mapping[str, EmulatedType]
    ranks: tuple[str, ...]              # device type per launch rank
    hosts: tuple[str, ...] = ()         # emulated host name per launch rank ('' = real host)
    source: str = "<dict>"

    def type_of(self, rank: int) -> EmulatedType:
        if rank >= len(self.ranks):
            raise SpecError(self.source, "ranks", f"a device type for launch rank {rank} "
                            f"(the list has {len(self.ranks)} entries; WORLD_SIZE is larger)")
        return self.types[self.ranks[rank]]

    def host_of(self, rank: int) -> str | None:
        if rank < len(self.hosts) and self.hosts[rank]:
            return self.hosts[rank]
        return None


def emulation_from_dict(data: Mapping[str, Any], source: str = "<dict>") -> EmulationSpec:
    if not isinstance(data, Mapping):
        raise SpecError(source, "<root>", "a mapping with device_types and ranks", type(data).__name__)
    raw_types = data.get("device_types")
    if not isinstance(raw_types, Mapping) or not raw_types:
        raise SpecError(source, "device_types", "a non-empty mapping {name: {speed, memory_gib}}", raw_types)
    types_: dict[str, EmulatedType] = {}
    for name, body in raw_types.items():
        if not isinstance(body, Mapping):
            raise SpecError(source, f"device_types.{name}", "a mapping {speed, memory_gib}", body)
        speed = body.get("speed", 1.0)
        mem = body.get("memory_gib", 16.0)
        if not isinstance(speed, (int, float)) or isinstance(speed, bool) or not 0 < speed <= 1.0:
            raise SpecError(source, f"device_types.{name}.speed",
                            "a number in (0, 1] (relative to the host; emulation can only slow down)", speed)
        if not isinstance(mem, (int, float)) or isinstance(mem, bool) or mem <= 0:
            raise SpecError(source, f"device_types.{name}.memory_gib", "a number > 0", mem)
        unknown = set(body) - {"speed", "memory_gib"}
        if unknown:
            raise SpecError(source, f"device_types.{name}", "only the keys speed, memory_gib",
                            sorted(unknown))
        types_[str(name)] = EmulatedType(str(name), float(speed), float(mem))
    ranks = data.get("ranks")
    if not isinstance(ranks, (list, tuple)) or not ranks:
        raise SpecError(source, "ranks", "a non-empty list of device type names, one per launch rank", ranks)
    for i, t in enumerate(ranks):
        if t not in types_:
            raise SpecError(source, f"ranks[{i}]", f"one of {sorted(types_)}", t)
    hosts = data.get("hosts", [])
    if not isinstance(hosts, (list, tuple)) or (hosts and len(hosts) != len(ranks)):
        raise SpecError(source, "hosts", f"a list of {len(ranks)} host names (one per rank)", hosts)
    unknown = set(data) - {"device_types", "ranks", "hosts"}
    if unknown:
        raise SpecError(source, "<root>", "only the keys device_types, ranks, hosts", sorted(unknown))
    return EmulationSpec(types_, tuple(str(r) for r in ranks), tuple(str(h) for h in hosts), source)


def load_emulation(path: str) -> EmulationSpec:
    from poseidon_plugin.specfile import load_yaml

    # bounded like a cluster file: size, depth, aliases, duplicate keys, UTF-8
    return emulation_from_dict(load_yaml(path, "emulation"), source=path)


# ----------------------------------------------------------------------------------------------
# CPU shims for torch.cuda
# ----------------------------------------------------------------------------------------------

_SHIMS_INSTALLED = False
_MODE = None


def _is_accel(dev: Any) -> bool:
    import torch

    if isinstance(dev, bool):
        return False
    if isinstance(dev, int):
        return True
    if isinstance(dev, str):
        return dev.split(":")[0] in ("cuda", "npu")
    if isinstance(dev, torch.device):
        return dev.type in ("cuda", "npu")
    return False


class _WallEvent:
    """torch.cuda.Event on the wall clock."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                 **_: Any) -> None:
        self._t: float | None = None

    def record(self, stream: Any = None) -> None:
        self._t = time.perf_counter()

    def elapsed_time(self, end: "_WallEvent") -> float:
        if self._t is None or end._t is None:
            raise RuntimeError("event not recorded")
        return (end._t - self._t) * 1e3

    def synchronize(self) -> None: ...
    def wait(self, stream: Any = None) -> None: ...
    def query(self) -> bool:
        return True


class _FakeStream:
    def __init__(self, *_: Any, **__: Any) -> None: ...
    def wait_stream(self, *_: Any) -> None: ...
    def wait_event(self, *_: Any) -> None: ...
    def record_event(self, event: Any = None) -> _WallEvent:
        ev = event or _WallEvent()
        ev.record()
        return ev
    def synchronize(self) -> None: ...
    def query(self) -> bool:
        return True
    def __enter__(self) -> "_FakeStream":
        return self
    def __exit__(self, *_: Any) -> None: ...


def _make_mode():
    import torch
    from torch.overrides import TorchFunctionMode

    cpu = torch.device("cpu")
    identity = {torch.Tensor.cuda, torch.Tensor.pin_memory}
    if hasattr(torch.Tensor, "npu"):
        identity.add(torch.Tensor.npu)
    tensor_to = torch.Tensor.to
    tensor_type = torch.Tensor.type
    import torch.distributed as dist

    all_to_all_single = getattr(dist, "all_to_all_single", None)

    class CpuRedirectMode(TorchFunctionMode):
        """Send every accelerator placement to the CPU."""

        def __torch_function__(self, func, types_, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func in identity:
                return args[0]
            if (func is tensor_type or func is torch.Tensor.type) and len(args) == 1 \
                    and not kwargs:
                # Megatron's fp16/bf16 optimizer checks param.type() == 'torch.cuda.BFloat16Tensor'.
                # torch hands a Tensor method's *current* attribute to this mode: MindSpeed
                # replaces torch.Tensor.type with a wrapper (its 'npu' -> 'cuda' rename), so the
                # wrapper arrives here, not the method captured above.
                name = func(*args)
                return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
            if func is tensor_to:
                args = tuple(cpu if (i > 0 and _is_accel(a)) else a for i, a in enumerate(args))
            if func is all_to_all_single or (
                    getattr(func, "__name__", None) == "all_to_all_single"
                    and (getattr(func, "__module__", None) or "").startswith(("torch.distributed",
                                                                    "mindspeed"))):
                # megatron-core's alltoall MoE dispatcher moves its split sizes to the host only
                # from a CUDA tensor (moe_utils.maybe_move_tensor_to_cpu): on the CPU they stay
                # tensors, which gloo's binding does not take; lists are what it would pass.
                # By name too: MindSpeed-LLM wraps torch.distributed's function after the shims
                # are installed (its high_availability communication patch, functools.wraps)
                args = tuple(a.tolist() if i in (2, 3) and torch.is_tensor(a) else a
                             for i, a in enumerate(args))
                for k in ("output_split_sizes", "input_split_sizes"):
                    if torch.is_tensor(kwargs.get(k)):
                        kwargs[k] = kwargs[k].tolist()
            dev = kwargs.get("device")
            if dev is not None and _is_accel(dev):
                kwargs["device"] = cpu
            return func(*args, **kwargs)

    return CpuRedirectMode()


def shims_installed() -> bool:
    """Whether this process runs ``torch.cuda`` on the CPU (:func:`install_cpu_shims`)."""
    return _SHIMS_INSTALLED


def install_cpu_shims(*, local_rank: int = 0, device_count: int = 1, device_name: str = "cpu",
                      memory_bytes: int = 16 << 30) -> None:
    """Make ``torch.cuda`` (as megatron-core uses it) run on the CPU. Idempotent; process-wide."""
    global _SHIMS_INSTALLED, _MODE
    if _SHIMS_INSTALLED:
        return
    import torch

    state = {"device": local_rank}
    patches = _cuda_patches(state, device_count, device_name, memory_bytes)
    for name, value in patches.items():
        setattr(torch.cuda, name, value)
    for name in ("get_rng_state", "set_rng_state", "manual_seed", "manual_seed_all",
                 "get_rng_state_all", "set_rng_state_all"):
        setattr(torch.cuda.random, name, patches[name])
    _keep_off_the_accelerator(state)
    _MODE = _make_mode()
    _MODE.__enter__()  # stays active for the whole process
    _patch_megatron_rng()
    _SHIMS_INSTALLED = True


def _cuda_patches(state: dict[str, Any], device_count: int, device_name: str,
                  memory_bytes: int) -> dict[str, Any]:
    """``torch.cuda`` attribute -> CPU stand-in (``state["device"]``: the current device)."""
    import torch

    props = types.SimpleNamespace(name=device_name, total_memory=int(memory_bytes), major=9, minor=0,
                                  multi_processor_count=1, gcnArchName="", uuid="emulated")
    cpu_gen = torch.default_generator

    def set_device(dev: Any) -> None:
        state["device"] = dev.index if isinstance(dev, torch.device) and dev.index is not None else (
            dev if isinstance(dev, int) else state["device"])

    def get_rng_state(device: Any = "cuda") -> torch.Tensor:
        return cpu_gen.get_state()

    def set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
        cpu_gen.set_state(new_state)

    def manual_seed(seed: int) -> None:
        cpu_gen.manual_seed(int(seed))

    nvtx = types.SimpleNamespace(range_push=lambda *a, **k: None, range_pop=lambda *a, **k: None,
                                 range=lambda *a, **k: contextlib.nullcontext(),
                                 mark=lambda *a, **k: None)
    patches: dict[str, Any] = dict(
        is_available=lambda: True,
        is_initialized=lambda: True,
        device_count=lambda: device_count,
        current_device=lambda: state["device"],
        set_device=set_device,
        synchronize=lambda *a, **k: None,
        empty_cache=lambda: None,
        ipc_collect=lambda: None,
        Event=_WallEvent,
        Stream=_FakeStream,
        current_stream=lambda *a, **k: _FakeStream(),
        default_stream=lambda *a, **k: _FakeStream(),
        stream=lambda *a, **k: contextlib.nullcontext(),
        set_stream=lambda *a, **k: None,
        device=lambda *a, **k: contextlib.nullcontext(),
        get_device_name=lambda *a, **k: device_name,
        get_device_properties=lambda *a, **k: props,
        get_device_capability=lambda *a, **k: (9, 0),
        mem_get_info=lambda *a, **k: (int(memory_bytes), int(memory_bytes)),
        memory_allocated=lambda *a, **k: 0,
        max_memory_allocated=lambda *a, **k: 0,
        memory_reserved=lambda *a, **k: 0,
        max_memory_reserved=lambda *a, **k: 0,
        memory_stats=lambda *a, **k: {},
        reset_peak_memory_stats=lambda *a, **k: None,
        reset_max_memory_allocated=lambda *a, **k: None,
        get_rng_state=get_rng_state,
        set_rng_state=set_rng_state,
        get_rng_state_all=lambda: [cpu_gen.get_state()],
        set_rng_state_all=lambda states: cpu_gen.set_state(states[0]),
        manual_seed=manual_seed,
        manual_seed_all=manual_seed,
        seed=lambda: None,
        initial_seed=lambda: cpu_gen.initial_seed(),
        default_generators=(cpu_gen,),
        is_current_stream_capturing=lambda: False,
        _lazy_call=lambda cb, **k: cb(),
        _lazy_init=lambda: None,
        nvtx=nvtx,
    )
    return patches


def _keep_off_the_accelerator(state: dict[str, Any]) -> None:
    """No CUDA context, no torch.accelerator probe, no torch.compile probing the real device."""
    import torch

    # torch.accelerator (DataLoader pinning, dynamo) must not reach the CUDA runtime either.
    accel = getattr(torch, "accelerator", None)
    if accel is not None:
        accel.is_available = lambda: False
        accel.current_device_index = lambda: state["device"] if isinstance(state["device"], int) else 0
        accel.synchronize = lambda *a, **k: None
    # A CUDA context must never be created; a stray accelerator call should fail loudly, not hang.
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    # torch.compile (Megatron's jit_fuser) would probe the real accelerator; run eagerly instead.
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    try:
        import torch._dynamo

        torch._dynamo.config.disable = True
    except Exception:  # pragma: no cover - very old torch
        pass


def _patch_megatron_rng() -> None:
    """megatron.core.tensor_parallel.random keeps name copies of torch.cuda helpers."""
    import importlib

    import torch

    try:
        rnd = importlib.import_module("megatron.core.tensor_parallel.random")
    except ImportError:  # megatron not installed: the shims still serve plain torch code
        return
    gen = torch.default_generator

    def _get(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return gen.get_state()

    def _set(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
        gen.set_state(new_state)

    # The emulated device generator *is* the CPU generator, so Megatron's check "CPU RNG state
    # changed within GPU RNG context" fires on every fork; it is expected here, not a bug.
    import logging

    class _DropExpected(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return "CPU RNG state changed within GPU RNG context" not in record.getMessage()

    logging.getLogger(rnd.__name__).addFilter(_DropExpected())
    rnd._get_cuda_rng_state = _get
    rnd._set_cuda_rng_state = _set
    rnd._lazy_call = lambda cb, **k: cb()
    rnd._lazy_init = lambda: None
    rnd.device_ctx_manager = lambda *a, **k: contextlib.nullcontext()


# ----------------------------------------------------------------------------------------------
# slowing transformer layers down to an emulated device type
# ----------------------------------------------------------------------------------------------

_SLOWDOWN = {"factor": 1.0}
_EMULATED = {"on": False}   # install_slowdown was called (any factor, 1.0 included)
_SLOWDOWN_INSTALLED = False
_TLS = threading.local()


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _work_s(start: tuple[float, float]) -> float:
    """Compute time since ``start``: wall time, but never more than the CPU time the process spent.

    Waiting (a tensor-parallel all-reduce waiting for a partner that is itself padding, or being
    descheduled on an oversubscribed CPU) burns no CPU, so it is not multiplied; otherwise padding
    would feed on the partner's padding and grow without bound.
    """
    wall, cpu = time.perf_counter() - start[0], time.process_time() - start[1]
    return max(0.0, min(wall, cpu))


# A device slowing down mid-run (tests of the straggler monitor): the file this names holds
# lines ``LAUNCH_RANK FACTOR``; the rank's padding is its type's slowdown x FACTOR while the file
# says so (re-read whenever it changes, checked at every padded op; no file / no line: x 1).
SLOWDOWN_FILE_ENV = "POSEIDON_EMULATE_SLOWDOWN_FILE"
_LIVE = {"mtime": None, "factor": 1.0, "suspended": False}


def live_factor() -> float:
    """This rank's extra slowdown from :data:`SLOWDOWN_FILE_ENV`'s file (1.0 without one)."""
    path = os.environ.get(SLOWDOWN_FILE_ENV)
    if not path or _LIVE["suspended"]:
        return 1.0
    try:
        mtime = os.stat(path).st_mtime_ns
    except OSError:
        return 1.0
    if mtime != _LIVE["mtime"]:
        me = os.environ.get("POSEIDON_LAUNCH_RANK") or os.environ.get("RANK", "0")
        factor = 1.0
        try:
            with open(path, encoding="utf-8") as f:
                for line in f:
                    parts = line.split()
                    if len(parts) == 2 and parts[0] == me:
                        factor = max(1.0, float(parts[1]))
        except (OSError, ValueError):
            return _LIVE["factor"]   # half written: the previous value until it is whole
        _LIVE["mtime"], _LIVE["factor"] = mtime, factor
    return _LIVE["factor"]


def _pad(work_s: float) -> None:
    extra = work_s * (_SLOWDOWN["factor"] * live_factor() - 1.0)
    if extra > 0:
        time.sleep(extra)


def slowdown_factor() -> float | None:
    """The emulated type's slowdown of this process (None: no emulation installed)."""
    return _SLOWDOWN["factor"] if _EMULATED["on"] else None


@contextlib.contextmanager
def padding_suspended():
    """No sleeping inside the block (the profiler computes the emulated time itself)."""
    saved = _SLOWDOWN["factor"], _LIVE["suspended"]
    _SLOWDOWN["factor"], _LIVE["suspended"] = 1.0, True
    try:
        yield
    finally:
        _SLOWDOWN["factor"], _LIVE["suspended"] = saved


def install_slowdown(factor: float) -> None:
    """Pad every megatron-core TransformerLayer forward and backward to ``factor`` x its real time.

    Forward: timed around the call. Backward: a gradient hook on the layer's output marks the start
    of the layer's backward, one on its input marks the end (no extra autograd nodes or views, so
    Megatron's pipeline schedule can still free the output tensors). The layer class and each
    subclass with a ``forward`` of its own are wrapped (:func:`pad_transformer_layers`), now and
    after every TransformerBlock is built: a framework that puts its own subclass in
    megatron-core's place (MindSpeed-LLM v26.1.0 does, after this is installed, with a
    ``forward`` that never calls megatron-core's) is padded as well.
    """
    global _SLOWDOWN_INSTALLED
    _SLOWDOWN["factor"] = float(factor)
    _EMULATED["on"] = True
    if _SLOWDOWN_INSTALLED or (factor <= 1.0 and not os.environ.get(SLOWDOWN_FILE_ENV)):
        return
    _SLOWDOWN_INSTALLED = True
    pad_transformer_layers()
    _pad_when_blocks_are_built()


def _pad_when_blocks_are_built() -> None:
    """:func:`pad_transformer_layers` after every TransformerBlock is built: the classes its
    layers are made of are all loaded by then, whoever imported them (the training script, a
    framework's patches after the launch's), and none has run a forward yet."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    original = TransformerBlock.__init__
    if getattr(original, "_poseidon_padded", False):
        return

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        pad_transformer_layers()

    init.__wrapped__ = original  # type: ignore[attr-defined]
    init._poseidon_padded = True  # type: ignore[attr-defined]
    TransformerBlock.__init__ = init


def _layer_classes() -> list[type]:
    """megatron-core's TransformerLayer (the one it defines, wherever a framework's patch has
    moved its module attribute) and every loaded subclass of it."""
    from megatron.core.transformer import transformer_layer

    current = transformer_layer.TransformerLayer
    base = next((c for c in current.__mro__ if c.__module__ == transformer_layer.__name__
                 and c.__name__ == "TransformerLayer"), current)
    found, todo = [], [base]
    while todo:
        cls = todo.pop()
        if cls not in found:
            found.append(cls)
            todo.extend(cls.__subclasses__())
    return found


def pad_transformer_layers() -> int:
    """Wraps the ``forward`` of every TransformerLayer class not yet wrapped (:func:`_layer_classes`;
    only a class's own ``forward``). A layer whose ``forward`` calls its parent's is padded once:
    the outermost wrapped call pads, the calls inside it do not. Returns how many were wrapped
    now; nothing before :func:`install_slowdown`."""
    if not _SLOWDOWN_INSTALLED:
        return 0
    wrapped = 0
    for cls in _layer_classes():
        fwd = cls.__dict__.get("forward")
        if fwd is None or getattr(fwd, "_poseidon_padded", False):
            continue
        cls.forward = _padded_forward(fwd)
        wrapped += 1
    return wrapped


def _padded_forward(orig_forward: Callable) -> Callable:
    def forward(self, *args: Any, **kwargs: Any):
        if getattr(_TLS, "in_layer", False):   # a parent's forward inside a padded one
            return orig_forward(self, *args, **kwargs)
        hs = args[0] if args else kwargs.get("hidden_states")
        t0 = _clock()
        _TLS.in_layer = True
        try:
            out = orig_forward(self, *args, **kwargs)
        finally:
            _TLS.in_layer = False
        _pad(_work_s(t0))
        out0 = out[0] if isinstance(out, tuple) else out
        if getattr(out0, "requires_grad", False) and getattr(hs, "requires_grad", False):
            key = id(self)

            def on_output_grad(g):  # first gradient of this layer's backward
                starts = _TLS.__dict__.setdefault("starts", {})
                starts[key] = _clock()
                return None

            def on_input_grad(g):  # the layer's backward is done
                t_start = _TLS.__dict__.setdefault("starts", {}).pop(key, None)
                if t_start is not None:
                    _pad(_work_s(t_start))
                return None

            out0.register_hook(on_output_grad)
            hs.register_hook(on_input_grad)
        return out

    forward.__wrapped__ = orig_forward  # type: ignore[attr-defined]
    forward._poseidon_padded = True     # type: ignore[attr-defined]
    return forward


# ----------------------------------------------------------------------------------------------
# pipeline sends under gloo on megatron-core < 0.19
# ----------------------------------------------------------------------------------------------

# megatron-core before 0.19: the interleaved schedule with overlap_p2p_comm frees a chunk's output
# (``deallocate_output_tensor``: its ``.data`` swapped for a 1-element tensor) while the isend of
# it may still be running; gloo reads the freed memory, which the CPU allocator hands out again at
# once, and the next stage receives garbage (NaN losses). 0.19 waits for the send first
# (schedules.py: "isend() copies asynchronously"). Under the CPU emulation each send goes from a
# private copy on these versions: what the schedule frees is no longer what gloo reads.
PRIVATE_SENDS_BEFORE = (0, 19)
P2P_MODULE = "megatron.core.pipeline_parallel.p2p_communication"


class _PrivateSendDistributed:
    """``torch.distributed`` as megatron-core's p2p module sees it: ``isend`` and the ``P2POp``
    of an isend send a copy of the tensor; everything else is torch's."""

    def __init__(self, dist: Any) -> None:
        self._dist = dist

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dist, name)

    def isend(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return self._dist.isend(tensor.detach().clone(), *args, **kwargs)

    def P2POp(self, op: Any, tensor: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N802
        if op == self.isend or op is self._dist.isend:   # a bound method: a new one each time
            return self._dist.P2POp(self._dist.isend, tensor.detach().clone(), *args, **kwargs)
        return self._dist.P2POp(op, tensor, *args, **kwargs)


class _PrivateSendTorch:
    """``torch`` with :class:`_PrivateSendDistributed` as its ``distributed``."""

    def __init__(self, torch_module: Any) -> None:
        self._torch = torch_module
        self.distributed = _PrivateSendDistributed(torch_module.distributed)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)


def megatron_core_release() -> tuple[int, int] | None:
    """(major, minor) of the imported megatron-core, None when unknown."""
    from poseidon_plugin.megatron import provenance

    version = provenance.megatron_core().version
    parts = version.split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or "x")
    except (IndexError, ValueError):
        return None


def private_pipeline_sends() -> bool:
    """Under the CPU emulation on megatron-core < 0.19 (:data:`PRIVATE_SENDS_BEFORE`): every
    pipeline send of megatron-core's p2p module goes from a private copy. Whether it does now
    (False on 0.19 and later, or without that module)."""
    import importlib

    release = megatron_core_release()
    if release is None or release >= PRIVATE_SENDS_BEFORE:
        return False
    try:
        p2p = importlib.import_module(P2P_MODULE)
    except ImportError:
        return False
    current = getattr(p2p, "torch", None)
    if isinstance(current, _PrivateSendTorch):
        return True
    if current is None or not hasattr(current, "distributed"):
        return False
    p2p.torch = _PrivateSendTorch(current)
    return True


# ----------------------------------------------------------------------------------------------
# the all-to-all dispatcher's split sizes on an emulated device
# ----------------------------------------------------------------------------------------------

DISPATCHER_MODULE = "megatron.core.transformer.moe.token_dispatcher"


def host_split_sizes() -> bool:
    """megatron-core's all-to-all token dispatcher moves its split sizes to the host with
    ``maybe_move_tensor_to_cpu(..., as_numpy=True)``, which converts only a tensor on the
    accelerator (``is_cuda``); the emulated device's tensors are CPU tensors, so on
    megatron-core 0.12 the splits stayed tensors and gloo's ``all_to_all_single`` refused them
    ("incompatible function arguments") at the first EP > 1 step. Under the emulation the
    dispatcher's helper hands the host copy as the accelerator's would be handed (a numpy array
    where asked). Whether it is wrapped now (False: no such helper in this megatron-core)."""
    import importlib

    import torch

    try:
        dispatcher = importlib.import_module(DISPATCHER_MODULE)
    except ImportError:
        return False
    original = getattr(dispatcher, "maybe_move_tensor_to_cpu", None)
    if original is None:
        return False
    if getattr(original, "_poseidon_host_splits", False):
        return True

    def to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        out = original(tensor, as_numpy=as_numpy, record_stream=record_stream)
        if as_numpy and torch.is_tensor(out):
            out = out.detach().cpu().numpy()
        return out

    to_host._poseidon_host_splits = True  # type: ignore[attr-defined]
    dispatcher.maybe_move_tensor_to_cpu = to_host
    return True
