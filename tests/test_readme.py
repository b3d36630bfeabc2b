"""The README's Python example runs as written."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.slow
def test_readme_python_example_runs():
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S)
    assert code is not None, "README has no Python example"
    exec(compile(code.group(1), str(README), "exec"), {})


def test_readme_names_both_setup_commands():
    text = README.read_text()
    assert "make demo" in text and "make test" in text
