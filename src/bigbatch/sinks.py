"""Metrics where users look: TensorBoard, MLflow and Weights & Biases. Every number of a
step's metrics goes to every sink as ``bigbatch/<key>`` (:func:`tagged`), a batch
change also as an event in words; each sink's package is imported when it is made
(docs/logging.md)."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "PREFIX",
    "MLflowSink",
    "Sink",
    "Sinks",
    "TensorBoardSink",
    "WandbSink",
    "batch_change",
    "require",
    "tagged",
]

#: every metric's name is this and its key in ``Step.metrics``
PREFIX = "bigbatch/"
#: the metric that marks each batch change with the new batch (and the changes' text)
CHANGES = PREFIX + "batch_change"
#: where a tracker keeps the list of changes in words (MLflow's tag, W&B's table)
CHANGE_LIST = PREFIX + "batch_changes"


def tagged(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of a metrics row under their logged names (no step, flags or text)."""
    return {
        PREFIX + key: float(value)
        for key, value in metrics.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step"
    }


def batch_change(metrics: Mapping[str, Any]) -> str | None:
    """The batch change a metrics row announces, in words; None if none."""
    batch, following = metrics.get("batch_size"), metrics.get("next_batch_size")
    if batch is None or following is None or following == batch:
        return None
    words = [f"batch {batch} -> {following} after step {metrics.get('step')}"]
    if "samples" in metrics:
        words[0] += f" ({metrics['samples']:,} samples)"
    if "noise_scale" in metrics:
        bounds = ""
        if "noise_scale_low" in metrics and "noise_scale_high" in metrics:
            bounds = (
                f" [{_shown(metrics['noise_scale_low'])}, {_shown(metrics['noise_scale_high'])}]"
            )
        words.append(f"noise scale {_shown(metrics['noise_scale'])}{bounds}")
    for key, name in (
        ("critical_batch", "critical batch estimate"),
        ("noise_multiple", "kappa"),
        ("loss_slope", "loss slope per e-fold"),
        ("similarity", "similarity"),
    ):
        if key in metrics:
            words.append(f"{name} {_shown(metrics[key])}")
    return "; ".join(words)


def _shown(value: float) -> str:
    # NaN where an estimate is undefined (|G|^2's unbiased estimate at or below 0: noise only)
    return f"{value:.4g}" if math.isfinite(value) else "undefined"


class Sink(Protocol):
    """Where a run's metrics go: numbers by step, text events, and an end."""

    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def event(self, text: str, step: int, batch: int) -> None: ...

    def close(self) -> None: ...


class Sinks:
    """Several sinks fed from one metrics row at a time; a context manager that closes them."""

    def __init__(self, *sinks: Sink) -> None:
        self.sinks = list(sinks)

    def record(self, metrics: Mapping[str, Any]) -> None:
        """Log a step's metrics (it must carry ``step``) and its batch change, if any."""
        # {}: an asynchronous loop's first step, or its flush() with nothing left
        if not metrics:
            return
        step = int(metrics["step"])
        values = tagged(metrics)
        change = batch_change(metrics)
        for sink in self.sinks:
            sink.log(values, step)
            if change is not None:
                sink.event(change, step, int(metrics["next_batch_size"]))

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()

    def __bool__(self) -> bool:
        return bool(self.sinks)

    def __enter__(self) -> Sinks:
        return self

    def __exit__(self, kind: object, error: BaseException | None, trace: object) -> None:
        if error is not None:  # a tracker that keeps a run's status is told how it ended
            stopped = isinstance(error, KeyboardInterrupt) or hasattr(error, "signum")
            for sink in self.sinks:
                if callable(getattr(sink, "ended", None)):
                    sink.ended("KILLED" if stopped else "FAILED")
        self.close()


def require(package: str, extra: str) -> Any:
    """Import ``package``, or a ModuleNotFoundError naming the extra that brings it."""
    import importlib

    try:
        return importlib.import_module(package)
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            f"this sink needs {package.partition('.')[0]}: pip install 'bigbatch[{extra}]'",
            name=err.name,
        ) from None


class TensorBoardSink:
    """Scalars in a TensorBoard log directory; a batch change is a point and a text under
    ``bigbatch/batch_change``. ``purge_step``: a resumed run's first step."""

    def __init__(self, log_dir: str | Path, purge_step: int | None = None) -> None:
        require("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir), purge_step=purge_step)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)

    def event(self, text: str, step: int, batch: int) -> None:
        self.writer.add_scalar(CHANGES, batch, step)
        self.writer.add_text(CHANGES, text, step)

    def close(self) -> None:
        self.writer.close()


class MLflowSink:
    """Metrics of one MLflow run: a new one in ``experiment``, or ``run_id`` continued;
    non-finite values are left out."""

    def __init__(
        self,
        tracking_uri: str,
        experiment: str,
        run_name: str | None = None,
        run_id: str | None = None,
        params: Mapping[str, Any] | None = None,
        artifact_location: str | None = None,
        changes: Sequence[tuple[int, int, str]] | None = None,
    ) -> None:
        mlflow = require("mlflow", "mlflow")
        entities = require("mlflow.entities", "mlflow")
        self._metric = entities.Metric
        self.client = mlflow.MlflowClient(tracking_uri)
        if run_id is None:
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = (
                found.experiment_id
                if found is not None
                else self.client.create_experiment(experiment, artifact_location)
            )
            run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
            values = [entities.Param(k, str(v)) for k, v in (params or {}).items()]
            for start in range(0, len(values), 100):  # log_batch takes 100 params at most
                self.client.log_batch(run_id, params=values[start : start + 100])
        else:  # reopened: it stopped KILLED or FAILED, and trains again
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        self._status = "FINISHED"
        if changes is None:
            changes_tag = self.client.get_run(run_id).data.tags.get(CHANGE_LIST, "")
            self.changes = changes_tag.splitlines()
        else:  # a resumed run's own (the tag may hold changes past its checkpoint)
            self.changes = [f"step {step}: {text}" for step, _, text in changes]

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        batch = [self._metric(k, v, now, step) for k, v in metrics.items() if math.isfinite(v)]
        self.client.log_batch(self.run_id, metrics=batch)

    def event(self, text: str, step: int, batch: int) -> None:
        self.client.log_metric(self.run_id, CHANGES, batch, step=step)
        # a step logged again (a run resumed before it) replaces what the list said from it
        self.changes = [c for c in self.changes if _listed_step(c) < step]
        self.changes.append(f"step {step}: {text}")
        # a tag holds at most a few thousand characters in some stores: the last changes
        self.client.set_tag(self.run_id, CHANGE_LIST, "\n".join(self.changes)[-4000:])

    def ended(self, status: str) -> None:  # "KILLED" (a signal) or "FAILED"
        self._status = status

    def close(self) -> None:
        self.client.set_terminated(self.run_id, status=self._status)


def _listed_step(line: str) -> int:
    # the step a line of MLflow's change list names (-1: a line the tag's cut began in)
    head, _, _ = line.partition(":")
    return int(head[5:]) if head.startswith("step ") and head[5:].isdigit() else -1


class WandbSink:
    """Metrics of a Weights & Biases run (``run_id`` continues one); batch changes are a
    table ``bigbatch/batch_changes`` at the end."""

    def __init__(
        self,
        directory: str | Path,
        project: str = "bigbatch",
        name: str | None = None,
        run_id: str | None = None,
        config: Mapping[str, Any] | None = None,
        changes: Sequence[tuple[int, int, str]] | None = None,
    ) -> None:
        wandb = require("wandb", "wandb")
        self._table = wandb.Table
        self.run = wandb.init(
            project=project,
            dir=str(directory),
            name=name,
            id=run_id,
            resume="allow" if run_id else None,
            config=dict(config or {}),
        )
        self.run_id = self.run.id
        # a resumed run's earlier changes: the table, logged at the end, holds every one
        self.changes: list[list[Any]] = [list(c) for c in changes or ()]
        self._exit_code = 0

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def event(self, text: str, step: int, batch: int) -> None:
        self.changes = [c for c in self.changes if c[0] < step]  # (as MLflowSink's)
        self.changes.append([step, batch, text])
        self.run.log({CHANGES: batch}, step=step)

    def close(self) -> None:
        if self.changes:
            self.run.log(
                {CHANGE_LIST: self._table(columns=["step", "batch", "change"], data=self.changes)}
            )
        self.run.finish(exit_code=self._exit_code)

    def ended(self, status: str) -> None:  # W&B marks a stopped run failed (no "killed")
        self._exit_code = 1
