r"""Which datasets hold quantised features, and what a flow trained on them learns.

For every dataset of the small-data suite given as a file and every held-out set, read as a user
would read it but with ``dequantize = "off"`` (the values as read), every feature that repeats
(:func:`~iresflow.data.quantization.repeats`: at most
:data:`~iresflow.data.quantization.MAX_LEVEL_FRACTION` times as many distinct values as frames
in the training split, a frame counted once however many overlapping windows hold it) is listed
with its distinct values, its values, the fraction of consecutive frames that repeat the
previous frame's value exactly, and the grid step that
:func:`~iresflow.data.quantization.grid_step` finds (what ``dequantize = "auto"``, the default,
dequantises with; "none": the levels lie on no regular grid and are left as read).

With ``--run NAME=FOLDER`` (a trained run), the largest modulus of the roots of the top
sub-model of every autoregressive step of the run's flow
(:class:`~iresflow.transforms.temporal.AutoregressiveLinear`): the largest eigenvalue modulus of
its companion matrix, 1 for a unit root (a random walk's "same as before"), below 1 for a
process that returns to its mean. Run from the repository root::

    python -m benchmarks quantised
    python -m benchmarks quantised --run pickup=runs/pickup --datasets PickupGestureWiimoteZ
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import torch
from torch import Tensor

from benchmarks import cli
from benchmarks.held_out import HELD_OUT
from benchmarks.small_data import DATASETS, SHIPPED, data_settings
from iresflow.data.quantization import grid_step, repeats
from iresflow.data.user_files import user_file_kind
from iresflow.runs.load import load_run
from iresflow.train.config import TrainConfig
from iresflow.train.factories import load_data
from iresflow.transforms.temporal import AutoregressiveLinear


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cli.add_datasets(parser, [name for name in DATASETS if name not in SHIPPED] + list(HELD_OUT))
    parser.add_argument("--run", nargs="+", default=[], metavar="NAME=FOLDER",
                        help="trained runs whose autoregressive steps' roots to print")


def repeating_features(name: str) -> list[str]:
    """One line per feature of ``name``'s training split whose values repeat."""
    config = TrainConfig.from_dict({**data_settings(name), "dequantize": "off"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dataset = load_data(config)
    copies = config.table.overlap + 1 if user_file_kind(config.data) == "table" else 1
    train = dataset.train
    raw = dataset.to_raw(train.x.double(), train.mask) if dataset.preprocessing else train.x
    pairs = train.mask[:, 1:] & train.mask[:, :-1]
    lines = []
    for d in range(dataset.features):
        values = raw[..., d][train.mask]
        if not repeats(values, copies):
            continue
        same = ((raw[:, 1:, d] == raw[:, :-1, d]) & pairs).sum() / pairs.sum()
        step = grid_step(values, copies)
        lines.append(f"{name:<24}{d:>8}{len(values.unique()):>8}{values.numel():>9}"
                     f"{float(same):>10.3f}"
                     f"{'none' if step is None else f'{step:.4g}':>10}")
    return lines


def largest_root(layer: AutoregressiveLinear) -> float:
    """Largest root modulus of the layer's top sub-model (its companion matrix's)."""
    lags: Tensor = layer.lag_weights.detach()[layer.order, : layer.order].double()  # (p, D, D)
    order, features = lags.shape[0], lags.shape[1]
    companion = torch.zeros(order * features, order * features, dtype=torch.float64)
    companion[:features] = torch.cat(list(lags), dim=1)
    companion[features:, :-features] = torch.eye((order - 1) * features, dtype=torch.float64)
    return float(torch.linalg.eigvals(companion).abs().max())


def run(args: argparse.Namespace) -> int:
    print(f"{'dataset':<24}{'feature':>8}{'levels':>8}{'values':>9}{'repeats':>10}{'step':>10}")
    for name in args.datasets:
        print("\n".join(repeating_features(name)) or f"{name:<24}{'(no repeating feature)':>30}")
    for item in args.run:
        label, _, folder = item.partition("=")
        model = load_run(Path(folder), device="cpu").model
        roots = [f"{largest_root(m):.4f}" for m in model.modules()
                 if isinstance(m, AutoregressiveLinear)]
        print(f"{label}: largest root modulus of the autoregressive steps: "
              f"{', '.join(roots) or 'none'}")
    return 0
