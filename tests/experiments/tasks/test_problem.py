"""A task's record: its learning rate per optimizer family and whether a run reached its target."""

from unittest import mock

import pytest

from bigbatch.batch.lr import FAMILY_RULES, lr_factor
from bigbatch.experiments.tasks import TASKS, Task
from bigbatch.optim import FAMILIES, get_optimizer_info, list_optimizers


def make_task(**fields):
    defaults = {
        "name": "toy",
        "summary": "",
        "size": "",
        "expected": "",
        "target": 0.9,
        "lrs": {"adam": 1e-3, "adam/held": 4e-3, "sgd": 0.1, "sgd/held": 0.4},
        "max_samples": 1000,
        "width": 8,
        "depth": 1,
        "build": lambda config: None,
    }
    return Task(**{**defaults, **fields})


def test_a_family_without_a_measured_rate_is_refused_not_given_another_familys():
    task = make_task()
    assert (task.lr("sgd", held=False), task.lr("sgd", held=True)) == (0.1, 0.4)
    # an Adam-type rate would be 60 times too small for LARS on text
    with pytest.raises(KeyError, match="no measured rate for optimizer 'lars' \\(no 'lars' or"):
        task.lr("lars", held=False)
    with pytest.raises(KeyError, match="no 'vr-lars/held' or 'lars/held' in its rates"):
        task.lr("vr-lars", held=True)


def test_an_optimizer_measured_by_name_takes_its_own_rate_before_its_familys():
    task = make_task(lrs={"adam": 1e-3, "sgd": 0.1, "vr-sgd": 1.0, "vr-sgd/held": 4.0})
    assert task.lr("vr-sgd", held=False) == 1.0
    assert task.lr("vr-sgd", held=True) == 4.0
    assert task.lr("vr-momentum", held=False) == 0.1  # the family's


@pytest.mark.parametrize("name", sorted(TASKS))
@pytest.mark.parametrize("optimizer", list_optimizers())
@pytest.mark.parametrize("held", [False, True])
def test_every_built_in_task_has_a_rate_for_every_registered_optimizer(name, optimizer, held):
    assert TASKS[name].lr(optimizer, held) > 0


def test_a_run_without_a_rate_for_its_optimizer_is_one_config_error():
    from bigbatch.experiments.config import ConfigError, defaults
    from bigbatch.experiments.plan import plan_run

    task = make_task(name="text", lrs={"adam": 1e-3, "adam/held": 1e-3})
    config = {**defaults(), "task": "text", "optimizer": "lars"}
    refusal = "text task has no measured rate for optimizer 'lars'.*give one with --set lr="
    with mock.patch.dict(TASKS, {"text": task}):
        with pytest.raises(ConfigError, match=refusal):
            plan_run(config)
        # a rate given by the user needs none from the task
        assert plan_run({**config, "lr": 0.5})["lr"] == 0.5


@pytest.mark.parametrize("name", sorted(TASKS))
def test_a_tasks_rates_are_keyed_by_known_names_each_with_its_held_partner(name):
    keys = set(TASKS[name].lrs)
    known = set(list_optimizers()) | set(FAMILIES)
    for key in keys:
        assert key.removesuffix("/held") in known, key  # a misspelt name would be ignored
    for key in keys - {k for k in keys if k.endswith("/held")}:
        # else a held run would take the family's held rate, measured for another optimizer
        assert key + "/held" in keys, key


def test_a_tasks_measured_batch_rule_carries_its_rate_where_the_user_names_none():
    from bigbatch.experiments.config import defaults
    from bigbatch.experiments.plan import plan_run

    task = make_task(name="text", lr_rules={"sgd": "sqrt", "vr-momentum": "none"})
    assert (task.lr_rule("sgd"), task.lr_rule("plain-sgd"), task.lr_rule("lamb")) == (
        "sqrt",
        "sqrt",  # the family's measured rule
        None,  # the family's general rule holds
    )
    assert task.lr_rule("vr-momentum") == "none"  # its own before its family's

    def resolved(**overrides):
        config = {**defaults(), "task": "text", "optimizer": "sgd", **overrides}
        with mock.patch.dict(TASKS, {"text": task}):
            done = plan_run(config)
        return done["batch.lr_scaling"], done["lr"]

    constant = {"batch.controller": "constant"}
    # 0.1 is the rate at the task's batch 64: sqrt carries it to 0.2 at 256, 0.05 at 16
    assert resolved(**constant, **{"batch.initial": 256}) == ("sqrt", pytest.approx(0.2))
    assert resolved(**constant, **{"batch.initial": 16}) == ("sqrt", pytest.approx(0.05))
    # the user's rule is kept (linear: 0.4 at 256), and a held rule takes the held rate
    assert resolved(**constant, **{"batch.initial": 256, "batch.lr_scaling": "linear"}) == (
        "linear",
        pytest.approx(0.4),
    )
    assert resolved(**constant, **{"batch.initial": 256}, optimizer="vr-momentum") == (
        "none",
        0.4,
    )
    # a controller that follows the noise holds the rate whatever was measured
    assert resolved(**{"batch.controller": "noise_scale"}) == ("none", 0.4)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_a_tasks_batch_rules_are_keyed_by_known_names(name):
    known = set(list_optimizers()) | set(FAMILIES)
    for key in TASKS[name].lr_rules:
        assert key in known, key  # a misspelt name would be ignored


@pytest.mark.parametrize("ceiling", [0.0, -1.0, float("inf"), "0.5"])
def test_a_task_refuses_a_ceiling_that_is_not_a_positive_rate(ceiling):
    with pytest.raises(ValueError, match=r"lr_max\['sgd'\] = .*; a ceiling is a positive rate"):
        make_task(lr_max={"sgd": ceiling})


def test_a_task_refuses_a_rule_it_cannot_have_measured():
    with pytest.raises(ValueError, match="lr_rules\\['sgd'\\] = 'adascale'"):
        make_task(lr_rules={"sgd": "adascale"})


#: every (task, optimizer) whose task records a batch rule for it
MEASURED_RULES = [
    (name, optimizer)
    for name, task in sorted(TASKS.items())
    for optimizer in list_optimizers()
    if task.lr_rule(optimizer) is not None
]


@pytest.mark.parametrize("name, optimizer", MEASURED_RULES)
def test_a_scaled_rate_carried_to_batch_256_is_the_held_rate_where_the_task_records_a_rule(
    name, optimizer
):
    """The scaled and held rates are one measurement (constant 256's best), the scaled one
    given at the task's batch: carried by the task's rule where it scales, and where the
    task holds the rate by the family's (what a user who names ``linear`` starts from).
    Where the task records a ceiling, constant 256 runs at it for most of the budget and
    the held rate, never above it, is the one measured for the held-rate controllers."""
    task = TASKS[name]
    rule = task.lr_rule(optimizer)
    if rule == "none":
        rule = FAMILY_RULES[get_optimizer_info(optimizer).family]
    carried = task.lr(optimizer, held=False) * lr_factor(rule, 256, task.base_batch)
    ceiling = task.lr_ceiling(optimizer)
    if ceiling is None:
        assert carried == pytest.approx(task.lr(optimizer, held=True))
    else:
        assert task.lr(optimizer, held=True) <= ceiling < carried


def test_a_ceiling_is_the_optimizers_own_else_its_familys_and_only_for_the_tasks_rate():
    from bigbatch.experiments.config import defaults
    from bigbatch.experiments.plan import plan_run

    task = make_task(name="text", lr_max={"sgd": 0.3, "plain-sgd": 0.2})
    assert (task.lr_ceiling("plain-sgd"), task.lr_ceiling("sgd"), task.lr_ceiling("lamb")) == (
        0.2,
        0.3,
        None,
    )

    def resolved(**overrides):
        config = {**defaults(), "task": "text", "optimizer": "sgd", **overrides}
        with mock.patch.dict(TASKS, {"text": task}):
            return plan_run(config)["lr_max"]

    assert resolved() == 0.3 and resolved(optimizer="lamb") == 0.0
    assert resolved(lr=0.5) == 0.0  # the ceiling was measured with the task's rates
    assert resolved(lr_max=0.7) == resolved(lr=0.5, lr_max=0.7) == 0.7  # the user's stands


@pytest.mark.parametrize("name", sorted(TASKS))
def test_a_tasks_ceilings_are_keyed_by_known_names(name):
    known = set(list_optimizers()) | set(FAMILIES)
    for key in TASKS[name].lr_max:
        assert key in known, key


# text's default rates at the batches its two settings train at: the default controller
# starts at 16, constant 256; each within 0.02 nats of the best of its x2 grid there
# (docs/results.md "Recipes"). Plain SGD, VR-SGD and VR-Adam take their scaled rate at
# 256 only up to their ceiling (TEXT_CEILINGS)
TEXT_RATES = {
    "lamb": ("sqrt", 0.008, 0.032),
    "merit": ("sqrt", 0.008, 0.032),
    "nvlamb": ("sqrt", 0.008, 0.032),
    "vr-lamb": ("sqrt", 0.008, 0.032),
    "vr-adam": ("sqrt", 0.008, 0.032),
    "lambc": ("sqrt", 0.016, 0.064),
    "adamw": ("sqrt", 0.00565685, 0.0226274),
    "sgd": ("sqrt", 0.158, 0.632),
    "vr-lars": ("sqrt", 1.0, 4.0),
    "lars": ("none", 4.0, 4.0),
    "vr-momentum": ("none", 0.158, 0.158),
    "plain-sgd": ("sqrt", 0.632, 2.528),
    "vr-sgd": ("sqrt", 0.632, 2.528),
    "larc": ("none", 0.5, 0.5),
}


def test_text_pins_the_rates_of_every_registered_optimizer():
    assert sorted(TEXT_RATES) == sorted(list_optimizers())


def _default_and_constant_256(task, optimizer):
    """``task``'s resolved config for ``optimizer`` under the default controller from batch
    16 and at constant batch 256, everything else at its default."""
    from bigbatch.experiments.config import defaults
    from bigbatch.experiments.plan import plan_run

    config = {**defaults(), "task": task, "optimizer": optimizer, "batch.initial": 16}
    constant = {**config, "batch.controller": "constant", "batch.initial": 256}
    return plan_run(config), plan_run(constant)


@pytest.mark.parametrize("optimizer", sorted(TEXT_RATES))
def test_text_runs_each_form_at_its_measured_rate_at_16_and_256(optimizer):
    rule, at_16, at_256 = TEXT_RATES[optimizer]
    default, constant = _default_and_constant_256("text", optimizer)
    assert (default["batch.controller"], default["batch.initial"]) == ("batch_warmup", 16)
    assert (default["batch.lr_scaling"], default["lr"]) == (rule, pytest.approx(at_16))
    assert (constant["batch.lr_scaling"], constant["lr"]) == (rule, pytest.approx(at_256))


#: the rate ceilings text records (lr_max): the largest rate a step of the form takes
TEXT_CEILINGS = {"plain-sgd": 0.632, "vr-sgd": 0.632, "vr-adam": 0.016}


@pytest.mark.parametrize("optimizer", sorted(TEXT_RATES))
def test_text_caps_the_rate_of_the_forms_whose_rule_passes_the_largest_stable_one(optimizer):
    default, constant = _default_and_constant_256("text", optimizer)
    assert default["lr_max"] == constant["lr_max"] == TEXT_CEILINGS.get(optimizer, 0.0)


def _rates_at_16_and_256(task, optimizer):
    return tuple(c["lr"] for c in _default_and_constant_256(task, optimizer))


def test_digits_runs_merit_at_its_own_rate_and_the_rest_of_the_family_at_the_familys():
    def rates(optimizer):
        return _rates_at_16_and_256("digits", optimizer)

    # measured: MERIT 4x the family's (docs/results.md "Recipes", digits)
    assert rates("merit") == (pytest.approx(0.008), pytest.approx(0.032))
    assert rates("lamb") == rates("adamw") == (pytest.approx(0.002), pytest.approx(0.008))


def test_teacher_runs_larc_and_vr_sgd_at_their_measured_rates():
    def rates(optimizer):
        return _rates_at_16_and_256("teacher", optimizer)

    # measured (docs/results.md "Recipes", teacher): each one's default-controller best at
    # batch 16, carried linearly to 256; plain SGD's own 0.25 at batch 64 (both grids' best)
    assert rates("larc") == (pytest.approx(0.395), pytest.approx(6.32))
    assert rates("vr-sgd") == (pytest.approx(0.125), pytest.approx(2.0))
    assert rates("plain-sgd") == (pytest.approx(0.0625), pytest.approx(1.0))


@pytest.mark.parametrize(
    "metric, target, row, reached",
    [
        ("eval_accuracy", 0.9, {"eval_accuracy": 0.9}, True),
        ("eval_accuracy", 0.9, {"eval_accuracy": 0.89}, False),
        ("eval_loss", 2.0, {"eval_loss": 1.9}, True),
        ("eval_loss", 2.0, {"eval_loss": 2.1}, False),
        ("eval_loss", 2.0, {"eval_accuracy": 1.0}, False),  # the metric was not evaluated
    ],
)
def test_an_accuracy_is_reached_from_below_a_loss_from_above(metric, target, row, reached):
    task = make_task(target_metric=metric, target=target)
    assert task.lower_is_better == (metric == "eval_loss")
    assert task.reached(row) is reached


def test_a_rate_off_the_tasks_own_takes_the_tasks_ceiling_along_in_proportion():
    """A grid point or trial at m× the task's rate is the recipe at m× its scale, so ×1 is
    exactly the run ``bigbatch train`` makes; a rate or ceiling the user set stays theirs."""
    from bigbatch.experiments.plan import at_rate, plan_run

    layer = {"task": "text", "optimizer": "plain-sgd", "batch.controller": "constant"}
    layer["batch.initial"] = 256
    own = plan_run(layer)
    assert (own["lr"], own["lr_max"]) == (pytest.approx(2.528), 0.632)
    for m in (0.5, 1.0, 2.0):
        point = plan_run(at_rate(layer, own["lr"] * m))
        assert point["lr_max"] == 0.632 * m  # exactly: ×1 is the recipe, bit for bit
    assert plan_run(at_rate({**layer, "lr": 1.0}, 2.0))["lr_max"] == 0.0
    assert plan_run(at_rate({**layer, "lr_max": 0.5}, 2.0))["lr_max"] == 0.5
    assert "lr_max" not in at_rate({**layer, "optimizer": "lamb"}, 0.1)  # no ceiling to move


def test_a_rate_measured_at_another_batch_is_met_there_and_interpolated_between():
    from bigbatch.experiments.config import defaults
    from bigbatch.experiments.plan import plan_run

    lrs = {"adam": 0.016, "adam/held": 0.016, "adamw": 0.01, "adamw/held": 0.01}
    task = make_task(name="text", lrs=lrs, lrs_at={8: {"lamb": 0.008}, 16: {"adam": 0.008}})
    assert task.measured_rates("lamb") == {8: 0.008, 16: 0.008, 64: 0.016}
    assert task.measured_rates("merit") == {16: 0.008, 64: 0.016}  # the family's key only
    assert task.measured_rates("adamw") == {64: 0.01}  # measured by name at 64: its own only

    def rate(optimizer, batch):
        config = {**defaults(), "task": "text", "optimizer": optimizer, "batch.initial": batch}
        with mock.patch.dict(TASKS, {"text": task}):
            return plan_run(config)["lr"], plan_run(config).origins["lr"]

    assert rate("lamb", 8) == (0.008, "the text task's lamb rate 0.008 at batch 8")
    assert rate("lamb", 32)[0] == pytest.approx(0.008 * 2**0.5)  # 0.008 at 16, 0.016 at 64
    assert "between 0.008 at batch 16 and 0.016 at 64 (x B^0.5)" in rate("lamb", 32)[1]
    assert rate("lamb", 4)[0] == pytest.approx(0.008 * 0.5**0.5)  # sqrt from the nearest
    assert rate("lamb", 256)[0] == pytest.approx(0.032)
    assert rate("merit", 8)[0] == pytest.approx(0.008 * 0.5**0.5)
    assert rate("adamw", 8)[0] == pytest.approx(0.01 * (8 / 64) ** 0.5)


@pytest.mark.parametrize(
    "lrs_at",
    [
        {64: {"adam": 0.01}},
        {8: {"adam": -1.0}},
        {0: {"adam": 1.0}},
        {True: {"adam": 1.0}},
        {8: {"adam": True}},
    ],
)
def test_a_task_refuses_a_measured_rate_that_is_not_a_positive_rate_at_another_batch(lrs_at):
    with pytest.raises(ValueError, match="lrs_at"):
        make_task(lrs_at=lrs_at)


def test_a_rate_measured_at_another_batch_may_be_a_whole_number():
    assert make_task(lrs_at={128: {"sgd": 1}}).measured_rates("sgd") == {64: 0.1, 128: 1}


@pytest.mark.parametrize("name", sorted(TASKS))
def test_a_tasks_rates_at_other_batches_are_keyed_by_known_names(name):
    known = set(list_optimizers()) | set(FAMILIES)
    for table in TASKS[name].lrs_at.values():
        assert set(table) <= known


@pytest.mark.parametrize(
    "batch, rate", [(4, 0.004), (8, 0.008), (16, 0.008), (32, 0.008 * 2**0.5), (256, 0.032)]
)
def test_text_starts_lamb_at_its_rate_measured_at_small_batches(batch, rate):
    from bigbatch.experiments.plan import plan_run

    config = {"task": "text", "batch.controller": "constant", "batch.initial": batch}
    assert plan_run(config)["lr"] == pytest.approx(rate)
