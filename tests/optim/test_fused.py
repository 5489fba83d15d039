"""``impl="fused"``: the Triton kernels agree with the reference update.

On a GPU the kernels run compiled. Without one they run on CPU tensors under
Triton's interpreter, which executes the same kernel code in numpy (slowly:
the tensors here are small, but several span many chunks and tiles). Skipped
where Triton is not installed.
"""

import importlib

import pytest
import torch
from torch import nn

import bigbatch as bb

from .common import gpt_like_params

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# without a GPU, tests/conftest.py has set TRITON_INTERPRET=1 before Triton was imported
_fused = importlib.import_module("bigbatch.optim._fused")
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and not _fused.interpreted(),
    reason="no GPU, and Triton was imported before TRITON_INTERPRET=1 could be set",
)

#: a matrix of 6 chunks and 2 x 2 MERIT tiles, a 3-D tensor (MERIT: foreach), a
#: vector over two chunks, small matrices and vectors
SHAPES = [(40, 520), (64, 32), (32,), (3, 8, 5), (4500,), (40, 3), (1,)]


def make_params(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(s, generator=gen) for s in SHAPES]
    tensors[1][5].zero_()  # a zero row: MERIT's ratio is 1 there
    return [nn.Parameter(t.to(DEVICE, dtype)) for t in tensors]


def run(name, impl, steps=2, dtype=torch.float32, **options):
    params = make_params(dtype)
    groups = [
        {"params": params[:2] + params[3:4], "weight_decay": 0.01},
        {"params": params[2:3] + params[4:], "weight_decay": 0.0},
    ]
    lr = options.pop("lr", 1e-2)
    optimizer = bb.optim.create_optimizer(groups, name, lr=lr, impl=impl, **options)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:  # new gradient tensors every step, as zero_grad(set_to_none) leaves
            p.grad = torch.randn(p.shape, generator=gen).to(DEVICE, dtype)
        optimizer.step()
    return [p.detach().float().cpu() for p in params], optimizer


CASES = {
    "lamb": {},
    "lamb-no-clip": {"max_grad_norm": None},
    "lamb-decoupled": {"decoupled_weight_decay": True},
    "nvlamb-trust-clip": {"always_adapt": True, "trust_clip": True},
    "lamb-no-bias-correction": {"bias_correction": False},
    "lars": {},
    "larc-nesterov": {"trust_clip": True, "nesterov": True},
    "lars-no-momentum-always-adapt": {"momentum": 0.0, "always_adapt": True},
    "merit": {},
}


@pytest.mark.parametrize("case", CASES)
def test_fused_matches_the_reference(case):
    name = case.split("-")[0].replace("nvlamb", "lamb").replace("larc", "lars")
    expected, _ = run(name, "reference", **CASES[case])
    got, _ = run(name, "fused", **CASES[case])
    for a, b in zip(expected, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["lamb", "lars", "merit"])
def test_fused_takes_a_tensor_learning_rate(name):
    lr = torch.tensor(3e-3, device=DEVICE)
    expected, _ = run(name, "reference", lr=lr)
    got, _ = run(name, "fused", lr=lr)
    for a, b in zip(expected, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["lamb", "lars", "merit"])
def test_fused_reads_and_writes_bfloat16_parameters_with_float32_state(name):
    expected, _ = run(name, "reference", steps=2, dtype=torch.bfloat16)
    got, optimizer = run(name, "fused", steps=2, dtype=torch.bfloat16)
    # Triton's interpreter rounds float32 to bfloat16 by truncation (the GPU rounds
    # to nearest, as torch does): a bfloat16 ulp or two apart here
    for a, b in zip(expected, got):
        torch.testing.assert_close(b, a, rtol=2e-2, atol=1e-2)
    for state in optimizer.state.values():
        for value in state.values():
            if value.dim() > 0:
                assert value.dtype == torch.float32


def test_tensors_the_kernels_do_not_take_go_through_foreach():
    transposed = nn.Parameter(torch.randn(24, 16, device=DEVICE).t())  # not contiguous
    double = nn.Parameter(torch.randn(50, device=DEVICE, dtype=torch.float64))
    assert _fused.split_supported([[transposed, double]]) == ([], [0, 1])
    results = {}
    for impl in ("reference", "fused"):
        params = [nn.Parameter(transposed.detach().clone()), nn.Parameter(double.detach().clone())]
        optimizer = bb.optim.LAMB(params, lr=1e-2, impl=impl)
        for step in range(2):
            for p in params:
                p.grad = torch.full_like(p, 0.1 * (step + 1))
            optimizer.step()
        results[impl] = params
    for a, b in zip(results["reference"], results["fused"]):
        torch.testing.assert_close(b, a)


def test_merit_leaves_tensors_of_more_than_two_dimensions_to_foreach():
    conv = torch.zeros(4, 3, 3, 3)
    assert not _fused.merit_supports(conv)
    assert _fused.merit_supports(torch.zeros(5, 4)) and _fused.merit_supports(torch.zeros(5))


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["lamb", "lars", "merit"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_low_precision_matches_foreach_on_cuda(name, dtype):
    """Both compute in float32 and round into the parameter once per step (to nearest)."""
    results = {}
    for impl in ("foreach", "fused"):
        params = [nn.Parameter(p) for p in gpt_like_params(dtype=dtype)]
        opt = bb.optim.create_optimizer(params, name, lr=1e-3, impl=impl)
        gen = torch.Generator().manual_seed(1)
        for _ in range(20):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).to(DEVICE, dtype)
            opt.step()
        results[impl] = [p.detach().float().cpu() for p in params]
    for a, b in zip(results["foreach"], results["fused"]):
        torch.testing.assert_close(b, a, rtol=1e-2, atol=1e-3)
