"""The squared norms of each micro-batch's mean gradient, from the backward hook."""

import copy

import pytest
import torch
from torch import nn

from bigbatch.parallel.world import World
from bigbatch.stats.layout import ParamLayout, SubBatches
from bigbatch.stats.micro_batch_norms import MicroBatchNorms


def test_the_sum_of_each_micro_batchs_mean_gradient_norm_per_group():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))
    groups = [list(model[0].parameters()), list(model[2].parameters())]
    reference = copy.deepcopy(model)  # the expected gradients, away from the hook
    x, y = torch.randn(12, 5), torch.randn(12, 2)
    sizes, weights = [4, 8], [4 / 12, 8 / 12]  # the batch's mean loss, split
    batches = SubBatches(sizes, [sizes], weights, World())
    norms = MicroBatchNorms(ParamLayout(groups), lambda: batches)
    norms.begin(batches)
    expected = torch.zeros(2, dtype=torch.float64)
    for index, (xs, ys) in enumerate(zip(x.split(sizes), y.split(sizes), strict=True)):
        batches.current = index
        loss = nn.functional.mse_loss(model(xs), ys)
        reference_loss = nn.functional.mse_loss(reference(xs), ys)
        mean_grads = torch.autograd.grad(reference_loss, list(reference.parameters()))
        expected += torch.stack(
            [sum(g.double().square().sum() for g in mean_grads[:2]),
             sum(g.double().square().sum() for g in mean_grads[2:])]
        )  # fmt: skip
        (loss * weights[index]).backward()
    small = norms.finish(batches)
    assert torch.allclose(small.sums, expected, rtol=1e-6)  # float32 gradients
    assert (small.count, small.h, small.factor) == (2, (1 / 4 + 1 / 8) / 2, 1.0)
    with pytest.raises(RuntimeError, match="without begin"):
        norms.finish(batches)


def test_a_backward_outside_a_step_is_not_counted():
    model = nn.Linear(3, 1)
    norms = MicroBatchNorms(ParamLayout([list(model.parameters())]), lambda: None)
    model(torch.randn(2, 3)).sum().backward()  # no step: the hook ignores it
    for handle in norms.handles:
        handle.remove()


def test_a_users_autograd_grad_between_steps_runs_and_is_not_counted():
    # torch's register_multi_grad_hook (mode "all") raised inside torch.autograd.grad
    model = nn.Linear(3, 1)
    batches = SubBatches([2, 2], [[2, 2]], [0.5, 0.5], World())
    steps = [None]
    norms = MicroBatchNorms(ParamLayout([list(model.parameters())]), lambda: steps[0])
    x = torch.randn(4, 3)
    grads = torch.autograd.grad(model(x).sum(), list(model.parameters()))
    assert torch.equal(grads[1], torch.tensor([4.0]))
    steps[0] = batches
    norms.begin(batches)
    for index in range(2):
        batches.current = index
        (model(x[2 * index : 2 * index + 2]).mean() * 0.5).backward()
    assert norms.finish(batches).sums.item() > 0
