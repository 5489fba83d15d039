"""The README quotes what its commands print: the figures of the main job come from
``benchmarks/default_run.py --write``, which records them in docs/default_run.json."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def default_run_module():
    spec = importlib.util.spec_from_file_location("default_run", ROOT / "benchmarks/default_run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_quotes_the_recorded_default_run():
    default_run = default_run_module()
    figures = json.loads((ROOT / "docs" / "default_run.json").read_text())
    assert default_run.quoted_block((ROOT / "README.md").read_text()) == default_run.quote(figures)


def test_the_readme_main_command_is_the_one_the_figures_come_from():
    text = (ROOT / "README.md").read_text()
    assert 'python -m pip install -c constraints/ci.txt -e ".[cli]" && bigbatch train' in text
    assert default_run_module().COMMAND[0] == "train"
