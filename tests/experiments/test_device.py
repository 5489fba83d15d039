"""``device = "auto"``: which device a process trains on, with and without GPUs; and the
command line training on a real GPU (``cuda``-marked: skipped without one)."""

import json
import os
import platform
import subprocess
import sys
import warnings

import pytest
import torch

import bigbatch as bb
from bigbatch import cli
from bigbatch.experiments import device
from bigbatch.experiments.device import keep_freed_memory, resolve_device

glibc = pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc"
)


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine has ``n`` GPUs."""

    def have(n):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return have


def test_auto_is_the_cpu_without_a_gpu(gpus):
    gpus(0)
    assert resolve_device("auto") == torch.device("cpu")


def test_auto_is_the_local_ranks_gpu(gpus, monkeypatch):
    gpus(2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert resolve_device("auto") == torch.device("cuda", 1)


def test_auto_takes_the_cpu_when_processes_outnumber_gpus(gpus, monkeypatch):
    gpus(1)  # bigbatch train --nproc 2 on one GPU: NCCL cannot put two ranks on it
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    for rank in ("0", "1"):
        monkeypatch.setenv("LOCAL_RANK", rank)
        with pytest.warns(UserWarning, match="2 processes on this node but 1 GPU"):
            assert resolve_device("auto") == torch.device("cpu")


def test_a_named_gpu_that_is_not_there_is_one_clear_error(gpus):
    gpus(1)
    with pytest.raises(ValueError, match=r"device = 'cuda:3' but this machine has 1 GPU"):
        resolve_device("cuda:3")
    with pytest.raises(ValueError, match=r"device = 'cuda:1' but this machine has 1 GPU"):
        resolve_device("cuda:1")  # the count itself is one past the last


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_only_float16_gets_a_loss_scaler(precision):
    scaler = device.Precision(precision, torch.device("cpu")).scaler()
    assert (scaler is not None) == (precision == "fp16")


#: in a fresh process, as ``bigbatch train`` calls it: in a long-lived test worker every
#: page faulted every time once in CI (likely, not confirmed: the worker's main thread on
#: one of glibc's secondary arenas, whose emptied heaps are unmapped whatever the thresholds)
_FAULTS = """
import resource, torch
from bigbatch.experiments.device import keep_freed_memory

def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(40 << 18).fill_(1.0)  # 40 MiB of float32
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

if {keep}:
    assert keep_freed_memory()
faults()
print(min(faults() for _ in range(5)))
"""


def _fewest_page_faults_of_a_40_mib_block(keep: bool) -> int:
    code = _FAULTS.format(keep=keep)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(done.stdout)


@glibc
def test_kept_memory_is_not_faulted_in_again_at_the_next_step():
    """A 40 MiB tensor, above the largest mmap threshold glibc sets itself (32 MiB), is
    mapped afresh and faults in all its 10,240 pages at every allocation under glibc's
    defaults; kept, an allocation after the first reuses the freed block (not every one:
    one in three faulted again on this machine, glibc 2.36)."""
    assert _fewest_page_faults_of_a_40_mib_block(keep=True) < 1_000


@glibc
def test_the_users_own_malloc_settings_are_left_alone(monkeypatch):
    calls = []

    class Libc:
        def __init__(self, _name):
            self.mallopt = lambda *args: calls.append(args) or 1

    monkeypatch.setattr(device.ctypes, "CDLL", Libc)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    assert not keep_freed_memory() and not calls
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=1024")
    assert not keep_freed_memory() and not calls
    monkeypatch.delenv("GLIBC_TUNABLES")
    assert keep_freed_memory()
    assert calls == [(device._M_MMAP_THRESHOLD, 1 << 30), (device._M_TRIM_THRESHOLD, 1 << 30)]


# ---------------------------------------------------------------- on a CUDA GPU


def run(tmp_path, name, *settings):
    out = tmp_path / name
    args = ["train", "--quiet", "--set", "task=digits", "--set", "max_samples=20000"]
    for setting in settings:
        args += ["--set", setting]
    assert cli.main([*args, "--out", str(out)]) == 0
    return out, json.loads((out / "summary.json").read_text())


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_train_on_cuda_in_each_precision(tmp_path, precision):
    _, summary = run(tmp_path, precision, f"precision={precision}")
    assert summary["device"].startswith("cuda") and summary["precision"] == precision
    assert summary["best_accuracy"] > 0.7


@pytest.mark.cuda
def test_auto_picks_the_gpu_and_a_killed_cuda_run_resumes(tmp_path, monkeypatch):
    straight, summary = run(tmp_path, "straight", "checkpoint_every=5")
    assert summary["device"].startswith("cuda")

    real_step = bb.AdaptiveBatch._optimizer_step

    def crash_after_12(self):
        if self.steps_taken == 12:
            raise KeyboardInterrupt
        return real_step(self)

    killed = tmp_path / "killed"
    monkeypatch.setattr(bb.AdaptiveBatch, "_optimizer_step", crash_after_12)
    args = ["train", "--quiet", "--set", "task=digits", "--set", "max_samples=20000"]
    assert cli.main([*args, "--set", "checkpoint_every=5", "--out", str(killed)]) == 130
    monkeypatch.setattr(bb.AdaptiveBatch, "_optimizer_step", real_step)
    assert cli.main(["train", "--quiet", "--resume", str(killed)]) == 0

    def rows(out):
        lines = (out / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines]

    a, b = rows(straight), rows(killed)
    # GPU reductions may add in another order (atomics): the same path, to float tolerance
    assert [r["batch_size"] for r in a] == [r["batch_size"] for r in b]
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=1e-4)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux's CPU sets")
def test_local_processes_share_the_cores_this_process_may_use_not_the_machines(monkeypatch):
    """A container or a job step given 3 cores of a 64-core machine: 2 processes get one
    thread each, not 32 (which os.cpu_count() gave)."""
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5, 6})
    assert [device.share_of_cores(n) for n in (1, 2, 3, 8)] == [3, 1, 1, 1]
    # the threads a process takes (what set_threads sets and --explain says): the number
    # asked for; else its share under several local processes; else torch's default (None)
    assert [device.threads_of(2, 3), device.threads_of(0, 3), device.threads_of(0, 1)] == [
        2,
        1,
        None,
    ]


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux's CPU sets")
def test_more_threads_than_cores_are_set_and_warned_of(monkeypatch):
    """threads = 1000 on 2 cores was taken silently (torch's threads then wait on each other)."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    chosen: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", chosen.append)
    with pytest.warns(UserWarning, match=r"^threads = 4 is more than the 3 core\(s\) here$"):
        device.set_threads(4)
    each = r"threads = 2 is more than the 1 core\(s\) each of 3 processes has"
    with pytest.warns(UserWarning, match=each):
        device.set_threads(2, local_processes=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        device.set_threads(3)  # every core: as asked, nothing said
        device.set_threads(0, local_processes=3)  # the share
    assert chosen == [4, 2, 3, 1]
