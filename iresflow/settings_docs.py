"""The settings tables of ``docs/cli.md``, written from the settings records.

Every table of settings in ``docs/cli.md`` sits between two markers that name the records it
lists, and is generated from their fields (name and flag, default, choices, help text), so the
page cannot state another default than the code::

    <!-- settings: EvaluateSettings RunSettings -->
    | setting (flag) | default | choices | meaning |
    ...
    <!-- /settings -->

Rewrite the tables in place after changing a setting (a test fails while they are out of
date)::

    python -m iresflow.settings_docs
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from iresflow._settings import SettingsRecord
from iresflow.runs.settings import (
    EvaluateSettings,
    ForecastSettings,
    InfoSettings,
    RunSettings,
    SampleSettings,
)
from iresflow.train.config import TrainConfig

__all__ = ["PAGE", "RECORDS", "main", "render_tables", "settings_table"]

#: The page whose tables :func:`main` rewrites: ``docs/cli.md`` of the repository.
PAGE = Path(__file__).resolve().parents[1] / "docs" / "cli.md"

#: The records a marker may name, by class name.
RECORDS: dict[str, type[SettingsRecord]] = {
    cls.__name__: cls
    for cls in (TrainConfig, EvaluateSettings, SampleSettings, ForecastSettings, InfoSettings,
                RunSettings)
}

_TABLE = re.compile(
    r"(?P<open><!-- settings: (?P<names>[A-Za-z ]+) -->\n).*?(?P<close><!-- /settings -->)",
    re.DOTALL,
)


def settings_table(settings: list[tuple[dataclasses.Field, Any]]) -> str:
    """A markdown table of settings, one row per field, as :meth:`SettingsRecord.settings`
    lists them.

    Args:
        settings: Fields made with :func:`~iresflow._settings.setting`, with their type hints.

    Returns:
        The table's lines, header first, each ending in a newline.

    Example:
        >>> from iresflow._settings import setting
        >>> @dataclasses.dataclass(frozen=True)
        ... class Draw(SettingsRecord):
        ...     num: int = setting(16, "sequences to draw")
        >>> print(settings_table(Draw.settings()), end="")
        | setting (flag) | default | choices | meaning |
        |---|---|---|---|
        | `num` (`--num`) | 16 |  | sequences to draw |
    """
    lines = ["| setting (flag) | default | choices | meaning |", "|---|---|---|---|"]
    for field, hint in settings:
        flag = "--" + field.name.replace("_", "-")
        flags = f"`{flag}`, `--no-{flag[2:]}`" if hint is bool else f"`{flag}`"
        choices = field.metadata["choices"] or ()
        cells = (
            f"`{field.name}` ({flags})",
            _default(field, hint),
            ", ".join(f"`{choice}`" for choice in choices),
            field.metadata["help"],
        )
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "".join(line + "\n" for line in lines)


def _default(field: dataclasses.Field, hint: Any) -> str:
    """The default as the page states it: words for an automatic one, TOML's spelling else."""
    value = field.default
    if value is None:
        return field.metadata["unset"]
    if hint is bool:
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, str):
        return f"`{value}`"
    if isinstance(value, tuple):
        return f"`{','.join(value)}`"
    return str(value)


def render_tables(text: str) -> str:
    """``text`` with every table between settings markers regenerated from its records.

    Raises:
        KeyError: a marker names no record of :data:`RECORDS`.
    """

    def table(match: re.Match[str]) -> str:
        settings = [row for name in match["names"].split() for row in RECORDS[name].settings()]
        return match["open"] + settings_table(settings) + match["close"]

    return _TABLE.sub(table, text)


def main() -> None:
    """Rewrite the settings tables of :data:`PAGE` in place."""
    text = PAGE.read_text(encoding="utf-8")
    rendered = render_tables(text)
    if rendered != text:
        PAGE.write_text(rendered, encoding="utf-8")
    print(f"{PAGE}: settings tables {'rewritten' if rendered != text else 'up to date'}")


if __name__ == "__main__":
    main()
