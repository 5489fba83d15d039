"""The bigbatch command end to end on small tasks."""

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from bigbatch import cli
from bigbatch.loop import AdaptiveBatch

# the CPU: these runs are compared bitwise, and --nproc 2 uses two gloo ranks even where a
# GPU exists (tests/experiments/test_device.py trains on the GPU)
SMALL = [
    "--quiet",
    "--set",
    "device=cpu",
    "--set",
    "task=digits",
    "--set",
    "max_samples=6000",
    "--set",
    "eval_every=10",
    "--set",
    "checkpoint_every=5",
    "--set",
    "batch.initial=32",
]


def run_cli(*args):
    return cli.main([str(a) for a in args])


def rows(run):
    """A run's metrics rows without their timing field (which differs between runs)."""
    out = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        row.pop("wall_seconds")
        out.append(row)
    return out


def test_train_writes_the_run_directory(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli("train", *SMALL, "--out", out) == 0
    for name in (
        "config.toml",
        "metrics.jsonl",
        "summary.json",
        "checkpoint.pt",
        "report.md",
        "batch_similarity.png",
        "loss_accuracy.png",
        "lr.png",
    ):
        assert (out / name).is_file(), name
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {"step", "samples", "batch_size", "lr", "loss", "similarity", "noise_scale"} <= set(
        rows[0]
    )
    # one noise scale: the estimate the default controller decides on, with its bounds
    known = [r for r in rows if r["noise_scale_low"] > 0 < r["noise_scale"]]  # unknown: NaN, 0
    assert known and "critical_batch" in known[-1]
    assert all(r["noise_scale_low"] <= r["noise_scale"] <= r["noise_scale_high"] for r in known)
    assert any("eval_accuracy" in r and "eval_loss" in r for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == len(rows) and summary["samples"] == rows[-1]["samples"] >= 6000
    assert summary["avg_batch_size"] == pytest.approx(summary["samples"] / summary["steps"])
    assert summary["best_accuracy"] > 0.5
    assert summary["controller"].startswith("BatchWarmup(multiple=0.125, initial=32, ")
    assert "best accuracy" in capsys.readouterr().out
    # an existing run is never overwritten
    before = (out / "metrics.jsonl").read_text()
    assert run_cli("train", *SMALL, "--out", out) == 2
    assert "already exists" in capsys.readouterr().err
    assert (out / "metrics.jsonl").read_text() == before
    # the report re-renders from the files
    (out / "report.md").unlink()
    assert run_cli("report", out) == 0
    assert (out / "report.md").is_file()


#: the batch taking over a warm-up-stable-decay schedule's cool-down (most of the run)
SEESAW = ["--set", "batch.controller=seesaw", "--set", "schedule.kind=wsd"]
SEESAW += ["--set", "schedule.cooldown=0.9", "--set", "batch.critical_multiple=0"]


#: a ramp in optimizer steps whose change comes after the kill
RAMP = ["--set", "batch.controller=ramp", "--set", "batch.ramp_points=0:32, 15 steps:64"]


#: the noise from each example's gradient norm, measured at every third step (the kill
#: comes before a measured step; the checkpoint it resumes from is between two)
EXAMPLES = ["--set", "noise_from=examples", "--set", "statistics_every=3"]


@pytest.mark.parametrize(
    "extra", [[], SEESAW, RAMP, EXAMPLES], ids=["default", "seesaw", "ramp", "per-example"]
)
def test_a_killed_run_resumes_to_the_same_result(tmp_path, monkeypatch, extra):
    straight = tmp_path / "straight"
    assert run_cli("train", *SMALL, *extra, "--out", straight) == 0
    if extra == RAMP:  # the table, in steps
        assert [r["batch_size"] for r in rows(straight)][13:16] == [32, 32, 64]
    if extra and extra != EXAMPLES:  # the batch grows after the kill: the controller's state
        batches = [r["batch_size"] for r in rows(straight)]
        assert batches[12] < batches[-1] and batches == sorted(batches)

    killed = tmp_path / "killed"
    real_step = AdaptiveBatch._optimizer_step

    def crash_after_12(self, *args):
        if self.steps_taken == 12:
            raise KeyboardInterrupt  # a kill between checkpoints (the last was at step 10)
        return real_step(self, *args)

    monkeypatch.setattr(AdaptiveBatch, "_optimizer_step", crash_after_12)
    assert run_cli("train", *SMALL, *extra, "--out", killed) == 130
    assert len((killed / "metrics.jsonl").read_text().splitlines()) == 12
    monkeypatch.setattr(AdaptiveBatch, "_optimizer_step", real_step)
    assert run_cli("train", "--quiet", "--resume", killed) == 0

    assert rows(killed) == rows(straight)
    a = torch.load(killed / "checkpoint.pt", weights_only=True)["loop"]["model"]
    b = torch.load(straight / "checkpoint.pt", weights_only=True)["loop"]["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_bad_toml_and_corrupted_checkpoint(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("lr = = 3")
    assert run_cli("train", "--config", bad) == 2
    assert "not valid TOML" in capsys.readouterr().err
    out = tmp_path / "run"
    assert run_cli("train", *SMALL, "--out", out) == 0
    finished = json.loads((out / "summary.json").read_text())
    good = (out / "checkpoint.prev.pt").read_bytes()  # the one before the last
    (out / "checkpoint.pt").write_bytes(b"not a checkpoint")
    # the run resumes from the previous checkpoint, says so in one line, and ends the same
    with pytest.warns(RuntimeWarning, match="cannot be read.*resuming from the previous") as seen:
        assert run_cli("train", "--quiet", "--resume", out) == 0
    (warning,) = [w for w in seen if "checkpoint" in str(w.message)]
    shown = warnings.formatwarning(warning.message, RuntimeWarning, warning.filename, 1)
    assert shown.startswith("bigbatch: warning: checkpoint") and shown.count("\n") == 1
    again = json.loads((out / "summary.json").read_text())
    assert again["final_eval_loss"] == finished["final_eval_loss"]
    assert again["steps"] == finished["steps"]
    # the damaged file was replaced, and the good one stays its predecessor
    assert (out / "checkpoint.prev.pt").read_bytes() == good
    torch.load(out / "checkpoint.pt", weights_only=True)
    # with both damaged the run cannot resume: one line naming both, nothing changed
    (out / "checkpoint.pt").write_bytes(b"not a checkpoint")
    (out / "checkpoint.prev.pt").write_bytes(b"nor this")
    assert run_cli("train", "--quiet", "--resume", out) == 2
    err = capsys.readouterr().err
    assert "truncated or corrupted" in err and "nor can the previous one" in err
    assert (out / "checkpoint.prev.pt").read_bytes() == b"nor this"
    # a bad value in the run's saved config.toml: the file named, not only the value
    config = out / "config.toml"
    config.write_text(config.read_text().replace('optimizer = "lamb"', 'optimizer = "lamb2"'))
    assert run_cli("train", "--quiet", "--resume", out) == 2
    assert capsys.readouterr().err.startswith(f"bigbatch: error: {str(config)!r}: optimizer ")


def test_compare_writes_one_report(tmp_path):
    out = tmp_path / "cmp"
    assert (
        run_cli(
            "compare",
            *SMALL,
            "--set",
            "max_samples=3000",
            "--vary",
            "batch.controller=constant,simigrad",
            "--out",
            out,
        )
        == 0
    )
    index = json.loads((out / "compare.json").read_text())
    assert [a["name"] for a in index["arms"]] == [
        "batch.controller=constant",
        "batch.controller=simigrad",
    ]
    assert [a["dirs"] for a in index["arms"]] == [["run00-lr0-seed0"], ["run01-lr0-seed0"]]
    report = (out / "report.md").read_text()
    assert "batch.controller=simigrad" in report
    assert (out / "pareto.png").is_file() and (out / "curves.png").is_file()


def test_stop_at_target_ends_the_run_at_the_first_evaluation_that_reaches_it(tmp_path):
    out = tmp_path / "run"
    # a rate at which the small default batch reaches digits' target well within the budget
    budget = ["--set", "max_samples=60000", "--set", "eval_every=5", "--set", "lr=0.016"]
    assert run_cli("train", *SMALL, *budget, "--set", "stop_at_target=true", "--out", out) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["target_reached"] and summary["steps"] == summary["steps_to_target"]
    assert summary["samples"] < 60000


def test_tasks_are_listed(capsys):
    assert run_cli("tasks") == 0
    listing = capsys.readouterr().out
    for name in ("mnist1d", "teacher", "digits", "lm", "text"):
        assert name in listing
    # a rule measured on a task is listed with its rates
    assert "rules     sgd sqrt, vr-momentum none, plain-sgd sqrt" in listing
    assert "lr_max    plain-sgd 0.632, vr-sgd 0.632, vr-adam 0.016 (ceilings" in listing


def test_lm_task_logs_the_max_attention_logit_and_loss_floor(tmp_path, capsys):
    out = tmp_path / "lm"
    assert (
        run_cli(
            "train",
            "--quiet",
            "--set",
            "task=lm",
            "--set",
            "max_samples=2000",
            "--set",
            "model.width=32",
            "--set",
            "model.depth=1",
            "--out",
            out,
        )
        == 0
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["max_attention_logit"] > 0
    assert 0 < summary["loss_floor"] < summary["final_eval_loss"]
    # the command's line leads with the task's own score, the eval loss
    assert f"best eval loss {summary['best_eval_loss']:.4f}, final " in capsys.readouterr().out


def test_teacher_task_trains(tmp_path):
    out = tmp_path / "teacher"
    assert (
        run_cli(
            "train",
            "--quiet",
            "--set",
            "device=cpu",
            "--set",
            "task=teacher",
            "--set",
            "max_samples=20000",
            "--out",
            out,
        )
        == 0
    )
    assert json.loads((out / "summary.json").read_text())["best_accuracy"] > 0.3


def test_vrgd_and_agvm_runs_report_the_generalization_gap(tmp_path):
    out = tmp_path / "vr"
    args = [
        "--set",
        "optimizer=vr-lamb",
        "--set",
        "min_sub_batches=8",
        "--set",
        "agvm.enabled=true",
    ]
    assert run_cli("train", *SMALL, *args, "--set", "agvm.start=5", "--out", out) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["best_accuracy"] > 0.5
    gap = summary["final_train_accuracy"] - summary["final_accuracy"]
    assert summary["generalization_gap"] == pytest.approx(gap)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    multipliers = {r["agvm/last"] for r in rows}
    assert len(multipliers) > 1  # μ moves once AGVM starts


BLOCK_CLI_EXTRA = "import sys\nfor m in ('matplotlib', 'mnist1d', 'tqdm'): sys.modules[m] = None\n"


def test_the_library_imports_without_the_cli_extra_and_the_command_names_it(tmp_path):
    # the core install is torch and numpy: the library imports without the extra's
    # packages, and a command that needs them says which extra to install, in one line
    script = BLOCK_CLI_EXTRA + (
        "import bigbatch, bigbatch.integrations._driver\n"
        "from bigbatch import cli\n"
        f"sys.exit(cli.main(['train', '--quiet', '--out', {str(tmp_path / 'run')!r}]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("bigbatch: error: the command line needs the cli extra")
    assert "pip install 'bigbatch[cli]'" in done.stderr and done.stderr.count("\n") == 1


def test_without_a_toml_reader_the_command_names_the_extra(monkeypatch, capsys):
    # Python 3.10 reads TOML with tomli, which comes with the cli extra
    from bigbatch.experiments import config

    monkeypatch.setattr(config, "tomllib", None)
    assert cli.main(["train", "--set", "lr=0.1"]) == 2
    assert "needs the cli extra (tomli is not installed)" in capsys.readouterr().err


def test_intervals_in_a_share_of_the_budget_evaluate_and_checkpoint_where_it_is_passed(
    tmp_path,
):
    out = tmp_path / "every"
    args = ["--set", "eval_every=25%", "--set", "checkpoint_every=1k samples"]
    assert run_cli("train", *SMALL, *args, "--set", "max_samples=4000", "--out", out) == 0
    logged = rows(out)
    evaluated = [r["samples"] for r in logged if "eval_loss" in r]
    quarters = [r["samples"] for i, r in enumerate(logged) if i and any(
        (logged[i - 1]["samples"] < q * 1000 <= r["samples"]) for q in (1, 2, 3, 4)
    )]  # fmt: skip
    assert evaluated == [logged[0]["samples"], *quarters]  # the first step, then each quarter
    assert json.loads((out / "summary.json").read_text())["ended"] == "budget"
    assert 'eval_every = "25%"' in (out / "config.toml").read_text()  # saved as written


def test_bigbatchs_own_warnings_are_one_line_wherever_python_locates_them(monkeypatch):
    from bigbatch.optim import FewSubBatchesWarning

    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # restored after
    cli._one_line_warnings()
    # a VRGD run of the CLI warns from inside torch's no_grad wrapper of the step
    inside_torch = os.path.join(os.path.dirname(torch.__file__), "utils", "_contextlib.py")
    shown = warnings.formatwarning("few sub-batches", FewSubBatchesWarning, inside_torch, 124)
    assert shown == "bigbatch: warning: few sub-batches\n"
    other = warnings.formatwarning("deprecated", FutureWarning, inside_torch, 124)
    assert other.startswith(inside_torch)  # other packages' warnings keep Python's format


@pytest.mark.parametrize("command", ["train", "critical-batch"])
def test_an_unknown_flag_gets_the_commands_usage(command, capsys):
    # (argparse's own answer is the top level's usage: the commands, not the flags)
    with pytest.raises(SystemExit) as stopped:
        cli.main([command, "--bogus", "3"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: bigbatch {command} ")
    assert err.rstrip().endswith(f"bigbatch {command}: error: unrecognized arguments: --bogus 3")
