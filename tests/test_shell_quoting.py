"""Matrix values reach the shell as data: each is one word, exactly as the matrix wrote it.

Every matrix field that is rendered into a `RUN` line is listed in QUOTED below. The tests
render two matrices of the same shape: a benign one, where each field holds a plain
placeholder word, and a hostile one, where it holds shell syntax (operators, redirects,
command substitution, quotes, globs, tildes, braces, comments, spaces). Each `RUN` line is
cut into words by a POSIX shell lexer (`shlex`, with `;`, `|`, `&`, `<`, `>`, `(`, `)` as
operator tokens), and the hostile line must give the benign line's words with each
placeholder replaced by the hostile value, whole: no extra word, no extra operator, no
value split or changed. A second check counts the characters a shell would act on (`$`,
backticks, globs, `~`, braces, operators, `#`) outside quotes: the hostile line may have no
more of them than the benign one. That also keeps `<<` quoted, so BuildKit, which reads an
unquoted `<<WORD` in a RUN line as a heredoc over the lines after it, never sees one.

A value that cannot be said safely is refused when the matrix is read (REFUSED): the CLI
exits 2 with one line, and writes nothing. `run:` steps are the one deliberate exception:
arbitrary shell, rendered verbatim (see README, "The matrix").

ENV and LABEL lines are Dockerfile syntax, not shell: their values must come back whole
from the Dockerfile's own double-quote rules, and never start an instruction of their own.
"""
from __future__ import annotations

import re
import shlex
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from imagebuild.build.plan import build_plan
from imagebuild.config.matrix import load_matrix
from tests.conftest import run_imagebuild

# --- the fields ---------------------------------------------------------------------------

APT = ["libc6:amd64", "tzdata=2024a-0+deb12u1~x", "curl/bookworm-backports", "pkg=1:2.3~rc1+dfsg-1"]
PIP = ['numpy>=1.26,<3', 'pkg[extra]; python_version < "3.12"',
       "onnx (>=1.0, !=1.2) ; os_name=='posix' and platform_machine != 'x86_64'", "wheel==0.* ; python_version~='3.1'",
       'x<1 ; os_name == "<<EOF"']
URL = ["https://x.example/simple;touch${IFS}pwned", "https://x.example/$(id)/`id`|cat>out&&<in",
       "https://x.example/~user/*?[a]{b,c}#frag!", "https://x.example/it's/\"dq\"\\back",
       "https://x.example/<<EOF"]
WHEELS = ['nvidia-cudnn-cu11==8.6.*; python_version >= "3.8"', "nvidia-cuda-runtime-cu11 == 11.8.89",
          "nvidia-x[extra]==1.0 ; platform_machine=='x86_64'", 'nvidia-y==2.0; os_name != "nt"']
SETUID = ["/usr/bin/*", "/opt/my tools/su;id", "/x/$(touch pwned)`id`>out<in|&",
          "/x/'single'\"double\"\\back#~{a,b}!", "/x/<<EOF"]
# Strictly validated, so only harmless characters are possible; quoted all the same.
USER_NAME = ["_svc", "build-er", "x_1", "u-2"]
PPA = ["deadsnakes/ppa+x", "a.b/c-d", "owner/ppa.2", "x+y/z"]


@dataclass(frozen=True)
class Field:
    key: str  # where it sits in matrix.yaml
    placeholder: str  # a plain word, unique in every rendered Dockerfile
    hostile: tuple[str, ...]
    set: Callable[[dict[str, Any], str], None]


def _apt(layer: str) -> Callable[[dict, str], None]:
    return lambda m, v: m["layers"][layer].setdefault("packages", []).append(v)


def _pip(layer: str, key: str) -> Callable[[dict, str], None]:
    def put(m: dict, v: str) -> None:
        pip = m["layers"][layer].setdefault("pip", {})
        if key == "index_url":
            pip[key] = v
        else:
            pip.setdefault(key, []).append(v)
    return put


def _extra(key: str, sub: str | None = None) -> Callable[[dict, str], None]:
    def put(m: dict, v: str) -> None:
        layer = m["extra_layers"][0]
        target = layer.setdefault("pip", {}) if sub else layer
        name = sub or key
        if name == "index_url":
            target[name] = v
        else:
            target.setdefault(name, []).append(v)
    return put


def _set(*path: str) -> Callable[[dict, str], None]:
    def put(m: dict, v: str) -> None:
        node = m
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = v
    return put


def _append(*path: str) -> Callable[[dict, str], None]:
    def put(m: dict, v: str) -> None:
        node = m
        for part in path[:-1]:
            node = node[part]
        node.setdefault(path[-1], []).append(v)
    return put


# Every field that reaches a RUN line. The shape decides which pip index the paddle layer
# uses: its own `layers.paddle.pip.index_url` wins over the cuda entry's paddle_index_url.
QUOTED = (
    Field("layers.base.packages", "placeholder-apt-base", tuple(APT), _apt("base")),
    Field("layers.cuda.packages", "placeholder-apt-cuda", tuple(APT), _apt("cuda")),
    Field("layers.python.packages", "placeholder-apt-python", tuple(APT), _apt("python")),
    Field("layers.paddle.packages", "placeholder-apt-paddle", tuple(APT), _apt("paddle")),
    Field("extra_layers[].packages", "placeholder-apt-extra", tuple(APT), _extra("packages")),
    Field("layers.python.pip.packages", "placeholder-pip-python", tuple(PIP), _pip("python", "packages")),
    Field("layers.paddle.pip.packages", "placeholder-pip-paddle", tuple(PIP), _pip("paddle", "packages")),
    Field("extra_layers[].pip.packages", "placeholder-pip-extra", tuple(PIP), _extra("pip", "packages")),
    Field("layers.cuda.pip.index_url", "https://placeholder.example/cuda-index", tuple(URL),
          _pip("cuda", "index_url")),
    Field("layers.cuda.pip.extra_index_urls", "https://placeholder.example/cuda-extra", tuple(URL),
          _pip("cuda", "extra_index_urls")),
    Field("layers.python.pip.index_url", "https://placeholder.example/python-index", tuple(URL),
          _pip("python", "index_url")),
    Field("layers.python.pip.extra_index_urls", "https://placeholder.example/python-extra", tuple(URL),
          _pip("python", "extra_index_urls")),
    Field("layers.paddle.pip.index_url", "https://placeholder.example/paddle-index", tuple(URL),
          _pip("paddle", "index_url")),
    Field("layers.paddle.pip.extra_index_urls", "https://placeholder.example/paddle-extra", tuple(URL),
          _pip("paddle", "extra_index_urls")),
    Field("extra_layers[].pip.index_url", "https://placeholder.example/extra-index", tuple(URL),
          _extra("pip", "index_url")),
    Field("extra_layers[].pip.extra_index_urls", "https://placeholder.example/extra-extra", tuple(URL),
          _extra("pip", "extra_index_urls")),
    Field("cuda.<wheels>.wheels", "placeholder-wheel==1.0", tuple(WHEELS), _append("cuda", "11.8", "wheels")),
    Field("cuda.<wheels>.paddle_index_url", "https://placeholder.example/cu118", tuple(URL),
          _set("cuda", "11.8", "paddle_index_url")),
    Field("cuda.<image>.paddle_index_url", "https://placeholder.example/cu126", tuple(URL),
          _set("cuda", "12.6", "paddle_index_url")),
    Field("setuid_allowlist", "/placeholder/setuid", tuple(SETUID), _append("setuid_allowlist")),
    Field("user.name", "placeholder_user", tuple(USER_NAME), _set("user", "name")),
    Field("os.<ubuntu>.python_ppa", "placeholder/ppa", tuple(PPA), _set("os", "ubuntu22.04", "python_ppa")),
)
# Reach a RUN line but are refused unless plain (REFUSED has cases): the python and paddle
# versions (axis values, strict version patterns). In Dockerfile syntax, not shell:
# env keys and values (ENV), labels (LABEL), images and digests (FROM/ARG).
PADDLE_OWN_INDEX = {"layers.paddle.pip.index_url"}
CUDA_INDEXES = {"cuda.<wheels>.paddle_index_url", "cuda.<image>.paddle_index_url"}


def skeleton() -> dict[str, Any]:
    """Every template in play: a debian base with the wheels CUDA, an ubuntu one with NVIDIA's
    image and a PPA for Python, CPU and GPU, an extra layer, every build secret."""
    return {
        "schema": 1, "registry": "registry.example.com", "project": "paddle", "repository": "paddle",
        "secrets": {"ca-bundle": {"file": "/etc/pki/ca.pem"}, "pip-conf": {"env": "PIP_CONF"},
                    "netrc": {"env": "NETRC_TEXT"}},
        "user": {"name": "paddle", "uid": 4242, "gid": 4343},
        "os": {"debian12": {"image": "docker.io/library/debian:12", "family": "debian"},
               "ubuntu22.04": {"image": "docker.io/library/ubuntu:22.04", "family": "ubuntu"}},
        "cuda": {"11.8": {"version": "11.8", "cudnn": "8.6", "provider": "wheels",
                          "wheels": ["nvidia-cuda-runtime-cu11==11.8.89"]},
                 "12.6": {"version": "12.6", "cudnn": "9.5", "provider": "image",
                          "image": "nvidia/cuda:12.6.3-cudnn-runtime-ubuntu22.04"}},
        "layers": {"base": {}, "cuda": {}, "python": {}, "paddle": {}},
        "extra_layers": [{"name": "tools", "packages": ["git"]}],
        "tags": {"gpu": ["{paddle}-gpu-cuda{cuda}-cudnn{cudnn}-{os}{py_suffix}"], "cpu": ["{paddle}-{os}{py_suffix}"]},
        "matrix": {"os": ["debian12"], "cuda": ["cpu", "11.8"], "python": ["3.11"], "paddle": ["2.6.2"],
                   "include": [{"os": "ubuntu22.04", "cuda": "12.6", "python": "3.11", "paddle": "3.2.2"}]},
    }


SHAPES = {  # which fields each matrix shape holds
    "paddle-own-index": [f for f in QUOTED if f.key not in CUDA_INDEXES],
    "cuda-paddle-index": [f for f in QUOTED if f.key not in PADDLE_OWN_INDEX],
}
ROUNDS = range(5)  # round r gives each field its r-th hostile value (cycling)


def matrix_with(fields: list[Field], value: Callable[[Field], str]) -> dict[str, Any]:
    m = skeleton()
    for f in fields:
        f.set(m, value(f))
    return m


def render(tmp_path: Path, name: str, matrix: dict[str, Any]) -> dict[str, str]:
    path = tmp_path / name / "matrix.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(matrix, sort_keys=False), encoding="utf-8")
    return build_plan(load_matrix(path)).rendered_files()


# --- reading RUN lines the way a shell does -----------------------------------------------


def instructions(dockerfile: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments), with the Dockerfile's `\\`-newline continuations joined."""
    out, pending = [], ""
    for line in dockerfile.split("\n"):
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1]
            continue
        keyword, _, rest = (pending + line).strip().partition(" ")
        out.append((keyword.upper(), rest))
        pending = ""
    assert not pending, "a continuation runs past the end of the file"
    return out


def shell_command(run: str) -> str:
    """The shell text of a RUN line: the --mount=... flags in front are BuildKit's, not the shell's."""
    words = run.split(" ")
    while words and words[0].startswith("--mount="):
        words.pop(0)
    return " ".join(words)


def shell_words(command: str) -> list[str]:
    """POSIX words and operator tokens. Only characters no shell acts on are word characters,
    so an unquoted `$`, glob, `~`, brace or `!` ends up as a token of its own."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.wordchars = "".join(c for c in lexer.wordchars if c not in "~*?") + ":,@%+="
    return list(lexer)


SHELL_ACTIVE = set("$`*?[]~{};&|<>()#!")


def active_outside_quotes(command: str) -> Counter[str]:
    """Characters a shell would act on: unquoted ones, and `$`/backtick inside double quotes."""
    counts: Counter[str] = Counter()
    quote, i = "", 0
    while i < len(command):
        c = command[i]
        if quote == "'":
            quote = "" if c == "'" else quote
        elif quote == '"':
            if c == "\\":
                i += 1
            elif c == '"':
                quote = ""
            elif c in "$`":
                counts[c] += 1
        elif c == "\\":
            i += 1
        elif c in "'\"":
            quote = c
        elif c in SHELL_ACTIVE:
            counts[c] += 1
        i += 1
    assert not quote, f"unterminated quote in: {command}"
    return counts


def run_commands(dockerfile: str) -> list[str]:
    return [shell_command(rest) for keyword, rest in instructions(dockerfile) if keyword == "RUN"]


# --- the proof ----------------------------------------------------------------------------


def compare(benign: dict[str, str], hostile: dict[str, str], fields: list[Field],
            value: Callable[[Field], str]) -> set[str]:
    """Assert each hostile RUN line is its benign twin with placeholders swapped for the hostile
    values as single words; return the keys of the fields seen in some RUN line."""
    by_placeholder = {f.placeholder: f for f in fields}
    seen: set[str] = set()
    assert benign.keys() == hostile.keys()
    for path, text in benign.items():
        plain, evil = run_commands(text), run_commands(hostile[path])
        assert len(plain) == len(evil), f"{path}: a value added or removed a RUN instruction"
        for plain_cmd, evil_cmd in zip(plain, evil):
            expected = []
            for word in shell_words(plain_cmd):
                # A placeholder is a whole word, or part of one (`ppa:` + the PPA).
                for placeholder, field in by_placeholder.items():
                    if placeholder in word:
                        seen.add(field.key)
                        word = word.replace(placeholder, value(field))
                expected.append(word)
            assert shell_words(evil_cmd) == expected, f"{path}:\n  {evil_cmd}"
            assert active_outside_quotes(evil_cmd) == active_outside_quotes(plain_cmd), f"{path}:\n  {evil_cmd}"
    return seen


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("round_", ROUNDS)
def test_every_hostile_value_reaches_its_command_as_one_unchanged_word(tmp_path, shape, round_):
    fields = SHAPES[shape]
    def hostile(f: Field) -> str:
        return f.hostile[round_ % len(f.hostile)]
    benign = render(tmp_path, "benign", matrix_with(fields, lambda f: f.placeholder))
    evil = render(tmp_path, "hostile", matrix_with(fields, hostile))
    assert compare(benign, evil, fields, hostile) == {f.key for f in fields}


def test_between_them_the_shapes_cover_every_listed_field():
    assert {f.key for fields in SHAPES.values() for f in fields} == {f.key for f in QUOTED}


def test_the_hostile_values_are_hostile():
    """The control: unquoted, most of these values are not one shell word, or not themselves."""
    risky = {v for f in QUOTED for v in f.hostile if f.key not in ("user.name", "os.<ubuntu>.python_ppa")}
    assert sum(1 for v in risky if not _one_plain_word(v)) >= 15


def _one_plain_word(text: str) -> bool:
    try:
        return shell_words(text) == [text] and not active_outside_quotes(text)
    except (ValueError, AssertionError):  # an unbalanced quote
        return False


def test_plain_values_stay_readable(tmp_path):
    files = render(tmp_path, "plain", matrix_with([], str))
    paddle = next(text for path, text in files.items() if path.startswith("paddle/debian12-cuda"))
    assert " paddlepaddle-gpu==2.6.2" in paddle  # no quotes around a plain word


def test_the_numpy_redirect_from_the_issue_is_one_argument(tmp_path):
    m = skeleton()
    m["layers"]["python"]["pip"] = {"packages": ["numpy>=1.26,<3"]}
    files = render(tmp_path, "numpy", m)
    [pip] = [c for path, text in files.items() if path.startswith("python/debian12-py")
             for c in run_commands(text) if "pip install" in c]
    assert shell_words(pip)[-1] == "numpy>=1.26,<3"
    assert ">" not in shell_words(pip)


# --- run: the escape hatch ----------------------------------------------------------------


def test_run_steps_are_rendered_verbatim_as_shell(tmp_path):
    step = 'echo "$HOME" | tr a-z A-Z > /tmp/x && ls /* ; true'
    m = skeleton()
    m["extra_layers"][0]["run"] = [step]
    files = render(tmp_path, "run", m)
    extra = next(text for path, text in files.items() if path.startswith("extra/"))
    assert any(c.endswith(f";     {step}") for c in run_commands(extra))


# --- ENV and LABEL: Dockerfile syntax -----------------------------------------------------


def dockerfile_double_quoted(text: str) -> str:
    """One `"..."` word by the Dockerfile's rules: `\\` escapes `"`, `$` and itself."""
    assert text.startswith('"') and text.endswith('"') and len(text) >= 2, text
    out, i, body = [], 0, text[1:-1]
    while i < len(body):
        if body[i] == "\\" and i + 1 < len(body) and body[i + 1] in '"$\\':
            out.append(body[i + 1])
            i += 2
            continue
        assert body[i] != '"', f"unescaped quote ends the word early: {text}"
        out.append(body[i])
        i += 1
    return "".join(out)


DOCKERFILE_HOSTILE = ['a"b', "c:\\path\\", "trailing\\", "$(id);|&><`id`", "'single'", "#hash",
                      "  spaces  ", 'x\\" \\ LABEL', "\\"]


@pytest.mark.parametrize("value", DOCKERFILE_HOSTILE)
def test_env_values_come_back_whole_from_their_env_instruction(tmp_path, value):
    m = skeleton()
    m["layers"]["paddle"]["env"] = {"IMAGEBUILD_TEST": value, "AFTER": "after"}
    files = render(tmp_path, "env", m)
    for path, text in files.items():
        if not path.startswith("paddle/"):
            continue
        envs = [rest for keyword, rest in instructions(text) if keyword == "ENV" and rest.startswith(("IMAGEBUILD_TEST=", "AFTER="))]
        assert [e.split("=", 1)[0] for e in envs] == ["AFTER", "IMAGEBUILD_TEST"], path
        assert dockerfile_double_quoted(envs[1].split("=", 1)[1]) == value
        assert dockerfile_double_quoted(envs[0].split("=", 1)[1]) == "after"


@pytest.mark.parametrize("value", DOCKERFILE_HOSTILE)
def test_label_values_come_back_whole_from_the_label_instruction(tmp_path, value):
    m = skeleton()
    m["labels"] = {"io.example.hostile": value, "io.example.zz": "after"}
    files = render(tmp_path, "label", m)
    for path, text in files.items():
        if not path.startswith("release/"):
            continue
        [label] = [rest for keyword, rest in instructions(text) if keyword == "LABEL"]
        pairs = re.findall(r'([a-z0-9._-]+)=("(?:[^"\\]|\\.)*")', label)
        assert re.fullmatch(r'(?:[a-z0-9._-]+="(?:[^"\\]|\\.)*"\s*)+', label)  # nothing outside the pairs
        got = {key: dockerfile_double_quoted(quoted) for key, quoted in pairs}
        assert got["io.example.hostile"] == value
        assert got["io.example.zz"] == "after"


# --- refused values -----------------------------------------------------------------------


@dataclass(frozen=True)
class Refusal:
    key: str  # the key the error line names
    value: Any
    set: Callable[[dict[str, Any], Any], None]


def _env_key(m: dict, v: str) -> None:
    m["layers"]["base"]["env"] = {v: "x"}


def _label_key(m: dict, v: str) -> None:
    m["labels"] = {v: "x"}


NEWLINE_RUN = "x\nRUN touch pwned"
REFUSED = (
    Refusal("layers.paddle.packages[0]", "curl; id", _apt("paddle")),
    Refusal("layers.paddle.packages[0]", "$(id)", _apt("paddle")),
    Refusal("layers.paddle.packages[0]", "curl" + NEWLINE_RUN, _apt("paddle")),
    Refusal("layers.python.pip.packages[0]", "numpy>=1.26; id | sh", _pip("python", "packages")),
    Refusal("layers.python.pip.packages[0]", "numpy`id`", _pip("python", "packages")),
    Refusal("layers.python.pip.packages[0]", "pkg @ https://x.example/p.whl", _pip("python", "packages")),
    Refusal("layers.python.pip.packages[0]", "numpy\n", _pip("python", "packages")),
    Refusal("layers.python.pip.index_url", "https://x.example/simple; id", _pip("python", "index_url")),
    Refusal("layers.python.pip.index_url", "https://x.example/" + NEWLINE_RUN, _pip("python", "index_url")),
    Refusal("layers.python.pip.extra_index_urls[0]", "https://x.example/\u2028RUN id",
            _pip("python", "extra_index_urls")),
    Refusal("cuda.11.8.wheels[1]", "nvidia-x==1.0;id", _append("cuda", "11.8", "wheels")),
    Refusal("cuda.11.8.paddle_index_url", "https://x.example/a\tb", _set("cuda", "11.8", "paddle_index_url")),
    Refusal("setuid_allowlist[0]", "/usr/bin/su" + NEWLINE_RUN, _append("setuid_allowlist")),
    Refusal("setuid_allowlist[0]", "/usr/bin/su\0", _append("setuid_allowlist")),
    Refusal("user.name", "paddle;id", _set("user", "name")),
    Refusal("user.name", "paddle\n", _set("user", "name")),
    Refusal("os.ubuntu22.04.python_ppa", "deadsnakes/ppa; id", _set("os", "ubuntu22.04", "python_ppa")),
    Refusal("os.ubuntu22.04.image", "docker.io/library/ubuntu:22.04\nRUN id", _set("os", "ubuntu22.04", "image")),
    Refusal("matrix.python[0]", "3.11;id", lambda m, v: m["matrix"].update(python=[v])),
    Refusal("matrix.paddle[0]", "2.6.2$(id)", lambda m, v: m["matrix"].update(paddle=[v])),
    Refusal("layers.base.env.A B", "A B", _env_key),
    Refusal("layers.base.env.X", NEWLINE_RUN, lambda m, v: m["layers"]["base"].update(env={"X": v})),
    Refusal("layers.base.env.X", "x\rRUN id", lambda m, v: m["layers"]["base"].update(env={"X": v})),
    Refusal("labels.io.example.x", NEWLINE_RUN, lambda m, v: m.update(labels={"io.example.x": v})),
    Refusal("labels.a b", "a b", _label_key),
    Refusal("extra_layers[0].run[0]", "echo a" + NEWLINE_RUN, lambda m, v: m["extra_layers"][0].update(run=[v])),
    Refusal("extra_layers[0].run[0]", "echo a \\", lambda m, v: m["extra_layers"][0].update(run=[v])),
    Refusal("extra_layers[0].run[0]", "cat <<EOF", lambda m, v: m["extra_layers"][0].update(run=[v])),
    Refusal("extra_layers[0].name", "tools;id", lambda m, v: m["extra_layers"][0].update(name=v)),
)


@pytest.fixture(scope="module")
def refusals(tmp_path_factory) -> list[tuple[Refusal, Any, bool]]:
    """(case, CLI result, whether anything was written) per REFUSED case, run in parallel."""
    def run(index: int) -> tuple[Refusal, Any, bool]:
        case = REFUSED[index]
        folder = tmp_path_factory.mktemp(f"refused{index}")
        m = skeleton()
        case.set(m, case.value)
        (folder / "matrix.yaml").write_text(yaml.safe_dump(m, sort_keys=False), encoding="utf-8")
        result = run_imagebuild("render", "--matrix", folder / "matrix.yaml", "--out", folder / "out", cwd=folder)
        return case, result, (folder / "out").exists()
    with ThreadPoolExecutor(max_workers=4) as pool:
        return list(pool.map(run, range(len(REFUSED))))


def test_the_refusal_control_matrix_renders(tmp_path):
    (tmp_path / "matrix.yaml").write_text(yaml.safe_dump(skeleton(), sort_keys=False), encoding="utf-8")
    result = run_imagebuild("render", "--matrix", tmp_path / "matrix.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("index", range(len(REFUSED)), ids=[f"{c.key}={c.value!r}" for c in REFUSED])
def test_values_that_cannot_be_said_safely_are_refused_with_one_line(refusals, index):
    case, result, wrote = refusals[index]
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: matrix.yaml:"), result.stderr
    assert f": {case.key}: " in lines[0]
    assert "Traceback" not in result.stderr and not wrote
