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
