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
