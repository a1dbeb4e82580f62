"""Hostile YAML: files built to crash, hang or exhaust the loader, run through the real CLI.

Matrices go through `imagebuild validate --matrix`, vulnerability policies through
`imagebuild gate --policy` (over a workdir that would otherwise pass). Each sample starts
from a file the command accepts and adds one hostile thing. Every one must end with

    error: <file>:<line>: [<key>: ]<message>

as exactly one printable line on stderr, exit code 2, no traceback, nothing written, and
well within the subprocess timeout (a hang fails there). The loader's limits themselves, and
that refusing a bomb costs little memory, are checked on `parse_document` at the end.
"""
from __future__ import annotations

import codecs
import os
import re
import subprocess
import tracemalloc
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from imagebuild.core.source import LIMITS, InputError, Limits, Reader, load_document, parse_document

from .conftest import run_imagebuild
from .test_gate_cli import write_workdir
from .test_matrix_errors import VALID as MATRIX
from .trivy_reports import CPU, report

NEXT = MATRIX.count("\n") + 1  # the line of what a sample appends to the matrix
POLICY = "schema: 1\nseverity: HIGH\nignore_unfixed: true\n"  # 3 lines; what is appended starts at line 4
TIMEOUT = 20  # seconds per CLI run; far above the second or two a refusal takes
MB = 1 << 20


def line_of(text: str) -> int:
    """The matrix's line holding `text`."""
    return MATRIX[:MATRIX.index(text)].count("\n") + 1


@dataclass(frozen=True)
class Sample:
    id: str
    kind: str  # "matrix" (read by validate) or "policy" (read by gate)
    write: Callable[[Path], None]  # writes the hostile file at the given path
    line: int | None  # None: the error is about the whole file, which has no line to name
    message: str  # a part of what the error says


def text(content: str) -> Callable[[Path], None]:
    return lambda path: path.write_bytes(content.encode("utf-8"))


def raw(content: bytes) -> Callable[[Path], None]:
    return lambda path: path.write_bytes(content)


def padded(head: str, filler: str, size: int) -> Callable[[Path], None]:
    """A file of `size` bytes: `head`, then `filler` written in chunks, so no test holds it in memory."""
    def write(path: Path) -> None:
        with path.open("wb") as out:
            out.write(head.encode())
            left = size - len(head)
            chunk = (filler * (MB // len(filler))).encode()
            while left > 0:
                out.write(chunk[:left])
                left -= len(chunk)
    return write


def sparse(size: int) -> Callable[[Path], None]:
    """A file that claims `size` bytes without taking the disk space: reading it all would take minutes."""
    def write(path: Path) -> None:
        path.write_text(MATRIX)
        os.truncate(path, size)
    return write


def bomb(levels: int, refs: int) -> str:
    """Billion laughs on one line: each level is a list of `refs` aliases of the level below."""
    parts = ["l0: &l0 [lol]"] + [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * refs)}]" for i in range(1, levels + 1)]
    return "{" + ", ".join(parts) + "}"


def mapping_bomb(levels: int, refs: int) -> str:
    """The same with mappings, in block style, one level a line."""
    lines = ["  m0: &m0 {lol: lol}"]
    for i in range(1, levels + 1):
        lines.append(f"  m{i}: &m{i} {{{', '.join(f'k{j}: *m{i - 1}' for j in range(refs))}}}")
    return "\n".join(lines) + "\n"


def merge_bomb(levels: int, refs: int) -> str:
    """Merge keys (<<) multiply the pairs of a mapping the same way, without any alias in a value."""
    parts = ["g0: &g0 {lol: lol}"]
    for i in range(1, levels + 1):
        parts.append(f"g{i}: &g{i} {{<<: [{', '.join([f'*g{i - 1}'] * refs)}], k{i}: v}}")
    return "{" + ", ".join(parts) + "}"


def expiring(value: str) -> str:
    return f"exceptions:\n  - id: CVE-2024-1\n    owner: me\n    reason: r\n    expires: {value}\n"


SAMPLES = [
    # Control characters and NUL bytes, raw or written as escapes in double-quoted strings.
    Sample("nul-in-a-value", "matrix", text(MATRIX + "name: pad\x00dle\n"), NEXT, "control character U+0000"),
    Sample("nul-as-first-byte", "policy", raw(b"\x00" + POLICY.encode()), 1, "control character U+0000"),
    Sample("bell-in-a-key", "matrix", text(MATRIX + "lab\x07els: {}\n"), NEXT, "control character U+0007"),
    Sample("escape-in-a-key", "matrix", text(MATRIX + "\x1b[31mlabels: {}\n"), NEXT, "control character U+001B"),
    Sample("escape-sequence-in-a-value", "policy", text(POLICY + "exceptions:\n  - reason: \x1b[2Jgone\n"), 5,
           "control character U+001B"),
    Sample("escape-written-as-backslash-e", "matrix", text(MATRIX.replace("project: paddle", 'project: "\\e]0;x\\a"')),
           line_of("project: paddle"), "project: control character U+001B"),
    Sample("bell-written-as-backslash-a-in-a-key", "policy", text(POLICY + '"sev\\aerity": LOW\n'), 4,
           "control character U+0007"),
    Sample("nul-written-as-backslash-0", "policy", text(POLICY + 'note: "a\\0b"\n'), 4,
           "note: control character U+0000"),
    Sample("delete", "matrix", text(MATRIX + "name: a\x7fb\n"), NEXT, "control character U+007F"),
    Sample("c1-control", "matrix", text(MATRIX + "name: a\u009bb\n"), NEXT, "control character U+009B"),
    Sample("next-line-as-a-line-break", "policy", text(POLICY + "note: a\u0085b\n"), 4, "control character U+0085"),
    Sample("right-to-left-override", "policy", text(POLICY + "exceptions:\n  - owner: \u202eevil\n"), 5,
           "invisible formatting character U+202E"),
    # Invalid encodings.
    Sample("latin-1", "matrix", raw(MATRIX.encode() + "name: Café\n".encode("latin-1")), NEXT, "not valid UTF-8"),
    Sample("latin-1-in-a-comment", "policy", raw(POLICY.encode() + "# Müller\n".encode("latin-1")), 4,
           "not valid UTF-8 (byte 0xfc at column 4)"),
    Sample("utf-16-little-endian-with-bom", "matrix", raw(MATRIX.encode("utf-16")), 1, "UTF-16"),
    Sample("utf-16-big-endian-with-bom", "policy", raw(codecs.BOM_UTF16_BE + POLICY.encode("utf-16-be")), 1,
           "UTF-16"),
    Sample("utf-32-with-bom", "matrix", raw(MATRIX.encode("utf-32")), 1, "UTF-32"),
    Sample("utf-16-without-bom", "policy", raw(POLICY.encode("utf-16-le")), 1, "control character U+0000"),
    Sample("truncated-utf-8-sequence", "matrix", raw(MATRIX.encode() + b"name: caf\xc3\n"), NEXT, "not valid UTF-8"),
    Sample("overlong-utf-8", "policy", raw(POLICY.encode() + b"# \xc0\xaf\n"), 4, "not valid UTF-8"),
    Sample("utf-8-encoded-surrogate", "matrix", raw(MATRIX.encode() + b"name: \xed\xa0\x80\n"), NEXT, "not valid UTF-8"),
    # Alias and anchor expansion bombs.
    Sample("billion-laughs-9-levels-of-9", "matrix", text(MATRIX + f"lol: {bomb(9, 9)}\n"), NEXT, "aliases expand"),
    Sample("billion-laughs-of-mappings", "policy", text(POLICY + "lol:\n" + mapping_bomb(9, 9)), 4, "aliases expand"),
    Sample("billion-laughs-20-levels-of-2", "policy", text(POLICY + f"lol: {bomb(20, 2)}\n"), 4, "aliases expand"),
    Sample("merge-key-bomb", "matrix", text(MATRIX + f"lol: {merge_bomb(9, 9)}\n"), NEXT, "merge keys (<<) expand"),
    Sample("too-many-aliases", "policy", text(POLICY + "x: &x y\nmany: [" + "*x, " * 1000 + "]\n"), 5,
           f"more than {LIMITS.max_aliases} aliases"),
    Sample("alias-inside-itself", "matrix", text(MATRIX + "loop: &loop [a, *loop]\n"), NEXT,
           "refers to a collection that contains it"),
    # Very deep nesting, flow and block style.
    Sample("10k-flow-sequences", "matrix", text(MATRIX + "name: " + "[" * 10_000 + "]" * 10_000 + "\n"), NEXT,
           "nested more than"),
    Sample("100k-flow-sequences-never-closed", "policy", text(POLICY + "note: " + "[" * 100_000 + "\n"), 4,
           "nested more than"),
    Sample("100k-flow-mappings", "policy", text(POLICY + "note: " + "{a: " * 100_000 + "}" * 100_000 + "\n"), 4,
           "nested more than"),
    Sample("10k-block-sequences", "matrix", text(MATRIX + "name:\n" + "- " * 10_000 + "x\n"), NEXT + 1, "nested more than"),
    Sample("100k-block-sequences", "policy", text(POLICY + "note:\n  " + "- " * 100_000 + "x\n"), 5,
           "nested more than"),
    # Key i sits at line NEXT + i, at nesting level i + 1: the first one past the limit is named.
    Sample("block-mappings-indented-200-deep", "matrix",
           text(MATRIX + "".join(" " * i + f"k{i}:\n" for i in range(200)) + " " * 200 + "x\n"),
           NEXT + LIMITS.max_depth, "nested more than"),
    # Very large files, refused by their size before they are read.
    Sample("50-mb-comment", "matrix", padded(MATRIX + "# ", "lol ", 50 * MB), None, "the file is 52,428,800 bytes"),
    Sample("50-mb-value", "policy", padded(POLICY + "note: ", "x", 50 * MB), None, "the file is 52,428,800 bytes"),
    Sample("50-gb-sparse-file", "matrix", sparse(50 << 30), None, "YAML input is limited to"),
    Sample("one-byte-over-the-limit", "policy", padded(POLICY + "# ", "x", LIMITS.max_bytes + 1), None,
           f"YAML input is limited to {LIMITS.max_bytes:,}"),
    Sample("small-file-with-too-many-values", "matrix", text(MATRIX + "name: [" + "a," * 100_000 + "]\n"), NEXT,
           f"more than {LIMITS.max_nodes} values"),
    # Duplicate keys.
    Sample("duplicate-top-level-key", "matrix", text(MATRIX + "registry: other.example.com\n"), NEXT,
           "registry: duplicate key"),
    Sample("duplicate-key-in-a-list-item", "policy", text(POLICY + "exceptions:\n  - id: CVE-1\n    id: CVE-2\n"), 6,
           "exceptions[0].id: duplicate key"),
    Sample("duplicate-key-in-a-flow-mapping", "matrix", text(MATRIX + "labels: {a: 1, a: 2}\n"), NEXT,
           "labels.a: duplicate key"),
    Sample("duplicate-key-quoted-once", "policy", text(POLICY + '"severity": LOW\n'), 4, "severity: duplicate key"),
    Sample("duplicate-key-as-number-and-string", "matrix", text(MATRIX + "labels:\n  1: x\n  '1': y\n"), NEXT + 2,
           "labels.1: duplicate key"),
    Sample("duplicate-key-deep-down", "matrix",
           text(MATRIX.replace("    family: debian\n", "    family: debian\n    family: ubuntu\n")), line_of("family: debian") + 1,
           "os.debian12.family: duplicate key"),
    # Merge keys, which a policy does not take.
    Sample("merge-key-in-an-exception", "policy",
           text(POLICY + "base: &b {owner: me}\nexceptions:\n  - <<: *b\n    id: CVE-1\n"), 6,
           "exceptions[0]: merge keys (<<) are not allowed in this file"),
    Sample("merge-key-at-the-top", "policy", text(POLICY + "defaults: &d {ignore_unfixed: false}\n<<: *d\n"), 5,
           "merge keys (<<) are not allowed"),
    Sample("merge-key-with-a-list", "policy", text(POLICY + "a: &a {x: 1}\nb: &b {y: 2}\nc: {<<: [*a, *b]}\n"), 6,
           "c: merge keys (<<) are not allowed"),
    Sample("merge-key-without-an-alias", "policy", text(POLICY + "c:\n  <<: {severity: LOW}\n"), 5,
           "c: merge keys (<<) are not allowed"),
    # Tags that would build objects, several documents, keys that are not strings, values no schema reads.
    Sample("python-object-apply", "matrix", text(MATRIX + 'name: !!python/object/apply:os.system ["touch pwned"]\n'),
           NEXT, "tag '!!python/object/apply:os.system' is not allowed"),
    Sample("python-name", "policy", text(POLICY + "note: !!python/name:os.system\n"), 4,
           "tag '!!python/name:os.system' is not allowed"),
    Sample("local-tag", "matrix", text(MATRIX + "name: !ruby/object {a: 1}\n"), NEXT,
           "tag '!ruby/object' is not allowed"),
    Sample("binary", "policy", text(POLICY + "note: !!binary aGVsbG8=\n"), 4, "tag '!!binary' is not allowed"),
    Sample("set", "matrix", text(MATRIX + "name: !!set {a, b}\n"), NEXT, "tag '!!set' is not allowed"),
    Sample("second-document", "matrix", text(MATRIX + "---\nschema: 1\n"), NEXT, "a second document starts here"),
    Sample("second-document-after-an-end-marker", "policy", text(POLICY + "...\n---\nschema: 1\n"), 5,
           "a second document starts here"),
    Sample("list-as-a-key", "matrix", text(MATRIX + "? [a, b]\n: c\n"), NEXT, "keys must be strings, got a list"),
    Sample("null-as-a-key", "policy", text(POLICY + "~: x\n"), 4, "keys must be strings, got None"),
    Sample("boolean-as-a-key", "policy", text(POLICY + "yes: x\n"), 4, "keys must be strings, got True"),
    Sample("5000-digit-number", "matrix", text(MATRIX.replace("schema: 1", "schema: " + "9" * 5000)), line_of("schema: 1"),
           "schema: number longer than"),
    Sample("impossible-date", "policy", text(POLICY + expiring("2027-02-30")), 8,
           "exceptions[0].expires: invalid timestamp '2027-02-30'"),
    Sample("explicit-bool-on-other-text", "policy", text(POLICY.replace("true", "!!bool maybe")), 3,
           "ignore_unfixed: invalid bool 'maybe'"),
    Sample("explicit-timestamp-on-other-text", "matrix", text(MATRIX + "name: !!timestamp soon\n"), NEXT,
           "name: invalid timestamp 'soon'"),
    # Found by tests/test_fuzz_yaml.py: PyYAML's int constructor indexes the empty string.
    Sample("explicit-int-on-nothing", "matrix", text(MATRIX + "name: !!int\n"), NEXT, "name: invalid int ''"),
    Sample("undefined-alias", "matrix", text(MATRIX + "name: *nowhere\n"), NEXT, "found undefined alias"),
    Sample("empty-file", "policy", text(""), 1, "the file is empty"),
]


@dataclass(frozen=True)
class Outcome:
    returncode: int | None  # None: still running at the timeout
    stdout: str
    stderr: str
    changed: tuple[str, ...]  # files created, changed or removed in the sample's folder


def snapshot(folder: Path) -> dict[str, bytes]:
    # The hostile file itself can be 50 MB (or claim 50 GB): it is the one file not read back.
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*")
            if p.is_file() and p.name not in ("matrix.yaml", "policy.yaml")}


def run_sample(sample: Sample, folder: Path) -> Outcome:
    if sample.kind == "matrix":
        sample.write(folder / "matrix.yaml")
        args: tuple[str, ...] = ("validate", "--matrix", "matrix.yaml")
    else:
        write_workdir(folder, {CPU: report()})  # a workdir the gate passes with a clean policy
        sample.write(folder / "policy.yaml")
        args = ("gate", "--workdir", "work", "--policy", "policy.yaml")
    before = snapshot(folder)
    try:
        result = run_imagebuild(*args, cwd=folder, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as expired:
        return Outcome(None, str(expired.stdout or ""), str(expired.stderr or ""), ())
    after = snapshot(folder)
    changed = tuple(sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name)))
    return Outcome(result.returncode, result.stdout, result.stderr, changed)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, Outcome]:
    """Every sample through the CLI once, in parallel: fresh processes are slow."""

    def run(sample: Sample) -> Outcome:
        folder = tmp_path_factory.mktemp(sample.id)
        try:
            return run_sample(sample, folder)
        finally:
            for name in ("matrix.yaml", "policy.yaml"):  # the 50 MB ones need not stay on disk
                (folder / name).unlink(missing_ok=True)

    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        return dict(zip((s.id for s in SAMPLES), pool.map(run, SAMPLES), strict=True))


every_sample = pytest.mark.parametrize("sample", [pytest.param(s, id=f"{s.kind}-{s.id}") for s in SAMPLES])


def test_every_class_has_several_samples_for_each_kind_of_file():
    assert len({s.id for s in SAMPLES}) == len(SAMPLES)
    for kind in ("matrix", "policy"):
        assert sum(s.kind == kind for s in SAMPLES) >= 20


@every_sample
def test_finishes_well_within_the_timeout(sample, outcomes):
    assert outcomes[sample.id].returncode is not None, f"still running after {TIMEOUT} s"


@every_sample
def test_exits_with_code_2(sample, outcomes):
    assert outcomes[sample.id].returncode == 2, outcomes[sample.id].stderr[-2000:]


@every_sample
def test_prints_one_printable_line_on_stderr_and_nothing_on_stdout(sample, outcomes):
    outcome = outcomes[sample.id]
    assert len(outcome.stderr.splitlines()) == 1, outcome.stderr[-2000:]
    assert outcome.stderr.endswith("\n")
    assert outcome.stderr.rstrip("\n").isprintable(), repr(outcome.stderr)
    assert outcome.stdout == ""


@every_sample
def test_shows_no_traceback(sample, outcomes):
    outcome = outcomes[sample.id]
    assert "Traceback" not in outcome.stderr + outcome.stdout


@every_sample
def test_names_the_file_and_the_line(sample, outcomes):
    line = outcomes[sample.id].stderr.rstrip("\n")
    where = f"error: {sample.kind}.yaml:{sample.line}: " if sample.line else f"error: {sample.kind}.yaml: "
    assert line.startswith(where), line


@every_sample
def test_says_what_is_wrong(sample, outcomes):
    assert sample.message in outcomes[sample.id].stderr, outcomes[sample.id].stderr


@every_sample
def test_writes_nothing(sample, outcomes):
    assert outcomes[sample.id].changed == ()


def test_the_same_files_without_the_hostile_part_pass(tmp_path):
    """The control: each command accepts its base file, so each refusal above is its sample's."""
    (tmp_path / "m").mkdir()
    (tmp_path / "p").mkdir()
    matrix = run_sample(Sample("valid", "matrix", text(MATRIX), None, ""), tmp_path / "m")
    policy = run_sample(Sample("valid", "policy", text(POLICY), None, ""), tmp_path / "p")
    assert (matrix.returncode, matrix.stderr) == (0, "")
    assert policy.returncode == 0, policy.stderr


def test_a_matrix_may_use_merge_keys(tmp_path):
    """Matrices may share settings between entries with merge keys; only policies refuse them."""
    (tmp_path / "matrix.yaml").write_text(MATRIX.replace("    family: debian\n", "    <<: {family: debian}\n"))
    run = run_imagebuild("validate", "--matrix", "matrix.yaml", cwd=tmp_path, timeout=TIMEOUT)
    assert run.returncode == 0, run.stderr


# --- the loader's limits, on parse_document ---------------------------------------------------


SMALL = Limits(max_bytes=1000, max_depth=5, max_aliases=4, max_nodes=50)


def refusal(text: str, expected: str, limits: Limits = SMALL, merge_keys: bool = False) -> str:
    """The InputError parse_document raises for `text`, which must say `expected`."""
    with pytest.raises(InputError, match=re.escape(expected)) as error:
        parse_document(text, "f.yaml", limits=limits, merge_keys=merge_keys)
    return str(error.value)


@pytest.mark.parametrize("nest", [
    pytest.param(lambda n: "[" * n + "x" + "]" * n, id="flow-sequences"),
    pytest.param(lambda n: "{a: " * n + "x" + "}" * n, id="flow-mappings"),
    pytest.param(lambda n: "- " * n + "x", id="block-sequences"),
    pytest.param(lambda n: "".join("  " * i + "k:\n" for i in range(n - 1)) + "  " * (n - 1) + "k: x",
                 id="block-mappings"),
    pytest.param(lambda n: "- " * (n // 2) + "[" * (n - n // 2) + "x" + "]" * (n - n // 2), id="block-then-flow"),
])
def test_nesting_is_allowed_up_to_max_depth_and_refused_beyond(nest):
    parse_document(nest(SMALL.max_depth) + "\n", "f.yaml", limits=SMALL)
    refusal(nest(SMALL.max_depth + 1) + "\n", "nested more than 5 levels deep")


def test_aliases_are_allowed_up_to_max_aliases_and_refused_beyond():
    parse_document("a: &a x\nb: [*a, *a, *a, *a]\n", "f.yaml", limits=SMALL)
    assert refusal("a: &a x\nb: [*a, *a, *a, *a, *a]\n", "more than 4 aliases") == "f.yaml:2: more than 4 aliases (*name)"


def test_values_are_counted_with_every_alias_expanded():
    # 1 mapping + 2 keys' values: a list of 20 and a list of 2 aliases to it: 3 + 20 + 2 * 21 = 65 > 50.
    items = ", ".join(["x"] * 20)
    parse_document(f"a: &a [{items}]\nb: [*a]\n", "f.yaml", limits=SMALL)
    refusal(f"a: &a [{items}]\nb: [*a, *a]\n", "aliases expand to more than 50 values")


def test_values_are_counted_as_they_are_read():
    assert refusal("[" + "x, " * 60 + "]\n", "more than 50 values") == "f.yaml:1: more than 50 values"


def test_a_file_one_byte_over_max_bytes_is_refused(tmp_path):
    path = tmp_path / "f.yaml"
    path.write_text("a: " + "x" * (SMALL.max_bytes - 4) + "\n")
    load_document(path, "f.yaml", limits=SMALL)
    path.write_text("a: " + "x" * (SMALL.max_bytes - 3) + "\n")
    with pytest.raises(InputError, match="the file is 1,001 bytes; YAML input is limited to 1,000"):
        load_document(path, "f.yaml", limits=SMALL)


def test_reading_stops_after_max_bytes_even_when_the_file_has_no_end():
    with pytest.raises(InputError, match="larger than 1,000 bytes"):
        load_document("/dev/zero", "zero.yaml", limits=SMALL)


def test_an_alias_bomb_is_refused_without_building_its_expansion():
    tracemalloc.start()
    try:
        with pytest.raises(InputError, match="aliases expand"):
            parse_document(f"lol: {bomb(9, 9)}\n", "f.yaml")  # 9**9 = 387 million strings if expanded
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * MB, f"{peak / MB:.0f} MiB"


def test_a_merge_bomb_is_refused_without_building_its_pairs():
    tracemalloc.start()
    try:
        with pytest.raises(InputError, match="merge keys"):
            parse_document(f"lol: {merge_bomb(9, 9)}\n", "f.yaml", merge_keys=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * MB, f"{peak / MB:.0f} MiB"


def test_nesting_far_past_python_recursion_is_refused_quickly_and_cleanly():
    for text in ("[" * 1_000_000, "- " * 500_000 + "x", "{a: " * 200_000):
        refusal(text + "\n", "nested more than 64 levels deep", LIMITS)


# --- what the loader still accepts ------------------------------------------------------------


def test_tabs_and_line_breaks_in_values_are_fine():
    doc = parse_document('run: |\n  set -e\n  make\nsep: "a\\tb"\ncrlf: x\r\nnote: "one\\ntwo"\n', "f.yaml")
    assert doc.data == {"run": "set -e\nmake\n", "sep": "a\tb", "crlf": "x", "note": "one\ntwo"}


def test_utf_8_text_with_or_without_a_byte_order_mark_is_fine(tmp_path):
    path = tmp_path / "f.yaml"
    path.write_bytes(codecs.BOM_UTF8 + "owner: Zoë 张伟 🙂\n".encode())
    assert load_document(path).data == {"owner": "Zoë 张伟 🙂"}


def test_dates_and_plain_equals_signs_keep_their_meaning():
    doc = parse_document("expires: 2027-01-31\nenv: =\n", "f.yaml")
    assert str(doc.data["expires"]) == "2027-01-31" and doc.data["env"] == "="


def test_error_lines_escape_what_could_split_them_or_drive_a_terminal():
    line = str(InputError("evil\n.yaml", 3, "k\x1b[2J", "got 'a\rb\u202ec'"))
    assert line == "evil\\n.yaml:3: k\\x1b[2J: got 'a\\rb\\u202ec'"


def test_long_values_quoted_in_errors_are_cut_short():
    doc = parse_document("schema: " + "x" * 5000 + "\n", "f.yaml")
    with pytest.raises(InputError, match=r"^f\.yaml:1: schema: expected an integer, got 'x{60}…'\Z"):
        Reader(doc).integer(doc.data["schema"], ("schema",))
