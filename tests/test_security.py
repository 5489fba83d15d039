"""Nothing in bigbatch unpickles arbitrary objects or evaluates a config."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for d in ("src", "benchmarks", "examples") for p in (ROOT / d).rglob("*.py")]


def test_every_torch_load_is_weights_only():
    calls = []
    for path in SOURCES:
        text = path.read_text()
        for match in re.finditer(r"torch\.load\(", text):
            depth, end = 1, match.end()
            while depth:  # to the call's own closing parenthesis
                depth += {"(": 1, ")": -1}.get(text[end], 0)
                end += 1
            call = text[match.start() : end]
            calls.append((path.name, call))
            assert "weights_only=True" in call, f"{path}: {call}"
    assert calls  # the checkpoints are read somewhere


def test_no_eval_exec_or_pickle_loads():
    for path in SOURCES:
        text = path.read_text()
        # builtins only: module.eval() switches a model to evaluation mode
        for pattern in (
            r"(?<![\w.])eval\(",
            r"(?<![\w.])exec\(",
            r"pickle\.loads?\(",
            r"yaml\.load\(",
        ):
            assert not re.search(pattern, text), f"{path} uses {pattern}"
