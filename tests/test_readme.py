"""The README's Python examples run as written."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_the_api_and_the_conditional_examples():
    assert len(EXAMPLES) == 2, "README should hold the API and the conditional-flow examples"
    assert "context=" in EXAMPLES[1] and len(EXAMPLES[1].splitlines()) <= 15


@pytest.mark.parametrize("code", [
    pytest.param(EXAMPLES[0], marks=pytest.mark.slow, id="api"),  # 20 steps of a 3-block flow
    pytest.param(EXAMPLES[1], id="conditional"),  # about a second
])
def test_readme_python_example_runs(code: str):
    exec(compile(code, str(README), "exec"), {})


def test_readme_names_both_setup_commands():
    text = README.read_text()
    assert "make demo" in text and "make test" in text
