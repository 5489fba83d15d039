"""``bigbatch compare``: a grid of arms, each tuned the same way, and one report.

The arms are every ``--arm NAME:KEY=V,...`` (or ``[[compare.arms]]`` table) times every
combination of the ``--vary KEY=V1,V2,...`` axes (keys joined by ``+`` vary together).
Each arm trains through :func:`bigbatch.experiments.sweep.sweep`: the rate grid on the
first seed, the best (``rank``) on ``seeds`` seeds. The directory holds ``compare.json``
(the plan and each arm's choice), a directory per run and the report; the same command
into it again continues it. ``examples/recipes/`` and ``benchmarks/studies/`` hold
study files.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .build import check_batches_fit
from .config import ConfigError, flatten, parse_assignment, resolve
from .flags import settings_from
from .options import Protocol, TuneSettings
from .plan import plan_run
from .report import comparison as comparison_report
from .rundir import claim_plan, new_run_dir, write_atomically
from .signals import stops_as_a_whole
from .sweep import Arm, sweep

#: the [compare] table's names that give the arms rather than how each is tuned
ARM_OPTIONS = ("vary", "arms")


@dataclass(frozen=True)
class Comparison:
    """A checked plan: the base config, the arms, and how each is tuned."""

    base: dict[str, Any]
    varied: list[str]
    arms: list[Arm]
    protocol: Protocol

    def to_dict(self) -> dict[str, Any]:
        """The plan as ``compare.json`` saves it: every protocol option but the runs at a
        time (which may change between sessions), the base and the arms."""
        protocol = {
            k: list(v) if isinstance(v, tuple) else v
            for k, v in asdict(self.protocol).items()
            if k != "jobs"
        }
        arms = [{"name": a.name, "overrides": a.overrides, "stem": a.stem} for a in self.arms]
        return {"varied": self.varied, **protocol, "base": self.base, "arms": arms}


def parse_axis(text: str) -> tuple[list[str], list[dict[str, Any]]]:
    """``KEY=V1,V2`` or ``K1+K2=A1+B1,A2+B2``: the keys and each point's overrides."""
    keys_text, sep, values = text.partition("=")
    if not sep or not values.strip() or not keys_text.strip():
        raise ConfigError(f"--vary takes KEY=V1,V2,... (or K1+K2=A1+B1,...), got {text!r}")
    keys = [k.strip() for k in keys_text.split("+")]
    points = []
    for value in values.split(","):
        parts = value.split("+") if len(keys) > 1 else [value]
        if len(parts) != len(keys):
            raise ConfigError(
                f"--vary {keys_text}: {value!r} has {len(parts)} values for {len(keys)} keys"
            )
        point = dict(parse_assignment(f"{k}={v}") for k, v in zip(keys, parts))
        if point in points:  # the same runs twice under two names
            raise ConfigError(f"--vary {keys_text}: {value.strip()!r} is given twice")
        points.append(point)
    return keys, points


def parse_arm(spec: str | Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """An arm written out: ``NAME:KEY=V,...`` (``--arm``) or a table with ``name`` and config
    keys (``[[compare.arms]]``); its name and overrides."""
    if isinstance(spec, Mapping):
        settings = flatten(spec)
        name = settings.pop("name", None)
        pairs = list(settings.items())
    else:
        name, sep, text = str(spec).partition(":")
        if not sep:
            raise ConfigError(f"--arm takes NAME:KEY=V,..., got {spec!r}")
        parts = [part.strip() for part in text.split(",") if part.strip()]
        if bad := next((part for part in parts if "=" not in part), None):
            raise ConfigError(
                f"--arm {name}: {bad!r} is not KEY=V (--arm splits at commas: a value holding "
                "commas, such as batch.ramp_points, goes in a --config file's [[compare.arms]])"
            )
        pairs = [parse_assignment(part) for part in parts]
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"an arm needs a name, got {spec!r}")
    return name.strip(), dict(pairs)


def plan(base: dict[str, Any], **options: Any) -> Comparison:
    """The comparison of ``options`` over ``base``, checked: ``vary`` and ``arms`` give the
    arms, :class:`~bigbatch.experiments.options.Protocol`'s options how each is tuned.

    Every arm's config is resolved here, so a bad value stops the comparison
    before any run starts.
    """
    written = {k: options.pop(k) for k in ARM_OPTIONS if k in options}
    protocol = settings_from(Protocol, "compare", options, also=ARM_OPTIONS)
    axes = [parse_axis(text) for text in _listed(written, "vary")]
    explicit = [parse_arm(spec) for spec in _listed(written, "arms")]
    if not axes and not explicit:
        raise ConfigError("compare needs at least one --vary KEY=V1,V2,... or --arm NAME:KEY=V")
    if len({name for name, _ in explicit}) < len(explicit):
        raise ConfigError(f"two arms share a name: {[name for name, _ in explicit]}")
    settings = [overrides for _, overrides in explicit]
    if twin := next((n for n, o in explicit if settings.count(o) > 1), None):
        raise ConfigError(f"arm {twin!r} has another arm's settings: the same runs twice")
    varied = [k for keys, _ in axes for k in keys]
    if len(set(varied)) < len(varied):
        raise ConfigError(f"a key is varied twice: {varied}")
    if protocol.seeds > 1 and "seed" in {*varied, *(k for o in settings for k in o)}:
        raise ConfigError(
            f"seeds = {protocol.seeds} beside arms that set the seed: an arm's seeds (its seed "
            "and the next ones) would overlap another's; vary the seed or give --seeds"
        )
    arms, planned = [], []
    combos = itertools.product(explicit or [("", {})], *(points for _, points in axes))
    for i, (arm, *combo) in enumerate(combos):
        name, overrides = arm
        grid = {k: v for point in combo for k, v in point.items()}
        if clash := sorted(overrides.keys() & grid.keys()):
            raise ConfigError(f"arm {name!r} sets {clash[0]!r}, which --vary also varies")
        planned.append(plan_run(resolve(base, {**overrides, **grid})))
        label = ", ".join([name] * bool(name) + [f"{k}={v}" for k, v in grid.items()])
        label = label or ", ".join(f"{k}={v}" for k, v in overrides.items())
        arms.append(Arm(label, {**overrides, **grid}, f"run{i:02d}"))
    check_batches_fit(planned)  # every arm checked before any trains, on its data too
    return Comparison(dict(base), varied, arms, protocol)


def _listed(options: dict[str, Any], name: str) -> list[Any]:
    """An option that may be one text or a list of them, as a list (absent: empty); an arm
    may also be a table."""
    value = options.get(name)
    if value is None:
        return []
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    for item in items:
        if not isinstance(item, str) and not (name == "arms" and isinstance(item, Mapping)):
            example = "'KEY=V1,V2,...'" if name == "vary" else "'NAME:KEY=V,...'"
            raise ConfigError(f"{name} takes text such as {example}, got {item!r}")
    return items


def run_comparison(
    comparison: Comparison,
    out: Path | None,
    *,
    quiet: bool = False,
    tune: TuneSettings | None = None,
) -> Path:
    """Train the comparison into ``out`` (new, or the same comparison's, continued); the
    report. A tuned comparison's studies search with ``tune`` (default: its defaults)."""
    root = out or new_run_dir(task=f"compare-{comparison.base['task']}")
    index_path, planned = root / "compare.json", comparison.to_dict()
    lock = claim_plan(
        root, index_path.name, {"plan": planned}, "comparison", config_at="base", compared=_plan
    )
    for arm in comparison.arms:
        print(f"[{arm.stem}] {arm.name}", flush=True)
    p = comparison.protocol
    try:
        tune = tune if p.tune else None  # a [tune] table's settings reach only a tuned sweep
        with stops_as_a_whole(root):
            results = sweep(
                comparison.base, comparison.arms, root, p, quiet=quiet or p.jobs > 1, tune=tune
            )
        index = {"plan": planned, "arms": [r.to_dict() for r in results]}
        write_atomically(index_path, json.dumps(index, indent=2) + "\n")
    finally:
        lock.release()
    return comparison_report.render(root)


def _plan(index: Any) -> Any:
    """The plan in a comparison's ``compare.json`` (beside its arms' results, once run)."""
    return index.get("plan") if isinstance(index, dict) else index
