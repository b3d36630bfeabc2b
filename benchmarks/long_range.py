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

* the GRU + MAF (:func:`benchmarks.baselines.recurrent.train_recurrent_flow`, sequential
  sampling) given as many optimisation seconds as the slowest recipe of the same seed
  (equal training time);

with the fraction of the AR-to-floor gap a model closes, ``(AR - model) / (AR - floor)``, and
for attention recipes the observed over certified Lipschitz constant of the attention branches
(``lipschitz_report``; mean over branches, probed with random sequences of 16 frames as in
``docs/recipes.md`` and of the dataset's length ``N``).

``--diagnose`` adds, per attention branch of every trained attention recipe, where its
certificate goes (:func:`attention_diagnosis`): the observed/certified ratio at random inputs,
at the inputs the branch receives on test sequences and after an adversarial search from them;
the share of the bound that the length term takes; the largest ratio a pure value path can
reach (attention held fixed); and how the trained heads spread their attention over a sequence
and over the frames one period (or a multiple) away.

Run from the repository root::

    python -m benchmarks long_range                           # 1 seed, small budget
    python -m benchmarks long_range --seeds 3 --epochs 20 --max-train none
    python -m benchmarks long_range --references-only --max-train none --max-eval none
    python -m benchmarks long_range --diagnose-run runs/my_attention_run   # a trained run
    python -m benchmarks long_range --seeds 3 --doc docs/attention.md --figures docs/figures

``--doc`` writes the tables into the page between its ``<!-- long-range:start -->`` and
``<!-- long-range:end -->`` markers; ``--figures`` writes the learning curves (validation NLL
against optimisation seconds, mean over seeds) and a picture of what the heads of the first
attention recipe attend to.

Writes the records (one per dataset and seed) to ``--out`` (default
``benchmarks/out/long_range.json``) after every seed; ``--table-from`` reports earlier files
without training (their seeds merged), e.g. runs of different seeds made side by side. Timings
on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks import cli
from benchmarks.baselines.recurrent import train_recurrent_flow
from benchmarks.figures import long_range_curves, plot_attention
from benchmarks.recipes import RECIPES, attention_use, run_recipe
from benchmarks.records import markdown_table, mean_sd
from benchmarks.results_specs import gru_maf_config
from iresflow.data.synthetic import RepeatedMotif, synthetic_family, synthetic_names
from iresflow.models.reference import AutoregressiveGaussian
from iresflow.nn.attention import ContractiveL2MultiheadAttention
from iresflow.nn.diagnostics import attention_weights, empirical_lipschitz, jacobian_norm
from iresflow.nn.positional import PositionalBranch
from iresflow.runs.load import load_run
from iresflow.train.config import TrainConfig
from iresflow.train.factories import load_data

#: Recipes run by default: the default model and the best attention recipe of docs/recipes.md.
DEFAULT_RECIPES = (
    "default (AR(3), conv + mlp)",
    "AR(3), attention + conv + mlp, coeff 0.99, learned positions",
)
#: Largest order of the AR(p) Gaussian (p chosen on validation), the gap's reference.
MAX_AR_ORDER = 3
#: Row name of the sequential baseline.
GRU_MAF = "GRU + MAF (sequential sampling)"
#: The fields that identify a record.
KEY = ("dataset", "seed")


def models(record: dict[str, Any]) -> list[str]:
    """The models of a record: its fields that hold a model's row."""
    return [name for name, value in record.items() if isinstance(value, dict)]


def _lags(name: str, x: torch.Tensor) -> torch.Tensor:
    """Period of every sequence ``(B,)``: the posterior mode for ``repeated_motif``."""
    family = synthetic_family(name)
    if isinstance(family, RepeatedMotif):
        return family.period_log_likelihoods(x).argmax(1) + family.min_period
    return torch.full(x.shape[:1], family.period)


def _branch_diagnosis(branch: PositionalBranch, x: torch.Tensor, lags: torch.Tensor,
                      generator: torch.Generator) -> dict[str, float]:
    """Where the certificate of one attention branch goes, at its inputs ``x`` ``(B, N, D)``."""
    inner = branch.branch
    b, n, d = x.shape
    certified = float(branch.lipschitz_constant(n))
    with torch.enable_grad():
        def ratio(points: torch.Tensor, g: object = branch) -> float:
            return float(jacobian_norm(g, points, "inf").detach().max()) / certified
        at_data = jacobian_norm(branch, x, "inf").detach() / certified
        adversarial = empirical_lipschitz(branch, x[:2], "inf", steps=60, lr=0.05)
        # At a constant sequence the logits' gradients vanish (|q_i - q_j|^2 is flat at 0), so
        # the Jacobian is the value path alone: uniform weights times the value/output maps.
        value = ratio(torch.ones(1, n, d, dtype=x.dtype), inner)
        random16, random_n = (ratio(torch.randn(4, m, d, generator=generator, dtype=x.dtype))
                              for m in (16, n))
    maps = attention_weights(branch, x)
    offset = torch.arange(n) - torch.arange(n).unsqueeze(1)
    copies = (offset % lags[:, None, None] == 0) & (offset != 0)  # (B, N, N)
    entropy = -(maps * maps.clamp_min(1e-300).log()).sum(-1)
    return {
        "random_16": random16, "random_n": random_n, "data_mean": float(at_data.mean()),
        "data_max": float(at_data.max()), "adversarial": float(adversarial.value) / certified,
        "length_share": 1.0 - float(inner.raw_bound(1) / inner.raw_bound(n)),
        "value_path": value,
        "effective_tokens": float(entropy.exp().mean()),
        "copy_mass": float((maps * copies[:, None]).sum(-1).mean()),
        "copy_mass_uniform": float(copies.sum(-1).double().mean()) / n,
    }


def attention_diagnosis(run_dir: Path, num: int = 8) -> list[dict[str, Any]]:
    """Where the certificates of a trained run's L2 attention branches go, on test sequences.

    The test sequences are pushed through the chain in float64; every L2 attention branch is
    probed at the inputs it receives. Ratios are observed / certified Lipschitz constants
    (exact Jacobian norms in the certificate's norm, ``lipschitz_report``'s estimate).

    Args:
        run_dir: A run trained on a synthetic dataset.
        num: Number of test sequences.

    Returns:
        One dict per attention branch: ``name``; ratios ``random_16`` and ``random_n`` (random
        normal probes of 16 and ``N`` frames), ``data_mean``/``data_max`` (at the branch's
        inputs), ``adversarial`` (gradient ascent from two of them); ``length_share`` (share
        of the bound ``B(N)`` taken by its length term, ``1 - B(1)/B(N)``); ``value_path``
        (the ratio with the attention weights held uniform: what moving tokens by their
        attended average can use); ``effective_tokens`` (``exp`` of the attention entropy,
        mean over heads and queries), ``copy_mass`` (attention on frames a multiple of the
        period away) and ``copy_mass_uniform`` (the same for uniform attention).
    """
    run = load_run(run_dir, device="cpu")
    model = run.model.double().eval()
    x, mask = run.dataset.test.x[:num].double(), run.dataset.test.mask[:num]
    lags = _lags(run.dataset.name, x)
    generator = torch.Generator().manual_seed(0)
    rows = []
    with torch.no_grad():
        for name, step in model.transform.named_steps():
            branch = getattr(step, "branch", None)
            if isinstance(branch, PositionalBranch) and isinstance(
                    branch.branch, ContractiveL2MultiheadAttention):
                rows.append({"name": name, **_branch_diagnosis(branch, x, lags, generator)})
            x = step(x, mask=mask, logdet=False)[0]
    return rows


def print_diagnosis(rows: list[dict[str, Any]]) -> None:
    """Print :func:`attention_diagnosis` rows, one line per branch."""
    for r in rows:
        print(f"    {r['name']}: observed/certified random16 {r['random_16']:.3f} randomN "
              f"{r['random_n']:.3f} data {r['data_mean']:.3f} (max {r['data_max']:.3f}) "
              f"adversarial {r['adversarial']:.3f} | length term {r['length_share']:.3f} of "
              f"B(N), value path {r['value_path']:.3f} | attention over "
              f"{r['effective_tokens']:.1f} tokens, on period multiples {r['copy_mass']:.3f} "
              f"(uniform {r['copy_mass_uniform']:.3f})", flush=True)


def references(settings: dict[str, Any]) -> dict[str, float]:
    """Floor and AR(p) test NLLs on the splits of the flat ``iresflow train`` ``settings``."""
    dataset = load_data(TrainConfig.from_dict(settings))
    test = dataset.test
    floor = dataset.nll(synthetic_family(dataset.name).log_prob(test.x, test.mask), test)
    ar = AutoregressiveGaussian(dataset.features, dataset.max_len)
    ar.fit_selected_order(dataset.train, dataset.val, MAX_AR_ORDER)
    return {"floor": floor, "ar": dataset.nll(ar.log_prob(test.x, test.mask), test),
            "ar_order": ar.order, "max_len": dataset.max_len}


def run_seed(name: str, seed: int, recipes: list[str], settings: dict[str, Any],
             folder: Path, diagnose: bool = False, gru: bool = True,
             figures: Path | None = None) -> dict[str, Any]:
    """The record of one dataset and seed: references, trained recipes and the GRU + MAF
    (``settings`` of the trainer override the recipes'); ``figures``: where to draw the first
    attention recipe's heads (:func:`benchmarks.figures.plot_attention`)."""
    base = {"data": name, "seed": seed, "device": "cpu", **settings}
    result: dict[str, Any] = {"dataset": name, "seed": seed, **references(base)}
    gap = result["ar"] - result["floor"]
    for recipe in recipes:
        row = run_recipe({**base, **RECIPES[recipe], **settings}, folder / "run")
        row["gap_closed"] = (result["ar"] - row["test_nll"]) / gap
        metrics = (folder / "run" / "metrics.jsonl").read_text().splitlines()
        row["history"] = _curve([json.loads(line) for line in metrics])
        row["attention_use_full_length"] = (
            None if row["attention_usage"] is None
            else attention_use(folder / "run", result["max_len"]))
        result[recipe] = row
        print(f"  {name} seed {seed} {recipe}: test {row['test_nll']:.3f} "
              f"(floor {result['floor']:.3f}, AR {result['ar']:.3f}) "
              f"{row['train_seconds']:.0f} s", flush=True)
        if row["attention_usage"] is not None:
            if diagnose:
                row["diagnosis"] = attention_diagnosis(folder / "run")
                print_diagnosis(row["diagnosis"])
            if figures is not None:
                plot_attention(folder / "run", figures / f"long_range_attention_{name}.png",
                               _lags)
                figures = None
    if gru:
        seconds = max([result[m]["train_seconds"] for m in models(result)], default=60.0)
        row = run_gru_maf(base, seconds)
        row["gap_closed"] = (result["ar"] - row["test_nll"]) / gap
        result[GRU_MAF] = row
        print(f"  {name} seed {seed} {GRU_MAF}: test {row['test_nll']:.3f} "
              f"({row['train_seconds']:.0f} s)", flush=True)
    return result


def run_gru_maf(base: dict[str, Any], seconds: float) -> dict[str, Any]:
    """The GRU + MAF trained for ``seconds`` optimisation seconds on the splits of the flat
    settings ``base`` (its data, seed and subsets), with the results table's protocol for a
    baseline."""
    subsets = {k: base[k] for k in ("max_train", "max_eval") if k in base}
    config = gru_maf_config(base["data"], base["seed"], seconds, **subsets)
    row = train_recurrent_flow(config, load_data(config))
    return {"test_nll": row["test_nll"], "train_seconds": row["train_seconds"],
            "best_epoch": row["best_epoch"], "attention_usage": None,
            "attention_use_full_length": None, "history": _curve(row["history"])}


def _curve(history: list[dict[str, float]]) -> list[tuple[float, float]]:
    """``(optimisation seconds so far, validation NLL)`` of every epoch of a training history
    (one metrics dict per epoch, as in ``metrics.jsonl``)."""
    elapsed, curve = 0.0, []
    for row in history:
        elapsed += row["train_seconds"]
        curve.append((elapsed, row["val_nll"]))
    return curve


def table(name: str, runs: list[dict[str, Any]]) -> str:
    """One dataset's rows as Markdown: test NLL (mean ± sd over seeds), gap closed, usage; a
    model that only some seeds ran says on how many."""
    rows = [["exact density (floor)", mean_sd([r["floor"] for r in runs]), "1", "—", "—", "—"],
            [f"AR(p ≤ {MAX_AR_ORDER}) Gaussian (p = {','.join(str(r['ar_order']) for r in runs)})",
             mean_sd([r["ar"] for r in runs]), "0", "—", "—", "—"]]
    for model in dict.fromkeys(m for r in runs for m in models(r)):
        per_seed = [r[model] for r in runs if model in r]
        label = model if len(per_seed) == len(runs) else f"{model} ({len(per_seed)} seed(s))"
        use = "—"
        if per_seed[0]["attention_usage"] is not None:
            use = (f"{mean_sd([r['attention_usage'] for r in per_seed], 2)} / "
                   f"{mean_sd([r['attention_use_full_length'] for r in per_seed], 2)}")
        rows.append([label, mean_sd([r["test_nll"] for r in per_seed]),
                     mean_sd([r["gap_closed"] for r in per_seed], 2),
                     mean_sd([r["train_seconds"] for r in per_seed], 0),
                     ",".join(str(r["best_epoch"]) for r in per_seed), use])
    return f"### {name} (test NLL, nats/frame; {len(runs)} seed(s))\n\n" + markdown_table(
        ["model", "test NLL", "gap closed", "train s", "best epoch",
         "attention use (16 / N frames)"], rows)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cli.add_datasets(parser, synthetic_names())
    parser.add_argument("--recipes", nargs="+", default=list(DEFAULT_RECIPES),
                        choices=list(RECIPES), metavar="RECIPE",
                        help="names in benchmarks.recipes.RECIPES (default: %(default)s)")
    parser.add_argument("--references-only", action="store_true",
                        help="print the floor and the AR(p) Gaussian only (no training)")
    cli.add_seeds(parser)
    cli.add_settings(parser, epochs=3, max_train=300, max_eval=100)
    cli.add_threads(parser)
    parser.add_argument("--diagnose", action="store_true",
                        help="where the attention branches' certificates go (slower)")
    parser.add_argument("--no-gru", action="store_true", help="skip the GRU + MAF baseline")
    cli.add_records(parser, "long_range", ("long-range",))
    parser.add_argument("--figures", type=Path, default=None,
                        help="write learning curves and the attention picture here")
    parser.add_argument("--diagnose-run", type=Path, default=None,
                        help="only diagnose the attention of this trained run folder")


def run(args: argparse.Namespace) -> None:
    """Train and report (or report earlier records, or diagnose a run)."""
    if args.diagnose_run is not None:
        print_diagnosis(attention_diagnosis(args.diagnose_run))
        return
    figures = args.figures
    if args.table_from is not None:
        content = cli.table_from(args, KEY)
        print("\n".join(content["commands"]))
        rows = content["records"]
    else:
        settings = cli.settings(args)
        earlier, rows = cli.stored(args, settings), []
        recipes = [] if args.references_only else args.recipes
        with tempfile.TemporaryDirectory() as tmp:
            for name in args.datasets:
                for seed in cli.seeds(args):
                    rows.append(run_seed(
                        name, seed, recipes, settings, Path(tmp), args.diagnose,
                        gru=not (args.no_gru or args.references_only),
                        figures=figures if seed == args.first_seed else None))
                    written = cli.save(args, rows, KEY, settings, earlier)[0]
        rows = written
        print(f"\nsettings: {json.dumps(settings)}, seeds {list(cli.seeds(args))}\n")
        if args.references_only:
            figures = None
    by_name: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_name.setdefault(row["dataset"], []).append(row)
    tables = "\n\n".join(table(name, runs) for name, runs in by_name.items())
    print(tables)
    cli.publish(args, {"long-range": tables})
    for name, runs in by_name.items():
        if figures is not None and models(runs[0]):
            long_range_curves(name, runs, models(runs[0]),
                              figures / f"long_range_curves_{name}.png")
