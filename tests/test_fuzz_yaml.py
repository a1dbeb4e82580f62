"""Fuzzing the hardened YAML loader (source.py) and the matrix parser on top of it.

Every matrix, policy and release file may come from a pull request: whatever its bytes, loading
it either gives a Document or raises InputError, whose one line is safe to print. Nothing else
(no PyYAML exception, no RecursionError, no UnicodeError, no TypeError from a validator).
Bounded: a few hundred examples each, a few seconds on a busy 2-core machine.
"""
from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from imagebuild.config.matrix import MatrixParser
from imagebuild.config.support import load_support_table
from imagebuild.core.source import UNSAFE_TEXT, Document, InputError, Limits, load_document, parse_document

REPO = Path(__file__).resolve().parent.parent
SMALL = Limits(max_bytes=4096, max_depth=8, max_aliases=8, max_nodes=200)  # reached often, not rarely
# No example database: nothing written into the checkout; each run draws afresh.
FUZZ = settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

# Pieces of YAML syntax, so that generated text reaches the composer and the converter, not only
# the scanner's first complaint.
TOKENS = ["- ", ": ", "? ", "\n", "\n  ", "\n    ", "&a ", "*a", "&b ", "*b", "<<: ", "<<: *a", "[", "]", "{", "}",
          ", ", "'", '"', "!!str ", "!!int ", "!!binary ", "!!python/object:os.system ", "!local ", "!!set ",
          "!!timestamp ", "!!bool ", "--- ", "...", "#", "|\n  ", ">\n  ", "key", "3.10", "0x1f", "1e9",
          "2024-13-45", "9" * 40, "~", "null", "yes", "\\x1b", '"\\x1b"', '"\\u202e"', '"\\ud800"', "\t",
          "%YAML 1.1\n", "\ufeff", "\u2028", "\x85", "é"]
yaml_like = st.lists(st.sampled_from(TOKENS) | st.text(max_size=4), max_size=60).map("".join)


def _only_input_errors(call) -> Document | None:
    try:
        return call()
    except InputError as err:
        line = str(err)
        assert not UNSAFE_TEXT.search(line), line  # one printable line, whatever the file held
        assert "\n" not in line
        return None


@FUZZ
@given(yaml_like)
def test_yaml_like_text_gives_a_document_or_an_input_error(text):
    _only_input_errors(lambda: parse_document(text, "fuzz.yaml", merge_keys=False, limits=SMALL))
    _only_input_errors(lambda: parse_document(text, "fuzz.yaml", merge_keys=True, limits=SMALL))


@FUZZ
@given(st.text(max_size=300))
def test_arbitrary_text_gives_a_document_or_an_input_error(text):
    _only_input_errors(lambda: parse_document(text, "fuzz.yaml", merge_keys=True, limits=SMALL))


_scratch = Path(tempfile.mkdtemp(prefix="imagebuild-fuzz-yaml-"))


@FUZZ
@given(st.binary(max_size=300) | yaml_like.map(lambda t: t.encode("utf-8", "surrogatepass")))
def test_arbitrary_bytes_in_a_file_give_a_document_or_an_input_error(raw):
    path = _scratch / "fuzz.yaml"
    path.write_bytes(raw)
    _only_input_errors(lambda: load_document(path, merge_keys=True, limits=SMALL))


# --- the matrix parser: the example matrix with values swapped for anything at all ---------------------

EXAMPLE = yaml.safe_load((REPO / "examples/local/matrix.yaml").read_text())
SUPPORT = load_support_table()
scalar = st.none() | st.booleans() | st.integers(-10, 10**6) | st.text(max_size=12) | st.sampled_from(
    ["3.10", "cpu", "debian12", "11.8", "3.3.1", "2.6.2", "x" * 400, "{paddle}", "{nope}", "a\nb", "../x",
     "/etc/passwd", "sha256:" + "0" * 64])
value = st.recursive(scalar, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                          max_size=3), max_leaves=8)


def _paths(data, prefix=()):
    yield prefix
    if isinstance(data, dict):
        for key, item in data.items():
            yield from _paths(item, prefix + (key,))
    elif isinstance(data, list):
        for index, item in enumerate(data):
            yield from _paths(item, prefix + (index,))


PATHS = [p for p in _paths(EXAMPLE) if p]


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(PATHS), value), min_size=1, max_size=4))
def test_a_matrix_with_any_values_parses_or_is_one_input_error(edits):
    data = copy.deepcopy(EXAMPLE)
    for path, new in edits:
        target = data
        try:
            for part in path[:-1]:
                target = target[part]
            target[path[-1]] = new
        except (KeyError, IndexError, TypeError):
            continue  # an earlier edit replaced what this one points into
    text = yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
    doc = _only_input_errors(lambda: parse_document(text, str(REPO / "examples/local/fuzz.yaml"), merge_keys=True))
    if doc is not None:
        _only_input_errors(lambda: MatrixParser(doc, SUPPORT).parse())
