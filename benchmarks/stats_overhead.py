"""What the gradient statistics cost: step time with statistics on vs off, interleaved A/B.

    python benchmarks/stats_overhead.py            # both configurations (~3 min on 2 cores)
    python benchmarks/stats_overhead.py --quick

Two configurations, each a fixed batch of 4 micro-batches through
``bigbatch.AdaptiveBatch`` with a ``Constant`` controller, so the only
difference between the arms is ``statistics=True/False`` (and ``gsnr=True``):

- compute-bound: a 2-layer transformer language model (d=128, 64 tokens,
  vocabulary 256) on random tokens, micro-batches of 256 sequences
  (the ≤ 3% target of issue 3);
- overhead-bound: a 2-layer MLP on 32 features, micro-batches of 64: reported
  as the cost in µs per micro-batch.

Arms alternate step by step, in an order rotated every round (A B C, B C A,
...), so drift on a shared machine and position effects hit all arms alike;
the table gives medians over the steps. Extra memory is the buffers the
statistics allocate (the half-batch gradient, and the Welford M2 with
``gsnr``).
"""

from __future__ import annotations

import argparse
import functools

import torch
from torch import nn
from torch.utils.data import TensorDataset

import bigbatch as bb
from _timing import interleaved, medians


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 128, layers: int = 2, context: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(context, d))
        layer = nn.TransformerEncoderLayer(
            d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)
        mask = torch.triu(torch.full((context, context), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.head(
            self.blocks(h, mask=self.mask[: tokens.shape[1], : tokens.shape[1]], is_causal=True)
        )


def lm_setup(micro: int):
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (4 * micro * 4, 65), generator=gen)
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    torch.manual_seed(0)
    model = TinyLM()

    def loss_fn(batch):
        x, y = batch
        return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())

    return model, data, loss_fn


def mlp_setup(micro: int):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4 * micro * 64, 32, generator=gen)
    data = TensorDataset(x, (x @ torch.randn(32, 10, generator=gen)).argmax(1))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 10))

    def loss_fn(batch):
        x, y = batch
        return nn.functional.cross_entropy(model(x), y)

    return model, data, loss_fn


def make_loop(setup, micro: int, **options):
    model, data, loss_fn = setup(micro)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    loop = bb.AdaptiveBatch(
        model,
        optimizer,
        data,
        controller=bb.batch.Constant(4 * micro),
        max_micro_batch=micro,
        lr_scaling="none",
        **options,
    )
    return loop, loss_fn


def one_step(loop, loss_fn) -> None:
    step = next(loop.steps(max_steps=loop.steps_taken + 1))
    for batch in step.micro_batches():
        step.backward(loss_fn(batch))
    step.apply()


def extra_bytes(loop) -> int:
    return loop.collector.memory() if loop.collector is not None else 0


def compare(name: str, setup, micro: int, steps: int) -> None:
    arms = {
        "off": make_loop(setup, micro, statistics=False),
        "on": make_loop(setup, micro, statistics=True),
        "on + gsnr": make_loop(setup, micro, statistics=True, gsnr=True),
    }
    steppers = {name: functools.partial(one_step, *parts) for name, parts in arms.items()}
    times = medians(interleaved(steppers, steps))
    base = times["off"]
    params = sum(p.numel() for p in arms["off"][0].model.parameters())
    print(
        f"\n{name}: {params / 1e6:.2f}M parameters, 4 micro-batches of {micro}, "
        f"{steps} interleaved steps per arm"
    )
    print("| statistics | median step ms | overhead | extra µs per micro-batch | extra memory |")
    print("|---|---|---|---|---|")
    for arm, (loop, _) in arms.items():
        med = times[arm]
        per_micro = (med - base) / 4 * 1e6
        print(
            f"| {arm} | {med * 1e3:.1f} | {100 * (med / base - 1):+.1f}% | {per_micro:+.0f} | "
            f"{extra_bytes(loop) / 2**20:.2f} MiB |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, smaller LM micro-batch")
    args = parser.parse_args()
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads")
    compare(
        "compute-bound: transformer LM",
        lm_setup,
        64 if args.quick else 256,
        4 if args.quick else 12,
    )
    compare("overhead-bound: MLP", mlp_setup, 64, 20 if args.quick else 200)


if __name__ == "__main__":
    main()
