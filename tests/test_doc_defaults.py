"""The docs' tables of defaults say what the code does: each controller's signature in
docs/adaptive_batching.md lists every keyword of its constructor with its default."""

import ast
import inspect
import operator
import re
from pathlib import Path

import pytest

import bigbatch.batch as batch

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\| `(\w+)\(([^`]*)\)`", re.MULTILINE)
#: controllers whose row lists their constructor (Constant and Ramp show their forms)
LISTED = ("BatchWarmup", "Seesaw", "CriticalBatchRamp", "DampedSimiGrad", "SimiGrad", "NoiseScale")


def value(text: str) -> object:
    """A default as the docs write it: a literal, or a fraction such as ``1/3``."""
    tree = ast.parse(text, mode="eval").body
    if isinstance(tree, ast.BinOp) and isinstance(tree.op, ast.Div):
        return operator.truediv(ast.literal_eval(tree.left), ast.literal_eval(tree.right))
    return ast.literal_eval(tree)


def documented() -> dict[str, dict[str, object]]:
    text = (ROOT / "docs" / "adaptive_batching.md").read_text()
    rows = {}
    for name, args in ROW.findall(text):
        pairs = [a.split("=", 1) for a in args.split(", ") if "=" in a]
        rows[name] = {k.strip(): value(v) for k, v in pairs}
    return rows


def test_the_fraction_reader():
    assert value("1/3") == pytest.approx(1 / 3) and value("False") is False and value("16") == 16


@pytest.mark.parametrize("name", LISTED)
def test_a_controllers_row_lists_its_constructors_defaults(name):
    defaults = {
        p.name: p.default
        for p in inspect.signature(getattr(batch, name)).parameters.values()
        if p.default is not inspect.Parameter.empty
    }
    rows = documented()
    assert name in rows, f"docs/adaptive_batching.md has no row for {name}"
    assert rows[name] == pytest.approx(defaults)
