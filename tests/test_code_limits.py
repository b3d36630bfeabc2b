"""Size limits of the package's code: no file over 450 lines, no function over 80.

A file that needs more does several jobs and is split by job; a function that needs more is
several steps and is split into them (docs/architecture.md).
"""

from __future__ import annotations

import ast
from pathlib import Path

import iresflow

PACKAGE = Path(iresflow.__file__).resolve().parent
MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 80


def oversized(source: str, where: str) -> list[str]:
    """The limits a module's source breaks, one line of text each (empty when it keeps them)."""
    found = []
    lines = len(source.splitlines())
    if lines > MAX_FILE_LINES:
        found.append(f"{where}: {lines} lines (limit {MAX_FILE_LINES})")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{where}:{node.lineno}: {node.name} has {length} lines "
                             f"(limit {MAX_FUNCTION_LINES})")
    return found


def test_checker_finds_long_files_and_functions() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    long_function = f"def f():\n{body}\n"
    assert [line.split(": ", 1)[1] for line in oversized(long_function, "m.py")] == [
        f"f has {MAX_FUNCTION_LINES + 1} lines (limit {MAX_FUNCTION_LINES})"
    ]
    assert oversized("x = 1\n" * (MAX_FILE_LINES + 1), "m.py") == [
        f"m.py: {MAX_FILE_LINES + 1} lines (limit {MAX_FILE_LINES})"
    ]
    assert oversized("def f():\n    return 1\n" + "x = 1\n" * (MAX_FILE_LINES - 2), "m.py") == []


def test_no_file_or_function_of_the_package_is_oversized() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += oversized(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert not found, "\n".join(found)
