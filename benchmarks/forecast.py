"""Forecast suite: the causal flow's forecasts against seasonal-naive, AR(p), ETS and GRU + MAF.

On every dataset of the small-data suite (:mod:`benchmarks.small_data`, its files and splits),
the last ``H`` frames of every test sequence are held out
(:func:`iresflow.runs.forecast.hold_out`; ``H`` is a quarter of the median test length, at
most 24) and forecast from the frames before them with ``S`` draws each; every forecaster is
scored in the data's original units by :func:`iresflow.runs.scoring.forecast_scores` (CRPS
averaged over features, energy score, coverage of the central 50% and 90% intervals):

* **flow (causal)**: ``iresflow train`` with every default but ``causal = true`` (and the
  settings of ``--set``, an ablation, recorded with it) (:func:`iresflow.train.loop.train`),
  then :func:`iresflow.runs.forecast.forecast_run`, the
  path of ``iresflow forecast``, with its defaults ``candidate = "auto"`` and ``noise =
  "auto"`` (the model and the noise it chose, ``candidate`` and ``noise``, and the validation
  CRPS of every option, ``validation``, are recorded; records made before the model was chosen
  have ``noise_validation``, the run's own model's two); the scores of the run's own model's
  forecasts with each noise, ``given`` and ``prior``, are recorded too, as ``given_noise`` and
  ``prior_noise`` (tables ``noise`` and ``candidates``); its test NLL
  (``evaluate_run(method="auto")``) is recorded beside the default flow's of
  ``--default-from`` (the small-data records);
* **seasonal naive**: the last season repeated, the period chosen on the validation split;
* **AR(p) Gaussian**: the closed-form reference (order chosen on validation) drawn forward;
* **ETS**: damped-trend exponential smoothing fitted to every univariate test sequence alone
  (univariate data only);
* **GRU + MAF**: :func:`benchmarks.baselines.recurrent.train_recurrent_flow` for ``--budget``
  seconds, sampled frame by frame.

The seconds each forecaster takes to draw its forecasts of the held-out test sequences (the
flow's with the validation forecasts that choose its noise), and
to draw the ``S`` forecasts of one sequence (the first; the median of three calls after a
warm-up), are recorded with the scores; the tables leave them out, since records of
different runs may be merged into one table (``--table-from``), and ``python -m benchmarks
sampling --run RUN --horizon H`` times the forecasters side by side. The second table gives
the causal flow's test NLL beside the default flow's and counts the causal runs whose best
epoch is their last (cut short); ``--table noise`` prints instead every flow forecast with
both noises and the noise ``auto`` chose, ``--table candidates`` the run's own model's
forecast beside the chosen model's. The trained runs are removed afterwards unless
``--runs DIR`` keeps them (``DIR/DATASET-seedS``), to be forecast again without
training (``--reforecast``). Run from the repository root::

    python -m benchmarks forecast --seeds 3 --budget 60 --out docs/forecast.json \\
        --doc docs/forecasting.md
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from benchmarks import cli, records
from benchmarks.baselines.forecasters import (
    ar_forecast,
    choose_period,
    ets_forecast,
    seasonal_naive,
)
from benchmarks.baselines.recurrent import GRU_HIDDEN, RecurrentFlow, train_recurrent_flow
from benchmarks.results_specs import gru_maf_config
from benchmarks.small_data import DATASETS, MAX_AR_ORDER, data_settings, load
from benchmarks.timing import median_seconds
from iresflow.data.datasets import SequenceDataset
from iresflow.models.forecasting import FORECAST_NOISE
from iresflow.models.reference import AutoregressiveGaussian
from iresflow.runs.evaluate import evaluate_run
from iresflow.runs.forecast import HeldOut, forecast_run, held_out_truth, hold_out, raw_frames
from iresflow.runs.load import load_candidate, load_run
from iresflow.runs.scoring import forecast_scores
from iresflow.runs.settings import KEPT
from iresflow.train.config import TrainConfig
from iresflow.train.loop import train
from iresflow.train.selection import choose

#: Longest horizon forecast.
MAX_HORIZON = 24
#: The fields that identify a record.
KEY = ("dataset", "seed")
MODELS = ("flow", "seasonal_naive", "ar", "ets", "gru_maf")
#: The fields of a flow record that its training gives (the others, its forecasts).
TRAINING_FIELDS = ("test_nll", "epochs", "kept", "best_epoch", "train_seconds", "settings")
NAMES = {"flow": "flow (causal)", "seasonal_naive": "seasonal naive", "ar": "AR(p) Gaussian",
         "ets": "ETS", "gru_maf": "GRU + MAF"}


def horizon_of(ds: SequenceDataset) -> int:
    """A quarter of the median test length, between 1 and :data:`MAX_HORIZON`."""
    return max(1, min(MAX_HORIZON, int(ds.test.frames.median()) // 4))


def _scores(ds: SequenceDataset, held: HeldOut, draws: Tensor, seconds: float
            ) -> dict[str, Any]:
    """The scores of model-space draws ``(S, B, H, D)`` in original units, and their time."""
    raw, truth = raw_frames(ds, draws.float()), held_out_truth(ds, held)
    return forecast_scores(raw.double(), truth.double(), held.truth_mask) | {"seconds": seconds}


def run_flow(name: str, ds: SequenceDataset, seed: int, horizon: int, num: int,
             run_dir: Path, held: HeldOut, settings: dict[str, Any] | None = None
             ) -> dict[str, Any]:
    """The causal flow through the product path: train, evaluate the test split, forecast the
    test sequences of ``ds`` (:func:`forecast_flow`). ``kept`` names the candidate the run kept
    (``None``: a run of one model)."""
    config = TrainConfig.from_dict({**data_settings(name), "seed": seed, "causal": True,
                                    **(settings or {})})
    begin = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        result = train(config, run_dir, overwrite=True, progress=False)
        evaluation = evaluate_run(load_run(run_dir), split="test", method="auto", seed=seed,
                                  save=False, reference=False)
    trained = time.perf_counter() - begin
    return forecast_flow(run_dir, ds, seed, horizon, num, held) | {
        "test_nll": evaluation["nll"], "epochs": result.epochs,
        "kept": choose(result.selection).name if result.selection else None,
        "best_epoch": result.best_epoch, "train_seconds": trained}


def forecast_flow(run_dir: Path, ds: SequenceDataset, seed: int, horizon: int, num: int,
                  held: HeldOut) -> dict[str, Any]:
    """The forecasts of a trained causal run of the test sequences of ``ds``:
    :func:`~iresflow.runs.forecast.forecast_run` with its defaults (model and noise chosen on
    validation: ``candidate``, ``noise``, ``validation``), and the run's own model's with each
    noise (``given_noise``, ``prior_noise``); ``latency``: the median seconds of the chosen
    model's ``num`` draws of the first held-out sequence, ``peer_latency`` those of a GRU + MAF
    (timed untrained: its cost does not depend on its weights), timed in turn."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        run = load_run(run_dir)
    run = dataclasses.replace(run, dataset=dataclasses.replace(run.dataset, test=ds.test))
    begin = time.perf_counter()
    forecast = forecast_run(run, horizon=horizon, num=num, seed=seed)
    seconds = time.perf_counter() - begin
    fixed = {f"{noise}_noise": forecast_run(run, horizon=horizon, num=num, seed=seed,
                                            noise=noise, candidate=KEPT).scores
             for noise in FORECAST_NOISE}
    assert forecast.scores is not None
    drew = run if forecast.candidate == KEPT else load_candidate(run, forecast.candidate)
    past, observed = held.x[:1], held.observed[:1]
    start = torch.where(observed[..., None], past, 0.0)
    peer = RecurrentFlow(ds.features, ds.max_len, hidden=GRU_HIDDEN).eval()
    timings: dict[str, list[float]] = {"flow": [], "peer": []}
    for _ in range(3):  # in turn, so that a change of the machine's load reaches both
        timings["flow"].append(median_seconds(lambda: drew.model.forecast(
            start, observed, horizon=horizon, num_samples=num)))
        timings["peer"].append(median_seconds(lambda: peer.forecast(past, observed, horizon,
                                                                      num)))
    return forecast.scores | {
        "seconds": seconds, "latency": statistics.median(timings["flow"]),
        "peer_latency": statistics.median(timings["peer"]), "candidate": forecast.candidate,
        "noise": forecast.noise, "validation": forecast.validation_crps, **fixed,
        "converged": forecast.diagnostics["converged"]}


def run_classical(ds: SequenceDataset, held: HeldOut, seed: int, horizon: int, num: int
                  ) -> dict[str, Any]:
    """Seasonal naive, the AR(p) Gaussian and (univariate data) ETS."""
    record: dict[str, Any] = {}
    validation = hold_out(ds.val, horizon)
    period = choose_period(validation.x, validation.observed, validation.truth,
                           validation.truth_mask)
    begin = time.perf_counter()
    point = seasonal_naive(held.x, held.observed, horizon, period)
    record["seasonal_naive"] = _scores(ds, held, point, time.perf_counter() - begin) | {
        "period": period}
    ar = AutoregressiveGaussian(ds.features, ds.max_len)
    ar.fit_selected_order(ds.train, ds.val, MAX_AR_ORDER)
    begin = time.perf_counter()
    draws = ar_forecast(ar, held.x, held.observed, horizon, num,
                        torch.Generator().manual_seed(seed))
    record["ar"] = _scores(ds, held, draws, time.perf_counter() - begin) | {"order": ar.order}
    if ds.features == 1:
        begin = time.perf_counter()
        draws = ets_forecast(held.x, held.observed, horizon, num, seed)
        record["ets"] = _scores(ds, held, draws, time.perf_counter() - begin)
    return record


def run_gru_maf(name: str, ds: SequenceDataset, held: HeldOut, seed: int, horizon: int,
                num: int, budget: float) -> dict[str, Any]:
    """The GRU + MAF of the small-data suite, trained for ``budget`` seconds, forecasting frame
    by frame."""
    row = train_recurrent_flow(gru_maf_config(name, seed, budget, **data_settings(name)), ds)
    model = row["model"].eval()
    begin = time.perf_counter()
    parts = [model.forecast(held.x[batch], held.observed[batch], horizon, num,
                            torch.Generator().manual_seed(seed + k))
             for k, batch in enumerate(torch.arange(len(held.x)).split(64))]
    draws = torch.cat(parts, dim=1)
    scores = _scores(ds, held, draws, time.perf_counter() - begin)
    one = median_seconds(lambda: model.forecast(held.x[:1], held.observed[:1], horizon, num))
    return scores | {"latency": one, "test_nll": row["test_nll"], "epochs": row["epochs"],
                     "stopped": row["stopped"]}


def first_test(ds: SequenceDataset, limit: int | None) -> SequenceDataset:
    """The data with its first ``limit`` test sequences only (``None``: all)."""
    if limit is None or limit >= len(ds.test):
        return ds
    return dataclasses.replace(ds, test=ds.test.subset(torch.arange(limit)))


def run_dataset(name: str, seed: int, num: int, budget: float, work: Path, flow: bool,
                limit: int | None = None, settings: dict[str, Any] | None = None
                ) -> dict[str, Any]:
    """Every forecaster on one dataset and seed (the first ``limit`` test sequences; the
    flow's ``settings`` of ``iresflow train`` that differ from the defaults, an ablation)."""
    ds = load(name, seed)
    horizon = horizon_of(ds)
    ds = first_test(ds, limit)
    held = hold_out(ds.test, horizon)
    record: dict[str, Any] = {"dataset": name, "seed": seed, "horizon": horizon, "draws": num,
                              "features": ds.features, "sequences": len(held.index)}
    record.update(run_classical(ds, held, seed, horizon, num))
    if flow:
        record["flow"] = run_flow(name, ds, seed, horizon, num, work / f"{name}-seed{seed}",
                                  held, settings) | {"settings": settings or {}}
    if budget > 0:
        record["gru_maf"] = run_gru_maf(name, ds, held, seed, horizon, num, budget)
    return record


def _default_nll(default: dict[str, Any] | None, name: str) -> list[float]:
    if default is None:
        return []
    return [r["flow"]["test_nll"] for r in default["records"]
            if r["dataset"] == name and "flow" in r]


def markdown_tables(rows: list[dict[str, Any]], default: dict[str, Any] | None,
                    block: str = "forecast") -> dict[str, str]:
    """The CRPS table (best in bold; coverage of the 90% interval in brackets), and the
    causal-versus-default NLL table with the causal runs whose best epoch is their last, as
    the blocks ``BLOCK-crps`` and ``BLOCK-nll``."""
    names = sorted(dict.fromkeys(r["dataset"] for r in rows), key=DATASETS.index)
    crps_rows, nll_rows = [], []
    for name in names:
        runs = [r for r in rows if r["dataset"] == name]
        means = {m: statistics.fmean(r[m]["crps_mean"] for r in runs)
                 for m in MODELS if all(m in r for r in runs)}
        best = min(means.values())
        cells = []
        for model in MODELS:
            if model not in means:
                cells.append("—")
                continue
            values = [r[model]["crps_mean"] for r in runs]
            cover = statistics.fmean(r[model]["coverage"]["90"] for r in runs)
            text = f"{records.mean_sd(values, 4)} ({cover:.0%})"
            cells.append(f"**{text}**" if means[model] == best else text)
        first = runs[0]
        crps_rows.append([name, str(first["horizon"]), str(first["sequences"]), *cells])
        causal = [r["flow"]["test_nll"] for r in runs if "flow" in r]
        reference = _default_nll(default, name)
        gap = (f"{statistics.fmean(causal) - statistics.fmean(reference):+.3f}"
               if causal and reference else "—")
        short = [r["flow"]["best_epoch"] == r["flow"]["epochs"] for r in runs if "flow" in r]
        nll_rows.append([name, records.mean_sd(causal) if causal else "—",
                         records.mean_sd(reference) if reference else "—", gap,
                         f"{sum(short)} of {len(short)}" if short else "—"])
    crps_header = ["dataset", "H", "sequences", *(NAMES[m] for m in MODELS)]
    nll_header = ["dataset", "causal flow test NLL", "default flow test NLL", "difference",
                  "causal runs cut short"]
    return {f"{block}-crps": records.markdown_table(crps_header, crps_rows),
            f"{block}-nll": records.markdown_table(nll_header, nll_rows)}


def noise_table(rows: list[dict[str, Any]]) -> str:
    """Every flow forecast's CRPS with the new frames' noise given the observed noise and from
    the base alone (the lower in bold), the noise ``auto`` chose and the validation CRPS that
    chose it (records that have it), and the best baseline's CRPS."""
    lines = []
    for r in sorted((r for r in rows if "flow" in r and "prior_noise" in r["flow"]),
                    key=lambda r: (DATASETS.index(r["dataset"]), r["seed"])):
        flow = r["flow"]
        crps = {noise: flow[f"{noise}_noise"]["crps_mean"] for noise in FORECAST_NOISE}
        cells = [f"**{v:.5g}**" if v == min(crps.values()) else f"{v:.5g}"
                 for v in crps.values()]
        chosen = _own_validation(flow)
        auto = ("—" if chosen is None else f"{min(chosen, key=chosen.__getitem__)} "
                f"({chosen['given']:.5g} / {chosen['prior']:.5g})")
        lines.append([r["dataset"], str(r["seed"]), flow.get("kept") or "—", *cells, auto,
                      _best_baseline(r)])
    header = ["dataset", "seed", "kept", "CRPS, noise given", "CRPS, noise prior",
              "auto (validation CRPS given / prior)", "best baseline"]
    return records.markdown_table(header, lines)


def candidates_table(rows: list[dict[str, Any]]) -> str:
    """Every flow forecast of the records that chose their model on validation: the forecast of
    the run's own model with the noise it would choose alone, the model and noise chosen among
    the run's candidates and its forecast (the lower CRPS in bold), the classical
    forecasters' (ETS: univariate data only), and the seconds of the chosen model's draws of
    one sequence beside a GRU + MAF's (where the record has them)."""
    lines = []
    for r in sorted((r for r in rows if "flow" in r and r["flow"].get("validation")),
                    key=lambda r: (DATASETS.index(r["dataset"]), r["seed"])):
        flow = r["flow"]
        own = _own_validation(flow)
        assert own is not None
        noise = min(own, key=own.__getitem__)
        crps = [flow[f"{noise}_noise"]["crps_mean"], flow["crps_mean"]]
        cells = [f"**{v:.5g}**" if v == min(crps) and crps[0] != crps[1] else f"{v:.5g}"
                 for v in crps]
        classical = [f"{r[m]['crps_mean']:.5g}" if m in r else "—" for m in MODELS[1:4]]
        speed = (f"{flow['latency']:.3f} / {flow['peer_latency']:.3f}"
                 if "peer_latency" in flow else "—")
        lines.append([r["dataset"], str(r["seed"]), flow.get("kept") or "—", noise, cells[0],
                      f"{flow['candidate']}, {flow['noise']}", cells[1], *classical, speed])
    header = ["dataset", "seed", "kept", "its noise", "CRPS, kept model",
              "chosen model, noise", "CRPS, chosen", *(NAMES[m] for m in MODELS[1:4]),
              "seconds, chosen / GRU + MAF"]
    return records.markdown_table(header, lines)


def _own_validation(flow: dict[str, Any]) -> dict[str, float] | None:
    """The validation CRPS of each noise of the run's own model, where the record has them: the
    noise choice of the records made before the model was chosen too (``noise_validation``)."""
    if flow.get("validation"):
        name = flow.get("kept") or KEPT
        return {noise: flow["validation"][f"{name}/{noise}"] for noise in FORECAST_NOISE}
    return flow.get("noise_validation")


def _best_baseline(r: dict[str, Any]) -> str:
    """The name and CRPS of a record's best baseline."""
    baselines = {m: r[m]["crps_mean"] for m in MODELS[1:] if m in r}
    best = min(baselines, key=baselines.__getitem__)
    return f"{NAMES[best]} {baselines[best]:.5g}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cli.add_datasets(parser, DATASETS)
    cli.add_seeds(parser)
    cli.add_settings(parser, epochs=None)
    parser.add_argument("--num", type=int, default=100, help="draws per forecast (default: 100)")
    parser.add_argument("--budget", type=float, default=60.0,
                        help="optimisation seconds of the GRU + MAF (0: skip it; default: 60)")
    parser.add_argument("--no-flow", action="store_true", help="skip the causal flow")
    parser.add_argument("--max-sequences", type=cli.optional_int, default=64,
                        help="test sequences forecast per dataset, the first ones ('none': "
                        "all; default: %(default)s)")
    cli.add_runs(parser)
    parser.add_argument("--default-from", type=Path, default=cli.ROOT / "docs" / "small_data.json",
                        help="small-data records with the default flow's test NLL "
                        "(default: %(default)s)")
    parser.add_argument("--reforecast", action="store_true",
                        help="train nothing: forecast again the runs an earlier run kept in "
                        "--runs DIR and replace their flow forecasts in the records of --out "
                        "(the rest of every record stays)")
    parser.add_argument("--table", choices=("scores", "noise", "candidates"), default="scores",
                        help="scores: the CRPS and NLL tables; noise: every flow forecast with "
                        "each noise (records that have both); candidates: the forecasts of the "
                        "run's own model beside those of the model and noise chosen on "
                        "validation (records that have it) (default: scores)")
    cli.add_records(parser, "forecast", ("forecast-crps", "forecast-nll", "forecast-noise",
                                         "forecast-candidates"))
    parser.add_argument("--block", dest="blocks", metavar="BLOCK",
                        type=lambda name: (f"{name}-crps", f"{name}-nll"),
                        help="the blocks of the --doc pages the scores tables go into: "
                        "BLOCK-crps and BLOCK-nll (default: forecast)")
    cli.add_threads(parser)


def run(args: argparse.Namespace) -> int:
    """Run the suite (or read it, ``--table-from``), print and write the tables."""
    default = records.load(args.default_from) if args.default_from.is_file() else None
    if args.table_from is not None:
        rows = cli.table_from(args, KEY)["records"]
    elif args.reforecast:
        rows = reforecast(args)
    else:
        if args.num < 2 or args.budget < 0:
            raise SystemExit("--num must be >= 2 and --budget >= 0")
        earlier, rows = cli.stored(args, {}), []
        with tempfile.TemporaryDirectory() as scratch:
            work = args.runs or Path(scratch)
            for name in args.datasets:
                for seed in cli.seeds(args):
                    record = run_dataset(name, seed, args.num, args.budget, work,
                                         flow=not args.no_flow, limit=args.max_sequences,
                                         settings=cli.settings(args))
                    rows.append(record)
                    crps = {m: f"{record[m]['crps_mean']:.4g}" for m in MODELS if m in record}
                    print(f"{name} seed {seed}: CRPS {crps}", file=sys.stderr, flush=True)
                    written = cli.save(args, rows, KEY, {}, earlier)[0]
        rows = written
    block = args.blocks[0].removesuffix("-crps")
    tables = {"scores": lambda: markdown_tables(rows, default, block),
              "noise": lambda: {"forecast-noise": noise_table(rows)},
              "candidates": lambda: {"forecast-candidates": candidates_table(rows)}}[args.table]()
    for table in tables.values():
        print(table)
    cli.publish(args, tables)
    return 0


def reforecast(args: argparse.Namespace) -> list[dict[str, Any]]:
    """``--reforecast``: the records of ``--out`` of the requested datasets and seeds with the
    flow's forecasts drawn again from the runs kept in ``--runs`` (:func:`forecast_flow`), every
    earlier forecast field of the flow dropped (:data:`TRAINING_FIELDS` stay); the file is
    rewritten with them.

    Raises:
        SystemExit: no ``--runs``, no records, or a requested record or run missing.
    """
    if args.runs is None or not args.out.is_file():
        raise SystemExit("--reforecast needs --runs DIR and the records of an earlier run in "
                         "--out")
    content = records.load(args.out)
    rows = {(r["dataset"], r["seed"]): r for r in content["records"]}
    for name in args.datasets:
        for seed in cli.seeds(args):
            run_dir = args.runs / f"{name}-seed{seed}"
            if (name, seed) not in rows or "flow" not in rows[name, seed] or not run_dir.is_dir():
                raise SystemExit(f"no record with a flow or no run {run_dir} of {name} seed "
                                 f"{seed}")
            record = rows[name, seed]
            ds = first_test(load(name, seed), args.max_sequences)
            held = hold_out(ds.test, record["horizon"])
            trained = {k: v for k, v in record["flow"].items() if k in TRAINING_FIELDS}
            record["flow"] = trained | forecast_flow(run_dir, ds, seed, record["horizon"],
                                                     record["draws"], held)
            print(f"{name} seed {seed}: flow CRPS {record['flow']['crps_mean']:.4g}",
                  file=sys.stderr, flush=True)
    written = list(rows.values())
    records.save(args.out, written, [*content["commands"], args.command_line],
                 content["settings"])
    return written
