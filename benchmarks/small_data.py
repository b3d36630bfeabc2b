"""Small-and-medium data suite: the default flow against the closed-form references.

Every dataset is read the way a user would type it: the UEA/UCR archive files that ship inside
the ``aeon`` wheel (``pip install iresflow[benchmarks]``; nothing is downloaded at run time) go
through ``load_dataset(path_to_TRAIN.ts, test_path=path_to_TEST.ts)`` with their official
train/test splits, and the three shipped datasets through their names. Per dataset and seed:

* **flow**: :func:`iresflow.train.loop.train` with the default
  :class:`~iresflow.train.config.TrainConfig` (what ``iresflow train --data FILE --test-data
  FILE`` runs), then the product's evaluation (``evaluate_run(method="auto")``, the end of
  ``iresflow train``) with its per-sequence scores;
* **AR(p) Gaussian**: :class:`iresflow.models.reference.AutoregressiveGaussian`, :math:`p \\le 3`
  chosen on the validation split, refitted on train and validation;
* **sequence Gaussian**: a full-covariance Gaussian over the flattened sequence, fitted on train
  and validation, where it applies (fixed length, more fitting sequences than :math:`N D`);
* **GRU + MAF**: :class:`benchmarks.baselines.recurrent.RecurrentFlow` trained by
  :func:`iresflow.train.fit.fit` for ``--budget`` seconds (0: skipped);
* the per-sequence NLL distribution of the flow and of the AR Gaussian
  (:func:`iresflow.models.worst_cases.summarize_sequence_nll`: median, worst, sequences far
  above the median).

Run from the repository root::

    python -m benchmarks.small_data --seeds 3 --budget 60 --out docs/small_data.json \\
        --doc docs/small_data.md

prints the markdown table, writes the raw numbers to ``--out`` and, with ``--doc``, the page
between its ``<!-- small-data:start -->`` / ``<!-- small-data:end -->`` markers. The flow and
the GRU + MAF can run apart (``--budget 0``; ``--no-flow``) and be merged by ``--table-from``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.baselines.gaussian import SequenceGaussian
from benchmarks.baselines.recurrent import GRU_LR, GRU_PATIENCE, train_recurrent_flow
from benchmarks.results_report import replace_between_markers
from benchmarks.results_specs import FULL, SPECS, train_config
from iresflow.data.datasets import SequenceDataset, load_dataset
from iresflow.models.reference import AutoregressiveGaussian
from iresflow.models.worst_cases import summarize_sequence_nll

#: UEA/UCR archive datasets bundled in the aeon wheel, in the suite's order.
ARCHIVE = ("BasicMotions", "CardanoSentiment", "ItalyPowerDemand", "GunPoint", "ArrowHead",
           "Covid3Month", "PickupGestureWiimoteZ", "OSULeaf")
SHIPPED = ("japanese_vowels", "digits_rows", "co2_windows")
DATASETS = ARCHIVE + SHIPPED
MAX_AR_ORDER = 3
#: The trained models of a record (the closed-form references are in every record).
MODELS = ("flow", "gru_maf")
START, END = "<!-- small-data:start -->", "<!-- small-data:end -->"


def archive_files(name: str) -> tuple[Path, Path]:
    """The official ``_TRAIN.ts`` and ``_TEST.ts`` files of an archive dataset in aeon's wheel.

    The installed package is located without importing it (aeon's import is slow).

    Args:
        name: A dataset of :data:`ARCHIVE`.

    Returns:
        ``(train_path, test_path)``.

    Raises:
        ValueError: ``name`` is not in :data:`ARCHIVE`.
        ImportError: aeon is not installed.
        FileNotFoundError: the installed aeon does not ship the files.
    """
    if name not in ARCHIVE:
        raise ValueError(f"name must be one of {ARCHIVE}, got {name!r}")
    spec = importlib.util.find_spec("aeon")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the archive datasets ship with aeon: pip install iresflow[benchmarks]")
    folder = Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data" / name
    paths = folder / f"{name}_TRAIN.ts", folder / f"{name}_TEST.ts"
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing from the installed aeon")
    return paths


def data_settings(name: str) -> dict[str, str | None]:
    """The ``data`` and ``test_data`` settings a user would give for a dataset."""
    if name in SHIPPED:
        return {"data": name, "test_data": None}
    train_path, test_path = archive_files(name)
    return {"data": str(train_path), "test_data": str(test_path)}


def load(name: str, seed: int) -> SequenceDataset:
    """The dataset through iresflow's loader, as ``iresflow train`` loads it (warnings muted)."""
    settings = data_settings(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "split with fewer than 30 sequences"
        if settings["test_data"] is None:
            return load_dataset(name, seed=seed)
        return load_dataset(settings["data"], test_path=settings["test_data"], seed=seed)


def sequence_gaussian_applies(ds: SequenceDataset) -> str | None:
    """``None`` if the full-covariance sequence Gaussian applies, else the reason it does not."""
    if not (bool(ds.train.mask.all()) and bool(ds.val.mask.all()) and bool(ds.test.mask.all())):
        return "variable length"
    fitting = len(ds.train) + len(ds.val)
    if fitting <= ds.max_len * ds.features:
        return f"{fitting} sequences <= N D = {ds.max_len * ds.features}"
    return None


def distribution(nll: torch.Tensor) -> dict[str, Any]:
    """Per-sequence NLL summary as a JSON record."""
    return summarize_sequence_nll(nll).to_dict()


def run_flow(name: str, seed: int, run_dir: Path,
             settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """The default flow through the product path: ``train``, then ``evaluate_run``'s scores.

    Args:
        name: Dataset of :data:`DATASETS`.
        seed: Seed of the run (split and training).
        run_dir: Run folder (overwritten).
        settings: Settings of ``iresflow train`` that differ from the defaults (an ablation);
            recorded in the result.
    """
    from iresflow.runs.evaluate import evaluate_run
    from iresflow.runs.load import load_run
    from iresflow.train.config import TrainConfig
    from iresflow.train.loop import train

    settings = dict(settings or {})
    config = TrainConfig.from_dict({**data_settings(name), "seed": seed, **settings})
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        result = train(config, run_dir, overwrite=True, progress=False)
        run = load_run(run_dir)
        scores = run_dir / "scores.npz"
        evaluation = evaluate_run(run, split="test", method="auto",
                                  n_samples=config.eval_n_samples, seed=config.seed,
                                  scores=str(scores))
    per_sequence = torch.from_numpy(np.load(scores)["nll"])
    return {"test_nll": evaluation["nll"], "method": evaluation["method"],
            "epochs": result.epochs, "best_epoch": result.best_epoch,
            "stopped_early": result.stopped_early, "seconds": time.perf_counter() - start,
            "params": sum(p.numel() for p in run.model.parameters()),
            "position_norm": run.config.model.position_norm, "settings": settings,
            "sequences": distribution(per_sequence)}


def run_references(ds: SequenceDataset) -> dict[str, Any]:
    """The closed-form AR(p) Gaussian and, where it applies, the sequence Gaussian."""
    ar = AutoregressiveGaussian(ds.features, ds.max_len)
    val_nll = ar.fit_selected_order(ds.train, ds.val, MAX_AR_ORDER)
    log_prob = ar.log_prob(ds.test.x, ds.test.mask)
    record: dict[str, Any] = {"ar": {
        "test_nll": ds.nll(log_prob, ds.test), "order": ar.order, "order_val_nll": val_nll,
        "sequences": distribution(ds.sequence_nll(log_prob, ds.test))}}
    reason = sequence_gaussian_applies(ds)
    if reason is None:
        gauss = SequenceGaussian(ds.max_len, ds.features).fit(
            torch.cat([ds.train.x, ds.val.x]).double())
        record["sequence_gaussian"] = {
            "test_nll": ds.nll(gauss.log_prob(ds.test.x.double()), ds.test)}
    else:
        record["sequence_gaussian"] = {"skipped": reason}
    return record


def run_gru_maf(name: str, ds: SequenceDataset, seed: int, budget: float) -> dict[str, Any]:
    """The GRU + MAF baseline trained for ``budget`` optimisation seconds.

    Through :func:`~iresflow.train.fit.fit`, the loop of ``iresflow train``, with the results
    table's protocol for a baseline (:func:`benchmarks.results_specs.train_config`).
    """
    protocol = dataclasses.replace(FULL, max_seconds=budget, max_epochs=10_000,
                                   patience=GRU_PATIENCE)
    config = dataclasses.replace(train_config(SPECS["gru_maf"], name, GRU_LR, seed, protocol),
                                 **data_settings(name))
    row = train_recurrent_flow(config, ds)
    return {key: row[key] for key in ("test_nll", "epochs", "stopped")}


def run_dataset(name: str, seed: int, budget: float, settings: dict[str, Any] | None,
                work: Path, flow: bool = True) -> dict[str, Any]:
    """Every model of the suite on one dataset and seed (the flow unless ``flow=False``, with
    the :func:`run_flow` ``settings``)."""
    ds = load(name, seed)
    record: dict[str, Any] = {
        "dataset": name, "seed": seed, "features": ds.features, "max_len": ds.max_len,
        "sizes": [len(ds.train), len(ds.val), len(ds.test)], "unit": ds.unit,
        "variable_length": not bool(ds.train.mask.all() and ds.test.mask.all())}
    record.update(run_references(ds))
    if flow:
        record["flow"] = run_flow(name, seed, work / f"{name}-seed{seed}", settings)
    if budget > 0:
        record["gru_maf"] = run_gru_maf(name, ds, seed, budget)
    return record


def merge_records(files: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Records of several runs, one per dataset and seed: the first file that ran a model
    gives its entry (``flow``, ``gru_maf``), so a flow-only and a baseline-only run combine.

    Args:
        files: The ``records`` of every ``--out`` file, in order of precedence.

    Returns:
        One record per (dataset, seed), in the order they first appear.
    """
    merged: dict[tuple[str, int], dict[str, Any]] = {}
    for records in files:
        for record in records:
            key = (record["dataset"], record["seed"])
            if key not in merged:
                merged[key] = dict(record)
                continue
            for model in MODELS:
                if model in record and model not in merged[key]:
                    merged[key][model] = record[model]
    return list(merged.values())


# ------------------------------------------------------------------------------------------------
# table


def _mean(values: Sequence[float]) -> str:
    """``mean`` or ``mean ± sd`` over seeds, 3 decimals (4 significant digits when large)."""
    if not values:
        return "—"
    mean = statistics.fmean(values)
    text = f"{mean:.3f}" if abs(mean) < 100 else f"{mean:.1f}"
    return text if len(values) == 1 else f"{text} ± {statistics.stdev(values):.3f}"


def _worst(summaries: Sequence[dict[str, Any]]) -> str:
    """``median / worst / far-above count``: the median averaged over seeds, the worst sequence
    of all seeds and the far-above counts summed over seeds."""
    if not summaries:
        return "—"
    median = statistics.fmean(s["median"] for s in summaries)
    far = sum(s["far_above"] for s in summaries)
    worst = max(s["worst"] for s in summaries)
    worst_text = f"{worst:.2f}" if abs(worst) < 100 else f"{worst:.0f}"
    return f"{median:.2f} / {worst_text} / {far}"


def markdown_table(records: Sequence[dict[str, Any]]) -> str:
    """One row per dataset: mean test NLL over seeds per model, then per-sequence worst cases.

    Args:
        records: :func:`run_dataset` records (several seeds of a dataset are averaged).

    Returns:
        A markdown table; the best NLL of every row is in bold, and † marks a GRU + MAF that
        reached its time budget (rather than early stopping) on at least one seed.
    """
    names = sorted(dict.fromkeys(r["dataset"] for r in records),  # the suite's order first
                   key=lambda name: DATASETS.index(name) if name in DATASETS else len(DATASETS))
    lines = [
        "| dataset | train/val/test | D | N | unit | iresflow default | AR(p) Gaussian (p) | "
        "sequence Gaussian | GRU + MAF | flow: median / worst / far | "
        "AR: median / worst / far |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        rows = [r for r in records if r["dataset"] == name]
        first = rows[0]
        columns = {
            "flow": [r["flow"]["test_nll"] for r in rows if "flow" in r],
            "ar": [r["ar"]["test_nll"] for r in rows],
            "sequence_gaussian": [r["sequence_gaussian"]["test_nll"] for r in rows
                                  if "test_nll" in r["sequence_gaussian"]],
            "gru_maf": [r["gru_maf"]["test_nll"] for r in rows if "gru_maf" in r],
        }
        means = {k: statistics.fmean(v) for k, v in columns.items() if v}
        best = min(means.values())
        cells = {k: (f"**{_mean(v)}**" if v and means[k] == best else _mean(v))
                 for k, v in columns.items()}
        if any(r.get("gru_maf", {}).get("stopped") == "time" for r in rows):
            cells["gru_maf"] += " †"
        flow_sequences = [r["flow"]["sequences"] for r in rows if "flow" in r]
        orders = "/".join(str(r["ar"]["order"]) for r in rows)
        sizes = "/".join(str(s) for s in first["sizes"])
        length = f"≤ {first['max_len']}" if first["variable_length"] else str(first["max_len"])
        lines.append(
            f"| {name} | {sizes} | {first['features']} | {length} | {first['unit']} | "
            f"{cells['flow']} | {cells['ar']} ({orders}) | {cells['sequence_gaussian']} | "
            f"{cells['gru_maf']} | {_worst(flow_sequences)} | "
            f"{_worst([r['ar']['sequences'] for r in rows])} |")
    return "\n".join(lines)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=DATASETS,
                        metavar="NAME", help=f"datasets (default: all of {', '.join(DATASETS)})")
    parser.add_argument("--seeds", type=int, default=1,
                        help="number of seeds: FIRST..FIRST+S-1 (default: 1)")
    parser.add_argument("--first-seed", type=int, default=0, metavar="FIRST",
                        help="first seed (default: 0), to run seeds in separate processes")
    parser.add_argument("--budget", type=float, default=60.0,
                        help="optimisation seconds of the GRU + MAF (0: skip it; default: 60)")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                        help="settings of iresflow train for the flow that differ from the "
                        "defaults, e.g. position_norm=off base=multivariate-t (values read as "
                        "JSON where they parse, else as text)")
    parser.add_argument("--no-flow", action="store_true",
                        help="skip the flow: only the references and the GRU + MAF")
    parser.add_argument("--epochs", type=int, default=None,
                        help="epochs of the flow (default: iresflow train's)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/small_data.json"))
    parser.add_argument("--doc", type=Path, default=None,
                        help="also write the table into this page between its markers")
    parser.add_argument("--table-from", type=Path, nargs="+", default=None, metavar="JSON",
                        help="run nothing: print (and --doc) the table of earlier --out "
                        "files, merged by dataset and seed (the first file with a model's "
                        "entry gives it)")
    args = parser.parse_args(argv)
    if (args.seeds < 1 or args.first_seed < 0 or args.budget < 0
            or (args.epochs is not None and args.epochs < 1)):
        parser.error("--seeds and --epochs must be positive, --first-seed and --budget >= 0")
    args.settings = {} if args.epochs is None else {"epochs": args.epochs}
    for item in args.set:
        key, sep, text = item.partition("=")
        if not sep or not key:
            parser.error(f"--set takes KEY=VALUE, got {item!r}")
        try:
            args.settings[key] = json.loads(text)
        except json.JSONDecodeError:
            args.settings[key] = text
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the suite, print the table, write the JSON (and the page)."""
    args = _parse(argv)
    if args.table_from is not None:
        records = merge_records([json.loads(path.read_text())["records"]
                                 for path in args.table_from])
        return _report(records, args.doc)
    records = []
    with tempfile.TemporaryDirectory() as work:
        for name in args.datasets:
            for seed in range(args.first_seed, args.first_seed + args.seeds):
                record = run_dataset(name, seed, args.budget, args.settings, Path(work),
                                     flow=not args.no_flow)
                records.append(record)
                scores = {model: f"{record[model]['test_nll']:.3f}" for model in MODELS
                          if model in record}
                print(f"{name} seed {seed}: AR({record['ar']['order']}) "
                      f"{record['ar']['test_nll']:.3f}, {scores}", file=sys.stderr, flush=True)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps({"command": " ".join(sys.argv),
                                                "records": records}, indent=1) + "\n")
    return _report(records, args.doc)


def _report(records: list[dict[str, Any]], doc: Path | None) -> int:
    """Print the table (and write it into ``doc``); 1 if a flow NLL is not finite."""
    table = markdown_table(records)
    print(table)
    if doc is not None:
        doc.write_text(replace_between_markers(doc.read_text(), table, str(doc), START, END))
    return 0 if all(math.isfinite(r["flow"]["test_nll"]) for r in records if "flow" in r) else 1


if __name__ == "__main__":
    raise SystemExit(main())
