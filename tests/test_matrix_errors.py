"""Malformed matrix.yaml files: each gets one line naming file, line and key; exit code 2.

Every case starts from VALID (a small matrix that validates) and breaks one thing. The
real CLI runs on it in a fresh process, through `validate`, and for one case of each kind
of check (YAML, schema, catalogs, support table, expansion, planning) through `render` too:

    error: matrix.yaml:<line>: <key>: <message>

exactly one line on stderr, exit code 2, no traceback, and nothing written: no
dockerfiles/ folder appears beside the matrix.

Line numbers are counted in the YAML text of each case; VALID's lines are numbered in
the margin below, and appended lines start at 25.
"""
from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

VALID = """\
schema: 1
registry: registry.example.com
project: paddle
repository: paddle
os:
  debian12:
    image: docker.io/library/debian:12
    family: debian
cuda:
  "11.8":
    version: "11.8"
    cudnn: "8.6"
    provider: wheels
    wheels:
      - nvidia-cuda-runtime-cu11==11.8.89
      - nvidia-cudnn-cu11==8.6.0.163
tags:
  gpu: ["{paddle}-gpu-cuda{cuda}-cudnn{cudnn}{py_suffix}"]
  cpu: ["{paddle}{py_suffix}"]
matrix:
  os: [debian12]
  cuda: [cpu, "11.8"]
  python: ["3.10", "3.11"]
  paddle: ["2.6.2"]
"""
#  1 schema            7 image       13 provider       19 tags.cpu        25 (appended)
#  2 registry          8 family      14 wheels         20 matrix
#  3 project           9 cuda        15 wheels[0]      21 matrix.os
#  4 repository       10 "11.8"      16 wheels[1]      22 matrix.cuda
#  5 os               11 version     17 tags           23 matrix.python
#  6 debian12         12 cudnn       18 tags.gpu       24 matrix.paddle
# matrix: is last, so appended "  exclude:"/"  include:" lines belong to it.

SECRET = "hunter2"  # a credential some cases put into the matrix; no error may repeat it


def edit(*pairs: str) -> str:
    """VALID with each `old` (which must occur exactly once) replaced by its `new`."""
    text = VALID
    for old, new in zip(pairs[::2], pairs[1::2]):
        assert text.count(old) == 1, f"{old!r} must occur once in VALID"
        text = text.replace(old, new)
    return text


def append(*lines: str) -> str:
    """VALID plus these lines; the first one is line 25."""
    return VALID + "".join(line + "\n" for line in lines)


@dataclass(frozen=True)
class Case:
    id: str
    text: str
    line: int
    key: str | None  # None: the error is about the file, not one key
    message: str  # a fragment of the explanation
    render: bool = False  # also run it through `render`, which must write nothing

    @property
    def commands(self) -> tuple[str, ...]:
        return ("validate", "render") if self.render else ("validate",)


CASES = [
    # --- the file itself --------------------------------------------------------------
    Case("yaml-syntax-error", edit("project: paddle", "project: paddle: x"),
         3, None, "invalid YAML: mapping values are not allowed here", render=True),
    Case("yaml-tab-indentation", edit("    family: debian", "\tfamily: debian"),
         8, None, "invalid YAML: found character '\\t' that cannot start any token"),
    Case("empty-file", "", 1, None, "the file is empty", render=True),
    Case("comments-only", "# a matrix, one day\n", 1, None, "the file is empty"),
    Case("top-level-is-a-list", "- schema: 1\n- registry: registry.example.com\n",
         1, None, "expected a mapping, got a list"),
    Case("duplicate-top-level-key", append("project: other"), 25, "project", "duplicate key"),
    Case("duplicate-nested-key", edit("    family: debian", "    family: debian\n    family: ubuntu"),
         9, "os.debian12.family", "duplicate key", render=True),
    # --- top-level keys ----------------------------------------------------------------
    Case("unknown-top-level-key", append("registy: registry.example.org"),
         25, "registy", "unknown key (did you mean 'registry'?)", render=True),
    Case("wrong-schema-number", edit("schema: 1", "schema: 2"),
         1, "schema", "unsupported schema 2 (this imagebuild reads schema 1)"),
    Case("schema-as-string", edit("schema: 1", 'schema: "1"'), 1, "schema", "expected an integer, got '1'"),
    Case("missing-registry", edit("registry: registry.example.com", "# registry: forgotten"),
         1, None, "missing required key 'registry'"),
    Case("registry-with-scheme", edit("registry: registry.example.com", "registry: https://registry.example.com"),
         2, "registry", "'https://registry.example.com' is not a registry host[:port]"),
    Case("uppercase-project", edit("project: paddle", "project: Paddle"),
         3, "project", "'Paddle' must be lowercase letters, digits and . _ -"),
    # --- axes ------------------------------------------------------------------------------
    Case("python-as-a-bare-integer", edit('python: ["3.10", "3.11"]', "python: [3]"),
         23, "matrix.python[0]", "'3' is not a Python version like 3.11"),
    Case("python-axis-not-a-list", edit('python: ["3.10", "3.11"]', 'python: "3.10"'),
         23, "matrix.python", "expected a list, got '3.10'"),
    Case("empty-axis", edit('python: ["3.10", "3.11"]', "python: []"), 23, "matrix.python", "must not be empty"),
    Case("missing-axis", edit('  paddle: ["2.6.2"]', "  # paddle: forgotten"),
         20, "matrix", "missing required key 'paddle'"),
    Case("paddle-version-not-in-support-table",
         edit('  paddle: ["2.6.2"]', '  paddle:\n    - "2.6.2"\n    - "3.9.0"'),
         26, "matrix.paddle[1]", "'3.9.0' is not in the support table (known: 2.5.2, 2.6.2, 3.0.0, ", render=True),
    Case("os-not-in-catalog", edit("os: [debian12]", "os: [debian13]"),
         21, "matrix.os[0]", "'debian13' is not in the os catalog (did you mean 'debian12'?)"),
    Case("cuda-not-in-catalog", edit('cuda: [cpu, "11.8"]', 'cuda: [cpu, "11.9"]'),
         22, "matrix.cuda[1]", "'11.9' is not in the cuda catalog (did you mean '11.8'?)"),
    Case("axis-value-listed-twice", edit('python: ["3.10", "3.11"]', 'python: ["3.10", "3.11", "3.10"]'),
         23, "matrix.python[2]", "'3.10' is listed twice"),
    Case("axis-value-listed-twice-once-unquoted", edit('python: ["3.10", "3.11"]', 'python: ["3.10", 3.10]'),
         23, "matrix.python[1]", "'3.10' is listed twice"),
    # --- the support table -------------------------------------------------------------
    Case("paddle-does-not-support-python", edit('python: ["3.10", "3.11"]', 'python: ["3.10", "3.13"]'),
         23, "matrix.python[1]", "paddle 2.6.2 does not support Python 3.13 (supported: 3.8, 3.9, 3.10, 3.11, 3.12); "
                                 "exclude it or list it under allow_unsupported with a reason", render=True),
    Case("paddle-does-not-support-cuda-cudnn", edit('cudnn: "8.6"', 'cudnn: "8.9"'),
         22, "matrix.cuda[1]", "paddle 2.6.2 does not support CUDA 11.8 with cuDNN 8.9"),
    Case("include-outside-support-table",
         append("  include:", '    - {os: debian12, cuda: "11.8", python: "3.12", paddle: "3.0.0"}'),
         26, "matrix.include[0]", "paddle 3.0.0 does not support CUDA 11.8 with cuDNN 8.6"),
    Case("allow-unsupported-without-reason",
         append("allow_unsupported:", '  - {paddle: "2.6.2", python: "3.13"}'),
         26, "allow_unsupported[0]", "missing required key 'reason'"),
    Case("allow-unsupported-with-short-reason",
         append("allow_unsupported:", '  - {python: "3.13", reason: "why not"}'),
         26, "allow_unsupported[0].reason", "say why in a sentence (at least 10 characters)"),
    Case("allow-unsupported-matching-nothing",
         append("allow_unsupported:", '  - {python: "3.13", reason: "preview builds for the platform team"}'),
         26, "allow_unsupported[0]", "allows nothing", render=True),
    Case("allow-unsupported-naming-no-axis",
         append("allow_unsupported:", '  - {reason: "everything goes, trust me on this"}'),
         26, "allow_unsupported[0]", "name at least one of os, cuda, python, paddle"),
    # --- exclude and include ----------------------------------------------------------
    Case("exclude-value-not-in-axes", append("  exclude:", '    - {python: "3.12"}'),
         26, "matrix.exclude[0].python", "'3.12' is not among the matrix's python values (3.10, 3.11)"),
    Case("exclude-that-excludes-nothing",
         append("  exclude:", '    - {cuda: cpu, python: "3.10"}', '    - {python: "3.10", cuda: cpu}'),
         27, "matrix.exclude[1]", "excludes no combination", render=True),
    Case("exclude-empty-entry", append("  exclude:", "    - {}"),
         26, "matrix.exclude[0]", "an empty exclude entry would remove every combination"),
    Case("exclude-everything", append("  exclude:", '    - {paddle: "2.6.2"}'),
         20, "matrix", "expands to no combination at all"),
    Case("include-new-combination-lacking-axes", append("  include:", '    - {paddle: "3.0.0", python: "3.12"}'),
         26, "matrix.include[0]", "matches no combination, so it adds a new one, which needs os, cuda", render=True),
    Case("include-matching-but-adding-nothing", append("  include:", '    - {python: "3.10"}'),
         26, "matrix.include[0]", "matches existing combinations but adds nothing to them"),
    Case("include-unknown-key", append("  include:", '    - {python: "3.10", colour: green}'),
         26, "matrix.include[0].colour", "unknown key"),
    Case("include-adding-one-variant-twice",
         append("  include:", '    - {os: debian12, cuda: cpu, python: "3.12", paddle: "2.6.2"}',
                '    - {os: debian12, cuda: cpu, python: "3.12", paddle: "2.6.2"}'),
         27, "matrix.include[1]", "gives variant 'paddle2.6.2-cpu-py3.12-debian12' twice", render=True),
    # --- tags ------------------------------------------------------------------------------
    Case("tag-template-unknown-field", edit('cpu: ["{paddle}{py_suffix}"]', 'cpu: ["{paddle}{pyhton}"]'),
         19, "tags.cpu[0]", "unknown field {pyhton} (did you mean 'python'?)"),
    Case("tag-template-invalid-characters", edit('gpu: ["{paddle}-gpu-cuda{cuda}-cudnn{cudnn}{py_suffix}"]',
                                                 'gpu: ["{paddle}:gpu"]'),
         18, "tags.gpu[0]", "'{paddle}:gpu' cannot give a valid tag"),
    Case("tag-template-attribute-access", edit('cpu: ["{paddle}{py_suffix}"]', 'cpu: ["{paddle.major}"]'),
         19, "tags.cpu[0]", "bad tag template"),
    Case("tag-invalid-only-with-real-values", edit('cpu: ["{paddle}{py_suffix}"]', 'cpu: ["{py_suffix}{paddle}"]'),
         19, "tags.cpu[0]", "gives the tag '-py3102.6.2' for paddle2.6.2-cpu-py3.10-debian12, which is not a valid tag", render=True),
    Case("two-variants-one-tag", edit('cpu: ["{paddle}{py_suffix}"]', 'cpu: ["{paddle}"]'),
         19, "tags.cpu", "tag '2.6.2' is given to both paddle2.6.2-cpu-py3.10-debian12 "
                         "and paddle2.6.2-cpu-py3.11-debian12", render=True),
    Case("include-tags-shared-by-two-variants", append("  include:", '    - {cuda: cpu, tags: ["{paddle}-cpu"]}'),
         26, "matrix.include[0].tags", "tag '2.6.2-cpu' is given to both"),
    # --- secrets ---------------------------------------------------------------------------
    Case("secret-with-inline-value",
         append("secrets:", "  pip-conf:", f'    value: "index-url = https://ci:{SECRET}@pypi.example.com/simple"'),
         27, "secrets.pip-conf.value", "secrets are referenced by 'file' or 'env', never written into the matrix", render=True),
    Case("secret-given-as-plain-text",
         append("secrets:", f'  pip-conf: "index-url = https://ci:{SECRET}@pypi.example.com/simple"'),
         26, "secrets.pip-conf", "never written into the matrix"),
    Case("secret-unknown-id", append("secrets:", "  ca-bundel: {file: /etc/ssl/certs/ca-certificates.crt}"),
         26, "secrets.ca-bundel", "unknown build secret (did you mean 'ca-bundle'?)"),
    Case("secret-with-file-and-env", append("secrets:", "  netrc: {file: /root/.netrc, env: NETRC_CONTENT}"),
         26, "secrets.netrc", "give exactly one of 'file' (a path) or 'env' (a variable name)"),
    Case("secret-env-not-a-variable-name", append("secrets:", "  netrc: {env: NETRC-CONTENT}"),
         26, "secrets.netrc.env", "'NETRC-CONTENT' is not an environment variable name"),
    # --- images and the catalogs -----------------------------------------------------------
    Case("bad-digest", edit("    image: docker.io/library/debian:12",
                            "    image: docker.io/library/debian:12\n    digest: sha256:abc123"),
         8, "os.debian12.digest", "'sha256:abc123' is not a digest (sha256: followed by 64 hex digits)", render=True),
    Case("digest-inline-in-image", edit("image: docker.io/library/debian:12",
                                        "image: docker.io/library/debian:12@sha256:" + "a" * 64),
         7, "os.debian12.image", "give the digest in its own 'digest' key, not after '@'"),
    Case("unknown-os-family", edit("family: debian", "family: alpine"),
         8, "os.debian12.family", "'alpine' is not one of debian, ubuntu"),
    Case("misspelt-os-key", edit("family: debian", "familly: debian"),
         8, "os.debian12.familly", "unknown key (did you mean 'family'?)"),
    Case("cuda-image-provider-without-image", edit("provider: wheels", "provider: image"),
         10, "cuda.11.8", "provider 'image' needs 'image'"),
    Case("cuda-wheels-provider-without-wheels",
         edit("    wheels:\n      - nvidia-cuda-runtime-cu11==11.8.89\n      - nvidia-cudnn-cu11==8.6.0.163",
              "    # wheels: forgotten\n    #\n    #"),
         10, "cuda.11.8", "provider 'wheels' needs 'wheels' (pinned NVIDIA pip packages)"),
    Case("wheel-not-pinned", edit("nvidia-cudnn-cu11==8.6.0.163", "nvidia-cudnn-cu11>=8.6"),
         16, "cuda.11.8.wheels[1]", "'nvidia-cudnn-cu11>=8.6' must be pinned with =="),
    Case("cuda-entry-named-cpu", edit('  "11.8":', "  cpu:"), 10, "cuda.cpu", "'cpu' is reserved for CPU-only variants"),
    Case("two-cuda-entries-one-layer-folder",
         edit("      - nvidia-cudnn-cu11==8.6.0.163",
              "      - nvidia-cudnn-cu11==8.6.0.163\n"
              '  "11.8-lean":\n    version: "11.8"\n    cudnn: "8.6"\n    provider: wheels\n'
              "    wheels: [nvidia-cuda-runtime-cu11==11.8.89]",
              'cuda: [cpu, "11.8"]', 'cuda: [cpu, "11.8", "11.8-lean"]'),
         17, "cuda.11.8-lean", "two different cuda layers would share dockerfiles/cuda/debian12-cuda11.8-cudnn8.6-wheels", render=True),
    # --- layers ----------------------------------------------------------------------------
    Case("bad-apt-package-name", append("layers:", "  paddle:", '    packages: [libgomp1, "curl; rm -rf /"]'),
         27, "layers.paddle.packages[1]", "'curl; rm -rf /' is not a Debian package name"),
    Case("credential-in-layer-env", append("layers:", "  python:", "    env:", f"      PIP_PASSWORD: {SECRET}"),
         28, "layers.python.env.PIP_PASSWORD", "credentials never go into ENV (they persist in the image)", render=True),
    Case("index-url-with-credentials",
         append("layers:", "  paddle:", "    pip:", f"      index_url: https://ci:{SECRET}@pypi.example.com/simple"),
         28, "layers.paddle.pip.index_url", "is not an http(s) URL without credentials"),
    Case("unknown-layer-kind", append("layers:", "  release:", "    packages: [curl]"),
         26, "layers.release", "unknown key"),
    Case("extra-layer-that-installs-nothing", append("extra_layers:", "  - name: tools", "    env: {TOOLS_HOME: /opt}"),
         26, "extra_layers[0]", "extra layer 'tools' installs nothing (give packages, pip.packages or run)"),
    Case("extra-layer-defined-twice",
         append("extra_layers:", "  - {name: tools, packages: [git]}", "  - {name: tools, packages: [curl]}"),
         27, "extra_layers[1].name", "extra layer 'tools' is defined twice"),
    # --- layer compression -----------------------------------------------------------------
    Case("unknown-compression", append("compression: brotli"),
         25, "compression", "'brotli' is not a layer compression (known: gzip, zstd, zstd:<level 1-19>, estargz)",
         render=True),
    Case("zstd-level-out-of-range", append("  include:", '    - {python: "3.11", compression: "zstd:20"}'),
         26, "matrix.include[0].compression", "'zstd:20': the zstd level must be a whole number from 1 to 19"),
    Case("gzip-with-a-level", append("compression: gzip:6"), 25, "compression", "'gzip:6': gzip takes no level"),
    # --- the pip layers' split ------------------------------------------------------------------
    Case("pip-layers-no-parts", append("pip_layers: {parts: 0}"), 25, "pip_layers.parts", "must be at least 1, got 0",
         render=True),
    Case("pip-layers-too-many-parts", append("pip_layers:", "  parts: 17"), 26, "pip_layers.parts",
         "must be at most 16, got 17"),
    Case("pip-layers-parts-in-words", append("pip_layers: {parts: four}"), 25, "pip_layers.parts",
         "expected an integer, got 'four'"),
    Case("pip-layers-a-bound-on-one-part", append("pip_layers:", "  parts: 1", "  max_part_mib: 512"),
         27, "pip_layers.max_part_mib", "bounds a part, and parts: 1 splits nothing"),
    Case("pip-layers-bound-of-nothing", append("pip_layers: {max_part_mib: 0}"), 25, "pip_layers.max_part_mib",
         "must be at least 1, got 0"),
    Case("pip-layers-unknown-key", append("pip_layers: {part: 4}"), 25, "pip_layers.part",
         "unknown key (did you mean 'parts'?)"),
    Case("pip-layers-not-a-mapping", append("pip_layers: 4"), 25, "pip_layers", "expected a mapping, got a number (4)"),
    # --- hardening -------------------------------------------------------------------------
    Case("user-uid-0", append("user:", "  uid: 0"), 26, "user.uid", "must be at least 1, got 0"),
    Case("user-gid-0", append("user: {name: paddle, gid: 0}"), 25, "user.gid", "must be at least 1, got 0"),
    Case("setuid-allowlist-relative-path", append("setuid_allowlist: [/usr/bin/su, usr/bin/sudo]"),
         25, "setuid_allowlist[1]", "'usr/bin/sudo' is not an absolute path"),
    Case("oci-label-in-labels", append("labels:", "  org.opencontainers.image.vendor: Example"),
         26, "labels.org.opencontainers.image.vendor", "OCI labels are set by imagebuild from the matrix"),
    Case("label-key-not-lowercase", append("labels:", "  Team: ml-platform"),
         26, "labels.Team", "label keys are lowercase reverse-DNS names"),
]


@dataclass(frozen=True)
class Outcome:
    returncode: int
    stdout: str
    stderr: str
    left_behind: tuple[str, ...]  # what is in the matrix's folder afterwards


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, imagebuild) -> dict[tuple[str, str], Outcome]:
    """Run every case through every command once, in parallel: fresh processes are slow."""

    def run(case: Case, command: str) -> Outcome:
        folder = tmp_path_factory.mktemp(f"{case.id}-{command}")
        matrix = folder / "matrix.yaml"
        matrix.write_text(case.text, encoding="utf-8")
        result = imagebuild(command, "--matrix", matrix, cwd=folder)
        left = tuple(sorted(str(p.relative_to(folder)) for p in folder.rglob("*")))
        return Outcome(result.returncode, result.stdout, result.stderr, left)

    jobs = [(case, command) for case in CASES for command in case.commands]
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        results = list(pool.map(lambda job: run(*job), jobs))
    return {(case.id, command): outcome for (case, command), outcome in zip(jobs, results)}


every_case = pytest.mark.parametrize(
    "case, command",
    [pytest.param(case, command, id=f"{case.id}-{command}") for case in CASES for command in case.commands])


def test_the_case_table_is_large_and_distinct():
    assert len(CASES) >= 35
    assert sum(case.render for case in CASES) >= 10
    assert len({case.id for case in CASES}) == len(CASES)
    assert len({case.text for case in CASES}) == len(CASES)


def test_the_unbroken_matrix_is_valid_and_renders(tmp_path, imagebuild):
    """The control: without a mutation the same runs succeed, so each failure below is its mutation's."""
    (tmp_path / "matrix.yaml").write_text(VALID, encoding="utf-8")
    validated = imagebuild("validate", "--matrix", tmp_path / "matrix.yaml", cwd=tmp_path)
    rendered = imagebuild("render", "--matrix", tmp_path / "matrix.yaml", cwd=tmp_path)
    assert (validated.returncode, validated.stderr) == (0, "")
    assert "valid, 4 variants" in validated.stdout
    assert (rendered.returncode, rendered.stderr) == (0, "")
    assert (tmp_path / "dockerfiles" / "release").is_dir()


@every_case
def test_exits_with_code_2(case, command, outcomes):
    assert outcomes[case.id, command].returncode == 2


@every_case
def test_prints_exactly_one_line_on_stderr_and_nothing_on_stdout(case, command, outcomes):
    outcome = outcomes[case.id, command]
    assert len(outcome.stderr.splitlines()) == 1, outcome.stderr
    assert outcome.stderr.endswith("\n")
    assert outcome.stdout == ""


@every_case
def test_names_the_file_the_line_and_the_key(case, command, outcomes):
    line = outcomes[case.id, command].stderr.rstrip("\n")
    where = f"error: matrix.yaml:{case.line}: "
    assert line.startswith(where), line
    if case.key is not None:
        assert line.startswith(f"{where}{case.key}: "), line
    else:  # a problem of the whole file: the message follows the line number directly
        assert not re.match(r"[\w.\[\]-]+: ", line[len(where):]), line


@every_case
def test_says_what_is_wrong(case, command, outcomes):
    assert case.message in outcomes[case.id, command].stderr


@every_case
def test_shows_no_traceback(case, command, outcomes):
    outcome = outcomes[case.id, command]
    assert "Traceback" not in outcome.stderr + outcome.stdout


@every_case
def test_writes_nothing(case, command, outcomes):
    assert outcomes[case.id, command].left_behind == ("matrix.yaml",)


@pytest.mark.parametrize("case, command", [
    pytest.param(case, command, id=f"{case.id}-{command}")
    for case in CASES if SECRET in case.text for command in case.commands])
def test_never_repeats_a_credential_from_the_matrix(case, command, outcomes):
    assert SECRET not in outcomes[case.id, command].stderr
