"""Tests marked ``cuda`` need a GPU: they are skipped, with the reason, where there is none.

Without a GPU, Triton (where installed) runs ``impl="fused"``'s kernels in its
interpreter on CPU tensors (tests/optim/test_fused.py). The variable must be
set before anything imports Triton, so it is set here, first.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none here)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
