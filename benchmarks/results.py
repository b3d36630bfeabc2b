"""The results table: iresflow against Gaussians, AR models, nflows flows and a torchdiffeq CNF.

Protocol (same for every model): the splits, preprocessing and units of
:func:`iresflow.data.datasets.load_dataset` (``seed=0``); one trainer, the loop of
``iresflow train`` (:func:`iresflow.train.fit.fit` with the settings of :func:`train_config`:
Adam at a constant learning rate, minibatches of 64, early stopping on the validation NLL, the
same epoch and time budget per run; the iresflow rows are built from their settings exactly as
``iresflow train`` builds them); the widths of the baselines chosen so
that their parameter counts match the default iresflow model on each dataset; every trained
model tuned over the same learning-rate grid on the validation split with seed 0, then the best
configuration trained with the remaining seeds. Reported per model: test NLL (mean and standard
deviation over seeds) in the dataset's unit, parameters, optimisation time per epoch, sampling
time per sequence, and for iresflow the exact NLL next to the Russian-roulette estimate with its
standard error. The Gaussians are closed-form fits (no seeds); the linear-Gaussian AR(p) model
over frames chooses its order on the validation split and is refitted on train and validation.

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

    python -m benchmarks.results --quick                 # CI-sized check, writes benchmarks/out/
    python -m benchmarks.results --jobs 2 --readme README.md   # the full table, docs/results.*
    python -m benchmarks.results --jobs 2 --mode convergence   # docs/results_convergence.*
    python -m benchmarks.results --jobs 2 --mode budget --budget 60   # docs/results_budget60.*
    python -m benchmarks.results --jobs 1 --models iresflow --merge   # re-run some rows only

With ``--merge`` only the ``--models`` are run (on ``--datasets``); the other rows are kept from
the stored report of the mode, and the page says which command produced which rows.

The table is written to ``docs/results.md`` between ``<!-- results:start -->`` and
``<!-- results:end -->`` (and with ``--readme`` between the same markers in the README), the raw
numbers to ``docs/results.json``, the learning curves to ``docs/figures/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from functools import cache
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from benchmarks.baselines.autoregressive import AutoregressiveGaussian
from benchmarks.baselines.cnf import CNF, FixedProbeValidation
from benchmarks.baselines.gaussian import FrameGaussian, SequenceGaussian
from benchmarks.baselines.nflows_models import frame_maf, sequence_maf, sequence_realnvp
from benchmarks.baselines.recurrent import RecurrentFlow
from iresflow.data.datasets import SequenceDataset, SequenceSplit, load_dataset
from iresflow.train.config import TrainConfig
from iresflow.train.epoch import TrainingSession
from iresflow.train.factories import build_model
from iresflow.train.fit import fit
from iresflow.train.likelihood import split_log_prob

DATASETS = ("japanese_vowels", "digits_rows", "co2_windows")
START, END = "<!-- results:start -->", "<!-- results:end -->"
#: Parameter count the baselines aim at when the iresflow model cannot be built.
FALLBACK_TARGET_PARAMS = 20_000
#: Model settings of the iresflow rows on top of the library defaults (ModelConfig): the default
#: recipe and its ablations.
IRESFLOW_RECIPES: dict[str, dict[str, Any]] = {
    "default": {},
    "transformer": {"ar_order": 0, "layers": ("attention", "mlp"), "n_blocks": 4},
    "frames": {"ar_order": 0, "layers": ("mlp",)},
    "lipschitznorm": {"ar_order": 0, "layers": ("attention", "mlp"), "n_blocks": 4,
                      "attention": "lipschitznorm"},
}
#: Largest order P of the AR(p) Gaussian; p in 0..P is chosen on the validation split.
MAX_AR_ORDER = 3
#: Modes of the trainer (module docstring) and their budgets on top of ``FULL``/``QUICK``.
MODES = ("table", "convergence", "budget")
CONVERGENCE = {"max_seconds": 7200.0, "max_epochs": 2000, "patience": 30}
#: Gradient-norm clip of every trained model.
GRAD_CLIP = 100.0
#: Sequences per forward pass when the test split is scored.
EVAL_BATCH = 256
#: Learning-curve points: the test NLL is recorded when the optimisation time has grown by
#: this factor since the last point (and after the last epoch).
CURVE_GROWTH = 1.25
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Budget:
    """Everything that differs between the full and the quick run."""

    seeds: int
    lrs: tuple[float, ...]
    max_seconds: float
    max_epochs: int
    patience: int
    batch_size: int
    sample_num: int
    roulette_samples: int
    cnf_exact_max_dim: int  # the CNF's test divergence is exact iff N * D <= this
    subset: tuple[int, int, int] | None  # train/val/test sequences kept (None: all)


FULL = Budget(seeds=3, lrs=(1e-3, 3e-3), max_seconds=30.0, max_epochs=500, patience=20,
              batch_size=64, sample_num=64, roulette_samples=4, cnf_exact_max_dim=64,
              subset=None)
QUICK = Budget(seeds=1, lrs=(3e-3,), max_seconds=1.0, max_epochs=2, patience=2,
               batch_size=64, sample_num=4, roulette_samples=2, cnf_exact_max_dim=0,
               subset=(64, 16, 12))


# ------------------------------------------------------------------------------------------------
# models


def _variable_length(ds: SequenceDataset) -> bool:
    return not bool(ds.train.mask.all() and ds.val.mask.all() and ds.test.mask.all())


def _fixed_length_only(ds: SequenceDataset) -> str | None:
    return "variable-length data" if _variable_length(ds) else None


def _multi_feature(ds: SequenceDataset) -> str | None:
    return "D = 1: a frame MAF is a Gaussian" if ds.features < 2 else None


def _always(ds: SequenceDataset) -> str | None:
    return None


def _iresflow(recipe: str) -> Callable[[SequenceDataset, int], nn.Module]:
    def build(ds: SequenceDataset, width: int) -> nn.Module:
        return build_model(TrainConfig(data=ds.name, **IRESFLOW_RECIPES[recipe]), ds)
    return build


def _fit_on_train(model: nn.Module, ds: SequenceDataset) -> dict[str, Any]:
    """Closed-form fit on the training split (the Gaussians)."""
    model.fit(ds.train.x, ds.train.mask)
    return {}


def _fit_ar(model: nn.Module, ds: SequenceDataset) -> dict[str, Any]:
    """AR(p): p chosen on the validation split, then refitted on train and validation."""
    assert isinstance(model, AutoregressiveGaussian)
    val_nll = model.fit_selected_order(ds.train, ds.val, MAX_AR_ORDER)
    return {"order": model.order, "order_val_nll": val_nll}


@dataclass(frozen=True)
class ModelSpec:
    """One row of the table.

    Attributes:
        key: Identifier in the JSON file.
        label: Row label.
        sampler: ``"parallel"`` (the issue's parallel samplers: iresflow, RealNVP, CNF),
            ``"sequential"`` (autoregressive over dimensions) or ``"closed form"``.
        applies: ``None`` if the model applies to a dataset, else the reason it does not.
        build: ``(dataset, width) -> model``; ``width`` is ignored by fixed architectures.
        widths: Candidate widths, the one matching the target parameter count is used
            (empty: fixed architecture).
        trained: Gradient training (else a closed-form fit).
        fit: Closed-form fit ``(model, dataset) -> extra record fields`` (untrained rows).
        recipe: The iresflow recipe (:data:`IRESFLOW_RECIPES`): the model settings of the
            row's :class:`~iresflow.train.config.TrainConfig`, from which training builds the
            flow as ``iresflow train`` does (``None``: a baseline).
    """

    key: str
    label: str
    sampler: str
    applies: Callable[[SequenceDataset], str | None]
    build: Callable[[SequenceDataset, int], nn.Module]
    widths: tuple[int, ...] = ()
    trained: bool = True
    fit: Callable[[nn.Module, SequenceDataset], dict[str, Any]] = _fit_on_train
    recipe: str | None = None


WIDTHS = tuple(range(8, 257, 4))
MODELS = (
    ModelSpec("gaussian_frames", "Gaussian over frames (full cov.)", "closed form", _always,
              lambda ds, w: FrameGaussian(ds.features, ds.max_len), trained=False),
    ModelSpec("gaussian_sequences", "Gaussian over sequences (full cov.)", "closed form",
              _fixed_length_only, lambda ds, w: SequenceGaussian(ds.max_len, ds.features),
              trained=False),
    ModelSpec("ar_gaussian", f"AR(p) Gaussian over frames (p ≤ {MAX_AR_ORDER} on val.)",
              "closed form, sequential over frames", _always,
              lambda ds, w: AutoregressiveGaussian(ds.features, ds.max_len), trained=False,
              fit=_fit_ar),
    ModelSpec("gru_maf", "GRU + nflows MAF over the next frame", "sequential over frames",
              _always, lambda ds, w: RecurrentFlow(ds.features, ds.max_len, hidden=w), WIDTHS),
    ModelSpec("maf_frames", "nflows MAF over i.i.d. frames", "parallel over frames",
              _multi_feature, lambda ds, w: frame_maf(ds.features, ds.max_len, hidden=w),
              WIDTHS),
    ModelSpec("maf", "nflows MAF (flattened sequence)", "sequential", _fixed_length_only,
              lambda ds, w: sequence_maf(ds.max_len, ds.features, hidden=w), WIDTHS),
    ModelSpec("realnvp", "nflows RealNVP (flattened sequence)", "parallel", _fixed_length_only,
              lambda ds, w: sequence_realnvp(ds.max_len, ds.features, hidden=w), WIDTHS),
    ModelSpec("cnf", "CNF (torchdiffeq, attention field)", "parallel", _always,
              lambda ds, w: CNF(ds.features, ds.max_len, hidden=w), WIDTHS),
    ModelSpec("iresflow", "iresflow (default: AR(3), temporal conv + MLP)", "parallel", _always,
              _iresflow("default"), recipe="default"),
    ModelSpec("iresflow_transformer", "iresflow, Transformer recipe (L2 attention + MLP, no AR)",
              "parallel", _always, _iresflow("transformer"), recipe="transformer"),
    ModelSpec("iresflow_frames", "iresflow, frames only (MLP, no AR: ablation)", "parallel",
              _always, _iresflow("frames"), recipe="frames"),
    ModelSpec("iresflow_lipschitznorm", "iresflow (LipschitzNorm attention)", "parallel",
              _always, _iresflow("lipschitznorm"), recipe="lipschitznorm"),
)
SPECS = {spec.key: spec for spec in MODELS}
#: Rows compared by the issue's target: iresflow against the other parallel samplers.
PARALLEL_PEERS = ("realnvp", "cnf")


def count_parameters(model: nn.Module) -> int:
    """Trainable parameters, or the free parameters of a closed-form fit."""
    fitted = getattr(model, "num_parameters", None)
    if isinstance(fitted, int):
        return fitted
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@cache
def target_params(name: str) -> int:
    """Parameter count of the default iresflow model on a dataset (the baselines' target)."""
    try:
        return count_parameters(_iresflow("default")(dataset(name, None), 0))
    except ImportError:
        return FALLBACK_TARGET_PARAMS


def matched_width(spec: ModelSpec, ds: SequenceDataset, target: int) -> int:
    """The candidate width whose parameter count is closest to ``target`` (in log ratio).

    Parameter counts grow with the width, so the scan stops at the first width above target.
    """
    if not spec.widths:
        return 0
    best, best_gap = spec.widths[0], math.inf
    for width in spec.widths:
        count = count_parameters(spec.build(ds, width))
        gap = abs(math.log(count / target))
        if gap < best_gap:
            best, best_gap = width, gap
        if count > target:
            break
    return best


# ------------------------------------------------------------------------------------------------
# one run


@cache
def dataset(name: str, subset: tuple[int, int, int] | None) -> SequenceDataset:
    """The dataset (split seed 0), train/val/test cut to their first ``subset`` sequences."""
    ds = load_dataset(name, seed=0)
    if subset is None:
        return ds

    def head(split: SequenceSplit, n: int) -> SequenceSplit:
        return SequenceSplit(split.x[:n], split.mask[:n], split.log_jacobian[:n])

    return dataclasses.replace(ds, train=head(ds.train, subset[0]), val=head(ds.val, subset[1]),
                               test=head(ds.test, subset[2]))


def train_config(spec: ModelSpec, name: str, lr: float, seed: int, budget: Budget
                 ) -> TrainConfig:
    """The training settings of a row: the protocol's, and an iresflow row's model settings.

    Adam at the constant learning rate ``lr`` (no warm-up, no schedule), minibatches of
    ``budget.batch_size``, gradient-norm clipping at :data:`GRAD_CLIP`, at most
    ``budget.max_epochs`` epochs and ``budget.max_seconds`` seconds of optimisation (0: no
    limit), early stopping after ``budget.patience`` epochs without a better validation NLL; the
    rest are the defaults of ``iresflow train`` (validation with 4 roulette estimates per
    sequence for a flow).

    Example:
        >>> config = train_config(SPECS["iresflow"], "co2_windows", 3e-3, 1, FULL)
        >>> config.lr, config.seed, config.scheduler, config.max_seconds, config.layers
        (0.003, 1, 'none', 30.0, ('conv', 'mlp'))
    """
    recipe = IRESFLOW_RECIPES[spec.recipe] if spec.recipe is not None else {}
    return TrainConfig(
        data=name, seed=seed, device="cpu", lr=lr, batch_size=budget.batch_size,
        epochs=budget.max_epochs, max_seconds=budget.max_seconds, patience=budget.patience,
        scheduler="none", warmup=0, clip=GRAD_CLIP, **recipe,
    )


def _inner(model: nn.Module) -> nn.Module:
    """The model itself, without the CNF's validation wrapper."""
    return model.cnf if isinstance(model, FixedProbeValidation) else model


def _time_sampling(model: nn.Module, ds: SequenceDataset, num: int) -> float:
    generator = torch.Generator().manual_seed(0)
    if _variable_length(ds):
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
        epochs = result.steps / math.ceil(len(ds.train) / budget.batch_size)
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
            threads: int, log: Callable[[str], None]) -> dict[str, dict[str, Any]]:
    """All runs of the table, ``jobs`` at a time; returns ``{dataset: {model: entry}}``.

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
    return entries


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


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean and standard deviation over seeds of the numbers of a row."""
    good = [r for r in runs if "error" not in r]
    out: dict[str, Any] = {"seeds": len(good), "errors": [r["error"] for r in runs if "error" in r]}
    if not good:
        return out
    for field in ("test_nll", "val_nll", "seconds_per_epoch", "sample_seconds_per_sequence",
                  "epochs", "test_nll_roulette"):
        values = [r[field] for r in good if isinstance(r.get(field), int | float)]
        if values:
            out[field] = statistics.fmean(values)
            out[field + "_std"] = statistics.stdev(values) if len(values) > 1 else None
    errors = [r["test_nll_roulette_stderr"] for r in good if "test_nll_roulette_stderr" in r]
    if errors:  # standard error of the mean over seeds of independent estimates
        out["test_nll_roulette_stderr"] = math.sqrt(sum(e * e for e in errors)) / len(errors)
    out["params"] = good[0]["params"]
    out["test_divergence"] = good[0].get("test_divergence")
    out["order"] = good[0].get("order")
    return out


# ------------------------------------------------------------------------------------------------
# the target of the issue and the tables


def target_check(entries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Does iresflow (the default recipe) have the best test NLL on >= 2 of 3 datasets, and the
    best among the parallel samplers (iresflow, RealNVP, CNF) on every dataset?"""
    per_dataset = {}
    for name, per_model in entries.items():
        means = {key: e["summary"]["test_nll"] for key, e in per_model.items()
                 if e["status"] == "ok" and "test_nll" in e.get("summary", {})}
        if "iresflow" not in means:
            per_dataset[name] = {"available": False}
            continue
        best_overall = min(means, key=means.__getitem__)
        parallel = {k: v for k, v in means.items() if k == "iresflow" or k in PARALLEL_PEERS}
        best_parallel = min(parallel, key=parallel.__getitem__)
        params = {k: per_model[k]["summary"]["params"] for k in parallel}
        per_dataset[name] = {
            "available": True,
            "best_overall": best_overall,
            "best_parallel": best_parallel,
            "iresflow_best_overall": best_overall == "iresflow",
            "iresflow_best_parallel": best_parallel == "iresflow",
            "parallel_params": params,
        }
    available = [d for d in per_dataset.values() if d["available"]]
    wins = sum(d["iresflow_best_overall"] for d in available)
    parallel_wins = sum(d["iresflow_best_parallel"] for d in available)
    complete = len(available) == len(DATASETS)
    return {
        "datasets": per_dataset,
        "best_overall_count": wins,
        "best_parallel_count": parallel_wins,
        "holds": complete and wins >= 2 and parallel_wins == len(DATASETS),
        "complete": complete,
    }


def _fmt(value: Any, digits: int = 3) -> str:
    return f"{value:.{digits}f}" if isinstance(value, int | float) and math.isfinite(value) else "—"


def _fmt_time(seconds: Any) -> str:
    if not isinstance(seconds, int | float) or not math.isfinite(seconds):
        return "—"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _nll_cell(summary: dict[str, Any]) -> str:
    if "test_nll" not in summary:
        return "failed"
    std = summary.get("test_nll_std")
    return _fmt(summary["test_nll"]) + (f" ± {_fmt(std)}" if std is not None else "")


def markdown_tables(report: dict[str, Any]) -> str:
    """The tables and the target check, as Markdown (the text between the markers)."""
    lines: list[str] = []
    meta = report["meta"]
    mode = "quick mode: tiny budgets and data subsets, not a result" if meta["quick"] else "full"
    training = {
        "table": f"{meta['budget']['max_seconds']:g} s of optimisation per run, at most "
                 f"{meta['budget']['max_epochs']} epochs, early stopping",
        "convergence": f"trained to convergence: early stopping with patience "
                       f"{meta['budget']['patience']}, at most {meta['budget']['max_epochs']} "
                       f"epochs or {meta['budget']['max_seconds']:g} s",
        "budget": f"equal budgets of {meta['budget']['max_seconds']:g} s of optimisation per "
                  "run, no early stopping, best validation epoch kept",
    }[meta.get("mode", "table")]
    lines.append(
        f"Test NLL, lower is better: mean ± std over {meta['budget']['seeds']} seed(s) "
        f"({mode}; {training}; CPU, {meta['threads']} thread(s) per run)."
    )
    for name, per_model in report["datasets"].items():
        info = report["dataset_info"][name]
        lines += ["", f"**{name}** ({info['unit']}, N = {info['max_len']}, D = {info['features']}, "
                      f"{info['sizes']['train']}/{info['sizes']['val']}/{info['sizes']['test']} "
                      f"train/val/test; baselines matched to ≈{info['target_params']} parameters)",
                  "",
                  "| model | sampler | test NLL | roulette estimate ± s.e. | params | "
                  "s/epoch | epochs | sampling / seq | lr |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for key, entry in per_model.items():
            spec = SPECS[key]
            if entry["status"] != "ok":
                lines.append(f"| {spec.label} | {spec.sampler} | n/a ({entry['reason']}) "
                             "| | | | | | |")
                continue
            s = entry["summary"]
            nll = _nll_cell(s)
            if key == "cnf" and s.get("test_divergence") == "hutchinson":
                nll += " (Hutchinson est.)"
            if s.get("order") is not None:
                nll += f" (p = {s['order']})"
            roulette = "—"
            if "test_nll_roulette" in s:
                roulette = f"{_fmt(s['test_nll_roulette'])} ± {s['test_nll_roulette_stderr']:.1g}"
            lr = entry.get("best_lr")
            lines.append(
                f"| {spec.label} | {spec.sampler} | {nll} | {roulette} | "
                f"{s.get('params', '—')} | {_fmt(s.get('seconds_per_epoch'), 2)} | "
                f"{_fmt(s.get('epochs'), 1)} | {_fmt_time(s.get('sample_seconds_per_sequence'))} | "
                f"{'closed form' if lr is None else f'{lr:g}'} |"
            )
            if s.get("errors"):
                lines.append(f"| ↳ failed runs: {'; '.join(s['errors'])} | | | | | | | | |")
    lines += ["", _target_text(report["target"])]
    return "\n".join(lines)


def _target_text(target: dict[str, Any]) -> str:
    parts = ["**Target** (iresflow with its default recipe has the best test NLL on at least 2 "
             "of 3 datasets, and the best among the parallel samplers iresflow, RealNVP and CNF "
             "on all three): "]
    if not target["complete"]:
        parts.append("**not evaluated** — iresflow results are missing for some datasets. ")
    else:
        parts.append("**holds**. " if target["holds"] else "**does not hold**. ")
    parts.append(f"Best overall on {target['best_overall_count']}/{len(DATASETS)}, best among "
                 f"parallel samplers on {target['best_parallel_count']}/{len(DATASETS)}.")
    for name, d in target["datasets"].items():
        if not d["available"]:
            parts.append(f" {name}: no iresflow result.")
            continue
        params = ", ".join(f"{SPECS[k].label.split(' (')[0]} {v}"
                           for k, v in d["parallel_params"].items())
        parts.append(f" {name}: best overall {SPECS[d['best_overall']].label}; best parallel "
                     f"{SPECS[d['best_parallel']].label} (parameters: {params}).")
    return "".join(parts)


def replace_between_markers(text: str, block: str, source: str) -> str:
    """Replace what lies between the results markers of ``text`` by ``block``."""
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise ValueError(f"{source} must contain the markers {START} and {END}, once each, "
                         "in this order")
    head, rest = text.split(START)
    _, tail = rest.split(END)
    return f"{head}{START}\n{block}\n{END}{tail}"


def results_markdown(report: dict[str, Any]) -> str:
    """The whole ``results.md`` page."""
    budget = report["meta"]["budget"]
    return (
        "# Results\n\n"
        f"{provenance_text(report['datasets'])} Do not edit the table by hand.\n\n"
        f"{START}\n{markdown_tables(report)}\n{END}\n\n"
        "## Protocol\n\n"
        "* Data: `iresflow.data.load_dataset(name, seed=0)`: the same splits, preprocessing and "
        "units (original units, including the preprocessing's log-Jacobian) for every model.\n"
        f"* Training: one trainer for every model, the loop of `iresflow train` ({TRAINER}, "
        "with the settings of `benchmarks.results.train_config`): Adam at a constant learning "
        "rate, minibatches of 64 sequences, loss = NLL per unit of the dataset, gradient-norm "
        "clipping at 100, validation after every epoch, early stopping after `patience` epochs "
        "without a better validation NLL, best validation epoch restored; the same epoch and "
        "time budget per run. The iresflow rows are built from their settings as `iresflow "
        "train` builds them.\n"
        "* Tuning: learning rates "
        f"{', '.join(f'{lr:g}' for lr in budget['lrs'])} on the validation split with seed 0; "
        "the best one is then trained with the remaining seeds. Widths of MAF, RealNVP, CNF "
        "and GRU + MAF "
        "are chosen so that their parameter counts are closest to the default iresflow model "
        "(4 blocks, hidden 64) on each dataset. Validation (early stopping and the choice of "
        "learning rate) uses each model's cheap evaluation: the exact density for the Gaussians "
        "and nflows models, the validation of `iresflow train` for iresflow (Russian roulette, "
        "4 estimates per sequence, and the inverse check), and a Hutchinson estimate with "
        "probes fixed across epochs for the CNF.\n"
        "* iresflow: test NLL with the exact log-determinant (dense Jacobians), next to the "
        f"Russian-roulette estimate ({budget['roulette_samples']} estimates per sequence; "
        "standard error over sequences and seeds).\n"
        "* CNF: FFJORD-style, dopri5 with `odeint_adjoint`, tolerance 1e-3 in training and 1e-5 "
        "in evaluation; Hutchinson divergence in training; at test time the exact divergence "
        f"(Jacobian trace) when N·D ≤ {budget['cnf_exact_max_dim']}, else a one-probe "
        "Hutchinson estimate (unbiased, marked in the table).\n"
        "* Gaussians: closed-form maximum likelihood on the training split with a ridge of 1e-4 "
        "on the covariance diagonal; the sequence Gaussian needs fixed-length data.\n"
        "* AR(p) Gaussian over frames (`benchmarks/baselines/autoregressive.py`): "
        "x_t | x_{t-1..t-p} ~ N(A [x_{t-1..t-p}] + b, S), frames t ≤ p with the AR(t-1) "
        "conditional fitted on the t-th frames; every conditional by least squares with the "
        "residual covariance (ridge 1e-4); p in 0.."
        f"{MAX_AR_ORDER} chosen by the validation NLL of fits on the training split, then "
        "refitted on training and validation sequences (so its `val_nll` in the JSON is "
        "in-sample; `order_val_nll` holds the validation NLLs, model space, that chose p).\n"
        "* GRU + MAF (`benchmarks/baselines/recurrent.py`): a GRU over the past frames whose "
        "state is the context of an nflows MAF (4 layers) over the next frame; width matched "
        "to the parameter target like MAF, RealNVP and CNF.\n"
        "* Learning curves (`figures/`): the test NLL of the current parameters, with the "
        "validation estimator, against optimisation seconds (geometric steps), mean over seeds "
        "(interpolated in log time); closed-form fits as horizontal lines.\n"
        "* Times: optimisation wall time per epoch (validation excluded) and sampling wall "
        f"time per sequence (batches of {budget['sample_num']}), on "
        f"{report['meta']['machine']}, with other processes possibly sharing the CPU: "
        "compare within a table, not across machines. This run: "
        f"{report['meta']['wall_seconds'] / 60:.0f} min wall time with "
        f"{report['meta']['jobs']} parallel run(s) of {report['meta']['threads']} thread(s).\n"
    )


#: The trainer of the rows this version of the script trains.
TRAINER = "`iresflow.train.fit.fit`"
#: The trainer of rows stored before the benchmarks trained through ``iresflow train``'s loop.
EARLIER_TRAINER = "`fit_model` of the former `benchmarks/baselines/training.py`"


def provenance_text(entries: dict[str, dict[str, Any]]) -> str:
    """Which command (and trainer) produced which rows of a report.

    Example:
        >>> entry = {"generated_by": "python -m benchmarks.results", "trainer": TRAINER}
        >>> provenance_text({"co2_windows": {"iresflow": entry}})
        'Rows of iresflow generated by `python -m benchmarks.results` (trained by `iresflow.train.fit.fit`).'
    """  # noqa: E501
    sources: dict[tuple[str, str], list[str]] = {}
    for per_model in entries.values():
        for key, entry in per_model.items():
            source = (entry["generated_by"], entry.get("trainer", EARLIER_TRAINER))
            models = sources.setdefault(source, [])
            if key not in models:
                models.append(key)
    return " ".join(
        f"Rows of {', '.join(sorted(models, key=list(SPECS).index))} generated by `{command}` "
        f"(trained by {trainer})." for (command, trainer), models in sources.items()
    )


def merge_report(stored: dict[str, Any], fresh: dict[str, dict[str, Any]], budget: Budget
                 ) -> dict[str, dict[str, Any]]:
    """The stored rows of a report with the ``fresh`` ones put in their place.

    Args:
        stored: A report written by :func:`main` (``results.json``); rows without their
            ``generated_by`` command take the report's.
        fresh: ``{dataset: {model: entry}}`` of the runs just made.
        budget: Their budget, which must be the stored one.

    Returns:
        The merged ``{dataset: {model: entry}}``, rows in the order of :data:`MODELS`.

    Raises:
        ValueError: the stored report has another budget.
    """
    if stored["meta"]["budget"] != json.loads(json.dumps(dataclasses.asdict(budget))):
        raise ValueError(f"the stored report has the budget {stored['meta']['budget']}, not "
                         f"{dataclasses.asdict(budget)}: run every model, without --merge")
    merged: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys([*stored["datasets"], *fresh]):
        rows = {key: {"generated_by": stored["meta"]["command"], **entry}
                for key, entry in stored["datasets"].get(name, {}).items()}
        rows.update(fresh.get(name, {}))
        merged[name] = {key: rows[key] for key in SPECS if key in rows}
    return merged


def mode_budget(base: Budget, mode: str, seconds: float | None = None) -> Budget:
    """The budget of a training mode (module docstring) on top of ``FULL`` or ``QUICK``.

    Args:
        base: ``FULL`` or ``QUICK``.
        mode: One of :data:`MODES`.
        seconds: Optimisation seconds per run (``budget``: required; ``table``: optional;
            ``convergence``: optional cap on top of early stopping).

    Returns:
        The budget.

    Example:
        >>> mode_budget(FULL, "budget", 60.0).max_seconds, mode_budget(FULL, "budget", 60).patience
        (60.0, 1000000)
        >>> capped = mode_budget(FULL, "convergence", 300)
        >>> capped.max_seconds, capped.patience
        (300.0, 30)
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "convergence":
        capped = {} if seconds is None else {"max_seconds": float(seconds)}
        return dataclasses.replace(base, **(CONVERGENCE | capped))
    if mode == "budget":
        if seconds is None or not seconds > 0:
            raise ValueError("the budget mode needs a positive number of seconds (--budget)")
        return dataclasses.replace(base, max_seconds=float(seconds), max_epochs=1_000_000,
                                   patience=1_000_000)
    return base if seconds is None else dataclasses.replace(base, max_seconds=float(seconds))


def mean_curve(curves: list[list[list[float]]], points: int = 40
               ) -> tuple[list[float], list[float]]:
    """Mean over seeds of learning curves ``[[seconds, nll], ...]``.

    The curves are interpolated linearly in log-seconds onto a log-spaced grid of ``points``
    times spanning the range every curve covers (a single curve is returned as it is).

    Args:
        curves: One curve per seed, each with increasing positive seconds.
        points: Grid size.

    Returns:
        ``(seconds, mean nll)``; empty lists when no curve has a point.

    Example:
        >>> mean_curve([[[1.0, 2.0], [100.0, 0.0]], [[1.0, 4.0], [100.0, 2.0]]], points=3)
        ([1.0, 10.0, 100.0], [3.0, 2.0, 1.0])
    """
    curves = [c for c in curves if c]
    if not curves:
        return [], []
    if len(curves) == 1:
        return [p[0] for p in curves[0]], [p[1] for p in curves[0]]
    lo, hi = max(c[0][0] for c in curves), min(c[-1][0] for c in curves)
    grid = np.geomspace(lo, hi, points) if hi > lo else np.array([lo])
    values = [np.interp(np.log(grid), np.log([p[0] for p in c]), [p[1] for p in c])
              for c in curves]
    return [float(g) for g in grid], [float(v) for v in np.mean(values, axis=0)]


def write_learning_curves(report: dict[str, Any], folder: Path, stem: str) -> list[Path]:
    """One figure per dataset: test NLL against optimisation seconds, mean over seeds.

    Trained models are drawn as curves (log time axis), closed-form fits as horizontal lines.

    Returns:
        The paths of the PNG files written (``folder/<stem>_learning_curve_<dataset>.png``).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, per_model in report["datasets"].items():
        figure = Figure(figsize=(7, 4.5))
        FigureCanvasAgg(figure)
        ax = figure.add_subplot()
        finals: list[float] = []
        for key, entry in per_model.items():
            summary = entry.get("summary", {})
            if entry["status"] != "ok" or "test_nll" not in summary:
                continue
            label, color = SPECS[key].label, f"C{list(SPECS).index(key) % 10}"
            if not SPECS[key].trained:
                ax.axhline(summary["test_nll"], linestyle="--", linewidth=1, label=label,
                           color=color)
                finals.append(summary["test_nll"])
                continue
            seconds, nll = mean_curve([r.get("curve", []) for r in entry["runs"]
                                       if "error" not in r])
            if seconds:
                ax.plot(seconds, nll, marker=".", label=label, color=color)
                finals.append(nll[-1])
        if finals:
            low, high = min(finals), max(finals)
            margin = max(high - low, 1e-3)
            ax.set_ylim(low - 0.3 * margin, high + 0.8 * margin)  # early epochs may be far off
        ax.set_xscale("log")
        ax.set_xlabel("optimisation seconds")
        ax.set_ylabel(f"test NLL ({report['dataset_info'][name]['unit']}; validation "
                      "estimator)")
        ax.set_title(f"{name}: mean over seeds ({report['meta']['mode']} mode)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        path = folder / f"{stem}_learning_curve_{name}.png"
        figure.savefig(path, dpi=110, bbox_inches="tight")
        paths.append(path)
    return paths


def _sanitize(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _sanitize(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_sanitize(v) for v in value]
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI-sized run (< 2 min)")
    parser.add_argument("--datasets", nargs="+", choices=DATASETS, default=list(DATASETS))
    parser.add_argument("--models", nargs="+", choices=list(SPECS), default=list(SPECS))
    parser.add_argument("--seeds", type=int, help="seeds per model (default 3; quick 1)")
    parser.add_argument("--mode", choices=MODES, default="table",
                        help="table: fixed budget with early stopping; convergence: early "
                        "stopping with a generous cap; budget: equal wall-clock budgets")
    parser.add_argument("--budget", type=float, help="optimisation seconds per run "
                        "(default 30; quick 1; required with --mode budget; with --mode "
                        "convergence a cap on top of early stopping, default 7200)")
    parser.add_argument("--max-epochs", type=int, help="override the epoch cap")
    parser.add_argument("--patience", type=int, help="override the early-stopping patience")
    parser.add_argument("--jobs", type=int, default=1, help="runs in parallel (processes)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--out", type=Path, help="folder for results.md/json "
                        "(default docs/; quick benchmarks/out/quick/)")
    parser.add_argument("--readme", type=Path, help="also replace the table in this README")
    parser.add_argument("--merge", action="store_true", help="re-run only --models: keep the "
                        "other rows stored in the report of this mode (OUT/STEM.json)")
    return parser


def build_report(args: argparse.Namespace, budget: Budget, command: str,
                 entries: dict[str, dict[str, Any]], seconds: float) -> dict[str, Any]:
    """The report written to ``results.json``: settings, dataset facts, rows and the target."""
    report: dict[str, Any] = {
        "meta": {
            "quick": args.quick,
            "mode": args.mode,
            "command": command,
            "budget": dataclasses.asdict(budget),
            "threads": args.threads,
            "jobs": args.jobs,
            "torch": torch.__version__,
            "machine": f"{platform.machine()} CPU with {os.cpu_count()} cores",
            "wall_seconds": seconds,
        },
        "dataset_info": {
            name: {
                "unit": ds.unit, "features": ds.features, "max_len": ds.max_len,
                "variable_length": _variable_length(ds), "target_params": target_params(name),
                "sizes": {"train": len(ds.train), "val": len(ds.val), "test": len(ds.test)},
            }
            for name in entries
            for ds in (dataset(name, budget.subset),)
        },
        "datasets": entries,
    }
    report["target"] = target_check(entries)
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = _parser()
    args = parser.parse_args(argv)

    try:
        budget = mode_budget(QUICK if args.quick else FULL, args.mode, args.budget)
    except ValueError as error:
        parser.error(str(error))
    for field in ("seeds", "max_epochs", "patience"):
        if getattr(args, field) is not None:
            budget = dataclasses.replace(budget, **{field: getattr(args, field)})
    stem = {"table": "results", "convergence": "results_convergence",
            "budget": f"results_budget{budget.max_seconds:g}"}[args.mode]
    out = args.out or (ROOT / "benchmarks" / "out" / "quick" if args.quick else ROOT / "docs")
    if args.readme is not None:  # fail before the runs, not after
        replace_between_markers(args.readme.read_text(), "", str(args.readme))
    names, keys = tuple(args.datasets), tuple(args.models)
    stored = json.loads((out / f"{stem}.json").read_text()) if args.merge else None
    if stored is not None:  # a report of another budget is refused before the runs
        try:
            merge_report(stored, {}, budget)
        except ValueError as error:
            parser.error(str(error))
    torch.set_num_threads(args.threads)

    start = time.perf_counter()
    print(f"results: {len(names)} dataset(s), {len(keys)} model(s), budget {budget}")
    entries = run_all(names, keys, budget, args.jobs, args.threads, print)
    command = "python -m benchmarks.results" + "".join(
        f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    for per_model in entries.values():
        for entry in per_model.values():
            entry.update(generated_by=command, trainer=TRAINER)
    if stored is not None:
        entries = merge_report(stored, entries, budget)
    report = build_report(args, budget, command, entries, time.perf_counter() - start)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(_sanitize(report), indent=1) + "\n")
    (out / f"{stem}.md").write_text(results_markdown(report))
    figures = write_learning_curves(report, out / "figures", stem)
    if args.readme is not None:
        text = args.readme.read_text()
        args.readme.write_text(replace_between_markers(text, markdown_tables(report),
                                                       str(args.readme)))
    print(markdown_tables(report))
    print(f"\nwrote {out / stem}.md, {out / stem}.json and {len(figures)} figure(s) in "
          f"{out / 'figures'} in {time.perf_counter() - start:.0f} s")
    return report


if __name__ == "__main__":
    main()
