"""The one results writer and table renderer of every benchmark.

A benchmark's results are *records*, JSON objects identified by a few key fields (a dataset and
a seed, say), stored with the commands that produced them and the settings they share::

    {"commands": ["python -m benchmarks ...", ...], "settings": {...}, "records": [{...}, ...]}

Files of records merge by key (:func:`merge_records`): a record takes every field of the first
file that has it, so a run of some models and a run of others combine, and a re-run replaces
the fields it wrote. Tables are Markdown (:func:`markdown_table`), written into docs pages
between the markers ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` (:func:`write_blocks`).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def json_safe(value: Any) -> Any:
    """``value`` with non-finite floats replaced by ``None`` (strict JSON), tuples as lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def save(path: Path, records: Sequence[dict[str, Any]], commands: Sequence[str],
         settings: dict[str, Any] | None = None, **extra: Any) -> None:
    """Write a file of records (the parent folder is created).

    Args:
        path: Destination ``.json``.
        records: The records.
        commands: The commands that produced them, oldest first.
        settings: What the records share (a later ``--merge`` must match it).
        extra: Further top-level fields (e.g. the machine of the run).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    content = {"commands": list(commands), "settings": settings or {}, **extra,
               "records": list(records)}
    path.write_text(json.dumps(json_safe(content), indent=1) + "\n")


def load(path: Path) -> dict[str, Any]:
    """A file written by :func:`save` (``commands`` and ``settings`` default to empty)."""
    content = json.loads(Path(path).read_text())
    return {"commands": [], "settings": {}, **content}


def merge_records(files: Sequence[Sequence[dict[str, Any]]], key: Sequence[str]
                  ) -> list[dict[str, Any]]:
    """The records of several files, one per key, in the order keys first appear.

    Args:
        files: The records of every file, in order of precedence.
        key: The fields that identify a record.

    Returns:
        One record per key, holding every field of the first file that has it.

    Example:
        >>> first = [{"seed": 0, "flow": 1.0}]
        >>> later = [{"seed": 0, "flow": 9.0, "gru": 3.0}, {"seed": 1, "flow": 2.0}]
        >>> merge_records([first, later], key=("seed",))
        [{'seed': 0, 'flow': 1.0, 'gru': 3.0}, {'seed': 1, 'flow': 2.0}]
    """
    merged: dict[tuple[Any, ...], dict[str, Any]] = {}
    for records in files:
        for record in records:
            target = merged.setdefault(tuple(record[k] for k in key), {})
            for field, value in record.items():
                target.setdefault(field, value)
    return list(merged.values())


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table (an empty cell is one space).

    Example:
        >>> print(markdown_table(["a", "b"], [["1", "2"]]))
        | a | b |
        |---|---|
        | 1 | 2 |
    """
    def line(cells: Sequence[str]) -> str:
        return "|" + "|".join(f" {cell} " if cell else " " for cell in cells) + "|"

    return "\n".join([line(header), "|" + "---|" * len(header), *map(line, rows)])


def mean_sd(values: Sequence[float], digits: int = 3) -> str:
    """``mean`` of one value, ``mean ± sd`` of several, with ``digits`` decimals.

    Example:
        >>> mean_sd([1.0]), mean_sd([1.0, 2.0, 3.0], 1)
        ('1.000', '2.0 ± 1.0')
    """
    mean = statistics.fmean(values)
    if len(values) < 2:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def markers(name: str) -> tuple[str, str]:
    """The start and end markers of the block ``name`` in a docs page."""
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def replace_block(text: str, name: str, block: str, source: str) -> str:
    """Replace what lies between the markers of ``name`` in ``text`` by ``block``.

    Raises:
        ValueError: ``text`` (read from ``source``) does not contain both markers, once each,
            in order.

    Example:
        >>> replace_block("a <!-- x:start --> old <!-- x:end --> b", "x", "new", "page")
        'a <!-- x:start -->\\nnew\\n<!-- x:end --> b'
    """
    start, end = markers(name)
    if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
        raise ValueError(f"{source} must contain the markers {start} and {end}, once each, "
                         "in this order")
    head, rest = text.split(start)
    return f"{head}{start}\n{block}\n{end}{rest.split(end)[1]}"


def write_blocks(page: Path, blocks: dict[str, str], check_only: bool = False) -> None:
    """Write every block whose markers ``page`` contains between them.

    Args:
        page: A docs page (or README).
        blocks: ``{name: Markdown}``.
        check_only: Only check that the page can receive a block (before a long run).

    Raises:
        ValueError: the page has the markers of none of the blocks, or malformed markers.
    """
    text = page.read_text()
    names = [name for name in blocks if markers(name)[0] in text or markers(name)[1] in text]
    if not names:
        raise ValueError(f"{page} has the markers of none of the blocks {list(blocks)} "
                         f"(e.g. {' and '.join(markers(next(iter(blocks))))})")
    for name in names:
        text = replace_block(text, name, blocks[name], str(page))
    if not check_only:
        page.write_text(text)
