"""StepOptions: one record of the per-step rules, checked once, taken by every entry point."""

import dataclasses

import pytest
import torch
from torch.utils.data import TensorDataset

import bigbatch as bb
from bigbatch import StepOptions


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("lr_scaling", "cubic", "lr_scaling must be one of"),
        ("base_batch_size", 0, "base_batch_size must be a whole number >= 1, got 0"),
        ("schedule", 3, "schedule must be a function of samples, got 3"),
        ("max_lr_factor", 0.0, "max_lr_factor must be > 0, got 0.0"),
        ("statistics", "yes", "statistics must be true or false, got 'yes'"),
        ("similarity", "halves", "similarity must be one of"),
        ("ema_beta", 1.0, "ema_beta must be in [0, 1), got 1.0"),
        ("loss_reduction", "max", "loss_reduction must be one of"),
        ("nonfinite", "ignore", "nonfinite must be one of"),
        ("noise_units", 1, "noise_units must be at least 2 (one unit has no noise"),
        ("statistics_every", 0, "statistics_every must be a whole number >= 1, got 0"),
        ("statistics_every", 2.5, "statistics_every must be a whole number, got 2.5"),
        ("statistics_every", "often", "statistics_every must be a whole number of steps or"),
    ],
)
def test_a_bad_option_is_one_error_naming_it_and_its_value(field, value, message):
    with pytest.raises(ValueError) as raised:
        StepOptions(**{field: value})
    assert message in str(raised.value)


def test_keywords_replace_the_fields_of_a_record_and_unknown_ones_are_named():
    record = StepOptions(lr_scaling="sqrt", ema_beta=0.9)
    merged = StepOptions.of(record, nonfinite="raise")
    assert (merged.lr_scaling, merged.ema_beta, merged.nonfinite) == ("sqrt", 0.9, "raise")
    assert StepOptions.of(record) is record and StepOptions.of() == StepOptions()
    with pytest.raises(TypeError, match="unknown option 'lr_scale'; the step options are"):
        StepOptions.of(lr_scale="sqrt")
    with pytest.raises(TypeError, match="options must be a StepOptions, got dict"):
        StepOptions.of({"lr_scaling": "sqrt"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.ema_beta = 0.5


def test_a_hosts_keywords_keep_what_is_not_a_step_option():
    keywords = {"lr_scaling": "linear", "output_dir": "out", "gsnr": True}
    assert StepOptions.pop_from(keywords) == {"lr_scaling": "linear", "gsnr": True}
    assert keywords == {"output_dir": "out"}


def test_the_loop_takes_the_record_or_its_fields_and_builds_the_same_engine():
    def loop(**kwargs):
        model = torch.nn.Linear(3, 1)
        data = TensorDataset(torch.randn(64, 3), torch.randn(64, 1))
        return bb.AdaptiveBatch(model, torch.optim.SGD(model.parameters(), lr=0.1), data, **kwargs)

    by_record = loop(options=StepOptions(lr_scaling="sqrt", ema_beta=0.5))
    by_keywords = loop(lr_scaling="sqrt", ema_beta=0.5)
    assert by_record.engine.describe() == by_keywords.engine.describe()
    assert by_record.engine.describe()["collector"]["ema_beta"] == 0.5
    with pytest.raises(TypeError, match="unknown option 'lr'"):
        loop(lr=0.1)
