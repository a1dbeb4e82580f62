"""YAML input files with line numbers, and the one-line error every bad input gets.

Matrix, policy and release files are all read through `load_document`, so every
validation error can name `file:line: key: message` without a traceback.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import yaml

PathKey = tuple[str | int, ...]


class InputError(Exception):
    """A user input is malformed. Printed as one line; the CLI exits with code 2."""

    def __init__(self, file: str, line: int | None, key: str, message: str):
        super().__init__(message)
        self.file = file
        self.line = line
        self.key = key
        self.message = message

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        return f"{where}: {self.key}: {self.message}" if self.key else f"{where}: {self.message}"


def format_key(path: PathKey) -> str:
    """('matrix', 'paddle', 2) -> 'matrix.paddle[2]'."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


@dataclass
class Document:
    """Parsed YAML data plus the line of every mapping key and sequence item."""

    file: str
    data: Any
    lines: dict[PathKey, int] = field(default_factory=dict)

    def line(self, path: PathKey) -> int | None:
        # Fall back to the nearest enclosing node that has a recorded line.
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path[:-1]
        return self.lines.get((), 1)

    def error(self, path: PathKey, message: str) -> InputError:
        return InputError(self.file, self.line(path), format_key(path), message)


class _Loader(yaml.SafeLoader):
    """SafeLoader that keeps numbers-that-look-like-versions as written.

    YAML 1.1 reads `3.10` as the float 3.1; a version matrix must never do that, so
    floats keep their source text and are validated as strings.
    """

    def __init__(self, stream: str):
        super().__init__(stream)
        # id(mapping node) -> how many of its pairs came from merge keys (<<), which
        # flatten_mapping puts first; kept so a node reached again through an alias agrees.
        self.merged_pairs: dict[int, int] = {}


_Loader.add_constructor(
    "tag:yaml.org,2002:float", lambda loader, node: str(node.value)
)


def _convert(node: yaml.Node, path: PathKey, doc: Document, loader: _Loader) -> Any:
    doc.lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        if id(node) not in loader.merged_pairs:
            own = sum(1 for key_node, _ in node.value if key_node.tag != "tag:yaml.org,2002:merge")
            loader.flatten_mapping(node)  # resolves YAML merge keys (<<): merged pairs first
            loader.merged_pairs[id(node)] = len(node.value) - own
        merged = loader.merged_pairs[id(node)]
        result: dict[str, Any] = {}
        explicit: set[str] = set()
        for index, (key_node, value_node) in enumerate(node.value):
            key = loader.construct_object(key_node, deep=True)
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise InputError(doc.file, key_node.start_mark.line + 1, format_key(path),
                                 f"keys must be strings, got {key!r}")
            key = str(key)
            child = path + (key,)
            # YAML merge semantics: a key written in the mapping overrides a merged one, and
            # the later of two merged ones wins; only a key written twice is a mistake.
            if index >= merged:
                if key in explicit:
                    raise InputError(doc.file, key_node.start_mark.line + 1, format_key(child),
                                     "duplicate key")
                explicit.add(key)
            doc.lines[child] = key_node.start_mark.line + 1
            result[key] = _convert(value_node, child, doc, loader)
        return result
    if isinstance(node, yaml.SequenceNode):
        items = []
        for index, item in enumerate(node.value):
            child = path + (index,)
            doc.lines[child] = item.start_mark.line + 1
            items.append(_convert(item, child, doc, loader))
        return items
    return loader.construct_object(node, deep=True)


def load_document(path: str | Path, display_name: str | None = None) -> Document:
    """Read a YAML file; any syntax problem becomes an InputError with its line."""
    name = display_name or str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(name, None, "", "file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(name, None, "", f"cannot read: {exc}") from None
    return parse_document(text, name)


def parse_document(text: str, name: str) -> Document:
    doc = Document(file=name, data=None)
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            raise InputError(name, 1, "", "the file is empty")
        doc.data = _convert(node, (), doc, loader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else None
        problem = exc.problem or exc.context or "invalid YAML"
        raise InputError(name, line, "", f"invalid YAML: {problem}") from None
    except yaml.YAMLError as exc:
        raise InputError(name, None, "", f"invalid YAML: {exc}") from None
    finally:
        loader.dispose()
    return doc


# --- small validation helpers shared by every input schema -------------------------


def suggest(word: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(known), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def known_list(values: Iterable[str], limit: int = 8) -> str:
    values = list(values)
    shown = ", ".join(values[:limit])
    return shown + (", …" if len(values) > limit else "")


class Reader:
    """Typed accessors over a Document that raise InputError at the right line."""

    def __init__(self, doc: Document):
        self.doc = doc

    def error(self, path: PathKey, message: str) -> InputError:
        return self.doc.error(path, message)

    def mapping(self, value: Any, path: PathKey, allowed: Iterable[str] | None = None,
                required: Iterable[str] = ()) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.error(path, f"expected a mapping, got {_kind(value)}")
        if allowed is not None:
            allowed = list(allowed)
            for key in value:
                if key not in allowed:
                    raise self.error(path + (key,),
                                     f"unknown key{suggest(key, allowed)} (allowed: {known_list(allowed, 12)})")
        for key in required:
            if key not in value:
                raise self.error(path, f"missing required key '{key}'")
        return value

    def sequence(self, value: Any, path: PathKey, non_empty: bool = False) -> list[Any]:
        if not isinstance(value, list):
            raise self.error(path, f"expected a list, got {_kind(value)}")
        if non_empty and not value:
            raise self.error(path, "must not be empty")
        return value

    def string(self, value: Any, path: PathKey, non_empty: bool = True) -> str:
        if isinstance(value, bool) or value is None or isinstance(value, (dict, list)):
            raise self.error(path, f"expected a string, got {_kind(value)}")
        text = str(value)
        if non_empty and not text.strip():
            raise self.error(path, "must not be empty")
        return text

    def integer(self, value: Any, path: PathKey, minimum: int | None = None,
                maximum: int | None = None) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(path, f"expected an integer, got {_kind(value)}")
        if minimum is not None and value < minimum:
            raise self.error(path, f"must be at least {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise self.error(path, f"must be at most {maximum}, got {value}")
        return value

    def boolean(self, value: Any, path: PathKey) -> bool:
        if not isinstance(value, bool):
            raise self.error(path, f"expected true or false, got {_kind(value)}")
        return value

    def strings(self, value: Any, path: PathKey) -> tuple[str, ...]:
        items = self.sequence(value, path)
        return tuple(self.string(item, path + (i,)) for i, item in enumerate(items))


def _kind(value: Any) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, int):
        return f"a number ({value})"
    return f"'{value}'"
