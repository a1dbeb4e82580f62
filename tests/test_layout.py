"""The package's layout is its architecture: which room may use which, read from the imports themselves.

Every `import` in imagebuild/ is parsed (at module level, under TYPE_CHECKING and inside functions alike),
so a function-level import cannot hide an arrow that the table below does not allow.
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "imagebuild"

# room -> the rooms it may import. Read bottom-up: core knows nothing of the pipeline; each stage may
# use the stages before it; cli, at the top, may use everything and nothing imports it.
ALLOWED: dict[str, frozenset[str]] = {
    "core": frozenset(),
    "oci": frozenset({"core"}),
    "kube": frozenset({"core"}),  # the Kubernetes API client: retries are the caller's (an oci.retry transport)
    "config": frozenset({"core", "oci"}),
    "build": frozenset({"core", "oci", "config"}),
    "checks": frozenset({"core", "oci", "config", "build"}),
    "trust": frozenset({"core", "oci", "config", "checks"}),
    "release": frozenset({"core", "oci", "config", "build", "checks", "trust"}),
    "rollout": frozenset({"core", "oci", "config", "checks", "trust", "kube"}),
    "notify": frozenset({"core", "oci", "config"}),  # what rollouts and quarantines tell: events pure, sends in threads
    "retention": frozenset({"core", "oci", "config", "trust", "rollout"}),
    "metrics": frozenset({"core", "oci"}),  # figures from records as dicts; the exporters send through oci.retry
    "admission": frozenset({"core", "oci", "config", "checks", "trust", "rollout"}),
    "cli": frozenset({"core", "oci", "config", "build", "checks", "trust", "release", "rollout", "retention",
                      "admission", "kube", "notify", "metrics"}),
}
# Function-level imports: anywhere in cli/ (a command loads its stage when it runs, so that `imagebuild
# --help` starts without docker, jinja2 or httpx), and below it only of the modules named here, which
# pull in what a registry command must not load (tests/test_cli_startup.py). The cycle test reads them
# too, so a late import can defer a heavy module but never hide a cycle.
LAZY_IMPORTS_ALLOWED = frozenset({"cli"})
DEFERRED = {
    "imagebuild.config.matrix": "the matrix (the support table's YAML)",
    "imagebuild.build.plan": "the plan (jinja2, through render)",
    "imagebuild.checks.smoke_run": "the smoke run (the docker SDK)",
    "imagebuild.checks.gate": "the gate (SARIF's XML)",
    "imagebuild.checks.gate_run": "the gate run (the scan and the gate)",
}
HEAVY = ("docker", "jinja2", "xml.etree.ElementTree", "yaml")
# Modules that must import with the standard library alone, and so import anything else where they use it.
STDLIB_ONLY = {
    "imagebuild.build.baseimage": "builds the base image inside a bare Debian container (its reproducibility "
                                  "test); only its push needs the registry client",
}


@dataclass(frozen=True)
class Import:
    source: str  # the importing module, dotted
    target: str  # the imported module, dotted
    line: int
    in_function: bool


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(dotted: str) -> bool:
    path = PACKAGE.parent / dotted.replace(".", "/")
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports_of(path: Path) -> Iterator[Import]:
    source = module_name(path)
    package = source if path.name == "__init__.py" else source.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    in_function: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_function.update(id(inner) for inner in ast.walk(node) if inner is not node)
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            # `from imagebuild.build import plan` imports the module imagebuild.build.plan
            targets = [f"{base}.{alias.name}" if is_module(f"{base}.{alias.name}") else base for alias in node.names]
        for target in targets:
            if target == "imagebuild" or target.startswith("imagebuild."):
                yield Import(source, target, node.lineno, id(node) in in_function)


def room_of(module: str) -> str:
    """The subpackage a module is in; "top" for imagebuild itself and its __main__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (PACKAGE / parts[1]).is_dir() else "top"


ALL_IMPORTS = [imp for path in sorted(PACKAGE.rglob("*.py")) for imp in imports_of(path)]


def test_every_module_lives_in_a_room() -> None:
    loose = sorted(module_name(path) for path in PACKAGE.glob("*.py") if path.stem not in ("__init__", "__main__"))
    assert loose == [], "a module belongs in one of the subpackages: " + ", ".join(loose)
    rooms = sorted(path.parent.name for path in PACKAGE.glob("*/__init__.py"))
    assert rooms == sorted(ALLOWED)


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_each_room_says_what_it_owns_and_may_import(room: str) -> None:
    doc = ast.get_docstring(ast.parse((PACKAGE / room / "__init__.py").read_text(encoding="utf-8")))
    assert doc, f"imagebuild/{room}/__init__.py has no docstring"
    assert "May import:" in doc, f"imagebuild/{room}/__init__.py does not say what it may import"
    said = doc.split("May import:", 1)[1].split(".", 1)[0]
    named = {word.strip(" ,`()") for word in said.split()} & set(ALLOWED)
    assert named == ALLOWED[room], f"imagebuild/{room}/__init__.py says {sorted(named)}; the table allows "\
                                   f"{sorted(ALLOWED[room])}"


def test_imports_run_one_way_between_rooms() -> None:
    wrong = [f"{imp.source}:{imp.line} imports {imp.target}" for imp in ALL_IMPORTS
             if room_of(imp.source) in ALLOWED and room_of(imp.target) != room_of(imp.source)
             and room_of(imp.target) not in ALLOWED[room_of(imp.source)]]
    assert wrong == []


def test_nothing_imports_the_cli_but_the_entry_points() -> None:
    wrong = [f"{imp.source}:{imp.line}" for imp in ALL_IMPORTS
             if room_of(imp.target) == "cli" and room_of(imp.source) not in ("cli", "top")]
    assert wrong == []


def test_function_level_imports_only_defer_a_heavy_module() -> None:
    hidden = [f"{imp.source}:{imp.line} imports {imp.target}" for imp in ALL_IMPORTS
              if imp.in_function and room_of(imp.source) not in LAZY_IMPORTS_ALLOWED and imp.target not in DEFERRED
              and imp.source not in STDLIB_ONLY]
    assert hidden == []


@pytest.mark.parametrize("module", sorted(STDLIB_ONLY))
def test_a_standard_library_only_module_loads_nothing_else(module: str) -> None:
    assert third_party_loaded_by(module) == set(), STDLIB_ONLY[module]


def third_party_loaded_by(module: str) -> set[str]:
    """The top-level third-party packages a fresh interpreter has loaded after importing `module`."""
    program = textwrap.dedent(f"""
        import importlib, json, sys
        before = set(sys.modules)
        importlib.import_module({module!r})
        loaded = {{name.split(".")[0] for name in set(sys.modules) - before}}
        print(json.dumps(sorted(loaded - set(sys.stdlib_module_names))))
    """)
    proc = subprocess.run([sys.executable, "-c", program], cwd=PACKAGE.parent, capture_output=True, text=True,
                          timeout=60, check=True)
    return set(json.loads(proc.stdout)) - {"imagebuild"}


@pytest.mark.parametrize("module", sorted(DEFERRED))
def test_a_deferred_module_is_heavy(module: str) -> None:
    """A module may be imported late only if importing it loads what the start-up test keeps out."""
    assert third_party_loaded_by(module) & {name.split(".")[0] for name in HEAVY}, f"{module}: {DEFERRED[module]}?"


def test_the_registry_client_is_not_heavy() -> None:
    assert third_party_loaded_by("imagebuild.oci.client") & {"docker", "jinja2", "yaml"} == set()


def test_no_import_cycle_between_modules() -> None:
    edges: dict[str, set[str]] = {}
    for imp in ALL_IMPORTS:
        if imp.target != imp.source and not imp.source.startswith(imp.target + "."):
            edges.setdefault(imp.source, set()).add(imp.target)
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1 on the path, 2 done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for nxt in sorted(edges.get(module, ())):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module)
    assert [" -> ".join(cycle) for cycle in cycles] == []


def test_the_checker_sees_a_function_level_import_and_its_room() -> None:
    # The rules above are only as good as the parser: a lazy import in cli/ is found and marked so.
    lazy = [imp for imp in ALL_IMPORTS if imp.in_function]
    assert lazy and all(room_of(imp.source) for imp in lazy)
    assert room_of("imagebuild.oci.client") == "oci"
    assert room_of("imagebuild.build") == "build"
    assert room_of("imagebuild.cli") == "cli"


def test_one_image_reference_parser() -> None:
    """Only oci/reference.py takes an image reference apart at its '@' (a URL's user info is not one)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "oci" / "reference.py":
            continue
        text = path.read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("partition", "rpartition", "split", "rsplit") and node.args
                    and isinstance(node.args[0], ast.Constant) and node.args[0].value == "@"):
                receiver = ast.get_source_segment(text, node.func.value) or ""
                if "netloc" not in receiver and "://" not in receiver:
                    found.append(f"{module_name(path)}:{node.lineno} {receiver}")
    assert found == []
