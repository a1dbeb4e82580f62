"""YAML input files with line numbers, and the one-line error every bad input gets.

Matrix, policy and release files are all read through `load_document`, so every
validation error can name `file:line: key: message` without a traceback.

Every one of those files may come from a pull request, so the loader trusts nothing about
them: it refuses a file before reading it when it is too large, checks the encoding and the
characters itself, and bounds nesting, aliases and the number of values while PyYAML reads,
so a hostile file costs at most a second or so and a few tens of MB (see `Limits`).
"""
from __future__ import annotations

import codecs
import difflib
import os
import re
import stat
import unicodedata
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, Protocol

import yaml

from imagebuild.core.errors import ExitCode, ImagebuildError

PathKey = tuple[str | int, ...]


@dataclass(frozen=True)
class Limits:
    """What one YAML input file may hold; the loader refuses anything beyond, whatever PyYAML allows.

    Real files are far below them: the example matrix holds 150 values 6 levels deep, and a
    policy with a thousand exceptions would hold about 10,000 values in 200 KB. The cost of
    the worst file decides them: PyYAML (pure Python, so that the limits can hook into it)
    scans a MiB of text in well under a second but builds only some 20,000 values a second
    on a busy 2-core machine, so these limits keep any file within a second or two
    (bench/bench_yaml_limits.py times the worst cases).
    """

    max_bytes: int = 1 << 20  # checked before reading: a larger file is refused unread
    max_depth: int = 64  # nested collections; PyYAML's composer recurses once per level
    max_aliases: int = 256  # *alias references in the file
    max_nodes: int = 20_000  # values in the file, counting each alias as every value it stands for


LIMITS = Limits()


class InputError(ImagebuildError):
    """A user input is malformed. Printed as one line; the CLI exits with code 2."""

    exit_code = ExitCode.BAD_INPUT

    def __init__(self, file: str, line: int | None, key: str, message: str):
        super().__init__(message)
        self.file = file
        self.line = line
        self.key = key
        self.message = message

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        text = f"{where}: {self.key}: {self.message}" if self.key else f"{where}: {self.message}"
        # File names, keys and values quoted in messages come from the user: a newline or an
        # escape sequence among them must not split the line or reach the terminal.
        return _UNSAFE_IN_MESSAGE.sub(_escape, text)


# Characters no input file may hold, raw or written as an escape in a quoted string: C0 and C1
# controls but tab and line breaks, DEL, surrogates, U+FFFE/U+FFFF (all of which PyYAML refuses
# with a multi-line message of its own), NEL and the Unicode line separators (which PyYAML
# counts as line breaks, so no editor would show the line it reports), bidirectional overrides
# and zero-width no-break spaces (which make text read differently from what it says).
_FORBIDDEN = re.compile("[^\t\n\r\x20-\x7e\xa0-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]"
                        "|[\u2028\u2029\u202a-\u202e\u2066-\u2069\ufeff]")
# What no line printed from untrusted data may hold raw (messages here, and cli.common.safe for
# every line the CLI prints from registries, attestations, YAML and AdmissionReviews): C0 controls
# (ESC, so no escape sequence can start; CR and backspace, which overwrite a line), DEL and C1 (CSI
# is one), the Unicode line and paragraph separators, bidirectional embeddings, overrides, isolates
# and marks, zero-width and invisible formatting characters, BOMs and lone surrogates.
UNSAFE_TEXT = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]"
                         "|[\ud800-\udfff]")
_UNSAFE_IN_MESSAGE = UNSAFE_TEXT
_SHORT_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
_LINE_BREAK = re.compile("\r\n|\r|\n")
_UTF8_BOM = "\ufeff"
_FOREIGN_BOMS = (  # UTF-32 first: its little-endian mark starts with UTF-16's
    (codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),
    (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16"),
)


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    if char in _SHORT_ESCAPES:
        return _SHORT_ESCAPES[char]
    return f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}"


def escape_text(text: str) -> str:
    """`text` with every UNSAFE_TEXT character written as a visible escape (\\x1b, \\n, \\u202e)."""
    return UNSAFE_TEXT.sub(_escape, text)


def safe_text(text: object, limit: int = 200) -> str:
    """Text from an untrusted source (a registry, an unverified document, a request) made safe for one
    line of a terminal or a log: escaped (escape_text) and bounded to `limit` characters. A value that
    is not a string (a JSON number, list or null where a string belonged) is shown as its repr."""
    escaped = escape_text(text if isinstance(text, str) else repr(text))
    return escaped if len(escaped) <= limit else escaped[:limit - 3] + "..."


def _describe(char: str) -> str:
    kind = "control character" if unicodedata.category(char) == "Cc" else "invisible formatting character"
    return f"{kind} U+{ord(char):04X} is not allowed"


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


_STANDARD = "tag:yaml.org,2002:"
_MERGE = _STANDARD + "merge"
_MAP, _SEQ, _INT = _STANDARD + "map", _STANDARD + "seq", _STANDARD + "int"
# Scalar types an input may hold. Not !!binary, !!set, !!omap, !!pairs, nor any local (!name)
# or Python tag: no schema wants them, and they would only arrive as surprises.
_SCALAR_TAGS = frozenset(_STANDARD + name for name in ("str", "int", "float", "bool", "null", "timestamp", "value"))
_MAX_INT_DIGITS = 32  # int() of a long digit string is slow (and over 4300 digits an error)

Pair = tuple[yaml.Node, yaml.Node]


class _Mark(Protocol):
    """A position in the file, as PyYAML's pure-Python and C marks both give it."""

    line: int  # counted from 0


def _short_tag(tag: str) -> str:
    return "!!" + tag[len(_STANDARD):] if tag.startswith(_STANDARD) else tag


class _Loader(yaml.SafeLoader):
    """SafeLoader with the limits applied while it scans and composes.

    It also keeps numbers-that-look-like-versions as written: YAML 1.1 reads `3.10` as the
    float 3.1; a version matrix must never do that, so floats keep their source text and are
    validated as strings.
    """

    def __init__(self, text: str, name: str, limits: Limits, merge_keys: bool):
        super().__init__(text)
        self.name = name
        self.limits = limits
        self.merge_keys = merge_keys
        self.depth = 0  # collections open in the composer
        self.aliases = 0
        self.nodes = 0  # composed
        self.expanded = 0  # values converted, aliases counted each time they are reached
        # id(mapping node) -> its pairs with merge keys (<<) resolved, and how many of them
        # (first) came from merges; kept so a node reached again through an alias agrees.
        self.flattened: dict[int, tuple[list[Pair], int]] = {}
        self.flattening: set[int] = set()
        self.converting: set[int] = set()

    def refuse(self, mark: _Mark | None, message: str, key: str = "") -> NoReturn:
        raise InputError(self.name, mark.line + 1 if mark else None, key, message)

    # Scanner: nesting is bounded while reading tokens, before the composer recurses into it
    # (and before the scanner's own per-level bookkeeping makes a deep file quadratic).

    def _check_nesting(self) -> None:
        if self.flow_level + len(self.indents) > self.limits.max_depth:
            self.refuse(self.get_mark(), f"nested more than {self.limits.max_depth} levels deep")

    def fetch_flow_collection_start(self, token_class: type[yaml.Token]) -> None:
        super().fetch_flow_collection_start(token_class)
        self._check_nesting()

    def add_indent(self, column: int) -> bool:
        added: bool = super().add_indent(column)
        if added:
            self._check_nesting()
        return added

    # Composer: aliases and values are counted as the tree is built.

    # Typed here, as PyYAML's stubs leave them untyped.

    def peek_event(self) -> yaml.Event:
        peek: Callable[[], yaml.Event] = super().peek_event
        return peek()

    def get_event(self) -> yaml.Event:
        get: Callable[[], yaml.Event] = super().get_event
        return get()

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > self.limits.max_aliases:
                self.refuse(self.peek_event().start_mark, f"more than {self.limits.max_aliases} aliases (*name)")
            return super().compose_node(parent, index)
        self.nodes += 1
        if self.nodes > self.limits.max_nodes:
            self.refuse(self.peek_event().start_mark, f"more than {self.limits.max_nodes} values")
        if self.check_event(yaml.ScalarEvent):
            return super().compose_node(parent, index)
        self.depth += 1
        if self.depth > self.limits.max_depth:
            self.refuse(self.peek_event().start_mark, f"nested more than {self.limits.max_depth} levels deep")
        try:
            node = super().compose_node(parent, index)
        finally:
            self.depth -= 1
        return node

    def pairs(self, node: yaml.MappingNode, path: PathKey) -> tuple[list[Pair], int]:
        """The mapping's pairs with merge keys resolved, and how many (first) came from merges.

        YAML merge semantics, as PyYAML's flatten_mapping has them, without changing the nodes:
        merged pairs come first so that a key written in the mapping wins, and of several
        mappings merged through one list, the first wins.
        """
        known = self.flattened.get(id(node))
        if known is not None:
            return known
        if id(node) in self.flattening:
            self.refuse(node.start_mark, "a merge key (<<) includes the mapping it is part of", format_key(path))
        self.flattening.add(id(node))
        merged: list[Pair] = []
        own: list[Pair] = []
        for key_node, value_node in node.value:
            if key_node.tag != _MERGE:
                own.append((key_node, value_node))
                continue
            if not self.merge_keys:
                self.refuse(key_node.start_mark, "merge keys (<<) are not allowed in this file", format_key(path))
            sources = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
            for source in reversed(sources):
                if not isinstance(source, yaml.MappingNode):
                    self.refuse(source.start_mark, "a merge key (<<) takes a mapping or a list of mappings",
                                format_key(path))
                merged.extend(self.pairs(source, path)[0])
        self.flattening.discard(id(node))
        # Merged pairs are copies of pairs counted elsewhere: they count against the same budget.
        self.expanded += len(merged)
        if self.expanded > self.limits.max_nodes:
            self.refuse(node.start_mark, f"merge keys (<<) expand to more than {self.limits.max_nodes} values",
                        format_key(path))
        result = (merged + own, len(merged))
        self.flattened[id(node)] = result
        return result


def _keep_text(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> str:
    return str(node.value)


_Loader.add_constructor(_STANDARD + "float", _keep_text)
_Loader.add_constructor(_STANDARD + "value", _keep_text)  # a plain '=' is just text here


def _scalar(node: yaml.ScalarNode, path: PathKey, loader: _Loader) -> Any:
    key = format_key(path)
    if node.tag not in _SCALAR_TAGS:
        loader.refuse(node.start_mark, f"tag '{_short_tag(node.tag)}' is not allowed", key)
    if node.tag == _INT and len(node.value) > _MAX_INT_DIGITS:
        loader.refuse(node.start_mark, f"number longer than {_MAX_INT_DIGITS} digits", key)
    try:
        value = loader.construct_object(node)
    except (ValueError, OverflowError) as exc:  # e.g. a date like 2024-13-45
        loader.refuse(node.start_mark, f"invalid {_short_tag(node.tag)[2:]} '{node.value}': {exc}", key)
    except (KeyError, AttributeError, TypeError, IndexError):  # !!bool, !!timestamp or !!int (`!!int ''`) on other text
        loader.refuse(node.start_mark, f"invalid {_short_tag(node.tag)[2:]} '{node.value}'", key)
    if isinstance(value, str):
        bad = _FORBIDDEN.search(value)
        if bad:
            loader.refuse(node.start_mark, _describe(bad.group()), key)
    return value


def _convert(node: yaml.Node, path: PathKey, doc: Document, loader: _Loader) -> Any:
    doc.lines.setdefault(path, node.start_mark.line + 1)
    loader.expanded += 1
    if loader.expanded > loader.limits.max_nodes:
        # The node is where the alias points to; the top-level key it was reached from says more.
        raise InputError(doc.file, doc.line(path[:1]), format_key(path),
                         f"aliases expand to more than {loader.limits.max_nodes} values")
    if isinstance(node, yaml.ScalarNode):
        return _scalar(node, path, loader)
    if id(node) in loader.converting:
        loader.refuse(node.start_mark, "an alias (*name) refers to a collection that contains it", format_key(path))
    expected = _MAP if isinstance(node, yaml.MappingNode) else _SEQ
    if node.tag != expected:
        loader.refuse(node.start_mark, f"tag '{_short_tag(node.tag)}' is not allowed", format_key(path))
    loader.converting.add(id(node))
    try:
        if isinstance(node, yaml.MappingNode):
            return _convert_mapping(node, path, doc, loader)
        items = []
        for index, item in enumerate(node.value):
            child = path + (index,)
            doc.lines[child] = item.start_mark.line + 1
            items.append(_convert(item, child, doc, loader))
        return items
    finally:
        loader.converting.discard(id(node))


def _convert_mapping(node: yaml.MappingNode, path: PathKey, doc: Document, loader: _Loader) -> dict[str, Any]:
    pairs, merged = loader.pairs(node, path)
    result: dict[str, Any] = {}
    explicit: set[str] = set()
    for index, (key_node, value_node) in enumerate(pairs):
        key = _key(key_node, path, loader)
        child = path + (key,)
        # YAML merge semantics: a key written in the mapping overrides a merged one, and
        # the later of two merged ones wins; only a key written twice is a mistake.
        if index >= merged:
            if key in explicit:
                loader.refuse(key_node.start_mark, "duplicate key", format_key(child))
            explicit.add(key)
        doc.lines[child] = key_node.start_mark.line + 1
        result[key] = _convert(value_node, child, doc, loader)
    return result


def _key(node: yaml.Node, path: PathKey, loader: _Loader) -> str:
    if isinstance(node, yaml.MappingNode):
        loader.refuse(node.start_mark, "keys must be strings, got a mapping", format_key(path))
    if not isinstance(node, yaml.ScalarNode):
        loader.refuse(node.start_mark, "keys must be strings, got a list", format_key(path))
    key = _scalar(node, path, loader)
    if not isinstance(key, (str, int)) or isinstance(key, bool):
        loader.refuse(node.start_mark, f"keys must be strings, got {key!r}", format_key(path))
    key = str(key)
    if any(char in key for char in "\t\r\n"):
        loader.refuse(node.start_mark, "keys must be one line", format_key(path))
    return key


def load_document(path: str | Path, display_name: str | None = None, *, merge_keys: bool = False,
                  limits: Limits = LIMITS) -> Document:
    """Read a YAML file; any problem with it becomes an InputError with its line.

    merge_keys: whether this kind of file may use YAML merge keys (<<).
    """
    name = display_name or str(path)
    try:
        with open(path, "rb") as stream:
            size = _file_size(stream.fileno())
            if size is not None and size > limits.max_bytes:
                raise InputError(name, None, "", f"the file is {size:,} bytes; "
                                                 f"YAML input is limited to {limits.max_bytes:,}")
            raw = stream.read(limits.max_bytes + 1)  # never more, whatever the file claims to be
    except FileNotFoundError:
        raise InputError(name, None, "", "file not found") from None
    except OSError as exc:
        raise InputError(name, None, "", f"cannot read: {exc.strerror or exc}") from None
    if len(raw) > limits.max_bytes:
        raise InputError(name, None, "", f"the file is larger than {limits.max_bytes:,} bytes, "
                                         f"the limit for YAML input")
    return parse_document(_decode(raw, name), name, merge_keys=merge_keys, limits=limits)


def _file_size(fd: int) -> int | None:
    info = os.fstat(fd)
    return info.st_size if stat.S_ISREG(info.st_mode) else None


def _decode(raw: bytes, name: str) -> str:
    for bom, encoding in _FOREIGN_BOMS:
        if raw.startswith(bom):
            raise InputError(name, 1, "", f"the file is {encoding} (it starts with a byte order mark); "
                                          f"YAML input must be UTF-8")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise InputError(name, line, "", f"not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column {column}); "
                                         f"YAML input must be UTF-8") from None


def parse_document(text: str, name: str, *, merge_keys: bool = False, limits: Limits = LIMITS) -> Document:
    """Parse YAML text within `limits`; any problem becomes an InputError with its line.

    merge_keys: whether this kind of file may use YAML merge keys (<<).
    """
    if len(text) > limits.max_bytes or len(text.encode("utf-8", "surrogatepass")) > limits.max_bytes:
        raise InputError(name, None, "", f"the file is larger than {limits.max_bytes:,} bytes, "
                                         f"the limit for YAML input")
    if text.startswith(_UTF8_BOM):
        text = text[1:]
    bad = _FORBIDDEN.search(text)
    if bad:
        bad_line = len(_LINE_BREAK.findall(text, 0, bad.start())) + 1
        raise InputError(name, bad_line, "", _describe(bad.group()))
    doc = Document(file=name, data=None)
    loader = _Loader(text, name, limits, merge_keys)
    try:
        loader.get_event()  # the stream's start
        if loader.check_event(yaml.StreamEndEvent):
            raise InputError(name, 1, "", "the file is empty")
        node = loader.compose_document()
        if node is None:  # a document marker and nothing else
            raise InputError(name, 1, "", "the file is empty")
        if not loader.check_event(yaml.StreamEndEvent):
            loader.refuse(loader.peek_event().start_mark, "a second document starts here; expected one per file")
        doc.data = _convert(node, (), doc, loader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else None
        problem = exc.problem or exc.context or "invalid YAML"
        raise InputError(name, line, "", f"invalid YAML: {problem}") from None
    except yaml.YAMLError as exc:
        raise InputError(name, None, "", f"invalid YAML: {str(exc).splitlines()[0]}") from None
    except RecursionError:  # the limits above should make this unreachable; one line all the same
        raise InputError(name, None, "", f"nested too deeply (the limit is {limits.max_depth} levels)") from None
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
    text = str(value)
    # An error line is shown and logged: never quote what may be key material (a private key or
    # a certificate handed over instead of a YAML file), only say what it is.
    if "-----BEGIN" in text or "PRIVATE KEY" in text:
        return "PEM data (not shown)"
    return f"'{text[:60]}…'" if len(text) > 60 else f"'{text}'"
