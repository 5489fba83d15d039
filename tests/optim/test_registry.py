import re
import warnings

import pytest
import torch
from torch import nn

from bigbatch.optim import (
    LAMB,
    LARS,
    MERIT,
    OPTIMIZERS,
    FewSubBatchesWarning,
    StatisticsWrapper,
    create_optimizer,
    list_optimizers,
)
from bigbatch.optim.registry import class_family
from bigbatch.stats import MicroBatchStatistics


def test_every_name_builds_an_optimizer_that_steps():
    for name in list_optimizers():
        model = nn.Linear(4, 2)
        optimizer = create_optimizer(model, name, lr=0.01)
        stats = MicroBatchStatistics(optimizer.param_groups, gsnr=True)
        sizes = [3, 3, 3, 3]
        stats.begin(sizes)
        for i in range(4):
            stats.before_backward(i)
            (model(torch.randn(3, 4)).square().sum() / 4).backward()
        if isinstance(optimizer, StatisticsWrapper):  # VRGD reads the step's GSNR
            optimizer.observe(stats.finish())
        before = model.weight.detach().clone()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FewSubBatchesWarning)
            optimizer.step()
        assert not torch.equal(model.weight, before), name


def test_registry_lists_papers_and_includes_the_torch_anchors():
    assert {"lamb", "lars", "merit", "sgd", "adamw"} <= set(list_optimizers())
    assert all(info.paper and info.summary for info in OPTIMIZERS.values())


def test_model_gets_weight_decay_groups_and_registry_settings():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    optimizer = create_optimizer(model, "LAMBC", lr=2e-3, weight_decay=0.02, impl="reference")
    assert isinstance(optimizer, LAMB) and optimizer.impl == "reference"
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.02, 0.0]
    assert all(g["trust_clip"] for g in optimizer.param_groups)
    sgd = create_optimizer(model.parameters(), "sgd", lr=0.1)
    assert sgd.param_groups[0]["momentum"] == 0.9


def test_kinds():
    model = nn.Linear(2, 2)
    assert isinstance(create_optimizer(model, "larc", lr=1.0), LARS)
    assert isinstance(create_optimizer(model, "merit"), MERIT)


@pytest.mark.parametrize(
    "name, kwargs, message",
    [
        ("lamd", {}, "unknown optimizer 'lamd'; did you mean 'lamb'"),
        ("lamb", {"learning_rate": 0.1}, "takes no argument 'learning_rate'"),
        ("lamb", {"trust_clipping": True}, "did you mean 'trust_clip'"),
        ("lars", {}, "needs a learning rate"),
        ("lamb", {"lr": -1}, "lr must be"),
    ],
)
def test_bad_requests_raise_value_error(name, kwargs, message):
    with pytest.raises(ValueError, match=message):
        create_optimizer(nn.Linear(2, 2), name, **kwargs)


def test_no_decay_beside_parameters_and_a_groups_bad_value_are_refused():
    """no_decay splits a module: beside parameters it was dropped, every one decayed; a
    group's own value was taken unchecked where the same keyword is refused."""
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"no_decay=\['\*bias'\] splits a module's"):
        create_optimizer(model.parameters(), "lamb", no_decay=["*bias"])
    for name, group, message in [
        ("sgd", {"momentum": 1.5}, "momentum must be in [0, 1), got 1.5"),
        ("adamw", {"betas": (0.9, 1.0)}, "betas[1] must be in [0, 1), got 1.0"),
        ("lamb", {"lr": -1.0}, "lr must be"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            create_optimizer([{"params": list(model.parameters()), **group}], name)
    with pytest.raises(TypeError, match="should be an iterable of Tensors or dicts"):
        create_optimizer(torch.tensor(1.0), "sgd")  # torch's own words for a lone tensor
    groups = [{"params": list(model.parameters()), "lr": 0.1, "name": "all"}]  # torch's own keys
    assert create_optimizer(groups, "sgd").param_groups[0]["name"] == "all"


@pytest.mark.parametrize(
    "name, family",
    [("ASGD", "sgd"), ("NAdam", "adam"), ("RAdam", "adam"), ("RMSprop", "adam"),
     ("Adagrad", "adam"), ("Rprop", None)],
)  # fmt: skip
def test_torchs_optimizers_take_their_familys_rate_rule(name, family):
    """Averaged SGD took Adam's square-root rule, as an optimizer of no known family does."""
    assert class_family(getattr(torch.optim, name)) == family
