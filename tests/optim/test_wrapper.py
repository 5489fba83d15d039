"""The statistics-wrapper base: shared param groups, the closure, skipped steps."""

import pytest
import torch
from torch import nn

import bigbatch as bb


def make():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, bb.optim.VRGD(base)


def test_param_groups_stay_shared_after_load_state_dict():
    _model, wrapper = make()
    wrapper.load_state_dict(wrapper.state_dict())  # torch builds new group dicts here
    wrapper.param_groups[0]["lr"] = 0.5  # what schedulers and LR rules do
    assert wrapper.base.param_groups[0]["lr"] == 0.5
    assert wrapper.param_groups is wrapper.base.param_groups


def test_a_step_without_gradients_does_nothing_and_needs_no_statistics():
    model, wrapper = make()
    before = [p.detach().clone() for p in model.parameters()]
    wrapper.step()  # a loop dropped a non-finite step's gradients
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


@pytest.mark.filterwarnings("ignore::bigbatch.optim.FewSubBatchesWarning")  # VRGD at 4: on purpose
def test_the_closure_runs_before_the_statistics_are_taken():
    """Lightning runs the last backward, and the plugin observes the statistics, inside the
    closure it hands to ``optimizer.step``."""
    model, wrapper = make()
    x, y = torch.randn(16, 4), torch.randn(16, 2)
    collector = bb.stats.MicroBatchStatistics(wrapper.param_groups, gsnr=True)
    before = [p.detach().clone() for p in model.parameters()]

    def closure():
        collector.begin([4, 4, 4, 4])
        for i in range(4):
            collector.before_backward(i)
            part = slice(4 * i, 4 * i + 4)
            (nn.functional.mse_loss(model(x[part]), y[part]) / 4).backward()
        wrapper.observe(collector.finish())
        return torch.zeros(())

    wrapper.step(closure)
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    with pytest.raises(RuntimeError, match="gradient statistics"):
        wrapper.step()  # gradients but nothing observed: a clear error


@pytest.mark.filterwarnings("ignore::bigbatch.optim.FewSubBatchesWarning")  # VRGD at 4: on purpose
@pytest.mark.parametrize("wrapper_of", [bb.optim.VRGD, bb.optim.AGVM])
def test_a_group_added_after_a_load_is_the_bases_once_and_steps(wrapper_of):
    """After load_state_dict the wrapper shares the base's list of groups: a group added
    went in twice (refused, half added); and what a wrapper keeps per parameter or module
    group (VRGD's parameters, AGVM's groups) did not follow it to the next step."""
    torch.manual_seed(0)
    body, head, extra = nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(4, 2)
    groups = [
        {"params": list(body.parameters()), "agvm_group": "body"},
        {"params": list(head.parameters()), "agvm_group": "head"},
    ]
    base = torch.optim.SGD(groups, lr=0.1)
    wrapper = wrapper_of(base, start=0, interval=1) if wrapper_of is bb.optim.AGVM else (
        wrapper_of(base)
    )  # fmt: skip
    wrapper.load_state_dict(wrapper.state_dict())
    wrapper.add_param_group({"params": list(extra.parameters()), "agvm_group": "extra"})
    assert wrapper.param_groups is base.param_groups and len(base.param_groups) == 3
    with pytest.raises(ValueError, match="more than one parameter group"):
        wrapper.add_param_group({"params": list(extra.parameters())})
    assert len(base.param_groups) == 3  # a rejected group is not added
    x, y = torch.randn(16, 4), torch.randn(16, 2)
    collector = bb.stats.MicroBatchStatistics(
        wrapper.param_groups, gsnr=wrapper_of is bb.optim.VRGD
    )
    collector.begin([4, 4, 4, 4])
    for i in range(4):
        collector.before_backward(i)
        h = body(x[4 * i : 4 * i + 4])
        (nn.functional.mse_loss(head(h) + extra(h), y[4 * i : 4 * i + 4]) / 4).backward()
    wrapper.observe(collector.finish())
    before = extra.weight.detach().clone()
    wrapper.step()
    assert not torch.equal(extra.weight.detach(), before)


def test_torchs_state_dict_hooks_run_on_the_wrapper():
    """The wrapper replaced torch's state_dict and load_state_dict without their hooks:
    registered, accepted, never called; a load pre-hook's returned dict is the one loaded."""
    _model, wrapper = make()
    called = []
    wrapper.register_state_dict_pre_hook(lambda o: called.append("pre"))
    wrapper.register_state_dict_post_hook(lambda o, s: {**s, "mark": 1})
    wrapper.register_load_state_dict_pre_hook(
        lambda o, s: called.append("load pre") or {**s, "base": saved["base"]}
    )
    wrapper.register_load_state_dict_post_hook(lambda o: called.append("load post"))
    saved = wrapper.state_dict()
    assert saved["mark"] == 1
    wrapper.param_groups[0]["lr"] = 0.7
    wrapper.load_state_dict({**saved, "base": None})  # the pre-hook's dict is loaded
    assert called == ["pre", "load pre", "load post"]
    assert wrapper.param_groups[0]["lr"] == 0.1
    assert wrapper.param_groups is wrapper.base.param_groups
