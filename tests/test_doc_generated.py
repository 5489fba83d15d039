"""The docs' tables of names and defaults are generated from the code (tools/gen_docs.py):
each generated part of a page is what the generator writes today, and the generator lists
every controller, recipe and task with what the code says of it."""

import importlib.util
import inspect
from pathlib import Path

import pytest

from bigbatch.batch import CONTROLLERS
from bigbatch.experiments.tasks import TASKS
from bigbatch.optim import RECIPES

ROOT = Path(__file__).resolve().parents[1]


def _gen_docs():
    """tools/gen_docs.py, the one writer of the docs' generated parts, as a module."""
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "tools" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GEN = _gen_docs()


@pytest.mark.parametrize("path", sorted(GEN.GENERATED), ids=lambda p: p.name)
def test_each_pages_generated_parts_are_up_to_date(path):
    text = path.read_text()
    assert text == GEN.GENERATED[path](text), "run: python tools/gen_docs.py"


def test_every_generated_marker_names_a_table():
    for path in GEN.GENERATED:
        for line in path.read_text().splitlines():
            if line.startswith("<!-- generated:"):
                assert GEN.generated_tables(line + "\n").count("\n|") >= 2, (path, line)


def test_the_controllers_table_gives_each_constructors_defaults_and_config_name():
    table = GEN.controllers_table()
    for name, cls in CONTROLLERS.items():
        row = next(r for r in table.splitlines() if f"| `{name}` |" in r)
        for p in inspect.signature(cls).parameters.values():
            if p.default is not inspect.Parameter.empty:
                assert f"{p.name}={GEN._shown(p.default)}" in row, (name, p.name)
        assert row.startswith(f"| `{cls.__name__}("), name


def test_the_recipes_table_gives_each_optimizer_its_decay_schedule_and_settings():
    rows = GEN.recipes_table().splitlines()[2:]
    assert sum(row.split("|")[1].count("`") // 2 for row in rows) == len(RECIPES)
    for name, recipe in RECIPES.items():
        row = next(r for r in rows if f"`{name}`" in r.split("|")[1])
        assert f"| {recipe.weight_decay:g}, " in row and f"{recipe.warmup:.0%}, " in row, name
        for key, value in recipe.options.items():
            assert f"{key.replace('_', ' ')} {value:g}" in row, (name, key)


def test_the_tasks_table_gives_each_tasks_shape_budget_target_and_rates():
    rows = GEN.tasks_table().splitlines()[2:]
    assert [r.split("|")[1].strip(" `") for r in rows] == list(TASKS)
    for row, task in zip(rows, TASKS.values()):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[3].startswith(f"{task.width}, {task.depth}"), task.name
        assert cells[4] == f"{task.max_samples:,}" and cells[5].endswith(f" {task.target:g}")
        assert cells[6].startswith(f"{task.lrs['adam']:g}; {task.lrs['adam/held']:g}")
