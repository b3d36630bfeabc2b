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

    python -m benchmarks.recipes                      # all datasets and recipes (tens of minutes)
    python -m benchmarks.recipes --quick              # smoke run, about a minute
    python -m benchmarks.recipes --markdown docs/recipes.md

Writes ``--out`` (default ``benchmarks/out/recipes.json``) and, with ``--markdown``, the table as
a page; ``--merge`` adds the rows of an earlier ``--out`` of the same settings (e.g. recipes run
side by side in two processes).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from iresflow.runs.evaluate import evaluate_run
from iresflow.runs.load import load_run
from iresflow.train.config import TrainConfig
from iresflow.train.loop import train

DATASETS = ("japanese_vowels", "digits_rows", "co2_windows")
#: Recipes: a name and the model settings that differ from the defaults.
RECIPES: dict[str, dict[str, Any]] = {
    "default (AR(3), conv + mlp)": {},
    "AR(3), attention + conv + mlp": {"layers": ("attention", "conv", "mlp")},
    "AR(3), mlp only": {"layers": ("mlp",)},
    "no AR, conv + mlp": {"ar_order": 0},
    "Transformer (no AR, attention + mlp, 8 blocks)": {
        "ar_order": 0, "layers": ("attention", "mlp"), "n_blocks": 8,
    },
    # Certified ways to let the attention use more of its bound: a coefficient closer to 1 and
    # a learned positional table (the certificate holds for any table).
    "AR(3), attention + conv + mlp, coeff 0.99, learned positions": {
        "layers": ("attention", "conv", "mlp"), "coeff": 0.99, "positional": "learned",
    },
    "Transformer, coeff 0.99, learned positions": {
        "ar_order": 0, "layers": ("attention", "mlp"), "n_blocks": 8, "coeff": 0.99,
        "positional": "learned",
    },
    # The residual-flow Transformer block after the AR input layer, and the same with a learned
    # relative-position bias in the attention scores (certified, docs/math.md#relative-bias).
    "AR(3), attention + mlp, 8 blocks": {"layers": ("attention", "mlp"), "n_blocks": 8},
    "AR(3), attention + mlp, 8 blocks, relative bias": {
        "layers": ("attention", "mlp"), "n_blocks": 8, "relative_window": 32,
    },
    "Transformer, relative bias": {
        "ar_order": 0, "layers": ("attention", "mlp"), "n_blocks": 8, "relative_window": 32,
    },
    # Content-free reading at learned offsets (docs/math.md#relative-mixing): a fixed lag at no
    # cost to the certificate.
    "AR(3), relative + mlp": {"layers": ("relative", "mlp"), "relative_window": 32},
}
QUICK = {"epochs": 2, "max_train": 48, "max_eval": 16}
OUT = Path(__file__).resolve().parent / "out"


def attention_usage(run_dir: Path) -> float | None:
    """Mean of estimate / certificate over the attention branches of a run (``None``: none)."""
    model = load_run(run_dir, device="cpu").model
    report = model.lipschitz_report(generator=torch.Generator().manual_seed(0))
    ratios = [r["estimate"] / r["certified"] for r in report if r["name"].endswith("attention")]
    return sum(ratios) / len(ratios) if ratios else None


def run_recipe(config: TrainConfig, run_dir: Path) -> dict[str, Any]:
    """Train one recipe and score its best checkpoint exactly on validation and test."""
    start = time.perf_counter()
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
        "attention_usage": attention_usage(run_dir),
    }


def markdown(results: dict[str, dict[str, dict[str, Any]]], settings: dict[str, Any],
             commands: list[str] | None = None) -> str:
    """The results as a Markdown page, one table per dataset, best validation NLL in bold;
    ``commands``: the runs that produced the rows (default: one run of all recipes)."""
    runs = commands or ["python -m benchmarks.recipes --markdown docs/recipes.md"]
    lines = [
        "# Block recipes (ablation)",
        "",
        "Generated by " + ", merged with ".join(f"`{c}`" for c in runs) + "; exact NLL of the "
        "best-validation checkpoint, lower is better. Training: the `iresflow train` defaults "
        f"with {json.dumps(settings)}, seed 0, CPU. *Attention use*: observed local Lipschitz "
        "constant of the trained attention branches over their certificate (mean over branches).",
        "",
    ]
    for name, rows in results.items():
        unit = next(iter(rows.values()))["unit"]
        best = min(rows, key=lambda r: rows[r]["val_nll"])
        lines += [f"## {name}", "", f"| recipe | val NLL ({unit}) | test NLL | parameters | "
                  "best epoch | training s | attention use |", "|---|---|---|---|---|---|---|"]
        for recipe, r in rows.items():
            val = f"**{r['val_nll']:.3f}**" if recipe == best else f"{r['val_nll']:.3f}"
            usage = "—" if r["attention_usage"] is None else f"{r['attention_usage']:.2f}"
            lines.append(f"| {recipe} | {val} | {r['test_nll']:.3f} | {r['parameters']} | "
                         f"{r['best_epoch']} | {r['train_seconds']:.0f} | {usage} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=DATASETS)
    parser.add_argument("--recipes", nargs="+", type=int, default=None,
                        help="indices into the recipe list (default: all)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 epochs, small splits")
    parser.add_argument("--epochs", type=int, default=None, help="epoch budget of every run")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--markdown", type=Path, default=None, help="write the table here")
    parser.add_argument("--out", type=Path, default=OUT / "recipes.json",
                        help="JSON of the results (default: %(default)s)")
    parser.add_argument("--merge", type=Path, default=None, metavar="JSON",
                        help="an earlier --out with the same settings: its rows join this run's "
                             "(this run's replace those of the same recipe)")
    parser.add_argument("--table-from", type=Path, default=None, metavar="JSON",
                        help="train nothing: write the --markdown page of an earlier --out")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.table_from is not None:
        saved = json.loads(args.table_from.read_text())
        if args.markdown is not None:
            args.markdown.write_text(
                markdown(saved["results"], saved["settings"], saved.get("commands")) + "\n")
        return
    settings = dict(QUICK) if args.quick else {}
    if args.epochs is not None:
        settings["epochs"] = args.epochs
    names = list(RECIPES)
    chosen = names if args.recipes is None else [names[i] for i in args.recipes]
    results: dict[str, dict[str, dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for dataset in args.datasets:
            results[dataset] = {}
            for recipe in chosen:
                config = TrainConfig.from_dict(
                    {"data": dataset, "device": "cpu", **RECIPES[recipe], **settings})
                row = run_recipe(config, Path(tmp) / "run")
                results[dataset][recipe] = row
                print(f"{dataset:16s} {recipe:48s} val {row['val_nll']:9.4f}  "
                      f"test {row['test_nll']:9.4f}  {row['train_seconds']:6.0f} s", flush=True)
    commands = ["python -m benchmarks.recipes " + " ".join(sys.argv[1:])]
    if args.merge is not None:
        earlier = json.loads(args.merge.read_text())
        if earlier["settings"] != settings:
            parser.error(f"--merge {args.merge} was run with {earlier['settings']}, not {settings}")
        for dataset, rows in earlier["results"].items():
            results[dataset] = {**rows, **results.get(dataset, {})}
        commands = earlier.get("commands", []) + commands
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"settings": settings, "results": results,
                                    "commands": commands}, indent=2))
    if args.markdown is not None:
        args.markdown.write_text(markdown(results, settings, commands) + "\n")
        print(f"wrote {args.markdown}")


if __name__ == "__main__":
    main()
