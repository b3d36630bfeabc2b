r"""Initial models against the closed-form reference: where training starts, on validation.

For every dataset of the small-data suite and every held-out set, read as a user would read it,
each candidate of the default's model selection (:func:`iresflow.train.selection.candidates`)
is built and initialised exactly as ``iresflow train`` does before its first optimiser step
(:func:`~iresflow.train.factories.build_model` under the run's seed, then
:meth:`~iresflow.train.epoch.TrainingSession.initialize_flow`: ActNorm and the least-squares
fit of the autoregressive layer on the leading training sequences), and validated as every
epoch is (:meth:`~iresflow.train.epoch.TrainingSession.validate`). Beside it, the validation
NLL of the closed-form AR(p) Gaussian that every evaluation reports
(:func:`iresflow.runs.reference.fit_reference`: fitted on the training split, its order chosen
on the validation split). A candidate whose initial model is above the reference starts
training from a density worse than a least-squares fit. Nothing is trained. Run from the
repository root::

    python -m benchmarks initial --out docs/initial_models.json --doc docs/small_data.md
"""

from __future__ import annotations

import argparse
import warnings
from typing import Any

import torch

from benchmarks import cli, records
from benchmarks.held_out import HELD_OUT
from benchmarks.small_data import DATASETS, data_settings, load
from iresflow.runs.reference import fit_reference
from iresflow.train.config import TrainConfig
from iresflow.train.distributed import World
from iresflow.train.epoch import TrainingSession
from iresflow.train.factories import build_model
from iresflow.train.fit import seeded_training
from iresflow.train.selection import candidates

#: The fields that identify a record.
KEY = ("dataset", "seed")
#: The candidates in the table's order.
CANDIDATES = ("configured", "recurrent", "maf")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cli.add_datasets(parser, list(DATASETS) + list(HELD_OUT))
    cli.add_seeds(parser)
    cli.add_threads(parser)
    cli.add_records(parser, "initial", blocks=("initial-models",))


def initial_models(name: str, seed: int) -> dict[str, Any]:
    """The record of one dataset and seed: the reference's and every candidate's initial
    validation NLL (the dataset's unit)."""
    device = torch.device("cpu")
    dataset = load(name, seed)
    config = TrainConfig.from_dict({**data_settings(name), "seed": seed, "device": "cpu"})
    reference = fit_reference(dataset, "val")
    initial = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # identity sub-models of the AR fit
        for label, candidate in candidates(config, dataset.features):
            with seeded_training(candidate.seed, device):
                session = TrainingSession(candidate, dataset, build_model(candidate, dataset),
                                          device, World(0, 1))
                if session.flow is not None:
                    session.initialize_flow(session.flow)
                initial[label] = session.validate()["val_nll"]
    return {"dataset": name, "seed": seed, "unit": dataset.unit,
            "reference": {"model": reference["model"], "val_nll": reference["val_nll"]},
            "initial": initial}


def _cells(row: dict[str, Any]) -> list[str]:
    """The table's cells of one record: the reference's validation NLL and every candidate's
    initial one with its difference to the reference (positive: above it)."""
    ref = row["reference"]["val_nll"]
    initial = [f"{row['initial'][c]:.4f} ({row['initial'][c] - ref:+.4f})"
               if c in row["initial"] else "—" for c in CANDIDATES]
    return [row["dataset"], str(row["seed"]), row["unit"],
            f"{row['reference']['model']} {ref:.4f}", *initial]


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """One row per dataset and seed (:func:`_cells`), and how many initial models are above
    the reference."""
    body = [_cells(row) for row in rows]
    above = sum(value > row["reference"]["val_nll"]
                for row in rows for value in row["initial"].values())
    count = sum(len(row["initial"]) for row in rows)
    table = records.markdown_table(
        ["dataset", "seed", "unit", "AR(p) reference", *CANDIDATES], body)
    return f"{table}\n\nInitial models above the reference: {above} of {count}."


def run(args: argparse.Namespace) -> int:
    if args.table_from is not None:
        rows = cli.table_from(args, KEY)["records"]
    else:
        earlier = cli.stored(args, {})
        rows = []
        for name in args.datasets:
            for seed in cli.seeds(args):
                rows.append(initial_models(name, seed))
                print(" | ".join(_cells(rows[-1])), flush=True)
        rows, _ = cli.save(args, rows, KEY, {}, earlier)
    table = markdown_table(rows)
    print(table)
    cli.publish(args, {"initial-models": table})
    return 0
