"""The federated server's decisions: pooled statistics, schemes, round plans."""

import math

import pytest

from bigbatch.batch import BatchWarmup, Contract
from bigbatch.batch.lr import warmup_cosine
from bigbatch.federated import (
    ClientReport,
    ControllerScheme,
    Fixed,
    RoundPlanner,
    SmallLargeSwitch,
    pool_steps,
)


def report(samples, sq, trace, batch=16, similarity=None):
    steps = len(sq)
    return ClientReport(
        samples=samples,
        batches=[batch] * steps,
        grad_sq_norm=sq,
        trace=trace,
        similarity=similarity or [0.5] * steps,
    )


def test_pool_weighs_clients_by_samples_and_sums_their_batches():
    pooled = pool_steps(
        [report(100, [1.0, 2.0], [10.0, 20.0]), report(300, [3.0, 4.0], [30.0, 0.0])]
    )
    assert len(pooled) == 2
    assert pooled[0]["grad_sq_norm"] == pytest.approx((100 * 1 + 300 * 3) / 400)
    assert pooled[1]["trace"] == pytest.approx((100 * 20 + 300 * 0) / 400)
    assert pooled[0]["batch"] == 32


def test_pool_skips_a_clients_missing_value_and_stops_at_the_shortest_report():
    pooled = pool_steps(
        [report(100, [math.nan, 1.0, 5.0], [1, 1, 1]), report(100, [2.0, 3.0], [1, 1])]
    )
    assert len(pooled) == 2
    assert pooled[0]["grad_sq_norm"] == 2.0  # the NaN is left out, not averaged in
    assert pool_steps([]) == []
    alone = pool_steps([report(100, [math.nan], [math.inf])])  # no client measured it
    assert math.isnan(alone[0]["grad_sq_norm"]) and math.isnan(alone[0]["trace"])


def test_switch_is_large_until_its_fraction_of_the_samples_then_small():
    scheme = SmallLargeSwitch(large=128, small=16, switch=0.5)
    assert scheme.initial == 128
    assert scheme.next_local_batch([], 128, 4, samples=499, total=1000) == 128
    assert scheme.next_local_batch([], 128, 4, samples=500, total=1000) == 16
    assert SmallLargeSwitch(64, 16, switch=0.0).initial == 16


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"large": 16, "small": 32}, "small (32) must not exceed large (16)"),
        ({"large": 16, "small": 8, "switch": 1.5}, "switch"),
        ({"large": 0, "small": 8}, "large must be a whole number >= 1, got 0"),
    ],
)
def test_switch_refuses_bad_settings_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SmallLargeSwitch(**kwargs)


class Doubler:
    """A controller that doubles at its third measurement and counts what it saw."""

    initial, min, max = 64, 1, 10_000
    contract = Contract()

    def __init__(self):
        self.seen = []

    def next(self, measured, batch_size, samples):
        self.seen.append((batch_size, samples))
        return batch_size * 2 if len(self.seen) == 3 else batch_size

    def state_dict(self):
        return {"seen": len(self.seen)}

    def load_state_dict(self, state):
        pass


def test_controller_scheme_applies_a_decision_from_the_next_round_and_stops_feeding_after_it():
    controller = Doubler()
    scheme = ControllerScheme(controller, clients=4)
    assert scheme.initial == 16  # global 64 over 4 clients
    pooled = [{"grad_sq_norm": 1.0, "trace": 1.0, "similarity": 0.1}] * 5
    # five local steps of global batch 64 ended at 1000 samples
    assert scheme.next_local_batch(pooled, 16, 4, samples=1000, total=10_000) == 32
    assert controller.seen == [(64, 1000 - 64 * 4), (64, 1000 - 64 * 3), (64, 1000 - 64 * 2)]


def test_controller_scheme_divides_the_global_batch_rounding_up():
    # 64, then a chosen 100, over 3 clients: 22 and 34 each, never a global batch below it
    controller = Doubler()
    controller.next = lambda measured, batch_size, samples: 100
    scheme = ControllerScheme(controller, clients=3)
    assert scheme.initial == 22
    pooled = [{"grad_sq_norm": 1.0, "trace": 1.0, "similarity": 0.1}]
    assert scheme.next_local_batch(pooled, 22, 3, samples=1000, total=10_000) == 34


def test_controller_scheme_grows_where_the_pooled_noise_scale_exceeds_the_next_batch():
    noisy = [{"grad_sq_norm": 1.0, "trace": 1000.0, "similarity": 0.0, "schedule": 1.0}] * 12
    quiet = [{"grad_sq_norm": 1.0, "trace": 10.0, "similarity": 0.9, "schedule": 1.0}] * 12
    grows = ControllerScheme(BatchWarmup(multiple=0.25, initial=64), clients=4)
    assert grows.next_local_batch(noisy, 16, 4, samples=10_000, total=100_000) == 32
    holds = ControllerScheme(BatchWarmup(multiple=0.25, initial=64), clients=4)
    assert holds.next_local_batch(quiet, 16, 4, samples=10_000, total=100_000) == 16


def test_planner_covers_the_round_in_whole_steps_at_the_scaled_and_scheduled_rate():
    schedule = warmup_cosine(10_000, 1000)
    planner = RoundPlanner(
        Fixed(48), clients=2, local_samples=100, lr=0.1, lr_scaling="linear", base_batch=16,
        total_samples=10_000, schedule=schedule,
    )  # fmt: skip
    plan = planner.plan()
    assert (plan.round, plan.local_batch, plan.local_steps, plan.global_batch) == (1, 48, 3, 96)
    # the rate is read at the round's middle: 2 clients x 100 samples / 2
    assert plan.lr == pytest.approx(0.1 * 3 * schedule(100))
    planner.update(plan, [report(144, [1.0] * 3, [1.0] * 3, 48)] * 2)
    assert planner.samples == 288
    assert planner.plan().round == 2
    # read in planned samples (100 a client a round), as the total counts them
    assert planner.plan().lr == pytest.approx(0.1 * 3 * schedule(200 + 100))


def test_the_last_rounds_rate_is_read_inside_the_total_whatever_the_whole_steps_train():
    """1,000 samples a client at batch 64 train 1,024: the clock ran past the total, and
    the last round trained at rate 0."""
    rounds, schedule = 30, warmup_cosine(4 * 1000 * 30, 6000)
    planner = RoundPlanner(Fixed(64), clients=4, local_samples=1000, lr=0.1, lr_scaling="none",
                           total_samples=4 * 1000 * rounds, schedule=schedule)  # fmt: skip
    for _ in range(rounds):
        plan = planner.plan()
        planner.update(plan, [report(16 * 64, [1.0] * 16, [1.0] * 16, 64)] * 4)
    assert plan.lr == pytest.approx(0.1 * schedule(4 * 1000 * rounds - 2000)) and plan.lr > 0
    assert planner.samples == 4 * 1024 * rounds  # what the clients trained


def test_a_local_batch_of_one_is_refused_up_front():
    """A client measures from two sub-batches: at 1, every client failed every round, and
    Flower returned an empty model without a word."""
    with pytest.raises(ValueError, match="the scheme's local batch must be a whole number >= 2"):
        RoundPlanner(Fixed(1), clients=2, local_samples=8, lr=0.1, total_samples=10)


def test_planner_state_round_trips():
    def make():
        return RoundPlanner(
            ControllerScheme(BatchWarmup(initial=32), 2), clients=2, local_samples=64, lr=0.1,
            total_samples=6400,
        )  # fmt: skip

    first = make()
    # six steps: fewer than a decision needs, so the controller's window holds them
    quiet = [1.0, 2.0, 1.5, 1.0, 2.0, 1.5], [10.0] * 6
    plan = first.plan()
    first.update(plan, [report(64, *quiet, batch=16)] * 2)
    state = first.state_dict()
    second = make()
    assert second.state_dict() != state
    second.load_state_dict(state)
    assert second.plan() == first.plan()
    assert second.state_dict() == state


def test_the_controller_weighs_the_round_by_the_multiplier_it_trained_at():
    seen = []

    class Recording(Doubler):
        def next(self, measured, batch_size, samples):
            seen.append(measured["schedule"])
            return batch_size

    schedule = warmup_cosine(10_000, 2_000)
    planner = RoundPlanner(
        ControllerScheme(Recording(), 4), clients=4, local_samples=250, lr=0.1,
        total_samples=10_000, schedule=schedule,
    )  # fmt: skip
    plan = planner.plan()
    assert plan.schedule == schedule(500)  # the middle of the first 1,000 samples
    planner.update(plan, [report(256, [1.0] * 16, [1.0] * 16)] * 4)
    assert seen == [schedule(500)] * 16


def test_a_missing_client_thins_the_statistics_but_is_no_smaller_batch():
    planner = RoundPlanner(
        ControllerScheme(BatchWarmup(initial=16, min=16), 4), clients=4, local_samples=64,
        lr=0.1, total_samples=10_000,
    )  # fmt: skip
    plan = planner.plan()
    quiet = [1.0] * 16, [1.0] * 16
    planner.update(plan, [report(64, *quiet, batch=4)] * 3)  # one of four did not reply
    assert planner.local_batch == 4
    assert planner.samples == 3 * 64


def test_the_local_batch_never_exceeds_the_rounds_samples():
    class Huge(Doubler):
        def next(self, measured, batch_size, samples):
            return 1_000_000

    planner = RoundPlanner(
        ControllerScheme(Huge(), 2), clients=2, local_samples=100, lr=0.1, total_samples=10_000
    )
    planner.update(planner.plan(), [report(100, [1.0] * 4, [1.0] * 4, 32)] * 2)
    assert planner.local_batch == 100
    assert planner.plan().local_steps == 1


def test_the_local_batch_never_falls_below_two_for_the_clients_statistics():
    """A controller (or a global batch divided among many clients) that asks for a local
    batch of 1: a client measures from two sub-batches a step, so 2."""

    class Tiny(Doubler):
        def next(self, measured, batch_size, samples):
            return 1

    planner = RoundPlanner(
        ControllerScheme(Tiny(), 2), clients=2, local_samples=100, lr=0.1, total_samples=10_000
    )
    planner.update(planner.plan(), [report(100, [1.0] * 4, [1.0] * 4, 32)] * 2)
    assert planner.local_batch == 2
    assert planner.plan().local_steps == 50


def test_planner_refuses_bad_settings_naming_them():
    with pytest.raises(ValueError, match="the scheme divides its batch among 4 clients, not 2"):
        RoundPlanner(
            ControllerScheme(BatchWarmup(initial=64), 4), clients=2, local_samples=8, lr=0.1,
            total_samples=10,
        )  # fmt: skip
    with pytest.raises(ValueError, match="local_samples must be a whole number >= 1, got 0"):
        RoundPlanner(Fixed(8), clients=2, local_samples=0, lr=0.1, total_samples=10)
    with pytest.raises(ValueError, match="lr_scaling must be one of 'none', 'linear', 'sqrt'"):
        RoundPlanner(
            Fixed(8), clients=2, local_samples=8, lr=0.1, lr_scaling="adascale", total_samples=10
        )
    with pytest.raises(ValueError, match="lr_scaling must be one of"):
        RoundPlanner(
            Fixed(8), clients=2, local_samples=8, lr=0.1, lr_scaling="cubic", total_samples=10
        )
