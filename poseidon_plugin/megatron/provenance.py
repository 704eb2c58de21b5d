"""Where a measurement came from: the versions of the frameworks actually imported.

A profile record (``env``) and the profile cache's key name the ``megatron`` this process imports,
not whatever ``megatron-core`` pip has installed: a Megatron-LM checkout first on ``sys.path``
(the training script's directory, ``PYTHONPATH``) shadows the wheel, and its version is its own
``megatron.core.package_info``. When the imported package is not the installed distribution's
files, its version carries a short hash of the tree's path (``0.12.1 (tree 3fa2b1c0)``): two
checkouts of one version are two trees. On the MindSpeed-LLM backend MindSpeed and MindSpeed-LLM
are named the same way: the distribution's version when its files are the ones imported, else a
version found in the tree (``setup.py``, ``version.txt``, ``version.py``), else ``unknown``, with
the tree's hash.

Nothing here imports a framework that is not imported yet, except ``megatron.core`` itself
(:func:`megatron_core`), which every caller is about to use anyway; MindSpeed's packages are
located without being imported.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata as metadata
import importlib.util
import os
import re
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Iterable


@dataclass(frozen=True)
class Component:
    """One framework as this process imports it."""

    name: str        # the name users know: megatron-core, mindspeed, mindspeed-llm
    version: str     # its own version ("unknown" when it says none; "not installed")
    path: str = ""   # the tree holding the package when it is not the distribution's files

    @property
    def tree(self) -> str:
        """Short hash of the tree's path ("" for a distribution's files)."""
        return path_hash(self.path) if self.path else ""

    def describe(self) -> str:
        """What a record's ``env`` says: ``0.19.2`` or ``0.12.1 (tree 3fa2b1c0)``."""
        return f"{self.version} (tree {self.tree})" if self.path else self.version

    def for_humans(self) -> str:
        """What a log line says: ``0.19.2`` or ``0.12.1 (/path/to/Megatron-LM)``."""
        return f"{self.version} ({self.path})" if self.path else self.version


def path_hash(path: str) -> str:
    return hashlib.sha256(os.path.realpath(path).encode()).hexdigest()[:8]


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def _distribution_of(init_file: str, relative: str, names: Iterable[str]):
    """The installed distribution (one of ``names``) whose own files include ``init_file``
    (``relative`` is its path inside the distribution), else None."""
    for name in names:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        for f in dist.files or ():
            if str(f).replace(os.sep, "/") == relative:
                if _same_file(str(dist.locate_file(f)), init_file):
                    return dist
                break
    return None


def _installed_version(names: Iterable[str]) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


_VERSION_ASSIGN = re.compile(r"""\b(?:__version__|version)\s*=\s*['"]([0-9][^'"\s]{0,40})['"]""")


def tree_version(root: str, package: str) -> str | None:
    """A version written in a source tree: ``setup.py``'s ``version=``, a ``version.txt`` /
    ``VERSION`` file, or the package's ``version.py`` / ``__version__.py``; None if none."""
    for name in ("setup.py", os.path.join(package, "version.py"),
                 os.path.join(package, "__version__.py")):
        try:
            with open(os.path.join(root, name), encoding="utf-8", errors="replace") as f:
                m = _VERSION_ASSIGN.search(f.read(200_000))
        except OSError:
            continue
        if m:
            return m.group(1)
    for name in ("version.txt", "VERSION"):
        try:
            with open(os.path.join(root, name), encoding="utf-8", errors="replace") as f:
                text = f.read(100).strip().splitlines()
        except OSError:
            continue
        if text and re.fullmatch(r"[0-9][^\s]{0,40}", text[0].strip()):
            return text[0].strip()
    return None


# ----------------------------------------------------------------------------------------------
# megatron-core
# ----------------------------------------------------------------------------------------------

MEGATRON_DISTRIBUTIONS = ("megatron-core", "megatron_core")


def megatron_core(module: ModuleType | None = None) -> Component:
    """The imported ``megatron.core``'s version (its ``package_info``) and, when it is not the
    installed megatron-core distribution's files, the Megatron-LM tree holding it. Imports
    ``megatron.core`` if it is not imported yet; ``not installed`` when it cannot be."""
    mod = module if module is not None else sys.modules.get("megatron.core")
    if mod is None:
        try:
            import megatron.core as mod  # noqa: PLC0415
        except ImportError:
            return Component("megatron-core", "not installed")
    info = getattr(mod, "package_info", None)
    if info is None:
        try:
            info = importlib.import_module("megatron.core.package_info")
        except ImportError:
            info = None
    version = _package_info_version(info) or getattr(mod, "__version__", None)
    init = getattr(mod, "__file__", None) or ""
    if not init:   # a namespace package: no package_info, no tree to name
        return Component("megatron-core", str(version or "unknown"))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(init))))
    dist = _distribution_of(init, "megatron/core/__init__.py", MEGATRON_DISTRIBUTIONS)
    return Component("megatron-core", str(version or (dist.version if dist else "unknown")),
                     "" if dist is not None else root)


def _package_info_version(info: object) -> str | None:
    """``package_info``'s version without the local part: from 0.16 on ``__version__`` appends
    ``+<git HEAD>`` of whatever repository encloses the package (a venv inside a project's
    checkout gets the project's HEAD, which changes with every commit); the tree's identity is
    its path hash instead."""
    parts = getattr(info, "VERSION", None)
    if isinstance(parts, tuple) and len(parts) >= 3:
        return ".".join(map(str, parts[:3])) + "".join(map(str, parts[3:]))
    version = getattr(info, "__version__", None)
    return str(version).split("+", 1)[0] if version else None


def megatron_core_is_wheel(component: Component | None = None) -> bool:
    """Whether the imported megatron.core is the installed distribution's files."""
    c = component or megatron_core()
    return c.version != "not installed" and not c.path


# ----------------------------------------------------------------------------------------------
# MindSpeed, MindSpeed-LLM
# ----------------------------------------------------------------------------------------------

_MINDSPEED = {"mindspeed": ("mindspeed", ("mindspeed",)),
              "mindspeed-llm": ("mindspeed_llm", ("mindspeed_llm", "mindspeed-llm"))}


def package_component(name: str, package: str, distributions: Iterable[str]) -> Component:
    """A top-level package located (imported already or found, never imported here): the
    distribution's version when its files are the ones found, else the tree's own version
    (or ``unknown``) with the tree's path."""
    mod = sys.modules.get(package)
    init = getattr(mod, "__file__", None) if mod is not None else None
    if not init:
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            spec = None
        init = spec.origin if spec is not None and spec.has_location else None
    if not init or not os.path.exists(init):
        return Component(name, "not installed")
    distributions = tuple(distributions)
    dist = _distribution_of(init, f"{package}/__init__.py", distributions)
    if dist is not None:
        return Component(name, dist.version)
    root = os.path.dirname(os.path.dirname(os.path.abspath(init)))
    version = tree_version(root, package)
    if version is None:   # an editable install of this very tree says its version
        version = _editable_version(root, distributions)
    return Component(name, version or "unknown", root)


def _editable_version(root: str, distributions: Iterable[str]) -> str | None:
    import json

    for name in distributions:
        try:
            dist = metadata.distribution(name)
            direct = json.loads(dist.read_text("direct_url.json") or "{}")
        except (metadata.PackageNotFoundError, ValueError):
            continue
        url = str(direct.get("url", ""))
        if url.startswith("file://") and _same_file(url[len("file://"):], root):
            return dist.version
    return None


def mindspeed_components() -> list[Component]:
    """MindSpeed's and MindSpeed-LLM's versions (see :func:`package_component`)."""
    return [package_component(name, pkg, dists) for name, (pkg, dists) in _MINDSPEED.items()]


# ----------------------------------------------------------------------------------------------
# what a record and the cache key carry
# ----------------------------------------------------------------------------------------------

ENV_KEYS = {"megatron-core": "megatron_core", "mindspeed": "mindspeed",
            "mindspeed-llm": "mindspeed_llm", "torch": "torch"}


def components(backend: str = "megatron") -> list[Component]:
    """torch, megatron-core and (``backend`` "mindspeed-llm") MindSpeed and MindSpeed-LLM, as
    imported here."""
    try:
        import torch

        torch_version = str(torch.__version__)
    except ImportError:
        torch_version = "not installed"
    out = [Component("torch", torch_version), megatron_core()]
    if backend == "mindspeed-llm":
        out += mindspeed_components()
    return out


def env_entries(backend: str = "megatron") -> list[tuple[str, str]]:
    """``(env key, version)`` of :func:`components`, for a profile record's ``env``."""
    return [(ENV_KEYS[c.name], c.describe()) for c in components(backend)]


__all__ = ["Component", "components", "env_entries", "megatron_core", "mindspeed_components",
           "package_component", "path_hash", "tree_version"]
