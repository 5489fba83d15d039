import pytest

from bigbatch.optim import _blocks

from .common import EAGER_IMPLS, IMPLS


def _impl(request, monkeypatch) -> str:
    if request.param == "foreach-blocked":
        monkeypatch.setattr(_blocks, "CPU_BLOCK_ELEMENTS", 37)
        return "foreach"
    return request.param


@pytest.fixture(
    params=[pytest.param(i, marks=pytest.mark.compile) if i == "compiled" else i for i in IMPLS]
)
def impl(request, monkeypatch) -> str:
    """Every impl (the compiled one marked ``compile``); "foreach-blocked" is foreach with
    blocks so small that every tensor splits."""
    return _impl(request, monkeypatch)


@pytest.fixture(params=EAGER_IMPLS)
def eager_impl(request, monkeypatch) -> str:
    """The eager impls, for the edge cases (the compiled impl traces the same code)."""
    return _impl(request, monkeypatch)
