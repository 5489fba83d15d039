"""timm's LAMB and LARS, the references the tests compare against.

timm's package root imports torchvision, which does not import beside a CPU
torch wheel, so the ``timm/optim`` modules are loaded as a package of their
own without running ``timm/__init__.py``. timm is a dev dependency only.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import types
from pathlib import Path

import pytest

_PACKAGE = "_timm_optim_for_tests"


def load(module: str):
    """Import ``timm.optim.<module>`` without importing ``timm``; skip if timm is absent."""
    spec = importlib.util.find_spec("timm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("timm is not installed (pip install --no-deps timm)")
    if _PACKAGE not in sys.modules:
        package = types.ModuleType(_PACKAGE)
        package.__path__ = [str(Path(next(iter(spec.submodule_search_locations))) / "optim")]
        sys.modules[_PACKAGE] = package
    return importlib.import_module(f"{_PACKAGE}.{module}")


def for_loop(optimizer_class, *args, **options):
    """A timm optimizer running its per-tensor loop (``foreach=False`` where the version has it)."""
    if "foreach" in inspect.signature(optimizer_class).parameters:
        options["foreach"] = False
    return optimizer_class(*args, **options)
