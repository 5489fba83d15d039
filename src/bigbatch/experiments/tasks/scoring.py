"""How a task's model is scored: training losses and held-out evaluations, one host read each."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn


class OnDevice:
    """Evaluation tensors, copied to the model's device once (CPU: no copy)."""

    def __init__(self, *tensors: Tensor) -> None:
        self._tensors = tensors
        self._copies: dict[torch.device, tuple[Tensor, ...]] = {}

    def on(self, model: nn.Module) -> tuple[Tensor, ...]:
        device = next(model.parameters()).device
        if device not in self._copies:
            self._copies[device] = tuple(t.to(device) for t in self._tensors)
        return self._copies[device]


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """The model in eval mode without gradients, then back in the mode it was in."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


#: examples (classification) and tokens (language models) evaluated at a time, by device:
#: on a CPU a chunk whose activations stay in the cache is faster (MNIST-1D's 10,000 test
#: samples, one thread: 28 ms in chunks of 1,024 against 59 ms in chunks of 4,096; `text`
#: 217 ms in 8,192 tokens against 262 ms in 65,536); a GPU wants few, large launches
EVAL_CHUNKS = {
    "cpu": {"examples": 1024, "tokens": 8192},
    "cuda": {"examples": 4096, "tokens": 65_536},
}


def _chunk(device: torch.device, unit: str) -> int:
    """The chunk in ``unit`` (examples or tokens) for ``device`` (not a CPU: a GPU's)."""
    return EVAL_CHUNKS.get(device.type, EVAL_CHUNKS["cuda"])[unit]


def classification_eval(x: Tensor, y: Tensor, chunk: int | None = None):
    """Held-out cross-entropy and accuracy over ``chunk`` examples at a time (None: the
    device's :data:`EVAL_CHUNKS`), with one host read."""
    data = OnDevice(x, y)

    def evaluate(model: nn.Module) -> dict[str, float]:
        xs, ys = data.on(model)
        size = chunk or _chunk(xs.device, "examples")
        loss = torch.zeros((), dtype=torch.float64, device=xs.device)
        correct = torch.zeros((), dtype=torch.int64, device=xs.device)
        with evaluating(model):
            for i in range(0, len(xs), size):
                out = model(xs[i : i + size]).float()
                loss += nn.functional.cross_entropy(out, ys[i : i + size], reduction="sum")
                correct += (out.argmax(-1) == ys[i : i + size]).sum()
        total, right = torch.stack([loss, correct.double()]).tolist()  # one read
        return {"eval_loss": total / len(xs), "eval_accuracy": right / len(xs)}

    return evaluate


def classification_loss(model: nn.Module, batch: Any) -> Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def next_token_loss(model: nn.Module, batch: Any) -> Tensor:
    """Mean cross-entropy per predicted token; a batch is ``(inputs, targets)`` or one
    tensor of windows whose targets are the inputs shifted by one (stored as bytes)."""
    if len(batch) == 1:
        (windows,) = batch
        batch = windows[:, :-1].long(), windows[:, 1:].long()
    xb, yb = batch
    return nn.functional.cross_entropy(model(xb).flatten(0, 1), yb.flatten())


def next_token_eval(x: Tensor, y: Tensor, chunk_tokens: int | None = None):
    """Held-out cross-entropy per token (nats), next-token accuracy and the largest
    attention logit, over about ``chunk_tokens`` tokens at a time (None: the device's
    :data:`EVAL_CHUNKS`; so a long context does not hold every sequence's attention at
    once) with one host read."""
    data = OnDevice(x, y)

    def evaluate(model: nn.Module) -> dict[str, float]:
        xs, ys = data.on(model)
        chunk = max(1, (chunk_tokens or _chunk(xs.device, "tokens")) // x.shape[1])
        loss = torch.zeros((), dtype=torch.float64, device=xs.device)
        correct = torch.zeros((), dtype=torch.float64, device=xs.device)
        logit = torch.full((), -math.inf, device=xs.device)
        with evaluating(model):
            for i in range(0, len(xs), chunk):
                xb, yb = xs[i : i + chunk].long(), ys[i : i + chunk].long()
                out = model(xb).float()
                loss += nn.functional.cross_entropy(
                    out.flatten(0, 1), yb.flatten(), reduction="sum"
                )
                correct += (out.argmax(-1) == yb).sum()
                heads = torch.stack([b.attn.max_logit for b in model.blocks])  # type: ignore
                logit = torch.maximum(logit, heads.amax().float())
        total, right, top = torch.stack([loss, correct, logit.double()]).tolist()
        return {
            "eval_loss": total / ys.numel(),
            "eval_accuracy": right / ys.numel(),
            "max_attention_logit": top,
        }

    return evaluate
