"""Tests marked ``cuda`` need a GPU: they are skipped, with the reason, where there is none."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none here)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
