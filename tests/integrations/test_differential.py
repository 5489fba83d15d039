"""The plain loop, the Lightning callback and the Hugging Face Trainer on the same data.

All three hand the per-step rules to one ``StepEngine``, so on the same data,
model and optimizer they must make the same batch decisions, use the same
learning rates and end with the same parameters, on exactly the paths where
the plugins once drifted from the loop: AdaScale, VRGD (and the GSNR it
collects), AGVM, and a non-finite step that is skipped or stops training.
Every batch is a power of two from 64 and split into 4 micro-batches, so the
frameworks' 1/k loss weights equal the loop's b_i/B exactly.
"""

import contextlib
import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("lightning.pytorch")
transformers = pytest.importorskip("transformers")

import bigbatch as bb  # noqa: E402
from bigbatch.integrations.hf import AdaptiveBatchTrainer  # noqa: E402
from bigbatch.integrations.lightning import AdaptiveBatchCallback  # noqa: E402

from ._data import Teacher  # noqa: E402

K, FIRST, BUDGET, POISONED = 4, 64, 64 * 60, 5


class Net(nn.Module):
    """The model of all three runs; ``poison`` turns its outputs into NaN (one step's)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
        self.poison = False

    def logits(self, x):
        out = self.net(x)
        return out * math.nan if self.poison else out

    def forward(self, x, labels=None):
        logits = self.logits(x)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def make_optimizer(kind, net):
    if kind == "vrgd":  # VRGD asks for the GSNR: every loop must collect it
        return bb.optim.VRGD(torch.optim.SGD(net.net.parameters(), lr=0.1, momentum=0.9))
    if kind == "agvm":
        groups = bb.optim.module_param_groups(net.net, 0.0, "top")
        return bb.optim.AGVM(torch.optim.SGD(groups, lr=0.1, momentum=0.9), start=2, interval=2)
    return torch.optim.SGD(net.net.parameters(), lr=0.1, momentum=0.9)


def controller(case):
    if "ramp" in case:  # a ramp fixed in the user's units: optimizer steps and samples
        return bb.batch.Ramp(points=case["ramp"], budget=BUDGET)
    return bb.batch.contrib.CriticalBatchRamp(1.0, initial=FIRST, min=16, max=1024, window=4)


CASES = {
    "adascale": dict(optimizer="sgd", lr_scaling="adascale"),
    "vrgd": dict(optimizer="vrgd", lr_scaling="none"),
    "agvm": dict(optimizer="agvm", lr_scaling="sqrt"),
    "ramp-steps": dict(optimizer="sgd", lr_scaling="sqrt", ramp=[(0, 64), ("10 steps", 128)]),
    "ramp-share": dict(optimizer="sgd", lr_scaling="linear", ramp=[(0, 64), ("40%", 256)]),
    # the noise from each example's gradient norm, through the frameworks' 1/k loss weights
    "per-example": dict(optimizer="sgd", lr_scaling="adascale", noise_from="examples"),
    "nan-skip": dict(optimizer="sgd", lr_scaling="linear", nan=True),
    "nan-raise": dict(optimizer="sgd", lr_scaling="linear", nan=True, nonfinite="raise"),
    # every option away from its default, handed over as one StepOptions record
    "options": dict(
        optimizer="sgd",
        record=bb.StepOptions(
            lr_scaling="sqrt",
            base_batch_size=32,
            schedule=bb.schedules.warmup_cosine(BUDGET, BUDGET // 10),
            similarity="scalar",
            ema_beta=0.9,
            finite_correction=False,
            nonfinite="raise",
        ),
    ),
}


def options(case):
    """The case's step options, as every entry point takes them."""
    if "record" in case:
        return dict(options=case["record"])
    return dict(
        lr_scaling=case["lr_scaling"],
        nonfinite=case.get("nonfinite", "skip"),
        noise_from=case.get("noise_from", "sub_batches"),
    )


def run_loop(case):
    net, data = Net(), Teacher()
    optimizer = make_optimizer(case["optimizer"], net)
    loop = bb.AdaptiveBatch(
        net,
        optimizer,
        TensorDataset(data.x, data.y),
        controller=controller(case),
        max_micro_batch=1024,
        min_sub_batches=K,
        **options(case),
    )
    history = []
    try:
        for step in loop.steps(max_samples=BUDGET):
            net.poison = case.get("nan", False) and step.index == POISONED
            for x, y in step.micro_batches():
                step.backward(nn.functional.cross_entropy(net.logits(x), y))
            step.apply()
            history.append(step.metrics)
    except bb.NonFiniteError:
        pass
    return net, history, loop.engine


class LightningModule(pl.LightningModule):
    def __init__(self, case):
        super().__init__()
        self.model, self.case = Net(), case

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.model.poison = self.case.get("nan", False) and self.trainer.global_step == POISONED
        return nn.functional.cross_entropy(self.model.logits(x), y)

    def configure_optimizers(self):
        return make_optimizer(self.case["optimizer"], self.model)


def run_lightning(case):
    data = Teacher()
    sampler = bb.batch.GlobalBatchSampler(len(data), FIRST, micro_batches=K, max_samples=BUDGET)
    callback = AdaptiveBatchCallback(sampler, controller(case), log=False, **options(case))
    trainer = pl.Trainer(
        accumulate_grad_batches=K,
        use_distributed_sampler=False,
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    module = LightningModule(case)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with contextlib.suppress(bb.NonFiniteError):
            trainer.fit(module, DataLoader(TensorDataset(data.x, data.y), batch_sampler=sampler))
    return module.model, callback.history, callback.driver.engine


class Poison(transformers.TrainerCallback):
    def __init__(self, case):
        self.case = case

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        model.poison = self.case.get("nan", False) and state.global_step == POISONED


def run_hf(case, tmp_path):
    net, data = Net(), Teacher()
    sampler = bb.batch.GlobalBatchSampler(len(data), FIRST, micro_batches=K, max_samples=BUDGET)
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        gradient_accumulation_steps=K,
        max_grad_norm=0.0,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
    )
    trainer = AdaptiveBatchTrainer(
        model=net,
        args=arguments,
        train_dataset=data,
        sampler=sampler,
        controller=controller(case),
        optimizers=(make_optimizer(case["optimizer"], net), None),
        callbacks=[Poison(case)],
        **options(case),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with contextlib.suppress(bb.NonFiniteError):
            trainer.train()
    return net, trainer.bigbatch.history, trainer.bigbatch.driver.engine


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.filterwarnings("ignore::bigbatch.optim.FewSubBatchesWarning")  # VRGD at 4: on purpose
def test_loop_lightning_and_hf_decide_and_train_identically(name, tmp_path):
    case = CASES[name]
    runs = {
        "loop": run_loop(case),
        "lightning": run_lightning(case),
        "hf": run_hf(case, tmp_path),
    }
    _, reference, built = runs["loop"]
    sizes = [m["batch_size"] for m in reference]
    if case.get("nonfinite") != "raise":
        assert len(set(sizes)) > 1, "the batch must change for the comparison to mean anything"
    if name == "ramp-steps":  # the table in steps: the change after the 10th step
        assert sizes[:11] == [64] * 10 + [128] and set(sizes) == {64, 128}
    if name == "ramp-share":  # 40% of the budget = 1,536 samples = 24 steps of 64
        assert sizes[23:25] == [64, 256] and set(sizes) == {64, 256}
    if case.get("nan"):
        skipped = [m.get("skipped", 0.0) for m in reference]
        if case.get("nonfinite") == "raise":
            assert len(reference) == POISONED  # it stopped before the poisoned step was counted
        else:
            assert skipped[POISONED] == 1.0 and sum(skipped) == 1.0
    for framework in ("lightning", "hf"):
        net, history, engine = runs[framework]
        # built from the same options by StepEngine.build: the same engine, field by field
        assert engine.describe() == built.describe(), framework
        assert [m["batch_size"] for m in history] == sizes, framework
        assert [m["next_batch_size"] for m in history] == [m["next_batch_size"] for m in reference]
        assert [m["lr"] for m in history] == pytest.approx([m["lr"] for m in reference], rel=1e-6)
        assert [m.get("skipped", 0.0) for m in history] == [
            m.get("skipped", 0.0) for m in reference
        ]
        if case["optimizer"] == "agvm":
            keys = [k for k in reference[-1] if k.startswith("agvm/")]
            assert keys and all(history[-1][k] == pytest.approx(reference[-1][k]) for k in keys)
        if case["optimizer"] == "vrgd":
            assert engine.collector.provides() == frozenset({"gsnr"})
        for a, b in zip(net.net.parameters(), runs["loop"][0].net.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            assert torch.isfinite(a).all()
