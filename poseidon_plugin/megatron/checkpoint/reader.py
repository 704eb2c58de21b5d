"""A Megatron checkpoint read without loading its tensors.

What a relaunch needs to decide before any model is built: the iteration the load will take
(``latest_checkpointed_iteration.txt``, or ``--ckpt-step``), the format (``torch_dist``: a
``metadata.json`` naming the sharded backend; Megatron's legacy ``torch``: ``mp_rank_*``
folders), the layout and optimizer it was saved with (the ``args`` and content metadata in its
common state, read with megatron-core's own ``load_common_state_dict``), the files its
``.metadata`` lists with the bytes it needs from each, and Poseidon's record beside it
(:data:`RECORD_NAME`: the plan and the devices it was made for, each file's size and digest).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from poseidon_plugin.errors import PoseidonError

RECORD_NAME = "poseidon-plan.json"   # written by resume.write_record after each save
TRACKER = "latest_checkpointed_iteration.txt"
HASH_LIMIT_BYTES = 4 << 30   # a checkpoint larger than this is recorded with sizes only


@dataclass(frozen=True)
class CheckpointInfo:
    """What the load will read, as far as can be known without loading it."""

    load_dir: str
    iteration: int                 # -1: no checkpoint there (Megatron starts from scratch)
    path: str = ""                 # the iteration's folder
    fmt: str = ""                  # "torch_dist" | "torch" | "unknown"
    args: Mapping[str, Any] = field(default_factory=dict)    # the saved run's layout / optimizer
    content: Mapping[str, Any] = field(default_factory=dict)  # megatron's content metadata
    record: Mapping[str, Any] | None = None                  # Poseidon's record, if any

    def saved(self, name: str, default: Any = None) -> Any:
        return self.args.get(name, default)


def iteration_dir(load_dir: str, iteration: int) -> str:
    return os.path.join(load_dir, f"iter_{iteration:07d}")


def read_tracker(load_dir: str, step: int | None = None) -> int:
    """The iteration a load of ``load_dir`` takes (``--ckpt-step`` wins); -1 when none."""
    if step is not None:
        return step
    path = os.path.join(load_dir, TRACKER)
    if not os.path.isfile(path):
        return -1
    with open(path, encoding="utf-8") as f:
        text = f.read().strip()
    if text == "release":
        raise PoseidonError(f"--load {load_dir}: a 'release' checkpoint (weights only, no "
                            "iteration); resuming a job under a new plan needs a training one")
    try:
        return int(text)
    except ValueError:
        raise PoseidonError(f"--load {load_dir}: {TRACKER} holds {text[:40]!r}, not an "
                            "iteration number") from None


def detect_format(path: str) -> str:
    meta = os.path.join(path, "metadata.json")
    if os.path.isfile(meta):
        try:
            with open(meta, encoding="utf-8") as f:
                return str(json.load(f).get("sharded_backend", "unknown"))
        except (OSError, ValueError):
            return "unknown"
    if any(n.startswith("mp_rank_") for n in os.listdir(path)):
        return "torch"
    return "unknown"


def read_record(path: str) -> dict[str, Any] | None:
    """Poseidon's record beside the checkpoint, or None (saved without Poseidon)."""
    rec = os.path.join(path, RECORD_NAME)
    if not os.path.isfile(rec):
        return None
    try:
        with open(rec, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise PoseidonError(f"--load {path}: {RECORD_NAME} is unreadable ({e})") from None
    if not isinstance(data, dict) or "plan" not in data:
        raise PoseidonError(f"--load {path}: {RECORD_NAME} is not a Poseidon checkpoint record")
    return data


def _common_state(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The saved ``args`` (as a dict) and content metadata, by megatron-core's own reader."""
    from megatron.core import dist_checkpointing

    try:
        common = dist_checkpointing.load_common_state_dict(path)
    except Exception as e:   # noqa: BLE001 - any reader failure is one line naming the folder
        raise PoseidonError(f"--load {path}: megatron-core cannot read its common state "
                            f"({type(e).__name__}: {str(e)[:300]})") from None
    args = common.get("args")
    saved = dict(vars(args)) if args is not None else {}
    content = common.get("content_metadata") or {}
    return saved, dict(content) if isinstance(content, Mapping) else {}


def read_checkpoint(load_dir: str, step: int | None = None) -> CheckpointInfo:
    """``load_dir`` as the load will find it (files checked: :func:`check_files`)."""
    iteration = read_tracker(load_dir, step)
    if iteration < 0:
        return CheckpointInfo(load_dir, -1)
    path = iteration_dir(load_dir, iteration)
    if not os.path.isdir(path):
        raise PoseidonError(f"--load {load_dir}: iteration {iteration} has no folder {path}")
    fmt = detect_format(path)
    record = read_record(path)
    if fmt != "torch_dist":
        return CheckpointInfo(load_dir, iteration, path, fmt, record=record)
    check_files(path, record)
    args, content = _common_state(path)
    return CheckpointInfo(load_dir, iteration, path, fmt, args, content, record)


def _needed_bytes(path: str) -> dict[str, int]:
    """Per file the storage ``.metadata`` points into: the bytes it must at least have."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        meta = FileSystemReader(path).read_metadata()
    except Exception as e:   # noqa: BLE001
        raise PoseidonError(f"--load {path}: its .metadata is unreadable "
                            f"({type(e).__name__}: {str(e)[:200]})") from None
    need: dict[str, int] = {}
    for info in (meta.storage_data or {}).values():
        end = int(info.offset) + int(info.length)
        need[info.relative_path] = max(need.get(info.relative_path, 0), end)
    return need


def file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_files(path: str, record: Mapping[str, Any] | None) -> None:
    """Every shard the checkpoint's ``.metadata`` lists is there and long enough, and (with
    Poseidon's record) has the size and digest it had when saved; else one error naming it."""
    for name, size in sorted(_needed_bytes(path).items()):
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            raise PoseidonError(f"--load {path}: shard {name} is missing (the checkpoint's "
                                ".metadata lists it)")
        if os.path.getsize(full) < size:
            raise PoseidonError(f"--load {path}: shard {name} is truncated ({os.path.getsize(full)}"
                                f" bytes, the checkpoint's .metadata needs {size})")
    for name, want in sorted(((record or {}).get("files") or {}).items()):
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            raise PoseidonError(f"--load {path}: shard {name} is missing (saved with the "
                                "checkpoint)")
        if os.path.getsize(full) != want.get("bytes"):
            raise PoseidonError(f"--load {path}: shard {name} has {os.path.getsize(full)} bytes, "
                                f"{want.get('bytes')} when saved: corrupted")
        if want.get("sha256") and file_digest(full) != want["sha256"]:
            raise PoseidonError(f"--load {path}: shard {name} differs from what was saved "
                                "(sha256 mismatch): corrupted")


def shard_files(path: str) -> dict[str, dict[str, Any]]:
    """Each file of a saved iteration: its size, and its sha256 while the whole checkpoint is
    under HASH_LIMIT_BYTES (a digest is one read of the checkpoint, on one rank)."""
    names = sorted(n for n in os.listdir(path)
                   if n != RECORD_NAME and os.path.isfile(os.path.join(path, n)))
    sizes = {n: os.path.getsize(os.path.join(path, n)) for n in names}
    digest = sum(sizes.values()) <= HASH_LIMIT_BYTES
    return {n: {"bytes": sizes[n], **({"sha256": file_digest(os.path.join(path, n))}
                                      if digest else {})} for n in names}
