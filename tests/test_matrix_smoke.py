"""The matrix's `smoke` key: extra smoke tests per layer kind, extra layer, or include entry.

    smoke:
      all: [smoke/test_site.py]          # every variant
      cuda: [smoke/gpu/]                 # variants whose chain has a cuda layer
      jupyter: [smoke/test_jupyter.py]   # variants that get the extra layer 'jupyter'
    matrix:
      include:
        - {paddle: "2.6.2", cuda: "11.8", smoke: [smoke/test_26.py]}   # that variant only

Paths are relative to the matrix file and must exist. They are tests, not image content:
no layer's content key, and no rendered file, depends on them.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from imagebuild.build.plan import build_plan
from imagebuild.checks.smoke import MatrixContext
from imagebuild.config.matrix import load_matrix
from imagebuild.core.source import InputError

BASE = """\
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
    wheels: [nvidia-cudnn-cu11==8.6.0.163]
extra_layers:
  - name: jupyter
    pip: {packages: [jupyterlab==4.2.5]}
    when: {cuda: "11.8"}
tags:
  gpu: ["{paddle}-gpu-cuda{cuda}-cudnn{cudnn}{py_suffix}"]
  cpu: ["{paddle}{py_suffix}"]
matrix:
  os: [debian12]
  cuda: [cpu, "11.8"]
  python: ["3.10", "3.11"]
  paddle: ["2.6.2"]
"""
# Line 22 is `matrix:`; a `smoke:` inserted before it takes line 22; appended lines start at 27.

CPU_310 = "paddle2.6.2-cpu-py3.10-debian12"
GPU_310 = "paddle2.6.2-cuda11.8-cudnn8.6-py3.10-debian12"
GPU_311 = "paddle2.6.2-cuda11.8-cudnn8.6-py3.11-debian12"


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A matrix folder with some test files and folders to point at."""
    (tmp_path / "smoke" / "gpu").mkdir(parents=True)
    for name in ("test_site.py", "test_jupyter.py", "test_26.py", "gpu/test_gpu_extra.py", "notes.txt"):
        (tmp_path / "smoke" / name).write_text("def test_ok():\n    pass\n")
    return tmp_path


def load(folder: Path, text: str):
    path = folder / "matrix.yaml"
    path.write_text(text, encoding="utf-8")
    return load_matrix(path)


WITH_SMOKE = BASE.replace("matrix:\n", """smoke:
  all: [smoke/test_site.py]
  cuda: [smoke/gpu]
  jupyter: [smoke/test_jupyter.py]
matrix:
""", 1) + """  include:
    - {paddle: "2.6.2", cuda: "11.8", python: "3.11", smoke: [smoke/test_26.py]}
"""


def test_smoke_paths_resolve_beside_the_matrix(folder):
    m = load(folder, WITH_SMOKE)
    assert m.smoke == {
        "all": (str(folder / "smoke/test_site.py"),),
        "cuda": (str(folder / "smoke/gpu"),),
        "jupyter": (str(folder / "smoke/test_jupyter.py"),),
    }
    by_axes = {(c.cuda, c.python): c.smoke for c in m.combinations}
    assert by_axes[("11.8", "3.11")] == (str(folder / "smoke/test_26.py"),)
    assert by_axes[("11.8", "3.10")] == () and by_axes[("cpu", "3.11")] == ()


def test_each_variant_gets_its_kinds_layers_and_own_extras_in_order(folder):
    m = load(folder, WITH_SMOKE)
    ctx = MatrixContext(m, build_plan(m))
    site, gpu, jupyter, own = (str(folder / p) for p in
                               ("smoke/test_site.py", "smoke/gpu", "smoke/test_jupyter.py", "smoke/test_26.py"))
    assert ctx.extra_tests(CPU_310) == (site,)
    assert ctx.extra_tests(GPU_310) == (site, gpu, jupyter)
    assert ctx.extra_tests(GPU_311) == (site, gpu, jupyter, own)
    assert ctx.extra_tests("no-such-variant") == ()


def test_a_path_listed_twice_across_keys_runs_once(folder):
    text = BASE.replace("matrix:\n", "smoke:\n  all: [smoke/gpu]\n  cuda: [smoke/gpu/]\nmatrix:\n", 1)
    m = load(folder, text)
    ctx = MatrixContext(m, build_plan(m))
    assert ctx.extra_tests(GPU_310) == (str(folder / "smoke/gpu"),)


def test_smoke_extras_change_no_content_key_and_no_rendered_file(folder):
    """They are tests, not image content: adding them rebuilds nothing."""
    plain = build_plan(load(folder, BASE))
    extras = build_plan(load(folder, WITH_SMOKE))
    assert [v.chain for v in plain.variants] == [v.chain for v in extras.variants]
    assert [v.id for v in plain.variants] == [v.id for v in extras.variants]
    assert plain.rendered_files() == extras.rendered_files()


def test_an_include_entry_that_only_adds_smoke_tests_is_accepted(folder):
    text = BASE + '  include:\n    - {cuda: "11.8", smoke: [smoke/test_26.py]}\n'
    m = load(folder, text)
    assert sum(bool(c.smoke) for c in m.combinations) == 2


ERRORS = [
    # (id, text, line, key, message fragment)
    ("unknown-kind", BASE.replace("matrix:\n", "smoke:\n  paddel: [smoke/test_site.py]\nmatrix:\n", 1),
     23, "smoke.paddel", "unknown key (did you mean 'paddle'?)"),
    ("missing-file", BASE.replace("matrix:\n", "smoke:\n  all: [smoke/test_gone.py]\nmatrix:\n", 1),
     23, "smoke.all[0]", "'smoke/test_gone.py' does not exist"),
    ("absolute-path", BASE.replace("matrix:\n", "smoke:\n  all: [/etc/passwd]\nmatrix:\n", 1),
     23, "smoke.all[0]", "must be relative to the matrix file"),
    ("not-python", BASE.replace("matrix:\n", "smoke:\n  all: [smoke/notes.txt]\nmatrix:\n", 1),
     23, "smoke.all[0]", "is not a Python test file or a folder"),
    ("empty-list", BASE.replace("matrix:\n", "smoke:\n  all: []\nmatrix:\n", 1),
     23, "smoke.all", "must list at least one test file or folder"),
    ("listed-twice", BASE.replace("matrix:\n", "smoke:\n  all:\n    - smoke/gpu\n    - smoke/gpu/\nmatrix:\n", 1),
     25, "smoke.all[1]", "'smoke/gpu/' is listed twice"),
    ("not-a-mapping", BASE.replace("matrix:\n", "smoke: [smoke/test_site.py]\nmatrix:\n", 1),
     22, "smoke", "expected a mapping, got a list"),
    ("a-string-not-a-list", BASE.replace("matrix:\n", "smoke:\n  all: smoke/test_site.py\nmatrix:\n", 1),
     23, "smoke.all", "expected a list"),
    ("include-missing-file", BASE + '  include:\n    - {cuda: "11.8", smoke: [smoke/nope/]}\n',
     28, "matrix.include[0].smoke[0]", "'smoke/nope/' does not exist"),
    ("include-not-a-list", BASE + '  include:\n    - {cuda: "11.8", smoke: {all: [smoke/gpu]}}\n',
     28, "matrix.include[0].smoke", "expected a list, got a mapping"),
]


@pytest.mark.parametrize("case_id, text, line, key, message", ERRORS, ids=[e[0] for e in ERRORS])
def test_bad_smoke_entries_name_file_line_and_key(folder, case_id, text, line, key, message):
    with pytest.raises(InputError, match=f"/matrix.yaml:{line}: {re.escape(key)}: .*{re.escape(message)}") as caught:
        load(folder, text)
    err = caught.value
    assert (Path(err.file).name, err.line, err.key) == ("matrix.yaml", line, key), str(err)
    assert message in err.message, str(err)


def test_the_cli_reports_a_missing_smoke_file_in_one_line_with_exit_2(folder, imagebuild):
    (folder / "matrix.yaml").write_text(
        BASE.replace("matrix:\n", "smoke:\n  cuda: [smoke/test_gone.py]\nmatrix:\n", 1), encoding="utf-8")
    result = imagebuild("validate", "--matrix", folder / "matrix.yaml", cwd=folder)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"error: matrix.yaml:23: smoke.cuda[0]: 'smoke/test_gone.py' does not exist "
        f"(looked for {folder.resolve() / 'smoke/test_gone.py'})"]
    assert result.stdout == ""
