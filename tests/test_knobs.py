"""A component's config keys take their defaults from its constructor's signature."""

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
