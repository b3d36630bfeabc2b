"""The results table: iresflow against Gaussians, AR models, nflows flows and a torchdiffeq CNF.

Every model sees the same data, trainer and budgets, and the baselines are matched to the
default iresflow model in parameters; the protocol is written into the page with the tables
(:func:`benchmarks.results_report.blocks`). Reported per model: test NLL (mean and standard
deviation over seeds), parameters, optimisation time per epoch, sampling time per sequence, and
for iresflow the exact NLL next to the Russian-roulette estimate with its standard error.

Three training protocols (``--mode``):

* ``table`` (default): every trained model gets the same budget of optimisation seconds and
  epochs, with early stopping on the validation NLL;
* ``convergence``: early stopping on the validation NLL with a generous epoch cap, so that every
  model is trained until it stops improving;
* ``budget``: equal wall-clock budgets (``--budget`` seconds of optimisation, no early stopping;
  the best validation epoch is kept).

Every trained run records a learning curve (the test NLL, with the validation estimator, against
optimisation seconds), drawn per dataset as the mean over seeds into ``figures/``.

Run from the repository root::

    python -m benchmarks results --quick                # CI-sized check, benchmarks/out/
    python -m benchmarks results --jobs 2 --out docs/results.json --doc docs/results.md \
        README.md --figures docs/figures                # the full table
    python -m benchmarks results --jobs 2 --mode convergence --out \
        docs/results_convergence.json --doc docs/results_convergence.md --figures docs/figures
    python -m benchmarks results --jobs 2 --mode budget --budget 60   # equal 60 s budgets
    python -m benchmarks results --jobs 1 --models iresflow --merge --out docs/results.json
    python -m benchmarks results --table-from docs/results.json --doc docs/results.md

With ``--merge`` only the ``--models`` are run (on ``--datasets``); the other rows are kept from
``--out`` (of the same mode and budget), and the page says which command produced which rows.

The raw numbers go to ``--out`` (records of :mod:`benchmarks.records`, one per dataset), the
tables into the ``--doc`` pages between ``<!-- results:start -->`` and ``<!-- results:end -->``
(and which command produced which rows, and the protocol, between the markers
``results-provenance`` and ``results-protocol`` where a page has them), the learning curves
into ``--figures``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import platform
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures import wait as wait_futures
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from benchmarks import cli
from benchmarks.baselines.cnf import CNF, FixedProbeValidation
from benchmarks.figures import results_curves
from benchmarks.results_report import BLOCKS, TRAINER, blocks, markdown_tables, summarize
from benchmarks.results_specs import (
    DATASETS,
    FULL,
    MODES,
    QUICK,
    SPECS,
    Budget,
    ModelSpec,
    count_parameters,
    dataset,
    matched_width,
    mode_budget,
    target_params,
    train_config,
    variable_length,
)
from iresflow.data.batching import epoch_steps
from iresflow.data.datasets import SequenceDataset
from iresflow.train.epoch import TrainingSession
from iresflow.train.fit import fit
from iresflow.train.likelihood import split_log_prob

#: Sequences per forward pass when the test split is scored.
EVAL_BATCH = 256
#: Learning-curve points: the test NLL is recorded when the optimisation time has grown by
#: this factor since the last point (and after the last epoch).
CURVE_GROWTH = 1.25


def _inner(model: nn.Module) -> nn.Module:
    """The model itself, without the CNF's validation wrapper."""
    return model.cnf if isinstance(model, FixedProbeValidation) else model


def _time_sampling(model: nn.Module, ds: SequenceDataset, num: int) -> float:
    generator = torch.Generator().manual_seed(0)
    if variable_length(ds):
        kwargs: dict[str, Any] = {"lengths": ds.sample_lengths(num, generator)}
    else:
        kwargs = {"seq_len": ds.max_len}
    start = time.perf_counter()
    with torch.no_grad():
        _inner(model).sample(num, **kwargs)
    return (time.perf_counter() - start) / num


def _build(spec: ModelSpec, ds: SequenceDataset, budget: Budget, seed: int
           ) -> tuple[nn.Module, int]:
    """The model of a row (seeded) and its width.

    The CNF is wrapped in :class:`~benchmarks.baselines.cnf.FixedProbeValidation`, so that its
    validation estimate uses the same Hutchinson probes at every epoch.
    """
    width = matched_width(spec, ds, target_params(ds.name))
    torch.manual_seed(seed)
    model = spec.build(ds, width)
    if isinstance(model, CNF):
        model.exact_max_dim = budget.cnf_exact_max_dim
        return FixedProbeValidation(model), width
    return model, width


def _curve_recorder(ds: SequenceDataset
                    ) -> tuple[Callable[[TrainingSession, dict[str, float]], None],
                               list[list[float]]]:
    """An ``on_epoch`` hook of :func:`~iresflow.train.fit.fit` recording ``[seconds, test NLL]``.

    The test NLL of the current parameters uses the model's own ``log_prob`` in ``eval()``
    mode (a flow's configured estimator: one roulette estimate; the CNF's fixed probes). A
    point is added after the first and the last epoch, and whenever the optimisation time has
    grown by :data:`CURVE_GROWTH` since the last point.
    """
    curve: list[list[float]] = []

    def record(session: TrainingSession, row: dict[str, float]) -> None:
        seconds, last = session.train_seconds, session.stop_reason() is not None
        if curve and not last and seconds < CURVE_GROWTH * curve[-1][0]:
            return
        log_prob, _ = split_log_prob(session.model, ds.test, batch_size=EVAL_BATCH)
        curve.append([seconds, ds.nll(log_prob, ds.test)])

    return record, curve


def fit_row(spec: ModelSpec, model: nn.Module | None, ds: SequenceDataset, lr: float | None,
            seed: int, budget: Budget) -> tuple[nn.Module, dict[str, Any]]:
    """Train (or fit in closed form) the model of a row and score it on the validation split.

    A trained row goes through :func:`~iresflow.train.fit.fit` with :func:`train_config`; an
    iresflow row is built there from its settings (``model`` is ignored), as ``iresflow
    train`` builds it.

    Returns:
        The fitted model (best validation epoch, ``eval()`` mode) and the record of the fit.
    """
    start = time.perf_counter()
    if spec.trained:
        assert lr is not None
        on_epoch, curve = _curve_recorder(ds)
        result = fit(train_config(spec, ds.name, lr, seed, budget), ds,
                     None if spec.recipe is not None else model, on_epoch=on_epoch)
        model = result.model
        epochs = result.steps / epoch_steps(len(ds.train), budget.batch_size)  # one pass each
        record: dict[str, Any] = {
            "epochs": epochs, "best_epoch": result.best_epoch,
            "seconds_per_epoch": result.train_seconds / epochs, "stopped": result.stopped,
            "curve": curve, "val_nll": result.best_val_nll}
    else:
        assert model is not None
        record = {"epochs": None, "best_epoch": None, "seconds_per_epoch": None,
                  "stopped": "closed form", **spec.fit(model, ds)}
        record["val_nll"] = ds.nll(split_log_prob(model, ds.val, batch_size=EVAL_BATCH)[0],
                                   ds.val)
    record["fit_seconds"] = time.perf_counter() - start
    record["params"] = count_parameters(model)
    model.eval()
    return model, record


def score_row(model: nn.Module, spec: ModelSpec, ds: SequenceDataset, budget: Budget
             ) -> dict[str, Any]:
    """Test NLL (iresflow: exact, and the roulette estimate with its standard error) and the
    sampling time of a fitted row."""
    model = _inner(model).eval()
    record: dict[str, Any] = {}
    start = time.perf_counter()
    method = "exact" if spec.recipe is not None else None
    log_prob, _ = split_log_prob(model, ds.test, method=method, batch_size=EVAL_BATCH)
    record["test_nll"] = ds.nll(log_prob, ds.test)
    record["test_seconds"] = time.perf_counter() - start
    if spec.recipe is not None:
        estimate, stderr = split_log_prob(model, ds.test, method="roulette",
                                          n_samples=budget.roulette_samples,
                                          batch_size=EVAL_BATCH)
        assert stderr is not None
        record["test_nll_roulette"] = ds.nll(estimate, ds.test)
        record["test_nll_roulette_stderr"] = ds.nll_stderr(stderr, ds.test)
    if isinstance(model, CNF):
        exact_test = model.uses_exact_divergence(ds.max_len)
        record["test_divergence"] = "exact" if exact_test else "hutchinson"
    record["sample_seconds_per_sequence"] = _time_sampling(model, ds, budget.sample_num)
    return record


def run_task(stage: str, name: str, key: str, lr: float | None, seed: int, budget: Budget,
             state: dict[str, Tensor] | None = None) -> dict[str, Any]:
    """One stage of one run.

    Args:
        stage: ``"train"`` (fit and validate; the record carries the fitted ``"state"`` for a
            later ``"test"``), ``"test"`` (load ``state``; test NLLs and sampling time) or
            ``"full"`` (both).
        name: Dataset.
        key: Model key.
        lr: Learning rate (``None`` for closed-form fits).
        seed: Seed of the initialisation and of the minibatch order.
        budget: Budgets.
        state: ``state_dict`` of a ``"train"`` stage (``"test"`` only).

    Returns:
        The record of the stage (JSON-serialisable apart from ``"state"``).
    """
    spec = SPECS[key]
    ds = dataset(name, budget.subset)
    model, width = _build(spec, ds, budget, seed)
    record: dict[str, Any] = {"dataset": name, "model": key, "lr": lr, "seed": seed,
                              "width": width or None}
    if stage in ("train", "full"):
        model, fitted = fit_row(spec, model, ds, lr, seed, budget)
        record.update(fitted)
    else:
        assert state is not None
        model.load_state_dict(state)
    if stage in ("test", "full"):
        record.update(score_row(model, spec, ds, budget))
    if stage == "train":
        record["state"] = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return record


def _guarded(stage: str, name: str, key: str, lr: float | None, seed: int, budget: Budget,
             threads: int, state: dict[str, Tensor] | None = None) -> dict[str, Any]:
    """:func:`run_task` in a worker: fixed thread count, failures reported, not raised."""
    torch.set_num_threads(threads)
    try:
        return run_task(stage, name, key, lr, seed, budget, state)
    except Exception as error:  # a failing row is reported in the table, not fatal
        return {"dataset": name, "model": key, "lr": lr, "seed": seed,
                "error": f"{stage}: {type(error).__name__}: {error}"}


# ------------------------------------------------------------------------------------------------
# scheduling: tune on seed 0, then test the best configuration and train the remaining seeds


def run_all(names: tuple[str, ...], keys: tuple[str, ...], budget: Budget, jobs: int,
            threads: int, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """All runs of the table, ``jobs`` at a time: one record per dataset, its facts and an
    entry per model.

    A trained model is fitted with every learning rate on seed 0 (``"train"`` stage); the one
    with the lowest validation NLL is then evaluated on the test split (``"test"``) and trained
    and evaluated with the other seeds (``"full"``). Closed-form fits run one ``"full"`` stage.
    """
    entries: dict[str, dict[str, Any]] = {name: {} for name in names}
    pending: dict[Future, tuple[str, str, str]] = {}
    tuning: dict[tuple[str, str], list[dict[str, Any]]] = {}
    context = get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        def submit(stage: str, name: str, key: str, lr: float | None, seed: int,
                   state: dict[str, Tensor] | None = None) -> None:
            future = pool.submit(_guarded, stage, name, key, lr, seed, budget, threads, state)
            pending[future] = (stage, name, key)

        for name in names:
            ds = dataset(name, budget.subset)
            for key in keys:
                spec = SPECS[key]
                reason = spec.applies(ds)
                if reason is not None:
                    entries[name][key] = {"status": "n/a", "reason": reason}
                    continue
                entries[name][key] = {"status": "ok", "tuning": [], "runs": []}
                if not spec.trained:
                    submit("full", name, key, None, 0)
                    continue
                tuning[(name, key)] = []
                for lr in budget.lrs:
                    submit("train", name, key, lr, 0)
        while pending:
            done, _ = wait_futures(list(pending), return_when="FIRST_COMPLETED")
            for future in done:
                stage, name, key = pending.pop(future)
                record = future.result()
                entry = entries[name][key]
                log(_progress(stage, record))
                if stage == "full":
                    entry["runs"].append(record)
                    continue
                if stage == "test":
                    best = entry.pop("best_train")
                    entry["runs"].append({**best, **record} if "error" not in record else
                                         {**best, "error": record["error"]})
                    continue
                tuning[(name, key)].append(record)
                if len(tuning[(name, key)]) < len(budget.lrs):
                    continue
                configs = tuning.pop((name, key))
                entry["tuning"] = [{"lr": r["lr"], "val_nll": r.get("val_nll"),
                                    "error": r.get("error")} for r in configs]
                best = min(configs, key=lambda r: _finite_or_inf(r.get("val_nll")))
                entry["best_lr"] = best["lr"]
                if "error" in best:
                    entry["runs"].append(best)
                    continue
                state = best.pop("state")
                entry["best_train"] = best
                submit("test", name, key, best["lr"], 0, state)
                for seed in range(1, budget.seeds):
                    submit("full", name, key, best["lr"], seed)
    for per_model in entries.values():
        for entry in per_model.values():
            if entry["status"] == "ok":
                entry["runs"].sort(key=lambda r: r["seed"])
                entry["summary"] = summarize(entry["runs"])
    return [{"dataset": name, **_facts(dataset(name, budget.subset)), **per_model}
            for name, per_model in entries.items()]


def _facts(ds: SequenceDataset) -> dict[str, Any]:
    return {"unit": ds.unit, "features": ds.features, "max_len": ds.max_len,
            "variable_length": variable_length(ds), "target_params": target_params(ds.name),
            "sizes": {"train": len(ds.train), "val": len(ds.val), "test": len(ds.test)}}


def _finite_or_inf(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else math.inf


def _progress(stage: str, record: dict[str, Any]) -> str:
    head = (f"  {stage:5s} {record['dataset']:16s} {record['model']:23s} lr={record['lr']} "
            f"seed={record['seed']}")
    if "error" in record:
        return f"{head}  FAILED {record['error']}"
    parts = [head]
    if "val_nll" in record:
        parts.append(f"val {record['val_nll']:.4f} ({record['fit_seconds']:.0f} s, "
                     f"{record['params']} params)")
    if "test_nll" in record:
        parts.append(f"test {record['test_nll']:.4f} ({record['test_seconds']:.0f} s)")
    return "  ".join(parts)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cli.add_quick(parser, "tiny budgets and data subsets (< 2 min)")
    cli.add_datasets(parser, DATASETS)
    parser.add_argument("--models", nargs="+", choices=list(SPECS), default=list(SPECS))
    cli.add_seeds(parser, default=None, first=False)
    parser.add_argument("--mode", choices=MODES, default="table",
                        help="table: fixed budget with early stopping; convergence: early "
                        "stopping with a generous cap; budget: equal wall-clock budgets")
    parser.add_argument("--budget", type=float, help="optimisation seconds per run "
                        "(default 30; quick 1; required with --mode budget; with --mode "
                        "convergence a cap on top of early stopping, default 7200)")
    parser.add_argument("--max-epochs", type=int, help="override the epoch cap")
    parser.add_argument("--patience", type=int, help="override the early-stopping patience")
    parser.add_argument("--jobs", type=int, default=1, help="runs in parallel (processes)")
    cli.add_threads(parser)
    cli.add_records(parser, "results", BLOCKS)
    parser.add_argument("--figures", type=Path, help="draw the learning curves into this folder")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the table (or read it, ``--table-from``), write its records, pages and figures."""
    if args.table_from is not None:
        content = cli.table_from(args, key=("dataset",))
    else:
        try:
            budget = mode_budget(QUICK if args.quick else FULL, args.mode, args.budget)
        except ValueError as error:
            raise SystemExit(str(error)) from None
        for field in ("seeds", "max_epochs", "patience"):
            if getattr(args, field) is not None:
                budget = dataclasses.replace(budget, **{field: getattr(args, field)})
        settings = {"mode": args.mode, "quick": args.quick, "budget": dataclasses.asdict(budget)}
        earlier = cli.stored(args, settings)  # a report of another budget is refused here
        start = time.perf_counter()
        print(f"results: {len(args.datasets)} dataset(s), {len(args.models)} model(s), "
              f"budget {budget}")
        rows = run_all(tuple(args.datasets), tuple(args.models), budget, args.jobs,
                       args.threads, print)
        for row in rows:
            for key in SPECS.keys() & row.keys():
                row[key].update(generated_by=args.command_line, trainer=TRAINER)
        machine = {"threads": args.threads, "jobs": args.jobs, "torch": torch.__version__,
                   "machine": f"{platform.machine()} CPU with {os.cpu_count()} cores",
                   "wall_seconds": time.perf_counter() - start}
        rows, commands = cli.save(args, rows, ("dataset",), settings, earlier, machine=machine)
        content = {"commands": commands, "settings": settings, "machine": machine,
                   "records": rows}
        print(f"wrote {args.out}")
    if args.figures is not None:
        stem = args.out.stem if args.table_from is None else args.table_from[0].stem
        print(f"drew {len(results_curves(content, args.figures, stem))} figure(s) in "
              f"{args.figures}")
    print(markdown_tables(content))
    cli.publish(args, blocks(content))
    return content
