"""Run directories on disk: naming, atomic checkpoints, and reading a run back."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from .config import ConfigError, load_toml, resolve

CHECKPOINT = "checkpoint.pt"


def new_run_dir(root: str | Path = "runs", task: str = "run") -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path(root) / f"{stamp}-{task}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def check_new_run_dir(path: Path) -> None:
    if path.exists() and (path.is_file() or any(path.iterdir())):
        raise ConfigError(
            f"--out {str(path)!r} already exists and is not empty; "
            "runs are never overwritten (use --resume to continue one)"
        )


def previous(path: Path) -> Path:
    """Where the checkpoint before ``path``'s current one is kept."""
    return path.with_name(f"{path.stem}.prev{path.suffix}")


def save_atomically(obj: Any, path: Path, keep_previous: bool = False) -> None:
    """torch.save to a temporary file, flushed to disk, then renamed over ``path``.

    With ``keep_previous`` the file it replaces is kept as ``<name>.prev<suffix>``,
    so a checkpoint damaged later (a full disk, a bad copy) still has a good
    predecessor.
    """
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    if keep_previous and path.exists():
        # a link, then a rename: checkpoint.pt exists at every moment
        staged = path.with_name(f".{previous(path).name}.tmp")
        staged.unlink(missing_ok=True)
        try:
            os.link(path, staged)
        except OSError:  # a file system without hard links
            shutil.copy2(path, staged)
        os.replace(staged, previous(path))
    os.replace(tmp, path)


def load_checkpoint(path: Path) -> dict[str, Any]:
    kept = previous(path)
    hint = (
        f"; the previous checkpoint is kept at {str(kept)!r}: rename it to "
        f"{path.name!r} to resume from there"
        if kept.is_file()
        else ""
    )
    if not path.is_file():
        raise ConfigError(f"no checkpoint at {str(path)!r}: nothing to resume{hint}")
    try:
        return torch.load(path, weights_only=True)
    except Exception as err:  # a truncated or corrupted file
        raise ConfigError(
            f"checkpoint {str(path)!r} cannot be read ({type(err).__name__}: "
            f"{err}); it is truncated or corrupted{hint}"
        ) from None


def read_metrics(out: Path) -> list[dict[str, Any]]:
    path = Path(out) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_config(out: Path) -> dict[str, Any]:
    return resolve(load_toml(Path(out) / "config.toml"))
