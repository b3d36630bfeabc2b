"""The ``iresflow`` command: ``train``, ``evaluate``, ``sample`` and ``info``.

Every setting of :class:`~iresflow.train.config.TrainConfig` is a flag of ``iresflow train``
(``batch_size`` is ``--batch-size``); flags override a ``--config`` TOML file. User errors
(unknown dataset or option, missing run, unreadable checkpoint, incompatible settings) end the
command with one line ``iresflow: error: ...`` on stderr and a non-zero exit status. See
``docs/cli.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch

from iresflow.data.store import is_store
from iresflow.inverse.fixed_point import InversionError
from iresflow.train.checkpoint import CheckpointError
from iresflow.train.config import USER_FILE_SUFFIXES, ConfigError, TrainConfig
from iresflow.train.distributed import current_world, run_rank, spawn, torchrun_launch
from iresflow.train.epoch import TrainingDivergedError
from iresflow.train.evaluate import (
    LoadedRun,
    evaluate_run,
    load_run,
    plotted_test_sequences,
    sample_run,
    write_plots,
)
from iresflow.train.factories import resolve_device
from iresflow.train.loop import train
from iresflow.train.metrics import SCORE_SUFFIXES
from iresflow.train.paths import RunPaths
from iresflow.train.plots import PlotLabels, plot_traces

__all__ = ["CLIError", "build_parser", "main", "parse_train_config"]

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


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``iresflow`` command and its subcommands."""
    parser = _Parser(
        prog="iresflow",
        description="Invertible residual flows on sequences: train, evaluate, sample, inspect.",
    )
    commands = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")

    train_parser = commands.add_parser(
        "train", help="train a flow on a dataset",
        description="Train a residual-flow Transformer; evaluate it on the test split and "
        "write plots at the end. Settings come from --config (TOML) and the flags below, "
        "which take precedence.",
    )
    train_parser.set_defaults(handler=_train)
    train_parser.add_argument("--config", type=Path, help="TOML file of settings")
    train_parser.add_argument(
        "--out", type=Path, help="run folder (default: runs/DATASET-seedSEED)"
    )
    train_parser.add_argument(
        "--resume", action="store_true", help="continue the run in --out from its last epoch"
    )
    train_parser.add_argument(
        "--overwrite", action="store_true", help="replace an existing run in --out"
    )
    train_parser.add_argument(
        "--quiet", action="store_true", help="no progress bar or per-epoch lines"
    )
    settings = train_parser.add_argument_group("settings (override --config)")
    for field, hint in TrainConfig.settings():
        _add_setting(settings, field, hint)

    evaluate_parser = commands.add_parser(
        "evaluate", help="NLL of a trained run on a split",
        description="Print the NLL of a split in the dataset's unit (with its standard error "
        "for the roulette estimator) and store it in RUN/evaluation.json.",
    )
    evaluate_parser.set_defaults(handler=_evaluate)
    _add_run_arguments(evaluate_parser)
    evaluate_parser.add_argument("--split", choices=("test", "val", "train"), default="test")
    evaluate_parser.add_argument(
        "--method", choices=("exact", "roulette", "auto"), default="exact",
        help="log-determinant: exact, unbiased Russian-roulette estimates, or auto (exact when "
        "affordable, else enough roulette estimates for a standard error below 0.01; what "
        "train reports at its end) (default: exact)",
    )
    evaluate_parser.add_argument(
        "--n-samples", type=_positive_int, default=4,
        help="roulette estimates per sequence (>= 2 gives a standard error; default: 4)",
    )
    evaluate_parser.add_argument("--seed", type=int, default=0, help="seed of the estimates")
    evaluate_parser.add_argument(
        "--scores", type=Path, metavar="FILE",
        help="also write per-sequence scores, one row per sequence in the split's order (index, "
        "length, log_prob in nats and nll in the dataset's unit, label; with --classify the "
        "predicted label and the log-likelihood of every class) to this .csv or .npz file",
    )
    evaluate_parser.add_argument(
        "--classify", action="store_true",
        help="label-conditional runs: classify every sequence by Bayes' rule, argmax_k log "
        "p(x | y=k) + log pi_k with pi the class frequencies of the training split, and report "
        "the accuracy and the confusion matrix",
    )
    evaluate_parser.add_argument(
        "--nproc", type=_positive_int, default=1,
        help="processes sharing the split (gloo on the CPU, nccl with one GPU each; under "
        "torchrun the launch decides; default: 1)",
    )

    sample_parser = commands.add_parser(
        "sample", help="draw sequences from a trained run",
        description="Draw sequences by inverting the flow, save them in original units to an "
        ".npz file (x, mask, lengths) and plot them next to it.",
    )
    sample_parser.set_defaults(handler=_sample)
    _add_run_arguments(sample_parser)
    sample_parser.add_argument(
        "--num", type=_positive_int, default=16, help="sequences (default: 16)"
    )
    sample_parser.add_argument(
        "--length", type=_positive_int,
        help="length of every sequence (default: drawn from the training lengths)",
    )
    sample_parser.add_argument("--seed", type=int, default=0, help="seed (default: 0)")
    sample_parser.add_argument(
        "--label", metavar="NAME",
        help="class of every sample (runs trained with --condition label; one of the dataset's "
        "class names)",
    )
    sample_parser.add_argument(
        "--covariates", type=_float_list, metavar="V1,V2,...",
        help="covariates of every sample, one value per covariate (runs trained with "
        "--condition covariates; write --covariates=-1,2 for a leading minus sign)",
    )
    sample_parser.add_argument(
        "--out", type=Path, help="output .npz file (default: RUN/samples.npz)"
    )

    info_parser = commands.add_parser(
        "info", help="settings, size and Lipschitz report of a run",
        description="Print a run's settings, its parameter count and the certified and observed "
        "Lipschitz constants of every residual branch.",
    )
    info_parser.set_defaults(handler=_info)
    _add_run_arguments(info_parser)
    info_parser.add_argument(
        "--seq-len", type=_positive_int,
        help="sequence length of the Lipschitz report (default: the data's longest)",
    )
    return parser


def _add_setting(group: Any, field: dataclasses.Field, hint: Any) -> None:
    """A ``--flag`` for one :class:`TrainConfig` setting; absent flags leave it alone."""
    flag = "--" + field.name.replace("_", "-")
    options: dict[str, Any] = {"dest": field.name, "default": argparse.SUPPRESS}
    if hint is bool:
        group.add_argument(
            flag, action=argparse.BooleanOptionalAction,
            help=f"{field.metadata['help']} (default: {field.default})", **options,
        )
        return
    choices = field.metadata["choices"]
    if isinstance(hint, types.UnionType):  # None means automatic; spelled "none" on the line
        parse: Any = _optional(next(a for a in typing.get_args(hint) if a is not type(None)))
        default = f"{field.metadata['unset']}; 'none' restores it"
    elif typing.get_origin(hint) is tuple:  # a list setting, spelled "a,b,c" on the line
        parse, default, choices = _comma_list, ",".join(field.default), None
        options["metavar"] = "KIND[,KIND...]"
    else:
        parse, default = hint, field.default
    group.add_argument(
        flag, type=parse, choices=choices,
        help=f"{field.metadata['help']} (default: {default})", **options,
    )


def _comma_list(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())


def _optional(base: type) -> Any:
    def parse(text: str) -> Any:
        return None if text.lower() == "none" else base(text)

    parse.__name__ = base.__name__  # argparse names the type in its error messages
    return parse


def _float_list(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(item) for item in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", type=Path, metavar="RUN", help="run folder written by train")
    parser.add_argument(
        "--checkpoint", choices=("best", "last"), default="best",
        help="which checkpoint to use (default: best)",
    )
    parser.add_argument("--device", help="cpu, cuda, cuda:N or auto (default: the run's)")


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
        base = TrainConfig.from_toml(RunPaths(args.out).config)
    else:
        base = TrainConfig.from_toml(args.config) if args.config is not None else TrainConfig()
        for name in ("data", "test_data"):  # a run must find its files from anywhere
            value = overrides.get(name, getattr(base, name))
            if value is not None and (value.lower().endswith(USER_FILE_SUFFIXES)
                                      or is_store(value)):
                overrides[name] = str(Path(value).expanduser().resolve())
    launch = torchrun_launch()
    if launch is not None and "nproc" not in overrides:  # under torchrun the launch decides
        overrides["nproc"] = launch.world_size
    return base.replace(**overrides)


def _train(args: argparse.Namespace) -> int:
    config = _train_config(args)
    out = args.out
    if out is None:
        name = Path(config.data).name.split(".")[0]
        out = Path("runs") / f"{name}-seed{config.seed}"
    launch = torchrun_launch()
    if launch is not None and launch.world_size > 1:  # training and test NLL on every rank
        return run_rank(
            launch, resolve_device(config.device).type, _train_and_evaluate, config, out, args
        )
    return _train_and_evaluate(config, out, args)


def _train_and_evaluate(config: TrainConfig, out: Path, args: argparse.Namespace) -> int:
    """Train, then the test NLL (shared by the ranks of a torchrun launch) and the figures."""
    result = train(
        config, out, resume=args.resume, overwrite=args.overwrite, progress=not args.quiet
    )
    main = current_world().main
    _say(
        main,
        f"trained {result.epochs} epochs ({'stopped early' if result.stopped_early else 'done'}); "
        f"best validation NLL {result.best_val_nll:.4f} at epoch {result.best_epoch}",
    )
    run = load_run(out, device=_rank_device(config.device))
    evaluation = evaluate_run(
        run, split="test", method="auto", n_samples=config.eval_n_samples, seed=config.seed
    )
    _say(main, _describe_evaluation(evaluation))
    if main:
        for path in write_plots(run, seed=config.seed):
            print(f"wrote {path}")
    _say(main, f"run folder: {out}")
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    if args.scores is not None and args.scores.suffix not in SCORE_SUFFIXES:
        raise CLIError(f"--scores must end in .csv or .npz, got {args.scores}")
    launch = torchrun_launch()
    if args.nproc == 1 and (launch is None or launch.world_size == 1):
        return _evaluate_run(args)
    paths = RunPaths(args.run)
    if not paths.config.is_file():
        raise CLIError(f"{args.run} is not a run folder (no config.toml)")
    name = args.device if args.device is not None else TrainConfig.from_toml(paths.config).device
    device_type = resolve_device(name).type
    if launch is not None:
        if args.nproc != 1:
            raise CLIError("under torchrun the launch sets the processes; drop --nproc")
        return run_rank(launch, device_type, _evaluate_run, args)
    return spawn(_evaluate_run, args.nproc, device_type, args)


def _evaluate_run(args: argparse.Namespace) -> int:
    """``iresflow evaluate`` on one rank (or the only process); rank 0 reports and saves."""
    run = load_run(args.run, checkpoint=args.checkpoint, device=_rank_device(args.device))
    if args.classify and run.config.condition != "label":
        raise CLIError(
            f"--classify needs a run trained with --condition label; {args.run} has condition "
            f"{run.config.condition}"
        )
    result = evaluate_run(
        run, split=args.split, method=args.method, n_samples=args.n_samples, seed=args.seed,
        scores=args.scores, classify=args.classify,
    )
    main = current_world().main
    _say(main, _describe_evaluation(result))
    if "classification" in result:
        _say(main, _describe_classification(result["classification"]))
    _say(main, f"saved to {run.paths.evaluation}")
    if args.scores is not None:
        _say(main, f"wrote {args.scores}")
    return 0


def _rank_device(name: str | None) -> str | None:
    """The device setting ``name``, pinned to this rank's GPU in a CUDA process group."""
    if name is None or current_world().size == 1 or resolve_device(name).type != "cuda":
        return name
    return f"cuda:{torch.cuda.current_device()}"


def _say(main: bool, line: str) -> None:
    """Print ``line`` on rank 0 only."""
    if main:
        print(line)


def _sample(args: argparse.Namespace) -> int:
    out = args.out if args.out is not None else args.run / "samples.npz"
    _check_output_file(out)  # before the model loads
    run = load_run(args.run, checkpoint=args.checkpoint, device=args.device)
    if args.length is not None and args.length > run.model.max_len:
        raise CLIError(f"--length must be <= {run.model.max_len} for this model, got {args.length}")
    context, recorded = _sample_context(run, args)
    samples = sample_run(run, args.num, length=args.length, seed=args.seed, context=context)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(
        out, x=samples.x.numpy(), mask=samples.mask.numpy(), lengths=samples.lengths.numpy(),
        **recorded,
    )
    real, mask = plotted_test_sequences(run)
    if args.label is not None:  # the real sequences of the sampled class, when there are some
        same = run.dataset.test.labels[: len(real)] == samples.context[0]
        real, mask = (real[same], mask[same]) if bool(same.any()) else (real, mask)
    figure = plot_traces(
        real, mask, samples.x, samples.mask, out.with_suffix(".png"),
        labels=PlotLabels.for_dataset(run.dataset.name),
    )
    diagnostics = samples.diagnostics
    print(
        f"sampled {args.num} sequences of lengths {int(samples.lengths.min())}.."
        f"{int(samples.lengths.max())} ({run.checkpoint} checkpoint, epoch {run.epoch})"
    )
    verdict = "converged" if diagnostics["converged"] else "NOT converged: residual above tolerance"
    print(
        f"inverse: at most {diagnostics['max_iterations']} iterations per block; worst residual "
        f"{diagnostics['residual']:.2e} against its tolerance {diagnostics['tolerance']:.2e}: "
        f"{verdict}"
    )
    print(f"wrote {out} and {figure}")
    return 0


def _sample_context(
    run: LoadedRun, args: argparse.Namespace
) -> tuple[torch.Tensor | None, dict[str, np.ndarray]]:
    """The context of ``sample --label`` / ``--covariates`` for every sample, ``(num,)`` or
    ``(num, C)``, and the arrays recording it in the samples file."""
    condition = run.config.condition
    given = [flag for flag, value in (("--label", args.label), ("--covariates", args.covariates))
             if value is not None]
    needed = {"label": "--label", "covariates": "--covariates"}.get(condition)
    if needed is None:
        if given:
            raise CLIError(f"{given[0]} needs a conditional run; {args.run} is unconditional")
        return None, {}
    if given != [needed]:
        choice = (f"one of the classes {', '.join(run.dataset.classes or ())}"
                  if condition == "label" else f"{run.model.config.context_features} values")
        raise CLIError(
            f"{args.run} is conditioned on {'class labels' if condition == 'label' else condition}"
            f": sample it with {needed} ({choice})"
            + (f", not {given[0]}" if given and given[0] != needed else "")
        )
    if condition == "label":
        classes = run.dataset.classes or ()
        if args.label not in classes:
            raise CLIError(f"--label must be one of {', '.join(classes)}, got {args.label!r}")
        label = classes.index(args.label)
        return torch.full((args.num,), label, dtype=torch.int64), {
            "label": np.array(args.label), "labels": np.full(args.num, label)
        }
    width = run.model.config.context_features
    if len(args.covariates) != width:
        raise CLIError(
            f"--covariates must have {width} values for this run, got {len(args.covariates)}"
        )
    values = torch.tensor(args.covariates, dtype=torch.float32)
    return values.expand(args.num, width), {"covariates": values.numpy()}


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
    run = load_run(args.run, checkpoint=args.checkpoint, device=args.device)
    seq_len = args.seq_len if args.seq_len is not None else run.dataset.max_len
    if seq_len > run.model.max_len:
        raise CLIError(f"--seq-len must be <= {run.model.max_len} for this model, got {seq_len}")
    parameters = sum(p.numel() for p in run.model.parameters())
    print(f"run: {run.paths.root}")
    print(f"data: {run.dataset.name} ({run.dataset.features} features, up to "
          f"{run.dataset.max_len} frames, NLL in {run.dataset.unit})")
    print(f"checkpoint: {run.checkpoint}, epoch {run.epoch}")
    if run.config.condition == "label":
        classes = run.dataset.classes or ()
        print(f"condition: label ({len(classes)} classes: {', '.join(classes)}; embedding of "
              f"size {run.model.config.resolved_context_features})")
    elif run.config.condition == "covariates":
        print(f"condition: covariates ({run.model.config.context_features} per sequence)")
    if run.history:
        best = min(run.history, key=lambda row: row["val_nll"])
        print(f"best validation NLL: {best['val_nll']:.4f} (epoch {best['epoch']:.0f})")
    print(f"parameters: {parameters:,}")
    print("\nsettings:")
    print(run.config.to_toml().rstrip())
    generator = torch.Generator(next(run.model.parameters()).device).manual_seed(0)
    report = run.model.lipschitz_report(seq_len, generator=generator)
    print(
        "guarantees: re-checked at load: every parameter finite, every certified Lipschitz "
        "constant below 1 (weights are re-normalised in every forward pass)"
    )
    print(f"\nLipschitz constants of the residual branches (sequence length {seq_len}):")
    print(f"{'branch':<24}{'type':<36}{'norm':>5}{'certified':>11}{'observed':>10}")
    for row in report:
        print(
            f"{row['name']:<24}{row['type']:<36}{row['norm']:>5}"
            f"{row['certified']:>11.4f}{row['estimate']:>10.4f}"
        )
    return 0


def _describe_evaluation(result: dict[str, Any]) -> str:
    text = f"{result['split']} NLL: {result['nll']:.4f}"
    if "stderr" in result:
        text += f" ± {result['stderr']:.4f} (standard error)"
    details = result.get("choice", result["method"])
    if "n_samples" in result and "choice" not in result:
        details += f", {result['n_samples']} estimates per sequence"
    return (
        f"{text} {result['unit']} ({details}; {result['sequences']} sequences, "
        f"{result['checkpoint']} checkpoint of epoch {result['epoch']})"
    )


def _describe_classification(classification: dict[str, Any]) -> str:
    """Accuracy and the confusion matrix (rows true, columns predicted) as lines of text."""
    classes, corner = classification["classes"], "true/predicted"
    width = max(len(corner), *(len(name) for name in classes))
    columns = max(5, *(len(name) + 1 for name in classes))
    lines = [
        f"accuracy (Bayes' rule, training class frequencies as prior): "
        f"{classification['accuracy']:.4f}",
        "confusion matrix (rows: true class, columns: predicted class):",
        f"{corner:<{width}}" + "".join(f"{name:>{columns}}" for name in classes),
    ]
    for name, row in zip(classes, classification["confusion"], strict=True):
        lines.append(f"{name:<{width}}" + "".join(f"{count:>{columns}}" for count in row))
    return "\n".join(lines)
