from dataclasses import fields

import pytest

from bigbatch.experiments.config import (
    RENAMED,
    RUN_SECTIONS,
    BatchKeys,
    ConfigError,
    _keys,
    defaults,
    parse_assignment,
    resolve,
    schema,
    section,
    to_toml,
)
from bigbatch.experiments.plan import plan_run


def test_defaults_resolve_and_round_trip_through_toml(tmp_path):
    config = resolve()
    assert config == defaults()
    path = tmp_path / "c.toml"
    uri = 'file:C:\\runs\\new "a"'  # a backslash and quotes, escaped in the file
    path.write_text(to_toml({**config, "batch.target": 0.5, "task": "lm", "log.mlflow": uri}))
    from bigbatch.experiments.config import load_toml

    again = resolve(load_toml(path))
    assert again["batch.target"] == 0.5 and again["task"] == "lm" and again["log.mlflow"] == uri


def test_every_key_is_written_once_in_a_section_or_by_a_component():
    keys = [key.name for key in _keys()]
    assert len(keys) == len(set(keys)) == len(schema())  # none hides another
    written = [f.metadata["key"] for cls in RUN_SECTIONS for f in fields(cls)]
    assert set(written) < set(keys)  # the rest: the components' (batch.initial, dist.ratio)
    assert "batch.initial" not in written and "dist.ratio" not in written
    for cls in RUN_SECTIONS:  # a section of the defaults is the section's own defaults
        assert section(cls, defaults()) == cls()


def test_a_section_reads_a_resolved_config_by_its_fields():
    config = resolve({"batch.controller": "seesaw", "noise_from": "examples"})
    batch = section(BatchKeys, config)
    assert (batch.controller, batch.noise_from, batch.base) == ("seesaw", "examples", 0)
    assert schema()["batch.controller"].default == BatchKeys.controller == "batch_warmup"
    with pytest.raises(ConfigError, match=r"the config lacks batch\.controller, batch\.lr_scaling"):
        section(BatchKeys, {"batch.base": 0})


def test_a_components_keys_follow_the_key_they_belong_with():
    keys = list(schema())
    after = {k: keys[keys.index(k) + 1] for k in ("batch.controller", "vrgd.gamma")}
    assert after == {"batch.controller": "batch.noise_multiple", "vrgd.gamma": "vrgd.normalizer"}
    assert keys.index("dist.compressor") == keys.index("dist.compression") + 1


def test_set_values_are_read_as_toml():
    assert parse_assignment("batch.target=0.5") == ("batch.target", 0.5)
    assert parse_assignment("task = digits") == ("task", "digits")
    assert parse_assignment('task="lm"') == ("task", "lm")
    assert resolve({"lr": 1})["lr"] == 1.0
    assert parse_assignment("log.mlflow=http://host/?a=b") == ("log.mlflow", "http://host/?a=b")
    # a number given to a duration keeps every digit (1234567.0 was saved as 1.23457e+06)
    ramp = {"batch.controller": "ramp", "batch.ramp_over": 1234567.0}
    assert resolve(ramp)["batch.ramp_over"] == "1234567"
    with pytest.raises(ConfigError, match=r"'1234567\.5' is not a whole number of samples"):
        resolve({**ramp, "batch.ramp_over": 1234567.5})


@pytest.mark.parametrize(
    "layer, message",
    [
        ({"batch.tagret": 0.5}, "unknown config key 'batch.tagret'; did you mean 'batch.target'"),
        ({"task": "mnist"}, "task must be one of .*got 'mnist'; did you mean 'mnist1d'"),
        ({"lr": "fast"}, "lr must be a number, got 'fast'"),
        ({"seed": 1.5}, "seed must be a whole number, got 1.5"),
        ({"batch.target": 2.0}, r"batch.target must be in \[-1, 1\], got 2.0"),
        ({"max_micro_batch": 0}, "max_micro_batch must be a whole number >= 1, got 0"),
        ({"batch.min": 512, "batch.max": 64}, "batch.min .512. is larger than batch.max .64."),
        ({"batch.initial": 8, "batch.min": 32}, "batch.initial .8. is outside"),
        ({"optimizer": "adam"}, "did you mean 'adamw'"),
        (
            {"batch.controller": "simi"},
            "batch.controller must be one of .*got 'simi'; did you mean 'simigrad'",
        ),
        ({"dist.compression": "zip"}, "dist.compression must be one of 'none', 'ef'"),
        (
            {"batch.min": 2, "batch.initial": 2, "noise_from": "sub_batches"},
            "below min_sub_batches",
        ),
        ({"lr": float("inf")}, "lr must be finite"),
    ],
)
def test_bad_values_name_the_key_and_value(layer, message):
    with pytest.raises(ConfigError, match=message):
        plan_run(layer)


def test_every_declared_key_names_an_argument_of_its_component():
    import inspect

    from bigbatch.batch.controllers import CONTROLLERS
    from bigbatch.optim import AGVM, VRGD
    from bigbatch.parallel.compression import CompressionState

    for component in (*CONTROLLERS.values(), AGVM, VRGD, CompressionState):
        parameters = inspect.signature(component).parameters
        assert all(knob.param in parameters for knob in component.CONFIG.values()), component


def test_an_old_key_name_is_refused_with_the_new_one():
    # no old names before 1.0: each renamed key is one error that names the key it is now
    for old, new in RENAMED.items():
        with pytest.raises(ConfigError, match=f"config key '{old}' is now '{new}'"):
            resolve({old: 1})


def test_a_config_file_that_is_not_toml_text_or_not_a_file_is_named(tmp_path):
    from bigbatch.experiments.config import load_toml

    (tmp_path / "latin1.toml").write_bytes(b"\xff\xfe lr = 1\n")
    with pytest.raises(ConfigError, match=r"latin1.toml' is not valid TOML: 'utf-8' codec"):
        load_toml(tmp_path / "latin1.toml")
    (tmp_path / "folder.toml").mkdir()
    with pytest.raises(ConfigError, match=r"folder.toml' is a folder, not a file"):
        load_toml(tmp_path / "folder.toml")


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("weight_decay", "must be a number or 'auto', got 'lots'"),
        ("schedule.warmup", "= 'lots': not a duration"),  # it also takes a length as text
        ("vrgd.gamma", "must be a number or 'auto', got 'lots'"),
    ],
)
def test_a_recipe_key_takes_a_number_or_auto_and_names_anything_else(key, message):
    with pytest.raises(ConfigError, match=f"{key} {message}"):
        resolve({key: "lots"})
    with pytest.raises(ConfigError, match=f"{key} must be (>|in)"):
        resolve({key: -1})
