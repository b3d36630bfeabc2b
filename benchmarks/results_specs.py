"""The rows, budgets and data of the results table (:mod:`benchmarks.results`).

Every row is a :class:`ModelSpec`: a baseline of :mod:`benchmarks.baselines`, built at the width
whose parameter count matches the default iresflow model, or an iresflow recipe
(:data:`IRESFLOW_RECIPES`, settings of ``iresflow train``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

from torch import nn

from benchmarks.baselines.cnf import CNF
from benchmarks.baselines.gaussian import FrameGaussian, SequenceGaussian
from benchmarks.baselines.nflows_models import frame_maf, sequence_maf, sequence_realnvp
from benchmarks.baselines.recurrent import GRU_LR, GRU_PATIENCE, RecurrentFlow
from iresflow.data.datasets import SequenceDataset, SequenceSplit, load_dataset
from iresflow.models.reference import AutoregressiveGaussian
from iresflow.train.config import TrainConfig
from iresflow.train.factories import build_model

DATASETS = ("japanese_vowels", "digits_rows", "co2_windows")
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


def variable_length(ds: SequenceDataset) -> bool:
    return not bool(ds.train.mask.all() and ds.val.mask.all() and ds.test.mask.all())


def _fixed_length_only(ds: SequenceDataset) -> str | None:
    return "variable-length data" if variable_length(ds) else None


def _multi_feature(ds: SequenceDataset) -> str | None:
    return "D = 1: a frame MAF is a Gaussian" if ds.features < 2 else None


def _always(ds: SequenceDataset) -> str | None:
    return None


def _iresflow(recipe: str) -> Callable[[SequenceDataset, int], nn.Module]:
    def build(ds: SequenceDataset, width: int) -> nn.Module:
        return build_model(TrainConfig.from_dict({"data": ds.name, **IRESFLOW_RECIPES[recipe]}),
                           ds)
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
    return count_parameters(_iresflow("default")(dataset(name, None), 0))


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


def gru_maf_config(name: str, seed: int, seconds: float, **overrides: Any) -> TrainConfig:
    """The training settings of the GRU + MAF outside the table (small-data and long-range
    benchmarks): the table's protocol with :data:`~benchmarks.baselines.recurrent.GRU_LR`,
    ``seconds`` of optimisation and early stopping after
    :data:`~benchmarks.baselines.recurrent.GRU_PATIENCE` epochs."""
    protocol = dataclasses.replace(FULL, max_seconds=seconds, max_epochs=10_000,
                                   patience=GRU_PATIENCE)
    return train_config(SPECS["gru_maf"], name, GRU_LR, seed, protocol, **overrides)


def train_config(spec: ModelSpec, name: str, lr: float, seed: int, budget: Budget,
                 **overrides: Any) -> TrainConfig:
    """The training settings of a row: the protocol's, and an iresflow row's model settings.

    Adam at the constant learning rate ``lr`` (no warm-up, no schedule), minibatches of
    ``budget.batch_size`` in epochs of one pass over the training split, gradient-norm
    clipping at :data:`GRAD_CLIP`, at most ``budget.max_epochs`` epochs and
    ``budget.max_seconds`` seconds of optimisation (0: no limit), early stopping after
    ``budget.patience`` epochs without a better validation NLL, one model per row (no
    ``alternative``); the rest are the defaults of ``iresflow train`` (validation with 4
    roulette estimates per sequence for a flow), or the flat settings ``overrides`` (e.g. the
    data's).

    Example:
        >>> config = train_config(SPECS["iresflow"], "co2_windows", 3e-3, 1, FULL)
        >>> config.lr, config.seed, config.scheduler, config.max_seconds, config.model.layers
        (0.003, 1, 'none', 30.0, ('conv', 'mlp'))
    """
    recipe = IRESFLOW_RECIPES[spec.recipe] if spec.recipe is not None else {}
    return TrainConfig.from_dict({
        "data": name, "seed": seed, "device": "cpu", "lr": lr, "batch_size": budget.batch_size,
        "epochs": budget.max_epochs, "min_steps": 1, "max_seconds": budget.max_seconds,
        "patience": budget.patience, "scheduler": "none", "warmup": 0, "clip": GRAD_CLIP,
        "alternative": "none", **recipe, **overrides})
