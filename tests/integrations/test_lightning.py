"""The Lightning callback with the real Lightning (skipped only where the extra is absent)."""

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("lightning.pytorch")

import bigbatch as bb  # noqa: E402
from bigbatch.integrations.lightning import AdaptiveBatchCallback  # noqa: E402
from bigbatch.sinks import tagged  # noqa: E402


def teacher_data(n=4096, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=gen)
    return TensorDataset(x, (x @ torch.randn(16, 4, generator=gen)).argmax(1))


def make_model(dropout=0.0):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Dropout(dropout), nn.Linear(32, 4))


class Module(pl.LightningModule):
    def __init__(self, lr=0.2, dropout=0.0):
        super().__init__()
        self.net = make_model(dropout)
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.net.parameters(), lr=self.lr)


def fit(
    callback, sampler, data, *, ckpt_path=None, callbacks=(), root=None, logger=False, dropout=0.0,
    plugins=(), module=None, workers=0,
):  # fmt: skip
    trainer = pl.Trainer(
        accumulate_grad_batches=sampler.micro_batches,
        use_distributed_sampler=False,
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=bool(callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback, *callbacks],
        default_root_dir=root,
        plugins=list(plugins) or None,
    )
    module = module or Module(dropout=dropout)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        warnings.filterwarnings("ignore", ".*resuming from a checkpoint that ended.*")
        loader = DataLoader(data, batch_sampler=sampler, num_workers=workers)
        trainer.fit(module, loader, ckpt_path=ckpt_path)
    return module


def test_constant_batches_train_exactly_like_adaptive_batch():
    data, batch, k, steps = teacher_data(), 64, 4, 12
    sampler = bb.batch.GlobalBatchSampler(
        len(data), batch, micro_batches=k, max_samples=batch * steps, seed=0
    )
    callback = AdaptiveBatchCallback(sampler, bb.batch.Constant(batch), log=False)
    module = fit(callback, sampler, data)

    model = make_model()
    loop = bb.AdaptiveBatch(
        model,
        torch.optim.SGD(model.parameters(), lr=0.2),
        data,
        controller=bb.batch.Constant(batch),
        max_micro_batch=batch,
        min_sub_batches=k,
        seed=0,
    )
    losses = []
    for step in loop.steps(max_steps=steps):
        for x, y in step.micro_batches():
            step.backward(nn.functional.cross_entropy(model(x), y))
        step.apply()
        losses.append(step.metrics["loss"])
    for a, b in zip(module.net.parameters(), model.parameters()):
        torch.testing.assert_close(a, b)
    assert [h["loss"] for h in callback.history] == pytest.approx(losses, rel=1e-5)
    assert callback.samples == batch * steps and len(callback.history) == steps


def test_batch_sizes_adapt_and_training_ends_at_the_sample_budget():
    data = teacher_data()
    sampler = bb.batch.GlobalBatchSampler(len(data), 32, micro_batches=4, max_samples=30_000)
    controller = bb.batch.SimiGrad(target=0.5, initial=32, min=8, max=1024, window=5)
    callback = AdaptiveBatchCallback(sampler, controller, log=False)
    fit(callback, sampler, data)
    sizes = [h["batch_size"] for h in callback.history]
    assert len(set(sizes)) > 3
    assert 30_000 <= callback.samples < 30_000 + 1024
    losses = [h["loss"] for h in callback.history]
    assert sum(losses[-5:]) < 0.7 * sum(losses[:5])


def test_a_loader_with_workers_trains_the_whole_sample_budget():
    """Lightning reads the loader's length once, after its workers drew steps ahead: the
    sampler counted them as spent and the run ended 2 steps of 20 short of its budget."""
    data, batch, steps = teacher_data(), 32, 20
    sampler = bb.batch.GlobalBatchSampler(
        len(data), batch, micro_batches=2, max_samples=batch * steps
    )
    callback = AdaptiveBatchCallback(sampler, bb.batch.Constant(batch), log=False)
    fit(callback, sampler, data, workers=2)
    assert callback.samples == batch * steps and len(callback.history) == steps


def test_a_run_resumed_from_a_checkpoint_continues_exactly(tmp_path):
    data = teacher_data()

    def run(ckpt_path=None, save=False):
        sampler = bb.batch.GlobalBatchSampler(len(data), 32, micro_batches=4, max_samples=8000)
        controller = bb.batch.SimiGrad(target=0.5, initial=32, min=8, max=512, window=3)
        callback = AdaptiveBatchCallback(sampler, controller, log=False)
        saver = []
        if save:
            saver = [
                pl.callbacks.ModelCheckpoint(
                    dirpath=tmp_path, every_n_train_steps=10, save_top_k=-1, filename="{step}"
                )
            ]
        # dropout: the random state resumes too (Lightning restores none)
        module = fit(
            callback, sampler, data, ckpt_path=ckpt_path, callbacks=saver, root=tmp_path,
            dropout=0.2,
        )  # fmt: skip
        return module, callback

    straight, straight_cb = run(save=True)
    resumed, resumed_cb = run(ckpt_path=tmp_path / "step=20.ckpt")
    tail = [h["batch_size"] for h in straight_cb.history[20:]]
    assert [h["batch_size"] for h in resumed_cb.history] == tail
    for a, b in zip(straight.net.parameters(), resumed.net.parameters()):
        assert torch.equal(a, b)


class SaveAt(pl.Callback):
    """Saves a checkpoint after the micro-batch ``batch_idx`` (as a validation there would)."""

    def __init__(self, batch_idx, path):
        self.batch_idx, self.path = batch_idx, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == self.batch_idx:
            trainer.save_checkpoint(self.path)


def test_a_checkpoint_inside_an_optimizer_step_is_refused_by_name(tmp_path):
    """Validation every 10 batches with 4 micro-batches a step saved checkpoints mid-step;
    resumed, the sampler began a new step where Lightning counted the old one's third
    micro-batch: an internal RuntimeError from the driver. Saving one is warned of."""
    data = teacher_data()

    def run(**kwargs):
        sampler = bb.batch.GlobalBatchSampler(len(data), 64, micro_batches=4, max_samples=768)
        callback = AdaptiveBatchCallback(sampler, bb.batch.Constant(64), log=False)
        return fit(callback, sampler, data, root=tmp_path, **kwargs)

    saves = [SaveAt(9, tmp_path / "mid.ckpt"), SaveAt(11, tmp_path / "end.ckpt")]
    with pytest.warns(UserWarning, match=r"after 2 of its 4 micro-batches .* cannot be resumed"):
        run(callbacks=saves)  # said as it is saved (only then: the step's end is not)
    with pytest.raises(ValueError, match=r"inside an optimizer step, after 2 of its 4 micro"):
        run(ckpt_path=tmp_path / "mid.ckpt")
    run(ckpt_path=tmp_path / "end.ckpt")  # a step's end resumes


class Record(pl.Callback):
    """Writes each rank's batch sizes, similarities and final parameters to a file."""

    def __init__(self, adaptive, directory):
        self.adaptive, self.directory = adaptive, directory

    def on_train_end(self, trainer, pl_module):
        torch.save(
            {
                "batch": [h["batch_size"] for h in self.adaptive.history],
                "similarity": [h["similarity"] for h in self.adaptive.history],
                "params": torch.cat([p.detach().flatten() for p in pl_module.parameters()]),
            },
            self.directory / f"rank{trainer.global_rank}.pt",
        )


@pytest.mark.processes
def test_ddp_ranks_decide_the_same_batch_sizes(tmp_path):
    data = teacher_data()
    sampler = bb.batch.GlobalBatchSampler(len(data), 64, micro_batches=2, max_samples=12_000)
    controller = bb.batch.SimiGrad(target=0.5, initial=64, min=16, max=1024, window=3)
    callback = AdaptiveBatchCallback(sampler, controller, log=False)
    trainer = pl.Trainer(
        accumulate_grad_batches=2,
        use_distributed_sampler=False,
        max_epochs=1,
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback, Record(callback, tmp_path)],
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        trainer.fit(Module(), DataLoader(data, batch_sampler=sampler))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert ranks[0]["batch"] == ranks[1]["batch"] and len(set(ranks[0]["batch"])) > 2
    assert ranks[0]["similarity"] == ranks[1]["similarity"]
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])


def test_every_number_of_a_step_goes_to_the_hosts_logger_under_one_prefix(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    data = teacher_data()
    sampler = bb.batch.GlobalBatchSampler(len(data), 32, micro_batches=4, max_samples=8_000)
    callback = AdaptiveBatchCallback(sampler, bb.batch.SimiGrad(target=0.5, initial=32, window=5))
    fit(callback, sampler, data, logger=CSVLogger(tmp_path, name="csv"))
    (metrics,) = tmp_path.glob("csv/*/metrics.csv")
    columns = metrics.read_text().splitlines()[0].split(",")
    assert set(tagged(callback.history[-1])) <= set(columns)
    assert {"bigbatch/noise_scale", "bigbatch/next_batch_size", "bigbatch/lr_factor"} <= set(
        columns
    )
    # each step's numbers at Lightning's own (0-based) step for it, as its training_step's
    import csv

    logged = [r for r in csv.DictReader(metrics.open()) if r.get("bigbatch/step")]
    assert all(float(r["bigbatch/step"]) == int(r["step"]) + 1 for r in logged)


def test_under_16_mixed_the_statistics_are_those_of_the_unscaled_gradient():
    """The engine reads the gradients before the AMP plugin unscales them, with its scale
    (read with the per-example norms, scaled, beside an unscaled sum: |G|^2 -1.4e7)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    data = teacher_data(512)
    runs = {}
    for name in ("32-true", "16-mixed"):
        sampler = bb.batch.GlobalBatchSampler(len(data), 32, micro_batches=2, max_samples=96)
        callback = AdaptiveBatchCallback(sampler, bb.batch.BatchWarmup(initial=32), log=False)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        plugins = [MixedPrecision("16-mixed", "cpu", scaler=scaler)] if name != "32-true" else []
        fit(callback, sampler, data, plugins=plugins)
        runs[name] = [(h["grad_sq_norm"], h["trace"]) for h in callback.history]
    # (CPU autocast in float16 rounds the products: a few parts in a thousand)
    for (g32, t32), (g16, t16) in zip(runs["32-true"], runs["16-mixed"], strict=True):
        assert g16 == pytest.approx(g32, rel=0.02) and t16 == pytest.approx(t32, rel=0.02)


class _Summed(Module):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y, reduction="sum")


@pytest.mark.parametrize("noise_from", ["sub_batches", "examples"])
def test_a_summed_loss_gives_the_statistics_adaptive_batch_does(noise_from):
    """loss_reduction="sum": each micro-batch's loss is b_i times its mean, divided by k by
    Lightning; the statistics took it as the mean's 1/k, their norms b_i² too large (x56)
    and B_simple off where the sizes differ (30 in 8, 8, 7, 7). At rate 0, the loop's."""
    data, options = teacher_data(512), {"statistics": True, "noise_from": noise_from}
    sampler = bb.batch.GlobalBatchSampler(len(data), 30, micro_batches=4, max_samples=90, seed=0)
    callback = AdaptiveBatchCallback(
        sampler, bb.batch.Constant(30), loss_reduction="sum", log=False, **options
    )
    fit(callback, sampler, data, module=_Summed(lr=0.0))
    model = make_model()
    loop = bb.AdaptiveBatch(
        model, torch.optim.SGD(model.parameters(), lr=0.0), data,
        controller=bb.batch.Constant(30), max_micro_batch=30, min_sub_batches=4, seed=0,
        **options,
    )  # fmt: skip
    expected = []
    for step in loop.steps(max_steps=3):
        for x, y in step.micro_batches():
            step.backward(nn.functional.cross_entropy(model(x), y))
        step.apply()
        expected.append((step.metrics["grad_sq_norm"], step.metrics["trace"]))
    got = [(h["grad_sq_norm"], h["trace"]) for h in callback.history]
    assert got == [pytest.approx(e, rel=1e-5) for e in expected]


def test_a_loss_scaled_by_16_mixed_reaches_the_engine_unscaled():
    """Lightning's AMP plugin scales the loss before on_before_backward: the logged loss (and
    BatchWarmup's loss slope) must be the loss itself, not loss × 65536."""
    from types import SimpleNamespace

    callback = AdaptiveBatchCallback(bb.batch.GlobalBatchSampler(4096, 32, micro_batches=4))
    given = []
    callback.driver = SimpleNamespace(add_loss=given.append)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    trainer = SimpleNamespace(precision_plugin=SimpleNamespace(scaler=scaler))
    callback.on_before_backward(trainer, None, torch.tensor(0.75) * 1024.0)
    assert given[0].item() == pytest.approx(0.75)
    callback.on_before_backward(SimpleNamespace(precision_plugin=object()), None, torch.tensor(2.0))
    assert given[1].item() == 2.0  # no scaler: the loss as given


def test_under_16_mixed_an_overflow_is_skipped_and_the_scale_lowered():
    """The engine skips an overflowed step by dropping its gradients, so the scaler never
    sees the inf: the engine lowers the scale itself (it stayed, and every step overflowed)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    data = teacher_data(512)
    sampler = bb.batch.GlobalBatchSampler(len(data), 32, micro_batches=2, max_samples=64)
    callback = AdaptiveBatchCallback(sampler, bb.batch.BatchWarmup(initial=32), log=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**100)
    fit(callback, sampler, data, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    assert callback.history[0]["skipped"] == 1.0
    assert scaler.get_scale() < 2.0**100


class _Validated(Module):
    validations = 0

    def validation_step(self, batch, batch_idx):
        self.validations += 1


def test_training_ends_at_the_sample_budget_and_the_epochs_validation_runs():
    """The sampler's ``len`` is an upper bound: after the budget Lightning ran empty epochs
    (forever with ``max_steps`` alone; here 3), and with ``max_epochs=1`` the epoch's end
    (its validation) never came."""
    data = teacher_data()
    for limit in ({"max_steps": 1000, "max_epochs": 3}, {"max_epochs": 1}):
        sampler = bb.batch.GlobalBatchSampler(len(data), 64, micro_batches=2, max_samples=640)
        callback = AdaptiveBatchCallback(sampler, bb.batch.Constant(64), log=False)
        trainer = pl.Trainer(
            accumulate_grad_batches=2, use_distributed_sampler=False, accelerator="cpu",
            devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[callback], num_sanity_val_steps=0, **limit,
        )  # fmt: skip
        module = _Validated()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", ".*does not have many workers.*")
            trainer.fit(module, DataLoader(data, batch_sampler=sampler),
                        DataLoader(data, batch_size=512))  # fmt: skip
        assert trainer.global_step == 10 and callback.samples == 640, limit
        assert trainer.current_epoch <= 1 and module.validations == 8, limit


def test_an_optimizer_step_on_a_part_of_a_step_is_refused():
    """``limit_train_batches`` (or ``fast_dev_run``) not a multiple of the micro-batches:
    Lightning steps the optimizer on the window's part; that step went past the statistics,
    the rate rule and the sample count, unsaid."""
    data = teacher_data()
    sampler = bb.batch.GlobalBatchSampler(len(data), 64, micro_batches=2, max_samples=6400)
    callback = AdaptiveBatchCallback(sampler, bb.batch.Constant(64), log=False)
    trainer = pl.Trainer(
        accumulate_grad_batches=2, use_distributed_sampler=False, accelerator="cpu", devices=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[callback], max_epochs=1, limit_train_batches=3,
    )  # fmt: skip
    with pytest.raises(RuntimeError, match=r"after 1 of its 2 micro-batches.*limit_train_batches"):
        trainer.fit(Module(), DataLoader(data, batch_sampler=sampler))


@pytest.mark.parametrize("mistake", ["no sampler", "another size"])
def test_a_loader_that_does_not_draw_with_the_sampler_is_one_error(mistake):
    """A loader without the sampler failed with "the loader drew more than 64 steps ahead";
    a dataset of another size with an IndexError mid-run."""
    data = teacher_data()
    sampler = bb.batch.GlobalBatchSampler(2 * len(data), 64, micro_batches=2, max_samples=640)
    if mistake == "no sampler":
        sampler = bb.batch.GlobalBatchSampler(len(data), 64, micro_batches=2, max_samples=640)
    callback = AdaptiveBatchCallback(sampler, bb.batch.Constant(64), log=False)
    trainer = pl.Trainer(
        accumulate_grad_batches=2, use_distributed_sampler=False, accelerator="cpu", devices=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[callback], max_epochs=1,
    )  # fmt: skip
    loader = DataLoader(data, batch_sampler=sampler)
    if mistake == "no sampler":
        loader = DataLoader(data, batch_size=8)
    expected = "draws its batches with BatchSampler" if mistake == "no sampler" else "8192 samples"
    with pytest.raises(ValueError, match=expected):
        trainer.fit(Module(), loader)


class _SkipsOne(Module):
    def training_step(self, batch, batch_idx):
        return None if batch_idx == 3 else super().training_step(batch, batch_idx)


def test_a_training_step_that_returns_none_inside_a_step_is_one_error():
    """Lightning skips the backward of a micro-batch whose training_step returns None and
    steps anyway: the step went undecided, and every later decision a step late."""
    data = teacher_data()
    sampler = bb.batch.GlobalBatchSampler(len(data), 64, micro_batches=2, max_samples=640)
    callback = AdaptiveBatchCallback(sampler, bb.batch.Constant(64), log=False)
    with pytest.raises(RuntimeError, match="training_step returned None for 1 of this step's 2"):
        fit(callback, sampler, data, module=_SkipsOne())


def test_a_sampler_without_a_sample_budget_is_refused():
    """Its loader has no len(): Lightning drew a batch ahead, each new size a step late."""
    data = teacher_data()
    sampler = bb.batch.GlobalBatchSampler(len(data), 64, micro_batches=2)
    callback = AdaptiveBatchCallback(sampler, bb.batch.Constant(64), log=False)
    with pytest.raises(ValueError, match="the sampler needs max_samples"):
        fit(callback, sampler, data)


def test_accumulation_other_than_the_samplers_micro_batches_is_refused_by_name():
    data = teacher_data()
    sampler = bb.batch.GlobalBatchSampler(len(data), 64, micro_batches=4, max_samples=640)
    callback = AdaptiveBatchCallback(sampler, bb.batch.Constant(64), log=False)
    trainer = pl.Trainer(
        accumulate_grad_batches=2, max_epochs=1, accelerator="cpu", logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        use_distributed_sampler=False, callbacks=[callback],
    )  # fmt: skip
    refused = r"accumulate_grad_batches \(2\) must equal the sampler's micro_batches \(4\)"
    with pytest.raises(ValueError, match=refused):
        trainer.fit(Module(), DataLoader(data, batch_sampler=sampler))


class _NoOptimizer(Module):
    def configure_optimizers(self):
        return None


def test_a_module_without_an_optimizer_is_refused_by_name():
    """configure_optimizers returning None: Lightning trains with a stand-in optimizer of no
    parameters, and the first step was an IndexError from inside bigbatch."""
    data = teacher_data()
    sampler = bb.batch.GlobalBatchSampler(len(data), 64, micro_batches=2, max_samples=640)
    callback = AdaptiveBatchCallback(sampler, bb.batch.Constant(64), log=False)
    with pytest.raises(ValueError, match="exactly one optimizer, got 0"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's: no optimizer, so none is stepped
        fit(callback, sampler, data, module=_NoOptimizer())


class _EpochScheduled(Module):
    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)]


def test_intervals_of_the_whole_run_are_warned_of():
    """The budget is one Lightning epoch: an epoch-stepped scheduler stepped once, at its end."""
    data = teacher_data()
    sampler = bb.batch.GlobalBatchSampler(len(data), 64, micro_batches=2, max_samples=640)
    callback = AdaptiveBatchCallback(sampler, bb.batch.Constant(64), log=False)
    with pytest.warns(UserWarning, match="interval='epoch' would act once, at its end"):
        fit(callback, sampler, data, module=_EpochScheduled())


def test_a_fraction_of_the_epoch_as_the_validation_interval_is_warned_of():
    """``val_check_interval=0.5`` is half of the loader's length, an upper bound on the
    batches: it would validate once, at the budget's end, not halfway."""
    data = teacher_data()
    sampler = bb.batch.GlobalBatchSampler(len(data), 64, micro_batches=2, max_samples=640)
    callback = AdaptiveBatchCallback(sampler, bb.batch.Constant(64), log=False)
    trainer = pl.Trainer(
        accumulate_grad_batches=2, use_distributed_sampler=False, accelerator="cpu", devices=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, max_epochs=1,
        enable_model_summary=False, callbacks=[callback], num_sanity_val_steps=0,
        val_check_interval=0.5,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        with pytest.warns(UserWarning, match=r"val_check_interval=0\.5 would act once"):
            trainer.fit(_Validated(), DataLoader(data, batch_sampler=sampler),
                        DataLoader(data, batch_size=512))  # fmt: skip


def test_validating_with_the_callback_attached_checks_nothing_of_a_fit():
    """The callback's checks are a fit's: ``trainer.validate`` beside it (its sampler
    without a budget, no accumulation) runs the module's validation as without it."""
    data = teacher_data()
    sampler = bb.batch.GlobalBatchSampler(len(data), 64, micro_batches=2)
    callback = AdaptiveBatchCallback(sampler, bb.batch.Constant(64), log=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
    )  # fmt: skip
    module = _Validated()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        trainer.validate(module, DataLoader(data, batch_size=512))
    assert module.validations == 8 and callback.history == []
