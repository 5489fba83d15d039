"""The sinks: names, batch-change events, and each tracker's files read back.

TensorBoard's event files are read with its own reader, MLflow's store with its
client, and W&B's offline run file (a LevelDB-style log of its protobuf
records) with a small reader and W&B's own record type.
"""

import json
import math
import struct

import pytest

from bigbatch.sinks import (
    MLflowSink,
    Sinks,
    TensorBoardSink,
    WandbSink,
    batch_change,
    tagged,
)


def rows(steps=6, change_at=3):
    """Metrics rows like a run's: the batch doubles after step ``change_at``."""
    out = []
    batch = 64
    for step in range(1, steps + 1):
        following = 2 * batch if step == change_at else batch
        out.append(
            {
                "step": step,
                "samples": sum(r["batch_size"] for r in out) + batch,
                "batch_size": batch,
                "next_batch_size": following,
                "noise_scale": 100.0 + step,
                "noise_scale_low": 90.0,
                "noise_scale_high": 120.0,
                "critical_batch": 130.0,
                "loss": 1.0 / step,
                "skipped": False,
            }
        )
        batch = following
    return out


def test_every_number_gets_the_prefix_and_the_step_flags_and_text_do_not():
    row = {"step": 3, "loss": 0.5, "batch_size": 64, "skipped": True, "note": "x"}
    assert tagged(row) == {"bigbatch/loss": 0.5, "bigbatch/batch_size": 64.0}


def test_a_batch_change_says_what_caused_it():
    text = batch_change(rows()[2])
    assert text == (
        "batch 64 -> 128 after step 3 (192 samples); noise scale 103 [90, 120]; "
        "critical batch estimate 130"
    )
    assert batch_change(rows()[0]) is None and batch_change({"loss": 1.0}) is None
    # a controller that reads no noise (a ramp) changes the batch while |G|^2's estimate is
    # at or below 0: "noise scale nan" read as a fault
    text = batch_change({**rows()[2], "noise_scale": math.nan, "noise_scale_low": math.nan})
    assert "noise scale undefined [undefined, 120]" in text


def test_tensorboard_holds_every_metric_and_the_change(tmp_path):
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    with Sinks(TensorBoardSink(tmp_path / "tb")) as sinks:
        for row in rows():
            sinks.record(row)
    events = event_accumulator.EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0})
    events.Reload()
    assert [e.value for e in events.Scalars("bigbatch/batch_size")] == [64] * 3 + [128] * 3
    assert [e.step for e in events.Scalars("bigbatch/noise_scale")] == [1, 2, 3, 4, 5, 6]
    assert [(e.step, e.value) for e in events.Scalars("bigbatch/batch_change")] == [(3, 128)]
    (text,) = events.Tensors("bigbatch/batch_change/text_summary")
    assert text.step == 3 and b"batch 64 -> 128" in text.tensor_proto.string_val[0]


def test_a_resumed_tensorboard_writer_hides_what_followed_the_checkpoint(tmp_path):
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    with Sinks(TensorBoardSink(tmp_path / "tb")) as sinks:
        for row in rows()[:5]:  # killed after step 5, its checkpoint at step 2
            sinks.record({**row, "loss": 9.0})
    with Sinks(TensorBoardSink(tmp_path / "tb", purge_step=3)) as sinks:
        for row in rows()[2:]:
            sinks.record(row)
    events = event_accumulator.EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    losses = [(e.step, e.value) for e in events.Scalars("bigbatch/loss")]
    assert [s for s, _ in losses] == [1, 2, 3, 4, 5, 6]
    assert [v for s, v in losses if s >= 3] == pytest.approx([1 / 3, 1 / 4, 1 / 5, 1 / 6])


def test_mlflow_holds_every_metric_the_changes_and_continues_a_run(tmp_path):
    mlflow = pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    params = {"lr": 0.01, **{f"key{i}": i for i in range(150)}}  # log_batch takes 100 a call
    sink = MLflowSink(uri, "bigbatch-test", run_name="r", params=params)
    with Sinks(sink) as sinks:
        for row in rows()[:4]:
            sinks.record(row)
    again = MLflowSink(uri, "bigbatch-test", run_id=sink.run_id)
    with Sinks(again) as sinks:
        for row in rows()[4:]:
            sinks.record(row)
    client = mlflow.MlflowClient(uri)
    run = client.get_run(sink.run_id)
    assert run.data.params["lr"] == "0.01" and run.info.status == "FINISHED"
    assert len(run.data.params) == 151
    history = client.get_metric_history(sink.run_id, "bigbatch/batch_size")
    assert sorted((m.step, m.value) for m in history) == [(s, 64 if s <= 3 else 128) for s in
                                                          range(1, 7)]  # fmt: skip
    changes = client.get_metric_history(sink.run_id, "bigbatch/batch_change")
    assert [(m.step, m.value) for m in changes] == [(3, 128)]
    assert run.data.tags["bigbatch/batch_changes"].startswith("step 3: batch 64 -> 128")
    # killed after step 4 with its checkpoint at step 2: the resumed process logs 3-6 again,
    # and the list names the change at step 3 once
    replay = MLflowSink(uri, "bigbatch-test", run_id=sink.run_id)
    with Sinks(replay) as sinks:
        for row in rows()[2:]:
            sinks.record(row)
    listed = client.get_run(sink.run_id).data.tags["bigbatch/batch_changes"].splitlines()
    assert len(listed) == 1 and listed[0].startswith("step 3:")


@pytest.mark.parametrize("error, status", [(KeyboardInterrupt, "KILLED"), (OSError, "FAILED")])
def test_an_mlflow_run_a_stop_or_an_error_ends_is_not_marked_finished(tmp_path, error, status):
    mlflow = pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    sink = MLflowSink(uri, "bigbatch-test")
    with pytest.raises(error), Sinks(sink) as sinks:
        sinks.record(rows()[0])
        raise error
    client = mlflow.MlflowClient(uri)
    assert client.get_run(sink.run_id).info.status == status
    # a resume reopens it: it trains again (it read KILLED until it ended)
    MLflowSink(uri, "bigbatch-test", run_id=sink.run_id)
    assert client.get_run(sink.run_id).info.status == "RUNNING"


def wandb_records(run_file):
    """The protobuf records of a W&B run file: a 7-byte file header, then LevelDB log
    records (crc32c, length, type: full, first, middle, last) in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    position, pending, records = 7, b"", []
    while position + 7 <= len(data):
        block_left = 32768 - position % 32768
        if block_left < 7:  # the block's tail is padding
            position += block_left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if kind == 0:  # zero fill
            position += block_left
            continue
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # full, or the last part
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(directory):
    """The history rows of every offline run file under ``directory`` (a resumed run writes
    a second folder with the same run id), in the order they were written.

    ``run.finish()`` does not wait for W&B's service to write the run file (it was found
    holding its 7-byte header alone on a loaded machine); ``wandb.teardown()`` does."""
    import wandb

    wandb.teardown()
    history = []
    records = []
    for run_file in sorted(directory.glob("wandb/offline-run-*/run-*.wandb")):
        records += wandb_records(run_file)
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): i.value_json for i in record.history.item}
            history.append({k: json.loads(v) for k, v in items.items()})
    return history


def test_wandb_offline_holds_every_metric_and_the_change(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    # resumed from a checkpoint before step 3: the change listed there is logged again
    earlier = [(3, 128, "listed before the resume")]
    with Sinks(WandbSink(tmp_path, name="r", config={"lr": 0.01}, changes=earlier)) as sinks:
        for row in rows():
            sinks.record(row)
    history = wandb_history(tmp_path)
    by_step = {h["_step"]: h for h in history}
    assert [by_step[s]["bigbatch/batch_size"] for s in range(1, 7)] == [64] * 3 + [128] * 3
    assert by_step[3]["bigbatch/batch_change"] == 128
    assert all("bigbatch/batch_change" not in by_step[s] for s in (1, 2, 4, 5))
    assert by_step[6]["bigbatch/batch_changes/nrows"] == 1  # the table, logged at the end
    (table,) = tmp_path.glob("wandb/offline-run-*/files/media/table/bigbatch/batch_changes_*.json")
    data = json.loads(table.read_text())
    assert data["columns"] == ["step", "batch", "change"]
    assert data["data"] == [[3, 128, batch_change(rows()[2])]]


def test_an_asynchronous_loops_rows_as_the_docs_feed_them_log_every_step_once():
    """docs/logging.md's own-loop snippet under ``asynchronous=True``: the first step's
    metrics are ``{}`` (the read comes one step late) and ``flush()`` gives the last; a bare
    ``KeyError: 'step'`` ended the run before."""
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    import bigbatch as bb

    class Recording:
        def __init__(self):
            self.steps = []

        def log(self, values, step):
            self.steps.append(step)

        def event(self, text, step, batch): ...

        def close(self): ...

    torch.manual_seed(0)
    x = torch.randn(256, 4)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    loop = bb.AdaptiveBatch(
        model, optimizer, TensorDataset(x, (x[:, 0] > 0).long()), asynchronous=True
    )
    sink = Recording()
    with Sinks(sink) as sinks:
        for step in loop.steps(max_steps=5):
            for xb, yb in step.micro_batches():
                step.backward(nn.functional.cross_entropy(model(xb), yb))
            step.apply()
            sinks.record(step.metrics)
        sinks.record(loop.flush())
    assert sink.steps == [1, 2, 3, 4, 5]
