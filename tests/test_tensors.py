"""The norm helpers the optimizers and statistics share: one fused call per accumulation
dtype, in the tensors' own order."""

import pytest
import torch

from bigbatch._tensors import norms, sq_norms
from bigbatch.testing import count_ops

LARGE = 1 << 16


def mixed_tensors():
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randn(3, 5, generator=gen),
        torch.randn(LARGE + 7, generator=gen),
        torch.randn(4, 6, generator=gen, dtype=torch.float64),
        torch.randn(6, 4, generator=gen).to(torch.bfloat16).t(),  # not contiguous
        torch.randn(LARGE, generator=gen, dtype=torch.float64),
        torch.zeros(2),
    ]


def test_norms_and_squared_norms_equal_the_per_tensor_values_in_order():
    tensors = mixed_tensors()
    expected = [t.double().norm() for t in tensors]
    got = norms(tensors)
    assert [n.dtype for n in got] == [
        torch.float32,
        torch.float32,
        torch.float64,
        torch.float32,  # bfloat16 squares accumulate in float32
        torch.float64,
        torch.float32,
    ]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g.double(), e, rtol=1e-5, atol=0)
    squared = sq_norms(tensors)
    assert squared.dtype == torch.float64 and squared.shape == (len(tensors),)
    torch.testing.assert_close(squared, torch.stack(expected) ** 2, rtol=1e-5, atol=0)


def test_tensors_of_one_dtype_take_one_fused_call():
    tensors = [t for t in mixed_tensors() if t.dtype == torch.float32]
    expected = torch.stack([t.double().norm() for t in tensors]) ** 2
    torch.testing.assert_close(sq_norms(tensors), expected, rtol=1e-5, atol=0)
    assert count_ops(lambda: norms(tensors)) == {"_foreach_norm": 1}


def test_no_tensors_have_no_norms():
    assert norms([]) == [] and sq_norms([]).shape == (0,)


@pytest.mark.cuda
def test_on_a_gpu_every_tensor_takes_the_fused_call_in_order():
    tensors = [t.cuda() for t in mixed_tensors()]  # float32 and float64 interleaved
    expected = torch.stack([t.double().norm() for t in tensors]).cpu()
    torch.testing.assert_close(torch.stack([n.double() for n in norms(tensors)]).cpu(), expected)
    torch.testing.assert_close(sq_norms(tensors).cpu(), expected**2, rtol=1e-5, atol=0)
