"""Each optimizer's recipe: what create_optimizer and the config fill in when a user names only
the optimizer."""

import pytest
from torch import nn

from bigbatch.batch.lr import SCHEDULES
from bigbatch.optim import OPTIMIZERS, RECIPES, VRGD, create_optimizer, get_optimizer_info


def model():
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))


def test_every_registered_optimizer_has_a_recipe_the_schedules_know():
    assert set(RECIPES) == set(OPTIMIZERS)
    for name, recipe in RECIPES.items():
        assert recipe.schedule in SCHEDULES and 0 <= recipe.warmup < 1, name
        assert recipe.evidence, name


def test_create_optimizer_takes_the_recipes_weight_decay_and_settings():
    lars = create_optimizer(model(), "lars", lr=4.0)
    recipe = RECIPES["lars"]
    decayed, exempt = lars.param_groups
    assert decayed["weight_decay"] == recipe.weight_decay and exempt["weight_decay"] == 0.0
    assert decayed["trust_coefficient"] == recipe.options["trust_coefficient"]
    assert create_optimizer(model(), "lamb", lr=1e-3).param_groups[0]["weight_decay"] == 0.01


def test_what_the_caller_passes_overrides_the_recipe():
    lars = create_optimizer(model(), "larc", lr=4.0, weight_decay=1e-4, trust_coefficient=0.02)
    group = lars.param_groups[0]
    assert (group["weight_decay"], group["trust_coefficient"]) == (1e-4, 0.02)
    assert group["trust_clip"]  # what makes it LARC stays


def test_a_vrgd_form_takes_its_recipes_gamma_and_its_base_the_weight_decay():
    vr = create_optimizer(model(), "vr-sgd", lr=1.0)
    assert isinstance(vr, VRGD) and vr.gamma == RECIPES["vr-sgd"].options["gamma"]
    assert vr.base.param_groups[0]["momentum"] == 0  # the paper's VR-SGD is plain SGD
    assert vr.base.param_groups[0]["weight_decay"] == RECIPES["vr-sgd"].weight_decay


def test_the_recipes_schedule_warms_up_then_decays_over_any_count():
    recipe = get_optimizer_info("lars").recipe
    schedule = recipe.schedule_over(1000)
    warm = int(recipe.warmup * 1000)
    assert schedule(0) == pytest.approx(1 / warm)
    assert schedule(warm) == pytest.approx(1.0)
    assert schedule(1000) == pytest.approx(0.0, abs=1e-12)
