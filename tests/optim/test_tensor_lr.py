"""A tensor learning rate (as torch.optim accepts) gives the same steps as a float one."""

import pytest
import torch
from torch import nn

import bigbatch as bb

NAMES = ["lamb", "lambc", "nvlamb", "lars", "larc", "merit"]


def run(name, impl, lr, decoupled=False, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    params = [
        nn.Parameter(torch.randn(s, generator=gen, dtype=dtype)) for s in ((6, 5), (5,), (3, 2, 2))
    ]
    options = {"decoupled_weight_decay": True} if decoupled else {}
    groups = [
        {"params": params[:2], "weight_decay": 0.01},
        {"params": params[2:], "weight_decay": 0.0},
    ]
    opt = bb.optim.create_optimizer(groups, name, lr=lr, impl=impl, **options)
    for _ in range(5):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen, dtype=dtype)
        opt.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("impl", ["reference", "foreach"])
@pytest.mark.parametrize("name", NAMES)
def test_tensor_lr_equals_float_lr(name, impl):
    floats = run(name, impl, 0.01)
    tensors = run(name, impl, torch.tensor(0.01))
    for a, b in zip(floats, tensors):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["lamb", "lars", "merit"])
def test_a_float64_tensor_lr_steps_float64_parameters_as_its_float_does(name):
    # it was rounded to float32: 1.5e-9 to 6.4e-9 off a step
    floats = run(name, "foreach", 0.01, dtype=torch.float64)
    tensors = run(name, "foreach", torch.tensor(0.01, dtype=torch.float64), dtype=torch.float64)
    for a, b in zip(floats, tensors):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-15)


def test_decoupled_decay_with_a_tensor_lr():
    for a, b in zip(
        run("lamb", "foreach", 0.01, True), run("lamb", "foreach", torch.tensor(0.01), True)
    ):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.compile
@pytest.mark.parametrize("name", ["lamb", "lars", "merit"])
def test_tensor_lr_compiled(name):
    for a, b in zip(run(name, "reference", 0.01), run(name, "compiled", torch.tensor(0.01))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_bad_tensor_lr_is_named():
    params = [nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="0-dim"):
        bb.optim.LAMB(params, lr=torch.tensor([0.1, 0.2]))
    with pytest.raises(ValueError, match="lr"):
        bb.optim.LARS(params, lr=torch.tensor(-1.0))
