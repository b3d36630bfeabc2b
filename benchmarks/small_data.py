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
* **GRU + MAF** and **Transformer + MAF** (``--peers``): :class:`benchmarks.baselines.recurrent.
  RecurrentFlow` with either encoder of the past, trained by :func:`iresflow.train.fit.fit` for
  ``--budget`` seconds (0: skipped; ``flow``: the flow's wall time on the same dataset and seed,
  at least 60 s);
* the per-sequence NLL distribution of the flow and of the AR Gaussian
  (:func:`iresflow.models.worst_cases.summarize_sequence_nll`: median, worst, sequences far
  above the median).

The held-out datasets (:mod:`benchmarks.held_out`, ``--datasets uschange ...``) are read from
the long-format tables a user would have, with ``iresflow train``'s table settings.

Run from the repository root::

    python -m benchmarks small_data --seeds 3 --budget 60 --out docs/small_data.json \\
        --doc docs/small_data.md
    python -m benchmarks small_data --datasets uschange m1_yearly daphnet bleeding elnino \\
        fertility --seeds 3 --budget flow --peers gru transformer --out docs/held_out.json \\
        --doc docs/held_out.md

prints the markdown table, writes the records (one per dataset and seed) to ``--out`` and,
with ``--doc``, the table into the page between its ``<!-- small-data:start -->`` /
``<!-- small-data:end -->`` markers. The flow and the peers can run apart (``--budget 0``;
``--no-flow``) and be merged by ``--table-from``. Every model trains on ``--threads`` torch
threads (default one), so that two suites can share two cores without slowing each other down.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import math
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks import cli, records
from benchmarks.baselines.gaussian import SequenceGaussian
from benchmarks.baselines.recurrent import ENCODERS, PEER_NAMES, train_recurrent_flow
from benchmarks.held_out import HELD_OUT, aeon_file, table_settings
from benchmarks.results_specs import gru_maf_config, variable_length
from iresflow.data.datasets import SequenceDataset
from iresflow.models.reference import AutoregressiveGaussian
from iresflow.models.worst_cases import summarize_sequence_nll
from iresflow.runs.evaluate import evaluate_run
from iresflow.runs.load import load_run
from iresflow.train.config import TrainConfig
from iresflow.train.factories import load_data
from iresflow.train.loop import train
from iresflow.train.selection import candidate_paths, choose

#: UEA/UCR archive datasets bundled in the aeon wheel, in the suite's order.
ARCHIVE = ("BasicMotions", "CardanoSentiment", "ItalyPowerDemand", "GunPoint", "ArrowHead",
           "Covid3Month", "PickupGestureWiimoteZ", "OSULeaf")
SHIPPED = ("japanese_vowels", "digits_rows", "co2_windows")
DATASETS = ARCHIVE + SHIPPED
MAX_AR_ORDER = 3
#: The record key and the table's name of each peer (an encoder of the past).
PEERS = {encoder: (f"{encoder}_maf", PEER_NAMES[encoder]) for encoder in ENCODERS}
#: The least budget of a peer given the flow's wall time (``--budget flow``), in seconds.
MIN_MATCHED_BUDGET = 60.0
#: The fields that identify a record.
KEY = ("dataset", "seed")


def archive_files(name: str) -> tuple[Path, Path]:
    """The official ``_TRAIN.ts`` and ``_TEST.ts`` files of an archive dataset in aeon's wheel.

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
    return aeon_file(name, f"{name}_TRAIN.ts"), aeon_file(name, f"{name}_TEST.ts")


@functools.cache
def _held_out_folder() -> Path:
    """This process's folder of the held-out datasets' table files, removed at its exit."""
    folder = tempfile.mkdtemp(prefix="iresflow-held-out-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return Path(folder)


@functools.cache
def _held_out_settings(name: str) -> dict[str, Any]:
    """The settings of a held-out dataset, its files written once per process."""
    return table_settings(name, _held_out_folder())


def data_settings(name: str) -> dict[str, Any]:
    """The ``data`` and ``test_data`` settings a user would give for a dataset (and the table
    settings of a held-out one)."""
    if name in SHIPPED:
        return {"data": name, "test_data": None}
    if name in HELD_OUT:
        return dict(_held_out_settings(name))
    train_path, test_path = archive_files(name)
    return {"data": str(train_path), "test_data": str(test_path)}


def load(name: str, seed: int) -> SequenceDataset:
    """The dataset through iresflow's loader, as ``iresflow train`` loads it (warnings muted)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "split with fewer than 30 sequences"
        return load_data(TrainConfig.from_dict({**data_settings(name), "seed": seed}))


def sequence_gaussian_applies(ds: SequenceDataset) -> str | None:
    """``None`` if the full-covariance sequence Gaussian applies, else the reason it does not."""
    if variable_length(ds):
        return "variable length"
    fitting = len(ds.train) + len(ds.val)
    if fitting <= ds.max_len * ds.features:
        return f"{fitting} sequences <= N D = {ds.max_len * ds.features}"
    return None


def run_flow(name: str, seed: int, run_dir: Path,
             settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """The default flow through the product path: ``train``, then ``evaluate_run``'s scores.

    With an ``alternative`` (the default's) the record also names the candidate kept and gives
    every candidate's validation and test NLL; ``seconds`` covers all of their training.

    Args:
        name: Dataset of :data:`DATASETS`.
        seed: Seed of the run (split and training).
        run_dir: Run folder (overwritten).
        settings: Settings of ``iresflow train`` that differ from the defaults (an ablation);
            recorded in the result.
    """
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
        seconds = time.perf_counter() - start
        kept = choose(result.selection).name if result.selection else None
        candidates = [{**asdict(candidate), "test_nll": evaluation["nll"] if candidate.name == kept
                       else evaluate_run(
                           load_run(candidate_paths(result.paths, candidate.name).root),
                           split="test", method="auto", n_samples=config.eval_n_samples,
                           seed=config.seed, save=False)["nll"]}
                      for candidate in result.selection if candidate.error is None]
    per_sequence = torch.from_numpy(np.load(scores)["nll"])
    record = {"test_nll": evaluation["nll"], "method": evaluation["method"],
              "epochs": result.epochs, "best_epoch": result.best_epoch,
              "stopped_early": result.stopped_early, "seconds": seconds,
              "params": sum(p.numel() for p in run.model.parameters()),
              "position_norm": run.config.model.position_norm, "settings": settings,
              "sequences": summarize_sequence_nll(per_sequence).to_dict()}
    if kept is not None:  # every candidate's validation and test NLL, and the one kept
        record.update(kept=kept, candidates=candidates)
    return record


def run_references(ds: SequenceDataset) -> dict[str, Any]:
    """The closed-form AR(p) Gaussian and, where it applies, the sequence Gaussian."""
    ar = AutoregressiveGaussian(ds.features, ds.max_len)
    val_nll = ar.fit_selected_order(ds.train, ds.val, MAX_AR_ORDER)
    log_prob = ar.log_prob(ds.test.x, ds.test.mask)
    record: dict[str, Any] = {"ar": {
        "test_nll": ds.nll(log_prob, ds.test), "order": ar.order, "order_val_nll": val_nll,
        "sequences": summarize_sequence_nll(ds.sequence_nll(log_prob, ds.test)).to_dict()}}
    reason = sequence_gaussian_applies(ds)
    if reason is None:
        gauss = SequenceGaussian(ds.max_len, ds.features).fit(
            torch.cat([ds.train.x, ds.val.x]).double())
        record["sequence_gaussian"] = {
            "test_nll": ds.nll(gauss.log_prob(ds.test.x.double()), ds.test)}
    else:
        record["sequence_gaussian"] = {"skipped": reason}
    return record


def run_peer(name: str, ds: SequenceDataset, seed: int, budget: float,
             encoder: str = "gru") -> dict[str, Any]:
    """A GRU + MAF or Transformer + MAF peer trained for ``budget`` optimisation seconds.

    Through :func:`~iresflow.train.fit.fit`, the loop of ``iresflow train``, with the results
    table's protocol for a baseline (:func:`benchmarks.results_specs.train_config`).
    """
    config = gru_maf_config(name, seed, budget, **data_settings(name))
    row = train_recurrent_flow(config, ds, encoder=encoder)
    return {"budget": budget, **{key: row[key] for key in ("test_nll", "epochs", "stopped")}}


def run_dataset(name: str, seed: int, budget: float | str, settings: dict[str, Any] | None,
                work: Path, flow: bool = True, peers: Sequence[str] = ("gru",)) -> dict[str, Any]:
    """Every model of the suite on one dataset and seed (the flow unless ``flow=False``, with
    the :func:`run_flow` ``settings``; the ``peers`` for ``budget`` seconds, or ``"flow"``: the
    flow's wall time, at least :data:`MIN_MATCHED_BUDGET`)."""
    ds = load(name, seed)
    record: dict[str, Any] = {
        "dataset": name, "seed": seed, "features": ds.features, "max_len": ds.max_len,
        "sizes": [len(ds.train), len(ds.val), len(ds.test)], "unit": ds.unit,
        "variable_length": variable_length(ds)}
    record.update(run_references(ds))
    if flow:
        record["flow"] = run_flow(name, seed, work / f"{name}-seed{seed}", settings)
    if budget == "flow":
        budget = max(MIN_MATCHED_BUDGET, record["flow"]["seconds"] if flow else 0.0)
    if float(budget) > 0:
        for encoder in peers:
            record[PEERS[encoder][0]] = run_peer(name, ds, seed, float(budget), encoder)
    return record


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


def flow_label(rows: Sequence[dict[str, Any]]) -> str:
    """The flow's column header: ``iresflow default``, or the settings of ``iresflow train``
    that differ from the defaults and that every record's flow shares (an ablation).

    Example:
        >>> flow_label([{"flow": {"settings": {"layers": ["autoregressive", "mlp"], "seed": 1}}},
        ...             {"flow": {"settings": {"layers": ["autoregressive", "mlp"]}}}])
        'iresflow, layers = autoregressive,mlp'
    """
    settings = [r["flow"].get("settings", {}) for r in rows if "flow" in r]
    shared = {key: value for key, value in (settings[0] if settings else {}).items()
              if all(other.get(key) == value for other in settings)}
    if not shared:
        return "iresflow default"
    return "iresflow, " + ", ".join(
        f"{key} = {','.join(map(str, value)) if isinstance(value, list) else value}"
        for key, value in shared.items())


def _in_suite_order(names: Iterable[str]) -> list[str]:
    """The distinct ``names``, those of the suite and the held-out sets in that order first."""
    order = DATASETS + HELD_OUT
    return sorted(dict.fromkeys(names),
                  key=lambda name: order.index(name) if name in order else len(order))


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """One row per dataset: mean test NLL over seeds per model, then per-sequence worst cases.

    Args:
        rows: :func:`run_dataset` records (several seeds of a dataset are averaged).

    Returns:
        A markdown table; the best NLL of every row is in bold, and † marks a peer that
        reached its time budget (rather than early stopping) on at least one seed. The
        Transformer + MAF has a column where a record has it. After the flow's NLL of a run
        that chose among candidates, the initials of the one kept on each seed (c:
        configured, r: recurrent, m: maf).
    """
    names = _in_suite_order(r["dataset"] for r in rows)
    peers = [key for key, _ in PEERS.values() if key == "gru_maf" or any(key in r for r in rows)]
    table = []
    for name in names:
        runs = [r for r in rows if r["dataset"] == name]
        first = runs[0]
        columns = {
            "flow": [r["flow"]["test_nll"] for r in runs if "flow" in r],
            "ar": [r["ar"]["test_nll"] for r in runs],
            "sequence_gaussian": [r["sequence_gaussian"]["test_nll"] for r in runs
                                  if "test_nll" in r["sequence_gaussian"]],
            **{key: [r[key]["test_nll"] for r in runs if key in r] for key in peers},
        }
        means = {k: statistics.fmean(v) for k, v in columns.items() if v}
        best = min(means.values())
        cells = {k: (f"**{_mean(v)}**" if v and means[k] == best else _mean(v))
                 for k, v in columns.items()}
        for key in peers:
            if any(r.get(key, {}).get("stopped") == "time" for r in runs):
                cells[key] += " †"
        flow_sequences = [r["flow"]["sequences"] for r in runs if "flow" in r]
        orders = "/".join(str(r["ar"]["order"]) for r in runs)
        sizes = "/".join(str(s) for s in first["sizes"])
        length = f"≤ {first['max_len']}" if first["variable_length"] else str(first["max_len"])
        kept = [r["flow"]["kept"] for r in runs if "kept" in r.get("flow", {})]
        if kept:
            cells["flow"] += " (" + "/".join(k[0] for k in kept) + ")"
        table.append([name, sizes, str(first["features"]), length, first["unit"], cells["flow"],
                      f"{cells['ar']} ({orders})", cells["sequence_gaussian"],
                      *(cells[key] for key in peers),
                      _worst(flow_sequences), _worst([r["ar"]["sequences"] for r in runs])])
    names_of = dict(PEERS.values())
    header = ["dataset", "train/val/test", "D", "N", "unit", flow_label(rows),
              "AR(p) Gaussian (p)", "sequence Gaussian", *(names_of[key] for key in peers),
              "flow: median / worst / far", "AR: median / worst / far"]
    return records.markdown_table(header, table)


def candidates_table(rows: Sequence[dict[str, Any]]) -> str:
    """One row per dataset of runs that chose among candidates: each candidate's test NLL, the
    one kept on each seed, the kept model's NLL and the best candidate's on test.

    Args:
        rows: :func:`run_dataset` records whose flow has ``candidates`` (others are skipped).

    Returns:
        A markdown table (means over seeds; a dash where a dataset had no such candidate); the
        last column counts the seeds on which the validation split kept the candidate that was
        best on test.
    """
    chose = [r for r in rows if "candidates" in r.get("flow", {})]
    names = _in_suite_order(r["dataset"] for r in chose)
    kinds = list(dict.fromkeys(c["name"] for r in chose for c in r["flow"]["candidates"]))
    table = []
    for name in names:
        runs = [r for r in chose if r["dataset"] == name]
        tests = [{c["name"]: c["test_nll"] for c in r["flow"]["candidates"]} for r in runs]
        best = [min(test.values()) for test in tests]
        right = sum(test[r["flow"]["kept"]] == low
                    for test, r, low in zip(tests, runs, best, strict=True))
        table.append([name, *(_mean([test[k] for test in tests if k in test]) for k in kinds),
                      "/".join(r["flow"]["kept"][0] for r in runs),
                      _mean([r["flow"]["test_nll"] for r in runs]), _mean(best),
                      f"{right} of {len(runs)}"])
    header = ["dataset", *kinds, "kept (c/r/m)", "kept model", "best on test",
              "validation chose the best"]
    return records.markdown_table(header, table)


def with_peers(rows: Sequence[dict[str, Any]], others: Sequence[dict[str, Any]]
               ) -> list[dict[str, Any]]:
    """``rows`` with the peers' entries of the ``others`` of the same dataset and seed added
    where a row has none; a row without such an other stays as it is (no flow or reference
    entry is taken from ``others``).

    Example:
        >>> rows = [{"dataset": "a", "seed": 0, "flow": 1.0}, {"dataset": "a", "seed": 1}]
        >>> with_peers(rows, [{"dataset": "a", "seed": 0, "flow": 9.0, "gru_maf": 2.0}])
        [{'gru_maf': 2.0, 'dataset': 'a', 'seed': 0, 'flow': 1.0}, {'dataset': 'a', 'seed': 1}]
    """
    peers = {tuple(other[k] for k in KEY): {key: other[key] for key, _ in PEERS.values()
                                            if key in other} for other in others}
    return [{**peers.get(tuple(row[k] for k in KEY), {}), **row} for row in rows]


def _budget(text: str) -> float | str:
    """A ``--budget``: seconds ``>= 0`` or ``flow``."""
    if text == "flow":
        return text
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be seconds or 'flow', got {text!r}") from None
    if not seconds >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {text!r}")
    return seconds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cli.add_datasets(parser, DATASETS + HELD_OUT, default=DATASETS)
    cli.add_seeds(parser)
    parser.add_argument("--budget", type=_budget, default=60.0,
                        help="optimisation seconds of each peer (0: skip them; 'flow': the "
                        f"flow's wall time, at least {MIN_MATCHED_BUDGET:g}; default: 60)")
    parser.add_argument("--peers", nargs="+", choices=ENCODERS, default=["gru"],
                        help="the peers' encoders of the past (default: gru)")
    cli.add_settings(parser, epochs=None)
    cli.add_threads(parser)
    parser.add_argument("--no-flow", action="store_true",
                        help="skip the flow: only the references and the peers")
    cli.add_runs(parser)
    cli.add_records(parser, "small_data", ("small-data",))
    parser.add_argument("--peers-from", type=Path, default=None, metavar="JSON",
                        help="with --table-from: the peers' entries of the records of the same "
                        "dataset and seed in this file, where the tables' own have none")
    parser.add_argument("--table", choices=("suite", "candidates"), default="suite",
                        help="suite: every model per dataset; candidates: the test NLL of each "
                        "candidate of runs that chose among several, and which was kept "
                        "(default: suite)")
    parser.add_argument("--block", dest="blocks", type=lambda name: (name,),
                        default=("small-data",),
                        help="the name of the block of the --doc pages the table goes into "
                        "(default: small-data)")


def run(args: argparse.Namespace) -> int:
    """Run the suite (or read it, ``--table-from``), print and write the table; 1 if a flow NLL
    is not finite."""
    if args.table_from is not None:
        rows = cli.table_from(args, KEY)["records"]
        if args.peers_from is not None:
            rows = with_peers(rows, records.load(args.peers_from)["records"])
    else:
        earlier, rows = cli.stored(args, {}), []
        with tempfile.TemporaryDirectory() as temporary:
            work = Path(temporary) if args.runs is None else args.runs
            for name in args.datasets:
                for seed in cli.seeds(args):
                    record = run_dataset(name, seed, args.budget, cli.settings(args), work,
                                         flow=not args.no_flow, peers=args.peers)
                    rows.append(record)
                    scores = {model: f"{record[model]['test_nll']:.3f}" for model in
                              ("flow", *(key for key, _ in PEERS.values())) if model in record}
                    print(f"{name} seed {seed}: AR({record['ar']['order']}) "
                          f"{record['ar']['test_nll']:.3f}, {scores}", file=sys.stderr,
                          flush=True)
                    written = cli.save(args, rows, KEY, {}, earlier)[0]
        rows = written
    table = markdown_table(rows) if args.table == "suite" else candidates_table(rows)
    print(table)
    cli.publish(args, {args.blocks[0]: table})
    return 0 if all(math.isfinite(r["flow"]["test_nll"]) for r in rows if "flow" in r) else 1
