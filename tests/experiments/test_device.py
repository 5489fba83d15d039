"""``device = "auto"``: which device a process trains on, with and without GPUs."""

import pytest
import torch

from bigbatch.experiments.device import resolve_device


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
