"""Reading a YAML specification file (cluster, model): one loader, one set of file-level errors.

``load_yaml_mapping(path, what)`` returns the file's top-level mapping or raises ``SpecError``
naming ``path``:

* ``<file>: expected a readable <what> YAML file, got '<OS error>'`` (missing file, a directory,
  no permission);
* ``line N: expected valid YAML, got '<parser problem>'``;
* ``<top level>: expected a <what> mapping, got 'an empty file'``;
* ``<top level>: expected <mapping_expected>, got '<type name>'`` (e.g. a list at the top).

The field-level checks are the callers' (``cluster.cluster_from_dict``,
``model.model_from_dict``), which take the same ``Mapping`` from a file or from code.
"""

from __future__ import annotations

from typing import Any, Mapping

import yaml

from .errors import SpecError


def require_mapping(value: object, source: str, field: str,
                    expected: str = "a mapping") -> Mapping[str, Any]:
    """``value`` if it is a mapping, else ``SpecError(source, field, expected, <type name>)``."""
    if not isinstance(value, Mapping):
        raise SpecError(source, field, expected, type(value).__name__)
    return value


def load_yaml_mapping(path: str, what: str,
                      mapping_expected: str = "a mapping") -> Mapping[str, Any]:
    """The top-level mapping of the YAML file ``path``, a ``what`` spec ("cluster", "model").

    ``mapping_expected`` is the expectation a non-mapping top level is reported against (the
    same words the caller's ``*_from_dict`` uses for a non-mapping argument).
    """
    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except OSError as exc:
        raise SpecError(path, "<file>", f"a readable {what} YAML file", exc.strerror) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark is not None else "<file>"
        raise SpecError(path, where, "valid YAML", getattr(exc, "problem", str(exc))) from None
    if data is None:
        raise SpecError(path, "<top level>", f"a {what} mapping", "an empty file")
    return require_mapping(data, path, "<top level>", mapping_expected)


__all__ = ["load_yaml_mapping", "require_mapping"]
