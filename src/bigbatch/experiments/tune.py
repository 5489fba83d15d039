"""``bigbatch tune``: a multi-fidelity search of the rate (and any number key) on Optuna.

Each trial is an ordinary run under ``trials/``, searched by successive halving in
brackets (Jamieson & Talwalkar 2016, arXiv 1502.07943; Hyperband, Li et al. 2018,
arXiv 1603.06560): a bracket starts ``trials`` runs, pauses each at the lowest fidelity
and lets the best ``1/reduction`` continue to the next. A fidelity is the first samples
of the full run, on the full run's schedule (a compressed schedule favours large rates:
Wu et al. 2018, arXiv 1803.02021), and a survivor continues from its checkpoint. The
first bracket is a Latin hypercube, later ones TPE (Bergstra et al. 2011). The study
lives in SQLite, so a killed ``tune`` continues; docs/tuning.md.
"""

# every decision is remade from the study; writes best.toml, tune.md and tune.png

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import optuna
from optuna.trial import FrozenTrial, TrialState

from . import runner
from .arms import metric
from .build import check_batches_fit
from .config import ConfigError, resolve, schema, to_toml
from .device import share_of_cores
from .options import TuneSettings
from .plan import RunPlan, at_rate, plan_run, unread_by
from .pool import Processes
from .rundir import claim_plan, first_line, read_json
from .signals import stops_as_a_whole
from .tasks import TASKS

__all__ = [
    "Dimension",
    "TuneResult",
    "TuneSettings",
    "default_space",
    "latin_hypercube",
    "parse_dimension",
    "parse_space",
    "tune",
]

STUDY = "bigbatch"
SETTINGS_FILE = "tune.json"


@dataclass(frozen=True)
class Dimension:
    """One searched config key: its range, on a log scale or not."""

    key: str
    low: float
    high: float
    log: bool = False

    def suggest(self, trial: optuna.Trial) -> float | int:
        if schema()[self.key].kind is int:
            return trial.suggest_int(self.key, int(self.low), int(self.high), log=self.log)
        return trial.suggest_float(self.key, self.low, self.high, log=self.log)

    def grid_points(self) -> int:
        """Points of the ×2 grid (log) or the 5-point grid (linear) over this range: what a
        hand grid would train, for the cost comparison."""
        return math.floor(math.log2(self.high / self.low) + 1e-9) + 1 if self.log else 5


def parse_dimension(text: str, base: dict[str, Any]) -> Dimension:
    """``KEY=LOW:HIGH`` or ``KEY=LOW:HIGH:log``, checked: a number key of the schema, both
    ends valid values of it, LOW < HIGH, LOW > 0 on a log scale."""
    match = re.fullmatch(r"\s*([\w.]+)\s*=\s*([^:]+):([^:]+?)(:log)?\s*", text)
    if match is None:
        raise ConfigError(f"--search takes KEY=LOW:HIGH or KEY=LOW:HIGH:log, got {text!r}")
    key, low_text, high_text, log = match.groups()
    try:
        low, high = float(low_text), float(high_text)
    except ValueError:
        raise ConfigError(f"--search {key}: the range must be two numbers, got {text!r}") from None
    known = schema()
    if key not in known:
        resolve(base, {key: low})  # one error, with a suggestion
    if known[key].kind not in (int, float) or known[key].knob.choices:
        raise ConfigError(f"--search {key}: only number keys can be searched")
    if key == "max_samples":  # (the pauses and the grid's cost were the base budget's)
        raise ConfigError(
            "--search max_samples: a study pauses and ranks its trials at fractions of one "
            "budget; set max_samples, and search the other keys"
        )
    # each end must be a value the key accepts, in this run, on its data
    ends = [plan_run(resolve(base, {key: known[key].kind(end)})) for end in (low, high)]
    check_batches_fit(ends)
    unread = unread_by(ends[-1], known[key])
    if unread is not None:
        raise ConfigError(f"--search {key}: {unread}: every trial would train the same run")
    if not low < high:
        raise ConfigError(f"--search {key}: LOW must be below HIGH, got {low:g}:{high:g}")
    if log and low <= 0:
        raise ConfigError(f"--search {key}: a log range needs LOW > 0, got {low:g}")
    return Dimension(key, low, high, bool(log))


def parse_space(texts: Sequence[str], base: dict[str, Any]) -> list[Dimension]:
    """Every ``--search`` range (:func:`parse_dimension`), each key once."""
    space = [parse_dimension(text, base) for text in texts]
    keys = [d.key for d in space]
    repeated = next((k for k in keys if keys.count(k) > 1), None)
    if repeated is not None:
        raise ConfigError(f"--search {repeated}: a key is searched twice")
    return space


def default_space(config: dict[str, Any]) -> list[Dimension]:
    """The rate from 1/8 to 8 times the task's rate for the run's optimizer and batch rule
    (seven points of a ×2 grid)."""
    rate = plan_run(config).optimizer.lr
    return [Dimension("lr", rate / 8, rate * 8, log=True)]


@dataclass
class TuneResult:
    """What a study found, and what it cost."""

    best: dict[str, float]
    best_value: float
    best_dir: Path
    samples: int
    #: the samples each trial's schedule spans (the run's ``max_samples``)
    budget: int
    grid_samples: int
    trials: list[dict[str, Any]]

    @property
    def cost(self) -> float:
        """The samples trained, as a fraction of the ×2 grid's."""
        return self.samples / self.grid_samples


def tune(
    config: dict[str, Any],
    out: Path,
    space: Sequence[Dimension] | None = None,
    settings: TuneSettings | None = None,
    quiet: bool = True,
) -> TuneResult:
    """Search ``space`` (default :func:`default_space`) for ``config``'s run; resumable.

    ``config`` is a config layer; every trial trains it with the trial's
    values. The folder ``out`` is new, or holds a study of the same config,
    space and settings (then it continues). Raises :class:`ConfigError`
    before any training if the budget does not cover one bracket (bad settings
    are refused when they are made).
    """
    settings = settings or TuneSettings()
    # trials are ranked by their quality at each pause: none may end early at the target
    config = resolve(config, {"stop_at_target": False})
    planned = plan_run(config)  # the study's run as configured: its rate, warm-up, budget
    check_batches_fit([planned])  # before the folder is claimed
    space = list(space or default_space(planned))
    brackets = _brackets_in_budget(settings, space, _warmup(planned, space))
    if settings.jobs > 1 and not config.get("threads"):
        config = {**config, "threads": share_of_cores(settings.jobs)}
    out = Path(out)
    plan = {"config": config, "space": [asdict(d) for d in space], **asdict(settings)}
    lock = claim_plan(out, SETTINGS_FILE, plan, "study", config_at="config", compared=_compared)
    try:
        study = _study(out, config)
        _fail_orphans(study)
        with stops_as_a_whole(out), Processes(settings.jobs) as processes:
            for bracket in range(brackets):
                _Bracket(study, out, planned, config, space, settings, bracket, quiet).run(
                    processes
                )
        result = _result(study, planned, space, out)
        _write_outputs(out, config, result, space)
        return result
    finally:
        lock.release()


def _fail_orphans(study: optuna.Study) -> None:
    """Trials a killed ``tune`` left outside every bracket: asked but not yet in a bracket,
    or queued but not yet asked. Failed, so that their points are asked again."""
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if "bracket" not in t.user_attrs:
            study.tell(t.number, state=TrialState.FAIL)
    for _ in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
        study.tell(study.ask(), state=TrialState.FAIL)


def _warmup(planned: RunPlan, space: Sequence[Dimension] = ()) -> float:
    """The longest warm-up a trial trains with, a fraction of its samples: the planned
    run's, or the top of its range where the warm-up is searched."""
    searched = [d.high for d in space if d.key == "schedule.warmup"]
    return max([float(planned.schedule.warmup), *searched])


def _brackets_in_budget(settings: TuneSettings, space: list[Dimension], warmup: float) -> int:
    if settings.budget is None:
        return settings.brackets
    allowed = settings.budget * _grid_runs(space)
    bracket = settings.bracket_runs(warmup)
    fit = math.floor(allowed / bracket + 1e-9)
    if fit < 1:
        raise ConfigError(
            f"budget {settings.budget:g} of the grid is {allowed:.2f} runs, less than one "
            f"bracket ({bracket:.2f} runs with pauses at "
            f"{', '.join(f'{r:.3g}' for r in settings.rungs(warmup))}): fewer trials"
        )
    return min(settings.brackets, fit)


def _compared(plan: dict[str, Any]) -> dict[str, Any]:
    """A study's plan less what may change between its sessions: the trials at a time, and
    the config keys a finished run may differ in and still be reused (the threads)."""
    config = {k: v for k, v in plan["config"].items() if k not in runner.REUSE_IGNORES}
    return {**{k: v for k, v in plan.items() if k != "jobs"}, "config": config}


def _study(out: Path, config: dict[str, Any], *, new: bool = True) -> optuna.Study:
    # the study in out (new: made where there is none), or one line naming its file
    from sqlalchemy.exc import SQLAlchemyError

    task, path = TASKS[config["task"]], out.resolve() / "study.db"
    if not new and not path.is_file():
        raise ConfigError(f"{path}: missing: the study's trials are in it")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        return optuna.create_study(
            study_name=STUDY,
            storage=f"sqlite:///{path}",
            load_if_exists=True,
            direction="minimize" if task.lower_is_better else "maximize",
        )
    except SQLAlchemyError as err:
        raise ConfigError(f"{path}: not a study's database ({first_line(err, 120)})") from None


class _Bracket:
    """One bracket of successive halving, decided again from what the study has stored."""

    def __init__(
        self,
        study: optuna.Study,
        out: Path,
        planned: RunPlan,
        config: dict[str, Any],
        space: list[Dimension],
        settings: TuneSettings,
        index: int,
        quiet: bool,
    ) -> None:
        self.study, self.out, self.config, self.space = study, out, config, space
        self.settings, self.index, self.quiet = settings, index, quiet
        self.planned, self.budget = planned, planned.run.max_samples
        task = planned.task
        self.target, self.lower_is_better = task.target_metric, task.lower_is_better

    def run(self, processes: Processes) -> None:
        self._start_trials()
        warmup = _warmup(self.planned, self.space)
        rungs, keep = self.settings.rungs(warmup), self.settings.survivors(warmup)
        for j, fidelity in enumerate(rungs):
            alive = [t for t in self._trials() if t.state != TrialState.FAIL]
            if j:  # ranked by the last rung, ties to the earlier trial
                mark = self._mark(rungs[j - 1])
                alive = sorted(
                    (t for t in alive if mark in t.intermediate_values),
                    key=lambda t, m=mark: (self._rank(t.intermediate_values[m]), t.number),
                )
            for t in alive[keep[j] :]:
                if t.state == TrialState.RUNNING:
                    self.study.tell(t.number, state=TrialState.PRUNED)
            todo = [t for t in alive[: keep[j]] if t.state == TrialState.RUNNING]
            todo = [t for t in todo if self._mark(fidelity) not in t.intermediate_values]
            if not self.quiet and todo:
                print(f"bracket {self.index}: {len(todo)} trials to {fidelity:.3g} of the run")
            self._advance(todo, fidelity, processes)

    def _trials(self) -> list[FrozenTrial]:
        return [
            t
            for t in self.study.get_trials(deepcopy=False)
            if t.user_attrs.get("bracket") == self.index
        ]

    def _mark(self, fidelity: float) -> int:
        """The step a fidelity is reported at: its samples."""
        return round(fidelity * self.budget)

    def _rank(self, value: float) -> float:
        return value if self.lower_is_better else -value

    def _start_trials(self) -> None:
        """Ask the study for this bracket's trials (once: a resumed bracket has them; one
        killed while asking gets the points it had not yet asked)."""
        trials = self._trials()
        missing = self.settings.trials - len(trials)
        if missing <= 0:
            return
        if self.index == 0:
            asked = [t.params for t in trials]
            points = latin_hypercube(self.space, self.settings.trials, self.settings.seed)
            for params in [p for p in points if p not in asked][:missing]:
                self.study.enqueue_trial(params)
        else:
            self.study.sampler = optuna.samplers.TPESampler(
                seed=self.settings.seed + self.index, n_startup_trials=0, constant_liar=True
            )
        for _ in range(missing):
            trial = self.study.ask()
            for d in self.space:
                d.suggest(trial)
            trial.set_user_attr("bracket", self.index)

    def _advance(self, trials: list[FrozenTrial], fidelity: float, processes: Processes) -> None:
        """Train each trial on (from its checkpoint) to ``fidelity``, and store what it did."""
        until = None if fidelity >= 1 else self._mark(fidelity)
        quiet = self.quiet or self.settings.jobs > 1  # one progress bar or none
        runs = self.out / "trials"
        jobs = [
            (trial_config(self.config, t.params), str(runs / f"{t.number:04d}"), until)
            for t in trials
        ]
        records = processes.map(_train_trial, [(*job, quiet) for job in jobs])
        for t, record in zip(trials, records):
            trial = optuna.trial.Trial(self.study, t._trial_id)  # a trial of this study, resumed
            trial.set_user_attr("samples", record.get("samples", 0))
            if "diverged" in record:  # a rate past stability: out of the bracket
                trial.set_user_attr("diverged", record["diverged"])
                self.study.tell(t.number, state=TrialState.FAIL)
            elif until is not None:
                # a trial's run that went on to its end (resumed by hand) reports that end
                value = record[self.target] if record.get("paused") else metric(record, "final")
                trial.report(value, self._mark(fidelity))
            else:
                trial.report(metric(record, "final"), self.budget)
                self.study.tell(t.number, metric(record, "final"))


def trial_config(config: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The config a trial trains: ``config`` with its values, a searched rate taking the
    task's ceiling along with it (:func:`~bigbatch.experiments.plan.at_rate`)."""
    rest = resolve(config, {k: v for k, v in params.items() if k != "lr"})
    return resolve(at_rate(rest, params["lr"])) if "lr" in params else rest


def latin_hypercube(space: Sequence[Dimension], n: int, seed: int) -> list[dict[str, float]]:
    """``n`` points that cover every dimension evenly: each dimension's range (log-scaled
    where it is) cut into ``n`` strata, one point in each, the strata paired at random."""
    rng = np.random.default_rng(seed)
    points: list[dict[str, float]] = [{} for _ in range(n)]
    for d in space:
        fractions = (rng.permutation(n) + rng.uniform(size=n)) / n
        for point, u in zip(points, fractions):
            if d.log:
                value = math.exp(math.log(d.low) + u * (math.log(d.high) - math.log(d.low)))
            else:
                value = d.low + u * (d.high - d.low)
            point[d.key] = round(value) if schema()[d.key].kind is int else float(value)
    return points


def _train_trial(job: tuple[dict[str, Any], str, int | None, bool]) -> dict[str, Any]:
    """Train a trial's run from where it stands to ``until`` samples (None: to the end)."""
    config, run_dir, until, quiet = job
    return runner.train_or_reuse(config, run_dir, until=until, quiet=quiet)


def _grid_runs(space: Sequence[Dimension]) -> int:
    """The runs of the ×2 grid (5-point on a linear range) over ``space``."""
    return math.prod(d.grid_points() for d in space)


def _result(study: optuna.Study, planned: RunPlan, space: list[Dimension], out: Path) -> TuneResult:
    # a bracket's trials: not the orphans a kill left (_fail_orphans), which no bracket ran
    trials = [t for t in study.get_trials(deepcopy=False) if "bracket" in t.user_attrs]
    if not any(t.state == TrialState.COMPLETE for t in trials):
        if trials and all("diverged" in t.user_attrs for t in trials):
            raise ConfigError("no trial trained to the end: every one diverged; lower the range")
        raise ConfigError(
            f"no trial of {out} has trained to the end yet: run the same tune command "
            f"again (--out {out}) to continue it"
        )
    best = study.best_trial
    rows = [
        {
            "number": t.number,
            "bracket": t.user_attrs.get("bracket"),
            "state": t.state.name.lower(),
            "params": dict(t.params),
            "samples": t.user_attrs.get("samples", 0),
            "value": t.value,
            "last": t.intermediate_values[max(t.intermediate_values)]
            if t.intermediate_values
            else None,
            "curve": sorted(t.intermediate_values.items()),
            "diverged": t.user_attrs.get("diverged"),
        }
        for t in trials
    ]
    return TuneResult(
        best=dict(best.params),
        best_value=float(best.value),
        best_dir=out / "trials" / f"{best.number:04d}",
        samples=sum(t.user_attrs.get("samples", 0) for t in trials),
        budget=planned.run.max_samples,
        grid_samples=_grid_runs(space) * planned.run.max_samples,
        trials=rows,
    )


def render_report(out: Path) -> Path:
    """``tune.md``, ``tune.png`` and ``best.toml`` again, from a study's folder (its
    ``tune.json`` and the study's database); the report's path."""
    saved = read_json(out / SETTINGS_FILE)
    config, space = saved["config"], [Dimension(**d) for d in saved["space"]]
    result = _result(_study(out, config, new=False), plan_run(config), space, out)
    _write_outputs(out, config, result, space)
    return out / "tune.md"


def _write_outputs(
    out: Path, config: dict[str, Any], result: TuneResult, space: list[Dimension]
) -> None:
    from .report.tuning import markdown, plot

    (out / "best.toml").write_text(to_toml(trial_config(config, result.best)))
    (out / "tune.md").write_text(markdown(config, result, space))
    plot(out / "tune.png", config, result, space)
