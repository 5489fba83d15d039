"""Each task's build (tasks/registry.py): its training samples, its held-out files, its context."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from bigbatch.experiments import tasks
from bigbatch.experiments.build import build
from bigbatch.experiments.config import ConfigError, resolve
from bigbatch.experiments.plan import plan_run

from .common import text_config


@pytest.mark.parametrize("name", ["digits", "teacher"])
def test_train_samples_keeps_the_first_samples_and_scores_the_gap_on_them(name):
    args = plan_run({"task": name, "train_samples": 300, "model.width": 8, "model.depth": 1})
    problem = tasks.TASKS[name].build(args.task_args)
    full = tasks.TASKS[name].build(replace(args.task_args, train_samples=0))
    assert len(problem.train) == 300
    assert all(torch.equal(a, b) for a, b in zip(problem.train[:300], full.train[:300]))
    assert all(torch.equal(a, b) for a, b in zip(problem.test, full.test))  # the same test set
    if problem.evaluate_train is not None:  # train accuracy over exactly the kept samples
        model = problem.model
        x, y = problem.train.tensors
        expected = (model(x).argmax(1) == y).float().mean().item()
        assert problem.evaluate_train(model)["eval_accuracy"] == pytest.approx(expected)


def test_more_train_samples_than_the_task_has_is_one_error():
    config = plan_run({"task": "digits", "train_samples": 5000})
    with pytest.raises(ConfigError, match=r"train_samples = 5000 is more than the task's 1,437"):
        build(config)


def test_text_build_is_deterministic_and_holds_out_a_tenth_of_the_files():
    args = text_config().task_args
    first, second = tasks.TASKS["text"].build(args), tasks.TASKS["text"].build(args)
    assert torch.equal(first.train.tensors[0], second.train.tensors[0])
    assert all(torch.equal(a, b) for a, b in zip(first.test, second.test))
    assert first.info == second.info
    digest = first.info["corpus_sha256"]
    assert isinstance(digest, str) and len(digest) == 64
    shares = first.info["validation_files"] / (
        first.info["train_files"] + first.info["validation_files"]
    )
    assert 0.07 < shares < 0.13
    root = Path(torch.__file__).parent
    names = [p.relative_to(root).as_posix() for p in root.rglob("*.py")]
    held = {n for n in names if tasks.data.held_out(n)}
    assert first.info["validation_files"] == len(held)
    assert first.info["train_files"] == len(set(names) - held)  # no file on both sides


def test_lm_honours_model_context_too():
    config = plan_run({"task": "lm", "model.context": 8, "model.width": 16})
    problem = tasks.TASKS["lm"].build(config.task_args)
    assert problem.train[0][0].shape == (8,) and problem.test[0].shape == (1000, 8)


def test_a_context_on_a_task_without_sequences_is_one_error():
    config = resolve({"task": "mnist1d", "model.context": 16})
    with pytest.raises(ConfigError, match=r"model.context = 16 .* mnist1d task has no sequences"):
        plan_run(config)


def _python_files(root, count=30):
    for i in range(count):
        (root / f"mod{i:02d}.py").write_text(f"value_{i} = {i}  # a line of source\n" * 40)


def test_text_reads_the_corpus_it_is_named_and_says_which(tmp_path):
    _python_files(tmp_path)
    config = text_config(**{"text.corpus": str(tmp_path)})
    problem = tasks.TASKS["text"].build(config.task_args)
    train, _, info = tasks.text_corpus(tmp_path)
    assert problem.info == {"corpus": str(tmp_path.resolve()), **info}
    assert problem.train.tensors[0].flatten()[:9].numpy().tobytes() == train[:9].tobytes()


def test_a_corpus_too_short_for_the_context_names_both_keys(tmp_path):
    _python_files(tmp_path)
    config = text_config(**{"text.corpus": str(tmp_path), "model.context": 20_000})
    with pytest.raises(ConfigError, match=r"^model.context = 20000: text.corpus = '.*' has "
                       r"[\d,]+ bytes of (training|held-out) files, no window of 20000 and its "
                       r"next byte \(a shorter context, or a larger corpus\)$"):  # fmt: skip
        build(config)


def test_a_corpus_that_is_neither_package_nor_folder_is_one_error():
    config = text_config(**{"text.corpus": "no_such_package_here"})
    with pytest.raises(
        ConfigError, match=r"text.corpus = 'no_such_package_here' is not an installed"
    ):
        build(config)


def test_a_corpus_on_a_task_without_one_is_one_error():
    config = resolve({"task": "digits", "text.corpus": "sympy"})
    with pytest.raises(ConfigError, match=r"'sympy' is set, but the digits task does not read"):
        plan_run(config)


@pytest.mark.parametrize(("lr_max", "factor"), [(0.0, None), (0.05, 0.5)])
def test_the_loop_stops_the_rate_at_lr_max(lr_max, factor):
    layer = {"task": "digits", "lr": 0.1, "lr_max": lr_max, "model.width": 8, "model.depth": 1}
    _, loop, _ = build(plan_run(layer))
    assert loop.engine.options.max_lr_factor == factor
