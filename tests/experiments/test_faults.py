"""Faults an operator, a scheduler or a disk injects into ``bigbatch train``.

Each probe ends the same way or it fails: nothing lost (a resumed run equals
an uninterrupted one), no process left behind, one line on stderr and the
documented exit code (docs/cli.md). Marked ``faults``; they run with the rest
of the suite.
"""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from bigbatch import cli
from bigbatch.experiments import rundir
from bigbatch.testing import free_port

from .test_cli import rows
from .test_cli_distributed import (
    SMALL,
    alive,
    assert_same_run,
    bigbatch,
    kill_tree,
    process_tree,
    wait_for_checkpoint,
)

pytestmark = pytest.mark.faults


def wait_for_rows(run, count, process, timeout=120):
    """Wait until ``run`` has logged ``count`` optimizer steps (past a periodic checkpoint)."""
    deadline = time.monotonic() + timeout
    path = run / "metrics.jsonl"
    while not (path.exists() and len(path.read_text().splitlines()) >= count):
        assert process.poll() is None, "the run ended before the fault"
        assert time.monotonic() < deadline
        time.sleep(0.05)


def one_line(stderr):
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


def finish(process, timeout=300):
    # a small run takes about 30 s alone; two at once on a loaded 2-core machine took over 120
    _, stderr = process.communicate(timeout=timeout)
    return process.returncode, stderr


def test_two_runs_started_on_one_out_train_one_and_refuse_the_other(tmp_path):
    out = tmp_path / "same"
    args = [*SMALL, "--set", "max_samples=12000", "--out", out]
    first = bigbatch("train", *args, "--set", "seed=0", wait=False, capture=True)
    second = bigbatch("train", *args, "--set", "seed=1", wait=False, capture=True)
    results = sorted([finish(first), finish(second)])
    assert [code for code, _ in results] == [0, 2]
    refused = one_line(results[1][1])
    assert "in use by process" in refused or "already exists" in refused
    steps = [r["step"] for r in rows(out)]
    assert steps == list(range(1, len(steps) + 1))  # one writer: no step twice


SIGNALLED = [*SMALL, "--set", "max_samples=16000"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run the signalled ones must equal once resumed."""
    out = tmp_path_factory.mktemp("faults") / "straight"
    assert bigbatch("train", *SIGNALLED, "--out", out).returncode == 0
    return out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_checkpoints_and_the_resumed_run_equals_an_uninterrupted_one(
    tmp_path, capsys, straight, sig
):
    args = SIGNALLED
    stopped = tmp_path / "stopped"
    process = bigbatch("train", *args, "--out", stopped, wait=False, capture=True)
    wait_for_rows(stopped, 12, process)
    # a second writer, while the first still writes: in this process, at once (a new one
    # takes seconds to start, and on a loaded machine the run could end before the signal)
    assert run_cli("train", "--quiet", "--resume", stopped) == 2
    assert f"in use by process {process.pid}" in one_line(capsys.readouterr().err)
    os.kill(process.pid, sig)
    code, stderr = finish(process)
    assert code == 128 + sig
    line = one_line(stderr)
    assert f"stopped by {signal.Signals(sig).name} at step" in line and "--resume" in line
    summary = json.loads((stopped / "summary.json").read_text())
    assert summary["ended"] == "signal" and summary["why"] in line
    assert summary["steps"] == len(rows(stopped))
    resumed = bigbatch("train", "--quiet", "--resume", stopped)
    assert resumed.returncode == 0, resumed.stderr
    assert_same_run(stopped, straight)
    assert json.loads((stopped / "summary.json").read_text())["ended"] == "budget"


def test_sigterm_to_a_two_process_launcher_stops_every_rank_after_a_checkpoint(tmp_path):
    run = tmp_path / "two"
    args = [*SMALL, "--set", "max_samples=4000", "--nproc", 2, "--out", run]
    process = bigbatch("train", *args, wait=False, capture=True)
    wait_for_rows(run, 12, process)
    tree = process_tree(process.pid)
    assert len(tree) == 3  # the launcher and its two ranks
    os.kill(process.pid, signal.SIGTERM)
    code, stderr = finish(process)
    assert code == 143, stderr
    assert "stopped by SIGTERM at step" in one_line(stderr)
    assert not any(alive(pid) for pid in tree)
    state = torch.load(run / "checkpoint.pt", weights_only=True)["run"]
    assert state["metrics_lines"] == len(rows(run))  # the checkpoint is of the last step
    resumed = bigbatch("train", "--quiet", "--resume", run, "--nproc", 2)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((run / "summary.json").read_text())["samples"] >= 4000


def test_a_rank_that_stops_answering_ends_the_run_within_the_timeout(tmp_path):
    # the other rank's collective fails after dist.timeout (10 s); torch's agent then gives the
    # stopped rank a fixed 30 s to exit before SIGKILL. (3 s ended a run before the fault on
    # the 2-core CI machine: the other pytest worker's two-process runs starved a rank.)
    run = tmp_path / "hung"
    args = [*SMALL, "--set", "max_samples=400000", "--set", "dist.timeout=10", "--nproc", 2]
    process = bigbatch("train", *args, "--out", run, wait=False, capture=True)
    wait_for_rows(run, 8, process)
    tree = process_tree(process.pid)
    os.kill(tree[-1], signal.SIGSTOP)  # a rank stops, as a hung GPU or a paused VM would
    began = time.monotonic()
    code, stderr = finish(process, timeout=90)
    assert code == 4 and time.monotonic() - began < 60
    line = one_line(stderr)
    assert "stopped answering" in line and "launcher.log" in line
    assert not any(alive(pid) for pid in tree)


def two_nodes(run, *args, timeout_s=120):
    """Two torchrun agents on this machine, one rank each, meeting by c10d rendezvous: the
    command docs/distributed.md gives for a cluster (``--nnodes 2``), on localhost."""
    endpoint = f"localhost:{free_port()}"
    agents = []
    for _ in range(2):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
        command += ["--nproc-per-node", "1", "--rdzv-backend", "c10d"]
        command += ["--rdzv-endpoint", endpoint, "--rdzv-id", run.name]
        command += ["-m", "bigbatch.cli", "train", *map(str, args)]
        agents.append(
            subprocess.Popen(
                command,
                start_new_session=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
        )
    return agents


# one thread everywhere: --nproc gives each rank a share of the cores, torchrun leaves that to
# OMP_NUM_THREADS, and another thread count sums in another order
NODES = [*SMALL, "--set", "max_samples=4000", "--set", "threads=1"]


def test_two_simulated_nodes_train_like_one_and_resume_after_both_agents_die(tmp_path):
    one = tmp_path / "one-node"
    assert bigbatch("train", *NODES, "--nproc", 2, "--out", one).returncode == 0
    run = tmp_path / "two-nodes"
    agents = two_nodes(run, *NODES, "--out", run)
    wait_for_checkpoint(run, agents)
    trees = [kill_tree(a) for a in agents]  # both machines lost
    assert not any(alive(pid) for tree in trees for pid in tree)
    again = tmp_path / "again"
    shutil.copytree(run, again)
    agents = two_nodes(run, "--quiet", "--resume", run)
    assert [a.wait(timeout=120) for a in agents] == [0, 0], [a.communicate() for a in agents]
    assert rows(run) == rows(one)  # two nodes of one rank each are one node of two ranks
    # another number of processes continues the run (correctly, not bitwise)
    result = bigbatch("train", "--quiet", "--resume", again)
    assert result.returncode == 0, result.stderr
    summary = json.loads((again / "summary.json").read_text())
    assert summary["samples"] >= 4000 and summary["processes"] == 1


def test_when_one_simulated_node_dies_the_other_ends_with_one_line(tmp_path):
    run = tmp_path / "lost"
    args = [*SMALL, "--set", "max_samples=400000", "--set", "dist.timeout=5", "--out", run]
    agents = two_nodes(run, *args)
    wait_for_checkpoint(run, agents)
    kill_tree(agents[1])  # one machine lost
    survivor = agents[0]
    began = time.monotonic()
    _, stderr = survivor.communicate(timeout=120)
    assert survivor.returncode != 0 and time.monotonic() - began < 60
    ours = [line for line in stderr.splitlines() if line.startswith("bigbatch: ")]
    assert len(ours) == 1 and "a collective failed or timed out" in ours[0], stderr


def run_cli(*args):
    return cli.main([str(a) for a in args])


def test_an_out_that_cannot_be_written_is_one_line(tmp_path, capsys, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert run_cli("train", *SMALL, "--out", blocker / "run") == 2
    assert "cannot be created: not a directory" in one_line(capsys.readouterr().err)

    def refuse(self, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(self))

    monkeypatch.setattr(type(tmp_path), "mkdir", refuse)  # a read-only file system
    assert run_cli("train", *SMALL, "--out", tmp_path / "ro" / "run") == 2
    assert "cannot be created: permission denied" in one_line(capsys.readouterr().err)


def test_a_full_disk_keeps_the_last_checkpoint_and_the_run_resumes(tmp_path, capsys, monkeypatch):
    args = [*SMALL, "--set", "max_samples=12000"]
    straight, full = tmp_path / "straight", tmp_path / "full"
    assert run_cli("train", *args, "--out", straight) == 0
    save, calls = torch.save, []

    def save_until_full(obj, f):
        calls.append(1)
        if len(calls) == 3:  # the third checkpoint: half written, then the disk is full
            f.write(b"x" * 100)
            raise OSError(errno.ENOSPC, "No space left on device")
        return save(obj, f)

    monkeypatch.setattr(rundir.torch, "save", save_until_full)
    capsys.readouterr()
    assert run_cli("train", *args, "--out", full) == 2
    line = one_line(capsys.readouterr().err)
    assert "no space left on device" in line and "checkpoint.pt" in line
    assert not list(full.glob(".*.tmp"))  # the half-written file is gone
    kept = torch.load(full / "checkpoint.pt", weights_only=True)  # the last complete one
    assert kept["run"]["metrics_lines"] == 5
    summary = json.loads((full / "summary.json").read_text())  # how it ended, and why
    assert summary["ended"] == "error" and "no space left on device" in summary["why"]
    monkeypatch.setattr(rundir.torch, "save", save)  # room again
    assert run_cli("train", "--quiet", "--resume", full) == 0
    assert rows(full) == rows(straight)
    assert json.loads((full / "summary.json").read_text())["ended"] == "budget"


@pytest.mark.parametrize("when", ["while", "after"])
def test_a_kill_at_the_first_checkpoint_leaves_a_directory_out_reuses_or_that_resumes(
    tmp_path, when
):
    """SIGKILL halfway through the first ``torch.save``: no run was made, so the directory
    holds nothing that blocks ``--out``. Just after it landed: the run resumes (config.toml
    was written after it, and a kill between the two left a directory nothing took)."""
    out = tmp_path / "run"
    kill = "os.kill(os.getpid(), signal.SIGKILL)"
    if when == "while":
        patch = (
            "def save(obj, f, *a, **k):\n"
            f"    f.write(b'PK half a checkpoint'); f.flush(); {kill}\n"
            "rundir.torch.save = save\n"
        )
    else:
        patch = (
            "save = runner.save_atomically\n"
            f"runner.save_atomically = lambda *a, **k: (save(*a, **k), {kill})\n"
        )
    child = (
        "import os, signal\n"
        "from bigbatch.experiments import rundir, runner\n"
        f"{patch}"
        "from bigbatch import cli\n"
        f"cli.main(['train', *{SMALL!r}, '--set', 'max_samples=1000', '--out', {str(out)!r}])\n"
    )
    assert subprocess.run([sys.executable, "-c", child]).returncode == -signal.SIGKILL
    assert (out / "config.toml").is_file()
    if when == "while":
        assert not (out / "checkpoint.pt").exists()
        assert run_cli("train", *SMALL, "--set", "max_samples=1000", "--out", out) == 0
    else:
        assert run_cli("train", "--quiet", "--resume", out) == 0
    assert json.loads((out / "summary.json").read_text())["samples"] >= 1000


def test_a_disk_without_room_for_two_checkpoints_is_refused_up_front(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(rundir.shutil, "disk_usage", lambda path: type("U", (), {"free": 1000}))
    assert run_cli("train", *SMALL, "--out", tmp_path / "run") == 2
    assert "MiB free; the run needs about" in one_line(capsys.readouterr().err)
    assert not (tmp_path / "run").exists()  # nothing left that would block the same --out


def test_a_training_set_smaller_than_the_first_batch_is_one_line(tmp_path, capsys):
    out = tmp_path / "tiny"
    assert run_cli("train", *SMALL, "--set", "train_samples=20", "--out", out) == 2
    assert "is larger than the training set (20 samples" in one_line(capsys.readouterr().err)
    assert not out.exists()
    small = [*SMALL, "--set", "train_samples=100", "--set", "max_samples=3000"]
    assert run_cli("train", *small, "--out", out) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["batch_max_lowered_from"] == 16384
    assert max(r["batch_size"] for r in rows(out)) <= 100


def test_a_run_of_non_finite_steps_stops_with_code_3_and_summaries_are_strict_json(
    tmp_path, capsys
):
    broken = [*SMALL, "--set", "lr=1e6", "--set", "max_samples=20000"]
    assert run_cli("train", *broken, "--out", tmp_path / "stopped") == 3
    line = one_line(capsys.readouterr().err)
    assert "optimizer steps were skipped" in line and "skip_limit" in line
    assert (tmp_path / "stopped" / "checkpoint.pt").is_file()
    stopped = json.loads((tmp_path / "stopped" / "summary.json").read_text())
    assert stopped["ended"] == "skip_limit" and stopped["diverged"] in line
    assert stopped["final_accuracy"] is None and stopped["skipped_steps"] > 0  # no score
    allowed = tmp_path / "allowed"
    assert run_cli("train", *broken, "--set", "skip_limit=1", "--out", allowed) == 0
    assert "skipped)" in capsys.readouterr().out  # the console's last line counts them
    text = (allowed / "summary.json").read_text()
    summary = json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in JSON"))
    assert summary["skipped_steps"] > 0
    assert summary["final_eval_loss"] is None and "nan" in summary["final_eval_loss_why"]


def test_a_signal_while_a_compares_run_writes_its_report_stops_the_compare(
    tmp_path, monkeypatch, capsys
):
    """SIGINT after a run's last step (its report being drawn) was read by nobody: the
    comparison trained every other run and exited 0. It stops before the next run now, and
    the same command again finishes the comparison."""
    from bigbatch.experiments.report import run as run_report

    original, sent = run_report.render, []

    def render(folder):
        if not sent:
            sent.append(folder)
            os.kill(os.getpid(), signal.SIGINT)
        return original(folder)

    monkeypatch.setattr(run_report, "render", render)
    out = tmp_path / "cmp"
    argv = ["compare", "--task", "digits", "--set", "max_samples=1000", "--set", "threads=1",
            "--vary", "seed=0,1", "--quiet", "--out", str(out)]  # fmt: skip
    assert cli.main(argv) == 130
    assert "stopped by SIGINT between runs; run the same command again" in capsys.readouterr().err
    assert len(list(out.glob("run*/summary.json"))) == 1
    assert cli.main(argv) == 0 and len(list(out.glob("run*/summary.json"))) == 2
