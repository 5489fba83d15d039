"""The Hugging Face Trainer integration with the real transformers (skipped only without it)."""

import warnings

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import bigbatch as bb  # noqa: E402
from bigbatch.integrations.hf import AdaptiveBatchTrainer  # noqa: E402
from bigbatch.sinks import tagged  # noqa: E402

from ._data import Teacher  # noqa: E402
from .hf_programs import tiny_llama  # noqa: E402


class Net(nn.Module):
    def __init__(self, dropout=0.0):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(16, 32), nn.Tanh(), nn.Dropout(dropout), nn.Linear(32, 4)
        )

    def forward(self, x, labels=None):
        logits = self.net(x)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def make_trainer(
    tmp_path, sampler, controller, statistics=None, dropout=0.0, eval_dataset=None, **args
):
    settings = dict(
        output_dir=str(tmp_path),
        gradient_accumulation_steps=sampler.micro_batches,
        learning_rate=0.2,
        optim="sgd",
        weight_decay=0.0,
        max_grad_norm=0.0,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
        data_seed=0,
    )
    arguments = transformers.TrainingArguments(**{**settings, **args})
    return AdaptiveBatchTrainer(
        model=Net(dropout),
        args=arguments,
        train_dataset=Teacher(),
        eval_dataset=eval_dataset,
        sampler=sampler,
        controller=controller,
        statistics=statistics,
    )


def train(trainer, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train(**kwargs)
    return trainer


def test_constant_batches_train_exactly_like_adaptive_batch(tmp_path):
    batch, k, steps = 64, 4, 12
    sampler = bb.batch.GlobalBatchSampler(4096, batch, micro_batches=k, max_samples=batch * steps)
    trainer = train(make_trainer(tmp_path, sampler, bb.batch.Constant(batch)))
    history = trainer.bigbatch.history
    assert len(history) == steps and trainer.bigbatch.samples == batch * steps

    model = Net()
    data = Teacher()
    loop = bb.AdaptiveBatch(
        model,
        torch.optim.SGD(model.parameters(), lr=0.2),
        torch.utils.data.TensorDataset(data.x, data.y),
        controller=bb.batch.Constant(batch),
        max_micro_batch=batch,
        min_sub_batches=k,
    )
    losses = []
    for step in loop.steps(max_steps=steps):
        for x, y in step.micro_batches():
            step.backward(nn.functional.cross_entropy(model.net(x), y))
        step.apply()
        losses.append(step.metrics["loss"])
    for a, b in zip(trainer.model.parameters(), model.parameters()):
        torch.testing.assert_close(a, b)
    assert [h["loss"] for h in history] == pytest.approx(losses, rel=1e-5)


class _Summed(Net):
    def forward(self, x, labels=None):
        logits = self.net(x)
        loss = nn.functional.cross_entropy(logits, labels, reduction="sum")
        return {"loss": loss, "logits": logits}


def test_a_summed_loss_gives_the_statistics_adaptive_batch_does(tmp_path):
    """loss_reduction="sum": the Trainer divides each micro-batch's summed loss by k, b_i/k
    of its mean; the statistics took it as the mean's 1/k (norms x58). At rate 0."""
    sampler = bb.batch.GlobalBatchSampler(4096, 30, micro_batches=4, max_samples=90)
    trainer = make_trainer(tmp_path, sampler, bb.batch.Constant(30), learning_rate=0.0)
    trainer = AdaptiveBatchTrainer(
        model=_Summed(), args=trainer.args, train_dataset=Teacher(), sampler=sampler,
        controller=bb.batch.Constant(30), statistics=True, loss_reduction="sum",
        noise_from="sub_batches",
    )  # fmt: skip
    got = [(h["grad_sq_norm"], h["trace"]) for h in train(trainer).bigbatch.history]
    model, data = Net(), Teacher()
    loop = bb.AdaptiveBatch(
        model, torch.optim.SGD(model.parameters(), lr=0.0),
        torch.utils.data.TensorDataset(data.x, data.y), controller=bb.batch.Constant(30),
        max_micro_batch=30, min_sub_batches=4, statistics=True, noise_from="sub_batches",
    )  # fmt: skip
    expected = []
    for step in loop.steps(max_steps=3):
        for x, y in step.micro_batches():
            step.backward(nn.functional.cross_entropy(model.net(x), y))
        step.apply()
        expected.append((step.metrics["grad_sq_norm"], step.metrics["trace"]))
    assert got == [pytest.approx(e, rel=1e-5) for e in expected]


class _MeanOverKwargs(Net):
    """A forward that takes the loss's keywords (so the Trainer counts the window's
    labels for it) and returns each micro-batch's mean all the same."""

    def forward(self, x, labels=None, **kwargs):
        return super().forward(x, labels)


def test_a_loss_the_user_says_is_not_scaled_for_accumulation_weighs_one_kth(tmp_path):
    """``loss_is_scaled_for_ga = False``: the Trainer divides each micro-batch's mean by k
    whatever the model takes, as for a model that takes no loss keywords; weighed as
    label shares (8/30 and 7/30, not 1/4) the statistics differ. Micro-batches of 8, 8,
    7, 7, at rate 0."""
    statistics = []
    for model in (Net(), _MeanOverKwargs()):
        sampler = bb.batch.GlobalBatchSampler(4096, 30, micro_batches=4, max_samples=90)
        trainer = make_trainer(tmp_path, sampler, bb.batch.Constant(30), learning_rate=0.0)
        trainer = AdaptiveBatchTrainer(
            model=model, args=trainer.args, train_dataset=Teacher(), sampler=sampler,
            controller=bb.batch.Constant(30), statistics=True, noise_from="sub_batches",
        )  # fmt: skip
        assert trainer.model_accepts_loss_kwargs == isinstance(model, _MeanOverKwargs)
        trainer.loss_is_scaled_for_ga = False
        history = train(trainer).bigbatch.history
        statistics.append([(h["grad_sq_norm"], h["trace"]) for h in history])
    assert len(statistics[0]) == 3
    assert statistics[1] == [pytest.approx(s, rel=1e-6) for s in statistics[0]]


@pytest.mark.parametrize(
    ("average", "n_gpu", "processes", "tensor_parallel", "scale"),
    [(True, 4, 1, 1, 4), (True, 1, 4, 2, 2), (True, 0, 3, 1, 3), (False, 4, 4, 1, 1)],
)
def test_the_across_processes_scale_is_the_one_compute_loss_multiplies_by(
    average, n_gpu, processes, tensor_parallel, scale
):
    """compute_loss multiplies a loss over every process's labels by the GPUs of one
    process's DataParallel where there are several, else by the processes over the
    tensor-parallel groups (none of it can run on this machine: the rule, by stand-ins)."""
    from types import SimpleNamespace

    trainer = SimpleNamespace(
        args=SimpleNamespace(average_tokens_across_devices=average, n_gpu=n_gpu),
        model_accepts_loss_kwargs=True, compute_loss_func=None,
        accelerator=SimpleNamespace(num_processes=processes), get_tp_size=lambda: tensor_parallel,
    )  # fmt: skip
    assert AdaptiveBatchTrainer._across_processes_scale(trainer) == scale


def test_batch_sizes_adapt_and_training_ends_at_the_sample_budget(tmp_path):
    sampler = bb.batch.GlobalBatchSampler(4096, 32, micro_batches=4, max_samples=30_000)
    controller = bb.batch.SimiGrad(target=0.5, initial=32, min=8, max=1024, window=5)
    trainer = train(make_trainer(tmp_path, sampler, controller))
    history = trainer.bigbatch.history
    assert len({h["batch_size"] for h in history}) > 3
    assert 30_000 <= trainer.bigbatch.samples < 30_000 + 1024
    losses = [h["loss"] for h in history]
    assert sum(losses[-5:]) < 0.7 * sum(losses[:5])


def test_a_run_resumed_from_a_checkpoint_continues_exactly(tmp_path):
    def run(resume=None):
        sampler = bb.batch.GlobalBatchSampler(4096, 32, micro_batches=4, max_samples=8000)
        controller = bb.batch.SimiGrad(target=0.5, initial=32, min=8, max=512, window=3)
        trainer = make_trainer(
            tmp_path, sampler, controller, save_strategy="steps", save_steps=10, dropout=0.2
        )  # dropout: the random state resumes too
        return train(trainer, resume_from_checkpoint=resume)

    straight = run()
    resumed = run(resume=str(tmp_path / "checkpoint-20"))
    tail = [h["batch_size"] for h in straight.bigbatch.history[20:]]
    assert [h["batch_size"] for h in resumed.bigbatch.history] == tail
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)


def test_statistics_are_taken_before_gradient_clipping(tmp_path):
    batch, k = 64, 4
    sampler = bb.batch.GlobalBatchSampler(4096, batch, micro_batches=k, max_samples=batch)
    constant = bb.batch.Constant(batch)
    trainer = train(make_trainer(tmp_path, sampler, constant, True, max_grad_norm=1e-4))
    clipped = trainer.bigbatch.history[0]
    sampler = bb.batch.GlobalBatchSampler(4096, batch, micro_batches=k, max_samples=batch)
    trainer = train(make_trainer(tmp_path, sampler, bb.batch.Constant(batch), True))
    unclipped = trainer.bigbatch.history[0]
    for name in ("grad_sq_norm", "trace", "similarity"):
        assert clipped[name] == pytest.approx(unclipped[name], rel=1e-6), name


def test_every_number_of_a_step_goes_to_the_trainers_logs_under_one_prefix(tmp_path):
    sampler = bb.batch.GlobalBatchSampler(4096, 32, micro_batches=4, max_samples=4_000)
    controller = bb.batch.SimiGrad(target=0.5, initial=32, min=8, max=1024, window=5)
    trainer = make_trainer(tmp_path, sampler, controller, logging_strategy="steps", logging_steps=1)
    train(trainer)
    logged = [h for h in trainer.state.log_history if "bigbatch/batch_size" in h]
    assert len(logged) >= len(trainer.bigbatch.history) - 1
    assert set(tagged(trainer.bigbatch.history[-1])) <= set(logged[-1])
    assert {"bigbatch/noise_scale", "bigbatch/next_batch_size", "bigbatch/samples"} <= set(
        logged[-1]
    )
    # the end-of-training summary does not repeat the last step's (a logger got it twice)
    (summary,) = [h for h in trainer.state.log_history if "train_runtime" in h]
    assert not any(k.startswith("bigbatch/") for k in summary)


class PaddedTokens(torch.utils.data.Dataset):
    """Token sequences whose labels end in padding (-100) of random length."""

    def __init__(self, n=128, length=12):
        generator = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, 32, (n, length), generator=generator)
        self.lengths = torch.randint(2, length + 1, (n,), generator=generator)

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        labels = self.tokens[i].clone()
        labels[self.lengths[i] :] = -100
        return {"input_ids": self.tokens[i], "labels": labels}


def test_a_causal_lms_micro_batches_weigh_the_labels_the_trainer_counts(tmp_path):
    """A Llama-type loss predicts labels[..., 1:] and the Trainer divides each micro-batch's
    sum by their count over the window: the engine's weights were all labels' share
    (summing to 1.11-1.14 with padding; the noise scale off up to 10x)."""
    torch.manual_seed(0)
    model = tiny_llama()
    sampler = bb.batch.GlobalBatchSampler(128, 16, micro_batches=4, max_samples=48)
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path), gradient_accumulation_steps=4, learning_rate=1e-3,
        max_grad_norm=0.0, report_to=[], save_strategy="no", logging_strategy="no",
        disable_tqdm=True, use_cpu=True,
    )  # fmt: skip
    trainer = AdaptiveBatchTrainer(
        model=model, args=arguments,
        train_dataset=PaddedTokens(), sampler=sampler, controller=bb.batch.Constant(16),
        statistics=True,
    )  # fmt: skip
    seen, draw = [], trainer.get_batch_samples

    def recorded(*args):
        batches, count = draw(*args)
        if batches:
            seen.append((batches, count, list(trainer.bigbatch.loss_weights)))
        return batches, count

    trainer.get_batch_samples = recorded
    train(trainer)
    assert len(seen) == 3
    for batches, count, weights in seen:
        shifted = [float((b["labels"][..., 1:] != -100).sum()) / float(count) for b in batches]
        assert weights == pytest.approx(shifted) and sum(weights) == pytest.approx(1.0)


class _WithIndex(Teacher):
    """Teacher's dicts with a field the model's forward does not take."""

    def __getitem__(self, i):
        return {**super().__getitem__(i), "idx": i}


def test_fields_the_model_does_not_take_are_dropped_as_the_trainer_drops_them(tmp_path):
    """``remove_unused_columns`` (the Trainer's default): its own loader drops what forward
    does not take; this one handed ``idx`` to forward (a TypeError)."""
    sampler = bb.batch.GlobalBatchSampler(4096, 32, micro_batches=2, max_samples=96)
    trainer = make_trainer(tmp_path, sampler, bb.batch.Constant(32))
    trainer.train_dataset = _WithIndex()
    assert train(trainer).state.global_step == 3


def test_a_dataset_of_another_size_than_the_samplers_is_one_error(tmp_path):
    sampler = bb.batch.GlobalBatchSampler(10_000, 32, micro_batches=2, max_samples=96)
    with pytest.raises(ValueError, match="draws from 10000 samples, the train dataset has 4096"):
        make_trainer(tmp_path, sampler, bb.batch.Constant(32))


def test_a_causal_lms_statistics_under_ddp_equal_one_process(tmp_path):
    """transformers multiplies a loss divided by every process's label count by the
    processes: the engine's weights summed to 1/W a rank, the trace 5x too large and
    |G|² negative under torchrun. (Micro-batches of 8 either way: units of one example.)"""
    from ..parallel.cluster import Cluster
    from . import hf_programs

    one = hf_programs.causal_lm_statistics(str(tmp_path / "one"), micro_batches=4)
    cluster = Cluster(2)
    try:
        ranks = cluster.run(hf_programs.causal_lm_statistics, str(tmp_path / "two"), 2)
    finally:
        cluster.close()
    for rank in ranks:
        assert rank["weights"] == pytest.approx([1.0] * 4)
        assert rank["trace"] == pytest.approx(one["trace"], rel=1e-4)
        assert rank["grad_sq_norm"] == pytest.approx(one["grad_sq_norm"], rel=1e-3, abs=1e-6)


def test_a_controller_that_shrinks_the_batch_trains_the_whole_sample_budget(tmp_path):
    """The Trainer's max_steps bound counts steps at the controller's smallest batch: at the
    sampler's first batch (32) it would end a run that falls to 8 at 5 steps of 10."""
    sampler = bb.batch.GlobalBatchSampler(4096, 32, micro_batches=2, max_samples=128)
    ramp = bb.batch.Ramp(points=[(0, 32), (64, 8)])
    trainer = train(make_trainer(tmp_path, sampler, ramp))
    assert trainer.state.global_step == 10
    assert [h["batch_size"] for h in trainer.bigbatch.history] == [32, 32] + [8] * 8


def test_the_budgets_end_saves_and_evaluates_as_max_steps_would(tmp_path):
    """The run's last steps were in no checkpoint and never evaluated: the Trainer's own
    end (at max_steps) was never reached."""
    sampler = bb.batch.GlobalBatchSampler(4096, 64, micro_batches=2, max_samples=64 * 12)
    settings = dict(save_strategy="steps", save_steps=5, eval_strategy="steps", eval_steps=5)
    evals = Teacher(256, seed=1)
    trainer = make_trainer(tmp_path, sampler, bb.batch.Constant(64), eval_dataset=evals, **settings)
    train(trainer)
    assert trainer.state.global_step == 12
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == [
        "checkpoint-10", "checkpoint-12", "checkpoint-5",
    ]  # fmt: skip
    assert [h["step"] for h in trainer.state.log_history if "eval_loss" in h] == [5, 10, 12]


def test_the_users_arguments_are_left_as_given(tmp_path):
    """The Trainer's max_steps bound was written into the user's arguments: a second
    Trainer given them stopped at the first one's bound, short of its own budget."""
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path), learning_rate=0.2, optim="sgd", report_to=[],
        save_strategy="no", logging_strategy="no", disable_tqdm=True, use_cpu=True,
    )  # fmt: skip
    steps = []
    for budget in (128, 640):
        sampler = bb.batch.GlobalBatchSampler(4096, 64, micro_batches=1, max_samples=budget)
        trainer = AdaptiveBatchTrainer(
            model=Net(), args=arguments, train_dataset=Teacher(), sampler=sampler,
            controller=bb.batch.Constant(64),
        )  # fmt: skip
        steps.append(train(trainer).state.global_step)
    assert arguments.max_steps == -1 and not arguments.ignore_data_skip
    assert steps == [2, 10]


def test_a_checkpoint_without_the_samplers_state_is_refused(tmp_path):
    """save_only_model keeps no bigbatch.pt: the resumed run began its sample budget again."""
    sampler = bb.batch.GlobalBatchSampler(4096, 64, micro_batches=1, max_samples=640)
    settings = dict(save_strategy="steps", save_steps=5, save_only_model=True)
    train(make_trainer(tmp_path, sampler, bb.batch.Constant(64), **settings))
    sampler = bb.batch.GlobalBatchSampler(4096, 64, micro_batches=1, max_samples=640)
    trainer = make_trainer(tmp_path, sampler, bb.batch.Constant(64), **settings)
    with pytest.raises(ValueError, match=r"checkpoint-5 has no bigbatch\.pt: it keeps no sampler"):
        train(trainer, resume_from_checkpoint=str(tmp_path / "checkpoint-5"))


def test_a_trainer_schedule_left_unused_is_warned_of(tmp_path):
    sampler = bb.batch.GlobalBatchSampler(4096, 64, micro_batches=1, max_samples=640)
    with pytest.warns(UserWarning, match="lr_scheduler_type='cosine' and its warm-up are not"):
        make_trainer(tmp_path, sampler, bb.batch.Constant(64), lr_scheduler_type="cosine")


def test_intervals_of_the_whole_run_are_warned_of(tmp_path):
    sampler = bb.batch.GlobalBatchSampler(4096, 64, micro_batches=1, max_samples=640)
    with pytest.warns(UserWarning, match="eval_strategy='epoch', logging_steps=0.1 would act"):
        make_trainer(
            tmp_path, sampler, bb.batch.Constant(64), eval_strategy="epoch",
            eval_dataset=Teacher(), logging_strategy="steps", logging_steps=0.1,
        )  # fmt: skip


def test_a_sampler_without_a_budget_or_of_another_accumulation_is_refused_by_name(tmp_path):
    endless = bb.batch.GlobalBatchSampler(4096, 64, micro_batches=4)
    with pytest.raises(ValueError, match="the sampler needs max_samples"):
        make_trainer(tmp_path, endless, bb.batch.Constant(64))
    sampler = bb.batch.GlobalBatchSampler(4096, 64, micro_batches=4, max_samples=640)
    with pytest.raises(
        ValueError,
        match=r"gradient_accumulation_steps \(2\) must equal the sampler's micro_batches \(4\)",
    ):
        make_trainer(tmp_path, sampler, bb.batch.Constant(64), gradient_accumulation_steps=2)
