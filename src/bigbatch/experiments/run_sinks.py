"""The sinks ``bigbatch train`` opens from its ``log.*`` keys, and how a resumed run finds
its MLflow or W&B run again."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from ..sinks import MLflowSink, Sinks, TensorBoardSink, WandbSink, batch_change, require
from .config import ConfigError, LogKeys
from .plan import RunPlan
from .rundir import first_line, read_metrics, write_atomically

__all__ = ["check_sinks", "open_sinks"]

#: files in the run directory naming the tracker's run a resumed run continues
MLFLOW_RUN = "mlflow_run_id"
WANDB_RUN = "wandb_run_id"


#: the trackers a run may log to, in the order they open: each one's key under ``log.``
#: is also its package's name
TRACKERS = ("tensorboard", "mlflow", "wandb")


def check_sinks(log: LogKeys) -> None:
    """Fail before a run directory is made if a sink's package is missing."""
    for package in TRACKERS:
        if getattr(log, package):
            require(package, package)
    if log.mlflow and log.mlflow != "local":  # a URI its client cannot open: one line
        try:
            require("mlflow", "mlflow").MlflowClient(log.mlflow)
        except Exception as err:  # mlflow's own exceptions, whatever the store
            raise ConfigError(
                f"log.mlflow = {log.mlflow!r} cannot be opened as a tracking URI "
                f"({first_line(err)})"
            ) from None


def open_sinks(plan: RunPlan, out: Path, resume: bool, first_step: int) -> Sinks:
    """Every sink the plan asks for, writing into (or naming) ``out``, continued from
    ``first_step`` on a resume; one that cannot open is a ConfigError naming its key."""
    # (a tracker's server down, or no login: a traceback and exit 1 before)
    sinks: list[Any] = []
    try:
        _open(plan, out, resume, first_step, sinks)
    except Exception as err:
        with contextlib.suppress(Exception):
            Sinks(*sinks).close()
        raise ConfigError(
            f"{_failed(plan, sinks)}: the tracker could not be opened ({first_line(err)}); "
            "the run is kept: --resume it once the tracker answers"
        ) from None
    return Sinks(*sinks)


def _failed(plan: RunPlan, opened: list[Any]) -> str:
    # the log key (and value) of the first tracker asked for that is not among those opened
    log = plan.log
    wanted = [(name, getattr(log, name)) for name in TRACKERS if getattr(log, name)]
    name, value = wanted[min(len(opened), len(wanted) - 1)]
    return f"log.{name} = {value!r}"


def _open(plan: RunPlan, out: Path, resume: bool, first_step: int, sinks: list[Any]) -> None:
    # open_sinks' trackers, in TRACKERS' order, each appended to sinks once open
    log = plan.log
    # a resumed run's batch changes so far, from its metrics (cut back to its checkpoint)
    changes = _changes(out) if resume and (log.mlflow or log.wandb) else None
    if log.tensorboard:
        # a resumed run hides what the killed one wrote after its checkpoint (an asynchronous
        # run's row of the checkpoint's own step among it: it is written a step later)
        late = plan.machine.asynchronous
        purge = first_step + (0 if late else 1) if resume else None
        sinks.append(TensorBoardSink(out / "tensorboard", purge_step=purge))
    if log.mlflow:
        local = log.mlflow == "local"
        sink = MLflowSink(
            f"sqlite:///{(out / 'mlflow.db').resolve()}" if local else log.mlflow,
            experiment=f"bigbatch-{plan.run.task}",
            run_name=out.name,
            run_id=_saved(out, MLFLOW_RUN) if resume else None,
            params=dict(plan),
            artifact_location=(out / "mlflow-artifacts").resolve().as_uri() if local else None,
            changes=changes,
        )
        write_atomically(out / MLFLOW_RUN, sink.run_id)
        sinks.append(sink)
    if log.wandb:
        sink = WandbSink(
            out,
            project=os.environ.get("WANDB_PROJECT", "bigbatch"),
            name=out.name,
            run_id=_saved(out, WANDB_RUN) if resume else None,
            config=dict(plan),
            changes=changes,
        )
        write_atomically(out / WANDB_RUN, sink.run_id)
        sinks.append(sink)


def _changes(out: Path) -> list[tuple[int, int, str]]:
    # (step, new batch, text) of each batch change the metrics log
    rows = read_metrics(out)
    texts = [(row, batch_change(row)) for row in rows]
    return [(int(r["step"]), int(r["next_batch_size"]), t) for r, t in texts if t is not None]


def _saved(out: Path, name: str) -> str | None:
    path = out / name
    return path.read_text().strip() if path.is_file() else None
