"""What the NPU stand-ins share: a name that imports but cannot run."""

from __future__ import annotations

import sys


class Unavailable:
    """An Ascend-only object: importable and walkable (``torchair.ge.Tensor`` is an
    :class:`Unavailable` too), usable as a decorator target or a base in annotations, but calling
    it raises ``NotImplementedError`` naming it, so a feature that needs it fails loudly."""

    def __init__(self, path: str) -> None:
        self._path = path

    def __getattr__(self, name: str) -> "Unavailable":
        if name.startswith("__"):
            raise AttributeError(name)
        return Unavailable(f"{self._path}.{name}")

    def __call__(self, *_a, **_k):
        raise NotImplementedError(f"NPU stand-in: {self._path} needs Ascend hardware and CANN; "
                                  "turn off the feature that calls it")

    def __repr__(self) -> str:
        return f"<unavailable {self._path}>"


def module_getattr(module: str):
    """A module ``__getattr__`` that answers every public name with an :class:`Unavailable`."""

    def __getattr__(name: str) -> Unavailable:
        if name.startswith("__"):
            raise AttributeError(name)
        return Unavailable(f"{module}.{name}")

    return __getattr__


class _SubmoduleFinder:
    """``import torch_npu.utils.x`` etc.: any submodule of a stand-in package that has no file
    here is created empty, every name in it an :class:`Unavailable`."""

    def __init__(self, packages: tuple[str, ...]) -> None:
        self.packages = packages

    def find_spec(self, fullname, path=None, target=None):
        import importlib.machinery

        root = fullname.split(".", 1)[0]
        if root not in self.packages or "." not in fullname:
            return None
        for finder in sys.meta_path:       # a real file of the stand-in wins
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        import types

        mod = types.ModuleType(spec.name)
        mod.__path__ = []
        mod.__getattr__ = module_getattr(spec.name)
        return mod

    def exec_module(self, module) -> None:
        return None


def install_finder() -> None:
    if not any(isinstance(f, _SubmoduleFinder) for f in sys.meta_path):
        sys.meta_path.append(_SubmoduleFinder(("torch_npu", "torchair", "acl")))
