import pytest
import torch
from torch import nn

from bigbatch.optim import param_groups


class WithPositions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos_embed = nn.Parameter(torch.zeros(4, 8))
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)

    def no_weight_decay(self):
        return {"pos_embed"}


def names(model, group):
    by_id = {id(p): n for n, p in model.named_parameters()}
    return sorted(by_id[id(p)] for p in group["params"])


def test_biases_norms_and_named_params_get_no_decay():
    model = WithPositions()
    decay, exempt = param_groups(model, weight_decay=0.05)
    assert decay["weight_decay"] == 0.05 and exempt["weight_decay"] == 0.0
    assert names(model, decay) == ["proj.weight"]
    assert names(model, exempt) == ["norm.bias", "norm.weight", "pos_embed", "proj.bias"]


def test_no_decay_patterns_and_empty_groups():
    model = nn.Sequential(nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False))
    groups = param_groups(model, 0.1, no_decay=["1.*"])
    assert [names(model, g) for g in groups] == [["0.weight"], ["1.weight"]]
    only_decay = param_groups(model, 0.1)
    assert len(only_decay) == 1 and only_decay[0]["weight_decay"] == 0.1


def test_bad_weight_decay_is_named():
    with pytest.raises(ValueError, match=r"weight_decay.*-1"):
        param_groups(nn.Linear(2, 2), weight_decay=-1)


def test_a_compiled_or_ddp_wrapped_model_keeps_its_own_names_and_no_weight_decay():
    """torch.compile's `_orig_mod.` and DDP's `module.` prefixes, and the wrapper hiding
    `no_weight_decay()`: pos_embed was decayed, silently."""
    model = WithPositions()
    expected = [names(model, g) for g in param_groups(model, 0.05, no_decay=["proj.weight"])]

    class Wrapper(nn.DataParallel):  # DDP's layout (`.module`) without a process group
        pass

    for wrapped in (torch.compile(model), Wrapper(model), torch.compile(Wrapper(model))):
        groups = param_groups(wrapped, 0.05, no_decay=["proj.weight"])
        assert [names(model, g) for g in groups] == expected
    # a pattern of the names the wrapper lists (as before) matches too
    groups = param_groups(torch.compile(model), 0.05, no_decay=["_orig_mod.proj.weight"])
    assert [names(model, g) for g in groups] == expected


def test_biases_and_normalisation_parameters_of_any_shape_get_no_decay():
    """the docs say biases and norms; `ndim <= 1` alone decayed LayerNorm([3, 4])'s and a
    (3, 4) bias (and gave them LAMB's and LARS's trust ratio)."""

    class Shaped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.ln = nn.LayerNorm([3, 4])
            self.bias = nn.Parameter(torch.zeros(3, 4))

    model = Shaped()
    decay, exempt = param_groups(model, 0.01)
    assert names(model, decay) == ["fc.weight"]
    assert names(model, exempt) == ["bias", "fc.bias", "ln.bias", "ln.weight"]


def test_no_decay_that_is_not_patterns_is_named():
    with pytest.raises(ValueError, match="no_decay takes name patterns, got None"):
        param_groups(nn.Linear(2, 2), 0.1, no_decay=None)
