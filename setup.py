"""Build script: the Cython hot paths are compiled from every poseidon_plugin/**/*.pyx."""

from __future__ import annotations

import glob
import os
import sys

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, find_packages, setup

# POSEIDON_CHECKS=1 builds with bounds and wrap-around checks on (used by the test suite's
# checked build); the default build turns them off once the tests pass with them on.
_checks = os.environ.get("POSEIDON_CHECKS", "0") == "1"

# The generated C files depend on the interpreter and on numpy's Cython declarations: a tree
# built for one Python / numpy / checks setting and then for another (``make test`` then
# ``make test-py310``) must regenerate them, even when they are newer than the .pyx files.
_STAMP = os.path.join("build", ".cython-generated-for")
_SIGNATURE = (f"python {sys.version_info[0]}.{sys.version_info[1]} numpy {np.__version__} "
              f"checks {int(_checks)}")
try:
    with open(_STAMP, encoding="utf-8") as fh:
        _regenerate = fh.read() != _SIGNATURE
except OSError:
    _regenerate = True

extensions = [
    Extension(
        os.path.splitext(path)[0].replace(os.sep, "."),
        [path],
        include_dirs=[np.get_include()],
        extra_compile_args=["-O3"],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )
    for path in sorted(glob.glob(os.path.join("poseidon_plugin", "**", "*.pyx"), recursive=True))
]

_EXTENSIONS = cythonize(
    extensions,
    language_level=3,
    force=_regenerate,  # the C files were generated for another setting (above)
    compiler_directives={
        "boundscheck": _checks,
        "wraparound": _checks,
        "initializedcheck": _checks,
        "cdivision": True,
    },
)
os.makedirs(os.path.dirname(_STAMP), exist_ok=True)
with open(_STAMP, "w", encoding="utf-8") as fh:
    fh.write(_SIGNATURE)

setup(
    name="poseidon_plugin",
    version="0.1.0",
    description="Automatic parallel-plan search for LLM pre-training on heterogeneous clusters "
    "(Megatron-LM / MindSpeed-LLM plugin)",
    python_requires=">=3.10",
    packages=find_packages(include=["poseidon_plugin", "poseidon_plugin.*"]),
    package_data={"poseidon_plugin": ["**/*.pxd", "**/*.pyx"]},
    ext_modules=_EXTENSIONS,
    install_requires=["numpy>=1.26", "pyyaml>=6"],
    extras_require={
        # megatron-core 0.19.2 needs Python 3.12; MindSpeed-LLM (Python 3.10) brings its own
        # Megatron-LM core_r0.12 tree
        # psutil: megatron-core's torch_dist checkpoint writer asks each worker's memory with it
        "megatron": ["torch", "megatron-core==0.19.2; python_version >= '3.12'", "psutil"],
        "plot": ["matplotlib>=3.7"],
        "test": ["pytest>=8", "hypothesis>=6.100"],
    },
    entry_points={"console_scripts": ["poseidon=poseidon_plugin.cli:main"]},
    zip_safe=False,
)
