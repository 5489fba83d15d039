"""Training runs for the experiment benchmarks: one run per process, resumable by directory."""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import shutil
from pathlib import Path
from typing import Any


def train_once(args: tuple[dict[str, Any], str]) -> dict[str, Any]:
    """Train ``config`` into ``out`` unless a finished run is there; return its summary."""
    config, out = args
    from bigbatch.experiments.config import resolve
    from bigbatch.experiments.runner import train

    path = Path(out)
    if (path / "summary.json").is_file():
        return json.loads((path / "summary.json").read_text())
    if path.exists():  # a run killed midway: start it again
        shutil.rmtree(path)
    return train(resolve(config), path, quiet=True)


def run_all(jobs: list[tuple[dict[str, Any], str]], workers: int) -> list[dict[str, Any]]:
    """Every ``(config, out)`` job, ``workers`` at a time (fresh processes: one torch each)."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        return list(pool.map(train_once, jobs))
