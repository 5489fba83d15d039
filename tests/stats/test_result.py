"""A step's statistics, read to the host in one transfer."""

import pytest
import torch

from bigbatch.stats import GradientStats
from bigbatch.stats.result import SCALARS


def make_stats(loss=None, group_halves=None):
    return GradientStats(
        similarity=torch.tensor(0.25),
        group_similarity=torch.tensor([0.5, -0.125]),
        grad_sq_norm=torch.tensor(2.0),
        trace=torch.tensor(40.0),
        noise_scale=torch.tensor(20.0),
        grad_sq_norm_ema=torch.tensor(1.5),
        trace_ema=torch.tensor(36.0),
        sizes=[8, 8, 16],
        loss=loss,
        group_halves=group_halves,
    )


def test_as_floats_holds_the_scalars_the_loss_and_each_groups_similarity():
    halves = torch.tensor([[1.0, 2.0], [3.0, 4.0], [0.5, -1.0]])
    stats = make_stats(loss=torch.tensor(0.75), group_halves=halves)
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


def test_the_values_are_read_once_and_copies_are_handed_out():
    stats = make_stats(group_halves=torch.zeros(3, 2))
    first = stats.as_floats()
    first["trace"] = -1.0
    stats.host_group_halves()[0][0] = 9.0
    stats.trace.fill_(7.0)  # read already: the host copy stays
    assert stats.as_floats()["trace"] == pytest.approx(40.0)
    assert stats.host_group_halves()[0] == [0.0, 0.0]
