"""``bigbatch train --nproc N``: DDP runs through torch's launcher, killed and resumed."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from .test_cli import rows

pytestmark = pytest.mark.processes

# the CPU: these runs are compared bitwise, and --nproc 2 uses two gloo ranks even where a
# GPU exists (tests/experiments/test_device.py trains on the GPU)
SMALL = [
    "--quiet",
    "--set",
    "device=cpu",
    "--set",
    "task=digits",
    "--set",
    "eval_every=10",
    "--set",
    "checkpoint_every=5",
    "--set",
    "batch.initial=32",
]


def bigbatch(*args, wait=True, capture=False):
    """``bigbatch ARGS`` in a new process: its result, or (``wait=False``) the running
    process, in a session of its own (``capture``: its stdout and stderr piped)."""
    command = [sys.executable, "-m", "bigbatch.cli", *map(str, args)]
    if not wait:
        pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) if capture else {}
        return subprocess.Popen(command, start_new_session=True, **pipes)
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def test_two_processes_train_like_one_on_the_same_batches(tmp_path):
    constant = [*SMALL, "--set", "batch.controller=constant", "--set", "max_samples=3000"]
    constant += ["--set", "log_statistics=true", "--set", "statistics_every=1"]  # every step
    one, two = tmp_path / "one", tmp_path / "two"
    assert bigbatch("train", *constant, "--out", one).returncode == 0
    result = bigbatch("train", *constant, "--nproc", 2, "--out", two)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("best accuracy") == 1  # rank 0 reports, once
    a, b = rows(one), rows(two)
    assert [r["batch_size"] for r in a] == [r["batch_size"] for r in b]
    assert [r["loss"] for r in b] == pytest.approx([r["loss"] for r in a], rel=1e-4)
    summary = json.loads((two / "summary.json").read_text())
    assert summary["processes"] == 2
    assert summary["statistics_bytes_per_step"] == 5 * 8  # 2 groups: 2·2 + 1 float64
    assert summary["best_accuracy"] == pytest.approx(
        json.loads((one / "summary.json").read_text())["best_accuracy"], abs=0.01
    )


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (Linux ``/proc``)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:  # "pid (name) state ppid ...": the name may hold spaces and parentheses
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a process that ended meanwhile
        children.setdefault(parent, []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def wait_for_checkpoint(run, processes, periodic=True, timeout=120):
    """Wait until ``run`` holds a periodic checkpoint (``periodic=False``: the one written
    before the first step) while every one of ``processes`` still runs."""
    deadline = time.monotonic() + timeout
    # checkpoint.pt is written before the first step; .prev appears with the first periodic one
    while not (run / ("checkpoint.prev.pt" if periodic else "checkpoint.pt")).exists():
        assert all(p.poll() is None for p in processes), "a run ended before its checkpoint"
        assert time.monotonic() < deadline
        time.sleep(0.02)


def kill_tree(process) -> list[int]:
    """SIGKILL ``process`` and every process it started, as a lost machine would.

    torch's launcher starts each rank in a session of its own, so killing the
    command's process group alone would leave the ranks training (and writing
    checkpoints) on their own.
    """
    tree = process_tree(process.pid)
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    process.wait()
    # SIGKILL is delivered asynchronously: the ranks are gone moments after their parent
    deadline = time.monotonic() + 60
    while any(alive(pid) for pid in tree):
        assert time.monotonic() < deadline, "a killed process survived"
        time.sleep(0.02)
    return tree


def kill_after_first_checkpoint(run, *args, periodic=True):
    """Start a run and kill it and everything it started once it has written a periodic
    checkpoint (or, ``periodic=False``, the one before its first step)."""
    process = bigbatch("train", *args, "--out", run, wait=False)
    wait_for_checkpoint(run, [process], periodic)
    kill_tree(process)


def assert_same_run(run, reference):
    """``run`` logged the same steps as ``reference`` and ended with bitwise-equal weights."""
    assert rows(run) == rows(reference)
    a = torch.load(run / "checkpoint.pt", weights_only=True)["loop"]["model"]
    b = torch.load(reference / "checkpoint.pt", weights_only=True)["loop"]["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie waiting to be reaped runs no code)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_compressed_two_process_run_reports_its_traffic(tmp_path):
    out = tmp_path / "ef"
    compression = ["--set", "dist.compression=ef", "--set", "dist.ratio=0.1", "--nproc", 2]
    result = bigbatch("train", *SMALL, "--set", "max_samples=6000", *compression, "--out", out)
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    # 10 plain warm-up steps, then about a fifth of the bytes (values and int64 indices)
    assert summary["compressed_bytes_per_step"] < 0.5 * summary["uncompressed_bytes_per_step"]
    assert summary["best_accuracy"] > 0.5
    # (one process refuses compression: tests/test_bad_input.py; one micro-batch a rank:
    # tests/test_assembly.py)


def test_torchs_powersgd_hook_trains_two_processes_and_its_warnings_print_once(tmp_path):
    out = tmp_path / "powersgd"
    compression = ["--set", "dist.compression=powersgd", "--nproc", 2]
    unread = ["--set", "dist.ratio=0.1"]  # Top-K's: the launcher and each rank plan the run
    result = bigbatch("train", *SMALL, "--set", "max_samples=2000", *compression, *unread,
                      "--out", out)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "summary.json").read_text())["best_accuracy"] > 0.3
    assert result.stderr.count("dist.ratio = 0.1 is set, but") == 1, result.stderr


def test_explain_with_nproc_explains_the_run_its_ranks_build():
    """--explain --nproc 2 builds the run in two processes, as they train it: SimiGrad's
    similarity is the scalar one (one process built it as one: 'split'), FSDP2 shards
    (one process warned it would not), a compression is built (each process its share of
    the cores)."""
    from bigbatch.experiments.device import share_of_cores

    def lines(*keys):
        args = [a for key in keys for a in ("--set", key)]
        result = bigbatch("train", "--explain", "--nproc", 2, "--set", "device=cpu", *args)
        assert result.returncode == 0, result.stderr
        return result.stderr, dict(line.split(maxsplit=1) for line in
                                   result.stdout.splitlines()[3:5])  # fmt: skip

    warned, simigrad = lines("batch.controller=simigrad", "dist.strategy=fsdp")
    assert simigrad["noise"].endswith(
        "1 micro-batch a process at least, measured every step; similarity scalar "
        "(noise_from = 'auto': every trained parameter is in a layer with a rule)"
    )
    assert "warning" not in warned, warned
    threads = share_of_cores(2)
    assert simigrad["machine"] == (
        f"2 processes (--nproc), each on cpu, {threads} thread{'s' if threads > 1 else ''} "
        "(the cores shared among them); forward passes in fp32"
    )
    _, compressed = lines("dist.compression=ef", "task=digits")
    assert compressed["noise"].startswith("the spread of the micro-batches' gradients, 2 ")
    assert compressed["machine"].endswith("; gradients compressed (ef)")
    refused = bigbatch("train", "--explain", "--nproc", 2, "--set", "task=digits",
                       "--set", "train_samples=10", "--set", "batch.initial=64")  # fmt: skip
    assert refused.returncode == 2
    assert refused.stderr.strip() == (
        "bigbatch: error: batch.initial = 64 is larger than the training set (10 samples, "
        "train_samples)"
    )


@pytest.mark.faults
def test_a_run_sigkilled_before_its_first_step_resumes_to_the_same_result(tmp_path):
    args = [*SMALL, "--set", "max_samples=12000"]
    straight = tmp_path / "straight"
    assert bigbatch("train", *args, "--out", straight).returncode == 0
    killed = tmp_path / "killed"
    kill_after_first_checkpoint(killed, *args, periodic=False)
    assert not (killed / "summary.json").exists()
    result = bigbatch("train", "--quiet", "--resume", killed)
    assert result.returncode == 0, result.stderr
    assert_same_run(killed, straight)
