"""A small model with every kind of parameter the optimizers treat differently, and a loop."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

#: what the ``impl`` fixture runs ("foreach-blocked": foreach with every tensor split)
IMPLS = ("reference", "foreach", "foreach-blocked", "compiled")
#: what the ``eager_impl`` fixture runs: the edge cases are the functional code's, which the
#: compiled impl traces as it is (its agreement is tested once per optimizer)
EAGER_IMPLS = IMPLS[:-1]


def impl_cases(switches, compiled: tuple[str, ...]) -> list:
    """``(impl, switch)`` pairs: every switch under the eager impls, ``compiled`` only compiled
    (marked ``compile``).

    The compiled impl is the reference function through torch.compile, which
    compiles once per switch (5–10 s each on two cores): the reference cases
    check every switch, and the compiled ones check the compilation on the
    defaults and on every switch at once.
    """
    eager = [(i, s) for i in EAGER_IMPLS for s in switches]
    return eager + [pytest.param("compiled", s, marks=pytest.mark.compile) for s in compiled]


class TinyNet(nn.Module):
    """Embedding, linear (weight and bias), LayerNorm and a 1-D convolution."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(40, 12)
        self.conv = nn.Conv1d(12, 12, 3, padding=1)
        self.norm = nn.LayerNorm(12)
        self.head = nn.Linear(12, 5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens).transpose(1, 2)
        h = torch.relu(self.conv(h)).transpose(1, 2)
        return self.head(self.norm(h)).mean(1)


def gpt_like_params(seed=0, dtype=torch.float32, device="cuda"):
    """Tensors shaped like a small GPT's parameters (matrices, vectors, a 3-D tensor)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(64, 32), (32,), (128, 32), (32, 128), (32,), (3, 8, 5)]
    return [torch.randn(s, generator=gen).to(device, dtype) for s in shapes]


def make_model(seed: int = 0) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet()


def split_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay for matrices, none for biases and norms (what bigbatch.optim.param_groups does)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    exempt = [p for p in model.parameters() if p.ndim < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": exempt, "weight_decay": 0.0},
    ]


def batches(steps: int, seed: int = 1, size: int = 32):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        yield (
            torch.randint(0, 40, (size, 6), generator=g),
            torch.randint(0, 5, (size,), generator=g),
        )


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: int = 50,
    loss_scale: float = 1.0,
    before_step: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """Run ``steps`` steps; return all parameters flattened into one vector."""
    for i, (x, y) in enumerate(batches(steps)):
        loss = nn.functional.cross_entropy(model(x), y) * loss_scale
        optimizer.zero_grad()
        loss.backward()
        if before_step is not None:
            before_step(i)
        optimizer.step()
    return flat(model)


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()
