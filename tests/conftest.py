"""Tests marked ``cuda`` need a GPU: they are skipped, with the reason, where there is none.

The suite runs in two pytest-xdist workers (``python -m pytest -n 2``, the README's
command): each worker, and every process a test starts, trains on one CPU thread, so two
workers share two cores instead of four threads fighting over them. (Grouping the cluster
and fault tests in one worker each, xdist's ``--dist loadgroup``, made the suite no faster:
10 m 20 s against 10 m 16 s; with pytest 9.2, xdist 3.8 cannot group at all.)

The second tier, which CI runs with the first: ``faults``, ``compile`` and ``processes``
(a test that starts several processes: DDP ranks, torch's launcher, a pool; marked here by the
fixtures that start them, or by hand). The inner loop leaves it out:
``python -m pytest -n 2 -m "not faults and not compile and not processes"``.

Without a GPU, Triton (where installed) runs ``impl="fused"``'s kernels in its
interpreter on CPU tensors (tests/optim/test_fused.py). The variable must be
set before anything imports Triton, so it is set here, first.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # the processes tests start inherit it (torch reads it when it starts)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


#: fixtures that start clusters of processes (tests/parallel/conftest.py,
#: tests/integrations/test_deepspeed.py; each worker starts each once for its tests)
_PROCESS_FIXTURES = {"cluster", "cluster2", "cluster4", "ranks", "one_rank"}


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none here)")
    for item in items:
        if _PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.processes)
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)
