"""The tests' own rules, read from their source: a test that expects an exception says which message.

`pytest.raises(SomeError)` alone passes for any SomeError, whatever raised it and whatever it says, so a
test could pass for a reason other than the one it is named for. Every `pytest.raises` in tests/ (and
`raises` imported from pytest) therefore names, with `match=`, the part of the message it expects.
"""
from __future__ import annotations

import ast
import textwrap
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def raises_names(tree: ast.Module) -> frozenset[str]:
    """The bare names `raises` is known by in this module (`from pytest import raises [as r]`)."""
    return frozenset(alias.asname or alias.name for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and node.module == "pytest"
                     for alias in node.names if alias.name == "raises")


def is_raises(call: ast.Call, bare: frozenset[str]) -> bool:
    func = call.func
    if isinstance(func, ast.Attribute):
        return func.attr == "raises" and isinstance(func.value, ast.Name) and func.value.id == "pytest"
    return isinstance(func, ast.Name) and func.id in bare


def states_a_message(call: ast.Call) -> bool:
    for keyword in call.keywords:
        if keyword.arg == "match":
            return not (isinstance(keyword.value, ast.Constant) and keyword.value.value in (None, ""))
    return False


def unmatched_raises(source: str, filename: str = "<test>") -> list[int]:
    """The lines of every `pytest.raises(...)` call in `source` without a `match=` naming a message."""
    tree = ast.parse(source, filename)
    bare = raises_names(tree)
    return sorted(node.lineno for node in ast.walk(tree)
                  if isinstance(node, ast.Call) and is_raises(node, bare) and not states_a_message(node))


def test_the_check_sees_a_raises_without_a_message_in_every_spelling():
    source = textwrap.dedent("""\
        import pytest
        from pytest import raises as expect_error

        def test_a():
            with pytest.raises(ValueError):
                int("x")
            with pytest.raises(ValueError, match=None):
                int("x")
            with expect_error(KeyError):
                {}["k"]
            with pytest.raises(ValueError, match="invalid literal"), pytest.raises(TypeError, match=""):
                int("x")
            with pytest.raises(ValueError, match="invalid literal") as caught:
                int("x")
            assert caught.value
            text = "pytest.raises(ValueError)"  # a string is not a call
        """)
    assert unmatched_raises(source) == [5, 7, 9, 11]


def test_every_pytest_raises_in_the_tests_states_the_message_it_expects():
    files = sorted(TESTS.rglob("*.py"))
    assert len(files) > 50, "the tests were found"
    missing = [f"{path.relative_to(TESTS.parent)}:{line}" for path in files
               for line in unmatched_raises(path.read_text(encoding="utf-8"), str(path))]
    assert missing == [], ("pytest.raises without match= (name the message the product gives, "
                           "re.escape'd where it has regex characters): " + ", ".join(missing))
