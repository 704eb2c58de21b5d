"""A failed import on a launch or ``poseidon profile`` path, as one line: what is missing, the fix.

:func:`require` imports a module or raises :class:`MissingImportError` (a ``PoseidonError``: the
CLI prints it on one line and exits 2, the launcher as ``[poseidon rank N] error: ...``), and
:func:`explain` turns any ``ImportError`` caught at an entry point into the same. The line says
which module is missing and who wanted it, from the exception's own ``name``:

* no ``megatron`` at all: install megatron-core or put a Megatron-LM checkout on ``PYTHONPATH``;
* ``megatron.training`` (or ``megatron.legacy``) under a megatron-core wheel before 0.18, which
  ships only ``megatron.core``: ``megatron-core 0.12's wheel ships no megatron.training: put a
  Megatron-LM checkout on PYTHONPATH``; under a tree without it: which tree;
* another ``megatron.*`` module: not in this version (which, where);
* MindSpeed / MindSpeed-LLM, Ascend's ``torch_npu`` / ``torchair`` / ``acl``: where they come from;
* a third-party module a framework imports (``einops``, ``six``, ...): ``pip install`` it;
* ``cannot import name X from Y``: the version installed lacks it (which version, where).

Torch-free at import time (the CLI imports it).
"""

from __future__ import annotations

import importlib
import logging
import re
from types import ModuleType

from poseidon_plugin.errors import PoseidonError

log = logging.getLogger("poseidon")


class MissingImportError(PoseidonError):
    """A module the launch or the profiler needs cannot be imported (one line, with the fix)."""


# module -> what to install (where it differs from the module's name, or needs saying)
PIP_NAMES = {
    "yaml": "pyyaml", "PIL": "pillow", "cv2": "opencv-python", "sklearn": "scikit-learn",
    "flask_restful": "flask-restful", "google.protobuf": "protobuf",
    "transformer_engine": "transformer-engine[pytorch]", "absl": "absl-py",
    "sentencepiece": "sentencepiece", "tiktoken": "tiktoken", "transformers": "transformers",
}
WHEEL_TRAINING_SINCE = (0, 18)
"""megatron-core wheels before this ship only ``megatron.core`` (no ``megatron.training``)."""

ASCEND = {"torch_npu": "Ascend's PyTorch adapter torch_npu (with the CANN toolkit)",
          "torchair": "torchair (Ascend's graph mode, installed with torch_npu)",
          "acl": "the CANN toolkit's acl (source its set_env.sh)"}
MINDSPEED = {"mindspeed": ("MindSpeed", "https://gitee.com/ascend/MindSpeed"),
             "mindspeed_llm": ("MindSpeed-LLM", "https://gitee.com/ascend/MindSpeed-LLM")}


def require(module: str, needed_by: str) -> ModuleType:
    """``importlib.import_module(module)``; a :class:`MissingImportError` line if it fails."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise explain(e, module, needed_by) from None


def require_megatron(needed_by: str, training: bool = True) -> None:
    """What every launch and ``poseidon profile`` imports first: ``megatron.core`` and (with
    ``training``) Megatron's argument parser, ``megatron.training.arguments``."""
    require("megatron.core", needed_by)
    if training:
        require("megatron.training.arguments", needed_by)


def _missing_name(e: ImportError) -> str:
    if e.name:
        return e.name
    m = re.search(r"No module named '([^']+)'", str(e))
    return m.group(1) if m else ""


def _megatron_where() -> tuple[str, str, bool]:
    """(version, where, is the wheel) of the megatron.core importable here; version "" if none."""
    from poseidon_plugin.megatron import provenance

    try:
        c = provenance.megatron_core()
    except Exception:  # noqa: BLE001 - only for the message
        return "", "", False
    if c.version == "not installed":
        return "", "", False
    if c.path:
        return c.version, f"the Megatron-LM tree {c.path}", False
    import sys

    mod = sys.modules.get("megatron.core")
    import os

    where = os.path.dirname(os.path.dirname(getattr(mod, "__file__", "") or "?"))
    return c.version, where, True


def _version_tuple(version: str) -> tuple[int, ...]:
    out = []
    for part in version.split(".")[:2]:
        m = re.match(r"\d+", part)
        out.append(int(m.group()) if m else 0)
    return tuple(out)


def explain(e: ImportError, wanted: str = "", needed_by: str = "") -> MissingImportError:
    """One line for ``e`` (raised importing ``wanted``, which ``needed_by`` needs)."""
    log.debug("import failed: %s", wanted or e, exc_info=e)
    missing = _missing_name(e)
    by = f" ({needed_by})" if needed_by else ""
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    if not isinstance(e, ModuleNotFoundError) or not missing:
        # "cannot import name X from Y": a module is there, without what the caller needs
        origin = f"{wanted} " if wanted else ""
        where = ""
        if (missing or wanted or "").startswith("megatron") or "megatron" in first:
            version, place, _ = _megatron_where()
            if version:
                where = f" (megatron-core {version}, {place})"
        return MissingImportError(f"cannot import {origin.strip() or 'a module'}{by}: {first}"
                                  f"{where}: that version lacks it; use a release this Poseidon "
                                  "supports (Megatron-LM core 0.12 to 0.19)")
    top = missing.split(".")[0]
    if top == "megatron":
        return _megatron_missing(missing, by)
    if top == "poseidon_plugin":
        return MissingImportError(f"Poseidon's own module {missing} is missing{by}: its compiled "
                                  "core is not built; run `make build` or reinstall "
                                  "(pip install .)")
    if top in ASCEND:
        return MissingImportError(f"cannot import {missing}{by}: install {ASCEND[top]}, or "
                                  "rehearse on CPU with --poseidon-emulate FILE")
    if top in MINDSPEED:
        name, url = MINDSPEED[top]
        return MissingImportError(f"cannot import {missing}{by}: {name} is not installed: pip "
                                  f"install -e a {name} checkout ({url}) or put it on "
                                  "PYTHONPATH, or pass --poseidon-backend megatron")
    if top == "torch":
        return MissingImportError(f"cannot import {missing}{by}: PyTorch is not installed: "
                                  "pip install torch")
    importer = wanted if wanted and wanted.split(".")[0] != top else ""
    pip = PIP_NAMES.get(missing) or PIP_NAMES.get(top) or top
    return MissingImportError(f"{importer or 'an import'}{by} needs {missing}, which is not "
                              f"installed: pip install {pip}")


def _megatron_missing(missing: str, by: str) -> MissingImportError:
    version, place, wheel = _megatron_where() if missing != "megatron" else ("", "", False)
    if not version:
        return MissingImportError(f"cannot import {missing}{by}: neither megatron-core nor a "
                                  "Megatron-LM checkout is importable: pip install "
                                  "megatron-core (0.18 or later ships megatron.training), or put "
                                  "a Megatron-LM checkout on PYTHONPATH")
    part = ".".join(missing.split(".")[:2])
    if part in ("megatron.training", "megatron.legacy") and wheel \
            and _version_tuple(version) < WHEEL_TRAINING_SINCE:
        major_minor = ".".join(version.split(".")[:2])
        return MissingImportError(
            f"megatron-core {major_minor}'s wheel ({place}) ships no {part}{by}: put a "
            "Megatron-LM checkout on PYTHONPATH, or install megatron-core 0.18 or later")
    return MissingImportError(f"cannot import {missing}{by}: megatron-core {version} has no such "
                              f"module ({place}); use a full Megatron-LM checkout of a release "
                              "this Poseidon supports (core 0.12 to 0.19)")


__all__ = ["MissingImportError", "explain", "require", "require_megatron"]
