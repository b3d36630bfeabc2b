"""The benchmarks' one command line: ``python -m benchmarks <name> [options]``.

Every benchmark is a module of this package with a docstring (its help), an
``add_arguments(parser)`` and a ``run(args)``; :data:`COMMANDS` lists them. The options they
share are defined once here: seeds, datasets, threads, training budgets, ``--set`` overrides of
``iresflow train`` settings, and the records options (``--out``, ``--merge``, ``--table-from``,
``--doc``) of :mod:`benchmarks.records`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import records
from iresflow.heap import keep_freed_memory

#: The subcommands, in the order of ``python -m benchmarks --help``.
COMMANDS = (
    "results", "small_data", "held_out", "forecast", "sampling", "recipes", "long_range",
    "order", "conditional", "robustness", "gaussian_baseline", "scaling", "length_scaling",
    "compiled", "larger_than_memory", "attention", "inverse", "residual_mlp", "train_epoch",
    "quantised", "initial",
)
ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out"


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m benchmarks``: one subparser per module of :data:`COMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Benchmarks of iresflow, each a user of its public API.")
    commands = parser.add_subparsers(dest="name", required=True, metavar="NAME")
    for name in COMMANDS:
        module = importlib.import_module(f"benchmarks.{name}")
        doc = module.__doc__ or name
        sub = commands.add_parser(name, help=doc.split("\n")[0], description=doc,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(sub)
        sub.set_defaults(benchmark=module.run)
    return parser


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """The options of ``python -m benchmarks ARGV``; ``command_line`` is that command."""
    args = build_parser().parse_args(argv)
    args.command_line = "python -m benchmarks " + " ".join(argv)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv``, check the ``--doc`` pages, run the benchmark; its exit status."""
    args = parse(list(sys.argv[1:] if argv is None else argv))
    keep_freed_memory()  # as the iresflow command does
    for page in getattr(args, "doc", None) or []:  # fail before the runs, not after
        records.write_blocks(page, dict.fromkeys(args.blocks, ""), check_only=True)
    if getattr(args, "threads", None) is not None:
        import torch

        torch.set_num_threads(args.threads)
    status = args.benchmark(args)
    return status if isinstance(status, int) else 0


# ------------------------------------------------------------------------------------------------
# shared options


def optional_int(text: str) -> int | None:
    """An integer, or ``None`` for ``none`` (all of something)."""
    return None if text.lower() == "none" else int(text)


def setting(text: str) -> tuple[str, Any]:
    """``KEY=VALUE``, the value read as JSON where it parses, else as text.

    Example:
        >>> setting("warmup=0"), setting("base=multivariate-t")
        (('warmup', 0), ('base', 'multivariate-t'))
    """
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--set takes KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def add_runs(parser: argparse.ArgumentParser) -> None:
    """``--runs DIR``: keep the flow's trained run folders (``args.runs``; ``None``: a temporary
    folder, removed at the end)."""
    parser.add_argument("--runs", type=Path, default=None, metavar="DIR",
                        help="keep the flow's run folders here, as NAME-seedSEED, to be "
                        "evaluated or forecast again without training (default: a temporary "
                        "folder, removed at the end)")


def add_threads(parser: argparse.ArgumentParser, default: int = 1) -> None:
    """``--threads N``: torch CPU threads, set by :func:`main` before the run."""
    parser.add_argument("--threads", type=int, default=default,
                        help="torch CPU threads (default: %(default)s)")


def add_quick(parser: argparse.ArgumentParser, what: str) -> None:
    """``--quick``: a smoke run, ``what`` saying what it shrinks."""
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {what}")


def add_seeds(parser: argparse.ArgumentParser, default: int | None = 1, first: bool = True
              ) -> None:
    """``--seeds S`` (how many) and, with ``first``, ``--first-seed F``: seeds F..F+S-1."""
    parser.add_argument("--seeds", type=int, default=default, metavar="S",
                        help="number of seeds (default: %(default)s)")
    if first:
        parser.add_argument("--first-seed", type=int, default=0, metavar="F",
                            help="first seed (default: 0), to run seeds in separate processes")


def seeds(args: argparse.Namespace) -> range:
    """The seeds of ``--seeds`` and ``--first-seed``."""
    if args.seeds < 1 or args.first_seed < 0:
        raise SystemExit("--seeds must be >= 1 and --first-seed >= 0")
    return range(args.first_seed, args.first_seed + args.seeds)


def add_datasets(parser: argparse.ArgumentParser, choices: Sequence[str],
                 default: Sequence[str] | None = None) -> None:
    """``--datasets NAME ...`` among ``choices`` (default: ``default``, else all)."""
    parser.add_argument("--datasets", nargs="+", choices=list(choices), metavar="NAME",
                        default=list(choices if default is None else default),
                        help=f"datasets among {', '.join(choices)} (default: %(default)s)")


def add_settings(parser: argparse.ArgumentParser, **budgets: int | None) -> None:
    """``--set KEY=VALUE ...``: settings of ``iresflow train`` that differ from its defaults,
    and a flag for each of ``budgets`` (``epochs``, ``max_train``, ``max_eval``: their
    defaults) (:func:`settings`)."""
    parser.add_argument("--set", nargs="+", action="extend", type=setting, default=[],
                        metavar="KEY=VALUE",
                        help="settings of iresflow train that differ from the defaults, e.g. "
                        "warmup=0 base=multivariate-t (values read as JSON where they parse)")
    helps = {"epochs": "epochs per run", "max_train": "training sequences per run",
             "max_eval": "validation and test sequences per run"}
    for name, default in budgets.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=optional_int, default=default,
                            help=f"{helps[name]} ('none': iresflow train's default, or all; "
                            "default: %(default)s)")


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The flat ``iresflow train`` settings of :func:`add_settings` (``None`` left out)."""
    chosen = {k: getattr(args, k, None) for k in ("epochs", "max_train", "max_eval")}
    return {k: v for k, v in chosen.items() if v is not None} | dict(args.set)


def add_records(parser: argparse.ArgumentParser, name: str, blocks: Sequence[str] = ()
                ) -> None:
    """The records options (:mod:`benchmarks.records`) of a benchmark that writes some.

    Args:
        parser: The benchmark's parser.
        name: Stem of the default ``--out`` (``benchmarks/out/NAME.json``).
        blocks: The blocks it writes into ``--doc`` pages, between their markers; a benchmark
            without any has only ``--out`` (no ``--doc``, ``--table-from``, ``--merge``).
    """
    parser.add_argument("--out", type=Path, default=OUT / f"{name}.json",
                        help="JSON records of the run (default: %(default)s)")
    parser.set_defaults(blocks=tuple(blocks), doc=[], merge=False, table_from=None)
    if not blocks:
        return
    parser.add_argument("--merge", action="store_true",
                        help="keep the records already in --out; this run's replace theirs")
    parser.add_argument("--table-from", type=Path, nargs="+", metavar="JSON",
                        help="run nothing: the tables of earlier --out files, merged (the "
                        "first file with a field gives it)")
    parser.add_argument("--doc", type=Path, nargs="+", default=[], metavar="PAGE",
                        help="also write the tables into these pages, between their markers "
                        f"({', '.join(records.markers(blocks[0]))})")


def stored(args: argparse.Namespace, settings: dict[str, Any]) -> dict[str, Any] | None:
    """With ``--merge``, the file of ``--out`` (checked before the runs), else ``None``.

    Raises:
        SystemExit: the stored records were made with other ``settings``.
    """
    if not args.merge or not args.out.exists():
        return None
    content = records.load(args.out)
    if content["settings"] != records.json_safe(settings):
        raise SystemExit(f"{args.out} has the settings {content['settings']}, not "
                         f"{records.json_safe(settings)}: run without --merge")
    return content


def save(args: argparse.Namespace, rows: list[dict[str, Any]], key: Sequence[str],
         settings: dict[str, Any], earlier: dict[str, Any] | None = None, **extra: Any
         ) -> tuple[list[dict[str, Any]], list[str]]:
    """Write this run's records to ``--out``, merged with ``earlier`` (:func:`stored`).

    Returns:
        The records written and the commands that produced them.
    """
    commands = [args.command_line]
    if earlier is not None:
        rows = records.merge_records([rows, earlier["records"]], key)
        commands = [*earlier["commands"], *commands]
    records.save(args.out, rows, commands, settings, **extra)
    return rows, commands


def table_from(args: argparse.Namespace, key: Sequence[str]) -> dict[str, Any]:
    """The files of ``--table-from`` as one: records merged by ``key``, commands joined, the
    settings and other fields of the first."""
    files = [records.load(path) for path in args.table_from]
    return {**files[0], "records": records.merge_records([f["records"] for f in files], key),
            "commands": [c for f in files for c in f["commands"]]}


def publish(args: argparse.Namespace, blocks: dict[str, str]) -> None:
    """Write ``blocks`` into every ``--doc`` page."""
    for page in args.doc:
        records.write_blocks(page, blocks)
        print(f"wrote {', '.join(blocks)} into {page}")
