"""``bigbatch federated``: the data splits, the settings' checks, and a whole simulation."""

import json

import numpy as np
import pytest

pytest.importorskip("flwr")
pytest.importorskip("sklearn")

from bigbatch.cli import main
from bigbatch.experiments.config import ConfigError
from bigbatch.experiments.federated import split_indices
from bigbatch.experiments.options import FederatedSettings

LABELS = np.repeat(np.arange(10), 100)


def test_an_iid_split_shares_every_sample_once_in_near_equal_parts():
    parts = split_indices(LABELS, 3, "iid", 0.5, seed=0)
    assert sorted(i for p in parts for i in p) == list(range(1000))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_a_dirichlet_split_shares_every_sample_once_and_skews_the_classes():
    parts = split_indices(LABELS, 4, "dirichlet", 0.1, seed=0)
    assert sorted(i for p in parts for i in p) == list(range(1000))
    assert all(parts)
    # at alpha 0.1 a client holds most of few classes: its largest class is far above 1/10
    shares = [np.bincount(LABELS[p], minlength=10).max() / len(p) for p in parts]
    assert np.mean(shares) > 0.3
    assert split_indices(LABELS, 4, "dirichlet", 0.1, seed=0) == parts
    assert split_indices(LABELS, 4, "dirichlet", 0.1, seed=1) != parts


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"split": "weird"}, "split must be one of 'iid', 'dirichlet', got 'weird'"),
        ({"task": "lm"}, "task must be one of"),
        ({"clients": 0}, "clients must be a whole number >= 1, got 0"),
        ({"alpha": 0.0}, "alpha"),
        ({"local_batch": 64, "local_samples": 32}, "local_batch (64) exceeds local_samples (32)"),
        ({"min_sub_batches": 1}, "min_sub_batches must be a whole number >= 2, got 1"),
        # every client failed (the statistics need 2 examples a step) and the command ended 0
        ({"local_batch": 1}, "local_batch must be a whole number >= 2, got 1"),
        (
            {"scheme": "switch", "large": 8, "local_batch": 16},
            "large (8) must lie between local_batch (16) and local_samples (1024)",
        ),
    ],
)
def test_bad_settings_are_one_error_naming_the_value(settings, message):
    with pytest.raises(ConfigError) as error:
        FederatedSettings(**settings)
    assert message in str(error.value)


def test_settings_at_their_bounds_are_accepted():
    assert FederatedSettings(scheme="switch", local_batch=16, large=16).large == 16
    assert FederatedSettings(local_batch=4, min_sub_batches=4).min_sub_batches == 4


def test_the_command_simulates_a_federation_and_writes_its_report(tmp_path, capsys):
    out = tmp_path / "fed"
    argv = ["federated", "--task", "digits", "--clients", "2", "--split", "dirichlet",
            "--rounds", "3", "--local-samples", "64", "--scheme", "switch", "--large", "32",
            "--local-batch", "8", "--threads", "1", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    rows = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3]
    # switch at half of 3 x 2 x 64 samples: rounds 1 (128 samples) and 2 (256) at 32
    assert [r["local_batch"] for r in rows] == [32, 32, 8]
    assert [r["client_steps"] for r in rows] == [2, 4, 12]
    assert all(0 <= r["eval_accuracy"] <= 1 for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["client_steps"] == 12 and summary["samples"] == 3 * 2 * 64
    assert (out / "federated.png").stat().st_size > 0
    report = (out / "report.md").read_text()
    assert "| 3 | 8 | 8 |" in report
    # bigbatch report re-renders it from the folder alone, as it does every command's
    (out / "report.md").unlink()
    assert main(["report", str(out)]) == 0
    assert (out / "report.md").read_text() == report
    # the same folder again is refused in one line
    assert main(argv) == 2
    assert "already exists" in capsys.readouterr().err
    # a config file: its [federated] table, a flag over it; another command's key refused
    study = tmp_path / "study.toml"
    study.write_text("[federated]\nrounds = 0\n")
    assert main(["federated", "--config", str(study), "--out", str(tmp_path / "f2")]) == 2
    assert "[federated] rounds must be a whole number >= 1, got 0" in capsys.readouterr().err
    study.write_text('task = "digits"\n[federated]\nrounds = 2\n')
    assert main(["federated", "--config", str(study), "--out", str(tmp_path / "f3")]) == 2
    assert "reads only the [federated] table" in capsys.readouterr().err


def test_the_command_without_flower_names_the_extra(monkeypatch, tmp_path, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "flwr", None)
    monkeypatch.setitem(sys.modules, "flwr.app", None)
    code = main(["federated", "--task", "digits", "--rounds", "1", "--out", str(tmp_path / "x")])
    assert code == 2
    assert "pip install 'bigbatch[flower]'" in capsys.readouterr().err


def test_a_client_that_fails_fails_the_simulation_in_one_line(monkeypatch, tmp_path, capsys):
    """FedAvg went on without a failing client (or with none, 0 steps and accuracy nan) and
    the command ended 0: not the federation asked for."""
    from bigbatch.integrations import flower

    def broken(setup, plan):
        raise RuntimeError("this client's device is gone")

    monkeypatch.setattr(flower, "train_round", broken)
    argv = ["federated", "--task", "digits", "--clients", "2", "--rounds", "2",
            "--local-samples", "16", "--threads", "1", "--out", str(tmp_path / "fed")]  # fmt: skip
    assert main(argv) == 4
    assert not (tmp_path / "fed").exists()  # nothing left that would block the same --out
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "bigbatch: error: 4 client updates failed in 2 rounds; the first: RuntimeError: this "
        "client's device is gone" + err[0].rpartition("gone")[2]
    ]


def test_an_out_that_cannot_be_made_is_refused_before_the_first_round(
    monkeypatch, tmp_path, capsys
):
    """It was found after every round had trained (and two runs on one --out both trained)."""
    from bigbatch.integrations import flower

    monkeypatch.setattr(flower, "train_round", lambda *args: pytest.fail("a round trained"))
    (tmp_path / "afile").touch()
    argv = ["federated", "--task", "digits", "--rounds", "2", "--out", str(tmp_path / "afile/x")]
    assert main(argv) == 2
    assert "cannot be created: not a directory" in capsys.readouterr().err
