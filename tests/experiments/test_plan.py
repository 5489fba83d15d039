"""The plan: every automatic value filled in one place (the task's, the recipe's, the
controller's, the statistics' and the rate's), read as typed sections, planned once."""

import warnings

import pytest

from bigbatch.experiments.config import ConfigError, _toml, flatten, resolve, to_toml
from bigbatch.experiments.plan import RunPlan, make_controller, plan_run


@pytest.mark.parametrize(
    "name",
    ["batch_warmup", "seesaw", "simigrad", "critical_ramp", "damped_simigrad", "noise_scale"],
)
def test_a_config_left_at_its_defaults_builds_the_librarys_default_controller(name):
    """One default per knob: the command line's controller is the class's own default."""
    from bigbatch.batch.controllers import CONTROLLERS

    config = plan_run({"batch.controller": name})
    assert repr(make_controller(config)) == repr(CONTROLLERS[name]())


def test_a_shared_key_whose_owners_differ_takes_the_chosen_controllers_own_default():
    warmup = plan_run({"batch.controller": "batch_warmup"})
    ramp = plan_run({"batch.controller": "critical_ramp"})
    assert (warmup["batch.noise_multiple"], ramp["batch.noise_multiple"]) == (0.125, 6.0)
    assert (warmup["batch.initial"], ramp["batch.initial"]) == (8, 64)
    # bounds that exclude the controller's own first batch move it, as only they were asked
    assert plan_run({"batch.min": 32})["batch.initial"] == 32
    # a controller with no default of its own (a constant batch) takes the default's
    constant = plan_run({"batch.controller": "constant"})
    assert constant["batch.initial"] == constant["batch.base"] == 8
    assert constant["batch.min"] == 8  # a key it does not take: held to the default's
    assert constant.origins["batch.noise_multiple"] == (
        "the batch_warmup controller's default (constant does not read it)"
    )
    assert warmup.origins["batch.noise_multiple"] == "the batch_warmup controller's default"
    chosen = plan_run({"batch.controller": "critical_ramp", "batch.noise_multiple": 3})
    assert make_controller(chosen).multiple == 3.0


def test_a_bound_left_at_its_default_moves_to_what_was_set_past_it():
    """Only what was set was asked for: a constant batch of 4 or 20,000, a ``batch.max`` of
    4, needs no other bound set (each was an error naming a bound nobody set)."""

    def bounds(**layer):
        run = plan_run(dict(layer.items()))
        return [run[k] for k in ("batch.min", "batch.initial", "batch.max")], run.origins

    assert bounds(**{"batch.controller": "constant", "batch.initial": 4})[0] == [4, 4, 16384]
    big, why = bounds(**{"batch.controller": "constant", "batch.initial": 20_000})
    assert big == [8, 20_000, 20_000]
    assert why["batch.max"] == "batch.initial (20,000), set past its default 16,384"
    low, why = bounds(**{"batch.max": 4})  # batch_warmup's own first batch is 8
    assert low == [4, 4, 4]
    assert why["batch.initial"] == (
        "the batch_warmup controller's default 8, moved into [batch.min, batch.max]"
    )
    assert bounds(**{"batch.min": 32_768})[0] == [32_768, 32_768, 32_768]
    # a bound that was set stays, and its conflict is an error
    with pytest.raises(ConfigError, match=r"batch\.initial \(8\) is outside .* = \[4, 4\]"):
        plan_run({"batch.initial": 8, "batch.max": 4})


def test_a_budget_below_the_first_batch_is_refused():
    """The loop takes whole batches: ``max_samples = 1`` trained one step of 16 unsaid."""
    with pytest.raises(ConfigError, match=r"max_samples \(1\) is below the first batch "):
        plan_run({"max_samples": 1})
    assert plan_run({"max_samples": 16})["max_samples"] == 16


def test_a_ramp_in_the_users_units_from_config_keys():
    def ramp(**keys):
        layer = {"batch.controller": "ramp", "model.context": 0, **keys}
        return plan_run(layer)

    # the table gives the first batch; its shares are of max_samples
    table = ramp(**{"batch.ramp_points": "0:32, 25%:64", "max_samples": 4000})
    controller = make_controller(table)
    assert table["batch.initial"] == table["batch.base"] == 32
    assert [controller.next({}, 0, s) for s in (999, 1000)] == [32, 64]
    # the linear ramp's length in tokens needs a sequence task: its context
    text = plan_run(
        resolve({"task": "text", "batch.controller": "ramp", "batch.ramp_over": "1M tokens"})
    )
    assert make_controller(text).tokens_per_sample == text["model.context"] > 0
    with pytest.raises(ConfigError, match="'1M tokens' counts tokens, but the mnist1d task"):
        ramp(**{"batch.ramp_over": "1M tokens"})
    with pytest.raises(ConfigError, match=r"batch\.initial = 16 but batch\.ramp_points starts"):
        ramp(**{"batch.ramp_points": "0:32, 25%:64", "batch.initial": 16})
    with pytest.raises(ConfigError, match=r"batch\.ramp_points = '0:32, 25%': a ramp point"):
        resolve({"batch.ramp_points": "0:32, 25%"})


@pytest.mark.parametrize("name", ["sgd", "lars", "lamb", "vr-sgd"])
def test_keys_left_at_auto_take_the_optimizers_recipe(name):
    from bigbatch.optim import RECIPES

    config = plan_run({"optimizer": name})
    recipe = RECIPES[name]
    assert config["weight_decay"] == recipe.weight_decay
    assert config["schedule.kind"] == recipe.schedule
    assert config["schedule.warmup"] == recipe.warmup
    assert config["vrgd.gamma"] == recipe.options.get("gamma", "auto")
    # the saved config reads back as the same run
    saved = flatten(_toml().loads(to_toml(config)))
    assert plan_run(saved) == config


def test_a_key_set_by_the_user_wins_over_the_recipe():
    config = plan_run({"optimizer": "lars", "weight_decay": 0.0, "schedule.kind": "poly"})
    assert (config["weight_decay"], config["schedule.kind"]) == (0.0, "poly")


@pytest.mark.parametrize(
    "layer, fewest",
    [
        # the loop's own rule: 4 shared by the processes (a rank of 2: 2; before, 4 a rank)
        ({"noise_from": "sub_batches"}, 0),
        ({"noise_from": "examples", "batch.controller": "constant"}, 1),
        # SimiGrad's rule reads the measured cosine: the examples keep a split for it
        ({"noise_from": "examples", "batch.controller": "simigrad"}, 2),
        ({"noise_from": "examples", "batch.similarity": "split"}, 2),
        ({}, 0),  # auto, the default: the loop decides on the model
    ],
)
def test_min_sub_batches_left_at_0_is_what_the_statistics_need(layer, fewest):
    plan = plan_run(layer)
    assert plan["min_sub_batches"] == fewest
    if layer.get("noise_from") == "sub_batches":
        assert "4 micro-batches shared by the processes" in plan.origins["min_sub_batches"]


@pytest.mark.parametrize(
    ("task", "length", "share"),
    [
        ("mnist1d", 0.05, 0.05),
        ("mnist1d", "5%", 0.05),
        ("mnist1d", "60k samples", 0.05),
        ("mnist1d", 60000, 60000 / 1_200_000),  # a number above 1 is refused below; as text
        ("text", "1M tokens", 1_000_000 / 32 / 150_000),
    ],
)
def test_the_warm_up_is_a_share_or_a_length_in_samples_or_tokens(task, length, share):
    if not isinstance(length, str) and length > 1:
        with pytest.raises(ConfigError, match=r"schedule.warmup must be in \[0, 1\]"):
            resolve({"task": task, "schedule.warmup": length})
        length = str(length)
    config = plan_run({"task": task, "schedule.warmup": length})
    assert config["schedule.warmup"] == pytest.approx(share)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"schedule.warmup": "500 steps"}, "schedule.warmup = '500 steps': the schedule is laid"),
        ({"schedule.warmup": "1M tokens"}, "schedule.warmup = '1M tokens': .*tokens_per_sample"),
        ({"schedule.cooldown": "2M"}, "schedule.cooldown = '2M' is longer than max_samples"),
    ],
)
def test_a_schedule_length_the_run_cannot_lay_out_is_one_error_naming_the_key(settings, message):
    with pytest.raises(ConfigError, match=message):
        plan_run({"task": "mnist1d", **settings})


def test_a_plan_is_read_only_planned_once_and_saved_as_a_plan(tmp_path):
    from bigbatch.experiments.rundir import read_config

    run = plan_run({"task": "digits"})
    assert plan_run(run) is run
    assert run["lr"] > 0 and "the digits task's" in run.origins["lr"]
    with pytest.raises(TypeError):
        run["lr"] = 1.0  # type: ignore[index]
    (tmp_path / "config.toml").write_text(to_toml(run))
    saved = read_config(tmp_path)
    assert isinstance(saved, RunPlan) and saved == run and plan_run(saved) is saved


def test_a_plans_typed_sections_read_its_keys():
    from dataclasses import fields

    from bigbatch.experiments.config import RUN_SECTIONS

    run = plan_run({"task": "text", "optimizer": "adamw", "text.corpus": "sympy"})
    sections = {type(getattr(run, name)): getattr(run, name) for name in vars(run)}
    for cls in RUN_SECTIONS:
        for f in fields(cls):
            assert getattr(sections[cls], f.name) == run[f.metadata["key"]], f.metadata["key"]
    assert run.optimizer.name == "adamw" and run.task.name == "text"
    args = run.task_args
    assert (args.width, args.depth, args.context) == (run.model.width, run.model.depth, 32)
    assert args.options.corpus == "sympy" and plan_run({"task": "lm"}).task_args.options is None
    assert run.facts == {"budget": run.run.max_samples, "tokens_per_sample": 32}


def test_a_replaced_key_says_where_it_came_from_and_leaves_the_plan_as_it_was():
    run = plan_run({"task": "digits"})
    smaller = run.replace("batch.max", 1437, "the training set")
    assert smaller["batch.max"] == 1437 and smaller.origins["batch.max"] == "the training set"
    assert run["batch.max"] == 16384 and "batch.max" not in run.origins
    assert smaller.task_args == run.task_args


def test_a_batch_larger_than_the_training_set_is_lowered_to_it_with_its_origin():
    from bigbatch.experiments.build import build

    problem, loop, _ = build(plan_run({"task": "digits", "model.width": 8}))
    assert loop.engine.controller.max == 1437
    assert problem.info["batch_max_lowered_from"] == 16384


def test_the_loop_takes_the_plans_ceiling_warm_up_and_a_batch_of_the_whole_training_set():
    # the ceiling as a factor of the rate, the warm-up as a share of the budget, and a batch
    # of exactly the training set's 1,437 samples neither refused nor lowered
    from bigbatch.experiments.build import build

    config = {"task": "digits", "model.width": 8, "lr": 0.01, "lr_max": 0.04}
    plan = plan_run({**config, "schedule.warmup": 0.1, "max_samples": 10_000})
    _, loop, _ = build(plan)
    assert loop.engine.options.max_lr_factor == pytest.approx(4.0)
    assert loop.engine.schedule(500) == pytest.approx(0.5, abs=0.01)  # half the 1,000 warm-up
    whole = {"batch.controller": "constant", "batch.initial": 1437, "batch.max": 1437}
    problem, loop, _ = build(plan_run({**config, **whole}))
    assert loop.engine.controller.max == 1437 and "batch_max_lowered_from" not in problem.info


@pytest.mark.parametrize(
    ("name", "impl", "built"),
    [("adamw", "fused", {"fused": True}), ("adamw", "foreach", {}), ("sgd", "foreach", {}),
     ("lamb", "foreach", {"impl": "foreach"})],
)  # fmt: skip
def test_torchs_optimizers_are_built_fused_only_when_asked(name, impl, built):
    from bigbatch.experiments.build import implementation

    assert implementation(name, impl) == built


def test_a_budget_of_one_batch_and_a_warm_up_of_the_whole_run_are_planned():
    one = {"batch.controller": "constant", "batch.initial": 64, "max_samples": 64}
    assert plan_run(one)["max_samples"] == 64
    with pytest.raises(ConfigError, match=r"max_samples \(63\) is below the first batch"):
        plan_run({**one, "max_samples": 63})
    assert plan_run({"schedule.warmup": "100%"})["schedule.warmup"] == 1.0


def test_fsdp_on_one_process_trains_the_whole_model_and_says_so():
    from bigbatch.experiments.build import build

    plan = plan_run({"task": "digits", "model.width": 8, "dist.strategy": "fsdp"})
    with pytest.warns(UserWarning, match=r"dist.strategy = 'fsdp' shards .* --nproc 2 or more"):
        _, loop, _ = build(plan)
    assert not loop.world.sharded


def test_the_tasks_rate_says_when_the_budget_is_longer_than_the_one_it_was_measured_at():
    longer = plan_run({"task": "text", "max_samples": 600_000}).origins["lr"]
    assert "measured at the task's budget of 150,000 samples; at 4x it" in longer
    assert "budget" not in plan_run({"task": "text", "max_samples": 75_000}).origins["lr"]
    assert "lr" not in plan_run({"task": "text", "lr": 0.004, "max_samples": 600_000}).origins


@pytest.mark.parametrize("rule", ["adascale", "adascale-sqrt"])
@pytest.mark.parametrize(("optimizer", "static"), [("sgd", "linear"), ("lamb", "sqrt")])
def test_under_adascale_the_tasks_rate_reaches_the_first_batch_by_the_static_rule(
    rule, optimizer, static
):
    """AdaScale's gain is 1 without statistics: carrying the task's rate at 64 to batch 8
    by it gave batch 8 the rate of 64 (8x the linear rule's for SGD)."""
    config = {"task": "teacher", "optimizer": optimizer}
    plain = plan_run({**config, "batch.lr_scaling": static})
    ada = plan_run({**config, "batch.lr_scaling": rule})
    assert ada["batch.base"] == 8 and ada["lr"] == pytest.approx(plain["lr"])
    assert f"({static} of 8/64)" in ada.origins["lr"]


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_an_asynchronous_run_builds_its_optimizer_fused_and_says_so(optimizer):
    """The plan, not the builder, chooses the fused step (it skips a non-finite step on the
    device): ``--explain`` and the saved config show what trains."""
    plan = plan_run({"optimizer": optimizer, "asynchronous": True})
    assert plan["optimizer_impl"] == "fused"
    assert "asynchronous" in plan.origins["optimizer_impl"]
    with pytest.raises(ConfigError, match="lamb cannot"):
        plan_run({"optimizer": "lamb", "asynchronous": True})


def test_a_key_the_run_does_not_read_is_warned_of_and_a_saved_configs_are_not():
    """A key set that the run does not read (batch.shrink under a constant batch, a VRGD key
    under LAMB, a compression key its method does not read) is warned of; a saved config,
    which holds every key as the plan filled it, is not."""
    constant = {"task": "digits", "batch.controller": "constant", "batch.shrink": True}
    message = r"batch.shrink = True is set, but the constant controller does not read it \("
    with pytest.warns(UserWarning, match=message):
        plan_run(constant)
    with pytest.warns(UserWarning, match="vrgd.normalizer = 'median' is set, but lamb does not"):
        plan_run({"task": "digits", "vrgd.normalizer": "median"})
    # a compression key the method does not read: EControl's η under EF, Top-K's ratio under
    # PowerSGD (which reads the warm-up) or without compression
    with pytest.warns(UserWarning, match="dist.eta = 0.3 is set, but dist.compression = 'ef'"):
        plan_run({"task": "digits", "dist.compression": "ef", "dist.eta": 0.3})
    for compression in ("none", "powersgd"):
        with pytest.warns(UserWarning, match=r"dist.ratio = 0.5 is set, .* \(ef, ef21, "):
            plan_run({"task": "digits", "dist.compression": compression, "dist.ratio": 0.5})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan_run({"task": "digits", "dist.compression": "powersgd", "dist.warmup": 3})
        plan_run({"task": "digits", "dist.compression": "econtrol", "dist.eta": 0.3})
    for kind in ("ramp", "constant", "seesaw"):  # every key as config.toml keeps it
        saved = dict(plan_run({"task": "digits", "batch.controller": kind}).items())
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            plan_run(saved)


def test_a_saved_powersgd_plan_with_a_warm_up_of_one_builds_torchs_least():
    """dist.warmup = 1 is refused when planned; a plan saved before that (it trained 2,
    torch's least) still builds, as torch's PowerSGD takes it."""
    import types

    from bigbatch.experiments.build import _comm_hook
    from bigbatch.experiments.plan import RunPlan

    saved = RunPlan(resolve({"dist.compression": "powersgd", "dist.warmup": 1}))
    state, _ = _comm_hook(saved, None, types.SimpleNamespace(group=None))
    assert state.start_powerSGD_iter == 2
