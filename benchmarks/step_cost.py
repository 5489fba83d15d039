"""What a bigbatch step costs against the step a user writes by hand (issues 3, 55).

    python benchmarks/step_cost.py                          # CPU: text model, GPT-2 shape at 16
    python benchmarks/step_cost.py --device cuda            # a GPU: every batch, bf16
    python benchmarks/step_cost.py --part agreement         # one-pass vs sub-batch noise
    python benchmarks/step_cost.py --models lm-gpu --batches 64,256 --micro-batches 4 \
        --arms off,sub-batches,gsnr --details --device cuda  # the statistics' own cost
    python benchmarks/step_cost.py --part throughput --device cuda  # bigbatch train, samples/s
    python benchmarks/step_cost.py --part ops --models text,text-gpu,gpt2 --arms plain,examples,off

**cost.** Arms, each its own copy of the same model and optimizer (LAMB), interleaved
step by step in a rotating order, median step time (CUDA events on a GPU):

- ``plain``: one forward/backward of the whole batch and ``optimizer.step()``;
- ``sub-batches``: ``AdaptiveBatch`` with a ``Constant`` batch and the sub-batch noise
  statistics (``noise_from="sub_batches"``: four micro-batches per step);
- ``gsnr``: the same, with the per-element gradient SNR as well (``gsnr=True``);
- ``examples``: the same with the per-example statistics (``noise_from="examples"``: one
  micro-batch, the noise from the gradient norms of 8 to 15 units of its examples, taken
  in the same backward, the default); ``all examples``: every example its own unit;
- ``off``: the same with ``statistics=False``;
- ``plain-fused``, ``examples-fused``: ``plain`` and ``examples`` with torch's AdamW
  (``fused=True``) for LAMB; ``async``: ``examples-fused`` with ``asynchronous=True``, each
  step's numbers read at the next step (a non-finite step skipped by the fused optimizer
  on the device), so the host never waits for the device inside a step;
- with ``--every K``, ``sub-batches/K`` and ``examples/K``: the statistics measured at
  every K-th step only (``statistics_every=K``), the steps between unsplit; each timed
  unit is K steps (one measured), so the time is the mean step over the cycle; ``--every
  auto``: K by the batch, as ``statistics_every="auto"`` takes it.

``--steady N`` adds the steady-state time: blocks of N steps with one synchronisation at
the end of each (a per-step synchronisation charges the host's work in full on a GPU),
interleaved, the median block over N.

``--keep-freed-memory`` keeps glibc's malloc from handing freed memory back between
steps, as ``bigbatch train`` does on a CPU (every arm alike). ``--micro-batches K``
splits every bigbatch arm's step in ``K`` (the statistics' own cost at one split:
``--arms off,sub-batches,gsnr --micro-batches 4``). ``--details`` adds, per arm, the
host synchronisations of one step (CUDA's sync debug mode; none on a CPU) and the
gradient-sized buffers the statistics keep.

Models: the ``text`` task's byte GPT (vocabulary 256, context 32, width 64, 2 layers),
the same at GPU scale (``text-gpu``: context 256, width 256, 4 layers), a wider GPU
language model (``lm-gpu``: vocabulary 512, width 512, 8 layers, context 256), a
GPT-2-small shape (width 768, 12 layers, 12 heads, vocabulary 50,257; context
``--gpt2-context``, 1,024 by default, 64 on a CPU, where a step of 1,024 tokens takes
minutes) and an overhead-bound ``mlp`` (32 features, 256 hidden, 10 classes), where the
loop's own Python is what a step costs; ``text-rms`` and ``text-gpu-rms``, those two with
RMSNorms for their LayerNorms (Llama's blocks); ``cnn1d``, MNIST-1D's CNN, ``cnn2d-gn``, two
3×3 convolutions with GroupNorms on 16×16 images, and ``cnn2d``, two wider ones (16 to 64
channels) without.

**ops.** The ATen operators one optimizer step dispatches (``bigbatch.testing.count_ops``),
every arm with torch's AdamW (``foreach=True``, so that the optimizer dispatches alike on
every device), counted on the ``meta`` device (the same operators, nothing computed; GPT-2
at its context of 1,024): on a GPU a small model's step costs a kernel launch per operator.

**agreement.** On the ``text``, ``mnist1d`` and ``lm`` tasks' models (``--tasks``; ``--set``
changes their config), trained for ``--warm-steps`` steps first, both estimators read the
same backward passes of ``--batches-measured`` batches of 64 (four micro-batches for the
sub-batch one): the mean ``|G|²``, ``tr Σ`` and ``B_simple = tr Σ / |G|²`` of each, with
standard errors; where the model has LayerNorms, also their parameters' alone (Gray et
al. 2024, "Normalization layer per-example gradients are sufficient to predict gradient
noise scale in transformers").

**throughput.** ``bigbatch train`` on ``--task`` (with ``--set`` overrides; bf16 on a
GPU) for ``--train-samples`` samples: samples per second of the whole run.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import tempfile
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

import bigbatch as bb
from _timing import at_least, interleaved, listed, medians
from bigbatch.experiments.config import resolve, with_overrides
from bigbatch.experiments.device import keep_freed_memory
from bigbatch.experiments.plan import plan_run
from bigbatch.experiments.tasks import TASKS, TinyTransformer
from bigbatch.experiments.tasks.models import Conv1dNet
from bigbatch.stats import MicroBatchStatistics
from bigbatch.testing import count_ops, host_syncs

ARMS = ("plain", "sub-batches", "examples", "all examples", "off")
#: arms with torch's AdamW (``fused=True``), which skips a step on the device: a plain
#: step, the default statistics, and the same read one step late (``asynchronous=True``)
FUSED_ARMS = ("plain-fused", "examples-fused", "async")
#: every arm there is (``--arms``): the default ones, the sub-batch statistics with GSNR,
#: the fused ones
KNOWN_ARMS = (*ARMS, "gsnr", *FUSED_ARMS)


def arms_of(names: tuple[str, ...], every: int | str) -> tuple[str, ...]:
    """The arms timed: ``names``, and the two estimators measuring every ``every``-th step."""
    return names if every == 1 else (*names, f"sub-batches/{every}", f"examples/{every}")


MODELS = {
    # name: (vocabulary, width, depth, heads, context); depth 0: the MLP
    "text": (256, 64, 2, 4, 32),
    "text-gpu": (256, 256, 4, 4, 256),  # the text task at GPU scale (docs/results.md)
    "lm-gpu": (512, 512, 8, 8, 256),
    "gpt2": (50_257, 768, 12, 12, 1024),
    "mlp": (10, 256, 0, 0, 32),  # classes, hidden, -, -, features
}


#: a model of MODELS with its LayerNorms as RMSNorms (Llama's blocks)
RMS = {"text-rms": "text", "text-gpu-rms": "text-gpu"}
#: convolutional nets, by their input's shape: MNIST-1D's CNN, a Conv2d net with GroupNorms,
#: a wider Conv2d net
CNNS = {"cnn1d": (40,), "cnn2d-gn": (3, 16, 16), "cnn2d": (16, 16, 16)}


def context_of(name: str) -> int:
    """The sequence length ``name`` takes (0: none)."""
    return 0 if name in CNNS else MODELS[RMS.get(name, name)][4]


def make_model(name: str, context: int) -> nn.Module:
    torch.manual_seed(0)
    if name == "cnn1d":
        return Conv1dNet(32, 3)
    if name == "cnn2d-gn":
        return nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.GroupNorm(8, 32), nn.ReLU(),
            nn.Conv2d(32, 32, 3, padding=1, stride=2), nn.GroupNorm(8, 32), nn.ReLU(),
            nn.Flatten(), nn.Linear(32 * 8 * 8, 10),
        )  # fmt: skip
    if name == "cnn2d":
        return nn.Sequential(
            nn.Conv2d(16, 64, 3, padding=1), nn.ReLU(),
            nn.Conv2d(64, 64, 3, padding=1, stride=2), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10),
        )  # fmt: skip
    if name in RMS:
        model = make_model(RMS[name], context)
        for parent in list(model.modules()):
            for child_name, child in list(parent.named_children()):
                if isinstance(child, nn.LayerNorm):
                    setattr(parent, child_name, nn.RMSNorm(child.normalized_shape))
        return model
    vocab, width, depth, heads, features = MODELS[name]
    if depth == 0:
        return nn.Sequential(nn.Linear(features, width), nn.ReLU(), nn.Linear(width, vocab))
    return TinyTransformer(vocab, context, width, depth, heads=heads)


def make_data(name: str, context: int, sequences: int, zeros: bool = False) -> TensorDataset:
    """``sequences`` examples for ``name`` (``zeros``: all zero, for counting operators)."""
    gen = torch.Generator().manual_seed(0)
    if name in CNNS:
        x = (
            torch.zeros(sequences, *CNNS[name])
            if zeros
            else torch.randn(sequences, *CNNS[name], generator=gen)
        )
        return TensorDataset(x, torch.randint(0, 10, (sequences,), generator=gen))
    vocab, _, depth, _, features = MODELS[RMS.get(name, name)]
    if zeros and depth == 0:
        return TensorDataset(torch.zeros(sequences, features), torch.zeros(sequences).long())
    if zeros:
        tokens = torch.zeros(sequences, context + 1, dtype=torch.long)
        return TensorDataset(tokens[:, :-1], tokens[:, 1:])
    if depth == 0:  # a linear teacher's classes
        x = torch.randn(sequences, features, generator=gen)
        return TensorDataset(x, (x @ torch.randn(features, vocab, generator=gen)).argmax(1))
    tokens = torch.randint(0, vocab, (sequences, context + 1), generator=gen)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


class Arm:
    """One arm: its model, optimizer and (for the bigbatch arms) loop.

    The optimizer is LAMB, or with ``adamw`` torch's AdamW with ``foreach=True``, which
    dispatches the same operators on a CPU as on a GPU (for counting them).
    """

    def __init__(self, name: str, model: nn.Module, data, batch: int, args, adamw=False) -> None:
        self.name, self.model, self.device = name, model, args.device
        if name in FUSED_ARMS:
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        elif adamw:
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        else:
            self.optimizer = bb.optim.LAMB(bb.optim.param_groups(model, 0.01), lr=1e-3)
        self.autocast = (
            torch.autocast("cuda", torch.bfloat16)
            if args.device.type == "cuda"
            else contextlib.nullcontext()
        )
        self.data, self.batch, self.position = data, batch, 0
        # --compile: torch.compile of the model in every arm (the measured layers traced)
        compiled = getattr(args, "compile", False)
        mode = getattr(args, "compile_mode", "default")
        self.forward = torch.compile(model, mode=mode) if compiled else model
        self.loop = None
        base, _, every = name.partition("/")
        #: optimizer steps per timed unit: a whole cycle of statistics_every ("auto": the
        #: cycle at this batch)
        statistics_every = every if every == "auto" else int(every or 1)
        self.every = bb.StepOptions(statistics_every=statistics_every).every_at(batch)
        if base not in ("plain", "plain-fused"):
            split = base in ("sub-batches", "gsnr")
            self.loop = bb.AdaptiveBatch(
                model,
                self.optimizer,
                data,
                controller=bb.batch.Constant(batch),
                max_micro_batch=max(batch, 1024),
                min_sub_batches=args.micro_batches,
                statistics=name != "off",
                gsnr=base == "gsnr",
                noise_from="sub_batches" if split else "examples",
                noise_units=None if name == "all examples" else bb.stats.per_example.UNITS,
                statistics_every=statistics_every,
                loader_options={"pin_memory": args.device.type == "cuda"},
                asynchronous=name == "async",
            )

    def loss(self, x, y):
        x = x.to(self.device, non_blocking=True)
        y = y.to(self.device, non_blocking=True)
        with self.autocast:
            logits = self.forward(x)
        return nn.functional.cross_entropy(logits.float().flatten(0, -2), y.flatten())

    def step(self) -> None:
        if self.loop is None:  # a plain step, on the host's next slice of the data
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

    def details(self) -> str:
        """Host synchronisations of one more step, and the statistics' buffers."""
        with host_syncs(self.device) as counted:
            self.step()
        collector = self.loop.collector if self.loop is not None else None
        buffers = collector.memory() if collector is not None else 0
        syncs = counted.count / self.every if self.device.type == "cuda" else "-"
        return f"{syncs} syncs, {buffers / 2**20:.2f} MiB"


def cost(model_name: str, batch: int, context: int, steps: int, args) -> None:
    if args.compile:  # the arms' models share their class's code: each arm's graphs apart
        torch._dynamo.reset()
        torch._dynamo.config.recompile_limit = 64
    data = make_data(model_name, context, max(4 * batch, 256))
    model = make_model(model_name, context).to(args.device)
    names = arms_of(args.arms, args.every)
    arms = [Arm(name, copy.deepcopy(model), data, batch, args) for name in names]
    times = medians(interleaved({a.name: a.step for a in arms}, steps, device=args.device))
    times = {a.name: times[a.name] / a.every for a in arms}  # per optimizer step
    base = times[names[0]]
    cells = [
        f"{times[a] * 1e3:.1f} ms" + (f" ({times[a] / base:.2f}x)" if i else "")
        for i, a in enumerate(names)
    ]
    if args.steady:
        # steady state: blocks of many steps with one synchronisation each (a step's own
        # synchronisation, its read, still happens inside), interleaved, the median block
        blocks = {a.name: _block(a, args.steady) for a in arms}
        steady = medians(interleaved(blocks, max(3, steps // args.steady), device=args.device))
        steady = {a.name: steady[a.name] / (args.steady * a.every) for a in arms}
        cells = [
            f"{cell}; steady {steady[a] * 1e3:.1f} ms"
            + (f" ({steady[a] / steady[names[0]]:.2f}x)" if i else "")
            for i, (cell, a) in enumerate(zip(cells, names, strict=True))
        ]
    if args.details:
        cells = [f"{cell}; {arm.details()}" for cell, arm in zip(cells, arms, strict=True)]
    print(f"| {model_name} | {batch} | {' | '.join(cells)} |", flush=True)


def _block(arm: Arm, steps: int):
    def run() -> None:
        for _ in range(steps):
            arm.step()

    return run


def ops(model_name: str, batch: int, context: int, args) -> dict[str, int]:
    """Operators one optimizer step dispatches, per arm (AdamW, foreach, in every arm), after
    two warm-up steps, on ``--ops-device`` (``meta`` by default: the same operators as any
    device, nothing computed, so GPT-2 at context 1,024 counts in seconds)."""
    device = torch.device(args.ops_device)
    here = argparse.Namespace(**{**vars(args), "device": device})
    with torch.device(device):
        model = make_model(model_name, context)
        data = make_data(model_name, context, max(4 * batch, 256), zeros=True)
    counts = {}
    for name in args.arms:
        arm = Arm(name, copy.deepcopy(model), data, batch, here, adamw=True)
        count_ops(arm.step)  # warm-up steps, counted too (on meta a read needs the count)
        count_ops(arm.step)
        counts[name] = sum(count_ops(arm.step).values())
        if arm.loop is not None and arm.loop.collector is not None:
            arm.loop.collector.close()
    base = counts[args.arms[0]]
    cells = [f"{n}" + (f" ({n / base:.2f}x)" if i else "") for i, n in enumerate(counts.values())]
    print(f"| {model_name} | {context} | {batch} | {' | '.join(cells)} |", flush=True)
    return counts


def throughput(args) -> None:
    cuda = args.device.type == "cuda"
    config = with_overrides(
        resolve(
            {
                "task": args.task,
                "max_samples": args.train_samples,
                "device": str(args.device),
                "precision": "bf16" if cuda else "fp32",
            }
        ),
        args.set,
    )
    with tempfile.TemporaryDirectory() as out:
        from bigbatch.experiments.runner import train

        summary = train(config, Path(out) / "run", quiet=True)
    rate = summary["samples"] / summary["wall_seconds"]
    print(
        f"\nbigbatch train --task {args.task} {' '.join('--set ' + s for s in args.set)}: "
        f"{summary['samples']} samples in {summary['wall_seconds']:.1f} s = {rate:.0f} "
        f"samples/s ({summary['steps']} steps, average batch {summary['avg_batch_size']:.0f})"
    )


def _forever(loader):
    """The loader's batches, epoch after epoch (a small training set ends before 300)."""
    while True:
        yield from loader


def agreement(task: str, args) -> None:
    config = plan_run(with_overrides(resolve({"task": task, "device": "cpu"}), args.set))
    problem = TASKS[task].build(config.task_args)
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
    # each estimator its own collector, one at a time over the same batches (a layer is
    # measured by one collector at a time)
    estimators = {
        "sub-batches": lambda: MicroBatchStatistics(params, ema_beta=0.0, similarity="scalar"),
        "examples": lambda: MicroBatchStatistics(
            params, ema_beta=0.0, similarity="scalar", per_example=model
        ),
        "4 units": lambda: MicroBatchStatistics(
            params, ema_beta=0.0, similarity="scalar", per_example=model, per_example_units=4
        ),
    }
    # Gray et al. (2024): the normalization layers' noise scale alone, where there are some
    norms = [p for m in model.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()]
    if norms:
        estimators["norm layers only"] = lambda: MicroBatchStatistics(
            [norms], ema_beta=0.0, similarity="scalar", per_example=model
        )
    rows: dict[str, list[tuple[float, float]]] = {name: [] for name in estimators}
    measured = [next(batches) for _ in range(args.batches_measured)]
    for name, make in estimators.items():
        collector = make()
        for batch in measured:
            size = len(batch[0])
            sizes = [size // 4] * 4
            collector.begin(sizes)
            start = 0
            for i, b in enumerate(sizes):
                collector.before_backward(i)
                part = [t[start : start + b] for t in batch]
                (problem.loss(model, part) * b / size).backward()
                start += b
            got = collector.finish()
            rows[name].append((got.grad_sq_norm, got.trace))
            model.zero_grad(set_to_none=True)
        collector.close()
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


def batch_list(text: str) -> str:
    # the batches as given (the cost part splits them per model), each checked here
    listed(at_least(1))(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--part",
        choices=("cost", "ops", "agreement", "throughput"),
        nargs="+",
        default=["cost"],
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--models", default="text,gpt2", help=f"of {', '.join([*MODELS, *RMS, *CNNS])}"
    )
    parser.add_argument("--batches", default="16,64,256,1024", type=batch_list)
    parser.add_argument(
        "--gpt2-batches", default=None, type=batch_list, help="default: 16 on CPU, --batches"
    )
    parser.add_argument("--gpt2-context", type=int, default=None)
    parser.add_argument("--arms", default=",".join(ARMS), help=f"of {', '.join(KNOWN_ARMS)}")
    parser.add_argument(
        "--micro-batches", type=int, help="each bigbatch arm's split (default: 4 for sub-batches)"
    )
    parser.add_argument("--details", action="store_true", help="host syncs and buffers too")
    parser.add_argument(
        "--steady",
        type=at_least(0),
        default=0,
        help="also time blocks of this many steps, one sync each",
    )
    parser.add_argument(
        "--ops-device", default="meta", help="where --part ops runs its steps (meta: no compute)"
    )
    parser.add_argument("--steps", type=at_least(1), default=20, help="timed steps per arm")
    parser.add_argument("--gpt2-steps", type=at_least(1), default=None, help="default: --steps")
    parser.add_argument(
        "--threads", type=at_least(0), default=0, help="torch CPU threads (0: default)"
    )
    parser.add_argument(
        "--keep-freed-memory", action="store_true", help="as bigbatch train does on a CPU"
    )
    parser.add_argument(
        "--compile", action="store_true", help="torch.compile each arm's model (cost part)"
    )
    parser.add_argument(
        "--compile-mode", default="default", help="torch.compile's mode (reduce-overhead: graphs)"
    )
    parser.add_argument(
        "--every",
        type=lambda text: text if text == "auto" else at_least(1)(text),
        default=1,
        help="also time statistics measured every K-th step (auto: statistics_every='auto')",
    )
    parser.add_argument("--tasks", default="text,mnist1d,lm")
    parser.add_argument("--warm-steps", type=at_least(1), default=200)
    parser.add_argument("--batches-measured", type=at_least(1), default=100)
    parser.add_argument("--task", default="lm", help="throughput: the task trained")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="agreement, throughput"
    )
    parser.add_argument("--train-samples", type=at_least(1), default=200_000)
    args = parser.parse_args()
    models = sorted(set(args.models.split(",")) - {*MODELS, *RMS, *CNNS})
    if models:
        parser.error(f"unknown models {models}; the models are {', '.join([*MODELS, *RMS, *CNNS])}")
    args.device = torch.device(args.device)
    args.arms = tuple(args.arms.split(","))
    unknown = sorted(set(args.arms) - set(KNOWN_ARMS))
    if unknown:
        parser.error(f"unknown arms {unknown}; the arms are {', '.join(KNOWN_ARMS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.keep_freed_memory and not keep_freed_memory():
        parser.error("--keep-freed-memory: glibc's malloc only")
    cpu = args.device.type == "cpu"
    print(f"# torch {torch.__version__}, {args.device}, {torch.get_num_threads()} threads")
    if "cost" in args.part:
        names = list(arms_of(args.arms, args.every))
        print(f"\n| model | batch | {' | '.join(names)} |")
        print("|---|---|" + "---|" * len(names))
        for name in args.models.split(","):
            batches, context = args.batches, context_of(name)
            if name == "gpt2":
                batches = args.gpt2_batches or ("16" if cpu else args.batches)
                context = args.gpt2_context or (64 if cpu else context)
            steps = args.gpt2_steps if name == "gpt2" and args.gpt2_steps else args.steps
            for batch in (int(b) for b in batches.split(",")):
                cost(name, batch, context, steps, args)
    if "ops" in args.part:
        print(f"\n| model | context | batch | {' | '.join(args.arms)} |  (operators per step)")
        print("|---|---|---|" + "---|" * len(args.arms))
        computed = args.ops_device != "meta"
        for name in args.models.split(","):
            batches, context = args.batches, context_of(name)
            if name == "gpt2" and computed:  # a real step of GPT-2 at 1,024 on a CPU: minutes
                batches = args.gpt2_batches or ("16" if cpu else args.batches)
                context = args.gpt2_context or (64 if cpu else context)
            elif name == "gpt2":
                context = args.gpt2_context or context
            for batch in (int(b) for b in batches.split(",")):
                ops(name, batch, context, args)
    if "agreement" in args.part:
        print("\n| task | estimator | |G|² | tr Σ | B_simple |")
        print("|---|---|---|---|---|")
        for task in args.tasks.split(","):
            agreement(task, args)
    if "throughput" in args.part:
        throughput(args)


if __name__ == "__main__":
    main()
