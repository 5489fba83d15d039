"""The operators a bigbatch step dispatches against a plain PyTorch step's (issue 73's bound).

A small model's GPU step is bound by kernel launches, one per dispatched operator,
and the count is the same on every machine: counted here on the ``meta`` device
(nothing computed, so GPT-2 at its context of 1,024 takes seconds), with torch's
AdamW (``foreach=True``) in every arm so that the optimizer dispatches alike. The
bound: the default statistics at most 1.15x a plain step's operators, statistics
off at most 1.02x. ``benchmarks/step_cost.py --part ops`` prints the full table.
"""

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import bigbatch as bb
from bigbatch.experiments.tasks import TinyTransformer
from bigbatch.testing import count_ops

#: (vocabulary, width, depth, heads, context): the text task, the same at GPU scale, GPT-2
SHAPES = {
    "text": (256, 64, 2, 4, 32),
    "text-gpu": (256, 256, 4, 4, 256),
    "gpt2": (50_257, 768, 12, 12, 1024),
}
DEFAULT_BOUND, OFF_BOUND = 1.15, 1.02


def counts(shape: str, batch: int, norm: type[nn.Module] = nn.LayerNorm) -> dict[str, int]:
    """Operators of one optimizer step after two warm-up steps: plain, default, off."""
    vocab, width, depth, heads, context = SHAPES[shape]
    with torch.device("meta"):
        model = TinyTransformer(vocab, context, width, depth, heads=heads)
        for parent in list(model.modules()):  # the LayerNorms as ``norm`` (RMSNorm: Llama's)
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.LayerNorm):
                    setattr(parent, name, norm(child.normalized_shape))
        tokens = torch.zeros(2 * batch, context + 1, dtype=torch.long)
    return _count(model, TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch)


def _count(model: nn.Module, data: TensorDataset, batch: int) -> dict[str, int]:
    out = {}
    for arm in ("plain", "default", "off"):
        step, loop = stepper(arm, model, data, batch)
        count_ops(step)  # warm-up steps (on meta, a read needs the counting mode)
        count_ops(step)
        out[arm] = sum(count_ops(step).values())
        if loop is not None and loop.collector is not None:
            loop.collector.close()
    return out


def stepper(arm, model, data, batch):
    """One optimizer step of ``arm`` as a function, and its loop (None for plain)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)

    def loss(x, y):
        logits = model(x)
        return nn.functional.cross_entropy(logits.flatten(0, -2), y.flatten())

    if arm == "plain":

        def plain():
            x, y = data[:batch]
            loss(x, y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return plain, None
    loop = bb.AdaptiveBatch(
        model, optimizer, data, controller=bb.batch.Constant(batch), statistics=arm == "default"
    )

    def adaptive():
        for s in loop.steps(max_steps=loop.steps_taken + 1):
            for x, y in s.micro_batches():
                s.backward(loss(x, y))
            s.apply()

    return adaptive, loop


@pytest.mark.parametrize(
    "shape, batch",
    [("text", 16), ("text", 1024), ("text-gpu", 64), ("gpt2", 16), ("gpt2", 1024)],
)
def test_a_step_dispatches_about_what_a_plain_step_does(shape, batch):
    got = counts(shape, batch)
    assert got["default"] <= DEFAULT_BOUND * got["plain"], got
    assert got["off"] <= OFF_BOUND * got["plain"], got


def test_rmsnorm_blocks_dispatch_no_more_than_a_plain_step():
    # torch's rms_norm is differentiated op by op; the rule's backward is written out
    got = counts("text", 16, norm=nn.RMSNorm)
    assert got["default"] <= got["plain"] and got["off"] <= OFF_BOUND * got["plain"], got


def test_a_small_layer_takes_its_units_gradients_not_the_gram_form(monkeypatch):
    # units of two rows: the Gram form's eight operators more a layer cost more than the
    # units' products, small as its Gram matrices are
    from bigbatch.stats import per_example

    batch = 16

    def default_ops() -> int:
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 10))
            data = TensorDataset(torch.zeros(2 * batch, 32), torch.zeros(2 * batch).long())
        return _count(model, data, batch)["default"]

    chosen = default_ops()
    monkeypatch.setattr(per_example, "_ghost_is_cheaper", lambda rows, p, q: True)
    gram = default_ops()
    assert chosen <= gram - 2 * 8, (chosen, gram)


def test_a_step_between_measurements_dispatches_what_a_step_without_statistics_does():
    """The default controller learns |G|² from the batch gradient between measurements: its
    norms ride in the loss's one read, squared and added up on the host (before: 10
    operators more, the sum of squares and the loss scale's on the device)."""
    got, metrics = {}, []
    for arm in ("off", "between"):
        torch.manual_seed(0)
        model = TinyTransformer(256, 32, 64, 2, heads=4)
        tokens = torch.randint(0, 256, (64, 33), generator=torch.Generator().manual_seed(0))
        data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        controller = bb.batch.Constant(16) if arm == "off" else bb.batch.BatchWarmup(initial=16)
        loop = bb.AdaptiveBatch(
            model, optimizer, data, controller=controller, statistics=arm == "between",
            statistics_every=4,
        )  # fmt: skip
        steps = loop.steps(max_steps=3)

        def step(steps=steps, model=model):
            s = next(steps)
            for x, y in s.micro_batches():
                s.backward(nn.functional.cross_entropy(model(x).flatten(0, -2), y.flatten()))
            s.apply()
            metrics.append(s.metrics)

        step()  # measures (the first of every 4)
        step()
        got[arm] = count_ops(step)  # the third: between measurements
    assert "batch_grad_sq_norm" in metrics[-1] and "trace" not in metrics[-1]
    launched = {op: n for op, n in (got["between"] - got["off"]).items() if op != "view"}
    assert not launched, launched
