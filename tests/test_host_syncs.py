"""One host synchronisation per optimizer step, counted on the CPU.

On a GPU every read of a device tensor's value from Python (``item``,
``tolist``, ``float()``, ``bool()``, ``.cpu()``, ...) stalls the host until
the device catches up. The CPU has no such stall, but the same reads are
visible: these tests wrap the reading methods of ``torch.Tensor`` and count
them during a step (the batch drawn, micro-batches loaded, forward, backward,
statistics, optimizer step, next batch size). The contract: exactly one per
step, with statistics (the batch decision, which carries the loss and the
finiteness check) or without; two with fp16's ``GradScaler``, whose ``step``
reads its overflow flag. The ``cuda``-marked test at the end checks the
same on a GPU with ``torch.cuda.set_sync_debug_mode``.

Reads made by the host-side data pipeline are not counted: the sampler's
permutation and the ``DataLoader``'s worker seed are CPU tensors wherever the
model trains, so reading them never waits for a device.
"""

import contextlib
import traceback

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import bigbatch as bb

from .common import count_syncs

#: where the ``cuda``-marked test runs (skipped without a GPU)
DEVICE = "cuda"

READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy")


@contextlib.contextmanager
def counting_reads():
    counts: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(name, original):
        def read(self, *args, **kwargs):
            if not _in_data_pipeline():
                counts.append(name)
            return original(self, *args, **kwargs)

        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, wrap(name, original))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def _in_data_pipeline() -> bool:
    files = [frame.filename for frame in traceback.extract_stack(limit=8)]
    return any("torch/utils/data" in f or f.endswith("bigbatch/batch/sampler.py") for f in files)


def make_loop(micro_batches, statistics=True, gsnr=False, optimizer="sgd", scaler=None, **options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3))
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4096, 12, generator=gen), torch.randint(0, 3, (4096,)))
    opt = (
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        if optimizer == "sgd"
        else bb.optim.VRGD(torch.optim.SGD(model.parameters(), lr=0.05))
    )
    controller = (
        bb.batch.contrib.CriticalBatchRamp(
            8.0, initial=16 * micro_batches, min=micro_batches, window=2
        )
        if statistics
        else bb.batch.Constant(16 * micro_batches)
    )
    loop = bb.AdaptiveBatch(
        model,
        opt,
        data,
        controller=controller,
        max_micro_batch=16,
        min_sub_batches=micro_batches,
        statistics=statistics,
        gsnr=gsnr,
        scaler=scaler,
        **options,
    )
    return model, loop


def reads_per_step(model, loop, steps=4):
    per_step = []
    iterator = loop.steps(max_steps=steps)
    for _ in range(steps):
        with counting_reads() as reads:
            step = next(iterator)
            for x, y in step.micro_batches():
                step.backward(nn.functional.cross_entropy(model(x), y))
            step.apply()
        per_step.append(list(reads))
    return per_step


@pytest.mark.parametrize("micro_batches", [2, 8])
@pytest.mark.parametrize("gsnr", [False, True])
def test_one_read_per_step_with_statistics(micro_batches, gsnr):
    model, loop = make_loop(micro_batches, gsnr=gsnr)
    per_step = reads_per_step(model, loop, steps=10)
    assert per_step == [["tolist"]] * len(per_step)
    assert loop.batch_size > 16 * micro_batches, "the controller must have acted"


@pytest.mark.parametrize("micro_batches", [1, 4])
@pytest.mark.parametrize("units", [None, 4])
def test_one_read_per_step_with_per_example_statistics(micro_batches, units):
    model, loop = make_loop(micro_batches, noise_from="examples", noise_units=units)
    assert loop.collector.per_example is not None
    assert reads_per_step(model, loop, steps=10) == [["tolist"]] * 10
    assert loop.batch_size > 16 * micro_batches, "the controller must have acted"


def test_one_read_per_step_measuring_every_third_step():
    """Between measurements the controller still learns (the batch gradient's norm rides in
    the loss's one reduction): one read on every step, measured or not."""
    model, loop = make_loop(2, noise_from="examples", statistics_every=3)
    assert reads_per_step(model, loop, steps=9) == [["tolist"]] * 9


def test_one_read_per_step_with_vrgd():
    model, loop = make_loop(8, optimizer="vrgd")
    assert reads_per_step(model, loop) == [["tolist"]] * 4


@pytest.mark.parametrize("micro_batches", [1, 8])
def test_one_read_per_step_without_statistics(micro_batches):
    model, loop = make_loop(micro_batches, statistics=False)
    assert reads_per_step(model, loop) == [["tolist"]] * 4


def test_a_grad_scaler_adds_its_own_read_of_the_overflow_flag():
    """fp16's GradScaler: the engine's one read, then ``GradScaler.step`` reads whether any
    gradient overflowed (``found_inf.item()``) to decide whether to step: two per step, as
    docs/cli.md says."""
    model, loop = make_loop(4, scaler=torch.amp.GradScaler("cpu"))
    assert reads_per_step(model, loop) == [["tolist", "item"]] * 4


def test_the_counter_sees_a_read():
    with counting_reads() as reads:
        torch.ones(2).sum().item()
    assert reads == ["item"]


def syncs_per_cuda_step(micro_batches=1, optimizer=None, **options):
    """Host synchronisations of each of 4 steps on CUDA, after a first one that makes state."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 4)).to(DEVICE)
    data = TensorDataset(torch.randn(8192, 32), torch.randint(0, 4, (8192,)))
    loop = bb.AdaptiveBatch(
        model,
        (optimizer or bb.optim.LAMB)(model.parameters(), lr=1e-3),
        data,
        controller=bb.batch.contrib.CriticalBatchRamp(8.0, initial=32 * micro_batches, window=2),
        max_micro_batch=32,
        min_sub_batches=micro_batches,
        loader_options={"pin_memory": True},
        **options,
    )
    steps = loop.steps(max_steps=6)

    def one_step():
        step = next(steps)
        for x, y in step.micro_batches():
            x, y = x.to(DEVICE, non_blocking=True), y.to(DEVICE, non_blocking=True)
            step.backward(nn.functional.cross_entropy(model(x), y))
        step.apply()

    one_step()  # the first step creates state
    return [count_syncs(one_step) for _ in range(4)], loop


@pytest.mark.cuda
@pytest.mark.parametrize(
    "micro_batches, gsnr, noise_from",
    [
        (2, False, "sub_batches"),
        (8, False, "sub_batches"),
        (8, True, "sub_batches"),
        (1, False, "examples"),
        (4, False, "examples"),
    ],
)
def test_one_host_sync_per_step_on_cuda(micro_batches, gsnr, noise_from):
    syncs, _ = syncs_per_cuda_step(micro_batches, gsnr=gsnr, noise_from=noise_from)
    assert syncs == [1, 1, 1, 1]


@pytest.mark.cuda
@pytest.mark.parametrize("micro_batches, noise_from", [(2, "sub_batches"), (1, "examples")])
def test_no_host_sync_in_an_asynchronous_step_on_cuda(micro_batches, noise_from):
    """``asynchronous=True``: a step's numbers are read at the next step from pinned memory,
    waiting on an event for the step before's copy only (which the sync debug mode does not
    count), so a step makes no synchronisation."""

    def fused_adamw(params, lr):
        return torch.optim.AdamW(params, lr=lr, fused=True)

    syncs, loop = syncs_per_cuda_step(
        micro_batches, fused_adamw, noise_from=noise_from, asynchronous=True
    )
    assert syncs == [0, 0, 0, 0]
    assert loop.flush()["step"] == 5
