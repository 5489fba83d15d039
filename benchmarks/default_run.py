"""The README's figures for the main job, from the command that produces them.

    python benchmarks/default_run.py            # run it, print the figures
    python benchmarks/default_run.py --write    # ... and record them (README and JSON)
    python benchmarks/default_run.py --check    # ... and exit 1 if the record differs

Runs the README's main job (`bigbatch train` on the default task) with one torch
thread, so that the optimizer steps, samples and accuracies are the same on
every run of one machine, torch build and CPU instruction set (more threads
sum in another order; another CPU may pick other kernels). The wall time is
the machine's and is quoted with it. ``--write`` records the figures in
``docs/default_run.json`` and in the README between its ``default-run``
markers; ``tests/test_readme.py`` checks that the two agree, so the README
never quotes figures this command did not print.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RECORD = ROOT / "docs" / "default_run.json"
BEGIN, END = "<!-- default-run:begin -->", "<!-- default-run:end -->"
COMMAND = ["train", "--quiet", "--set", "threads=1", "--set", "device=cpu"]


def run() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        began = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "bigbatch.cli", *COMMAND, "--out", str(out)],
            check=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        elapsed = time.perf_counter() - began
        summary = json.loads((out / "summary.json").read_text())
    return {
        "command": "bigbatch " + " ".join(COMMAND),
        "steps": summary["steps"],
        "samples": summary["samples"],
        "best_accuracy": round(summary["best_accuracy"], 4),
        "final_accuracy": round(summary["final_accuracy"], 4),
        "steps_to_target": summary["steps_to_target"],
        "training_seconds": round(summary["wall_seconds"]),
        "command_seconds": round(elapsed),
        "torch": torch.__version__,
        "machine": ", ".join(
            part
            for part in (platform.machine(), f"{os.cpu_count()} cores", platform.processor())
            if part
        ),
    }


def quote(figures: dict) -> str:
    """The README's sentence for ``figures``."""
    return (
        f"On {figures['machine']} (`{figures['command']}`, torch {figures['torch']}): "
        f"{figures['steps']:,} optimizer steps, {figures['samples']:,} samples, best test "
        f"accuracy {figures['best_accuracy']:.4f} (final {figures['final_accuracy']:.4f}), "
        f"the task's target 0.97 at step {figures['steps_to_target']:,}; "
        f"{figures['training_seconds']} s of training, {figures['command_seconds']} s for "
        "the whole command. The steps and accuracies repeat exactly on one machine and "
        "torch build; the times are this machine's (`python benchmarks/default_run.py`)."
    )


def quoted_block(text: str) -> str:
    match = re.search(re.escape(BEGIN) + r"\n(.*?)\n" + re.escape(END), text, re.S)
    if match is None:
        raise SystemExit(f"README.md has no {BEGIN} ... {END} block")
    return match.group(1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="record the figures")
    mode.add_argument(
        "--check", action="store_true", help="exit 1 if docs/default_run.json's figures differ"
    )
    args = parser.parse_args()
    figures = run()
    print(json.dumps(figures, indent=2))
    print(quote(figures))
    text = README.read_text()
    if args.write:
        RECORD.write_text(json.dumps(figures, indent=2) + "\n")
        README.write_text(text.replace(quoted_block(text), quote(figures)))
    if args.check:
        recorded = json.loads(RECORD.read_text())
        keys = ("steps", "samples", "best_accuracy", "final_accuracy", "steps_to_target")
        different = {k: (recorded[k], figures[k]) for k in keys if recorded[k] != figures[k]}
        if different:
            print(f"the README quotes other figures (quoted, measured): {different}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
