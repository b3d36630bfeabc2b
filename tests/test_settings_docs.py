"""docs/cli.md's settings tables are generated from the settings records and kept up to date."""

from __future__ import annotations

import re
from dataclasses import dataclass

from iresflow._settings import SettingsRecord, setting
from iresflow.settings_docs import PAGE, RECORDS, render_tables, settings_table
from iresflow.train.config import TrainConfig, read_toml


@dataclass(frozen=True)
class _Draw(SettingsRecord):
    num: int = setting(16, "sequences | or more")
    rate: float = setting(5e-3, "a rate")
    kind: str = setting("a", "a kind", ("a", "b"))
    kinds: tuple[str, ...] = setting(("a", "b"), "kinds in order", ("a", "b", "c"))
    length: int | None = setting(None, "a length", unset="drawn")
    plot: bool = setting(False, "also plot")


def test_a_table_states_flags_defaults_choices_and_help() -> None:
    assert settings_table(_Draw.settings()).splitlines() == [
        "| setting (flag) | default | choices | meaning |",
        "|---|---|---|---|",
        "| `num` (`--num`) | 16 |  | sequences \\| or more |",  # a | inside a cell is escaped
        "| `rate` (`--rate`) | 0.005 |  | a rate |",
        "| `kind` (`--kind`) | `a` | `a`, `b` | a kind |",
        "| `kinds` (`--kinds`) | `a,b` | `a`, `b`, `c` | kinds in order |",
        "| `length` (`--length`) | drawn |  | a length |",
        "| `plot` (`--plot`, `--no-plot`) | false |  | also plot |",
    ]


def test_render_tables_rewrites_only_between_markers() -> None:
    page = ("prose\n<!-- settings: InfoSettings -->\nstale\n<!-- /settings -->\nmore prose\n")
    rendered = render_tables(page)
    assert rendered.startswith("prose\n<!-- settings: InfoSettings -->\n| setting (flag) |")
    assert rendered.endswith("`seq_len` (`--seq-len`) | the data's longest |  | sequence length "
                             "of the Lipschitz report |\n<!-- /settings -->\nmore prose\n")
    assert render_tables(rendered) == rendered


def test_the_cli_page_is_up_to_date_with_the_records() -> None:
    """Run ``python -m iresflow.settings_docs`` when this fails."""
    text = PAGE.read_text(encoding="utf-8")
    assert render_tables(text) == text, "out of date: run python -m iresflow.settings_docs"
    named = {name for names in re.findall(r"<!-- settings: ([A-Za-z ]+) -->", text)
             for name in names.split()}
    assert named == set(RECORDS)  # every record has a table


def test_the_cli_page_states_no_other_default_in_its_prose() -> None:
    """A ``name = value`` in a sentence about defaults, outside the tables, is the default."""
    text = re.sub(r"```.*?```|<!-- settings:.*?<!-- /settings -->", "",
                  PAGE.read_text(encoding="utf-8"), flags=re.DOTALL)
    prose = " ".join(line for line in text.splitlines() if not line.startswith("|"))
    defaults = TrainConfig().to_dict()
    stated = [
        (name, value) for sentence in re.split(r"(?<=[.:;])\s", prose)
        if "default" in sentence.lower()
        for name, value in re.findall(r"`(\w+) = ([^`]+)`", sentence) if name in defaults
    ]
    assert len(stated) >= 4
    for name, value in stated:
        default = defaults[name]
        assert read_toml(f"v = {value}")["v"] == (
            list(default) if isinstance(default, tuple) else default), name
