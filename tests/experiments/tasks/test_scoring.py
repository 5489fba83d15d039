"""How a task's model is scored: losses and held-out evaluations."""

import numpy as np
import pytest
import torch

from bigbatch.experiments import tasks

from .common import text_config


def test_text_task_scores_cross_entropy_per_byte_and_honours_the_context(one_thread):
    problem = tasks.TASKS["text"].build(text_config().task_args)
    (window,) = problem.train[0]
    assert window.shape == (9,) and window.dtype == torch.uint8
    x, y = problem.test
    assert x.shape == (1000, 8) and torch.equal(x[:, 1:], y[:, :-1])  # targets: the next byte
    longer = tasks.TASKS["text"].build(text_config(**{"model.context": 16}).task_args)
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


@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_an_evaluation_is_the_same_whatever_its_chunks(chunk, one_thread):
    """The device's chunk (scoring.EVAL_CHUNKS) is a matter of speed only."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    x, y = torch.randn(50, 5), torch.randint(0, 3, (50,))
    whole = tasks.scoring.classification_eval(x, y, chunk=len(x))(model)
    parts = tasks.scoring.classification_eval(x, y, chunk=chunk)(model)
    assert parts["eval_accuracy"] == whole["eval_accuracy"]
    assert parts["eval_loss"] == pytest.approx(whole["eval_loss"], rel=1e-6)
    assert tasks.scoring.classification_eval(x, y)(model) == pytest.approx(whole, rel=1e-6)


@pytest.mark.parametrize("chunk_tokens", [8, 24, 65_536])
def test_a_language_models_evaluation_is_the_same_whatever_its_chunks(chunk_tokens, one_thread):
    problem = tasks.TASKS["text"].build(text_config().task_args)
    x, y = problem.test
    whole = tasks.scoring.next_token_eval(x, y, chunk_tokens=x.numel())(problem.model)
    parts = tasks.scoring.next_token_eval(x, y, chunk_tokens=chunk_tokens)(problem.model)
    assert parts == pytest.approx(whole, rel=1e-6)
