"""A step's statistics: gathered on the device, read to the host in one transfer."""

import pytest
import torch

from bigbatch.stats import GradientStats
from bigbatch.stats.result import SCALARS, Gather, PendingStats
from bigbatch.testing import count_ops


def make_stats(loss=None, group_halves=None):
    return GradientStats(
        similarity=0.25,
        group_similarity=[0.5, -0.125],
        grad_sq_norm=2.0,
        trace=40.0,
        noise_scale=20.0,
        grad_sq_norm_ema=1.5,
        trace_ema=36.0,
        sizes=[8, 8, 16],
        loss=loss,
        group_halves=group_halves,
    )


def test_as_floats_holds_the_scalars_the_loss_and_each_groups_similarity():
    stats = make_stats(loss=0.75, group_halves=[[1.0, 2.0], [3.0, 4.0], [0.5, -1.0]])
    assert stats.as_floats() == {
        "similarity": 0.25,
        "grad_sq_norm": 2.0,
        "trace": 40.0,
        "noise_scale": 20.0,
        "grad_sq_norm_ema": 1.5,
        "trace_ema": 36.0,
        "loss": 0.75,
        "similarity/group0": 0.5,
        "similarity/group1": -0.125,
    }
    assert stats.host_group_halves() == [[1.0, 2.0], [3.0, 4.0], [0.5, -1.0]]
    assert stats.batch_size == 32


def test_without_a_loss_or_half_terms_there_are_none():
    stats = make_stats()
    floats = stats.as_floats()
    assert "loss" not in floats and set(SCALARS) <= set(floats)
    assert stats.host_group_halves() == []


def test_copies_are_handed_out():
    stats = make_stats(group_halves=[[0.0, 0.0]] * 3)
    stats.as_floats()["trace"] = -1.0
    stats.host_group_halves()[0][0] = 9.0
    assert stats.as_floats()["trace"] == 40.0
    assert stats.host_group_halves()[0] == [0.0, 0.0]


def test_a_gather_is_one_stack_and_splits_back_by_part():
    into = Gather()
    into.scalars("loss", [torch.tensor(0.5)])
    into.scalars("norms", [torch.tensor(1.0, dtype=torch.float64), torch.tensor(2.0)])
    into.vector("sums", torch.tensor([3.0, 4.0, 5.0]))
    assert into.split(into.tensor().tolist()) == {
        "loss": [0.5],
        "norms": [1.0, 2.0],
        "sums": [3.0, 4.0, 5.0],
    }
    scalars_only = Gather()
    scalars_only.scalars("norms", [torch.tensor(1.0)] * 30)
    assert sum(count_ops(scalars_only.tensor).values()) == 1


def test_pending_statistics_are_read_once_in_one_transfer():
    values = torch.tensor([1.0, 2.0])
    decoded = []

    def decode(floats):
        decoded.append(floats)
        return make_stats(loss=floats[0])

    pending = PendingStats(values, decode)
    pending.start()  # nothing to start on the CPU
    first = pending.read()
    values.fill_(7.0)  # read already: the host copy stays
    assert pending.read() is first and first.loss == 1.0 and decoded == [[1.0, 2.0]]


@pytest.mark.cuda
def test_pending_statistics_are_copied_without_waiting_on_a_gpu():
    values = torch.arange(3.0, device="cuda")
    pending = PendingStats(values, lambda floats: make_stats(loss=floats[2]))
    pending.start()
    assert pending.read().loss == 2.0
