"""Code a reader takes in at once: no function over 80 lines, no class over 250 (the
docstring counted), anywhere in the package."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "bigbatch"
LIMITS = {ast.FunctionDef: 80, ast.AsyncFunctionDef: 80, ast.ClassDef: 250}


def too_long(source: str) -> list[str]:
    """``name (lines)`` of each function or class in ``source`` longer than its limit."""
    found = []
    for node in ast.walk(ast.parse(source)):
        limit = LIMITS.get(type(node))
        if limit is not None and (lines := node.end_lineno - node.lineno + 1) > limit:
            found.append(f"{node.name} ({lines} lines)")
    return found


def test_the_limits_see_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(80))
    assert too_long(f"def f():\n{body}\n") == ["f (81 lines)"]
    assert too_long("def g():\n    return 1\n") == []


def test_no_function_or_class_over_its_limit():
    found = {
        str(path.relative_to(SRC)): names
        for path in sorted(SRC.rglob("*.py"))
        if (names := too_long(path.read_text()))
    }
    assert found == {}
