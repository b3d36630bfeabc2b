r"""The likelihood of a finished run: its NLL on a split, per-sequence scores, classification.

The NLL is reported in the dataset's unit and in the original units of the data (the
preprocessing's log-Jacobian is added, :meth:`~iresflow.data.datasets.SequenceDataset.nll`). With
the exact log-determinant it is deterministic; with the Russian-roulette estimator every sequence
gets ``n_samples`` independent unbiased estimates and the NLL comes with its standard error
:math:`\sqrt{\sum_b s_b^2} / \sum_b u_b` (independent sequences). A conditional run is evaluated
under the context of every sequence (its label or covariates); a label-conditional run can also be
scored as a classifier (:mod:`iresflow.runs.classify`). Results are merged into the run's
``evaluation.json``. The settings are an :class:`~iresflow.runs.settings.EvaluateSettings`.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from iresflow.data.datasets import SequenceSplit
from iresflow.data.store import StoredSplit
from iresflow.models.worst_cases import summarize_sequence_nll
from iresflow.runs.classify import (
    bayes_classify,
    class_log_likelihoods,
    class_prior,
    confusion_matrix,
)
from iresflow.runs.load import LoadedRun, load_run
from iresflow.runs.plots import PlotLabels, plot_frame_scores
from iresflow.runs.reference import ReferenceWarning, compare_with_reference, fit_reference
from iresflow.runs.settings import EvaluateSettings, RunSettings
from iresflow.train.config import ConfigError, TrainConfig
from iresflow.train.distributed import current_world, launch
from iresflow.train.factories import resolve_device
from iresflow.train.likelihood import (
    batch_context,
    log_prob_cost,
    sharded_log_prob,
    trimmed_batch,
)
from iresflow.train.metrics import write_scores
from iresflow.train.paths import RunPaths

__all__ = [
    "evaluate", "evaluate_run", "frame_scores", "save_evaluation", "sequence_scores",
    "write_frame_scores",
]

#: ``method="auto"`` is exact up to this estimated cost (multiply-adds; about a minute on one
#: CPU core).
EXACT_BUDGET = 2e10
#: Most roulette estimates per sequence that ``method="auto"`` draws.
MAX_ROULETTE_SAMPLES = 256


def evaluate(
    run_dir: str | os.PathLike,
    settings: EvaluateSettings | None = None,
    run_settings: RunSettings | None = None,
) -> dict[str, Any]:
    """``iresflow evaluate``: load a run and evaluate it in ``settings.nproc`` processes.

    Every process loads the run (:func:`~iresflow.runs.load.load_run`) and takes its share of
    the split's batches (:func:`evaluate_run`); the processes are started, or joined under
    ``torchrun``, by :func:`~iresflow.train.distributed.launch`.

    Args:
        run_dir: The run folder.
        settings: How to evaluate (default: :class:`~iresflow.runs.settings.EvaluateSettings`).
        run_settings: Which checkpoint and device.

    Returns:
        The result of :func:`evaluate_run` (rank 0's when processes were started).

    Raises:
        ConfigError, CheckpointError, FileNotFoundError: as in :func:`evaluate_run` and
            :func:`~iresflow.runs.load.load_run`.
    """
    settings = settings or EvaluateSettings()
    run_settings = run_settings or RunSettings()
    device = resolve_device(run_settings.device or _stored_device(run_dir))
    return launch(_evaluate_rank, settings.nproc, device.type, run_dir, settings, run_settings)


def _stored_device(run_dir: str | os.PathLike) -> str:
    """The ``device`` setting of a run folder (``auto`` without one: loading then says why)."""
    path = RunPaths(Path(run_dir)).config
    return TrainConfig.from_toml(path, stored=True).device if path.is_file() else "auto"


def _evaluate_rank(
    run_dir: str | os.PathLike, settings: EvaluateSettings, run_settings: RunSettings
) -> dict[str, Any]:
    return evaluate_run(load_run(run_dir, run_settings), settings)


def evaluate_run(
    run: LoadedRun, settings: EvaluateSettings | None = None, *, save: bool = True,
    **changes: Any,
) -> dict[str, Any]:
    r"""Negative log-likelihood of a split in the dataset's unit beside the closed-form AR(p)
    Gaussian's (and, for a label-conditional run, the accuracy of its generative classifier).

    ``method="auto"`` (the end of ``iresflow train``) computes the NLL exactly when that is
    affordable, i.e. when the estimated cost (:func:`~iresflow.train.likelihood.log_prob_cost`)
    is at most :data:`EXACT_BUDGET` multiply-adds. Otherwise ``n_samples`` roulette estimates per
    sequence give a pilot standard error :math:`s`; if it exceeds ``target_stderr``, the NLL is
    recomputed with :math:`\lceil n_{\rm samples} (s / \text{target})^2 \rceil` estimates (at
    most :data:`MAX_ROULETTE_SAMPLES`), or exactly if that is estimated to cost less.

    Args:
        run: A loaded run.
        settings: Split, method, estimates, seed (torch's global generators are restored
            after), per-sequence ``scores`` file (written by rank 0, :func:`sequence_scores`),
            ``classify`` (Bayes' rule, :func:`~iresflow.runs.classify.bayes_classify`, with
            the class frequencies of the training split as prior and the class likelihoods of
            the NLL's method) and ``reference`` (default: ``EvaluateSettings()``); its
            ``nproc`` is for :func:`evaluate`, this function runs in the calling processes.
        save: Merge the result into ``evaluation.json`` of the run (keyed by split, then the
            method used); in a process group only rank 0 writes it.
        **changes: Fields of the settings to change (``method="roulette"``).

    In a process group (``iresflow evaluate --nproc N`` or under ``torchrun``) the ranks share
    the batches of the split and every rank returns the same result, equal to one process's
    (:func:`~iresflow.train.likelihood.sharded_log_prob`).

    Returns:
        ``{"split", "method", "nll", "unit", "sequences", "checkpoint", "epoch",
        "per_sequence"}`` (the last: :func:`~iresflow.models.worst_cases.summarize_sequence_nll`
        as a dict), plus ``"n_samples"`` and ``"stderr"`` for the roulette method and
        ``"choice"`` (why, in words) for ``"auto"``. With ``reference``, ``"reference"``
        (:func:`~iresflow.runs.reference.fit_reference`) and, when the flow is worse,
        ``"warnings"`` (also issued as :class:`~iresflow.runs.reference.ReferenceWarning`).
        With ``classify``, ``"classification"``: ``{"accuracy", "confusion" (rows true,
        columns predicted), "classes", "prior"}``, saved
        as ``evaluation.json[split]["classification"]`` with the method.

    Raises:
        ConfigError: an invalid setting, or ``classify`` for a run that is not
            label-conditional.
    """
    if "scores" in changes and changes["scores"] is not None:
        changes["scores"] = os.fspath(changes["scores"])
    settings = (settings or EvaluateSettings()).replace(**changes)
    if settings.classify and run.config.condition != "label":
        raise ConfigError(
            f"classify needs a run trained with condition = label (--condition label); "
            f"{run.paths.root} has condition {run.config.condition}"
        )
    data = getattr(run.dataset, settings.split)
    method, n_samples, choice, estimate = settings.method, settings.n_samples, None, None
    if method == "auto":
        method, n_samples, choice, estimate = _choose_method(
            run, data, n_samples, settings.target_stderr, settings.seed
        )
    if estimate is None:
        estimate = sharded_log_prob(
            run.model, data, method=method, n_samples=n_samples,
            batch_size=run.config.batch_size, seed=settings.seed,
        )
    log_prob, stderr = estimate
    result = _nll_result(run, settings.split, method, n_samples, estimate) | (
        {} if choice is None else {"choice": choice})
    if settings.reference:  # after the flow's results, which the warnings compare with
        _add_reference(run, settings.split, result)
    columns = {} if settings.scores is None else sequence_scores(
        run, settings.split, log_prob, stderr
    )
    if settings.classify:
        result["classification"] = _classify(run, data, method, n_samples, settings, columns)
    if current_world().main:
        if settings.scores is not None:
            _write_scores(run, settings, columns, result)
        if save:
            save_evaluation(run.paths, result)
    return result


def _write_scores(
    run: LoadedRun, settings: EvaluateSettings, columns: dict[str, Any], result: dict[str, Any]
) -> None:
    """Write the per-sequence scores and, for a causal run, the frame scores (their files
    listed as ``result["frame_scores"]``)."""
    assert settings.scores is not None
    if not run.model.causal:
        write_scores(settings.scores, columns)
        return
    written = write_frame_scores(run, settings.split, settings.scores, columns)
    result["frame_scores"] = [str(path) for path in written]


def _nll_result(
    run: LoadedRun, split: str, method: str, n_samples: int,
    estimate: tuple[Tensor, Tensor | None],
) -> dict[str, Any]:
    """The result of :func:`evaluate_run` from the log-densities (and standard errors)."""
    data, (log_prob, stderr) = getattr(run.dataset, split), estimate
    result: dict[str, Any] = {
        "split": split, "method": method, "nll": run.dataset.nll(log_prob, data),
        "unit": run.dataset.unit, "sequences": len(data), "checkpoint": run.checkpoint,
        "epoch": run.epoch,
        "per_sequence": summarize_sequence_nll(run.dataset.sequence_nll(log_prob, data)).to_dict(),
    }
    if method == "roulette":
        result["n_samples"] = n_samples
        if stderr is not None:
            result["stderr"] = run.dataset.nll_stderr(stderr, data)
    return result


def _add_reference(run: LoadedRun, split: str, result: dict[str, Any]) -> None:
    """Add the closed-form reference (:func:`~iresflow.runs.reference.fit_reference`, the same
    on every rank) and the warnings against it to ``result``; rank 0 issues them."""
    result["reference"] = fit_reference(run.dataset, split, condition=run.config.condition)
    found = compare_with_reference(result)
    if found:
        result["warnings"] = found
    if current_world().main:
        for warning in found:
            warnings.warn(warning, ReferenceWarning, stacklevel=3)


def _classify(
    run: LoadedRun, data: SequenceSplit, method: str, n_samples: int,
    settings: EvaluateSettings, columns: dict[str, Any],
) -> dict[str, Any]:
    """Bayes' rule over the class likelihoods; adds the prediction and every class's
    log-likelihood (original units) to the score ``columns``."""
    num_classes = len(run.dataset.classes or ())
    scores = class_log_likelihoods(
        run.model, data, method=method, n_samples=n_samples,
        batch_size=run.config.batch_size, seed=settings.seed,
    )
    prior = class_prior(run.dataset.train.labels, num_classes)
    predicted = bayes_classify(scores, prior)
    classes = run.dataset.classes
    columns["predicted"] = [classes[k] for k in predicted.tolist()]
    for k, name in enumerate(classes):
        columns[f"log_prob_{name}"] = scores[:, k] + data.log_jacobian
    return {
        "accuracy": float((predicted == data.labels).double().mean()),
        "confusion": confusion_matrix(data.labels, predicted, num_classes).tolist(),
        "classes": list(classes),
        "prior": prior.tolist(),
    }


def save_evaluation(paths: RunPaths, result: dict[str, Any]) -> None:
    """Merge a result of :func:`evaluate_run` into the run's ``evaluation.json``.

    Results are keyed by split, then by the method used; a classification is stored next to
    them (``evaluation.json[split]["classification"]``) with its method.

    Args:
        paths: The run folder.
        result: What :func:`evaluate_run` returned.
    """
    results = _read_json(paths.evaluation)
    entry = results.setdefault(result["split"], {})
    method = result["method"]
    entry[method] = {key: value for key, value in result.items() if key != "classification"}
    if "classification" in result:
        entry["classification"] = {**result["classification"], "method": method}
    paths.evaluation.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")


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


def frame_scores(run: LoadedRun, split: str) -> tuple[Tensor, Tensor]:
    """Every frame's log-density given the earlier ones, for a causal run
    (:meth:`~iresflow.models.flow.SequenceFlow.frame_log_prob`), in original units.

    Args:
        run: A loaded run whose model is causal.
        split: ``"test"``, ``"val"`` or ``"train"``.

    Returns:
        ``(log_prob, nll)``, both ``(B, N)`` float64 with ``N`` the dataset's ``max_len`` and
        ``nan`` at padding: the log-density in nats and the NLL in the dataset's unit
        (:meth:`~iresflow.data.splits.SequenceDataset.frame_nll`). A sequence's frames sum to
        its ``log_prob`` and to its NLL times its units.

    Raises:
        ConfigError: the run is not causal.
    """
    if not run.model.causal:
        raise ConfigError(f"{run.paths.root} is not causal: frame scores need a run trained "
                          "with causal = true (--causal)")
    data, parameter = getattr(run.dataset, split), next(run.model.parameters())
    shape = (len(data), run.dataset.max_len)
    log_prob = torch.full(shape, torch.nan, dtype=torch.float64)
    nll = log_prob.clone()
    with torch.no_grad():
        for batch in torch.arange(len(data)).split(run.config.batch_size):
            x, mask = trimmed_batch(data, batch, parameter.device, parameter.dtype)
            context = batch_context(run.model, data, batch, parameter.device)
            model_space = run.model.frame_log_prob(x, mask, context=context)
            frames = run.dataset.frame_nll(model_space, x, mask).cpu()
            nll[batch, : x.shape[1]] = frames
            log_prob[batch, : x.shape[1]] = -frames * run.dataset.unit_scale()
    return log_prob, nll


def write_frame_scores(
    run: LoadedRun, split: str, scores: str | os.PathLike, columns: dict[str, Any]
) -> list[Path]:
    """Write the per-sequence ``scores`` file of a causal run with its frame scores.

    An ``.npz`` file gets the arrays ``frame_log_prob`` and ``frame_nll`` ``(B, N)`` (added to
    the file); a ``.csv`` file a second one, ``NAME_frames.csv``, with one row per real frame
    (``index``, ``frame`` from 0, ``log_prob``, ``nll``). Either way ``NAME_frames.png`` plots
    the frame NLL of the sequence with the highest NLL beside its data.

    Args:
        run: A loaded run whose model is causal.
        split: The split of ``scores``.
        scores: The per-sequence scores file.
        columns: Its columns (:func:`sequence_scores`).

    Returns:
        The files written besides ``scores``.
    """
    log_prob, nll = frame_scores(run, split)
    path = Path(scores)
    frames_file = path.with_name(f"{path.stem}_frames{path.suffix}")
    if path.suffix == ".npz":
        write_scores(path, columns | {"frame_log_prob": log_prob, "frame_nll": nll})
        frames_file = path
    else:
        write_scores(path, columns)
        real = ~nll.isnan()
        where = real.nonzero()
        write_scores(frames_file, {"index": where[:, 0], "frame": where[:, 1],
                                   "log_prob": log_prob[real], "nll": nll[real]})
    worst = int(columns["nll"].argmax())
    x, mask = trimmed_batch(getattr(run.dataset, split), torch.tensor([worst]),
                            torch.device("cpu"))
    figure = plot_frame_scores(
        run.dataset.to_raw(x, mask)[0], mask[0], nll[worst, : x.shape[1]],
        path.with_name(f"{path.stem}_frames.png"), labels=PlotLabels.for_dataset(
            run.dataset.name), title=f"{split} sequence {worst} (highest NLL)",
        unit=run.dataset.unit,
    )
    return [frames_file, figure] if frames_file != path else [figure]


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


def _read_json(path: Path) -> dict[str, Any]:
    """Earlier results; an unreadable file is replaced (it only caches evaluations)."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return {}
    return data if isinstance(data, dict) else {}
