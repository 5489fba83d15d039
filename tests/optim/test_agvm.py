"""AGVM: module groups, μ dynamics (docs/algorithms.md, "AGVM"), the LR around the step, state."""

import math

import pytest
import torch
from torch import nn

from bigbatch.optim import AGVM, module_groups, module_param_groups
from bigbatch.stats import GradientStats


class Detector(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6))
        self.neck = nn.Linear(6, 6)
        self.bbox_head = nn.Linear(6, 2)

    def forward(self, x):
        return self.bbox_head(self.neck(self.backbone(x)))


def stats_with_halves(halves):
    """GradientStats carrying only what AGVM reads."""
    return GradientStats(0.0, [], 0.0, 0.0, 0.0, 0.0, 0.0, sizes=[1, 1],
                         group_halves=halves.tolist())  # fmt: skip


def halves_for(cosines):
    """(sq_a, sq_b, dot) per group with the given cosines (unit norms)."""
    c = torch.tensor(cosines, dtype=torch.float64)
    return torch.stack([torch.ones_like(c), torch.ones_like(c), c])


def test_rules_group_parameters_by_module_name():
    model = Detector()
    groups = module_groups(model, "detection")
    assert list(groups) == ["backbone", "neck", "head"]
    assert groups["head"] == ["bbox_head.weight", "bbox_head.bias"]
    assert list(module_groups(model, "top")) == ["backbone", "neck", "bbox_head"]
    assert list(module_groups(model, "ends")) == ["first", "body", "last"]
    assert list(module_groups(model, {"a": ["backbone.*"], "b": ["*"]})) == ["a", "b"]
    with pytest.raises(ValueError, match=r"'neck\.weight' matches no module group"):
        module_groups(model, {"a": ["backbone.*"], "b": ["*head*"]})
    with pytest.raises(ValueError, match="unknown module-group rule 'yolo'"):
        module_groups(model, "yolo")
    # one pattern written as a string is that pattern ("backbone.*" was read character by
    # character, and its "*" matched every parameter)
    one = module_groups(model, {"a": "backbone.*", "b": "*"})
    assert one["a"] == module_groups(model, "detection")["backbone"]
    with pytest.raises(TypeError, match="rule must be a rule's name or a mapping"):
        module_groups(model, 5)


def test_module_param_groups_split_decay_within_each_module():
    groups = module_param_groups(Detector(), 0.05, "detection")
    tags = [(g["agvm_group"], g["weight_decay"], len(g["params"])) for g in groups]
    assert tags == [
        ("backbone", 0.05, 1),
        ("backbone", 0.0, 3),  # bias, LayerNorm weight and bias
        ("neck", 0.05, 1),
        ("neck", 0.0, 1),
        ("head", 0.05, 1),
        ("head", 0.0, 1),
    ]


def test_mu_follows_the_published_update_and_clamps():
    model = Detector()
    optimizer = AGVM(
        torch.optim.SGD(module_param_groups(model, 0.01, "detection"), lr=0.1), start=0, interval=1
    )
    # per param group halves: every group of a module gets the same cosine
    cosines = [0.9, 0.9, 0.5, 0.5, 0.999, 0.999]
    optimizer.update(halves_for(cosines))
    d0, d_neck, d_head = 0.1, 0.5, 0.001
    s_neck = math.sqrt(min(max((d0 + 1e-6) / (d_neck + 1e-6), 0.5), 10))
    s_head = math.sqrt(min(max((d0 + 1e-6) / (d_head + 1e-6), 0.5), 10))
    assert optimizer.multipliers == pytest.approx([1.0, 0.97 + 0.03 * s_neck, 0.97 + 0.03 * s_head])
    assert s_neck == pytest.approx(math.sqrt(0.5)) and s_head == pytest.approx(math.sqrt(10))


def test_a_group_without_gradient_holds_its_mu_and_a_reference_without_one_moves_none():
    """Both halves 0 (a module unused or frozen that step) read as cosine 0, D = 1: the
    group's μ was pulled toward its floor, and a reference without gradient raised all."""
    model = Detector()
    optimizer = AGVM(
        torch.optim.SGD(module_param_groups(model, 0.01, "detection"), lr=0.1), start=0, interval=1
    )
    halves = halves_for([0.9, 0.9, 0.5, 0.5, 0.999, 0.999])
    halves[:, 4:] = 0.0  # the head has no gradient
    optimizer.update(halves)
    neck = optimizer.multipliers[1]
    assert neck != 1.0 and optimizer.multipliers[2] == 1.0
    halves[:, :2] = 0.0  # nor the reference
    optimizer.update(halves)
    assert optimizer.multipliers == [1.0, neck, 1.0]


def test_group_cosine_pools_its_param_groups():
    model = Detector()
    optimizer = AGVM(torch.optim.SGD(module_param_groups(model, 0.01, "ends"), lr=0.1))
    # "first" has two param groups; its cosine pools them, it is not their mean
    halves = torch.tensor(
        [
            [4.0, 1.0, 1.0, 1.0, 1.0, 1.0],
            [4.0, 1.0, 1.0, 1.0, 1.0, 1.0],
            [4.0, -1.0, 0.5, 0.5, 0.5, 0.5],
        ],
        dtype=torch.float64,
    )
    optimizer.update(halves)
    pooled = (4.0 - 1.0) / 5.0
    d0, d1 = 1 - pooled, 0.5
    expected = math.sqrt(min(max((d0 + 1e-6) / (d1 + 1e-6), 0.5), 10))
    assert optimizer.multipliers[1] == pytest.approx(0.97 + 0.03 * expected)


def test_lr_is_scaled_around_the_step_from_start_every_interval():
    model = Detector()
    groups = module_param_groups(model, 0.01, "detection")
    optimizer = AGVM(torch.optim.SGD(groups, lr=0.1), start=2, interval=3)
    cosines = halves_for([0.9, 0.9, 0.5, 0.5, 0.99, 0.99])
    history = []
    for _ in range(8):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        before = model.neck.weight.detach().clone()
        optimizer.observe(stats_with_halves(cosines))
        optimizer.step()
        step_taken = (before - model.neck.weight.detach())[0, 0].item()
        history.append(optimizer.multipliers[1])
        # SGD with weight decay 0.01 on the neck's weight: lr μ (g + λ w)
        expected = 0.1 * optimizer.multipliers[1] * (1 + 0.01 * before[0, 0].item())
        assert step_taken == pytest.approx(expected)
        assert all(g["lr"] == 0.1 for g in optimizer.param_groups)  # restored
    changes = [i + 1 for i in range(8) if history[i] != (history[i - 1] if i else 1.0)]
    assert changes == [5, 8]  # steps start + interval, start + 2 interval


def test_state_round_trip(tmp_path):
    model = Detector()
    optimizer = AGVM(
        torch.optim.AdamW(module_param_groups(model, 0.01, "detection"), lr=1e-3), start=0
    )
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    for _ in range(5):
        optimizer.observe(stats_with_halves(halves_for([0.9, 0.9, 0.4, 0.4, 0.7, 0.7])))
        optimizer.step()
    torch.save(optimizer.state_dict(), tmp_path / "agvm.pt")
    twin = AGVM(
        torch.optim.AdamW(module_param_groups(Detector(), 0.01, "detection"), lr=1e-3), start=0
    )
    twin.load_state_dict(torch.load(tmp_path / "agvm.pt", weights_only=True))
    assert twin.multipliers == optimizer.multipliers and twin._steps == 5


def test_a_state_of_other_module_groups_is_refused_before_anything_is_loaded():
    model = Detector()
    optimizer = AGVM(torch.optim.SGD(module_param_groups(model, 0.01, "detection"), lr=0.1))
    state = optimizer.state_dict()
    state["wrapper"]["multipliers"] = state["wrapper"]["multipliers"][:2]  # re-tagged groups
    with pytest.raises(ValueError, match="has 2 multipliers where this AGVM has 3 module"):
        optimizer.load_state_dict(state)


def test_bad_settings_are_named():
    groups = module_param_groups(Detector(), 0.0, "detection")
    with pytest.raises(ValueError, match="interval"):
        AGVM(torch.optim.SGD(groups, lr=0.1), interval=0)
    with pytest.raises(ValueError, match="momentum"):
        AGVM(torch.optim.SGD(groups, lr=0.1), momentum=1.0)
    with pytest.raises(ValueError, match="at least 2 module groups"):
        AGVM(torch.optim.SGD(Detector().parameters(), lr=0.1))
