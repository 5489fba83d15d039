from pathlib import Path

import numpy as np
import pytest
import torch

from bigbatch.experiments import tasks
from bigbatch.experiments.build import build
from bigbatch.experiments.config import ConfigError, resolve


def test_mnist1d_is_generated_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BIGBATCH_CACHE", str(tmp_path))
    # 2,000 samples: the task's 50,000 take half a minute to generate on two cores
    first = tasks.mnist1d_arrays(samples=2_000)
    assert first["x"].shape == (1_600, 40) and first["x_test"].shape == (400, 40)
    assert sorted(np.unique(first["y"])) == list(range(10))
    assert len(list(tmp_path.glob("mnist1d-*.npz"))) == 1
    again = tasks.mnist1d_arrays(samples=2_000)
    assert all(np.array_equal(first[k], again[k]) for k in first)


def test_markov_language_entropy_is_the_loss_floor():
    transition, floor = tasks.markov_language(vocab=4, alpha=1.0, seed=0)
    rows = transition.sum(1)
    assert np.allclose(rows.numpy(), 1.0)
    assert 0 < floor < np.log(4)


@pytest.mark.parametrize("name", ["digits", "teacher"])
def test_train_samples_keeps_the_first_samples_and_scores_the_gap_on_them(name):
    config = resolve({"task": name, "train_samples": 300})
    config = {**config, "model.width": 8, "model.depth": 1}
    problem = tasks.TASKS[name].build(config)
    full = tasks.TASKS[name].build({**config, "train_samples": 0})
    assert len(problem.train) == 300
    assert all(torch.equal(a, b) for a, b in zip(problem.train[:300], full.train[:300]))
    assert all(torch.equal(a, b) for a, b in zip(problem.test, full.test))  # the same test set
    if problem.evaluate_train is not None:  # train accuracy over exactly the kept samples
        model = problem.model
        x, y = problem.train.tensors
        expected = (model(x).argmax(1) == y).float().mean().item()
        assert problem.evaluate_train(model)["eval_accuracy"] == pytest.approx(expected)


def test_more_train_samples_than_the_task_has_is_one_error():
    config = resolve({"task": "digits", "train_samples": 5000})
    with pytest.raises(ConfigError, match=r"train_samples = 5000 is more than the task's 1,437"):
        build(config)


# ---------------------------------------------------------------- text


def _source_tree(root, files):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_text_corpus_is_deterministic_and_holds_whole_files_out(tmp_path):
    files = {f"pkg/mod{i:03d}.py": f"x = {i}\n" * (i % 7 + 1) for i in range(60)}
    _source_tree(tmp_path, files)
    train, validation, info = tasks.text_corpus(tmp_path)
    again = tasks.text_corpus(tmp_path)
    assert np.array_equal(train, again[0]) and np.array_equal(validation, again[1])
    assert info == again[2]
    held = sorted(n for n in files if tasks.data.held_out(n))
    assert info["validation_files"] == len(held) and 0 < len(held) < 15  # about a tenth
    assert info["train_files"] + info["validation_files"] == 60
    # whole files, in sorted order, on the side their path hashes to
    assert validation.tobytes() == "".join(files[n] for n in held).encode()
    assert info["corpus_bytes"] == train.size + validation.size
    (tmp_path / "pkg/mod000.py").write_text("changed\n")
    assert tasks.text_corpus(tmp_path)[2]["corpus_sha256"] != info["corpus_sha256"]


def test_byte_windows_predict_every_byte_once_or_spread_evenly():
    stream = np.arange(20, dtype=np.uint8)
    every = tasks.byte_windows(stream, 5)
    assert every.dtype == torch.uint8 and every.shape == (4, 5)
    assert every[1].tolist() == [4, 5, 6, 7, 8]  # windows overlap by the one byte they predict
    spread = tasks.byte_windows(stream, 5, count=3)
    assert [w[0].item() for w in spread] == [0, 7, 15]
    with pytest.raises(ValueError, match="hold no window"):
        tasks.byte_windows(stream[:3], 5)


@pytest.fixture
def one_thread():
    """Torch on one thread: the fastest for a test's tiny matrices, and no thread waits on
    a core another process keeps busy (two threads took 40x longer on a loaded machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _text_config(**keys):
    """The text task at a test's size: a small model on windows of 8 bytes."""
    from bigbatch.experiments.build import with_task_defaults

    small = {"task": "text", "model.width": 16, "model.depth": 1, "model.context": 8}
    return with_task_defaults(resolve({**small, **keys}))


def test_text_build_is_deterministic_and_holds_out_a_tenth_of_the_files():
    config = _text_config()
    first, second = tasks.TASKS["text"].build(config), tasks.TASKS["text"].build(config)
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


def test_text_task_scores_cross_entropy_per_byte_and_honours_the_context(one_thread):
    problem = tasks.TASKS["text"].build(_text_config())
    (window,) = problem.train[0]
    assert window.shape == (9,) and window.dtype == torch.uint8
    x, y = problem.test
    assert x.shape == (1000, 8) and torch.equal(x[:, 1:], y[:, :-1])  # targets: the next byte
    longer = tasks.TASKS["text"].build(_text_config(**{"model.context": 16}))
    assert longer.train[0][0].shape == (17,) and longer.test[0].shape == (1000, 16)
    model = problem.model
    with torch.no_grad():
        log_p = model(x.long()).double().log_softmax(-1)
    picked = log_p.gather(-1, y.long().unsqueeze(-1)).squeeze(-1)  # log p(next byte)
    scores = problem.evaluate(model)
    assert scores["eval_loss"] == pytest.approx(-picked.mean().item(), rel=1e-5)
    hits = (log_p.argmax(-1) == y).double().mean().item()
    assert scores["eval_accuracy"] == pytest.approx(hits)
    assert scores["max_attention_logit"] > 0
    batch = (torch.stack([problem.train[i][0] for i in range(64)]),)
    assert problem.loss(model, batch).item() == pytest.approx(np.log(256), rel=0.1)  # untrained


def test_a_few_steps_lower_the_text_loss(one_thread):
    steps = {"batch.controller": "constant", "batch.initial": 32, "max_samples": 32 * 30}
    # the first 20,000 windows: the sampler shuffles those, not the corpus's millions
    config = _text_config(**steps, lr=0.01, train_samples=20_000)
    problem, loop, _ = build(config)
    held = (torch.stack([problem.train[i][0] for i in range(0, 20_000, 100)]),)
    with torch.no_grad():
        before = problem.loss(loop.model, held).item()
    for step in loop.steps(max_samples=config["max_samples"]):
        for batch in step.micro_batches():
            step.backward(problem.loss(loop.model, batch))
        step.apply()
    with torch.no_grad():
        after = problem.loss(loop.model, held).item()
    assert after < before - 0.7  # measured: 5.70 to 4.61 (seed 0), 5.76 to 4.56 (seed 1)


def test_the_text_model_runs_under_bf16_autocast(one_thread):
    problem = tasks.TASKS["text"].build(_text_config())
    batch = (torch.stack([problem.train[i][0] for i in range(8)]),)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = problem.loss(problem.model, batch)
    loss.backward()
    assert torch.isfinite(loss) and problem.model.head.weight.grad is not None


def test_lm_honours_model_context_too():
    from bigbatch.experiments.build import with_task_defaults

    config = with_task_defaults(resolve({"task": "lm", "model.context": 8, "model.width": 16}))
    problem = tasks.TASKS["lm"].build(config)
    assert problem.train[0][0].shape == (8,) and problem.test[0].shape == (1000, 8)


def test_a_context_on_a_task_without_sequences_is_one_error():
    from bigbatch.experiments.build import with_task_defaults

    config = resolve({"task": "mnist1d", "model.context": 16})
    with pytest.raises(ConfigError, match=r"model.context = 16 .* mnist1d task has no sequences"):
        with_task_defaults(config)
