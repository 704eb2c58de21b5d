"""Stand-in for ``mindspeed.patch_utils``: patches registered by dotted name and recorded."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional


class Patch:
    """One patched name: a replacement and/or wrappers (names ending in ``wrapper``/``decorator``
    are stacked, anything else replaces). The stand-in records instead of patching modules."""

    def __init__(self, orig_func_name: str, new_func: Optional[Callable]) -> None:
        self.orig_func_name = orig_func_name
        self.orig_func = None
        self.patch_func: Optional[Callable] = None
        self.wrappers: List[Callable] = []
        self.is_applied = False
        if new_func is not None:
            self.set_patch_func(new_func)

    def set_patch_func(self, new_func: Callable, force_patch: bool = False) -> None:
        if getattr(new_func, "__name__", "").endswith(("wrapper", "decorator")):
            if new_func not in self.wrappers:
                self.wrappers.append(new_func)
        else:
            if self.patch_func is not None and not force_patch:
                raise RuntimeError(f"the patch of {self.orig_func_name} exist !")
            self.patch_func = new_func
        self.is_applied = False

    def remove_patch(self) -> None:
        self.patch_func = None
        self.wrappers.clear()
        self.is_applied = False

    def apply_patch(self) -> None:
        self.is_applied = True

    @property
    def active(self) -> bool:
        return self.is_applied and (self.patch_func is not None or bool(self.wrappers))


class MindSpeedPatchesManager:
    patches_info: Dict[str, Patch] = {}

    @staticmethod
    def register_patch(orig_func_name, new_func=None, force_patch=False, create_dummy=False):
        info = MindSpeedPatchesManager.patches_info
        if orig_func_name not in info:
            info[orig_func_name] = Patch(orig_func_name, new_func)
        else:
            info[orig_func_name].set_patch_func(new_func, force_patch)

    @staticmethod
    def remove_patches():
        for patch in MindSpeedPatchesManager.patches_info.values():
            patch.remove_patch()

    @staticmethod
    def apply_patches():
        for patch in MindSpeedPatchesManager.patches_info.values():
            patch.apply_patch()

    @staticmethod
    def active_patches() -> List[str]:
        """Stand-in only: the names whose patch is in effect."""
        return sorted(n for n, p in MindSpeedPatchesManager.patches_info.items() if p.active)
