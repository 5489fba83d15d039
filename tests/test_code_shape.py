"""The code-shape report (tools/code_shape.py) sees a long function."""

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "tools" / "code_shape.py"
_SPEC = importlib.util.spec_from_file_location("code_shape", _PATH)
code_shape = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(code_shape)


def test_the_report_sees_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(80))
    assert code_shape.too_long(f"def f():\n{body}\n") == ["f (81 lines)"]
    assert code_shape.too_long("def g():\n    return 1\n") == []
