"""The half-split terms ``(|g_A|², |g_B|², <g_A, g_B>)`` per group: measured from the
micro-batches of one process, and expected from the noise scalars."""

import pytest
import torch

from bigbatch._tensors import norms
from bigbatch.parallel.world import World
from bigbatch.stats.halves import FromNoiseScalars, SplitMicroBatches
from bigbatch.stats.layout import ParamLayout, SubBatches
from bigbatch.stats.result import Gather

from .common import backward_micro_batches, sub_batches

SIZES = [3, 5, 2, 6, 4]  # split: half A the first two micro-batches (8 samples), B 12


def per_group(values):
    """Per-parameter values summed per group: the first two parameters, then the third."""
    return [float(values[0] + values[1]), float(values[2])]


def gathered(halves, grads):
    """What ``halves`` puts into a step's read, as the floats read back."""
    into = Gather()
    halves.gather(into, grads)
    return into.split(into.tensor().tolist())


def test_split_micro_batches_measures_each_half_per_group():
    params = [torch.zeros(4, 3, requires_grad=True), torch.zeros(5, requires_grad=True)]
    params.append(torch.zeros(2, requires_grad=True))
    layout = ParamLayout([params[:2], params[2:]])
    batches = sub_batches(SIZES)
    halves = SplitMicroBatches(layout)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):  # the second step reuses the first one's buffer
        for p in params:
            p.grad = None
        increments = [[torch.randn(p.shape, generator=gen) for p in params] for _ in SIZES]
        halves.begin(batches)
        backward_micro_batches(
            params, increments, batches, before=lambda i: halves.before_backward(i, batches)
        )
        grads = layout.grads()
        sq_full = layout.per_group(norms(grads), square=True).tolist()
        got = halves.read(gathered(halves, grads), sq_full, None, None, batches)
        a = [sum(step[j] for step in increments[:2]).double() for j in range(3)]
        b = [sum(step[j] for step in increments[2:]).double() for j in range(3)]
        expected = (
            per_group([x.square().sum() for x in a]),
            per_group([x.square().sum() for x in b]),
            per_group([(x * y).sum() for x, y in zip(a, b)]),
        )
        for value, want in zip(got, expected):
            assert value == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert halves.memory() == 4 * sum(p.numel() for p in params)  # one copy of the gradient


def test_split_micro_batches_needs_two_and_the_half_way_announcement():
    halves = SplitMicroBatches(ParamLayout([[torch.zeros(3, requires_grad=True)]]))
    with pytest.raises(ValueError, match="at least 2 micro-batches"):
        halves.begin(sub_batches([8]))
    batches = sub_batches([4, 4])
    halves.begin(batches)
    halves.before_backward(0, batches)  # micro-batch 1 (half B) never announced
    with pytest.raises(RuntimeError, match="never announced"):
        halves.gather(Gather(), [torch.ones(3)])


@pytest.mark.parametrize("dataset_size", [None, 100])
def test_from_noise_scalars_gives_the_expected_terms_of_two_equal_halves(dataset_size):
    """Equal halves whatever the layout: the halves of the micro-batches or, under DDP, of
    the ranks made 8 against 12 here, and 1/3 against 2/3 on 3 ranks, where one process
    split the same batch evenly: another similarity, another SimiGrad batch."""
    signal, trace = [2.0, 0.5], [30.0, 4.0]
    got = FromNoiseScalars(dataset_size).read({}, [], signal, trace, sub_batches(SIZES))
    three_ranks = SubBatches([8], [[8], [6], [6]], [8 / 20], World(rank=0, size=3))
    assert FromNoiseScalars(dataset_size).read({}, [], signal, trace, three_ranks) == got
    g, t = torch.tensor(signal), torch.tensor(trace)
    if dataset_size is None:  # E|g_X|² = |G|² + trΣ / B_X, E<g_A, g_B> = |G|²
        expected = (g + t / 10, g + t / 10, g)
    else:  # without replacement from 100: trΣ (N - B_X) / (B_X (N - 1)), cross -trΣ / (N - 1)
        expected = (g + t * 90 / (10 * 99), g + t * 90 / (10 * 99), g - t / 99)
    for value, want in zip(got, expected):
        assert value == pytest.approx(want.tolist())


def test_scalar_halves_of_an_odd_batch_are_half_of_it_each():
    """7 samples: halves of 3.5 each (the floor, 3, read the cosine 0.375 for 0.4118)."""
    from types import SimpleNamespace

    from bigbatch.stats.estimators import scalar_halves

    got = FromNoiseScalars(None).read({}, [], [1.0], [5.0], SimpleNamespace(total=7))
    expected = scalar_halves(torch.tensor(1.0), torch.tensor(5.0), 3.5, 3.5)
    for g, e in zip(got, expected, strict=True):
        assert float(g[0]) == pytest.approx(float(e))
