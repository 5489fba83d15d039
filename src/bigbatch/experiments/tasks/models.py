"""The built-in tasks' models: a 1-D CNN, an MLP and a small pre-norm GPT."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


class Conv1dNet(nn.Module):
    """Strided 1-D convolutions then a linear classifier (the MNIST-1D paper's CNN shape)."""

    def __init__(self, width: int = 32, depth: int = 3, length: int = 40, classes: int = 10):
        super().__init__()
        layers: list[nn.Module] = []
        channels = 1
        for _ in range(depth):
            layers += [nn.Conv1d(channels, width, 5, stride=2, padding=2), nn.ReLU()]
            channels = width
            length = (length + 1) // 2
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(width * length, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x.unsqueeze(1)).flatten(1))


def mlp(inputs: int, width: int, depth: int, outputs: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(inputs, width), nn.ReLU()]
        inputs = width
    return nn.Sequential(*layers, nn.Linear(inputs, outputs))


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        #: largest pre-softmax attention logit of the last forward pass
        self.max_logit = torch.zeros(())

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        logits = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        logits = logits.masked_fill(~mask, float("-inf"))
        self.max_logit = logits.detach().amax()
        out = logits.softmax(-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """A pre-norm GPT: token and learned position embeddings, ``depth`` blocks of causal
    attention (``heads`` heads) and a 4x MLP, a linear head over the vocabulary."""

    def __init__(self, vocab: int, context: int, width: int, depth: int, heads: int = 4) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"model.width = {width} is not a multiple of the {heads} heads")
        self.embed = nn.Embedding(vocab, width)
        # learned positions, zero at the start; an Embedding over the positions rather than a
        # bare parameter, so that per-example gradient norms cover it
        # (bigbatch.stats.per_example); ``_weight`` skips an initialisation that would draw
        # from the random stream and change every later layer's start
        self.pos = nn.Embedding(context, width, _weight=torch.zeros(context, width))
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: Tensor) -> Tensor:
        n, steps = tokens.shape
        positions = torch.arange(steps, device=tokens.device).expand(n, steps)
        h = self.embed(tokens) + self.pos(positions)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))
