"""Each task's ``build(args) -> Problem``: its data, its model at the run's size and seed
(:class:`~.problem.TaskArgs`), its loss and evaluation."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from ...knobs import setting
from . import data as datasets
from .models import Conv1dNet, TinyTransformer, mlp
from .problem import Problem, TaskArgs
from .scoring import classification_eval, classification_loss, next_token_eval, next_token_loss


def classification_problem(
    x: Tensor, y: Tensor, xt: Tensor, yt: Tensor, model: nn.Module
) -> Problem:
    """A classification task's problem: train on ``(x, y)``, score on ``(xt, yt)`` and, for
    the generalization gap, on the training set too."""
    return Problem(
        TensorDataset(x, y),
        (xt, yt),
        model,
        classification_loss,
        classification_eval(xt, yt),
        evaluate_train=classification_eval(x, y),
    )


def build_mnist1d(args: TaskArgs) -> Problem:
    data = datasets.mnist1d_arrays()
    x, y = torch.tensor(data["x"], dtype=torch.float32), torch.tensor(data["y"], dtype=torch.long)
    rows = datasets.training_rows(args.train_samples, len(x))
    xt = torch.tensor(data["x_test"], dtype=torch.float32)
    yt = torch.tensor(data["y_test"], dtype=torch.long)
    torch.manual_seed(args.seed)
    model = Conv1dNet(args.width, args.depth)
    return classification_problem(x[:rows], y[:rows], xt, yt, model)


def build_teacher(args: TaskArgs, n_train: int = 50_000, n_test: int = 10_000) -> Problem:
    """Labels from a fixed random MLP (the teacher) of the student's own shape: 1.0 is
    reachable in principle, not at the default budget (docs/cli.md, "Tasks", says why)."""
    width, depth, dims, classes = args.width, args.depth, 32, 10
    gen = torch.Generator().manual_seed(1234)  # the teacher and the data are fixed
    torch.manual_seed(1234)
    teacher = mlp(dims, width, depth, classes)
    for p in teacher.parameters():
        p.data.normal_(0, 1 / math.sqrt(max(1, p.shape[-1])), generator=gen)
    x = torch.randn(n_train + n_test, dims, generator=gen)
    with torch.no_grad():
        y = teacher(x).argmax(1)
    torch.manual_seed(args.seed)
    model = mlp(dims, width, depth, classes)
    xt, yt = x[n_train:], y[n_train:]
    rows = datasets.training_rows(args.train_samples, n_train)
    return classification_problem(x[:rows], y[:rows], xt, yt, model)


def build_digits(args: TaskArgs) -> Problem:
    digits = datasets.digits_arrays()
    x = torch.tensor(digits["x"] / 16.0, dtype=torch.float32)
    y = torch.tensor(digits["y"], dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    split = 1437
    torch.manual_seed(args.seed)
    model = mlp(64, args.width, args.depth, 10)
    xt, yt = x[split:], y[split:]
    rows = datasets.training_rows(args.train_samples, split)
    return classification_problem(x[:rows], y[:rows], xt, yt, model)


def build_lm(args: TaskArgs, sequences: int = 20_000, test: int = 1_000) -> Problem:
    context = args.context
    transition, floor = datasets.markov_language()
    gen = torch.Generator().manual_seed(11)
    total = sequences + test
    tokens = torch.empty(total, context + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, len(transition), (total,), generator=gen)
    for t in range(context):
        tokens[:, t + 1] = torch.multinomial(
            transition[tokens[:, t]].float(), 1, generator=gen
        ).squeeze(1)
    x, y = tokens[:, :-1], tokens[:, 1:]
    torch.manual_seed(args.seed)
    model = TinyTransformer(len(transition), context, args.width, args.depth)

    rows = datasets.training_rows(args.train_samples, sequences)
    return Problem(
        TensorDataset(x[:rows], y[:rows]),
        (x[sequences:], y[sequences:]),
        model,
        next_token_loss,
        next_token_eval(x[sequences:], y[sequences:]),
        info={"loss_floor": floor},
    )


@dataclass(frozen=True)
class TextOptions:
    """The ``text`` task's own keys."""

    corpus: str = setting(
        "torch",
        "the text task's corpus: the *.py files of this installed package, or of this folder "
        "given as a path (./src, /data/code)",
        key="text.corpus",
    )


def build_text(args: TaskArgs, validation_windows: int = 1_000) -> Problem:
    """A byte-level GPT (:class:`TinyTransformer`, 256 tokens) on Python source text: the
    ``*.py`` files of the package (or folder) ``text.corpus``, torch's by default.

    Training samples are windows of ``model.context + 1`` bytes; the input is
    the first ``context`` bytes, the target each next byte. The validation set
    is ``validation_windows`` windows spread evenly over the held-out files.
    """
    context = args.context
    corpus = args.options.corpus
    root = datasets.corpus_root(corpus)
    train, validation, info = datasets.text_corpus(root)
    # a package by its name, a folder by its absolute path
    info = {"corpus": str(root) if datasets.names_a_folder(corpus) else corpus, **info}
    windows = datasets.byte_windows(train, context + 1)
    held = datasets.byte_windows(validation, context + 1, validation_windows)
    torch.manual_seed(args.seed)
    model = TinyTransformer(256, context, args.width, args.depth)
    rows = datasets.training_rows(args.train_samples, len(windows))
    x, y = held[:, :-1], held[:, 1:]
    return Problem(
        TensorDataset(windows[:rows]),
        (x, y),
        model,
        next_token_loss,
        next_token_eval(x, y),
        info=info,
    )
