"""A comparison's report: ``report.md`` with every arm's table, the steps to each
target, the rate grid, and the figures against the varied key, from ``compare.json``
and the runs' folders alone."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ..analysis import first_reaching, fit_critical_batch, mean_std, targets_between
from ..arms import ArmResult
from ..config import ConfigError, load_toml
from ..rundir import read_json, read_metrics
from ..summary import finished_summary
from .figures import plt, save, series, table


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points not beaten in both larger batch and higher accuracy, by batch size."""
    front = []
    for batch, accuracy in sorted(points, key=lambda p: (-p[0], -p[1])):
        if not front or accuracy > front[-1][1]:
            front.append((batch, accuracy))
    return sorted(front)


def _read_comparison(root: Path) -> tuple[dict[str, Any], list[ArmResult]]:
    """The plan, and each trained arm with its runs' summaries (the grid's are not read)."""
    index = read_json(root / "compare.json")
    if isinstance(index, dict) and "plan" in index and "arms" not in index:
        raise ConfigError(  # written when it starts, its results when it ends
            f"{str(root)!r} holds a comparison that has not ended: run the same bigbatch "
            f"compare command (--out {root}) to finish it, which writes its report"
        )
    arms = []
    for entry in index.get("arms", []):
        runs = []
        for d in entry["dirs"]:
            summary = finished_summary(root / d)
            if summary is None:  # a seed or an arm left out would change what is compared
                raise ConfigError(
                    f"{str(root / d)!r} holds no finished run (no summary.json of one): run "
                    f"the same bigbatch compare command (--out {root}) to train it again"
                )
            runs.append(summary)
        arms.append(ArmResult(**entry, runs=runs))
    return index.get("plan", {}), arms


def _names(loss: bool) -> tuple[str, str, str, str]:
    """The score in words, its evaluation key, and its best and final summary keys."""
    if loss:
        return "eval loss", "eval_loss", "best_eval_loss", "final_eval_loss"
    return "accuracy", "eval_accuracy", "best_accuracy", "final_accuracy"


def _mean_std_text(values: list[Any], digits: int) -> str:
    mean, std = mean_std(values)
    if math.isnan(mean):
        return "—"
    counted = sum(v is not None and math.isfinite(v) for v in values)
    text = f"{mean:,.{digits}f}" if counted == 1 else f"{mean:,.{digits}f} ± {std:,.{digits}f}"
    # a seed that diverged (or missed) is not in the mean: say how many are
    return text if counted == len(values) else f"{text} ({counted} of {len(values)} seeds)"


def _no_score(runs: list[dict[str, Any]], key: str) -> str:
    # why an arm has no score on any seed (each run diverged, say), or nothing
    if any(r.get(key) is not None for r in runs):
        return ""
    ends = sorted({str(r.get("ended")) for r in runs})
    return f"; no score on any seed (ended: {', '.join(ends)})"


def _every_mean(values: list[Any]) -> float | None:
    """The seeds' mean where every seed has a value (steps to a target: each reached it)."""
    return mean_std(values)[0] if values and all(v is not None for v in values) else None


def _axis(plan: dict[str, Any], arms: list[ArmResult]) -> str | None:
    """The varied key to draw against: numeric, three values at least, a quantity (not the
    seed, which names a draw); the batch first."""
    numeric = []
    for key in plan.get("varied", []):
        if key == "seed":
            continue
        values = {a.overrides.get(key) for a in arms}
        if len(values) >= 3 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in values
        ):
            numeric.append(key)
    if "batch.initial" in numeric:
        return "batch.initial"
    return numeric[-1] if numeric else None


#: the arm table's columns past the chosen rate and the steps to the target: summary key,
#: digits, heading; the last three only where the runs logged them (the training accuracy
#: where the training set was cut, the attention logit on a transformer: MERIT's claim)
COLUMNS = [
    ("samples_to_target", 0, "samples to target"),
    ("steps", 0, "steps"),
    ("avg_batch_size", 0, "average batch"),
    ("wall_seconds", 0, "wall s"),
    ("final_train_accuracy", 4, "final train accuracy"),
    ("generalization_gap", 4, "gap (train − test)"),
    ("max_attention_logit", 2, "largest attention logit"),
]


def render(root: Path) -> Path:
    """A table of every arm (seed mean ± std at its chosen rate), curves, and the Pareto front;
    against a numeric varied key, the score and the steps to the target, with the critical batch.
    """
    root = Path(root)
    plan, arms = _read_comparison(root)
    loss = bool(arms) and arms[0].runs[0].get("target_metric", "").endswith("loss")
    score, key, best, final = _names(loss)
    _plot_curves(root, arms, key, score)
    _plot_pareto(root, arms, loss)
    lines = ["# Comparison", ""]
    if arms:
        first = arms[0].runs[0]
        target = first.get("target_metric", "").removeprefix("eval_")
        grid = plan.get("lr_grid", [1.0])
        if plan.get("tune"):
            how = (
                f"Each arm's rate searched by `bigbatch tune` from its rate × {min(grid)} to "
                f"× {max(grid)}, chosen by the final {score}"
            )
        else:
            widened = plan.get("widen", 0)
            how = (
                f"Each arm at its rate × {grid}"
                # (the multipliers as given: the rates each arm trained are in its row)
                + (f", widened by up to {widened} at an end holding the best," * bool(widened))
                + f" on the first seed, ranked by {plan.get('rank', 'best')}"
            )
        lines += [
            f"Task {first.get('task')}; target {target} {first.get('target', math.nan):g}. "
            f"{how}; the chosen rate on {plan.get('seeds', 1)} seed(s), mean ± std.",
            "",
        ]
    columns = list(COLUMNS[:4])
    columns += [c for c in COLUMNS[4:] if any(c[0] in r for a in arms for r in a.runs)]
    rows = []
    for arm in arms:
        reached = [s for s in arm.values("steps_to_target") if s is not None]
        grid = ", ".join(f"{r:.3g}" for r in arm.lrs)
        if arm.tuned:
            grid = f"tuned: {arm.tuned['trials']} trials, {arm.tuned['cost']:.0%} of the grid"
        ceiling = f" ≤ {arm.lr_max:.3g}" if arm.lr_max else ""
        rows.append(
            [
                arm.name,
                f"{arm.lr:.3g}{ceiling} ({grid}){_no_score(arm.runs, best)}",
                _mean_std_text(arm.values(best), 4),
                _mean_std_text(arm.values(final), 4),
                f"{_mean_std_text(reached, 0)} ({len(reached)}/{len(arm.runs)})",
                *(_mean_std_text(arm.values(k), digits) for k, digits, _ in columns),
            ]
        )
    header = ["arm", "lr (grid)", f"best {score}", f"final {score}", "steps to target"]
    lines += table([*header, *(title for _, _, title in columns)], rows)
    lines += ["", f"![test {score} vs samples and steps](curves.png)", ""]
    lines += [f"![average batch vs best {score}](pareto.png)", ""]
    lines += _near_best(root, arms, loss)
    lines += _rate_grid(root, arms, loss)
    lines += _judged_early(root, arms, plan["prefixes"], loss)
    axis = _axis(plan, arms)
    if axis is not None:
        lines += _by_axis(root, arms, axis, loss)
    path = root / "report.md"
    path.write_text("\n".join(lines))
    return path


#: how far from the best arm's final score a run may end and still count as there: the
#: evidence protocol's tolerance (0.01 nats; 0.1 accuracy points)
NEAR_BEST = {"loss": 0.01, "accuracy": 0.001}


def _near_best(root: Path, arms: list[ArmResult], loss: bool) -> list[str]:
    """Optimizer steps to ``T`` = the best arm's final score (seed mean) within
    :data:`NEAR_BEST`, per arm, and each against the fewest: the claim that a batch
    schedule keeps the best final quality in fewer steps, read from the runs. Draws
    ``steps_final.png``: each arm's steps against its final score."""
    score, key, _, final = _names(loss)
    means = {a.name: mean_std(a.values(final))[0] for a in arms}
    finite = [m for m in means.values() if math.isfinite(m)]
    if not finite:
        return []
    best = min(finite) if loss else max(finite)
    tolerance = NEAR_BEST["loss" if loss else "accuracy"]
    target = best + tolerance if loss else best - tolerance
    what = f"the best arm's final {score} {'+' if loss else '−'} {tolerance:g}"
    stopped = {r.get("target") for a in arms for r in a.runs if r.get("ended") == "target"}
    if len(stopped) == 1 and None not in stopped:
        # a run that stops at its target ends there: its final score says where it stopped
        # (by how much an evaluation overshot), not how good it got, so T is that target
        target = stopped.pop()
        what = f"the runs' own target (they stop there: a final {score} is where one stopped)"
    # each seed's evaluation rows, and its wall-clock to T (runs that shared the machine slow
    # each other; a reused run keeps the time of the call that trained it)
    evals = {
        a.name: [[r for r in read_metrics(root / d) if key in r] for d in a.dirs] for a in arms
    }
    reached: dict[str, list[int | None]] = {}
    seconds: dict[str, list[float | None]] = {}
    for name, runs in evals.items():
        hits = [first_reaching(rows, target, key, loss) for rows in runs]
        reached[name] = [h and h[0] for h in hits]
        seconds[name] = [h and _wall_at(rows, h[0]) for rows, h in zip(runs, hits)]
    every = [m for m in map(_every_mean, reached.values()) if m is not None]
    fewest = min(every, default=math.nan)
    _plot_steps_final(root, arms, final, score)
    rows = []
    for arm in arms:
        got = [x for x in reached[arm.name] if x is not None]
        mean = _every_mean(reached[arm.name])
        rows.append(
            [
                arm.name,
                _mean_std_text(arm.values(final), 4),
                f"{means[arm.name] - best:+.4f}" if math.isfinite(means[arm.name]) else "—",
                f"{_mean_std_text(got, 0)} ({len(got)}/{len(reached[arm.name])})",
                f"{mean / fewest:.2f}" if mean is not None and fewest > 0 else "—",
                _mean_std_text([t for t in seconds[arm.name] if t is not None], 0),
            ]
        )
    header = ["arm", f"final {score}", "against the best", "steps to T", "× the fewest"]
    return [
        f"Steps to T = {target:.4g}, {what} (seed means; a ratio only where every seed reached T):",
        "",
        *table([*header, "wall s to T"], rows),
        "",
        f"![optimizer steps vs final {score}](steps_final.png)",
        "",
        *_at_targets(evals, arms, target, key, loss),
    ]


def _gridded(arms: list[ArmResult]) -> list[ArmResult]:
    """The arms with a run at every rate of a grid (not a comparison saved before the grid's
    runs were, nor a tuned rate)."""
    return [a for a in arms if len(a.grid_dirs) == len(a.lrs) >= 2]


def _grid_cells(arm: ArmResult, values: list[Any], mark: int | None, own: Any = None) -> str:
    """Each rate of ``arm``'s grid with its value, ``*`` at ``mark``, ``°`` at ``own``."""
    return ", ".join(
        f"{lr:.4g}{'°' if i == own else ''}: "
        f"{'—' if v is None else f'{v:.4f}'}{'*' if i == mark else ''}"
        for i, (lr, v) in enumerate(zip(arm.lrs, values))
    )


def _section(intro: str, header: list[str], rows: list[list[str]]) -> list[str]:
    """A paragraph and its table, or nothing where the table has no rows."""
    return [intro, "", *table(header, rows), ""] if rows else []


def _rate_grid(root: Path, arms: list[ArmResult], loss: bool) -> list[str]:
    """Each arm's final score at every rate of its grid (first seed; ``*`` the chosen rate,
    ``°`` its own, × 1: what its settings give a user who tunes nothing, e.g. an
    optimizer's recipe) and how far its own rate ends from the chosen one."""
    score, _, _, final = _names(loss)
    rows = []
    for arm in _gridded(arms):
        finals = [(finished_summary(root / d) or {}).get(final) for d in arm.grid_dirs]
        own = finals[arm.own] if arm.own is not None else None
        chosen = finals[arm.chosen]
        edge = " (the chosen rate is an end of the grid)" if arm.at_edge else ""
        mark = arm.chosen
        if all(v is None for v in finals):  # every rate diverged: none was chosen
            mark, edge = None, " (no rate gave a score)"
        rows.append(
            [
                arm.name,
                _grid_cells(arm, finals, mark, arm.own) + edge,
                f"{own - chosen:+.4f}" if own is not None and chosen is not None else "—",
            ]
        )
    return _section(
        f"Final {score} at each rate of the grid (first seed; * chosen, ° the arm's own "
        "rate, × 1):",
        ["arm", "rate: final", "own − chosen"],
        rows,
    )


def _judged_early(
    root: Path, arms: list[ArmResult], fractions: list[float], loss: bool
) -> list[str]:
    """Each arm's rate grid judged at ``fractions`` of its runs (first seed): the rate that
    leads there against the one the whole runs chose. A tuner that stops runs early ranks
    them so, with the schedule laid over the whole budget (the short-horizon bias)."""
    score, key, _, _ = _names(loss)
    rows = []
    for arm in _gridded(arms) if fractions else []:
        dirs = [root / d for d in arm.grid_dirs]
        # the schedule spans the budget: a fraction of it, as the tuner pauses
        budgets = [load_toml(d / "config.toml")["max_samples"] for d in dirs]
        curves = [([r for r in read_metrics(d) if key in r], b) for d, b in zip(dirs, budgets)]
        for fraction in fractions:
            scores = [_score_at(curve, fraction * budget, key) for curve, budget in curves]
            finite = [i for i, v in enumerate(scores) if v is not None and math.isfinite(v)]
            lead = min(finite, key=lambda i: scores[i] if loss else -scores[i], default=None)
            if lead is not None and sum(scores[i] == scores[lead] for i in finite) > 1:
                lead = None  # tied (before any training, every rate scores alike): none leads
            ratio = "—" if lead is None else f"× {arm.lrs[lead] / arm.lr:.3g}"
            rows.append([arm.name, f"{fraction:.3g}", _grid_cells(arm, scores, lead), ratio])
    return _section(
        f"The rate grid judged early: each rate's {score} at a fraction of its run (first "
        "seed; * leads there), and the leader against the rate the whole runs chose:",
        ["arm", "fraction of the run", "rate: score there", "leader ÷ chosen"],
        rows,
    )


def _score_at(curve: list[dict[str, Any]], samples: float, key: str) -> float | None:
    """The last evaluation at or before ``samples`` (None: none yet)."""
    before = [row[key] for row in curve if row["samples"] <= samples]
    return before[-1] if before else None


def _wall_at(rows: list[dict[str, Any]], step: int) -> float | None:
    """The wall-clock seconds a run had trained when it logged ``step`` (None: not logged)."""
    return next((r.get("wall_seconds") for r in rows if r["step"] == step), None)


#: how far from the first evaluation to T each target of the looser-targets table lies
TARGET_FRACTIONS = (0.5, 0.75, 0.9, 0.95, 0.99, 1.0)


def _static(arm: ArmResult) -> bool:
    return str(arm.runs[0].get("controller", "")).startswith("Constant(")


def _at_targets(
    evals: dict[str, list[list[dict[str, Any]]]],
    arms: list[ArmResult],
    target: float,
    key: str,
    loss: bool,
) -> list[str]:
    """Steps to targets from halfway to T (fractions of the way from the first evaluation,
    seed means): each arm's mean steps and, where every seed got there, the ratio to the
    fewest steps of a static batch (of any arm, where no arm is static) that got there on
    every seed; the claim that a schedule saves steps at every loss, not only at the end."""
    # from the arms that trained (a diverged arm's first evaluation can be 1e18 or NaN)
    final = _names(loss)[3]
    trained = {a.name for a in arms if math.isfinite(mean_std(a.values(final))[0])}
    firsts = [
        runs[0][0][key]
        for name, runs in evals.items()
        if name in trained and runs and runs[0] and math.isfinite(runs[0][0][key])
    ]
    if not firsts:
        return []
    start = statistics.fmean(firsts)
    values = targets_between(start, target, TARGET_FRACTIONS)
    steps = {
        name: [
            [h and h[0] for h in (first_reaching(run, v, key, loss) for run in runs)]
            for v in values
        ]
        for name, runs in evals.items()
    }
    means = {name: [_every_mean(hits) for hits in per] for name, per in steps.items()}
    reference = [a for a in arms if _static(a)] or arms
    fewest = [
        min((means[a.name][i] for a in reference if means[a.name][i]), default=None)
        for i in range(len(values))
    ]
    rows = []
    for arm in arms:
        cells = [arm.name]
        for mean, hits, low in zip(means[arm.name], steps[arm.name], fewest):
            if mean is None:
                cells.append(f"{sum(h is not None for h in hits)}/{len(hits)} reached")
            else:
                cells.append(f"{mean:,.0f}" + (f" ({mean / low:.2f}×)" if low else ""))
        rows.append(cells)
    which = "a static batch" if reference is not arms else "an arm"
    return _section(
        f"Steps to targets on the way from the first evaluation ({start:.4g}) to T "
        f"(seed means; × the fewest of {which} that reached it on every seed):",
        ["arm", *(f"{f:.0%}: {v:.4g}" for f, v in zip(TARGET_FRACTIONS, values))],
        rows,
    )


def _plot_steps_final(root: Path, arms: list[ArmResult], final: str, score: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    spans = []
    for arm in arms:
        steps, _ = mean_std(arm.values("steps"))
        value, error = mean_std(arm.values(final))
        ax.errorbar([steps], [value], yerr=[error], marker="o", capsize=3)
        ax.annotate(arm.name, (steps, value), fontsize=7)
        spans.append(steps)
    finite = [s for s in spans if math.isfinite(s) and s > 0]
    if finite and max(finite) > 3 * min(finite):  # a log axis only where it spans enough
        ax.set_xscale("log")
    ax.set_xlabel("optimizer steps (seed mean)")
    ax.set_ylabel(f"final test {score} (seed mean ± std)")
    save(fig, root / "steps_final.png")


def _plot_curves(root: Path, arms: list[ArmResult], key: str, score: str) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for arm in arms:
        rows = read_metrics(root / arm.dirs[0])
        for ax, x in zip(axes, ("samples", "step")):
            ax.plot(*series(rows, x, key), marker=".", label=arm.name)
    for ax, x in zip(axes, ("samples", "optimizer steps")):
        ax.set_xlabel(x)
        ax.set_xscale("log")
        ax.set_ylabel(f"test {score} (first seed)")
    if arms:
        axes[0].legend(fontsize=7)
    save(fig, root / "curves.png")


def _plot_pareto(root: Path, arms: list[ArmResult], loss: bool) -> None:
    score, _, best, _ = _names(loss)
    fig, ax = plt.subplots(figsize=(6, 4))
    points = [(mean_std(a.values("avg_batch_size"))[0], mean_std(a.values(best))[0]) for a in arms]
    named = [(arm, p) for arm, p in zip(arms, points) if all(map(math.isfinite, p))]
    arms, points = [arm for arm, _ in named], [p for _, p in named]  # a diverged arm: no point
    for arm, (b, a) in zip(arms, points):
        ax.scatter([b], [a])
        ax.annotate(arm.name, (b, a), fontsize=7)
    signed = [(b, -a if loss else a) for b, a in points]
    front = [(b, -a if loss else a) for b, a in pareto_front(signed)]
    ax.plot([p[0] for p in front], [p[1] for p in front], "k--", lw=0.8, label="Pareto front")
    if points:  # a log axis with no data cannot be drawn
        ax.set_xscale("log")
    ax.set_xlabel("average batch size (samples / steps)")
    ax.set_ylabel(f"best test {score} (seed mean)")
    ax.legend()
    save(fig, root / "pareto.png")


def _joined_with(arms: list[ArmResult], axis: str) -> set[str]:
    # `axis` and the keys whose values go one to one with its values over the arms
    joined = {axis}
    for key in {k for a in arms for k in a.overrides} - joined:
        pairs = {(a.overrides[axis], a.overrides.get(key)) for a in arms}
        if len({x for x, _ in pairs}) == len(pairs) == len({y for _, y in pairs}) > 1:
            joined.add(key)
    return joined


def _by_axis(root: Path, arms: list[ArmResult], axis: str, loss: bool) -> list[str]:
    """The score and the steps to the target against ``axis``, one curve per other setting;
    against the batch, each curve's critical batch."""
    curves: dict[str, list[ArmResult]] = {}
    along = _joined_with(arms, axis)
    for arm in sorted(arms, key=lambda a: a.overrides[axis]):
        # the arm's name less the axis's value and the keys varied with it (a `+` axis):
        # an arm written out (--arm) and the other varied keys each make their own curve
        point = {f"{k}={arm.overrides[k]}" for k in along}
        label = ", ".join(p for p in arm.name.split(", ") if p not in point) or "all"
        curves.setdefault(label, []).append(arm)
    fits = _critical_batches(curves, axis) if axis == "batch.initial" else {}
    score = _names(loss)[0]
    name = _plot_by_axis(root, curves, axis, fits, loss)
    lines = [f"![best {score} and steps to the target against {axis}]({name})", ""]
    rows = []
    for label, (fit, per_seed) in fits.items():
        at = []
        for arm in curves[label]:
            steps = arm.values("steps_to_target")
            mean = _every_mean(steps)
            reached = f"reached {sum(s is not None for s in steps)}/{len(steps)}"
            at.append(f"{arm.overrides[axis]:g}: {reached if mean is None else f'{mean:,.0f}'}")
        seeds = ", ".join(own.text() for own in per_seed) or "—"
        rows.append([label, f"{fit.floor:,.0f}", fit.text(), seeds, ", ".join(at)])
    return lines + _section(
        "Critical batch: the fit of steps ≈ S_min · (1 + B_crit / B) to the steps to the "
        "target (McCandlish et al. 2018) over the batches every seed reached it at (seed "
        "means; then each seed's own fit); at B_crit the steps are twice their floor, and "
        "doubling the batch beyond it saves less than a third of them.",
        ["curve", "S_min", "B_crit", "B_crit of each seed", "steps at each batch"],
        rows,
    )


def _steps_curve(members: list[ArmResult], axis: str) -> list[tuple[float, float]]:
    """``(axis value, mean steps to the target)`` of the members every seed of which
    reached the target."""
    means = [(a.overrides[axis], _every_mean(a.values("steps_to_target"))) for a in members]
    return [(x, m) for x, m in means if m is not None]


class _Fit(NamedTuple):
    # steps ≈ floor · (1 + critical / B), fitted on the batches `fitted`
    floor: float
    critical: float
    fitted: list[float]

    def text(self) -> str:
        # beyond the batches fitted on, the fit says only which side: not the arms' bounds
        if math.isinf(self.critical):
            return f"> {max(self.fitted):g} (no floor yet)"
        if self.critical == 0:
            return f"< {min(self.fitted):g}"
        return f"{self.critical:,.0f}"


def _fit(points: list[tuple[float, float]]) -> _Fit:
    return _Fit(*fit_critical_batch(points), [b for b, _ in points])


def _critical_batches(
    curves: dict[str, list[ArmResult]], axis: str
) -> dict[str, tuple[_Fit, list[_Fit]]]:
    """Per curve with three batches reached by every seed: the fit to the seed means, and
    each seed's own fit where that seed reached three batches."""
    fits = {}
    for label, members in curves.items():
        means = _steps_curve(members, axis)
        if len(means) < 3:
            continue
        steps = [(a.overrides[axis], a.values("steps_to_target")) for a in members]
        per_seed = []
        for seed in range(min(len(s) for _, s in steps)):
            points = [(b, s[seed]) for b, s in steps if s[seed] is not None]
            if len(points) >= 3:
                per_seed.append(_fit(points))
        fits[label] = (_fit(means), per_seed)
    return fits


def _plot_by_axis(
    root: Path,
    curves: dict[str, list[ArmResult]],
    axis: str,
    fits: dict[str, tuple[_Fit, list[_Fit]]],
    loss: bool,
) -> str:
    score, _, best, _ = _names(loss)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for label, members in curves.items():
        xs = [a.overrides[axis] for a in members]
        stats = [mean_std(a.values(best)) for a in members]
        left.errorbar(
            xs, [s[0] for s in stats], yerr=[s[1] for s in stats], marker="o", label=label
        )
        points = _steps_curve(members, axis)
        if not points:
            continue
        line = right.plot(*zip(*points), marker="o", label=label)[0]
        fit = fits[label][0] if label in fits else None
        if fit is not None and 0 < fit.critical < math.inf:
            grid = np.geomspace(points[0][0], points[-1][0], 50)
            right.plot(grid, fit.floor * (1 + fit.critical / grid), "--", color=line.get_color())
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel(axis)
    left.set_ylabel(f"best test {score} (seed mean ± std)")
    right.set_yscale("log")
    # (a label longer than the axis is cut at the figure's edges)
    right.set_ylabel("optimizer steps to the target")
    right.set_title("seed mean; dashed: the fit", fontsize=9)
    left.legend(fontsize=7)
    name = f"by_{axis.replace('.', '_')}.png"
    save(fig, root / name)
    return name
