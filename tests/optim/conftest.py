import pytest

from bigbatch.optim import _blocks

from .common import IMPLS


@pytest.fixture(params=IMPLS)
def impl(request, monkeypatch) -> str:
    """Every impl; "foreach-blocked" is foreach with blocks so small that every tensor splits."""
    if request.param == "foreach-blocked":
        monkeypatch.setattr(_blocks, "CPU_BLOCK_ELEMENTS", 37)
        return "foreach"
    return request.param
