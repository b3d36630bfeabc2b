"""Long-range synthetic datasets: models next to the exact NLL (the floor).

For each synthetic dataset with a known density (``repeated_motif``, ``nonlinear_seasonal``:
:mod:`iresflow.data.synthetic`, ``docs/datasets.md``) and each seed, on the splits the trainer
uses (``iresflow.train.factories.load_data``, so ``--max-train``/``--max-eval`` subsets are
shared by every row), the script prints the test NLL of

* the exact density (the floor: no model can do better in expectation);
* the linear-Gaussian AR(p) model over frames, ``p <= 3`` chosen on validation and refitted on
  train and validation (:class:`benchmarks.baselines.autoregressive.AutoregressiveGaussian`);
* iresflow recipes of :data:`benchmarks.recipes.RECIPES` trained by the product's trainer
  (:func:`benchmarks.recipes.run_recipe`: ``iresflow.train.loop.train``, exact NLL of the
  best-validation checkpoint): by default the default recipe and the attention recipe with the
  best validation NLL in ``docs/recipes.md``;

with the fraction of the AR-to-floor gap a model closes, ``(AR - model) / (AR - floor)``, and
for attention recipes the observed over certified Lipschitz constant of the attention branches
(``lipschitz_report``; mean over branches, probed with random sequences of 16 frames as in
``docs/recipes.md`` and of the dataset's length ``N``).

Run from the repository root::

    python -m benchmarks.long_range                           # 1 seed, small budget
    python -m benchmarks.long_range --seeds 0 1 2 --epochs 20 --max-train none
    python -m benchmarks.long_range --references-only --max-train none --max-eval none

Writes ``benchmarks/out/long_range.json``. Timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.baselines.autoregressive import AutoregressiveGaussian
from benchmarks.recipes import RECIPES, run_recipe
from iresflow.data.synthetic import synthetic_family, synthetic_names
from iresflow.train.config import TrainConfig
from iresflow.train.evaluate import load_run
from iresflow.train.factories import load_data

#: Recipes run by default: the default model and the best attention recipe of docs/recipes.md.
DEFAULT_RECIPES = (
    "default (AR(3), conv + mlp)",
    "AR(3), attention + conv + mlp, coeff 0.99, learned positions",
)
#: Largest order of the AR(p) Gaussian (p chosen on validation), the gap's reference.
MAX_AR_ORDER = 3
OUT = Path(__file__).resolve().parent / "out"


def attention_use(run_dir: Path, seq_len: int) -> float | None:
    """Mean observed / certified Lipschitz constant of a run's attention branches.

    Args:
        run_dir: A trained run folder.
        seq_len: Length of the random probe sequences of ``lipschitz_report``.

    Returns:
        The mean ratio, or ``None`` for a model without attention.
    """
    model = load_run(run_dir, device="cpu").model
    report = model.lipschitz_report(seq_len, generator=torch.Generator().manual_seed(0))
    ratios = [r["estimate"] / r["certified"] for r in report if r["name"].endswith("attention")]
    return sum(ratios) / len(ratios) if ratios else None


def references(config: TrainConfig) -> dict[str, float]:
    """Floor and AR(p) test NLLs on the splits of ``config`` (its seed and subsets)."""
    dataset = load_data(config)
    family = synthetic_family(config.data)
    test = dataset.test
    floor = dataset.nll(family.log_prob(test.x, test.mask), test)
    ar = AutoregressiveGaussian(dataset.features, dataset.max_len)
    ar.fit_selected_order(dataset.train, dataset.val, MAX_AR_ORDER)
    return {"floor": floor, "ar": dataset.nll(ar.log_prob(test.x, test.mask), test),
            "ar_order": ar.order, "max_len": dataset.max_len}


def run_seed(name: str, seed: int, recipes: list[str], settings: dict[str, Any],
             folder: Path) -> dict[str, Any]:
    """References and trained recipes of one dataset and seed (``settings`` of the trainer
    override the recipes')."""
    base = TrainConfig(data=name, seed=seed, device="cpu", **settings)
    result: dict[str, Any] = references(base)
    gap = result["ar"] - result["floor"]
    result["models"] = {}
    for recipe in recipes:
        config = TrainConfig(data=name, seed=seed, device="cpu",
                             **{**RECIPES[recipe], **settings})
        row = run_recipe(config, folder / "run")
        row["gap_closed"] = (result["ar"] - row["test_nll"]) / gap
        row["attention_use_full_length"] = (
            None if row["attention_usage"] is None
            else attention_use(folder / "run", result["max_len"]))
        result["models"][recipe] = row
        print(f"  {name} seed {seed} {recipe}: test {row['test_nll']:.3f} "
              f"(floor {result['floor']:.3f}, AR {result['ar']:.3f}) "
              f"{row['train_seconds']:.0f} s", flush=True)
    return result


def _mean_sd(values: list[float], digits: int = 3) -> str:
    mean = statistics.fmean(values)
    if len(values) < 2:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def table(name: str, runs: list[dict[str, Any]]) -> str:
    """One dataset's rows as Markdown: test NLL (mean ± sd over seeds), gap closed, usage."""
    lines = [f"### {name} (test NLL, nats/frame; {len(runs)} seed(s))", "",
             "| model | test NLL | gap closed | train s | best epoch | attention use "
             "(16 / N frames) |", "|---|---|---|---|---|---|",
             f"| exact density (floor) | {_mean_sd([r['floor'] for r in runs])} | 1 | — | — | — |",
             f"| AR(p ≤ {MAX_AR_ORDER}) Gaussian (p = "
             f"{','.join(str(r['ar_order']) for r in runs)}) | {_mean_sd([r['ar'] for r in runs])}"
             " | 0 | — | — | — |"]
    for recipe in runs[0]["models"]:
        rows = [r["models"][recipe] for r in runs]
        use = "—"
        if rows[0]["attention_usage"] is not None:
            use = (f"{_mean_sd([r['attention_usage'] for r in rows], 2)} / "
                   f"{_mean_sd([r['attention_use_full_length'] for r in rows], 2)}")
        lines.append(
            f"| {recipe} | {_mean_sd([r['test_nll'] for r in rows])} | "
            f"{_mean_sd([r['gap_closed'] for r in rows], 2)} | "
            f"{_mean_sd([r['train_seconds'] for r in rows], 0)} | "
            f"{','.join(str(r['best_epoch']) for r in rows)} | {use} |")
    return "\n".join(lines)


def _optional_int(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=synthetic_names(),
                        choices=synthetic_names())
    parser.add_argument("--recipes", nargs="+", default=list(DEFAULT_RECIPES),
                        choices=list(RECIPES), metavar="RECIPE",
                        help="names in benchmarks.recipes.RECIPES (default: %(default)s)")
    parser.add_argument("--references-only", action="store_true",
                        help="print the floor and the AR(p) Gaussian only (no training)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--epochs", type=int, default=3, help="epoch budget of every run")
    parser.add_argument("--max-train", type=_optional_int, default=300,
                        help="training sequences per run ('none': all 1000)")
    parser.add_argument("--max-eval", type=_optional_int, default=100,
                        help="validation and test sequences ('none': all)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    settings = {"epochs": args.epochs, "max_train": args.max_train, "max_eval": args.max_eval}
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.datasets:
            recipes = [] if args.references_only else args.recipes
            results[name] = [run_seed(name, seed, recipes, settings, Path(tmp))
                             for seed in args.seeds]
    print(f"\nsettings: {json.dumps(settings)}, seeds {args.seeds}\n")
    for name, runs in results.items():
        print(table(name, runs) + "\n")
    OUT.mkdir(exist_ok=True)
    (OUT / "long_range.json").write_text(
        json.dumps({"settings": settings, "seeds": args.seeds, "results": results}, indent=2))


if __name__ == "__main__":
    main()
