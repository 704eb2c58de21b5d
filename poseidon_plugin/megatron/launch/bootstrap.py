"""Bring-up before Megatron: rendezvous store, store-based barriers with deadlines, the temporary
gloo probe group, device selection, and the re-initialisation with renumbered ranks.

Every wait has a deadline. A rank that raises posts its error to the store, so the others stop
waiting at the next barrier and name it; a rank that hangs or dies is named when the deadline
passes, with the phase it was last seen in.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator

from poseidon_plugin.errors import DistributedError, PeerRefusedError, PoseidonError, is_refusal

log = logging.getLogger("poseidon")

_POLL_S = 0.02


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    run_id: str
    use_agent_store: bool

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None,
                     needed_by: str = "--poseidon-auto") -> "LaunchEnv":
        env = dict(os.environ if environ is None else environ)
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
        if missing:
            raise PoseidonError(
                f"{needed_by} needs a distributed launch (torchrun, or the variables RANK, "
                f"WORLD_SIZE, MASTER_ADDR, MASTER_PORT); missing: {', '.join(missing)}")
        try:
            rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
            local_rank = int(env.get("LOCAL_RANK", "0"))
            local_world = int(env.get("LOCAL_WORLD_SIZE", str(world)))
            port = int(env["MASTER_PORT"])
        except ValueError as e:
            raise PoseidonError(f"malformed launch environment: {e}") from None
        if not 0 <= rank < world:
            raise PoseidonError(f"RANK={rank} is outside WORLD_SIZE={world}")
        restart = env.get("TORCHELASTIC_RESTART_COUNT", "0")
        run_id = f"{env.get('TORCHELASTIC_RUN_ID', 'local')}.{restart}"
        return cls(rank, world, local_rank, local_world, env["MASTER_ADDR"], port, run_id,
                   env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true")


def connect_store(env: LaunchEnv, timeout_s: float):
    """The launch's key-value store: torchrun's agent store, or a TCPStore on MASTER_ADDR:PORT."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if env.use_agent_store:
        store, _, _ = next(dist.rendezvous("env://", rank=env.rank, world_size=env.world_size,
                                           timeout=timeout))
        return store
    # Plain env launch: rank 0 hosts the store. Do not wait for every worker here (TCPStore's
    # default): the join barrier below does that with a deadline and names the missing ranks.
    try:
        return dist.TCPStore(env.master_addr, env.master_port, world_size=None,
                             is_master=env.rank == 0, timeout=timeout, wait_for_workers=False,
                             multi_tenant=True)
    except Exception as e:  # noqa: BLE001 - the store raises RuntimeError/DistStoreError variants
        raise DistributedError(f"rank {env.rank}: cannot reach the rendezvous store at "
                               f"{env.master_addr}:{env.master_port} within {timeout_s:g} s: {e}") from None


class StoreSync:
    """Barriers with deadlines, phase heartbeats and error posting on a (prefixed) store."""

    def __init__(self, store: Any, rank: int, world_size: int, prefix: str) -> None:
        import torch.distributed as dist

        self.rank = rank
        self.world_size = world_size
        self.store = dist.PrefixStore(prefix, store)
        self.phase = "start"
        self.names: dict[int, str] = {}   # rank -> "rank 3 (host h, local rank 3)" once known

    # -- naming ---------------------------------------------------------------------------------
    def describe(self, rank: int) -> str:
        return self.names.get(rank, f"rank {rank}")

    # -- heartbeats and errors ------------------------------------------------------------------
    def enter(self, phase: str) -> None:
        log.debug("phase %s", phase)
        self.phase = phase
        self.store.set(f"phase/{self.rank}", json.dumps({"phase": phase, "t": time.time()}))

    def post_error(self, message: str, refused: bool = False) -> None:
        """This rank's error for the others; ``refused``: it refused the user's input (the
        others then exit 2 as it does)."""
        try:
            self.store.set(f"error/{self.rank}", json.dumps({"phase": self.phase, "message": message,
                                                              "refused": refused}))
            self.store.add("errors", 1)
        except Exception:  # noqa: BLE001 - best effort while already failing
            pass

    def _errors(self) -> list[tuple[str, bool]]:
        """(line, refused) of each other rank's posted error."""
        if self.store.add("errors", 0) == 0:
            return []
        out = []
        for r in range(self.world_size):
            if r != self.rank and self.store.check([f"error/{r}"]):
                info = json.loads(self.store.get(f"error/{r}"))
                out.append((f"{self.describe(r)} failed during {info['phase']}: "
                            f"{info['message']}", bool(info.get("refused"))))
        return out

    def _last_seen(self, rank: int) -> str:
        if not self.store.check([f"phase/{rank}"]):
            return "never connected"
        info = json.loads(self.store.get(f"phase/{rank}"))
        return f"last seen entering {info['phase']!r} {time.time() - info['t']:.1f} s ago"

    # -- barrier --------------------------------------------------------------------------------
    def barrier(self, name: str, timeout_s: float, ranks: list[int] | None = None) -> None:
        """Wait until every rank in ``ranks`` (default: all) reached barrier ``name``.

        Raises DistributedError naming the ranks that failed (immediately) or that did not arrive
        before the deadline (with the phase they were last seen in).
        """
        log.debug("barrier %s", name)
        members = list(range(self.world_size)) if ranks is None else sorted(ranks)
        self.store.set(f"bar/{name}/{self.rank}", "1")
        count = self.store.add(f"bar/{name}/count", 1)
        deadline = time.monotonic() + timeout_s
        while count < len(members):
            errors = self._errors()
            if errors:   # every one a refusal of the input: exit 2 as those ranks do
                kind = PeerRefusedError if all(r for _, r in errors) else DistributedError
                raise kind("; ".join(line for line, _ in errors))
            if time.monotonic() > deadline:
                missing = [r for r in members if not self.store.check([f"bar/{name}/{r}"])]
                detail = "; ".join(f"{self.describe(r)} ({self._last_seen(r)})" for r in missing)
                raise DistributedError(
                    f"timed out after {timeout_s:g} s waiting for {len(missing)} rank(s) at "
                    f"{name!r}: {detail}. A rank that hangs or died stops the launch; see its log.")
            time.sleep(_POLL_S)
            count = self.store.add(f"bar/{name}/count", 0)


class Bootstrap:
    """The probe phase: store + barriers + a temporary gloo group under its own prefix."""

    def __init__(self, env: LaunchEnv, timeout_s: float) -> None:
        self.env = env
        self.timeout_s = timeout_s
        self.store: Any = None
        self.sync: StoreSync | None = None
        self.probe_up = False
        self._groups = 0          # default groups made so far (each on its own store prefix)

    @property
    def prefix(self) -> str:
        return f"poseidon/{self.env.run_id}"

    def start(self) -> "Bootstrap":
        import torch.distributed as dist

        if dist.is_initialized():
            raise PoseidonError("torch.distributed is already initialised before Poseidon could plan "
                                "the launch; import poseidon_plugin.auto first, or use "
                                "python -m poseidon_plugin.launch")
        self.store = connect_store(self.env, self.timeout_s)
        self.sync = StoreSync(self.store, self.env.rank, self.env.world_size, f"{self.prefix}/sync")
        self.sync.enter("join")
        self.sync.barrier("join", self.timeout_s)
        # torch wraps sys.excepthook with a "[rank<r>]" prefix at every init_process_group:
        # restored when the probe group goes, tracebacks carry the (new) rank once
        self._excepthook = sys.excepthook
        self._init_probe()
        return self

    def _init_probe(self) -> None:
        """The gloo probe group as the default group, on a store prefix never used before (a
        re-created group must not read the keys of an earlier one: gloo would connect to its
        addresses)."""
        import torch.distributed as dist

        self._groups += 1
        name = "probe" if self._groups == 1 else f"probe{self._groups}"
        dist.init_process_group("gloo", store=dist.PrefixStore(f"{self.prefix}/{name}", self.store),
                                rank=self.env.rank, world_size=self.env.world_size,
                                timeout=timedelta(seconds=self.timeout_s))
        self.probe_up = True

    @contextlib.contextmanager
    def device_group(self, backend: str) -> Iterator[None]:
        """For the block, the default group is ``backend`` (NCCL / HCCL: :func:`device_backend`)
        over the launch's ranks, so megatron-core's TP groups, which name no backend and inherit
        the default one, run their collectives on the device's own backend; afterwards the gloo
        probe group is the default group again (a fresh one), the store barriers unchanged.

        On an error in the block the device group is destroyed and the probe group is not
        re-created (``probe_up`` is False): re-creating it waits for every rank, and a failing
        launch stops."""
        import torch.distributed as dist

        if not self.probe_up:
            raise RuntimeError("Bootstrap.device_group needs the probe group (start() first)")
        self.finish_probe()
        self._groups += 1
        name = f"{backend}{self._groups}"
        dist.init_process_group(backend, store=dist.PrefixStore(f"{self.prefix}/{name}", self.store),
                                rank=self.env.rank, world_size=self.env.world_size,
                                timeout=timedelta(seconds=self.timeout_s))
        try:
            yield
            # every rank done with the group before it goes (and a rank that failed in the
            # block is named here, not by the probe group's connect timing out)
            self.barrier(f"{name}-done")
        except BaseException:
            self._destroy_default()
            raise
        self._destroy_default()
        self._init_probe()

    def _destroy_default(self) -> None:
        """The default group (and every group made from it) destroyed; torch's traceback prefix
        undone."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        if getattr(self, "_excepthook", None) is not None:
            sys.excepthook = self._excepthook

    # -- guarded collectives on the probe group --------------------------------------------------
    def phase(self, name: str) -> None:
        assert self.sync is not None
        self.sync.enter(name)

    def barrier(self, name: str) -> None:
        assert self.sync is not None
        self.sync.barrier(name, self.timeout_s)

    def all_gather_object(self, obj: Any, name: str) -> list[Any]:
        import torch.distributed as dist

        self.barrier(name)
        out: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any, name: str, src: int = 0) -> Any:
        import torch.distributed as dist

        self.barrier(name)
        box = [obj if self.env.rank == src else None]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def fail(self, message: str, refused: bool = False) -> None:
        if self.sync is not None:
            self.sync.post_error(message, refused)

    def finish_probe(self) -> None:
        if self.probe_up:
            self._destroy_default()
        self.probe_up = False

    def init_main(self, new_rank: int, new_world: int, backend: str, timeout_minutes: float) -> None:
        """The real default group: ``rank = new_rank`` on a fresh prefix (stale probe keys must not
        be reused: gloo would connect to the probe group's addresses)."""
        import torch.distributed as dist

        self.finish_probe()
        dist.init_process_group(backend, store=dist.PrefixStore(f"{self.prefix}/main", self.store),
                                rank=new_rank, world_size=new_world,
                                timeout=timedelta(minutes=timeout_minutes))


# ----------------------------------------------------------------------------------------------
# devices
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LocalDevice:
    kind: str            # "cuda" | "npu" | "cpu" | "emulated"
    index: int
    name: str
    memory_bytes: int


def setup_device(local_rank: int, *, emulated_name: str | None = None,
                 emulated_memory_bytes: int = 0) -> LocalDevice:
    """Select this rank's device (CUDA, then NPU, lazily), or describe the emulated one."""
    if emulated_name is not None:
        return LocalDevice("emulated", local_rank, emulated_name, emulated_memory_bytes)
    import torch

    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        props = torch.cuda.get_device_properties(local_rank)
        return LocalDevice("cuda", local_rank, props.name, int(props.total_memory))
    npu = npu_module()
    if npu is not None:
        npu.set_device(local_rank)
        props = npu.get_device_properties(local_rank)
        return LocalDevice("npu", local_rank, props.name, int(props.total_memory))
    try:
        import psutil  # type: ignore

        mem = int(psutil.virtual_memory().total)
    except ImportError:
        mem = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return LocalDevice("cpu", local_rank, "cpu", mem)


_DEVICE_BACKENDS = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo", "emulated": "gloo"}


def device_backend(kind: str) -> str:
    """The collective backend of a device kind (``LocalDevice.kind``, or ``poseidon profile``'s
    ``cpu | cuda | npu``): NCCL on CUDA, HCCL on an Ascend NPU (registered by ``torch_npu``,
    which :func:`setup_device` / :func:`npu_module` imported when it found the NPU), gloo on the
    CPU and under emulation. The launch and ``poseidon profile`` time TP groups on it, and the
    launch's training group defaults to it."""
    try:
        return _DEVICE_BACKENDS[kind]
    except KeyError:
        raise PoseidonError(f"no collective backend known for device kind {kind!r} (expected "
                            f"one of {', '.join(sorted(_DEVICE_BACKENDS))})") from None


def npu_module():
    """torch.npu if torch_npu is installed and usable; never imported unless torch lacks CUDA."""
    import importlib.util

    if importlib.util.find_spec("torch_npu") is None:
        return None
    try:
        import torch
        import torch_npu  # noqa: F401

        return torch.npu if torch.npu.is_available() else None
    except Exception:  # noqa: BLE001 - a broken CANN install means: no NPU
        return None


def hostname() -> str:
    return socket.gethostname()


def maybe_inject_fault(phase: str, rank: int) -> None:
    """Test hook: POSEIDON_FAULT_INJECT='phase:rank:hang|raise|exit' makes one rank misbehave."""
    spec = os.environ.get("POSEIDON_FAULT_INJECT")
    if not spec:
        return
    f_phase, f_rank, mode = (spec.split(":") + ["", "", ""])[:3]
    if f_phase != phase or str(rank) != f_rank:
        return
    log.warning("fault injection: %s in %s", mode, phase)
    if mode == "hang":
        while True:
            time.sleep(3600)
    if mode == "exit":
        os._exit(17)
    raise RuntimeError(f"injected fault in {phase}")


def run_guarded(boot: Bootstrap, phase: str, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` in ``phase``; on error post it to the store (others name this rank) and re-raise.
    (``POSEIDON_FAULT_INJECT`` can make this rank misbehave here.)"""
    boot.phase(phase)
    try:
        maybe_inject_fault(phase, boot.env.rank)
        return fn()
    except BaseException as e:  # noqa: BLE001 - includes KeyboardInterrupt / SystemExit
        if not isinstance(e, DistributedError):
            boot.fail(f"{type(e).__name__}: {e}", refused=is_refusal(e))
        raise
