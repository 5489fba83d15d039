"""A component's config keys take their defaults from its constructor's signature."""

import contextlib

from bigbatch.knobs import NO_DEFAULT, Knob, signature_defaults


class Component:
    def __init__(self, rate, *, window=8, horizon=None, beta=0.5, target=None):
        pass


def test_defaults_come_from_the_signature():
    knobs = {
        "c.rate": Knob("rate", "required: no default"),
        "c.window": Knob("window", "the signature's default"),
        "c.horizon": Knob("horizon", "None in the signature: the knob's unset value", unset=0),
        "c.beta": Knob("beta", "a run's own default", run_default=0.9),
        "c.target": Knob("target", "None, and no unset value: None"),
    }
    assert signature_defaults(Component, knobs) == {
        "c.rate": NO_DEFAULT,
        "c.window": 8,
        "c.horizon": 0,
        "c.beta": 0.9,
        "c.target": None,
    }


def test_a_run_default_replaces_even_a_required_argument():
    knobs = {"c.rate": Knob("rate", "", run_default=0.1), "c.w": Knob("window", "", unset=3)}
    assert signature_defaults(Component, knobs) == {"c.rate": 0.1, "c.w": 8}


# ---------------------------------------------------------------- settings dataclasses

import math  # noqa: E402
from dataclasses import KW_ONLY  # noqa: E402

import pytest  # noqa: E402

from bigbatch.batch.controllers import CONTROLLERS  # noqa: E402
from bigbatch.knobs import check_settings, setting, settings  # noqa: E402


@settings
class Toy:
    rate: float = setting(help="required", key="lr", low=0, low_open=True)
    _: KW_ONLY
    window: int = setting(8, "a count", key="window", low=1)
    share: float = setting(0.5, "a share", low=0, high=1, high_open=True)
    on: bool = setting(True, "a flag")
    mode: str = setting("a", "one of two", key="mode", choices=("a", "b"))
    layers: int = setting(2, "a count in (0, 8)", low=0, low_open=True, high=8, high_open=True)
    name: str = setting("x", "text")

    def __post_init__(self):
        check_settings(self)


def test_settings_give_the_constructor_its_checks_repr_and_config_keys():
    toy = Toy(2)
    assert toy.rate == 2.0 and isinstance(toy.rate, float)  # a number is stored as a float
    assert repr(toy) == "Toy(rate=2.0, window=8, share=0.5, on=True, mode='a', layers=2, name='x')"
    assert list(Toy.CONFIG) == ["lr", "window", "mode"]  # only the fields with a key
    assert Toy.CONFIG["lr"] == Knob("rate", "required", low=0, low_open=True)
    assert signature_defaults(Toy, Toy.CONFIG) == {"lr": NO_DEFAULT, "window": 8, "mode": "a"}
    with pytest.raises(TypeError):
        Toy(1, 8)  # keyword-only after KW_ONLY, as a hand-written signature would say


@pytest.mark.parametrize(
    "values, message",
    [
        ({"rate": 0}, "rate must be > 0, got 0"),
        ({"rate": math.nan}, "rate must"),
        ({"rate": "fast"}, "rate must be a number, got 'fast'"),
        ({"rate": 1, "window": 0}, "window must be a whole number >= 1, got 0"),
        ({"rate": 1, "window": 2.0}, "window must be a whole number"),
        ({"rate": 1, "share": 1.0}, "share must be in \\[0, 1\\), got 1.0"),
        ({"rate": 1, "on": 1}, "on must be true or false"),
        ({"rate": 1, "mode": "c"}, "mode must be one of 'a', 'b', got 'c'"),
        ({"rate": 1, "mode": "bb"}, "got 'bb'; did you mean 'b'"),
        # a whole number's every bound holds (only the lower, closed one did)
        ({"rate": 1, "layers": 0}, r"layers must be a whole number in \(0, 8\), got 0"),
        ({"rate": 1, "layers": 8}, r"layers must be a whole number in \(0, 8\), got 8"),
        ({"rate": 1, "name": 3}, "name must be text, got 3"),
        ({"rate": None}, "rate must be a number, got None"),  # not typed optional
        ({"rate": 1, "window": None}, "window must be a whole number"),
    ],
)
def test_a_bad_setting_is_one_error_naming_it(values, message):
    with pytest.raises(ValueError, match=message):
        Toy(**values)


@pytest.mark.parametrize("name", sorted(CONTROLLERS))
def test_a_controllers_config_bounds_are_the_ones_it_checks(name):
    """One bound, in one place: a value a key's bounds refuse, the constructor refuses."""
    cls = CONTROLLERS[name]
    for key, knob in cls.CONFIG.items():
        if knob.low is None or key in ("initial", "min", "max"):
            continue
        below = knob.low if knob.low_open else knob.low - 1
        args = {"batch_size": 16} if name == "constant" else {}
        with pytest.raises(ValueError, match=knob.param):
            cls(**{**args, knob.param: below})


class _ChecksPassedError(Exception):
    """The compression state got past its checks to the model (a stand-in here)."""


class _NoModel:
    @property
    def process_group(self):
        raise _ChecksPassedError


@pytest.mark.parametrize("name", ["VRGD", "AGVM", "CompressionState"])
def test_a_wrappers_key_bounds_are_the_ones_it_checks(name):
    """A wrapper's constructor checks its own arguments (it wraps an optimizer or a DDP
    model, so it is no settings dataclass); its keys' bounds must say the same: a value
    just outside each is refused, one at a closed end or just inside an open one is
    taken."""
    import torch

    from bigbatch import optim
    from bigbatch.parallel.compression import CompressionState

    wrapper = CompressionState if name == "CompressionState" else getattr(optim, name)

    def make(param, value):
        if wrapper is CompressionState:  # its checks come before it reads the model
            with contextlib.suppress(_ChecksPassedError):
                CompressionState(_NoModel(), **{param: value})
            return
        # two param groups: AGVM compares module groups, each untagged group one
        layers = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
        sgd = torch.optim.SGD([{"params": m.parameters()} for m in layers], lr=0.1)
        wrapper(sgd, **{param: value})

    for knob in wrapper.CONFIG.values():
        if knob.choices:
            for value in knob.choices:
                make(knob.param, value)
            with pytest.raises(ValueError, match=knob.param):
                make(knob.param, "nope")
        if knob.low is not None:
            with pytest.raises(ValueError, match=knob.param):
                make(knob.param, knob.low if knob.low_open else knob.low - 1)
        if knob.high is not None:
            with pytest.raises(ValueError, match=knob.param):
                make(knob.param, knob.high if knob.high_open else knob.high + 1e-4)
            make(knob.param, knob.high - 1e-4 if knob.high_open else knob.high)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"eta": True}, "eta of ef must be a number, got True"),
        ({"method": "ef21-sgdm", "eta": 0}, r"eta of ef21-sgdm must be in \(0, 1\], got 0"),
        ({"seed": -1}, r"seed must be a whole number in \[0, 4294967295\], got -1"),
        ({"seed": 1.5}, "seed must be a whole number, got 1.5"),
    ],
)
def test_compression_refuses_a_flag_for_eta_and_a_seed_no_generator_takes(options, message):
    """``eta=True`` was taken as 1.0, a numpy float refused as out of range, any seed taken."""
    import numpy as np

    from bigbatch.parallel.compression import CompressionState

    with pytest.raises(ValueError, match=message):
        CompressionState(_NoModel(), **options)
    with pytest.raises(_ChecksPassedError):  # past the checks, to the model
        CompressionState(_NoModel(), method="econtrol", eta=np.float32(0.5), seed=np.int64(3))
