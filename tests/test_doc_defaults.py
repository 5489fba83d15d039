"""The docs' tables of defaults say what the code does: each controller's signature in
docs/adaptive_batching.md lists every keyword of its constructor with its default."""

import ast
import importlib.util
import inspect
import operator
import re
from pathlib import Path

import pytest

import bigbatch.batch as batch

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\| `(\w+)\(([^`]*)\)`", re.MULTILINE)
#: controllers whose row lists their constructor (Constant and Ramp show their forms)
LISTED = (
    "BatchWarmup",
    "Seesaw",
    "WarmupSeesaw",
    "CriticalBatchRamp",
    "DampedSimiGrad",
    "SimiGrad",
    "NoiseScale",
)


#: every registered controller class by its name (the research ones live in batch.contrib)
CLASSES = {cls.__name__: cls for cls in batch.CONTROLLERS.values()}


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
        for p in inspect.signature(CLASSES[name]).parameters.values()
        if p.default is not inspect.Parameter.empty
    }
    rows = documented()
    assert name in rows, f"docs/adaptive_batching.md has no row for {name}"
    assert rows[name] == pytest.approx(defaults)


def table_rows(page: str, header: str) -> list[list[str]]:
    """The cells of the rows of the table whose header line starts with ``header``."""
    lines = (ROOT / "docs" / page).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def numbers(text: str) -> list[float]:
    return [float(n) for n in re.findall(r"(?<![\w.])\d+(?:\.\d+)?(?:e-?\d+)?", text)]


def test_the_recipes_table_says_what_each_optimizer_gets():
    from bigbatch.optim import RECIPES

    rows = table_rows("optimizers.md", "| optimizers | weight decay |")
    assert sorted(n for row in rows for n in re.findall(r"`([\w-]+)`", row[0])) == sorted(RECIPES)
    for names, decay, shape, settings, _ in rows:
        for name in re.findall(r"`([\w-]+)`", names):
            recipe = RECIPES[name]
            assert numbers(decay)[0] == recipe.weight_decay, name
            assert f"{recipe.warmup:.0%}, {recipe.schedule}" == shape, name
            if "gamma" in recipe.options:
                assert f"γ {recipe.options['gamma']:g}" in settings, name
            if "trust_coefficient" in recipe.options and name in ("lars", "larc"):
                assert f"trust coefficient {recipe.options['trust_coefficient']:g}" in settings


def test_the_tasks_table_gives_each_tasks_shape_target_and_rates():
    from bigbatch.experiments.tasks import TASKS

    rows = table_rows("cli.md", "| task | data | model")
    assert [row[0].strip("`") for row in rows] == list(TASKS)
    for name, _, model, target, rates in rows:
        task = TASKS[name.strip("`")]
        shape = re.search(r"\((\d+), (\d+)\)", model)
        assert shape and [int(shape[1]), int(shape[2])] == [task.width, task.depth], name
        assert numbers(target)[0] == task.target, name
        assert numbers(rates)[:2] == [task.lrs["adam"], task.lrs["adam/held"]], name


def test_each_commands_options_table_is_made_from_its_settings():
    text = (ROOT / "docs" / "cli.md").read_text()
    assert text.count("<!-- generated: options ") == 4  # compare, critical, tune, federated
    assert text == _gen_docs().options_tables(text), "run: python tools/gen_docs.py"


def _gen_docs():
    """tools/gen_docs.py, the one writer of the docs' generated parts, as a module."""
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "tools" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
