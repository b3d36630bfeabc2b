"""Block recipes compared on the validation splits of the shipped datasets (the ablation table).

Every recipe is a :class:`~iresflow.models.config.ModelConfig` variation trained by the trainer
of ``iresflow train`` (:func:`iresflow.train.loop.train`) with the library's training defaults
and the same seed and epoch budget; the best-validation checkpoint is scored with the exact
log-determinant on the validation split (which chooses the default recipe) and on the test
split. For recipes with attention the table also gives the fraction of its certificate the
trained attention uses: the largest observed local Lipschitz constant of every attention branch
(``lipschitz_report``'s ``estimate``, exact Jacobian norms at random inputs) over its certified
bound, averaged over the attention branches.

Run from the repository root::

    python -m benchmarks recipes                      # all datasets and recipes (tens of minutes)
    python -m benchmarks recipes --quick              # smoke run, about a minute
    python -m benchmarks recipes --out docs/recipes.json --doc docs/recipes.md

Writes the records (one per dataset) to ``--out`` and, with ``--doc``, the tables into the page
between its ``<!-- recipes:start -->`` and ``<!-- recipes:end -->`` markers; ``--merge`` keeps
the recipes already in ``--out`` (run with the same settings) that this run does not redo.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import cli
from benchmarks.records import markdown_table
from iresflow.runs.evaluate import evaluate_run
from iresflow.runs.load import load_run
from iresflow.train.config import TrainConfig
from iresflow.train.loop import train

DATASETS = ("japanese_vowels", "digits_rows", "co2_windows")
#: Recipes: a name and the model settings that differ from the defaults. The default order of
#: the autoregressive input layer is chosen on the validation split (0 to 3); the recipes named
#: "AR(3)" pin order 3, as their names say (the default recipe is the default with order 3).
RECIPES: dict[str, dict[str, Any]] = {
    "default (AR(3), conv + mlp)": {"ar_order": 3},
    "AR(3), attention + conv + mlp": {"ar_order": 3, "layers": ("attention", "conv", "mlp")},
    "AR(3), mlp only": {"ar_order": 3, "layers": ("mlp",)},
    "no AR, conv + mlp": {"ar_order": 0},
    "Transformer (no AR, attention + mlp, 8 blocks)": {
        "ar_order": 0, "layers": ("attention", "mlp"), "n_blocks": 8,
    },
    # Certified ways to let the attention use more of its bound: a coefficient closer to 1 and
    # a learned positional table (the certificate holds for any table).
    "AR(3), attention + conv + mlp, coeff 0.99, learned positions": {
        "ar_order": 3, "layers": ("attention", "conv", "mlp"), "coeff": 0.99,
        "positional": "learned",
    },
    "Transformer, coeff 0.99, learned positions": {
        "ar_order": 0, "layers": ("attention", "mlp"), "n_blocks": 8, "coeff": 0.99,
        "positional": "learned",
    },
    # The residual-flow Transformer block after the AR input layer, and the same with a learned
    # relative-position bias in the attention scores (certified, docs/math.md#relative-bias).
    "AR(3), attention + mlp, 8 blocks": {
        "ar_order": 3, "layers": ("attention", "mlp"), "n_blocks": 8,
    },
    "AR(3), attention + mlp, 8 blocks, relative bias": {
        "ar_order": 3, "layers": ("attention", "mlp"), "n_blocks": 8, "relative_window": 32,
    },
    "Transformer, relative bias": {
        "ar_order": 0, "layers": ("attention", "mlp"), "n_blocks": 8, "relative_window": 32,
    },
    # Content-free reading at learned offsets (docs/math.md#relative-mixing): a fixed lag at no
    # cost to the certificate.
    "AR(3), relative + mlp": {"ar_order": 3, "layers": ("relative", "mlp"),
                              "relative_window": 32},
    # An affine step conditioned on all past frames by an unconstrained causal Transformer
    # (docs/math.md#autoregressive-step) before the default residual steps of every block:
    # long memory without a certificate to spend (docs/small_data.md#autoregressive-step).
    "autoregressive + conv + mlp": {"layers": ("autoregressive", "conv", "mlp")},
}
QUICK = {"epochs": 2, "max_train": 48, "max_eval": 16}
#: The fields that identify a record.
KEY = ("dataset",)


def attention_use(run_dir: Path, seq_len: int | None = None) -> float | None:
    """Mean observed / certified Lipschitz constant of a run's attention branches.

    Args:
        run_dir: A trained run folder.
        seq_len: Length of the random probe sequences of ``lipschitz_report`` (``None``: its
            default).

    Returns:
        The mean ratio, or ``None`` for a model without attention.
    """
    model = load_run(run_dir, device="cpu").model
    report = model.lipschitz_report(seq_len, generator=torch.Generator().manual_seed(0))
    ratios = [r["estimate"] / r["certified"] for r in report if r["name"].endswith("attention")]
    return sum(ratios) / len(ratios) if ratios else None


def run_recipe(settings: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """Train one recipe (flat ``iresflow train`` settings) and score its best checkpoint exactly
    on validation and test."""
    start = time.perf_counter()
    config = TrainConfig.from_dict({"alternative": "none", **settings})  # that recipe alone
    result = train(config, run_dir, overwrite=True, progress=False)
    seconds = time.perf_counter() - start
    run = load_run(run_dir, device="cpu")
    return {
        "val_nll": evaluate_run(run, split="val", method="exact", save=False)["nll"],
        "test_nll": evaluate_run(run, split="test", method="exact", save=False)["nll"],
        "unit": run.dataset.unit,
        "best_epoch": result.best_epoch,
        "train_seconds": seconds,
        "parameters": sum(p.numel() for p in run.model.parameters()),
        "attention_usage": attention_use(run_dir),
    }


def markdown(rows: list[dict[str, Any]], settings: dict[str, Any], commands: list[str]) -> str:
    """The ``recipes`` block: one table per dataset, best validation NLL in bold.

    Args:
        rows: The records, one per dataset with one field per recipe.
        settings: The training settings every recipe shared.
        commands: The runs that produced the rows.
    """
    lines = [
        "Generated by " + ", merged with ".join(f"`{c}`" for c in commands) + "; exact NLL of "
        "the best-validation checkpoint, lower is better. Training: the `iresflow train` "
        f"defaults with {json.dumps(settings)}, seed 0, CPU. *Attention use*: observed local "
        "Lipschitz constant of the trained attention branches over their certificate (mean "
        "over branches).",
    ]
    order = list(RECIPES)
    for record in rows:
        recipes = sorted((k for k, v in record.items() if isinstance(v, dict)),
                         key=lambda r: order.index(r) if r in order else len(order))
        best = min(recipes, key=lambda r: record[r]["val_nll"])
        table = []
        for recipe in recipes:
            r = record[recipe]
            val = f"**{r['val_nll']:.3f}**" if recipe == best else f"{r['val_nll']:.3f}"
            usage = "—" if r["attention_usage"] is None else f"{r['attention_usage']:.2f}"
            table.append([recipe, val, f"{r['test_nll']:.3f}", str(r["parameters"]),
                          str(r["best_epoch"]), f"{r['train_seconds']:.0f}", usage])
        unit = record[recipes[0]]["unit"]
        lines += ["", f"## {record['dataset']}", "", markdown_table(
            ["recipe", f"val NLL ({unit})", "test NLL", "parameters", "best epoch",
             "training s", "attention use"], table)]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cli.add_datasets(parser, DATASETS)
    parser.add_argument("--recipes", nargs="+", type=int, default=None,
                        help="indices into the recipe list (default: all)")
    cli.add_quick(parser, "2 epochs, small splits")
    cli.add_settings(parser, epochs=None)
    cli.add_threads(parser)
    cli.add_records(parser, "recipes", ("recipes",))


def run(args: argparse.Namespace) -> None:
    """Train the recipes (or read them, ``--table-from``); write the records and the tables."""
    if args.table_from is not None:
        content = cli.table_from(args, KEY)
        rows, settings, commands = content["records"], content["settings"], content["commands"]
    else:
        settings = (dict(QUICK) if args.quick else {}) | cli.settings(args)
        earlier = cli.stored(args, settings)
        names = list(RECIPES)
        chosen = names if args.recipes is None else [names[i] for i in args.recipes]
        rows = []
        with tempfile.TemporaryDirectory() as tmp:
            for dataset in args.datasets:
                rows.append({"dataset": dataset})
                for recipe in chosen:
                    row = run_recipe({"data": dataset, "device": "cpu", **RECIPES[recipe],
                                      **settings}, Path(tmp) / "run")
                    rows[-1][recipe] = row
                    print(f"{dataset:16s} {recipe:48s} val {row['val_nll']:9.4f}  "
                          f"test {row['test_nll']:9.4f}  {row['train_seconds']:6.0f} s",
                          flush=True)
        rows, commands = cli.save(args, rows, KEY, settings, earlier)
    cli.publish(args, {"recipes": markdown(rows, settings, commands)})
