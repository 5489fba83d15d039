"""The trust ratios of LARS and LAMB: 1 where a norm is zero, LARS's formula, LARC's clip."""

import pytest
import torch

from bigbatch.optim._trust import lars_ratio, trust_ratio


def test_trust_ratio_is_one_where_either_norm_is_zero():
    w_norm = torch.tensor([0.0, 2.0, 0.0, 3.0])
    u_norm = torch.tensor([1.0, 0.0, 0.0, 4.0])
    ratio = torch.tensor([5.0, 6.0, 7.0, 8.0])
    assert trust_ratio(w_norm, u_norm, ratio).tolist() == [1.0, 1.0, 1.0, 8.0]


def lars(w_norm, g_norm, lr=0.1, trust_clip=False):
    return lars_ratio(
        torch.tensor(w_norm),
        torch.tensor(g_norm),
        lr=lr,
        weight_decay=0.1,
        trust_coefficient=0.001,
        eps=1e-8,
        trust_clip=trust_clip,
    ).item()


def test_lars_ratio_is_eta_w_over_g_plus_decay_w():
    assert lars(2.0, 3.0) == pytest.approx(0.001 * 2.0 / (3.0 + 0.1 * 2.0 + 1e-8))
    assert lars(0.0, 3.0) == 1.0 and lars(2.0, 0.0) == 1.0


def test_trust_clip_divides_by_the_rate_and_caps_at_one():
    assert lars(2.0, 3.0, lr=0.1, trust_clip=True) == pytest.approx(0.001 * 2.0 / 3.2 / 0.1)
    assert lars(2.0, 3.0, lr=1e-4, trust_clip=True) == 1.0  # 6.25 times the rate: capped
    rate = torch.tensor(0.1)  # a tensor rate (no host read) gives the same
    assert lars(2.0, 3.0, lr=rate, trust_clip=True) == pytest.approx(0.00625)
