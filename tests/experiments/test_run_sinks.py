"""``bigbatch train`` with ``log.*``: every row in each tracker once, across a resume, and the
batch changes in the report."""

import json
import sys

import pytest

from bigbatch import cli
from bigbatch.experiments import runner
from bigbatch.experiments.config import resolve
from bigbatch.experiments.rundir import read_metrics
from bigbatch.sinks import batch_change

from ..test_sinks import wandb_history

CONFIG = {
    "task": "digits",
    "device": "cpu",
    "threads": 1,
    "max_samples": 8000,
    "eval_every": 5,
    "batch.controller": "simigrad",  # changes its batch often
    "batch.initial": 32,
    "log.tensorboard": True,
    "log.mlflow": "local",
    "log.wandb": True,
}


@pytest.fixture
def offline(monkeypatch):
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def test_every_row_reaches_each_tracker_once_across_a_resume(tmp_path, offline):
    import mlflow
    from tensorboard.backend.event_processing import event_accumulator

    out = tmp_path / "run"
    runner.train(resolve(CONFIG), out, quiet=True, until=3000)  # paused: a resume follows
    runner.train(resolve(CONFIG), out, resume=True, quiet=True)
    rows = read_metrics(out)
    steps = [r["step"] for r in rows]
    changes = [(r["step"], r["next_batch_size"]) for r in rows if batch_change(r)]
    assert len(changes) > 3

    events = event_accumulator.EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("bigbatch/batch_size")] == steps
    assert [e.value for e in events.Scalars("bigbatch/loss")] == pytest.approx(
        [r["loss"] for r in rows]
    )
    assert [(e.step, e.value) for e in events.Scalars("bigbatch/batch_change")] == changes

    client = mlflow.MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("bigbatch-digits").experiment_id])
    assert run.info.run_id == (out / "mlflow_run_id").read_text() and run.info.run_name == "run"
    history = client.get_metric_history(run.info.run_id, "bigbatch/batch_size")
    assert sorted({m.step for m in history}) == steps
    assert run.data.params["batch.controller"] == "simigrad"
    # every change once, the first process's and the resumed one's
    listed = run.data.tags["bigbatch/batch_changes"].splitlines()[1:]  # (cut to its end)
    listed_steps = [int(line.split(":")[0].removeprefix("step ")) for line in listed]
    assert listed_steps == [step for step, _ in changes][-len(listed) :]

    history = wandb_history(out)  # one run, continued: a folder per process, one run id
    folders = list(out.glob("wandb/offline-run-*"))
    assert {f.name.rsplit("-", 1)[1] for f in folders} == {(out / "wandb_run_id").read_text()}
    logged = sorted({h["_step"] for h in history if "bigbatch/batch_size" in h})
    assert logged == steps
    tables = sorted(
        out.glob("wandb/offline-run-*/files/media/table/bigbatch/batch_changes_*.table.json"),
        key=lambda p: int(p.name.split("_")[2]),
    )
    last = json.loads(tables[-1].read_text())["data"]  # the resumed run's, at its end
    assert [row[:2] for row in last] == [list(c) for c in changes]

    report = (out / "report.md").read_text()
    assert f"{len(changes)} changes of the batch size" in report
    assert batch_change(next(r for r in rows if batch_change(r))) in report


def test_a_missing_tracker_package_is_one_line_naming_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed
    code = cli.main(
        ["train", "--quiet", "--task", "digits", "--set", "max_samples=2000", "--set",
         "log.tensorboard=true", "--out", str(tmp_path / "r")]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "log.tensorboard needs the tensorboard extra" in err
    assert "pip install 'bigbatch[tensorboard]'" in err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("uri", ["bogus://x", "not-a-store"])
def test_a_tracking_uri_mlflow_cannot_open_is_one_line_before_the_run(tmp_path, capsys, uri):
    pytest.importorskip("mlflow")
    code = cli.main(
        ["train", "--quiet", "--task", "digits", "--set", "max_samples=300", "--set",
         f"log.mlflow={uri}", "--out", str(tmp_path / "r")]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert f"log.mlflow = '{uri}' cannot be opened as a tracking URI" in err
    assert not (tmp_path / "r").exists()


def test_a_tracker_that_cannot_open_is_one_line_and_the_run_resumes(tmp_path, capsys, monkeypatch):
    """W&B without a login (or an MLflow server that refuses) ended the run in a traceback,
    exit 1, with no summary; the folder then blocked the same command."""
    pytest.importorskip("tensorboard")
    from bigbatch.experiments import run_sinks

    def no_login(*args, **kwargs):
        raise RuntimeError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(run_sinks, "WandbSink", no_login)
    out = tmp_path / "r"
    argv = ["train", "--quiet", "--task", "digits", "--set", "max_samples=300", "--set",
            "log.tensorboard=true", "--set", "log.wandb=true", "--out", str(out)]  # fmt: skip
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "log.wandb = True: the tracker could not be opened" in err
    assert "No API key configured" in err and "--resume" in err
    assert json.loads((out / "summary.json").read_text())["ended"] == "error"
    monkeypatch.undo()  # the login given, the same run resumes
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    assert cli.main(["train", "--quiet", "--resume", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["ended"] == "budget"


@pytest.mark.parametrize("asynchronous, purged_from", [(False, 6), (True, 5)])
def test_a_resumed_run_hides_what_the_killed_one_wrote_after_its_checkpoint(
    tmp_path, monkeypatch, asynchronous, purged_from
):
    """An asynchronous run writes the row of its checkpoint's own step a step later, so a
    resume from step 5 hides step 5's TensorBoard points as well (else logged twice)."""
    from bigbatch.experiments import run_sinks
    from bigbatch.experiments.plan import plan_run

    opened = []
    monkeypatch.setattr(
        run_sinks, "TensorBoardSink", lambda path, purge_step: opened.append(purge_step)
    )
    config = {"task": "digits", "log.tensorboard": True, "optimizer": "adamw"}
    plan = plan_run(resolve({**config, "asynchronous": asynchronous}))
    run_sinks.open_sinks(plan, tmp_path, resume=True, first_step=5)
    assert opened == [purged_from]
