"""The command line's settings: every help text formats, every flag is a record's setting, a
default is defined once and a bad value gives one error; one model build and one data load per
command."""

from __future__ import annotations

import argparse
import ast
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import iresflow.cli
from iresflow._settings import ConfigError, SettingsRecord, setting
from iresflow.cli import build_parser, main, parse_settings
from iresflow.models.flow import SequenceFlow
from iresflow.runs.evaluate import evaluate_run
from iresflow.runs.load import load_run
from iresflow.runs.settings import EvaluateSettings, InfoSettings, RunSettings, SampleSettings
from iresflow.train import factories

COMMANDS = ("train", "evaluate", "sample", "forecast", "info")
TINY = [
    "--n-blocks", "1", "--hidden", "8", "--max-train", "12", "--max-eval", "6",
    "--batch-size", "6", "--scheduler", "plateau", "--eval-method", "exact", "--quiet",
    "--epochs", "1", "--device", "cpu",
]


def _parsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {"iresflow": parser, **commands.choices}


@pytest.mark.parametrize("argv", [["--help"], *[[command, "--help"] for command in COMMANDS]],
                         ids=lambda argv: " ".join(argv))
def test_help_of_every_command_exits_0_with_its_usage(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: iresflow") and "Traceback" not in out
    if argv[0] == "train":  # a help text with a percent sign, escaped for argparse
        assert "10% of the data file" in " ".join(out.split())


@pytest.mark.parametrize("name", ["iresflow", *COMMANDS])
def test_every_generated_help_string_formats(name: str) -> None:
    parser = _parsers()[name]
    formatter = parser._get_formatter()
    helps = [formatter._expand_help(action) for action in parser._actions if action.help]
    assert helps and all("%%" not in text for text in helps)
    assert parser.format_help().startswith("usage: iresflow")


@dataclass(frozen=True)
class _Shares(SettingsRecord):
    share: float = setting(0.1, "10% of the data, 100%o sure")
    part: int | None = setting(None, "a part", unset="50% of it")


def test_add_settings_escapes_percent_signs() -> None:
    parser = argparse.ArgumentParser()
    iresflow.cli.add_settings(parser, _Shares.settings())
    text = " ".join(parser.format_help().split())
    assert "10% of the data, 100%o sure (default: 0.1)" in text
    assert "(default: 50% of it; 'none' restores it)" in text


@pytest.mark.parametrize(
    ("command", "records"),
    [("evaluate", (EvaluateSettings, RunSettings)), ("sample", (SampleSettings, RunSettings)),
     ("info", (InfoSettings, RunSettings))],
)
def test_flags_are_the_records_settings_with_their_defaults(
    command: str, records: tuple[type, ...]
) -> None:
    assert parse_settings(command, ["run"]) == tuple(cls() for cls in records)
    flags = {option for action in _parsers()[command]._actions
             for option in action.option_strings}
    for cls in records:
        for field, _ in cls.settings():
            assert f"--{field.name.replace('_', '-')}" in flags
    help_text = " ".join(_parsers()[command].format_help().split())
    for cls in records:
        for field, _ in cls.settings():
            if not isinstance(field.default, tuple) and field.default is not None:
                assert f"(default: {field.default})" in help_text, field.name
    # the Python functions read their defaults from the same records
    assert inspect.signature(evaluate_run).parameters["settings"].default is None
    assert inspect.signature(load_run).parameters["settings"].default is None


def test_flags_set_the_records() -> None:
    evaluate, run = parse_settings("evaluate", [
        "r", "--method", "roulette", "--n-samples", "8", "--classify", "--scores", "s.csv",
        "--checkpoint", "last", "--device", "cpu",
    ])
    assert evaluate == EvaluateSettings(method="roulette", n_samples=8, classify=True,
                                        scores="s.csv")
    assert run == RunSettings(checkpoint="last", device="cpu")
    sample, _ = parse_settings("sample", ["r", "--covariates=-1,2.5", "--length", "none"])
    assert sample == SampleSettings(covariates=(-1.0, 2.5))


def test_cli_module_repeats_no_default() -> None:
    """Every default of cli.py's flags is argparse.SUPPRESS: the records hold the defaults."""
    tree = ast.parse(Path(iresflow.cli.__file__).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            assert not [k for k in node.keywords if k.arg == "default"], ast.unparse(node)


@pytest.mark.parametrize(
    ("argv", "record", "values", "message"),
    [
        (["evaluate", "{tmp}", "--n-samples", "0"], EvaluateSettings, {"n_samples": 0},
         "n_samples must be >= 1, got 0"),
        (["evaluate", "{tmp}", "--target-stderr", "0"], EvaluateSettings, {"target_stderr": 0.0},
         "target_stderr must be > 0, got 0.0"),
        (["evaluate", "{tmp}", "--scores", "x.txt"], EvaluateSettings, {"scores": "x.txt"},
         "scores must name a .csv or .npz file, got 'x.txt'"),
        (["evaluate", "{tmp}", "--nproc", "0"], EvaluateSettings, {"nproc": 0},
         "nproc must be >= 1, got 0"),
        (["sample", "{tmp}", "--length", "0"], SampleSettings, {"length": 0},
         "length must be >= 1, got 0"),
        (["sample", "{tmp}", "--label", "a", "--covariates", "1"], SampleSettings,
         {"label": "a", "covariates": (1.0,)}, "label and covariates exclude each other"),
        (["info", "{tmp}", "--seq-len", "0"], InfoSettings, {"seq_len": 0},
         "seq_len must be >= 1, got 0"),
        (["info", "{tmp}", "--device", "tpu"], RunSettings, {"device": "tpu"},
         "device must be cpu, cuda, cuda:N or auto, got 'tpu'"),
    ],
)
def test_a_bad_value_is_one_error_from_the_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], record: type,
    values: dict[str, Any], message: str,
) -> None:
    assert main([a.format(tmp=tmp_path) for a in argv]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"iresflow: error: {message}"
    with pytest.raises(ConfigError) as error:
        record(**values)
    assert str(error.value) == message


def test_one_model_build_and_one_data_load_per_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    counts = {"builds": 0, "loads": 0}
    build, load = SequenceFlow.__init__, factories.load_dataset

    def counted_build(self: SequenceFlow, *args: Any, **kwargs: Any) -> None:
        counts["builds"] += 1
        build(self, *args, **kwargs)

    def counted_load(*args: Any, **kwargs: Any) -> Any:
        counts["loads"] += 1
        return load(*args, **kwargs)

    monkeypatch.setattr(SequenceFlow, "__init__", counted_build)
    monkeypatch.setattr(factories, "load_dataset", counted_load)
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), *TINY]) == 0
    assert counts == {"builds": 3, "loads": 1}  # one per candidate (configured, recurrent, maf)
    trained = json.loads((out / "evaluation.json").read_text())["test"]["exact"]["nll"]
    for argv in (["evaluate", str(out), "--method", "auto"],
                 ["sample", str(out), "--num", "2", "--out", str(tmp_path / "s.npz")],
                 ["info", str(out)]):
        counts.update(builds=0, loads=0)
        assert main(argv) == 0
        assert counts == {"builds": 1, "loads": 1}, argv
    # the test NLL of train, on its own model and data, is that of the reloaded run
    assert evaluate_run(load_run(out), method="auto", save=False)["nll"] == trained
