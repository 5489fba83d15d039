"""``bigbatch report DIR`` on a folder whose files are damaged: one error naming what failed."""

import json

import pytest

from bigbatch.experiments.config import ConfigError
from bigbatch.experiments.report import render


@pytest.mark.parametrize(
    "files, message",
    [
        ({"compare.json": "[1, 2]"}, r"cannot be made from its files \(AttributeError"),
        ({"compare.json": "{"}, r"compare.json' is not valid JSON \(.*\): damaged\?"),
        ({"critical_batch.json": "null"}, r"cannot be made from its files \(TypeError"),
        ({"summary.json": "{", "metrics.jsonl": ""}, r"summary.json' is not valid JSON"),
        ({"summary.json": "{}"}, r"its files \(No such file or directory: .*metrics.jsonl\)"),
        (
            {"summary.json": json.dumps({"task": "digits"}), "metrics.jsonl": '{"step": 1}\nx\n'},
            r"metrics.jsonl' line 2 is not valid JSON",
        ),
        ({"notes.txt": "hello"}, "is not the folder of a run, a comparison"),
        # killed: a comparison writes its plan first, its results at the end
        (
            {"compare.json": json.dumps({"plan": {"seeds": 1}})},
            r"holds a comparison that has not ended: run the same bigbatch compare command",
        ),
        # a run of an ended comparison lost (a seed or a whole arm left out silently before)
        (
            {"compare.json": json.dumps({"plan": {}, "arms": [{"dirs": ["run00-lr0-seed0"]}]})},
            r"run00-lr0-seed0' holds no finished run \(no summary.json of one\): run the same "
            r"bigbatch compare command",
        ),
        # a federated run's: its rounds named, not a train run's metrics
        (
            {"summary.json": json.dumps({"config": {}}), "federated.png": ""},
            r"its files \(No such file or directory: .*rounds.jsonl\)",
        ),
        (
            {"summary.json": json.dumps({"config": {}}), "rounds.jsonl": "{\n"},
            r"rounds.jsonl' line 1 is not valid JSON",
        ),
        # killed before its first point: a critical-batch measurement's plan alone
        ({"plan.json": "{}"}, "holds a critical-batch measurement that has not measured a point"),
        (
            {"config.toml": "", "metrics.jsonl": '{"step": 1}\n'},  # killed: no summary yet
            r"holds a run that has not ended \(no summary.json\): finish it with bigbatch "
            r"train --resume",
        ),
    ],
)
def test_a_damaged_folder_is_one_error_naming_the_file(tmp_path, files, message):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=message):
        render(tmp_path)


def test_a_folder_that_does_not_exist_is_named_so(tmp_path):
    with pytest.raises(ConfigError, match=r"'.*nowhere' does not exist"):
        render(tmp_path / "nowhere")
