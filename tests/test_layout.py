"""The package's layout: where the Cython core lives, no import cycles, a torch-free core.

The import graph is read from the sources (``ast`` for .py, the import lines of .pyx; a
``cimport`` is compile time and no edge). Importing ``a.b.c`` runs ``a.b``'s ``__init__`` too,
so such an import is an edge to every package on the way (except the importer's own packages,
which always run first). Imports under ``if TYPE_CHECKING:`` never run and are no edges.

* Module level (what runs at import): no cycle at all, whichever module is imported first.
* Every import, function-local ones too: no cycle except through ``LAZY_BACK_EDGES`` -- a
  function-local import is a fine way to defer a cost (torch, the search driver), not to hide a
  cycle (``plan`` reaching into ``search`` for a constant did, and ``search.options`` into
  ``search.configs``).
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "poseidon_plugin"

# Function-local imports that knowingly close a cycle (importer, imported). Each must still be
# there (test below), so the list shrinks when one is taken apart.
LAZY_BACK_EDGES = {
    # the package re-exports pipeline's names on first use (PEP 562); pipeline imports _core,
    # which imports simulator.schedules (and so runs the package's __init__)
    ("poseidon_plugin.simulator", "poseidon_plugin.simulator.pipeline"),
}


def _module_files() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*")):
        if path.suffix not in (".py", ".pyx") or "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _module_files()


def _package(name: str) -> str:
    return name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]


def _absolute(importer: str, level: int, module: str | None) -> str:
    if not level:
        return module or ""
    base = _package(importer).split(".")
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return ((isinstance(t, ast.Name) and t.id == "TYPE_CHECKING")
            or (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"))


def _py_imports(name: str, src: str, local: bool) -> set[str]:
    """Dotted names ``name``'s source imports (``a.b`` and ``a.b.x`` for ``from a.b import x``):
    at module level (class bodies run at import too), or everywhere with ``local``."""
    out: set[str] = set()

    def visit(node, top: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(ast.Module(body=[sub], type_ignores=[]), top)
                continue
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                   ast.Lambda))
            if isinstance(child, ast.Import) and (inner or local):
                out.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom) and (inner or local):
                mod = _absolute(name, child.level, child.module)
                out.add(mod)
                out.update(f"{mod}.{a.name}" for a in child.names)
            visit(child, inner)

    visit(ast.parse(src), True)
    return out


_PYX_FROM = re.compile(r"^([ \t]*)from[ \t]+(\.*)([\w.]*)[ \t]+import[ \t]+\(?([\w ,\t]+)", re.M)
_PYX_IMPORT = re.compile(r"^([ \t]*)import[ \t]+([\w.]+)", re.M)


def _pyx_imports(name: str, src: str, local: bool) -> set[str]:
    """The Python imports of a .pyx (``cimport`` lines are compile time: no edge); indented
    ones are function-local."""
    out: set[str] = set()
    for m in _PYX_FROM.finditer(src):
        if m.group(1) and not local:
            continue
        mod = _absolute(name, len(m.group(2)), m.group(3) or None)
        out.add(mod)
        out.update(f"{mod}.{a.split(' as ')[0].strip()}" for a in m.group(4).split(",")
                   if a.strip())
    for m in _PYX_IMPORT.finditer(src):
        if not m.group(1) or local:
            out.add(m.group(2))
    return out


def import_graph(local: bool) -> dict[str, set[str]]:
    graph = {}
    for name, path in MODULES.items():
        src = path.read_text(encoding="utf-8")
        names = (_pyx_imports if path.suffix == ".pyx" else _py_imports)(name, src, local)
        edges = set()
        for dotted in names:
            parts = dotted.split(".")
            for i in range(1, len(parts) + 1):
                target = ".".join(parts[:i])
                if (target in MODULES and target != name
                        and not name.startswith(target + ".")):
                    edges.add(target)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as one cycle
    through it (for the message)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for v in sorted(graph):
        if v not in index:
            strong(v)
    out = []
    for comp in comps:
        members, path, v = set(comp), [], min(comp)
        while v not in path:    # walk inside the component until a module repeats
            path.append(v)
            v = min(graph[v] & members)
        out.append(path[path.index(v):] + [v])
    return out


def test_the_cython_core_is_poseidon_plugin_core():
    """The design card's house: the simulator's Cython core at ``poseidon_plugin/_core.pyx``
    (the Python side in ``simulator/``), the search's hot paths beside their package."""
    assert (PKG / "_core.pyx").is_file() and (PKG / "_core.pxd").is_file()
    assert not list((PKG / "simulator").glob("_core.p*"))
    assert {n for n, p in MODULES.items() if p.suffix == ".pyx"} == {
        "poseidon_plugin._core", "poseidon_plugin.search._search", "poseidon_plugin.search._bounds",
        "poseidon_plugin.search._roots"}
    core = importlib.import_module("poseidon_plugin._core")
    assert Path(core.__file__).parent == PKG and not core.__file__.endswith(".py")
    from poseidon_plugin.simulator import pipeline

    assert pipeline.get_dag is core.get_dag


def test_no_import_cycle_at_module_level():
    graph = import_graph(local=False)
    assert graph["poseidon_plugin._core"] >= {"poseidon_plugin.simulator.schedules"}
    assert "poseidon_plugin._core" in graph["poseidon_plugin.simulator.pipeline"]
    assert cycles(graph) == []


def test_no_import_cycle_hidden_in_a_function():
    graph = import_graph(local=True)
    assert "poseidon_plugin.search.runnerup" not in graph["poseidon_plugin.plan"]
    assert "poseidon_plugin.search.configs" not in graph["poseidon_plugin.search.options"]
    for importer, imported in sorted(LAZY_BACK_EDGES):
        assert imported in graph[importer], f"{importer} no longer imports {imported}: " \
                                            f"drop it from LAZY_BACK_EDGES"
        graph[importer].discard(imported)
    assert cycles(graph) == []


def test_the_cycle_finder_finds_cycles():
    """The checks above can fail: a graph with a cycle (and the repository's own graph with a
    module-level import that closes one) is reported."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    graph = import_graph(local=False)
    graph["poseidon_plugin.search.options"].add("poseidon_plugin.search.configs")
    found = cycles(graph)
    assert len(found) == 1 and {"poseidon_plugin.search.options",
                                "poseidon_plugin.search.configs"} <= set(found[0])
    # _py_imports: module level vs function-local vs TYPE_CHECKING
    src = ("from typing import TYPE_CHECKING\nfrom .a import x\nif TYPE_CHECKING:\n"
           "    from .b import y\nclass K:\n    from .c import z\n"
           "def f():\n    from ..d import w\n")
    name = "poseidon_plugin.search.options"
    top = _py_imports(name, src, local=False)
    assert {"poseidon_plugin.search.a", "poseidon_plugin.search.c"} <= top
    assert not {"poseidon_plugin.search.b", "poseidon_plugin.d"} & top
    every = _py_imports(name, src, local=True)
    assert "poseidon_plugin.d.w" in every and "poseidon_plugin.search.b" not in every


@pytest.mark.parametrize("module", ["poseidon_plugin._core", "poseidon_plugin.search._search",
                                    "poseidon_plugin.simulator.pipeline",
                                    "poseidon_plugin.search.options", "poseidon_plugin.plan"])
def test_a_module_imports_first_in_a_fresh_interpreter(module):
    """Whichever module a process imports first loads (a cycle through a package's __init__
    fails only in some orders)."""
    out = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr


def test_the_core_imports_without_torch():
    """Every module outside ``megatron/`` imports with torch and megatron unimportable, and
    none of them loads either."""
    core = sorted(n for n in MODULES if not n.startswith("poseidon_plugin.megatron")
                  and n != "poseidon_plugin.__main__")
    assert "poseidon_plugin._core" in core and "poseidon_plugin.search.driver" in core
    code = "\n".join([
        "import importlib, sys",
        "sys.modules['torch'] = None",
        "sys.modules['megatron'] = None",
        f"for name in {core!r}:",
        "    importlib.import_module(name)",
        "loaded = [k for k, m in list(sys.modules.items())",
        "          if k.split('.')[0] in ('torch', 'megatron') and m is not None]",
        "assert not loaded, loaded",
        "print('CORE TORCH-FREE OK', len(sys.modules))",
    ])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "CORE TORCH-FREE OK" in out.stdout


# Functions over ~80 lines still waiting to be split (issue 38, item 16: none left). The list
# may only shrink: a new long function fails the test below, and so does an entry that is no
# longer long (it would let the function grow past the limit again unnoticed).
LONG_FUNCTIONS: set[str] = set()
MAX_FUNCTION_LINES = 80


def _long_functions() -> dict[str, int]:
    out: dict[str, int] = {}

    def visit(node, path: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                lines = child.end_lineno - child.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    out[f"{path}:{name}"] = lines
                visit(child, path, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, path, prefix + child.name + ".")

    for path in sorted(PKG.rglob("*.py")):
        visit(ast.parse(path.read_text()), str(path.relative_to(ROOT)), "")
    return out


def test_no_new_function_over_80_lines():
    long = _long_functions()
    new = {k: v for k, v in long.items() if k not in LONG_FUNCTIONS}
    assert not new, f"functions over {MAX_FUNCTION_LINES} lines (split them): {new}"
    stale = sorted(LONG_FUNCTIONS - set(long))
    assert not stale, f"LONG_FUNCTIONS lists functions no longer over the limit: {stale}"
