"""`bigbatch train --explain`: every filled value of a run with where it came from."""

import re
from pathlib import Path

import pytest

from bigbatch import cli
from bigbatch.experiments.config import resolve, to_toml
from bigbatch.experiments.explain import explain
from bigbatch.experiments.plan import plan_run


def filled_lines(text):
    """``{key: (value, origin)}`` of the explanation's list of filled values."""
    rows = text.split("filled in", 1)[1].splitlines()[1:]
    return {m[1]: (m[2], m[3]) for r in rows if (m := re.match(r"  (\S+)\s+(\S+)\s+(.+)", r))}


def test_the_default_runs_rate_is_derived_in_words_and_numbers():
    config = resolve({})
    text = explain(config)
    run = plan_run(config)
    assert run["lr"] == pytest.approx(0.004 * 0.5**1.5)  # mnist1d's LAMB rate at 64, sqrt to 8
    rate = "rate  0.001414 = the mnist1d task's lamb rate 0.004 at batch 64 x 0.3536"
    assert f"{rate} (sqrt of 8/64)" in text
    assert "x sqrt(B/8) as the batch changes" in text
    assert "cosine over 1,200,000 samples, 5% warm-up" in text
    filled = filled_lines(text)
    for key, (value, _) in filled.items():
        assert value == repr(run[key])  # what is printed is what the run uses
    assert filled["batch.lr_scaling"][1] == "auto: the adam family's rule"
    assert filled["weight_decay"][1] == "the lamb recipe"
    assert filled["batch.initial"][1] == "the batch_warmup controller's default"


def test_a_value_that_was_set_is_not_explained_as_filled():
    text = explain(resolve({"lr": 0.01, "batch.initial": 32, "task": "text"}))
    assert "rate  0.01 = as set (lr)" in text
    filled = filled_lines(text)
    assert "lr" not in filled and "batch.initial" not in filled
    assert filled["model.context"] == ("32", "the text task's default")


@pytest.mark.filterwarnings("ignore::bigbatch.optim.FewSubBatchesWarning")  # VRGD at 4: on purpose
def test_where_the_noise_comes_from_is_read_off_the_runs_engine():
    def noise(**keys):
        line = next(r for r in explain(resolve(keys)).splitlines() if r.startswith("noise"))
        return line.removeprefix("noise").strip()

    assert noise() == (
        "each example's gradient norm in the one backward, 1 micro-batch at least, measured "
        "one step in 4 at batch 8 (by the batch: one in 64/B below 64, at most one in 4, "
        "every step from 64; |G|^2 also from the batch gradient's norm between); similarity "
        "scalar (noise_from = 'auto': every trained parameter is in a layer with a rule)"
    )
    # a run that never goes below 64 has no step between
    large = noise(**{"batch.initial": 128, "batch.min": 128})
    assert "every step at batch 128 (by the batch:" in large and "between" not in large
    assert "measured every step;" in noise(statistics_every=1)
    # SimiGrad reads the measured similarity: two micro-batches for the halves
    assert "2 micro-batches at least" in noise(**{"batch.controller": "simigrad"})
    assert "similarity split" in noise(**{"batch.controller": "simigrad"})
    assert noise(noise_from="sub_batches", statistics_every=4).startswith(
        "the spread of the micro-batches' gradients, 4 micro-batches at least, measured "
        "one step in 4 (|G|^2 also from the batch gradient's norm between)"
    )
    similarity_every = noise(statistics_every=4, **{"batch.controller": "damped_simigrad"})
    assert "one step in 4;" in similarity_every  # a similarity controller learns nothing between
    assert "measured every step;" in noise(optimizer="vr-lamb")  # VRGD reads every step
    # VRGD's GSNR reads the micro-batches: auto falls back and says why
    assert noise(optimizer="vr-lamb").endswith(
        "(noise_from = 'auto', but the GSNR (VRGD) reads the micro-batches)"
    )
    assert "a lossy reduction" in noise(**{"dist.compression": "ef"})


def test_the_machine_line_names_the_device_threads_and_precision():
    def machine(**keys):
        line = next(r for r in explain(resolve(keys)).splitlines() if r.startswith("machine"))
        return line.removeprefix("machine").strip()

    assert machine(device="cpu", threads=1, precision="bf16") == (
        "cpu, 1 thread; forward passes in bf16"
    )
    assert machine(device="cpu").endswith("(torch's default); forward passes in fp32")
    # a key only --nproc 2+ can train (one process refuses it): said, not explained as usual
    assert machine(device="cpu", **{"dist.compression": "ef"}).endswith(
        "gradients compressed (ef): train with --nproc 2 or more"
    )


def test_a_batch_max_above_the_training_set_is_explained_as_lowered_to_it():
    filled = filled_lines(explain(resolve({"task": "digits"})))
    assert filled["batch.max"] == ("1437", "the training set's size (batch.max 16,384 is larger)")
    assert "batch.max" not in filled_lines(explain(resolve({})))  # mnist1d holds 16,384+


def test_a_controller_that_asks_for_the_familys_rule_says_so():
    text = explain(resolve({"task": "text", "batch.controller": "seesaw", "optimizer": "sgd"}))
    assert filled_lines(text)["batch.lr_scaling"] == (
        "'linear'",
        "auto: the sgd family's rule, as Seesaw asks",
    )
    held = explain(resolve({"batch.controller": "critical_ramp"}))
    assert "held as the batch changes" in held and "holds the rate" in held


def test_the_command_prints_it_and_trains_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "--task", "text", "--explain"]) == 0
    assert capsys.readouterr().out.startswith("text: lamb, batch_warmup from batch 8 (its own")
    assert not (tmp_path / "runs").exists()
    saved = tmp_path / "run"
    saved.mkdir()
    (saved / "config.toml").write_text(to_toml(plan_run({})))
    assert cli.main(["train", "--resume", str(saved), "--explain"]) == 2
    assert "--explain explains a new run's config" in capsys.readouterr().err


def test_docs_quote_the_default_runs_explanation():
    docs = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    head = "\n".join(explain(resolve({})).splitlines()[:4])
    assert f"```\n{head}\n```" in docs


def test_the_default_start_says_why_it_is_small_and_a_start_that_was_set_does_not():
    why = "never shrinks it, so a start above the best batch would cost loss"
    assert why in explain(resolve({})).splitlines()[0]
    assert why in explain(resolve({"batch.controller": "warmup_seesaw"})).splitlines()[0]
    for keys in (
        {"batch.initial": 16},
        {"batch.min": 512},  # the own start raised to a bound
        {"batch.controller": "seesaw"},
        {"batch.controller": "constant"},
    ):
        assert why not in explain(resolve(keys)).splitlines()[0], keys
