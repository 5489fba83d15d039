"""The built-in tasks' data, made on this machine: MNIST-1D and the digits (cached), a
Markov language, an installed package's Python sources as bytes (torch's by default)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor


def cache_dir() -> Path:
    root = os.environ.get("BIGBATCH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "bigbatch"
    )
    return Path(root)


def training_rows(train_samples: int, available: int) -> int:
    """How many of a task's ``available`` training samples a run uses: the first
    ``train_samples`` (a smaller training set opens a generalization gap), or all (0)."""
    wanted = train_samples or available
    if wanted > available:
        raise ValueError(
            f"train_samples = {wanted} is more than the task's {available:,} training samples"
        )
    return wanted


def mnist1d_arrays(seed: int = 42, samples: int = 50_000) -> dict[str, np.ndarray]:
    """MNIST-1D with the package's default settings, built once and cached as .npz.

    The package keeps 80% of ``samples`` for training and 20% for the test set.
    """

    def make() -> dict[str, np.ndarray]:
        from mnist1d.data import get_dataset_args, make_dataset

        args = get_dataset_args()
        args.num_samples, args.seed = samples, seed
        data = make_dataset(args)
        return {k: np.asarray(data[k]) for k in ("x", "y", "x_test", "y_test")}

    return _cached(f"mnist1d-{samples}-seed{seed}", make)


def digits_arrays() -> dict[str, np.ndarray]:
    """scikit-learn's 8x8 digits (``x``: 1,797 images of 64 pixels in 0..16, ``y``: labels),
    cached as .npz: importing scikit-learn costs a run's process more than a second."""

    def make() -> dict[str, np.ndarray]:
        try:
            from sklearn.datasets import load_digits
        except ImportError:  # pragma: no cover - exercised only without the extra
            raise RuntimeError(
                "the digits task needs scikit-learn: pip install 'bigbatch[digits]'"
            ) from None
        digits = load_digits()
        return {"x": np.asarray(digits.data), "y": np.asarray(digits.target)}

    return _cached("digits", make)


def _cached(name: str, make: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The arrays saved as ``<cache>/<name>.npz``, made by ``make`` and saved the first time."""
    path = cache_dir() / f"{name}.npz"
    if path.is_file():
        with np.load(path) as data:
            return {k: data[k] for k in data.files}
    arrays = make()
    path.parent.mkdir(parents=True, exist_ok=True)
    # a temporary name of its own: the ranks of a torchrun job or the runs of a sweep
    # build the same cache at once on a fresh machine, and one shared name lost the race
    # (the first rename took the others' file away)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".npz")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp's 0600 would shut a shared cache's users out
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)  # the same arrays whoever renames last
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return arrays


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def markov_language(vocab: int = 32, alpha: float = 0.2, seed: int = 7) -> tuple[Tensor, float]:
    """A random order-1 Markov chain and its entropy rate in nats (the loss floor)."""
    rows = np.random.default_rng(seed).dirichlet(np.full(vocab, alpha), size=vocab)
    transition = torch.tensor(rows, dtype=torch.float64).clamp(min=1e-12)
    transition /= transition.sum(1, keepdim=True)
    stationary = torch.full((vocab,), 1.0 / vocab, dtype=torch.float64)
    for _ in range(1000):
        stationary = stationary @ transition
    entropy = -(transition * transition.log()).sum(1)
    return transition, float((stationary * entropy).sum())


#: one file in ten is held out for validation, chosen by its path's hash (stable as files come
#: and go between torch releases)
HELD_OUT_SHARE = 10


def held_out(path: str) -> bool:
    return int(hashlib.sha1(path.encode()).hexdigest(), 16) % HELD_OUT_SHARE == 0


def names_a_folder(corpus: str) -> bool:
    """Whether a ``text.corpus`` value is a path (absolute, ``.``/``~``, or with a
    separator) rather than a package name."""
    return os.sep in corpus or "/" in corpus or corpus.startswith((".", "~"))


def corpus_root(corpus: str) -> Path:
    """The folder whose ``*.py`` files are the ``text`` task's corpus.

    ``corpus`` is an installed package's (dotted) name, found without being imported
    (a dotted name imports its parents), or a folder given as a path: absolute, or
    starting with ``.`` or ``~``, or holding a separator, so that a folder in the working
    directory never shadows the package of the same name.
    """
    if not corpus:
        raise ValueError("text.corpus is empty: give a package name such as 'torch' or a folder")
    if names_a_folder(corpus):
        folder = Path(corpus).expanduser().resolve()
        if not folder.is_dir():
            raise ValueError(f"text.corpus = {corpus!r} is not a folder")
        return folder
    try:
        spec = importlib.util.find_spec(corpus)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise ValueError(
            f"text.corpus = {corpus!r} is not an installed package (give a package name such "
            "as 'torch' or 'sympy', or a folder as a path, e.g. './src')"
        )
    folders = list(spec.submodule_search_locations or [])
    if len(folders) != 1:
        what = "a single-file module" if not folders else f"spread over {len(folders)} folders"
        raise ValueError(
            f"text.corpus = {corpus!r} is {what}, not one package folder: name a package "
            "or give a folder as a path"
        )
    return Path(folders[0])


def text_corpus(root: Path) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """The bytes of every ``*.py`` file under ``root`` (:func:`corpus_root` finds it from
    ``text.corpus``, whose default names torch), in sorted path order, as
    ``(train, validation, info)``.

    Files whose path hashes to the held-out share go to validation, so no file
    is split between the two. Each file ends with a newline. ``info`` holds the
    SHA-256 of the corpus (paths and contents), its size and the file counts:
    a run's summary names the exact text it trained on.
    """
    root = Path(root)
    digest = hashlib.sha256()
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    files = (p for p in root.rglob("*.py") if p.is_file())  # not a folder `x.py`, a dead link
    for path in sorted(files, key=lambda p: p.relative_to(root).as_posix()):
        name = path.relative_to(root).as_posix()
        content = path.read_bytes()
        digest.update(name.encode() + b"\0" + content + b"\0")
        parts[held_out(name)].append(content if content.endswith(b"\n") else content + b"\n")
    if not parts[False] or not parts[True]:
        raise ValueError(f"no text to train and validate on: {str(root)!r} has too few .py files")
    train, validation = (np.frombuffer(b"".join(parts[h]), dtype=np.uint8) for h in (False, True))
    info = {
        "corpus_sha256": digest.hexdigest(),
        "corpus_bytes": int(train.size + validation.size),
        "train_files": len(parts[False]),
        "validation_files": len(parts[True]),
    }
    return train, validation, info


def byte_windows(stream: np.ndarray, length: int, count: int | None = None) -> Tensor:
    """Windows of ``length`` bytes from ``stream`` as a uint8 ``(n, length)`` tensor: every
    ``length - 1`` bytes apart (each byte is predicted once), or ``count`` evenly spaced."""
    last = stream.size - length
    if last < 0:
        raise ValueError(f"{stream.size} bytes hold no window of {length}")
    if count is None:
        starts = np.arange(0, last + 1, length - 1)
    else:
        starts = np.linspace(0, last, num=min(count, last + 1)).astype(np.int64)
    # rows of a strided view: one copy of the windows, no index array of their size
    return torch.from_numpy(np.lib.stride_tricks.sliding_window_view(stream, length)[starts])
