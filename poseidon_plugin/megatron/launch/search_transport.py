"""The distributed search's transport over torch.distributed (``search/distributed.py`` is the
algorithm and imports no torch): the rendezvous key-value store every process group has.

``TorchStore`` wraps a c10d store (torchrun's, or a launch's) under its own prefix;
``searchers_from_environ`` is ``poseidon plan --distributed`` under torchrun: one searcher per
process, the search threads of one host split among its processes.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.search.distributed import Searchers


class TorchStore:
    """A :class:`~poseidon_plugin.search.distributed.Store` on a torch.distributed store
    (one lock: the exchange thread and the search thread share the client)."""

    def __init__(self, store: Any, prefix: str) -> None:
        import torch.distributed as dist

        self._s = dist.PrefixStore(prefix, store)
        self._lock = threading.Lock()

    def set(self, key: str, value: bytes) -> None:
        with self._lock:
            self._s.set(key, value)

    def get(self, key: str) -> bytes | None:
        with self._lock:
            if not self._s.check([key]):
                return None
            return bytes(self._s.get(key))

    def add(self, key: str, amount: int) -> int:
        with self._lock:
            return int(self._s.add(key, amount))


def default_store() -> Any:
    """The default process group's store."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def _env_int(name: str) -> int:
    text = os.environ.get(name)
    try:
        return int(text)
    except (TypeError, ValueError):
        raise PoseidonError(f"--distributed: {name}={text!r} is not set to a number; run under "
                            "torchrun (torchrun --nproc-per-node K -m poseidon_plugin plan "
                            "--distributed ...)") from None


class _Group:
    """``searchers_from_environ``'s context: the process group made here goes at the end."""

    def __init__(self, searchers: Searchers, owns_group: bool) -> None:
        self.searchers, self.owns_group = searchers, owns_group

    def __enter__(self) -> Searchers:
        self.searchers.start()
        return self.searchers

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist

        self.searchers.close()
        if self.owns_group and dist.is_initialized():
            if not any(exc) and self.searchers.error is None:
                try:   # the coordinator reads the others' results before the store goes
                    dist.barrier()
                except Exception:  # noqa: BLE001 - a peer is gone: nothing left to tidy
                    pass
            dist.destroy_process_group()


def _await_coordinator(deadline: float, timeout_s: float) -> None:
    """Until ``deadline`` (monotonic), wait for MASTER_ADDR:MASTER_PORT to accept a
    connection (rank 0's store); one line naming an address that does not resolve, or no
    coordinator listening in ``timeout_s``."""
    import socket

    addr, port = os.environ.get("MASTER_ADDR", ""), _env_int("MASTER_PORT")
    try:
        socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        raise PoseidonError(f"--distributed: MASTER_ADDR={addr!r} does not resolve "
                            f"({getattr(e, 'strerror', None) or e})") from None
    while True:
        try:
            with socket.create_connection((addr, port), timeout=1.0):
                return
        except OSError:
            if time.monotonic() >= deadline:
                raise PoseidonError(f"--distributed: no coordinator (rank 0) listening at "
                                    f"{addr}:{port} after {timeout_s:g} s") from None
            time.sleep(0.2)


RENDEZVOUS_S = 120.0     # the longest --distributed waits for its peers to join
MIN_WAIT_S = 10.0        # ... and the shortest, whatever --time-budget says (torch's import
                         # alone can take seconds longer on one rank than another)


def wait_seconds(time_budget_s: float | None) -> float:
    """How long ``poseidon plan --distributed`` waits for a peer (to join the process group,
    or between heartbeats): ``--time-budget`` bounds it (at least ``MIN_WAIT_S``, at most
    ``RENDEZVOUS_S``)."""
    if time_budget_s is None:
        return RENDEZVOUS_S
    return min(RENDEZVOUS_S, max(MIN_WAIT_S, time_budget_s))


def _environment() -> tuple[int, int, int]:
    """(RANK, WORLD_SIZE, LOCAL_WORLD_SIZE) from torchrun's environment, each checked: one line
    naming a variable that is no number, or a RANK outside WORLD_SIZE."""
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    local = _env_int("LOCAL_WORLD_SIZE") if os.environ.get("LOCAL_WORLD_SIZE") else 1
    if world < 1 or not 0 <= rank < world:
        raise PoseidonError(f"--distributed: RANK={rank} is outside WORLD_SIZE={world} (ranks "
                            "are 0 .. WORLD_SIZE - 1)")
    if local < 1:
        raise PoseidonError(f"--distributed: LOCAL_WORLD_SIZE={local}: expected an integer >= 1")
    return rank, world, local


def searchers_from_environ(workers: int | None = None, timeout_s: float = RENDEZVOUS_S) -> _Group:
    """torchrun's environment (RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT): a gloo
    process group if none exists yet (its peers awaited ``timeout_s``), and this process's
    ``Searchers`` (its search threads: ``workers``, else this host's cores /
    LOCAL_WORLD_SIZE; a peer silent for ``timeout_s`` is given up unless
    POSEIDON_SEARCH_STALL_S says otherwise)."""
    import datetime

    from poseidon_plugin.search.distributed import stall_seconds

    rank, world, local = _environment()   # before torch's import (seconds)
    import torch.distributed as dist

    owns = not dist.is_initialized()
    if owns:
        start, left = time.monotonic(), timeout_s
        if rank != 0:   # c10d's client retries past its timeout (27 s at 10 s): wait here
            _await_coordinator(start + timeout_s, timeout_s)
            left = max(1.0, timeout_s - (time.monotonic() - start))
        try:
            dist.init_process_group("gloo", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=left))
        except Exception as e:  # noqa: BLE001 - c10d raises several kinds
            raise PoseidonError(f"--distributed: rank {rank} cannot join the process group "
                                f"in {timeout_s:g} s ({' '.join(str(e).split())[:200]})") \
                from None
    if workers is None:
        workers = max(1, (os.cpu_count() or 1) // max(1, local))
    store = TorchStore(default_store(), "poseidon-search/")
    stall_s = stall_seconds() if os.environ.get("POSEIDON_SEARCH_STALL_S") else \
        min(stall_seconds(), timeout_s)
    return _Group(Searchers(store, rank, world, workers=workers, stall_s=stall_s,
                            names=lambda r: f"rank {r}"), owns)


def launch_searchers(boot: Any, topo: Any, rank: int) -> Searchers | None:
    """A ``--poseidon-auto`` launch on more than one host: one searcher per host (its lowest
    launch rank; launch rank 0 coordinates), on the launch's store. None on the other ranks,
    on one host, or with POSEIDON_DISTRIBUTED_SEARCH=0."""
    if os.environ.get("POSEIDON_DISTRIBUTED_SEARCH", "1").strip() == "0":
        return None
    first: dict[str, int] = {}
    for info in sorted(topo.infos, key=lambda i: i.rank):
        first.setdefault(info.host, info.rank)
    ranks = sorted(first.values())
    if len(ranks) < 2 or rank not in ranks:
        return None
    return Searchers(TorchStore(boot.store, f"{boot.prefix}/search/"), ranks.index(rank),
                     len(ranks), names=lambda s: topo.describe(ranks[s]),
                     join_s=boot.timeout_s)
