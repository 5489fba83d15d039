"""Tuned comparisons: every arm gets the same learning-rate grid, and its best rate more seeds.

One rate for all favours the arm it was tuned for, so every arm trains at its own rate
(``lr``, or the task's for the arm's optimizer and rule) times each multiplier of a grid
on the first seed; the grid run that ranks best (:data:`RANKS`) gives its rate, trained
again on the further seeds. Each run is one process and one directory,
``<stem>-lr<i>-seed<s>``; one holding a ``summary.json`` is reused, so a killed sweep
continues. ``bigbatch compare`` and ``benchmarks/`` run through :func:`sweep`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import runner
from .arms import RANKS, Arm, ArmResult, metric
from .config import resolve
from .device import share_of_cores
from .options import Protocol, TuneSettings
from .plan import at_rate, plan_run
from .pool import in_processes
from .rundir import read_json
from .summary import finished_summary

__all__ = ["RANKS", "Arm", "ArmResult", "metric", "sweep"]


def train_once(job: tuple[dict[str, Any], str, bool]) -> dict[str, Any]:
    """Train one config into its directory unless a finished run is there; return its summary."""
    config, out, quiet = job
    if not quiet and finished_summary(Path(out)) is None:
        print(f"[{Path(out).name}] lr {config['lr']:.4g}, seed {config['seed']}", flush=True)
    return runner.train_or_reuse(resolve(config), out, quiet=quiet)


def sweep(
    base: dict[str, Any],
    arms: Sequence[Arm],
    root: Path,
    protocol: Protocol | None = None,
    *,
    quiet: bool = True,
    tune: TuneSettings | None = None,
) -> list[ArmResult]:
    """Train every arm on the rate grid, then its best rate on more seeds (module docstring),
    as ``protocol`` (:class:`~bigbatch.experiments.options.Protocol`, whose fields' help
    says what each does; None: its defaults) says; ``tune`` is the settings of the studies
    a tuned protocol runs. ``base`` is a config layer under each arm's overrides; an arm's
    seeds start at its ``seed``, else the base's. Raises :class:`ConfigError` before
    training if any config is bad.
    """
    protocol = protocol or Protocol()
    if tune is not None and not protocol.tune:
        raise ValueError("sweep: tune settings are given, but the protocol does not tune")
    multipliers, seeds, rank, jobs = protocol.lr_grid, protocol.seeds, protocol.rank, protocol.jobs
    tune = (tune or TuneSettings()) if protocol.tune else None
    base = dict(base)
    if jobs > 1 and not base.get("threads"):
        base["threads"] = share_of_cores(jobs)
    root = Path(root)
    # an arm's rate before the grid: its lr, or the task's when 0 (every config checked here)
    rates = {arm.stem: plan_run({**base, **arm.overrides}).optimizer.lr for arm in arms}
    if tune is not None:
        return [
            _tuned_arm(base, arm, rates[arm.stem], root, multipliers, seeds, jobs, quiet, tune)
            for arm in arms
        ]
    grids = {arm.stem: {i: m for i, m in enumerate(multipliers)} for arm in arms}

    def job(arm: Arm, i: int, k: int = 0) -> tuple[dict[str, Any], str]:
        """Rate ``i`` of the arm's grid, on the ``k``-th seed after the arm's first."""
        seed, lr = first_seed(base, arm) + k, rates[arm.stem] * grids[arm.stem][i]
        return at_rate({**base, **arm.overrides, "seed": seed}, lr), _run_name(arm, i, seed)

    grid_jobs = [job(arm, i) for arm in arms for i in grids[arm.stem]]
    done = dict(zip((name for _, name in grid_jobs), _run(grid_jobs, root, jobs, quiet)))

    def best(arm: Arm) -> int:
        seed = first_seed(base, arm)
        scores = {i: RANKS[rank](done[_run_name(arm, i, seed)]) for i in grids[arm.stem]}
        top = min(scores.values())
        tied = [i for i in sorted(scores) if scores[i] == top]
        # among equal scores an end of the grid (the low one first), so that a plateau that
        # reaches an end widens the grid, or is reported at the end, rather than passing for
        # a rate with worse ones on both sides; else the lowest rate
        ends = [i for i in (tied[0], tied[-1]) if i in (min(scores), max(scores))]
        return ends[0] if ends else tied[0]

    for _ in range(protocol.widen):
        extra = [
            job(arm, i) for arm in arms if (i := _beyond(grids[arm.stem], best(arm))) is not None
        ]
        if not extra:
            break
        done.update(zip((name for _, name in extra), _run(extra, root, jobs, quiet)))
    chosen = {arm.stem: best(arm) for arm in arms}
    more = [job(arm, chosen[arm.stem], k) for arm in arms for k in range(1, seeds)]
    done.update(zip((name for _, name in more), _run(more, root, jobs, quiet)))
    return [
        _arm_result(
            arm,
            grids[arm.stem],
            rates[arm.stem],
            chosen[arm.stem],
            done,
            first_seed(base, arm),
            seeds,
            lr_max=job(arm, chosen[arm.stem])[0].get("lr_max", 0.0),
        )
        for arm in arms
    ]


def first_seed(base: dict[str, Any], arm: Arm) -> int:
    """An arm's first seed: its own ``seed`` (an arm may vary it), else the base's, else 0;
    its further seeds are the ones after it."""
    return int({**base, **arm.overrides}.get("seed", 0))


def _run_name(arm: Arm, i: int, seed: int) -> str:
    """A grid run's directory: the arm, the index of its rate in the grid, the seed."""
    return f"{arm.stem}-lr{i}-seed{seed}"


def _arm_result(
    arm: Arm,
    grid: dict[int, float],
    rate: float,
    pick: int,
    done: dict[str, dict[str, Any]],
    seed0: int,
    seeds: int,
    lr_max: float,
) -> ArmResult:
    """An arm's grid, its chosen rate and that rate's runs on every seed."""
    order = sorted(grid)
    names = [_run_name(arm, pick, seed0 + k) for k in range(seeds)]
    own = next((i for i in order if grid[i] == 1.0), None)
    return ArmResult(
        name=arm.name,
        overrides=dict(arm.overrides),
        lrs=[rate * grid[i] for i in order],
        chosen=order.index(pick),
        runs=[done[n] for n in names],
        dirs=names,
        lr_max=lr_max,
        grid_dirs=[_run_name(arm, i, seed0) for i in order],
        own=None if own is None else order.index(own),
    )


def _tuned_arm(  # noqa: PLR0913 - sweep's settings, passed on
    base: dict[str, Any],
    arm: Arm,
    rate: float,
    root: Path,
    multipliers: Sequence[float],
    seeds: int,
    jobs: int,
    quiet: bool,
    settings: TuneSettings,
) -> ArmResult:
    """An arm whose rate a ``bigbatch tune`` study chose over the grid's range (in
    ``<stem>-tune``); the study's best run is the first seed's."""
    from .tune import Dimension, tune  # the tune extra (Optuna), only when asked for

    seed = first_seed(base, arm)
    space = [Dimension("lr", rate * min(multipliers), rate * max(multipliers), log=True)]
    study = tune(
        {**base, **arm.overrides, "seed": seed},
        root / f"{arm.stem}-tune",
        space,
        dataclasses.replace(settings, jobs=jobs),
        quiet,
    )
    lr = study.best["lr"]
    # as the study trains its trials (the first seed's run among them): to the end
    arm_config = {**base, **arm.overrides, "stop_at_target": False}
    more = [
        (at_rate({**arm_config, "seed": seed + k}, lr), f"{arm.stem}-tuned-seed{k}")
        for k in range(1, seeds)
    ]
    best_run = read_json(study.best_dir / "summary.json")
    return ArmResult(
        name=arm.name,
        overrides=dict(arm.overrides),
        lrs=[lr],
        chosen=0,
        runs=[best_run, *_run(more, root, jobs, quiet)],
        dirs=[str(study.best_dir.relative_to(root)), *(name for _, name in more)],
        tuned={"trials": len(study.trials), "cost": study.cost},
        lr_max=at_rate({**arm_config, "seed": seed}, lr).get("lr_max", 0.0),
    )


def _beyond(grid: dict[int, float], best: int) -> int | None:
    """Add the grid point past ``best`` if ``best`` is an end of ``grid`` (the ratio of
    the two outer points further); return its index, or None when ``best`` is inside."""
    low, high = min(grid), max(grid)
    if len(grid) < 2 or low < best < high:
        return None
    if best == high:
        grid[high + 1] = grid[high] * grid[high] / grid[high - 1]
        return high + 1
    grid[low - 1] = grid[low] * grid[low] / grid[low + 1]
    return low - 1


def _run(
    jobs: list[tuple[dict[str, Any], str]], root: Path, workers: int, quiet: bool
) -> list[dict[str, Any]]:
    """Each ``(config, name)`` into ``root / name``, ``workers`` processes at a time."""
    return in_processes(train_once, [(c, str(root / name), quiet) for c, name in jobs], workers)
