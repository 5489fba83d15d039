"""Per-example squared gradient norms from the backward pass, against torch.func's per-example
gradients, and the one-pass noise estimate against the sub-batch estimator."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils.data import TensorDataset

import bigbatch as bb
from bigbatch.stats import MicroBatchStatistics, noise_components
from bigbatch.stats.estimators import noise_from_examples
from bigbatch.stats.layout import ParamLayout
from bigbatch.stats.per_example import PerExampleNorms, uncovered

from .common import collect, make_problem, slow_gradients


class Sequences(nn.Module):
    """Every covered layer on sequences: embedding (with padding), LayerNorm, Conv1d, Linear."""

    def __init__(self, vocab=11, width=8, conv=nn.Conv1d):
        super().__init__()
        self.embed = nn.Embedding(vocab, width, padding_idx=0)
        self.norm = nn.LayerNorm(width)
        self.conv = nn.Conv1d(width, width, 3, stride=2, padding=1)
        self.head = nn.Linear(width, 5)

    def forward(self, ids):
        h = self.norm(self.embed(ids))
        h = self.conv(h.transpose(1, 2)).transpose(1, 2)
        return self.head(torch.tanh(h)).mean((1, 2))


class Images(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1, stride=2)
        self.head = nn.Linear(3 * 3 * 3, 1, bias=False)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)).flatten(1)).squeeze(1)


def per_example_sq_norms(model, inputs):
    """``|g_i|²`` of each example's own output, by torch.func (the slow, exact way)."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(p, x):
        return functional_call(model, p, (x[None],)).sum()

    grads = vmap(grad(one), in_dims=(None, 0))(params, inputs)
    return sum(g.reshape(len(inputs), -1).square().sum(1) for g in grads.values())


@pytest.mark.parametrize(
    "model, inputs",
    [
        (Sequences().double(), torch.randint(0, 11, (6, 7))),
        (Images().double(), torch.randn(5, 2, 6, 6, dtype=torch.float64)),
        (nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double(), torch.randn(6, 4)),
    ],
    ids=["embedding-layernorm-conv1d-linear", "conv2d", "mlp"],
)
def test_the_hooks_give_each_examples_squared_norm(model, inputs):
    torch.manual_seed(0)
    inputs = inputs.double() if inputs.is_floating_point() else inputs
    expected = per_example_sq_norms(model, inputs).sum()
    norms = PerExampleNorms(model, ParamLayout([list(model.parameters())]))
    norms.begin()
    weight = 0.25  # the mean loss of the micro-batch, weighted as a loop weights it
    loss = model(inputs).reshape(len(inputs), -1).sum(1).mean() * weight
    norms.set_scale((len(inputs) / weight) ** 2)
    loss.backward()
    torch.testing.assert_close(norms.finish(), expected.reshape(1), rtol=1e-10, atol=0)


@settings(max_examples=20, deadline=None)
@given(steps=st.integers(1, 9), width_in=st.integers(1, 6), width_out=st.integers(1, 6))
def test_the_ghost_norm_and_the_matrix_agree(steps, width_in, width_out):
    # which of the two the rule takes depends on T against the widths: both are exact
    from bigbatch.stats.per_example import _matrix_sq

    a = torch.randn(3, steps, width_in, dtype=torch.float64)
    d = torch.randn(3, steps, width_out, dtype=torch.float64)
    matrix = torch.bmm(d.transpose(1, 2), a).square().sum((1, 2))
    ghost = (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(d, d.transpose(1, 2))).sum((1, 2))
    torch.testing.assert_close(_matrix_sq(a, d), matrix.sum())
    torch.testing.assert_close(ghost, matrix)


def test_what_is_not_covered_is_named():
    bare = nn.Module()
    bare.lin = nn.Linear(2, 2)
    bare.pos = nn.Parameter(torch.zeros(2))
    assert uncovered(bare, list(bare.parameters())) == ["pos"]
    norm = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))  # couples the examples
    assert uncovered(norm, list(norm.parameters())) == ["1.weight", "1.bias"]
    tied = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False))
    tied[1].weight = tied[0].weight
    assert uncovered(tied, list(tied.parameters())) == ["0.weight"]
    # only the trained parameters count: a frozen bare parameter is no obstacle
    bare.pos.requires_grad_(False)
    assert uncovered(bare, [p for p in bare.parameters() if p.requires_grad]) == []
    with pytest.raises(ValueError, match=r"not covered: 1\.weight, 1\.bias"):
        MicroBatchStatistics([list(norm.parameters())], per_example=norm)


def test_a_frozen_parameter_of_a_hooked_layer_counts_for_nothing():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    model[0].bias.requires_grad_(False)
    inputs = torch.randn(5, 4, dtype=torch.float64)
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}

    def one(p, x):
        return functional_call(model, p, (x[None],), strict=False).sum()

    grads = vmap(grad(one), in_dims=(None, 0))(params, inputs)
    expected = sum(g.reshape(5, -1).square().sum(1) for g in grads.values()).sum()
    trained = [p for p in model.parameters() if p.requires_grad]
    norms = PerExampleNorms(model, ParamLayout([trained]))
    norms.begin()
    norms.set_scale(25.0)
    model(inputs).sum(1).mean().backward()
    torch.testing.assert_close(norms.finish(), expected.reshape(1), rtol=1e-10, atol=0)


def test_a_layer_run_twice_in_one_forward_is_refused():
    lin = nn.Linear(3, 3)
    stats = MicroBatchStatistics([list(lin.parameters())], per_example=lin)
    stats.begin([4])
    with pytest.raises(RuntimeError, match="ran twice in one micro-batch"):
        lin(lin(torch.randn(4, 3)))
    stats.begin([4])
    with pytest.raises(RuntimeError, match="without a positional input tensor"):
        lin(input=torch.randn(4, 3))


@pytest.mark.parametrize("sizes", [[23], [12, 11], [6, 6, 6, 5]])
def test_one_pass_noise_equals_the_estimator_on_single_examples(sizes):
    # the one-pass estimate is the sub-batch estimator with every example a sub-batch,
    # whatever the micro-batches: computed the slow way, one backward per example
    model, x, y = make_problem()
    single = slow_gradients(model, x, y, [1] * len(x))  # one backward per example
    mean = torch.stack(single).mean(0)
    signal, trace = noise_components(
        torch.stack([g.square().sum() for g in single]), [1] * len(x), mean.square().sum()
    )
    stats = MicroBatchStatistics([list(model.parameters())], ema_beta=0.0, per_example=model)
    got = collect(model, x, y, sizes, stats, loss_scale=8.0)
    assert got.grad_sq_norm.item() == pytest.approx(signal.item(), rel=1e-4)
    assert got.trace.item() == pytest.approx(trace.item(), rel=1e-4)
    # the similarity is the scalar one: the halves' expectation from the same scalars
    assert 0 < got.similarity.item() < 1


def test_noise_from_examples_is_unbiased_on_a_gaussian_oracle():
    # g_i = G + noise with tr Sigma = dim * sigma^2: the mean over many batches recovers both
    torch.manual_seed(0)
    dim, batch, sigma, trials = 20, 8, 0.5, 4000
    G = torch.ones(dim, dtype=torch.float64) * 0.3
    g = G + sigma * torch.randn(trials, batch, dim, dtype=torch.float64)
    mean_sq = g.square().sum(-1).mean(1)
    full_sq = g.mean(1).square().sum(-1)
    signal, trace = noise_from_examples(mean_sq, batch, full_sq)
    assert signal.mean().item() == pytest.approx(G.square().sum().item(), rel=0.05)
    assert trace.mean().item() == pytest.approx(dim * sigma**2, rel=0.02)


def _three_steps(model, forward, **options):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(256, 16, generator=gen)
    data = TensorDataset(x, (x @ torch.randn(16, 4, generator=gen)).argmax(1))
    loop = bb.AdaptiveBatch(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data,
        controller=bb.batch.Constant(64),
        noise_from="examples",
        lr_scaling="none",
        shuffle=False,
        **options,
    )
    out = []
    for step in loop.steps(max_steps=3):
        for xb, yb in step.micro_batches():
            step.backward(nn.functional.cross_entropy(forward(xb).float(), yb))
        step.apply()
        out.append([step.metrics["grad_sq_norm"], step.metrics["trace"]])
    return torch.tensor(out)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 4))


@pytest.mark.compile
def test_a_compiled_model_gives_the_same_statistics():
    # the hooks run eagerly between the compiled layers (a graph break at each)
    model = _mlp()
    eager = _three_steps(model, model)
    model = _mlp()
    compiled = _three_steps(model, torch.compile(model))
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-6)


def test_bf16_autocast_and_micro_batches_of_a_memory_limit():
    # the rules read bf16 activations in fp32; a step split for memory sums its micro-batches
    model = _mlp()
    whole = _three_steps(model, model)
    model = _mlp()

    def bf16(x):
        with torch.autocast("cpu", torch.bfloat16):
            return model(x)

    half = _three_steps(model, bf16, max_micro_batch=16)
    torch.testing.assert_close(half, whole, rtol=0.1, atol=0)


def test_a_sample_of_each_micro_batch_measures_its_first_examples():
    model, x, y = make_problem()
    sizes, sample = [12, 11], 5
    single = slow_gradients(model, x, y, [1] * len(x))  # one backward per example
    measured = [*range(0, 5), *range(12, 17)]
    mean_sq = torch.stack([single[i].square().sum() for i in measured]).mean()
    signal, trace = noise_from_examples(mean_sq, len(x), torch.stack(single).mean(0).square().sum())
    stats = MicroBatchStatistics(
        [list(model.parameters())], ema_beta=0.0, per_example=model, per_example_sample=sample
    )
    got = collect(model, x, y, sizes, stats)
    assert got.grad_sq_norm.item() == pytest.approx(signal.item(), rel=1e-4)
    assert got.trace.item() == pytest.approx(trace.item(), rel=1e-4)


@pytest.mark.cuda
def test_the_hooks_give_each_examples_squared_norm_on_cuda():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    model = Sequences().cuda()
    inputs = torch.randint(0, 11, (6, 7), device="cuda")
    expected = per_example_sq_norms(model, inputs).sum()
    norms = PerExampleNorms(model, ParamLayout([list(model.parameters())]))
    norms.begin()
    loss = model(inputs).mean()
    norms.set_scale(len(inputs) ** 2)
    loss.backward()
    torch.testing.assert_close(norms.finish().float(), expected.reshape(1), rtol=1e-4, atol=0)
