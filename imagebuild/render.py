"""Jinja2 templates -> Dockerfiles (pure), and the on-disk check that they are current.

The templates ship in the package. `templates_dir` (or the environment variable
IMAGEBUILD_TEMPLATES_DIR) renders from a copy instead: that is how the tests show that a
template edit changes the content keys and makes `imagebuild render --check` fail.
"""
from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

import jinja2

# Which template renders which layer kind (the cuda kind has one per provider).
TEMPLATES = {
    "base": "base.Dockerfile.j2",
    "cuda-image": "cuda-image.Dockerfile.j2",
    "cuda-wheels": "cuda-wheels.Dockerfile.j2",
    "python": "python.Dockerfile.j2",
    "paddle": "paddle.Dockerfile.j2",
    "extra": "extra.Dockerfile.j2",
    "release": "release.Dockerfile.j2",
}


def _double_quoted(value: Any) -> str:
    """A Dockerfile double-quoted string; `${VAR}` stays expandable on purpose."""
    text = str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")
    return f'"{text}"'


def _shell_word(value: Any) -> str:
    """One shell word that means exactly `value`: plain words stay as they are, anything
    else is single-quoted, so `numpy>=1.26` or a URL with `;` reaches the command as data."""
    return shlex.quote(str(value))


TEMPLATES_DIR_ENV = "IMAGEBUILD_TEMPLATES_DIR"


@lru_cache(maxsize=8)
def environment(templates_dir: str | None = None) -> jinja2.Environment:
    """The Jinja environment for the package's templates, or for a folder of copies."""
    loader: jinja2.BaseLoader = (jinja2.FileSystemLoader(templates_dir) if templates_dir
                                 else jinja2.PackageLoader("imagebuild", "templates"))
    env = jinja2.Environment(
        loader=loader,
        undefined=jinja2.StrictUndefined,  # a typo in a template fails loudly, never renders ""
        keep_trailing_newline=True,
        autoescape=False,
        auto_reload=False,  # one process renders from one set of templates; skip a stat per render
    )
    env.filters["dq"] = _double_quoted
    env.filters["sh"] = _shell_word
    return env


def render_template(template: str, context: dict[str, Any], templates_dir: str | None = None) -> str:
    folder = templates_dir if templates_dir is not None else os.environ.get(TEMPLATES_DIR_ENV) or None
    text = environment(folder).get_template(TEMPLATES[template]).render(**context)
    # Templates stay readable with blank lines around blocks; output keeps single ones.
    # Split on "\n" only: str.splitlines() would also break at U+2028 and friends inside a
    # value, starting a new Dockerfile instruction where the matrix never wrote one.
    lines = [line.rstrip() for line in text.split("\n")]
    out: list[str] = []
    for line in lines:
        if line == "" and (not out or out[-1] == ""):
            continue
        out.append(line)
    while out and out[-1] == "":
        out.pop()
    return "\n".join(out) + "\n"


@dataclass(frozen=True)
class Drift:
    path: str
    reason: str  # "changed", "missing" or "stale"

    def __str__(self) -> str:
        return f"{self.reason:8} {self.path}"


def write_tree(root: Path, files: dict[str, str]) -> list[str]:
    """Write rendered files under root and delete stale generated ones; return what changed."""
    changed = []
    for drift in check_tree(root, files):
        target = root / drift.path
        if drift.reason == "stale":
            target.unlink()
            _prune_empty_dirs(target.parent, root)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(files[drift.path], encoding="utf-8")
        changed.append(str(drift))
    return changed


def check_tree(root: Path, files: dict[str, str]) -> list[Drift]:
    drift = []
    for rel, content in sorted(files.items()):
        target = root / rel
        if not target.exists():
            drift.append(Drift(rel, "missing"))
        elif target.read_text(encoding="utf-8") != content:
            drift.append(Drift(rel, "changed"))
    for rel in sorted(_generated_files(root)):
        if rel not in files:
            drift.append(Drift(rel, "stale"))
    return drift


def _generated_files(root: Path) -> Iterable[str]:
    if not root.exists():
        return []
    return [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()]


def _prune_empty_dirs(directory: Path, root: Path) -> None:
    while directory != root and directory.is_dir() and not any(directory.iterdir()):
        directory.rmdir()
        directory = directory.parent
