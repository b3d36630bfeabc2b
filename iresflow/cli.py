"""The ``iresflow`` command: ``train``, ``evaluate``, ``sample``, ``forecast`` and ``info``.

Every setting is a flag, derived from the settings records: ``iresflow train`` from
:class:`~iresflow.train.config.TrainConfig` (``batch_size`` is ``--batch-size``; flags override
a ``--config`` TOML file), ``evaluate``, ``sample``, ``forecast`` and ``info`` from
:class:`~iresflow.runs.settings.EvaluateSettings`, :class:`~iresflow.runs.settings.SampleSettings`,
:class:`~iresflow.runs.settings.ForecastSettings`, :class:`~iresflow.runs.settings.InfoSettings`
and :class:`~iresflow.runs.settings.RunSettings`.
An absent flag leaves the record's default, and the record checks every value. User errors
(unknown dataset or option, missing run, unreadable checkpoint, incompatible settings) end the
command with one line ``iresflow: error: ...`` on stderr and a non-zero exit status. See
``docs/cli.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
import types
import typing
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from iresflow._settings import SettingsRecord
from iresflow.data.store import is_store
from iresflow.heap import keep_freed_memory
from iresflow.inverse.fixed_point import InversionError
from iresflow.runs.evaluate import evaluate
from iresflow.runs.figures import plot_forecast, plot_samples
from iresflow.runs.finish import train_and_evaluate
from iresflow.runs.forecast import forecast_run, save_forecast
from iresflow.runs.load import load_run
from iresflow.runs.reference import ReferenceWarning
from iresflow.runs.report import (
    describe_classification,
    describe_evaluation,
    describe_forecast,
    describe_run,
    describe_samples,
    describe_training,
)
from iresflow.runs.sample import sample_run, save_samples
from iresflow.runs.settings import (
    EvaluateSettings,
    ForecastSettings,
    InfoSettings,
    RunSettings,
    SampleSettings,
)
from iresflow.train.checkpoint import CheckpointError
from iresflow.train.config import USER_FILE_SUFFIXES, ConfigError, TrainConfig
from iresflow.train.distributed import lead_process
from iresflow.train.epoch import TrainingDivergedError
from iresflow.train.paths import RunPaths

__all__ = [
    "CLIError",
    "add_settings",
    "build_parser",
    "main",
    "parse_settings",
    "parse_train_config",
]

#: The settings records of a command's flags, beyond those of ``train``.
COMMAND_SETTINGS: dict[str, tuple[type[SettingsRecord], ...]] = {
    "evaluate": (EvaluateSettings, RunSettings),
    "sample": (SampleSettings, RunSettings),
    "forecast": (ForecastSettings, RunSettings),
    "info": (InfoSettings, RunSettings),
}


class CLIError(Exception):
    """A mistake in the command line, reported as one line without a traceback."""


class _UsageError(CLIError):
    """A malformed command line (exit status 2, like argparse)."""


class _Parser(argparse.ArgumentParser):
    """An argument parser that reports mistakes through :class:`CLIError`."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(f"{message} (see '{self.prog} --help')")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``iresflow`` command.

    Args:
        argv: Arguments without the program name (default: ``sys.argv[1:]``).

    Without a command it prints the help to stderr and returns 2 (a command is required).
    Every command first lets the process keep freed memory for reuse
    (:func:`~iresflow.heap.keep_freed_memory`).

    Returns:
        The exit status: 0 on success, 1 for an error, 2 for a malformed command line, 130
        when interrupted.

    Example:
        >>> main(["info", "no/such/run"])
        1
    """
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        parser.print_help(sys.stderr)
        return 2
    keep_freed_memory()
    formatted = warnings.formatwarning
    warnings.formatwarning = _format_warning
    try:
        args = parser.parse_args(argv)
        return args.handler(args)
    except _UsageError as error:
        print(f"iresflow: error: {error}", file=sys.stderr)
        return 2
    except (
        CLIError, ConfigError, CheckpointError, TrainingDivergedError, InversionError, OSError,
    ) as error:
        print(f"iresflow: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("iresflow: interrupted (a training run continues with --resume)", file=sys.stderr)
        return 130
    finally:
        warnings.formatwarning = formatted


def _format_warning(message: Warning | str, category: type[Warning], filename: str,
                    lineno: int, line: str | None = None) -> str:
    """A warning printed by a command: ``iresflow: warning: MESSAGE``, without the source line
    of the library that raised it."""
    return f"iresflow: warning: {message}\n"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``iresflow`` command and its subcommands."""
    parser = _Parser(
        prog="iresflow",
        description="Invertible residual flows on sequences: train, evaluate, sample, forecast, "
        "inspect.",
    )
    commands = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")
    _add_train(commands)
    evaluate_parser = commands.add_parser(
        "evaluate", help="NLL of a trained run on a split",
        description="Print the NLL of a split in the dataset's unit (with its standard error "
        "for the roulette estimator) and store it in RUN/evaluation.json.",
    )
    evaluate_parser.set_defaults(handler=_evaluate)
    sample_parser = commands.add_parser(
        "sample", help="draw sequences from a trained run",
        description="Draw sequences by inverting the flow, save them in original units to an "
        ".npz file (x, mask, lengths) and plot them next to it.",
    )
    sample_parser.set_defaults(handler=_sample)
    sample_parser.add_argument(
        "--out", type=Path, help="output .npz file (default: RUN/samples.npz)"
    )
    forecast_parser = commands.add_parser(
        "forecast", help="forecast the next frames with a causal run",
        description="Draw the next --horizon frames of sequences given their observed frames "
        "(runs trained with --causal): after the end of every sequence of --data, or in place "
        "of the last frames of every sequence of --split, scored against them (CRPS, energy "
        "score, interval coverage). Save the draws, their quantiles and the scores in original "
        "units to an .npz file and a fan chart per feature next to it.",
    )
    forecast_parser.set_defaults(handler=_forecast)
    forecast_parser.add_argument(
        "--out", type=Path, help="output .npz file (default: RUN/forecast.npz)"
    )
    info_parser = commands.add_parser(
        "info", help="settings, size and Lipschitz report of a run",
        description="Print a run's settings, its parameter count and the certified and observed "
        "Lipschitz constants of every residual branch.",
    )
    info_parser.set_defaults(handler=_info)
    for name, command in (("evaluate", evaluate_parser), ("sample", sample_parser),
                          ("forecast", forecast_parser), ("info", info_parser)):
        command.add_argument("run", type=Path, metavar="RUN", help="run folder written by train")
        records = COMMAND_SETTINGS[name]
        add_settings(command.add_argument_group("settings"), records[0].settings())
        add_settings(command.add_argument_group("run"), records[1].settings())
    return parser


def _add_train(commands: Any) -> None:
    """The ``train`` subcommand: its own arguments and one flag per setting of a run."""
    parser = commands.add_parser(
        "train", help="train a flow on a dataset",
        description="Train a residual sequence flow (residual blocks of the kinds in --layers: "
        "temporal convolutions and MLPs by default, attention on request); evaluate it on the "
        "test split and write plots at the end. Settings come from --config (TOML) and the "
        "flags below, which take precedence.",
    )
    parser.set_defaults(handler=_train)
    parser.add_argument("--config", type=Path, help="TOML file of settings")
    parser.add_argument("--out", type=Path, help="run folder (default: runs/DATASET-seedSEED)")
    parser.add_argument(
        "--resume", action="store_true", help="continue the run in --out from its last epoch"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an existing run in --out"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar or per-epoch lines")
    add_settings(parser.add_argument_group("settings (override --config)"), TrainConfig.settings())


def add_settings(group: Any, settings: list[tuple[Any, Any]]) -> None:
    """One ``--flag`` per setting (a dataclass field made with
    :func:`~iresflow._settings.setting`, with its type hint); absent flags leave it alone.

    Every help text is generated here, from the field's help, default and choices, with ``%``
    escaped for argparse's formatting.
    """
    for field, hint in settings:
        flag = "--" + field.name.replace("_", "-")
        options: dict[str, Any] = {"dest": field.name, "default": argparse.SUPPRESS}
        if hint is bool:
            options["action"] = argparse.BooleanOptionalAction
            default: Any = field.default
        else:
            options["type"], metavar = _parser_of(hint)
            if metavar is not None:
                options["metavar"] = metavar
            if isinstance(hint, types.UnionType):  # None means automatic; "none" on the line
                default = f"{field.metadata['unset']}; 'none' restores it"
            elif typing.get_origin(hint) is tuple:  # a list setting, "a,b,c" on the line
                default = ",".join(field.default)
            else:
                options["choices"], default = field.metadata["choices"], field.default
        help_text = f"{field.metadata['help']} (default: {default})"
        group.add_argument(flag, help=help_text.replace("%", "%%"), **options)


def _parser_of(hint: Any) -> tuple[Callable[[str], Any], str | None]:
    """The function reading a setting of type ``hint`` from the command line, and its metavar."""
    if isinstance(hint, types.UnionType):
        parse, metavar = _parser_of(
            next(arg for arg in typing.get_args(hint) if arg is not type(None))
        )
        return _optional(parse), metavar
    if typing.get_origin(hint) is tuple:
        item = typing.get_args(hint)[0]
        return _comma_list(item), "KIND[,KIND...]" if item is str else "V1,V2,..."
    return hint, None


def _comma_list(item: type) -> Callable[[str], tuple[Any, ...]]:
    def parse(text: str) -> tuple[Any, ...]:
        return tuple(item(part.strip()) for part in text.split(",") if part.strip())

    parse.__name__ = f"{item.__name__} list"  # argparse names the type in its error messages
    return parse


def _optional(base: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        return None if text.lower() == "none" else base(text)

    parse.__name__ = base.__name__
    return parse


def _record(cls: type[SettingsRecord], args: argparse.Namespace) -> Any:
    """The settings record of ``cls`` with the flags given on the command line."""
    return cls(**{f.name: getattr(args, f.name) for f, _ in cls.settings()
                  if hasattr(args, f.name)})


def parse_settings(command: str, argv: Sequence[str]) -> tuple[Any, ...]:
    """The settings records an ``iresflow evaluate``, ``sample``, ``forecast`` or ``info``
    command line describes, without running it.

    Args:
        command: ``"evaluate"``, ``"sample"``, ``"forecast"`` or ``"info"``.
        argv: The arguments after the command (the run folder first).

    Returns:
        The records of :data:`COMMAND_SETTINGS` for the command, in that order.

    Raises:
        CLIError: a malformed command line.
        ConfigError: an invalid setting.

    Example:
        >>> parse_settings("sample", ["runs/jv", "--num", "4"])[0].num
        4
    """
    args = build_parser().parse_args([command, *argv])
    return tuple(_record(cls, args) for cls in COMMAND_SETTINGS[command])


def parse_train_config(argv: Sequence[str]) -> TrainConfig:
    """The settings an ``iresflow train`` command line describes, without training.

    Args:
        argv: The arguments after ``iresflow train``.

    Returns:
        The :class:`TrainConfig` of ``--config`` (or of the run folder, with ``--resume``) with
        the flags applied.

    Raises:
        CLIError: a malformed command line.
        ConfigError: an unreadable file or an invalid setting.

    Example:
        >>> parse_train_config(["--n-blocks", "2", "--lr", "0.01"]).model.n_blocks
        2
    """
    return _train_config(build_parser().parse_args(["train", *argv]))


def _train_config(args: argparse.Namespace) -> TrainConfig:
    overrides = {
        field.name: getattr(args, field.name)
        for field, _ in TrainConfig.settings()
        if hasattr(args, field.name)
    }
    if args.resume:
        if args.out is None:
            raise CLIError("--resume needs --out RUN, the run folder to continue")
        if args.config is not None:
            raise CLIError("--resume takes the settings of the run; change them with flags")
        base = TrainConfig.from_toml(RunPaths(args.out).config, stored=True)
    else:
        base = TrainConfig.from_toml(args.config) if args.config is not None else TrainConfig()
        for name in ("data", "test_data"):  # a run must find its files from anywhere
            value = overrides.get(name, getattr(base, name))
            if value is not None and (value.lower().endswith(USER_FILE_SUFFIXES)
                                      or is_store(value)):
                overrides[name] = str(Path(value).expanduser().resolve())
    return TrainConfig.from_dict({**base.to_dict(), **overrides})


def _train(args: argparse.Namespace) -> int:
    config = _train_config(args)
    out = args.out
    if out is None:
        out = Path("runs") / f"{Path(config.data).name.split('.')[0]}-seed{config.seed}"
    with warnings.catch_warnings():  # printed with the evaluation
        warnings.simplefilter("ignore", ReferenceWarning)
        finished = train_and_evaluate(
            config, out, resume=args.resume, overwrite=args.overwrite, progress=not args.quiet
        )
    if lead_process():
        print(describe_training(finished.result, config.patience))
        print(describe_evaluation(finished.evaluation))
        for path in finished.plots:
            print(f"wrote {path}")
        print(f"run folder: {out}")
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    settings = _record(EvaluateSettings, args)
    with warnings.catch_warnings():  # printed with the evaluation
        warnings.simplefilter("ignore", ReferenceWarning)
        result = evaluate(args.run, settings, _record(RunSettings, args))
    if lead_process():
        print(describe_evaluation(result))
        if "classification" in result:
            print(describe_classification(result["classification"]))
        print(f"saved to {RunPaths(args.run).evaluation}")
        if settings.scores is not None:
            print(f"wrote {settings.scores}")
        for path in result.get("frame_scores", []):
            print(f"wrote {path}")
    return 0


def _sample(args: argparse.Namespace) -> int:
    settings = _record(SampleSettings, args)
    out = args.out if args.out is not None else args.run / "samples.npz"
    _check_output_file(out)  # before the model loads
    run = load_run(args.run, _record(RunSettings, args))
    samples = sample_run(run, settings)
    save_samples(samples, out, settings)
    figure = plot_samples(run, samples, out.with_suffix(".png"))
    print(describe_samples(run, samples))
    print(f"wrote {out} and {figure}")
    return 0


def _forecast(args: argparse.Namespace) -> int:
    settings = _record(ForecastSettings, args)
    out = args.out if args.out is not None else args.run / "forecast.npz"
    _check_output_file(out)  # before the model loads
    run = load_run(args.run, _record(RunSettings, args))
    forecast = forecast_run(run, settings)
    save_forecast(forecast, out)
    figure = plot_forecast(run, forecast, settings.plot_sequence, out.with_suffix(".png"))
    print(describe_forecast(run, forecast))
    print(f"wrote {out} and {figure}")
    return 0


def _check_output_file(out: Path) -> None:
    """Refuse an ``--out`` file that cannot be written: wrong suffix, a folder, no write access."""
    if out.suffix != ".npz":
        raise CLIError(f"--out must end in .npz, got {out}")
    if out.is_dir():
        raise CLIError(f"--out {out} is a folder, not a file")
    existing = next(parent for parent in out.parents if parent.exists())
    if not existing.is_dir():
        raise CLIError(f"cannot write --out {out}: {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK) or (
        out.exists() and not os.access(out, os.W_OK)
    ):
        raise CLIError(f"cannot write --out {out}: permission denied")


def _info(args: argparse.Namespace) -> int:
    settings = _record(InfoSettings, args)  # checked before the model loads
    run = load_run(args.run, _record(RunSettings, args))
    print(describe_run(run, settings))
    return 0
