"""A report of the code a reader takes in at once: functions over 80 lines, classes over 250
(the docstring counted), anywhere in the package.

    python tools/code_shape.py

A report, not a gate: a long piece is a place to look, and split where its meaning
splits, not to stay under a number.
"""

from __future__ import annotations

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


def main() -> None:
    found = {
        str(path.relative_to(SRC)): names
        for path in sorted(SRC.rglob("*.py"))
        if (names := too_long(path.read_text()))
    }
    for path, names in found.items():
        print(f"{path}: {', '.join(names)}")
    if not found:
        print("no function over 80 lines, no class over 250")


if __name__ == "__main__":
    main()
