"""What a bigbatch step costs against the step a user writes by hand (issue 55).

    python benchmarks/step_cost.py                          # CPU: text model, GPT-2 shape at 16
    python benchmarks/step_cost.py --device cuda            # a GPU: every batch, bf16
    python benchmarks/step_cost.py --part agreement         # one-pass vs sub-batch noise

**cost.** Arms, each its own copy of the same model and optimizer (LAMB), interleaved
step by step in a rotating order, median step time (CUDA events on a GPU):

- ``plain``: one forward/backward of the whole batch and ``optimizer.step()``;
- ``sub-batches``: ``AdaptiveBatch`` with a ``Constant`` batch and the sub-batch noise
  statistics (``noise_from="sub_batches"``: four micro-batches per step);
- ``examples``: the same with the per-example statistics (``noise_from="examples"``: one
  micro-batch, the noise from the gradient norms of 32 of its examples, taken in the
  same backward); ``all examples``: every example's norm;
- ``off``: the same with ``statistics=False``;
- with ``--every K``, ``sub-batches/K`` and ``examples/K``: the statistics measured at
  every K-th step only (``statistics_every=K``), the steps between unsplit; each timed
  unit is K steps (one measured), so the time is the mean step over the cycle.

Models: the ``text`` task's byte GPT (vocabulary 256, context 32, width 64, 2 layers),
the same at GPU scale (``text-gpu``: context 256, width 256, 4 layers) and a GPT-2-small
shape (width 768, 12 layers, 12 heads, vocabulary 50,257; context ``--gpt2-context``,
1,024 by default, 64 on a CPU, where a step of 1,024 tokens takes minutes).

**agreement.** On the ``text``, ``mnist1d`` and ``lm`` tasks' models, trained for
``--warm-steps`` steps first, both estimators read the same backward passes of
``--batches-measured`` batches of 64 (four micro-batches for the sub-batch one): the
mean ``|G|²``, ``tr Σ`` and ``B_simple = tr Σ / |G|²`` of each, with standard errors.
"""

from __future__ import annotations

import argparse
import contextlib
import copy

import torch
from torch import nn
from torch.utils.data import TensorDataset

import bigbatch as bb
from _timing import interleaved, medians
from bigbatch.experiments.build import with_task_defaults
from bigbatch.experiments.config import resolve
from bigbatch.experiments.tasks import TASKS, TinyTransformer
from bigbatch.stats import MicroBatchStatistics

ARMS = ("plain", "sub-batches", "examples", "all examples", "off")


def arms_of(every: int) -> tuple[str, ...]:
    """The arms timed: :data:`ARMS`, and the two estimators measuring every ``every``-th step."""
    return ARMS if every == 1 else (*ARMS, f"sub-batches/{every}", f"examples/{every}")


MODELS = {
    # name: (vocabulary, width, depth, heads, context)
    "text": (256, 64, 2, 4, 32),
    "text-gpu": (256, 256, 4, 4, 256),  # the text task at GPU scale (docs/results.md)
    "gpt2": (50_257, 768, 12, 12, 1024),
}


def token_data(vocab: int, context: int, sequences: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (sequences, context + 1), generator=gen)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


class Arm:
    """One arm: its model, optimizer and (for the bigbatch arms) loop."""

    def __init__(self, name: str, model: nn.Module, data, batch: int, args) -> None:
        self.name, self.model, self.device = name, model, args.device
        self.optimizer = bb.optim.LAMB(bb.optim.param_groups(model, 0.01), lr=1e-3)
        self.autocast = (
            torch.autocast("cuda", torch.bfloat16)
            if args.device.type == "cuda"
            else contextlib.nullcontext()
        )
        self.data, self.batch, self.position = data, batch, 0
        self.loop = None
        base, _, every = name.partition("/")
        #: optimizer steps per timed unit: a whole cycle of statistics_every
        self.every = int(every or 1)
        if name != "plain":
            self.loop = bb.AdaptiveBatch(
                model,
                self.optimizer,
                data,
                controller=bb.batch.Constant(batch),
                max_micro_batch=max(batch, 1024),
                statistics=name != "off",
                noise_from="sub_batches" if base == "sub-batches" else "examples",
                noise_examples=None if name == "all examples" else 32,
                statistics_every=self.every,
                loader_options={"pin_memory": args.device.type == "cuda"},
            )

    def loss(self, x, y):
        x = x.to(self.device, non_blocking=True)
        y = y.to(self.device, non_blocking=True)
        with self.autocast:
            logits = self.model(x)
        return nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    def step(self) -> None:
        if self.loop is None:
            start = self.position % (len(self.data) - self.batch)
            x, y = self.data[start : start + self.batch]
            self.position += self.batch
            self.loss(x, y).backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            return
        for step in self.loop.steps(max_steps=self.loop.steps_taken + self.every):
            for x, y in step.micro_batches():
                step.backward(self.loss(x, y))
            step.apply()


def cost(model_name: str, batch: int, context: int, steps: int, args) -> None:
    vocab, width, depth, heads, _ = MODELS[model_name]
    data = token_data(vocab, context, max(4 * batch, 256))
    torch.manual_seed(0)
    model = TinyTransformer(vocab, context, width, depth, heads=heads).to(args.device)
    names = arms_of(args.every)
    arms = [Arm(name, copy.deepcopy(model), data, batch, args) for name in names]
    times = medians(interleaved({a.name: a.step for a in arms}, steps, device=args.device))
    times = {a.name: times[a.name] / a.every for a in arms}  # per optimizer step
    plain = times["plain"]
    cells = " | ".join(f"{times[a] * 1e3:.1f} ms ({times[a] / plain:.2f}x)" for a in names[1:])
    print(f"| {model_name} | {batch} | {plain * 1e3:.1f} ms | {cells} |", flush=True)


def _forever(loader):
    """The loader's batches, epoch after epoch (a small training set ends before 300)."""
    while True:
        yield from loader


def agreement(task: str, args) -> None:
    config = with_task_defaults(resolve({"task": task, "device": "cpu"}))
    problem = TASKS[task].build(config)
    model = problem.model.to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(problem.train, batch_size=64, shuffle=True, drop_last=True)
    batches = _forever(loader)
    for _ in range(args.warm_steps):  # away from the initialisation
        loss = problem.loss(model, next(batches))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    params = [list(model.parameters())]
    collectors = {
        "sub-batches": MicroBatchStatistics(params, ema_beta=0.0, similarity="scalar"),
        "examples": MicroBatchStatistics(
            params, ema_beta=0.0, similarity="scalar", per_example=model
        ),
        "4 examples of 16": MicroBatchStatistics(
            params, ema_beta=0.0, similarity="scalar", per_example=model, per_example_sample=4
        ),
    }
    rows: dict[str, list[tuple[float, float]]] = {name: [] for name in collectors}
    for _ in range(args.batches_measured):
        batch = next(batches)
        size = len(batch[0])
        sizes = [size // 4] * 4
        for collector in collectors.values():
            collector.begin(sizes)
        start = 0
        for i, b in enumerate(sizes):
            for collector in collectors.values():
                collector.before_backward(i)
            part = [t[start : start + b] for t in batch]
            (problem.loss(model, part) * b / size).backward()
            start += b
        for name, collector in collectors.items():
            got = collector.finish()
            rows[name].append((got.grad_sq_norm.item(), got.trace.item()))
        model.zero_grad(set_to_none=True)
    for name, values in rows.items():
        signal = torch.tensor([v[0] for v in values], dtype=torch.float64)
        trace = torch.tensor([v[1] for v in values], dtype=torch.float64)
        n = len(values)
        ratio = trace.mean() / signal.mean()
        # the ratio's standard error by the delta method
        cov = torch.cov(torch.stack([trace, signal]))
        var = (
            cov[0, 0] / signal.mean() ** 2
            + trace.mean() ** 2 * cov[1, 1] / signal.mean() ** 4
            - 2 * trace.mean() * cov[0, 1] / signal.mean() ** 3
        ) / n
        print(
            f"| {task} | {name} | {signal.mean():.4g} ± {signal.std() / n**0.5:.2g} | "
            f"{trace.mean():.4g} ± {trace.std() / n**0.5:.2g} | {ratio:.1f} ± {var.sqrt():.1f} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("cost", "agreement", "both"), default="cost")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--models", default="text,gpt2")
    parser.add_argument("--batches", default="16,64,256,1024")
    parser.add_argument("--gpt2-batches", default=None, help="default: 16 on CPU, --batches")
    parser.add_argument("--gpt2-context", type=int, default=None)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per arm")
    parser.add_argument("--gpt2-steps", type=int, default=None, help="default: --steps")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    parser.add_argument(
        "--every", type=int, default=1, help="also time statistics measured every K-th step"
    )
    parser.add_argument("--tasks", default="text,mnist1d,lm")
    parser.add_argument("--warm-steps", type=int, default=200)
    parser.add_argument("--batches-measured", type=int, default=100)
    args = parser.parse_args()
    args.device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu = args.device.type == "cpu"
    print(f"# torch {torch.__version__}, {args.device}, {torch.get_num_threads()} threads")
    if args.part in ("cost", "both"):
        names = ["examples (32)" if a == "examples" else a for a in arms_of(args.every)[1:]]
        print(f"\n| model | batch | plain | {' | '.join(names)} |")
        print("|---|---|---|" + "---|" * len(names))
        for name in args.models.split(","):
            batches, context = args.batches, MODELS[name][4]
            if name == "gpt2":
                batches = args.gpt2_batches or ("16" if cpu else args.batches)
                context = args.gpt2_context or (64 if cpu else context)
            steps = args.gpt2_steps if name == "gpt2" and args.gpt2_steps else args.steps
            for batch in (int(b) for b in batches.split(",")):
                cost(name, batch, context, steps, args)
    if args.part in ("agreement", "both"):
        print("\n| task | estimator | |G|² | tr Σ | B_simple |")
        print("|---|---|---|---|---|")
        for task in args.tasks.split(","):
            agreement(task, args)


if __name__ == "__main__":
    main()
