"""The comparison report's reading of the claim: steps to the best final score."""

import json

from bigbatch.experiments.arms import ArmResult
from bigbatch.experiments.report import comparison
from bigbatch.experiments.report.comparison import (
    _axis,
    _by_axis,
    _critical_batches,
    _judged_early,
    _near_best,
    _rate_grid,
    pareto_front,
)


def _arm(root, name, curves, controller="BatchWarmup()"):
    """An arm whose seeds' eval losses are ``curves`` (lists of (step, loss))."""
    dirs, runs = [], []
    for seed, curve in enumerate(curves):
        run = root / f"{name}-seed{seed}"
        run.mkdir()
        rows = [
            {"step": s, "samples": 16 * s, "eval_loss": v, "wall_seconds": s / 100}
            for s, v in curve
        ]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        dirs.append(run.name)
        runs.append(
            {
                "final_eval_loss": curve[-1][1],
                "steps": curve[-1][0],
                "target_metric": "eval_loss",
                "controller": controller,
            }
        )
    return ArmResult(name, {}, [0.01], 0, runs, dirs)


def test_steps_to_the_best_final_loss_plus_the_tolerance(tmp_path):
    static = _arm(
        tmp_path, "static", [[(100, 2.0), (900, 1.505), (1000, 1.50)]] * 2, "Constant(64)"
    )
    fast = _arm(tmp_path, "schedule", [[(100, 2.0), (400, 1.509), (500, 1.505)]] * 2)
    never = _arm(tmp_path, "large", [[(10, 2.0), (50, 1.60)], [(10, 2.0), (50, 1.51)]])
    lines = _near_best(tmp_path, [static, fast, never], loss=True)
    text = "\n".join(lines)
    assert "T = 1.51" in text  # the best final (1.50) + 0.01
    split = next(i for i, line in enumerate(lines) if line.startswith("Steps to targets"))
    rows = {r.split(" | ")[0].strip("| "): r for r in lines[:split] if r.startswith("| ")}
    assert rows["static"].endswith("| 900 ± 0 (2/2) | 2.25 | 9 ± 0 |")  # 9 s to T
    assert rows["schedule"].endswith("| 400 ± 0 (2/2) | 1.00 | 4 ± 0 |")  # the fewest
    assert "+0.0050" in rows["schedule"]
    assert rows["large"].endswith("(1/2) | — | 0 |")  # one seed short of T: no ratio
    assert (tmp_path / "steps_final.png").is_file()

    # the looser targets, from halfway (1.755) to T: against the static batch's steps
    assert "from the first evaluation (2) to T" in lines[split] and "static batch" in lines[split]
    targets = {r.split(" | ")[0].strip("| "): r for r in lines[split:] if r.startswith("| ")}
    assert targets["arm"].startswith("| arm | 50%: 1.755 |")
    assert targets["static"] == "| static | " + " | ".join(["900 (1.00×)"] * 6) + " |"
    assert targets["schedule"].startswith("| schedule | 400 (0.44×) |")
    assert targets["large"].startswith("| large | 50 (0.06×) |")  # below the static batch
    assert targets["large"].endswith("| 1/2 reached |")  # T itself: one seed short


def test_runs_stopped_at_their_target_are_judged_at_that_target(tmp_path):
    """Under stop_at_target a final score is where a run stopped: T from the best of them
    (an evaluation's overshoot) showed arms that stopped at the target as never reaching T."""
    static = _arm(tmp_path, "static", [[(100, 2.0), (900, 1.55)]] * 2, "Constant(64)")
    fast = _arm(tmp_path, "schedule", [[(100, 2.0), (400, 1.59)]] * 2)
    for run in static.runs + fast.runs:
        run.update(ended="target", target=1.6)
    lines = _near_best(tmp_path, [static, fast], loss=True)
    assert lines[0].startswith("Steps to T = 1.6, the runs' own target (they stop there")
    split = next(i for i, line in enumerate(lines) if line.startswith("Steps to targets"))
    rows = {r.split(" | ")[0].strip("| "): r for r in lines[:split] if r.startswith("| ")}
    assert "| 900 ± 0 (2/2) | 2.25 |" in rows["static"]
    assert "| 400 ± 0 (2/2) | 1.00 |" in rows["schedule"]
    # runs stopped at two targets: no one target to judge them at, so T is the best final's
    for run in fast.runs:
        run["target"] = 1.58
    lines = _near_best(tmp_path, [static, fast], loss=True)
    assert lines[0].startswith("Steps to T = 1.56, the best arm's final eval loss + 0.01")


def test_pareto_front():
    assert pareto_front([(64, 0.97), (256, 0.98), (1024, 0.96), (4096, 0.95), (512, 0.90)]) == [
        (256, 0.98),
        (1024, 0.96),
        (4096, 0.95),
    ]
    # a point no more accurate than one at a larger batch is beaten by it
    assert pareto_front([(64, 0.9), (128, 0.9), (32, 0.95)]) == [(32, 0.95), (128, 0.9)]


def test_the_rate_grid_judged_early_leads_with_the_rate_that_learns_fastest(tmp_path):
    """A large rate leads early and ends worst: judged at a tenth of the run, the grid
    picks it; at nine tenths, the rate the whole runs chose."""
    curves = {  # eval loss at samples 100, 500, 900, 1000 of a 1,000-sample budget
        0.001: [2.0, 1.6, 1.2, 1.1],
        0.002: [1.9, 1.5, 1.3, 1.25],
        0.004: [1.5, 1.4, 1.45, 1.5],
    }
    dirs = []
    for i, losses in enumerate(curves.values()):
        run = tmp_path / f"lr{i}"
        run.mkdir()
        (run / "config.toml").write_text("max_samples = 1000\n")
        rows = [
            {"step": s // 10, "samples": s, "eval_loss": v}
            for s, v in zip((100, 500, 900, 1000), losses)
        ]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        dirs.append(run.name)
    runs = [{"final_eval_loss": 1.1, "target_metric": "eval_loss"}]
    arm = ArmResult("adam", {}, list(curves), 0, runs, dirs[:1], grid_dirs=dirs)
    lines = _judged_early(tmp_path, [arm], [0.1, 0.5, 0.95], loss=True)
    rows = [line for line in lines if line.startswith("| adam")]
    assert rows[0] == "| adam | 0.1 | 0.001: 2.0000, 0.002: 1.9000, 0.004: 1.5000* | × 4 |"
    assert rows[1].endswith("0.004: 1.4000* | × 4 |")
    assert rows[2].endswith("| × 1 |") and "0.001: 1.2000*" in rows[2]  # the last at 900
    # nothing judged where no fraction is asked for, or before the first evaluation
    assert _judged_early(tmp_path, [arm], [], loss=True) == []
    early = _judged_early(tmp_path, [arm], [0.05], loss=True)
    assert "| adam | 0.05 | 0.001: —, 0.002: —, 0.004: — | — |" in early
    # a tie (every rate's first evaluation, before it trained) has no leader
    for name in dirs:
        rows = [{"step": 0, "samples": 0, "eval_loss": 2.3}, {"step": 10, "samples": 1000}]
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tied = _judged_early(tmp_path, [arm], [0.5], loss=True)
    assert "| adam | 0.5 | 0.001: 2.3000, 0.002: 2.3000, 0.004: 2.3000 | — |" in tied


def test_the_axis_drawn_against_is_a_varied_quantity_never_the_seed():
    def arms(**values):
        return [ArmResult(str(i), {k: v[i] for k, v in values.items()}, [0.01], 0, [{}])
                for i in range(3)]  # fmt: skip

    plan = {"varied": ["seed", "lr_max"]}
    assert _axis(plan, arms(seed=[0, 1, 2], lr_max=[0.1, 0.2, 0.4])) == "lr_max"
    assert _axis({"varied": ["seed"]}, arms(seed=[0, 1, 2])) is None
    assert _axis({"varied": ["lr"]}, arms(lr=[0.1, 0.2, 0.2])) is None  # two values: no curve
    both = arms(lr=[0.1, 0.2, 0.4], **{"model.width": [8, 16, 32]})
    assert _axis({"varied": ["lr", "model.width"]}, both) == "model.width"  # the last varied
    batch = {"varied": ["model.width", "batch.initial"]}
    assert _axis(batch, arms(**{"model.width": [8, 16, 32], "batch.initial": [16, 64, 256]})) == (
        "batch.initial"
    )


def _labels_inside(save):
    """``save``, after asserting every axis label of the figure lies inside it."""

    def checked(fig, path, **kwargs):
        fig.tight_layout()
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        frame = fig.bbox
        for ax in fig.axes:
            for label in (ax.xaxis.label, ax.yaxis.label):
                box = label.get_window_extent(renderer)
                assert frame.x0 <= box.x0 and box.x1 <= frame.x1, label.get_text()
                assert frame.y0 <= box.y0 and box.y1 <= frame.y1, label.get_text()
        save(fig, path, **kwargs)

    return checked


def test_each_arm_written_out_is_its_own_curve_against_the_batch(tmp_path, monkeypatch):
    """`--arm static:... --arm seesaw:... --vary batch.initial=16,64,256`: two curves, each
    with its own critical batch (they were one curve, "all", and one fit of both)."""
    arms = []
    for name, critical in (("static", 64), ("seesaw", 1024)):
        for batch in (16, 64, 256):
            steps = round(1000 * (1 + critical / batch))  # S_min (1 + B_crit / B)
            runs = [{"steps_to_target": steps, "best_eval_loss": 1.5}]
            point = f"{name}, batch.initial={batch}"
            arms.append(ArmResult(point, {"batch.initial": batch}, [0.01], 0, runs, ["d"]))
    monkeypatch.setattr(comparison, "save", _labels_inside(comparison.save))
    text = "\n".join(_by_axis(tmp_path, arms, "batch.initial", loss=True))
    assert (tmp_path / "by_batch_initial.png").is_file()
    rows = {r.split(" | ")[0].strip("| "): r.split(" | ") for r in text.splitlines()}
    assert "all" not in rows
    assert float(rows["static"][2]) == 64 and float(rows["seesaw"][2].replace(",", "")) == 1024


def test_a_critical_batch_beyond_the_fit_names_the_batches_fitted_not_the_arms(
    tmp_path, monkeypatch
):
    """Batch 1,024 never reached the target, so the fit covered 16-256: it said "> 1024";
    steps exactly 1/B gave a floor of 1e-14 steps and B_crit 2e18 where it has none."""
    arms = []
    for batch, steps in ((16, 400), (64, 100), (256, 25), (1024, None)):
        runs = [{"steps_to_target": steps and s * steps, "best_eval_loss": 1.5} for s in (1, 2)]
        arms.append(ArmResult(f"batch.initial={batch}", {"batch.initial": batch}, [0.01], 0,
                              runs, ["d", "e"]))  # fmt: skip
    monkeypatch.setattr(comparison, "save", _labels_inside(comparison.save))
    text = "\n".join(_by_axis(tmp_path, arms, "batch.initial", loss=True))
    row = next(r for r in text.splitlines() if r.startswith("| all |")).split(" | ")
    assert row[1:4] == ["0", "> 256 (no floor yet)", "> 256 (no floor yet), > 256 (no floor yet)"]


def test_a_critical_batch_is_fitted_on_three_batches_reached_at_least():
    arms = [
        ArmResult(str(batch), {"batch.initial": batch}, [0.01], 0, [{"steps_to_target": steps}])
        for batch, steps in ((16, 400), (64, 100), (256, None))
    ]
    assert _critical_batches({"all": arms}, "batch.initial") == {}  # two points: no fit


def test_the_rate_grid_says_how_far_the_own_rate_ends_from_the_chosen(tmp_path):
    dirs = []
    for i, final in enumerate((0.8, 0.85, 0.9)):
        (tmp_path / f"lr{i}").mkdir()
        summary = {"ended": "budget", "final_accuracy": final}
        (tmp_path / f"lr{i}" / "summary.json").write_text(json.dumps(summary))
        dirs.append(f"lr{i}")
    runs = [{"final_accuracy": 0.9}]
    arm = ArmResult("adam", {}, [0.005, 0.01, 0.02], 2, runs, dirs[2:], grid_dirs=dirs, own=1)
    lines = _rate_grid(tmp_path, [arm], loss=False)
    # the table's rule has a cell for each heading
    assert lines[2:4] == ["| arm | rate: final | own − chosen |", "|---|---|---|"]
    assert lines[-2].startswith("| adam | 0.005: 0.8000, 0.01°: 0.8500, 0.02: 0.9000* (")
    assert lines[-2].endswith(" | -0.0500 |")  # own − chosen (its sign was flipped)
    # an arm of one rate (a tuned one) has no grid to show
    one = ArmResult("tuned", {}, [0.01], 0, runs, dirs[:1], grid_dirs=dirs[:1], own=0)
    assert _rate_grid(tmp_path, [one], loss=False) == []


def test_a_diverged_seed_or_arm_is_counted_not_hidden(tmp_path):
    """A diverged seed left the mean of two printed as of every seed, and a "± 0" of one;
    a diverged arm's first evaluation (1e18) set where the looser targets start; arms that
    all diverged could not draw the Pareto plot's log axis."""
    import math

    from bigbatch.experiments.report.comparison import _plot_pareto

    static = _arm(tmp_path, "static", [[(100, 2.0), (1000, 1.50)]] * 3, "Constant(64)")
    static.runs[1]["final_eval_loss"] = math.nan  # seed 1 diverged
    diverged = _arm(tmp_path, "diverged", [[(1, 1e18), (10, math.nan)]], "Constant(64)")
    lines = _near_best(tmp_path, [static, diverged], loss=True)
    split = next(i for i, line in enumerate(lines) if line.startswith("Steps to targets"))
    rows = {r.split(" | ")[0].strip("| "): r for r in lines[:split] if r.startswith("| ")}
    assert "| 1.5000 ± 0.0000 (2 of 3 seeds) |" in rows["static"]
    assert "| — |" in rows["diverged"]  # no gap to the best: nothing finite to take it from
    assert any("from the first evaluation (2) to T" in line for line in lines)
    for arm in (static, diverged):
        for run in arm.runs:
            run["final_eval_loss"] = run["best_eval_loss"] = math.nan
            run["avg_batch_size"] = 64
    _plot_pareto(tmp_path, [static, diverged], loss=True)
    assert (tmp_path / "pareto.png").is_file()


def test_keys_varied_together_are_one_curve_against_either(tmp_path, monkeypatch):
    """`--vary model.width+model.depth=16+1,32+2,64+3`: one curve of three shapes (it drew
    three curves of one point each, one per width)."""
    arms = []
    for width, depth in ((16, 1), (32, 2), (64, 3)):
        runs = [{"steps_to_target": 1000 + width, "best_eval_loss": 1.5}]
        overrides = {"model.width": width, "model.depth": depth}
        name = f"model.width={width}, model.depth={depth}"
        arms.append(ArmResult(name, overrides, [0.01], 0, runs, ["d"]))
    import bigbatch.experiments.report.comparison as comparison

    drawn = {}
    monkeypatch.setattr(
        comparison, "_plot_by_axis", lambda root, curves, *rest: drawn.update(curves) or "p.png"
    )
    _by_axis(tmp_path, arms, "model.depth", loss=True)
    assert list(drawn) == ["all"] and len(drawn["all"]) == 3
