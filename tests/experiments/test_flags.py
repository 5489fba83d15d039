"""A command's options from one settings class: flags, help, a file's table, checks."""

import argparse
from dataclasses import dataclass

import pytest

from bigbatch import cli
from bigbatch.experiments.config import ConfigError
from bigbatch.experiments.flags import add_flags, checked, given, options_table, settings_from
from bigbatch.experiments.options import SECTIONS, CriticalSettings, TuneSettings
from bigbatch.knobs import setting


@dataclass(frozen=True)
class Toy:
    count: int = setting(3, "how many", low=1)
    share: float = setting(0.5, "a share", low=0, high=1)
    limit: float | None = setting(None, "a limit", low=0, low_open=True)
    sizes: tuple[int, ...] = setting((8, 16), "sizes", low=1)
    mode: str = setting("a", "a mode", choices=("a", "b"))
    fast: bool = setting(False, "go fast")
    seed: int = setting(0, "seeds it", low=0, flag="--toy-seed")

    def __post_init__(self) -> None:
        checked(self)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_flags(parser, Toy)
    return parser.parse_args(argv)


def test_each_field_is_a_flag_of_its_type_and_an_absent_flag_is_not_given():
    args = parse("--count", "5", "--limit", "none", "--sizes", "4,8", "--mode", "b", "--fast")
    assert given(Toy, args) == {
        "count": 5,
        "limit": None,
        "sizes": (4, 8),
        "mode": "b",
        "fast": True,
    }
    assert given(Toy, parse("--toy-seed", "7", "--share", "0.25")) == {"seed": 7, "share": 0.25}
    assert given(Toy, parse()) == {}


def test_the_help_ends_in_the_default_and_the_docs_table_says_the_same():
    parser = argparse.ArgumentParser()
    add_flags(parser, Toy)
    text = " ".join(parser.format_help().split())
    assert "--count N how many (default 3)" in text
    assert "--sizes N1,N2,... sizes (default 8,16)" in text
    assert "--toy-seed N seeds it (default 0)" in text
    table = options_table(Toy)
    assert "| `--mode a\\|b` | a mode | `a` |" in table
    assert "| `--fast` | go fast | `off` |" in table
    assert "| `--limit X` | a limit | `none` |" in table


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--count", "three"), "--count takes a whole number, got 'three'"),
        (("--sizes", "4,x"), "--sizes takes comma-separated whole numbers, got '4,x'"),
        (("--share", "half"), "--share takes a number, got 'half'"),
    ],
)
def test_a_flag_that_does_not_parse_is_one_error_naming_it(argv, message):
    with pytest.raises(ConfigError, match=message):
        given(Toy, parse(*argv))


def test_none_is_an_empty_list_or_none_where_the_field_allows():
    assert given(Toy, parse("--sizes", "none", "--limit", "None")) == {"sizes": (), "limit": None}
    assert settings_from(Toy, "toy", {"limit": "none", "sizes": ["2", 4]}).sizes == (2, 4)
    with pytest.raises(ConfigError, match="--count takes a whole number, got 'none'"):
        given(Toy, parse("--count", "none"))


def test_a_refused_value_is_named_where_it_was_given():
    with pytest.raises(ConfigError, match=r"^\[toy\] count must be a whole number >= 1, got 0$"):
        settings_from(Toy, "toy", {"count": 0})
    with pytest.raises(ConfigError, match=r"^--toy-seed must be a whole number >= 0, got -1$"):
        settings_from(Toy, "toy", {"seed": 3}, given(Toy, parse("--toy-seed", "-1")))
    seed_bound = r"^--search-seed must be a whole number in \[0, 4294967295\], got -1$"
    with pytest.raises(ConfigError, match=seed_bound):
        cli._settings(cli._parser().parse_args(["tune", "--search-seed", "-1"]), "tune")


def test_layers_overlay_the_defaults_in_turn_and_a_bad_value_is_named():
    table = {"count": 4, "sizes": [2, 4], "share": 0.75}
    made = settings_from(Toy, "toy", table, given(Toy, parse("--count", "6")))
    assert (made.count, made.sizes, made.share, made.mode) == (6, (2, 4), 0.75, "a")
    assert settings_from(Toy, "toy", {"sizes": 32}).sizes == (32,)  # one item is a list of one
    assert settings_from(Toy, "toy", {"sizes": "2,4"}).sizes == (2, 4)
    # an item of a list is one value (its first number was taken, the rest dropped)
    with pytest.raises(ConfigError, match=r"^\[toy\] sizes takes a whole number, got '2,3'$"):
        settings_from(Toy, "toy", {"sizes": ["2,3", 4]})
    unknown = r"unknown option 'cout' in \[toy\]: it takes count, .*did you mean 'count'"
    with pytest.raises(ConfigError, match=unknown):
        settings_from(Toy, "toy", {"cout": 4})
    with pytest.raises(ConfigError, match=r"^\[toy\] share must be in \[0, 1\], got 2$"):
        settings_from(Toy, "toy", {"share": 2})
    with pytest.raises(ConfigError, match="sizes must be a whole number >= 1, got 0"):
        Toy(sizes=(4, 0))
    with pytest.raises(ConfigError, match="mode must be one of 'a', 'b', got 'c'"):
        Toy(mode="c")
    assert Toy(limit=1).limit == 1.0 and isinstance(Toy(limit=1).limit, float)


def test_a_study_file_holds_each_commands_options_beside_the_run_keys(tmp_path):
    study = tmp_path / "study.toml"
    study.write_text(
        'task = "digits"\nmax_samples = 2000\n\n[tune]\ntrials = 6\nbudget = 0.5\n\n'
        "[critical]\npoints = [0.25, 0.5]\n\n[compare]\nseeds = 3\n"
    )
    args = cli._parser().parse_args(["tune", "--config", str(study), "--trials", "4"])
    assert cli._settings(args, "tune") == TuneSettings(trials=4, budget=0.5)  # the flag wins
    assert cli._config(args)["max_samples"] == 2000  # the run keys, less the tables
    args = cli._parser().parse_args(["critical-batch", "--config", str(study)])
    assert cli._settings(args, "critical") == CriticalSettings(points=(0.25, 0.5))
    args = cli._parser().parse_args(["train", "--config", str(study)])
    assert cli._config(args)["task"] == "digits"  # train reads the run keys only
    args = cli._parser().parse_args(["compare", "--config", str(study)])
    assert cli._settings(args, "tune").budget == 0.5  # compare --tune's studies read [tune]
    assert set(SECTIONS) == {"compare", "tune", "critical", "federated"}
