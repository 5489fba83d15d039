"""What the statistics tests share: a small problem and its micro-batches computed the slow
way, the collector run over them, and micro-batch backward passes for the collector's parts."""

import torch
from torch import nn

from bigbatch.parallel.world import World
from bigbatch.stats.layout import SubBatches


def make_problem(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(23, 6), torch.randint(0, 3, (23,))
    return model, x, y


def micro_batches(x, y, sizes):
    start = 0
    for b in sizes:
        yield x[start : start + b], y[start : start + b]
        start += b


def slow_gradients(model, x, y, sizes):
    """Each micro-batch's mean gradient, flattened, by a separate backward."""
    grads = []
    for xb, yb in micro_batches(x, y, sizes):
        model.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]).double())
    model.zero_grad()
    return grads


def collect(model, x, y, sizes, stats, loss_scale=1.0):
    stats.begin(sizes)
    total = sum(sizes)
    for i, (xb, yb) in enumerate(micro_batches(x, y, sizes)):
        stats.before_backward(i)
        loss = nn.functional.cross_entropy(model(xb), yb) * len(xb) / total
        (loss * loss_scale).backward()
    return stats.finish(loss_scale=torch.tensor(loss_scale))


def sub_batches(sizes, loss_weights=None):
    """One process's step of micro-batches of these sizes (loss weights ``b_i / B`` by default)."""
    total = sum(sizes)
    weights = [b / total for b in sizes] if loss_weights is None else loss_weights
    return SubBatches(list(sizes), [list(sizes)], list(weights), World())


def backward_micro_batches(params, increments, batches, before=None):
    """Backward passes that add ``increments[i][j]`` to ``params[j].grad`` as micro-batch ``i``,
    announced as the collector announces them (``before(i)``, then ``batches.current = i``)."""
    for i, step in enumerate(increments):
        if before is not None:
            before(i)
        batches.current = i
        sum((p * g).sum() for p, g in zip(params, step)).backward()
