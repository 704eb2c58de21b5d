"""Assemble a MindSpeed-LLM stand-in release (tests/standin/README.md) into a directory."""

from __future__ import annotations

import os
import shutil
import sys

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "standin")
RELEASES = {"2.3.0": ("2.3.0",), "26.0.0": ("26.x", "26.0.0"), "26.1.0": ("26.x", "26.1.0")}
LAYOUT_RELEASES = ("26.1.0",)  # MindSpeed-LLM registers --pipeline-model-parallel-layout


def install(release: str, dest: str) -> str:
    """``dest`` with ``mindspeed/`` and ``mindspeed_llm/`` of ``release``; returns ``dest``."""
    os.makedirs(dest, exist_ok=True)
    shutil.copytree(os.path.join(HERE, "mindspeed"), os.path.join(dest, "mindspeed"),
                    dirs_exist_ok=True)
    for part in ("common", *RELEASES[release]):
        shutil.copytree(os.path.join(HERE, "mindspeed_llm", part, "mindspeed_llm"),
                        os.path.join(dest, "mindspeed_llm"), dirs_exist_ok=True)
    return dest


def forget() -> None:
    """Drop the stand-in's modules from sys.modules (tests switch releases in one process)."""
    for name in [m for m in sys.modules if m.split(".")[0] in ("mindspeed", "mindspeed_llm")]:
        del sys.modules[name]
