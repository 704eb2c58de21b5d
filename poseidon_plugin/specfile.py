"""Reading a YAML specification file (cluster, model): one loader, one set of file-level errors.

``load_yaml_mapping(path, what)`` returns the file's top-level mapping or raises ``SpecError``
naming ``path``:

* ``<file>: expected a readable <what> YAML file, got '<OS error>'`` (missing file, a directory,
  no permission);
* ``<file>: expected a <what> YAML file of at most 2 MiB, got '50.0 MiB'`` (``MAX_SPEC_BYTES``);
* ``line N: expected UTF-8 text, got 'byte 0xff'``;
* ``line N: expected valid YAML, got '<parser problem>'``;
* ``line N: expected unique keys in a mapping, got "duplicate key 'A100'"``;
* ``line N: expected YAML nested at most 32 deep, got 'deeper'`` (``MAX_SPEC_DEPTH``);
* ``<file>: expected at most 1000000 YAML values with aliases expanded, got ...``
  (``MAX_SPEC_VALUES``: a small file whose aliases expand to billions of values is refused
  before anything walks it);
* ``<top level>: expected a <what> mapping, got 'an empty file'``;
* ``<top level>: expected <mapping_expected>, got '<type name>'`` (e.g. a list at the top).

The limits keep a hostile file cheap: reading is bounded by the size, composing by the depth
(no recursion past ``MAX_SPEC_DEPTH``), and the values a caller may walk by the alias expansion.
The field-level checks are the callers' (``cluster.cluster_from_dict``,
``model.model_from_dict``), which take the same ``Mapping`` from a file or from code.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import yaml
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, SequenceNode
from yaml.reader import ReaderError
from yaml.resolver import Resolver

from .errors import SpecError
from .safeio import NotRegularFile, open_input

MAX_SPEC_BYTES = 2 << 20        # 2 MiB: a 40k-node cluster listed one node per line fits
MAX_SPEC_DEPTH = 32             # a cluster file nests 4 deep, a model file 1
MAX_SPEC_VALUES = 1_000_000     # YAML values (scalars, lists, mappings), aliases expanded

_MERGE_TAG = "tag:yaml.org,2002:merge"

try:  # libyaml scans and parses (no recursion, ~4x faster); composing stays ours
    from yaml._yaml import CParser as _Parser  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - PyYAML built without libyaml
    from yaml.parser import Parser as _PyParser
    from yaml.reader import Reader
    from yaml.scanner import Scanner

    class _Parser(Reader, Scanner, _PyParser):  # type: ignore[no-redef]
        def __init__(self, stream: str) -> None:
            Reader.__init__(self, stream)
            Scanner.__init__(self)
            _PyParser.__init__(self)


class _Refused(Exception):
    """A limit of this loader; ``load_yaml_mapping`` turns it into a ``SpecError``."""

    def __init__(self, where: str, expected: str, got: object) -> None:
        super().__init__(where, expected, got)
        self.where, self.expected, self.got = where, expected, got


def _line(mark) -> str:
    return f"line {mark.line + 1}" if mark is not None else "<file>"


class _NoSexagesimal:
    """An implicit int / float pattern that leaves out YAML 1.1's base-60 numbers: ``1:30`` is
    the string "1:30" (a field check refuses it by name), not 90."""

    def __init__(self, pattern) -> None:
        self.pattern = pattern

    def match(self, value: str):
        return None if ":" in value else self.pattern.match(value)


class _Resolver(Resolver):
    yaml_implicit_resolvers = {
        first: [(tag, _NoSexagesimal(rx) if tag.endswith((":int", ":float")) else rx)
                for tag, rx in resolvers]
        for first, resolvers in Resolver.yaml_implicit_resolvers.items()}


class _BoundedLoader(_Parser, Composer, SafeConstructor, _Resolver):
    """A safe loader that bounds nesting depth and refuses duplicate mapping keys."""

    def __init__(self, text: str) -> None:
        _Parser.__init__(self, text)
        Composer.__init__(self)
        SafeConstructor.__init__(self)
        _Resolver.__init__(self)
        self._depth = 0

    # the Python composer (libyaml's own would recurse in C without a bound)
    get_single_node = Composer.get_single_node
    compose_document = Composer.compose_document
    compose_scalar_node = Composer.compose_scalar_node
    compose_sequence_node = Composer.compose_sequence_node
    compose_mapping_node = Composer.compose_mapping_node

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_SPEC_DEPTH:
                raise _Refused(_line(self.peek_event().start_mark),
                               f"YAML nested at most {MAX_SPEC_DEPTH} deep", "deeper")
            return Composer.compose_node(self, parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        if isinstance(node, MappingNode):
            seen: set = set()
            for key_node, _ in node.value:
                if key_node.tag == _MERGE_TAG:
                    continue  # "<<: *base" merges; explicit keys override merged ones
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                except TypeError:
                    continue  # unhashable: the base class reports it
                if duplicate:
                    raise _Refused(_line(key_node.start_mark), "unique keys in a mapping",
                                   f"duplicate key {key!r}")
                seen.add(key)
        return super().construct_mapping(node, deep)


def _expanded_values(root: Node) -> int:
    """Values in the document with every alias expanded (a recursive alias is refused).

    Memoised per node, so an alias bomb is counted in time linear in the file, never expanded.
    """
    size: dict[int, int] = {}
    open_nodes: set[int] = set()

    def count(node: Node) -> int:
        key = id(node)
        if key in size:
            return size[key]
        if key in open_nodes:
            raise _Refused(_line(node.start_mark), "no alias inside its own anchor",
                           "a recursive alias")
        open_nodes.add(key)
        total = 1
        if isinstance(node, SequenceNode):
            total += sum(count(child) for child in node.value)
        elif isinstance(node, MappingNode):
            total += sum(count(k) + count(v) for k, v in node.value)
        open_nodes.discard(key)
        size[key] = total
        return total

    return count(root)  # recursion depth <= MAX_SPEC_DEPTH (the composer's bound)


def _read_text(path: str, what: str) -> str:
    """The file's text: at most ``MAX_SPEC_BYTES``, UTF-8 (a BOM is allowed)."""
    try:
        with open_input(path) as handle:   # a FIFO or a device: refused, not waited on
            data = handle.read(MAX_SPEC_BYTES + 1)
    except OSError as exc:
        raise SpecError(path, "<file>", f"a readable {what} YAML file", exc.strerror) from None
    except NotRegularFile as exc:
        raise SpecError(path, "<file>", f"a readable {what} YAML file (a regular file)",
                        exc.kind) from None
    if len(data) > MAX_SPEC_BYTES:
        try:
            size = os.path.getsize(path)
        except OSError:
            size = 0
        size = f"{size / (1 << 20):.1f} MiB" if size > MAX_SPEC_BYTES else "more"
        raise SpecError(path, "<file>", f"a {what} YAML file of at most "
                        f"{MAX_SPEC_BYTES >> 20} MiB", size)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise SpecError(path, f"line {line}", "UTF-8 text",
                        f"byte 0x{data[exc.start]:02x}") from None


def _parse(text: str, path: str) -> Any:
    loader = _BoundedLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        values = _expanded_values(node)
        if values > MAX_SPEC_VALUES:
            raise _Refused("<file>", f"at most {MAX_SPEC_VALUES} YAML values with aliases "
                           "expanded", f"{values} (an alias bomb?)")
        return loader.construct_document(node)
    except _Refused as exc:
        raise SpecError(path, exc.where, exc.expected, exc.got) from None
    except ReaderError as exc:  # a control character (no line mark)
        raise SpecError(path, f"character {exc.position}", "valid YAML",
                        exc.reason or str(exc)) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc)
        if "nesting depth" in problem:   # PyYAML >= 6.0.4's parser refuses deep nesting first
            raise SpecError(path, _line(mark), f"YAML nested at most {MAX_SPEC_DEPTH} deep",
                            "deeper") from None
        raise SpecError(path, _line(mark), "valid YAML", problem) from None
    except (ValueError, OverflowError) as exc:  # e.g. an int of 5000 digits, a bad timestamp
        raise SpecError(path, "<file>", "valid YAML", str(exc)) from None
    finally:
        loader.dispose()


def require_mapping(value: object, source: str, field: str,
                    expected: str = "a mapping") -> Mapping[str, Any]:
    """``value`` if it is a mapping, else ``SpecError(source, field, expected, <type name>)``."""
    if not isinstance(value, Mapping):
        raise SpecError(source, field, expected, type(value).__name__)
    return value


def load_yaml(path: str, what: str) -> Any:
    """The document of the YAML file ``path`` (None if empty), read within the limits above;
    ``what`` names the file in errors ("cluster", "emulation", ...)."""
    return _parse(_read_text(path, what), path)


def load_yaml_mapping(path: str, what: str,
                      mapping_expected: str = "a mapping") -> Mapping[str, Any]:
    """The top-level mapping of the YAML file ``path``, a ``what`` spec ("cluster", "model").

    ``mapping_expected`` is the expectation a non-mapping top level is reported against (the
    same words the caller's ``*_from_dict`` uses for a non-mapping argument).
    """
    data = load_yaml(path, what)
    if data is None:
        raise SpecError(path, "<top level>", f"a {what} mapping", "an empty file")
    return require_mapping(data, path, "<top level>", mapping_expected)


__all__ = ["MAX_SPEC_BYTES", "MAX_SPEC_DEPTH", "MAX_SPEC_VALUES", "load_yaml",
           "load_yaml_mapping", "require_mapping"]
