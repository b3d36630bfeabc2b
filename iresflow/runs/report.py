"""What the commands print about a run, as text: its summary, an evaluation, a set of samples.

:func:`describe_run` is ``iresflow info``: the settings, the size and the certified and observed
Lipschitz constants of every residual branch (settings: :class:`~iresflow.runs.settings.
InfoSettings`). The other functions put the results of :mod:`iresflow.runs.evaluate`,
:mod:`iresflow.runs.sample` and :mod:`iresflow.runs.forecast` into words.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from iresflow.runs.forecast import Forecast
from iresflow.runs.load import LoadedRun
from iresflow.runs.sample import Samples
from iresflow.runs.settings import KEPT, InfoSettings
from iresflow.train.config import ConfigError
from iresflow.train.loop import TrainResult
from iresflow.train.selection import CandidateResult, choose, read_selection

__all__ = [
    "describe_classification",
    "describe_evaluation",
    "describe_forecast",
    "describe_reference",
    "describe_run",
    "describe_samples",
    "describe_selection",
    "describe_training",
]


def describe_run(run: LoadedRun, settings: InfoSettings | None = None, **changes: Any) -> str:
    """A run's data, checkpoint, condition, best validation NLL (and the candidates it chose
    from), size, settings and the Lipschitz constants of its residual branches (certified and
    observed).

    Args:
        run: A loaded run.
        settings: The sequence length of the Lipschitz report (default: the data's longest).
        **changes: Fields of :class:`~iresflow.runs.settings.InfoSettings` to change.

    Returns:
        Lines of text.

    Raises:
        ConfigError: an invalid setting, or ``seq_len`` above the model's ``max_len``.
    """
    settings = (settings or InfoSettings()).replace(**changes)
    seq_len = settings.seq_len if settings.seq_len is not None else run.dataset.max_len
    longest = run.model.max_len
    if longest is not None and seq_len > longest:
        raise ConfigError(f"seq_len must be <= {longest} for this model, got {seq_len}")
    data = run.dataset
    lines = [
        f"run: {run.paths.root}",
        f"data: {data.name} ({data.features} features, up to {data.max_len} frames, NLL in "
        f"{data.unit})",
        f"checkpoint: {run.checkpoint}, epoch {run.epoch}",
    ]
    model = run.model_config
    if run.config.condition == "label":
        classes = data.classes or ()
        lines.append(f"condition: label ({len(classes)} classes: {', '.join(classes)}; "
                     f"embedding of size {model.resolved_context_features})")
    elif run.config.condition == "covariates":
        lines.append(f"condition: covariates ({model.context_features} per sequence)")
    if run.history:
        best = min(run.history, key=lambda row: row["val_nll"])
        lines.append(f"best validation NLL: {best['val_nll']:.4f} (epoch {best['epoch']:.0f})")
    selection = read_selection(run.paths)
    if selection is not None:
        lines.append(f"{describe_selection(selection)} (candidate runs in "
                     f"{run.paths.candidates})")
    lines += [
        f"parameters: {sum(p.numel() for p in run.model.parameters()):,}",
        "\nsettings:",
        run.config.to_toml().rstrip(),
    ]
    generator = torch.Generator(next(run.model.parameters()).device).manual_seed(0)
    report = run.model.lipschitz_report(seq_len, generator=generator)
    lines += [
        "guarantees: re-checked at load: every parameter finite, every certified Lipschitz "
        "constant below 1 (weights are re-normalised in every forward pass)",
        f"\nLipschitz constants of the residual branches (sequence length {seq_len}):",
        f"{'branch':<24}{'type':<36}{'norm':>5}{'certified':>11}{'observed':>10}",
    ]
    lines += [
        f"{row['name']:<24}{row['type']:<36}{row['norm']:>5}{row['certified']:>11.4f}"
        f"{row['estimate']:>10.4f}"
        for row in report
    ]
    return "\n".join(lines)


def describe_training(result: TrainResult, patience: int) -> str:
    """How a training run ended, in words, with a note when it was cut short.

    A run that ended at its cap (``epochs`` or ``max_seconds``) with its best epoch among its
    last ``patience`` epochs (the last tenth with ``patience = 0``) ended before early stopping
    could tell whether the validation NLL had stopped improving: the note says so.

    Args:
        result: The summary of the training.
        patience: The run's ``patience`` setting.

    Returns:
        One line, or two with the note.

    Example:
        >>> from pathlib import Path
        >>> from iresflow.train.paths import RunPaths
        >>> result = TrainResult(RunPaths(Path("run")), 60, 56, -22.524, False, [])
        >>> print(describe_training(result, patience=10))  # doctest: +NORMALIZE_WHITESPACE
        trained 60 epochs (done); best validation NLL -22.5240 at epoch 56
        note: the best epoch is among the last 10, and the run ended at its cap before early
        stopping could tell whether the validation NLL had stopped improving: it may have been
        cut short (train on: --resume with a higher --epochs or --max-seconds)
    """
    how = "stopped early" if result.stopped_early else "done"
    text = (f"trained {result.epochs} epochs ({how}); best validation NLL "
            f"{result.best_val_nll:.4f} at epoch {result.best_epoch}")
    if result.selection:
        text = f"{describe_selection(result.selection)}\nkept: {text}"
    window = patience if patience > 0 else max(1, result.epochs // 10)
    if not result.stopped_early and result.epochs - result.best_epoch < window:
        text += (f"\nnote: the best epoch is among the last {window}, and the run ended at its "
                 f"cap before early stopping could tell whether the validation NLL had stopped "
                 f"improving: it may have been cut short (train on: --resume with a higher "
                 f"--epochs or --max-seconds)")
    return text


def describe_selection(results: Sequence[CandidateResult]) -> str:
    """The candidates of a run (:mod:`iresflow.train.selection`) and the one kept, one line.

    Example:
        >>> print(describe_selection([CandidateResult("configured", -1.25, 9, 19),
        ...     CandidateResult("recurrent", -1.5, 4, 14)]))  # doctest: +NORMALIZE_WHITESPACE
        candidates: configured -1.2500 (best epoch 9 of 19), recurrent -1.5000 (best epoch 4
        of 14); kept recurrent, the lowest validation NLL
    """
    parts = [f"{result.name} failed ({result.error})" if result.error is not None
             else f"{result.name} {result.best_val_nll:.4f} (best epoch {result.best_epoch} of "
                  f"{result.epochs})" for result in results]
    return (f"candidates: {', '.join(parts)}; kept {choose(results).name}, the lowest "
            "validation NLL")


def describe_evaluation(result: dict[str, Any]) -> str:
    """A result of :func:`~iresflow.runs.evaluate.evaluate_run` in words: the NLL on one line,
    then, when the result has them, the per-sequence NLLs of the flow and of the closed-form
    reference (:func:`describe_reference`).

    Example:
        >>> describe_evaluation({"split": "test", "method": "exact", "nll": 1.5,
        ...     "unit": "nats/frame", "sequences": 6, "checkpoint": "best", "epoch": 2})
        'test NLL: 1.5000 nats/frame (exact; 6 sequences, best checkpoint of epoch 2)'
    """
    text = f"{result['split']} NLL: {result['nll']:.4f}"
    if "stderr" in result:
        text += f" ± {result['stderr']:.4f} (standard error)"
    details = result.get("choice", result["method"])
    if "n_samples" in result and "choice" not in result:
        details += f", {result['n_samples']} estimates per sequence"
    lines = [
        f"{text} {result['unit']} ({details}; {result['sequences']} sequences, "
        f"{result['checkpoint']} checkpoint of epoch {result['epoch']})"
    ]
    if "per_sequence" in result:
        lines += describe_reference(result)
    return "\n".join(lines)


def describe_reference(result: dict[str, Any]) -> list[str]:
    """The flow's per-sequence NLLs beside the closed-form reference's, and the warnings.

    Args:
        result: A result of :func:`~iresflow.runs.evaluate.evaluate_run` with
            ``"per_sequence"`` (and ``"reference"`` unless it was switched off).

    Returns:
        Lines of text: a table of NLL, median, worst and the count far above the median for the
        flow and the reference (or why the reference is missing), what the reference is, and
        one ``warning:`` line per warning.
    """
    split, unit = result["split"], result["unit"]
    rows = [("flow", result["nll"], result["per_sequence"])]
    reference = result.get("reference")
    if reference is not None and "nll" in reference:
        rows.append((f"{reference['model']} reference", reference["nll"],
                     reference["per_sequence"]))
    lines = [f"{split} NLL per sequence ({unit}):",
             f"  {'model':<28}{'NLL':>10}{'median':>10}{'worst':>11}  far above the median"]
    for name, nll, summary in rows:
        lines.append(
            f"  {name:<28}{nll:>10.4f}{summary['median']:>10.4f}{summary['worst']:>11.4f}  "
            f"{summary['far_above']} (above {summary['threshold']:.4f})"
        )
    if reference is None:
        return lines
    if "skipped" in reference:
        return [*lines, f"reference: not computed ({reference['skipped']})"]
    condition = reference["flow_condition"]
    about = (f"reference: closed-form {reference['model']}, {reference['parameters']:,} "
             f"parameters, fitted on the training split, order 0..{reference['max_order']} "
             f"chosen on the validation split (its NLL {reference['val_nll']:.4f})")
    if condition != "none":
        about += f"; unconditional, p(x), while the flow is conditional on its {condition}"
    return [*lines, about, *(f"warning: {text}" for text in result.get("warnings", []))]


def describe_classification(classification: dict[str, Any]) -> str:
    """Accuracy and the confusion matrix (rows true, columns predicted) as lines of text."""
    classes, corner = classification["classes"], "true/predicted"
    width = max(len(corner), *(len(name) for name in classes))
    columns = max(5, *(len(name) + 1 for name in classes))
    lines = [
        f"accuracy (Bayes' rule, training class frequencies as prior): "
        f"{classification['accuracy']:.4f}",
        "confusion matrix (rows: true class, columns: predicted class):",
        f"{corner:<{width}}" + "".join(f"{name:>{columns}}" for name in classes),
    ]
    for name, row in zip(classes, classification["confusion"], strict=True):
        lines.append(f"{name:<{width}}" + "".join(f"{count:>{columns}}" for count in row))
    return "\n".join(lines)


def describe_samples(run: LoadedRun, samples: Samples) -> str:
    """Two lines: what was drawn, and whether every fixed-point inverse converged."""
    diagnostics = samples.diagnostics
    return (
        f"sampled {len(samples.lengths)} sequences of lengths {int(samples.lengths.min())}.."
        f"{int(samples.lengths.max())} ({run.checkpoint} checkpoint, epoch {run.epoch})\n"
        f"inverse: at most {diagnostics['max_iterations']} iterations per block; "
        f"{_worst_solve(diagnostics)}"
    )


def _worst_solve(diagnostics: dict[str, Any]) -> str:
    """The solve closest to failing: its residual, as a share of its tolerance (which the two
    rounded numbers alone may hide; truncated, so that a converged solve's is below 1.000), and
    whether every solve converged."""
    residual, tolerance = diagnostics["residual"], diagnostics["tolerance"]
    share = math.floor(residual / tolerance * 1000) / 1000
    verdict = "converged" if diagnostics["converged"] else "NOT converged: residual above tolerance"
    return (f"worst residual {residual:.2e}, {share:.3f} of its tolerance {tolerance:.2e}: "
            f"{verdict}")


def describe_forecast(run: LoadedRun, forecast: Forecast) -> str:
    """What was forecast, its scores against the frames that followed (held-out forecasts), which
    model drew it and where the new frames' noise came from (with the validation scores that
    chose them), how far the observed frames widened the base's draws (where
    it reports it), and whether every fixed-point inverse converged."""
    draws, sequences, horizon, _ = forecast.samples.shape
    what = ("in place of the last frames of" if forecast.truth is not None
            else "after the end of")
    lines = [f"forecast {horizon} frames {what} {sequences} sequences of {forecast.source}, "
             f"{draws} draws each ({run.checkpoint} checkpoint)"]
    scores = forecast.scores
    if scores is not None:
        per_feature = ", ".join(f"{value:.4g}" for value in scores["crps"][:8])
        more = ", ..." if len(scores["crps"]) > 8 else ""
        lines += [
            f"CRPS {scores['crps_mean']:.4g} (original units; per feature {per_feature}{more}); "
            f"energy score {scores['energy']:.4g}",
            f"coverage of the 50% interval {scores['coverage']['50']:.1%}, of the 90% interval "
            f"{scores['coverage']['90']:.1%} ({scores['frames']} frames scored)",
        ]
    model = ("the run's model" if forecast.candidate == KEPT
             else f"the {forecast.candidate} candidate")
    lines.append(f"drawn by {model} (epoch {forecast.epoch}), noise of the new frames: "
                 f"{forecast.noise}")
    if forecast.validation_crps is not None:
        lines.append("chosen on the validation split, CRPS " + ", ".join(
            f"{option} {value:.4g}" for option, value in forecast.validation_crps.items()))
    if forecast.scale is not None:
        widest = int(forecast.scale.argmax())
        lines.append(
            f"scale of the new frames' noise given the observed ones (1: as without them): "
            f"median {float(forecast.scale.median()):.3g}, largest "
            f"{float(forecast.scale[widest]):.3g} (sequence {int(forecast.index[widest])})"
        )
    lines.append(f"inverse: {_worst_solve(forecast.diagnostics)}")
    return "\n".join(lines)
