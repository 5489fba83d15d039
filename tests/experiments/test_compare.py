"""``bigbatch compare``: the grid, recipes, the tuned protocol and the report (fake training)."""

import json
import math
import re
from pathlib import Path

import pytest

from bigbatch import cli
from bigbatch.experiments.compare import parse_axis, plan, run_comparison
from bigbatch.experiments.config import ConfigError, load_toml, resolve

from .fake_runs import critical_batch

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args):
    return cli.main([str(a) for a in args])


def test_keys_joined_by_plus_vary_together():
    keys, points = parse_axis("model.width+model.depth=64+2,32+3")
    assert keys == ["model.width", "model.depth"]
    assert points == [{"model.width": 64, "model.depth": 2}, {"model.width": 32, "model.depth": 3}]
    comparison = plan(
        resolve({"task": "digits"}),
        vary=["model.width+model.depth=64+2,32+3", "batch.initial=64,256,1024"],
    )
    assert len(comparison.arms) == 6  # 2 shapes x 3 batches, not 2 x 2 x 3
    assert comparison.arms[1].name == "model.width=64, model.depth=2, batch.initial=256"


@pytest.mark.parametrize(
    "options, message",
    [
        ({"vary": ["model.width+model.depth=64+2,32"]}, "has 1 values for 2 keys"),
        ({"vary": ["batch.initial=64", "batch.initial=128"]}, "varied twice"),
        ({"vary": ["batch.initial=64"], "lr_grid": "1,x2"}, "lr_grid takes comma-separated"),
        ({"vary": ["batch.initial=64"], "lr_grid": [1, -2]}, "lr_grid must be > 0, got -2"),
        ({"vary": ["batch.initial=64"], "seeds": 0}, "seeds must be a whole number >= 1"),
        ({"vary": ["batch.initial=64"], "rank": "fast"}, "rank must be one of 'steps'"),
        ({"vary": ["batch.initial=64"], "folds": 3}, "unknown option 'folds' in .compare.: it "),
        ({"vary": ["batch.initial=-1"]}, "batch.initial"),
        ({"vary": [1, 2]}, "vary takes text such as 'KEY=V1,V2,...', got 1"),
        ({"arms": [["seed=0"]]}, "arms takes text such as 'NAME:KEY=V,...', got \\['seed=0'\\]"),
        ({"vary": ["seed=0,1,0"]}, "--vary seed: '0' is given twice"),
        ({"vary": ["batch.initial=64"], "lr_grid": "1,,2"}, "lr_grid takes comma-separated"),
        # its ends are the grid's widening ends: out of order, it widened inside the grid
        ({"vary": ["batch.initial=64"], "lr_grid": [1, 0.5, 2]}, r"increasing .* \[1.0, 0.5"),
        ({"vary": ["batch.initial=64"], "lr_grid": [1, 2, 2]}, "needs increasing multipliers"),
        ({"vary": ["batch.initial=64"], "widen": 2}, "widen needs an lr_grid of two"),
        ({"arms": ["a:seed=1", "b:seed=1"]}, "arm 'a' has another arm's settings"),
    ],
)
def test_a_bad_plan_is_one_error(options, message):
    with pytest.raises(ConfigError, match=message):
        plan(resolve({"task": "digits"}), **options)


RECIPE = """
task = "digits"
[batch]
controller = "constant"
[compare]
vary = ["model.width+model.depth=32+1,128+1", "batch.initial=32,128,512,1024"]
lr_grid = [0.5, 1, 2]
seeds = 2
rank = "steps"
"""


def test_a_recipe_runs_the_protocol_and_reports_the_critical_batch(
    trained, tmp_path, monkeypatch, capsys
):
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(RECIPE)
    out = tmp_path / "cmp"
    reads = []
    monkeypatch.setattr(cli, "load_toml", lambda path: reads.append(path) or load_toml(path))
    assert run_cli("compare", "--quiet", "--config", recipe, "--out", out) == 0
    assert [Path(p) for p in reads] == [recipe]  # the run keys, [compare] and [tune] from one read
    assert len(trained) == 8 * 3 + 8 * 1  # 8 arms: a 3-point grid, then one more seed
    assert {c["batch.controller"] for c in trained} == {"constant"}
    index = json.loads((out / "compare.json").read_text())
    # the fake's best rate lies halfway (in log) between the grid's x1 and x2: a tie, in
    # which the end of the grid is taken (the rate may lie beyond it)
    assert [a["dirs"][1] for a in index["arms"]][:1] == ["run00-lr2-seed1"]
    report = (out / "report.md").read_text()
    for name in ("curves.png", "pareto.png", "by_batch_initial.png"):
        assert (out / name).is_file() and name in report
    # one critical batch per shape, the fake's 4 x width (its steps are rounded)
    for width in (32, 128):
        row = next(
            r
            for r in report.splitlines()
            if r.startswith(f"| model.width={width}, model.depth=1 |")
        )
        fitted = float(re.split(r"\s*\|\s*", row)[3].replace(",", ""))
        assert fitted == pytest.approx(critical_batch(width), rel=0.02)
    # the same comparison into the same directory continues it: nothing trains again
    assert run_cli("compare", "--quiet", "--config", recipe, "--out", out) == 0
    assert len(trained) == 32
    # flags override the recipe; another plan in that directory is refused
    capsys.readouterr()
    assert run_cli("compare", "--quiet", "--config", recipe, "--seeds", "3", "--out", out) == 2
    assert "a comparison of other settings (seeds = 2 there, 3 now)" in capsys.readouterr().err


def test_an_unknown_recipe_option_is_one_error(tmp_path, capsys):
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(RECIPE + "folds = 3\n")
    assert run_cli("compare", "--config", recipe, "--out", tmp_path / "x") == 2
    err = capsys.readouterr().err
    assert "unknown option 'folds' in [compare]: it takes vary, arms, lr_grid" in err
    assert err.count("\n") == 1


def test_a_tuned_comparison_searches_each_arms_rate_over_the_grid_range(trained, tmp_path):
    pytest.importorskip("optuna")
    base = resolve({"task": "digits", "lr": 0.001, "max_samples": 27_000})
    comparison = plan(base, vary=["batch.initial=64,256"], lr_grid=[1, 16], seeds=2, tune=True)
    report = run_comparison(comparison, tmp_path / "cmp", quiet=True).read_text()
    index = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    for arm in index["arms"]:
        (lr,) = arm["lrs"]
        assert abs(math.log2(lr / 0.004)) < 0.5  # the fake's best rate, of 9 trials
        assert arm["tuned"]["trials"] == 9 and 0 < arm["tuned"]["cost"] < 1
        assert arm["dirs"][0].startswith(f"{arm['dirs'][1].split('-')[0]}-tune/trials/")
        assert (tmp_path / "cmp" / arm["dirs"][1] / "summary.json").is_file()  # seed 1
    assert "searched by `bigbatch tune`" in report and "tuned: 9 trials" in report
    with pytest.raises(ConfigError, match="give two multipliers"):
        plan(base, vary=["batch.initial=64,256"], tune=True)


TUNED_RECIPE = """
task = "digits"
[compare]
lr_grid = [0.5, 2]
tune = true
[[compare.arms]]
name = "default"
[tune]
trials = 6
seed = 1
"""


def test_a_tuned_comparisons_studies_take_the_tune_options_as_flags(tmp_path, monkeypatch, capsys):
    """``--tune --search-seed 2 --trials 3``: the study's sampler seed and trials, over the
    file's ``[tune]`` table; its trials at a time are the comparison's ``--jobs``."""
    import bigbatch.experiments.compare as compare_module

    seen = {}

    def fake_run(comparison, out, *, quiet, tune):
        seen["tune"] = tune
        return tmp_path / "report.md"

    monkeypatch.setattr(compare_module, "run_comparison", fake_run)
    recipe = tmp_path / "tuned.toml"
    recipe.write_text(TUNED_RECIPE)
    args = ["compare", "--config", recipe, "--search-seed", "2", "--jobs", "2"]
    assert run_cli(*args) == 0
    assert (seen["tune"].seed, seen["tune"].trials, seen["tune"].jobs) == (2, 6, 2)
    assert run_cli(*args, "--trials", "3") == 0 and seen["tune"].trials == 3
    capsys.readouterr()
    assert run_cli(*args, "--trials", "0") == 2
    assert "--trials must be a whole number >= 1, got 0" in capsys.readouterr().err


ARMS_RECIPE = """
task = "digits"
[compare]
vary = ["model.width=16,32"]
lr_grid = [0.5, 1]
widen = 2
[[compare.arms]]
name = "static 64"
lr = 0.001
batch.controller = "constant"
batch.initial = 64
[[compare.arms]]
name = "seesaw x2"
lr = 0.001
batch.controller = "seesaw"
batch.max_growth = 2
"""


def test_arms_written_out_times_the_axes_and_a_widened_grid(trained, tmp_path):
    recipe = tmp_path / "arms.toml"
    recipe.write_text(ARMS_RECIPE)
    out = tmp_path / "cmp"
    assert run_cli("compare", "--config", recipe, "--out", out, "--quiet") == 0
    arms = json.loads((out / "compare.json").read_text())["arms"]
    assert [a["name"] for a in arms] == [
        "static 64, model.width=16",
        "static 64, model.width=32",
        "seesaw x2, model.width=16",
        "seesaw x2, model.width=32",
    ]
    assert arms[2]["overrides"] == {
        "lr": 0.001, "batch.controller": "seesaw", "batch.max_growth": 2, "model.width": 16
    }  # fmt: skip
    # the fake's best rate is 0.004: the grid (0.0005, 0.001) widens twice to reach it
    assert [round(lr, 6) for lr in arms[0]["lrs"]] == [0.0005, 0.001, 0.002, 0.004]
    assert len(trained) == 4 * 4  # every arm's four rates on one seed
    # the report gives the final score at every rate of the grid, marks the chosen rate and
    # the arm's own (x1, what its settings give untuned), and how far the own rate ends
    assert arms[0]["own"] == 1 and len(arms[0]["grid_dirs"]) == 4
    finals = [
        json.loads((out / d / "summary.json").read_text())["final_accuracy"]
        for d in arms[0]["grid_dirs"]
    ]
    cells = ", ".join(
        f"{lr:g}{'°' if i == 1 else ''}: {v:.4f}{'*' if i == 3 else ''}"
        for i, (lr, v) in enumerate(zip([0.0005, 0.001, 0.002, 0.004], finals))
    )
    row = (
        f"| static 64, model.width=16 | {cells} (the chosen rate is an end of the grid) "
        f"| {finals[1] - finals[3]:+.4f} |"
    )
    report = (out / "report.md").read_text()
    assert row in report
    assert "× [0.5, 1.0], widened by up to 2 at an end holding the best, on the first" in report


def test_an_arm_from_the_command_line_and_the_errors_of_arms():
    comparison = plan(
        resolve({"task": "digits"}),
        arms=["static 16:batch.controller=constant,batch.initial=16", "default:"],
    )
    assert [(a.name, a.overrides) for a in comparison.arms] == [
        ("static 16", {"batch.controller": "constant", "batch.initial": 16}),
        ("default", {}),
    ]
    base = resolve({"task": "digits"})
    with pytest.raises(ConfigError, match="--arm takes NAME:KEY=V"):
        plan(base, arms=["static 16"])
    with pytest.raises(ConfigError, match="two arms share a name"):
        plan(base, arms=["a:seed=1", "a:seed=2"])
    with pytest.raises(ConfigError, match="which --vary also varies"):
        plan(base, arms=["a:seed=1"], vary=["seed=2,3"])
    with pytest.raises(ConfigError, match="widen must be a whole number >= 0, got -1"):
        plan(base, arms=["a:seed=1"], widen=-1)
    with pytest.raises(ConfigError, match=r"batch\.intial"):
        plan(base, arms=["a:batch.intial=1"])


STUDIES = sorted(
    [
        *(ROOT / "benchmarks" / "studies").glob("*.toml"),
        *(ROOT / "examples" / "recipes").glob("*.toml"),
    ]
)


@pytest.mark.filterwarnings("error::UserWarning")  # a key an arm's controller leaves unread
@pytest.mark.parametrize("study", STUDIES, ids=lambda p: p.name)
def test_every_study_file_plans_every_arm(study):
    """A study file is data: its config and every arm resolve (no training here)."""
    table = load_toml(study)
    options = {k.removeprefix("compare."): v for k, v in table.items() if k.startswith("compare.")}
    base = resolve({k: v for k, v in table.items() if not k.startswith("compare.")})
    assert plan(base, **options).arms
    if "--tune" in study.read_text():  # its comment gives a tuned command: the file takes it
        assert plan(base, **{**options, "tune": True}).arms


def test_the_report_adds_the_train_accuracy_and_the_gap_where_runs_measured_them(trained, tmp_path):
    out = tmp_path / "gap"
    args = ["compare", "--task", "digits", "--arm", "a:seed=0", "--out", out, "--quiet"]
    assert run_cli(*args, "--set", "train_samples=500") == 0
    header = next(
        line for line in (out / "report.md").read_text().splitlines() if "lr (grid)" in line
    )
    assert header.endswith("| final train accuracy | gap (train − test) |")
    row = next(
        line for line in (out / "report.md").read_text().splitlines() if line.startswith("| a |")
    )
    assert row.count("|") == header.count("|")


def test_an_arm_that_diverged_at_every_rate_says_so_and_chooses_none(trained, tmp_path):
    out = tmp_path / "boom"
    args = ["compare", "--task", "digits", "--arm", "ok:lr=0.004", "--arm", "boom:lr=1000"]
    assert run_cli(*args, "--lr-grid", "0.5,1", "--out", out, "--quiet") == 0
    lines = (out / "report.md").read_text().splitlines()
    boom = [line for line in lines if line.startswith("| boom |")]
    assert "no score on any seed (ended: skip_limit)" in boom[0]
    assert boom[-1].endswith("1000°: — (no rate gave a score) | — |")  # none marked chosen
    ok = [line for line in lines if line.startswith("| ok |")]
    assert "no score" not in ok[0] and "*" in ok[-1]


def test_the_report_adds_the_largest_attention_logit_on_a_transformer_task(trained, tmp_path):
    out = tmp_path / "logit"
    assert run_cli("compare", "--task", "lm", "--arm", "a:seed=0", "--out", out, "--quiet") == 0
    lines = (out / "report.md").read_text().splitlines()
    header = next(line for line in lines if "lr (grid)" in line)
    assert header.endswith("| wall s | largest attention logit |")
    assert next(line for line in lines if line.startswith("| a |")).endswith("| 1.77 |")


def test_a_stop_inside_one_run_asks_for_the_comparison_again(
    trained, tmp_path, monkeypatch, capsys
):
    # the one run's own resume would train it alone, not continue the comparison
    from bigbatch.experiments import runner
    from bigbatch.experiments.signals import Stopped

    recipe = tmp_path / "arms.toml"
    recipe.write_text(ARMS_RECIPE)
    train = runner.train

    def stopped_at_the_third_run(config, out, **options):
        if len(trained) == 2:
            raise Stopped(15, 7, str(out))
        return train(config, out, **options)

    monkeypatch.setattr(runner, "train", stopped_at_the_third_run)
    out = tmp_path / "cmp"
    assert run_cli("compare", "--config", recipe, "--out", out, "--quiet") == 143
    assert f"run the same command again (--out {out}) to continue" in capsys.readouterr().err
    monkeypatch.setattr(runner, "train", train)
    assert run_cli("compare", "--config", recipe, "--out", out, "--quiet") == 0
    assert len(trained) == 4 * 4  # the two runs before the stop were not trained again
