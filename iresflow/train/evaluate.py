r"""Using a trained run: reload it, measure its likelihood, draw samples, draw figures.

The test NLL is reported in the dataset's unit and in the original units of the data (the
preprocessing's log-Jacobian is added, :meth:`~iresflow.data.datasets.SequenceDataset.nll`). With
the exact log-determinant it is deterministic; with the Russian-roulette estimator every sequence
gets ``n_samples`` independent unbiased estimates and the NLL comes with its standard error
:math:`\sqrt{\sum_b s_b^2} / \sum_b u_b` (independent sequences). A conditional run is evaluated
and sampled under the context of every sequence (its label or covariates); a label-conditional
run can also be scored as a classifier (:mod:`iresflow.train.classify`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from iresflow.data.datasets import SequenceDataset, SequenceSplit
from iresflow.data.store import StoredSplit
from iresflow.models.config import ModelConfig
from iresflow.models.transformer import ResidualFlowTransformer
from iresflow.train.averaging import copy_parameters, load_average, moving_average
from iresflow.train.checkpoint import CheckpointError, load_checkpoint
from iresflow.train.classify import (
    bayes_classify,
    class_log_likelihoods,
    class_prior,
    confusion_matrix,
)
from iresflow.train.config import ConfigError, TrainConfig
from iresflow.train.distributed import current_world
from iresflow.train.factories import load_data, resolve_device
from iresflow.train.likelihood import (
    batch_context,
    log_prob_cost,
    sharded_log_prob,
    trimmed_batch,
)
from iresflow.train.metrics import SCORE_SUFFIXES, write_scores
from iresflow.train.paths import RunPaths
from iresflow.train.plots import PlotLabels, plot_learning_curves, plot_marginals, plot_traces

__all__ = [
    "LoadedRun",
    "Samples",
    "check_guarantees",
    "evaluate_run",
    "full_history",
    "load_run",
    "plotted_test_sequences",
    "sample_run",
    "sequence_scores",
    "write_plots",
]

#: Sequences sampled for the figures of :func:`write_plots`.
PLOT_SAMPLES = 64
#: ``evaluate_run(method="auto")`` is exact up to this estimated cost (multiply-adds; about a
#: minute on one CPU core).
EXACT_BUDGET = 2e10
#: Standard error, in the dataset's unit, that ``evaluate_run(method="auto")`` aims for.
TARGET_STDERR = 0.01
#: Most roulette estimates per sequence that ``evaluate_run(method="auto")`` draws.
MAX_ROULETTE_SAMPLES = 256
#: Test sequences shown in the figures at most (all of a smaller test split).
PLOT_TEST_SEQUENCES = 1000


@dataclass(frozen=True)
class LoadedRun:
    """A trained run, ready for evaluation and sampling.

    Attributes:
        paths: The run folder.
        config: Its settings.
        dataset: The data it was trained on (same split).
        model: The flow in evaluation mode, with the moving-average weights when the run kept
            them.
        checkpoint: ``"best"`` or ``"last"``.
        epoch: The epoch the checkpoint was written after.
        history: The metrics of every epoch up to that checkpoint.
    """

    paths: RunPaths
    config: TrainConfig
    dataset: SequenceDataset
    model: ResidualFlowTransformer
    checkpoint: str
    epoch: int
    history: list[dict[str, float]]


@dataclass(frozen=True)
class Samples:
    """Sequences drawn from a run's model.

    Attributes:
        x: Samples in the data's original units, ``(num, N, D)``, zero at padding.
        mask: Padding mask ``(num, N)``, ``True`` for real frames.
        lengths: Length of every sample, ``(num,)``, int64.
        diagnostics: The model's ``inverse_diagnostics()`` after the inversion that produced
            them (iterations and residuals of the fixed-point solves), with ``"residual"`` and
            ``"tolerance"`` added: the true residual and the tolerance of the solve (over every
            residual step and sample) whose residual is largest relative to its tolerance, so
            ``"converged"`` holds iff ``residual < tolerance`` there.
        context: The context every sample was drawn with (labels ``(num,)`` or covariates
            ``(num, C)``, on the CPU), ``None`` for an unconditional run.
    """

    x: Tensor
    mask: Tensor
    lengths: Tensor
    diagnostics: dict[str, Any]
    context: Tensor | None = None


def load_run(
    run_dir: str | os.PathLike, *, checkpoint: str = "best", device: str | None = None
) -> LoadedRun:
    """Rebuild a run's model and data from its checkpoint.

    Args:
        run_dir: The run folder written by :func:`~iresflow.train.loop.train`.
        checkpoint: ``"best"`` (lowest validation NLL; ``last`` when there is no ``best.pt``)
            or ``"last"``.
        device: Device for the model (default: the run's ``device`` setting).

    Returns:
        A :class:`LoadedRun`.

    Raises:
        FileNotFoundError: ``run_dir`` is not a run folder.
        CheckpointError: the checkpoint is unreadable, does not match its model, or breaks the
            model's guarantees (:func:`check_guarantees`).
        ConfigError: the stored settings are invalid, or the device is unavailable.
    """
    paths = RunPaths(Path(run_dir))
    if not paths.root.is_dir():
        raise FileNotFoundError(f"run folder not found: {paths.root}")
    if checkpoint not in ("best", "last"):
        raise ValueError(f"checkpoint must be 'best' or 'last', got {checkpoint!r}")
    if not paths.last.is_file():
        raise FileNotFoundError(f"{paths.root} holds no checkpoint (checkpoints/last.pt)")
    path = paths.best if checkpoint == "best" and paths.best.is_file() else paths.last
    state = load_checkpoint(path)
    try:
        config = TrainConfig.from_dict(state["config"])
        model = ResidualFlowTransformer(ModelConfig.from_dict(state["model_config"]))
        model.load_state_dict(state["model"])
        if state["ema"] is not None:
            average = moving_average(model, config.ema)
            load_average(average, state["ema"])
            copy_parameters(model, dict(average.module.named_parameters()))
        epoch, history = int(state["epoch"]), list(state["history"])
    except ConfigError:
        raise
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise CheckpointError(f"checkpoint {path} does not match its model: {error}") from None
    check_guarantees(model, path)
    target = resolve_device(device if device is not None else config.device)
    dataset = load_data(config)
    return LoadedRun(
        paths, config, dataset, model.to(target).eval(), path.stem, epoch, history
    )


def check_guarantees(model: ResidualFlowTransformer, source: str | os.PathLike) -> None:
    """Re-check a loaded model's invertibility guarantees; refuse a model that breaks them.

    The spectrally normalised layers divide their raw weights by the norm in every forward pass,
    so weights edited to violate the Lipschitz constraint are re-normalised structurally and the
    certificates of :meth:`~iresflow.models.transformer.ResidualFlowTransformer.lipschitz_report`
    are recomputed from them. The model is refused when a parameter or buffer is NaN or
    infinite, or when a certified Lipschitz constant is not finite and below 1 (the residual
    steps would not be invertible, docs/math.md#dot-product-attention).

    Args:
        model: The loaded flow.
        source: The checkpoint it came from, named in the message.

    Raises:
        CheckpointError: a non-finite tensor or a certified bound ``>= 1``.

    Example:
        >>> model = ResidualFlowTransformer(features=2, max_len=4, n_blocks=1, hidden=4)
        >>> check_guarantees(model, "fresh model")
    """
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"refusing {source}: {name} holds NaN or Inf values")
    with torch.no_grad():
        report = model.lipschitz_report(n_inputs=1, generator=torch.Generator().manual_seed(0))
    for row in report:
        if not 0.0 <= row["certified"] < 1.0:  # also false for NaN
            raise CheckpointError(
                f"refusing {source}: the certified Lipschitz constant of {row['name']} is "
                f"{row['certified']:.4g}, not below 1, so the flow is not invertible"
            )


def evaluate_run(
    run: LoadedRun,
    *,
    split: str = "test",
    method: str = "exact",
    n_samples: int = 4,
    seed: int = 0,
    save: bool = True,
    target_stderr: float = TARGET_STDERR,
    scores: str | os.PathLike | None = None,
    classify: bool = False,
) -> dict[str, Any]:
    r"""Negative log-likelihood of a split in the dataset's unit (and, for a label-conditional
    run, the accuracy of its generative classifier).

    ``method="auto"`` (the end of ``iresflow train``) computes the NLL exactly when that is
    affordable, i.e. when the estimated cost (:func:`~iresflow.train.likelihood.log_prob_cost`)
    is at most :data:`EXACT_BUDGET` multiply-adds. Otherwise ``n_samples`` roulette estimates per
    sequence give a pilot standard error :math:`s`; if it exceeds ``target_stderr``, the NLL is
    recomputed with :math:`\lceil n_{\rm samples} (s / \text{target})^2 \rceil` estimates (at
    most :data:`MAX_ROULETTE_SAMPLES`), or exactly if that is estimated to cost less.

    Args:
        run: A loaded run.
        split: ``"test"``, ``"val"`` or ``"train"``.
        method: ``"exact"``, ``"roulette"`` or ``"auto"``.
        n_samples: Roulette estimates per sequence (at least 2 for a standard error; for
            ``"auto"``, those of the pilot).
        seed: Seed of the roulette estimates (torch's global generators are restored after).
        save: Merge the result into ``evaluation.json`` of the run (keyed by split, then the
            method used); in a process group only rank 0 writes it.
        target_stderr: Standard error, in the dataset's unit, that ``"auto"`` aims for.
        scores: Also write the per-sequence scores to this ``.csv`` or ``.npz`` file (rank 0),
            one row per sequence in the split's order (:func:`sequence_scores`).
        classify: Also classify every sequence by Bayes' rule
            (:func:`~iresflow.train.classify.bayes_classify`, the prior being the class
            frequencies of the training split) with the log-likelihoods of every class, computed
            with the method used for the NLL; label-conditional runs only.

    In a process group (``iresflow evaluate --nproc N`` or under ``torchrun``) the ranks share
    the batches of the split and every rank returns the same result, equal to one process's
    (:func:`~iresflow.train.likelihood.sharded_log_prob`).

    Returns:
        ``{"split", "method", "nll", "unit", "sequences", "checkpoint", "epoch"}`` with the
        method used, plus ``"n_samples"`` and ``"stderr"`` for the roulette method and
        ``"choice"`` (why, in words) for ``"auto"``. With ``classify``, ``"classification"``:
        ``{"accuracy", "confusion" (rows true, columns predicted), "classes", "prior"}``, saved
        as ``evaluation.json[split]["classification"]`` with the method.

    Raises:
        ValueError: unknown split or method, ``n_samples < 1``, ``target_stderr <= 0``,
            ``scores`` not ending in ``.csv`` or ``.npz``, or ``classify`` for a run that is not
            label-conditional.
    """
    if scores is not None and Path(scores).suffix not in SCORE_SUFFIXES:
        raise ValueError(f"scores must name a .csv or .npz file, got {str(scores)!r}")
    if classify and run.model.config.num_classes == 0:
        raise ValueError("classify needs a label-conditional run (condition = label)")
    if split not in ("test", "val", "train"):
        raise ValueError(f"split must be test, val or train, got {split!r}")
    if method not in ("exact", "roulette", "auto"):
        raise ValueError(f"method must be exact, roulette or auto, got {method!r}")
    if isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 1:
        raise ValueError(f"n_samples must be a positive int, got {n_samples!r}")
    if not target_stderr > 0:
        raise ValueError(f"target_stderr must be > 0, got {target_stderr}")
    data = getattr(run.dataset, split)
    choice = None
    estimate = None
    if method == "auto":
        method, n_samples, choice, estimate = _choose_method(
            run, data, n_samples, target_stderr, seed
        )
    if estimate is None:
        estimate = sharded_log_prob(
            run.model, data, method=method, n_samples=n_samples,
            batch_size=run.config.batch_size, seed=seed,
        )
    log_prob, stderr = estimate
    result: dict[str, Any] = {
        "split": split,
        "method": method,
        "nll": run.dataset.nll(log_prob, data),
        "unit": run.dataset.unit,
        "sequences": len(data),
        "checkpoint": run.checkpoint,
        "epoch": run.epoch,
    }
    if method == "roulette":
        result["n_samples"] = n_samples
        if stderr is not None:
            result["stderr"] = run.dataset.nll_stderr(stderr, data)
    if choice is not None:
        result["choice"] = choice
    class_scores = predicted = None
    if classify:
        class_scores = class_log_likelihoods(
            run.model, data, method=method, n_samples=n_samples,
            batch_size=run.config.batch_size, seed=seed,
        )
        prior = class_prior(run.dataset.train.labels, run.model.config.num_classes)
        predicted = bayes_classify(class_scores, prior)
        classes = run.dataset.classes
        result["classification"] = {
            "accuracy": float((predicted == data.labels).double().mean()),
            "confusion": confusion_matrix(data.labels, predicted, len(classes)).tolist(),
            "classes": list(classes),
            "prior": prior.tolist(),
        }
    main = current_world().main
    if scores is not None and main:
        columns = sequence_scores(run, split, log_prob, stderr)
        if class_scores is not None and predicted is not None:
            columns["predicted"] = [run.dataset.classes[k] for k in predicted.tolist()]
            for k, name in enumerate(run.dataset.classes):
                columns[f"log_prob_{name}"] = class_scores[:, k] + data.log_jacobian
        write_scores(scores, columns)
    if save and main:
        results = _read_json(run.paths.evaluation)
        entry = results.setdefault(split, {})
        entry[method] = {key: value for key, value in result.items() if key != "classification"}
        if "classification" in result:
            entry["classification"] = {**result["classification"], "method": method}
        run.paths.evaluation.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return result


def sequence_scores(
    run: LoadedRun, split: str, log_prob: Tensor, stderr: Tensor | None = None
) -> dict[str, Any]:
    """The per-sequence columns of ``evaluate_run(scores=...)`` for anomaly scoring.

    Args:
        run: A loaded run.
        split: ``"test"``, ``"val"`` or ``"train"``.
        log_prob: Model-space log-densities of the split's sequences, ``(B,)``.
        stderr: Their standard errors ``(B,)``, or ``None``.

    Returns:
        Columns of length ``B``, in the split's order: ``index``, ``length`` (real frames),
        ``log_prob`` (nats, original units), ``stderr`` (when given), ``nll`` (the sequence's
        NLL in the dataset's unit, :meth:`~iresflow.data.datasets.SequenceDataset.sequence_nll`)
        and, for labelled data, ``label`` (the class name).
    """
    data = getattr(run.dataset, split)
    columns: dict[str, Any] = {
        "index": torch.arange(len(data)),
        "length": data.frames,
        "log_prob": log_prob + data.log_jacobian,
    }
    if stderr is not None:
        columns["stderr"] = stderr
    columns["nll"] = run.dataset.sequence_nll(log_prob, data)
    labels = getattr(data, "labels", None)  # a StoredSplit has none
    if labels is not None and run.dataset.classes is not None:
        columns["label"] = [run.dataset.classes[k] for k in labels.tolist()]
    return columns


def _choose_method(
    run: LoadedRun, data: SequenceSplit | StoredSplit, n_samples: int, target: float, seed: int
) -> tuple[str, int, str, tuple[Tensor, Tensor | None] | None]:
    """``method="auto"``: the method, the estimates per sequence, the reason, and the
    log-densities when the pilot already meets the target (else ``None``: compute them)."""
    model, features = run.config.model, run.dataset.features
    mask = data.batch_mask(torch.arange(len(data)))
    exact = log_prob_cost(model, features, mask, method="exact")
    if exact <= EXACT_BUDGET:
        return "exact", 1, f"exact: estimated cost {exact:.1e} <= {EXACT_BUDGET:.0e}", None
    pilot_samples = max(2, n_samples)
    pilot = sharded_log_prob(
        run.model, data, method="roulette", n_samples=pilot_samples,
        batch_size=run.config.batch_size, seed=seed,
    )
    assert pilot[1] is not None  # two or more estimates
    stderr = run.dataset.nll_stderr(pilot[1], data)
    needed = math.ceil(pilot_samples * (stderr / target) ** 2)
    if needed <= pilot_samples:
        return "roulette", pilot_samples, (
            f"roulette: exact too costly ({exact:.1e} > {EXACT_BUDGET:.0e}); standard error "
            f"{stderr:.2g} <= {target:g} with {pilot_samples} estimates"
        ), pilot
    roulette = log_prob_cost(model, features, mask, method="roulette", n_samples=needed)
    if exact <= roulette:
        return "exact", 1, (
            f"exact: cheaper ({exact:.1e}) than the {needed} roulette estimates per sequence "
            f"({roulette:.1e}) for a standard error of {target:g}"
        ), None
    samples = min(needed, MAX_ROULETTE_SAMPLES)
    capped = "" if samples == needed else f" (capped; {needed} needed)"
    return "roulette", samples, (
        f"roulette: exact too costly ({exact:.1e} > {EXACT_BUDGET:.0e}); {samples} estimates "
        f"per sequence for a standard error of {target:g}{capped}"
    ), None


def sample_run(
    run: LoadedRun,
    num: int,
    *,
    length: int | None = None,
    seed: int = 0,
    context: Tensor | None = None,
) -> Samples:
    """Draw sequences from a run's model by inverting the flow.

    Args:
        run: A loaded run.
        num: Number of sequences.
        length: Common length of all samples; ``None`` draws the lengths from the training
            split's length distribution.
        seed: Seed of the lengths and of the base noise.
        context: For a conditional run, the context of every sample: class indices ``(num,)``
            (int64) or covariates ``(num, C)``; ``None`` for an unconditional run.

    Returns:
        :class:`Samples` in the data's original units.

    Raises:
        ValueError: ``num < 1``, ``length`` outside ``[1, max_len]``, or a context missing for a
            conditional run, given to an unconditional one, or of the wrong shape.
        InversionError: a fixed-point inverse did not converge.
    """
    device = next(run.model.parameters()).device
    generator = torch.Generator(device).manual_seed(seed)
    on_device = None if context is None else context.to(device)
    if length is None:
        lengths = run.dataset.sample_lengths(num, generator=torch.Generator().manual_seed(seed))
        x, mask = run.model.sample(num, lengths=lengths, generator=generator, context=on_device)
    else:
        x, mask = run.model.sample(num, seq_len=length, generator=generator, context=on_device)
        lengths = torch.full((num,), length, dtype=torch.int64)
    diagnostics = {**run.model.inverse_diagnostics(), **_worst_solve(run.model)}
    return Samples(
        run.dataset.to_raw(x, mask).cpu(), mask.cpu(), lengths.cpu(), diagnostics,
        None if context is None else context.cpu(),
    )


def write_plots(run: LoadedRun, *, seed: int = 0) -> list[Path]:
    """Write the run's figures into ``plots/``.

    ``learning_curves.png`` (NLL and learning rate of every epoch of the run, from the ``last``
    checkpoint, whichever checkpoint ``run`` holds, with the best epoch marked), ``samples.png``
    (the :data:`PLOT_SAMPLES` sampled sequences, their lengths drawn from the training lengths,
    and the test sequences of :func:`plotted_test_sequences`, as per-feature traces) and
    ``marginals.png`` (per-feature histograms of the frames of those test sequences and of the
    sampled frames), all in the data's original units with the dataset's axis names
    (:meth:`~iresflow.train.plots.PlotLabels.for_dataset`). A conditional run samples sequence
    ``i`` with the context (class or covariates) of the ``i``-th plotted test sequence, so the
    samples and the real sequences they are drawn next to share their conditions.

    Args:
        run: A loaded run.
        seed: Seed of the samples.

    Returns:
        The paths written.
    """
    real, mask = plotted_test_sequences(run)
    index = torch.arange(PLOT_SAMPLES) % len(real)
    context = batch_context(run.model, run.dataset.test, index, torch.device("cpu"))
    samples = sample_run(run, PLOT_SAMPLES, seed=seed, context=context)
    folder = run.paths.plots
    labels = PlotLabels.for_dataset(run.dataset.name)
    history, best_epoch = full_history(run)
    written = [] if not history else [
        plot_learning_curves(
            history, folder / "learning_curves.png", unit=run.dataset.unit, best_epoch=best_epoch
        )
    ]
    written.append(plot_traces(
        real, mask, samples.x, samples.mask, folder / "samples.png", labels=labels
    ))
    written.append(plot_marginals(
        real, mask, samples.x, samples.mask, folder / "marginals.png", labels=labels
    ))
    return written


def plotted_test_sequences(run: LoadedRun) -> tuple[Tensor, Tensor]:
    """The test sequences the figures show, in original units, on the CPU.

    The first :data:`PLOT_TEST_SEQUENCES` of the test split (all of a smaller one), so a split
    read from disk (:class:`~iresflow.data.store.StoredSplit`) is never loaded whole.

    Args:
        run: A loaded run.

    Returns:
        ``(x, mask)`` of shapes ``(b, n, D)`` and ``(b, n)``, ``n`` the longest of them.
    """
    test = run.dataset.test
    index = torch.arange(min(len(test), PLOT_TEST_SEQUENCES))
    x, mask = trimmed_batch(test, index, torch.device("cpu"))
    return run.dataset.to_raw(x, mask), mask


def full_history(run: LoadedRun) -> tuple[list[dict[str, float]], int | None]:
    """The metrics of every epoch of a run and its best epoch, from its ``last`` checkpoint.

    A ``best`` checkpoint holds the history up to the best epoch only; the ``last`` one shows
    what came after (e.g. a later degradation).

    Args:
        run: A loaded run.

    Returns:
        ``(history, best_epoch)``; ``best_epoch`` is ``None`` when no epoch qualified.

    Raises:
        CheckpointError: the ``last`` checkpoint is missing or unreadable.
    """
    state = load_checkpoint(run.paths.last)
    history = list(state["history"])
    best_epoch = int(state["best_epoch"]) or None
    return history, best_epoch


def _worst_solve(model: ResidualFlowTransformer) -> dict[str, float]:
    """Residual and tolerance of the last inverse's solve closest to failing (largest ratio)."""
    worst = {"residual": 0.0, "tolerance": math.inf}
    for module in model.modules():
        stats = getattr(module, "last_inverse_stats", None)
        if stats is None:
            continue
        ratio = stats.residual.double() / stats.tolerance.double()
        ratio = torch.where(torch.isnan(ratio), math.inf, ratio)  # a diverged solve is worst
        index = int(ratio.argmax())
        if float(ratio[index]) >= worst["residual"] / worst["tolerance"]:
            worst = {
                "residual": float(stats.residual[index]),
                "tolerance": float(stats.tolerance[index]),
            }
    return worst


def _read_json(path: Path) -> dict[str, Any]:
    """Earlier results; an unreadable file is replaced (it only caches evaluations)."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return {}
    return data if isinstance(data, dict) else {}
