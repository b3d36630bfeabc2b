r"""Using a trained run: reload it, measure its likelihood, draw samples, draw figures.

The test NLL is reported in the dataset's unit and in the original units of the data (the
preprocessing's log-Jacobian is added, :meth:`~iresflow.data.datasets.SequenceDataset.nll`). With
the exact log-determinant it is deterministic; with the Russian-roulette estimator every sequence
gets ``n_samples`` independent unbiased estimates and the NLL comes with its standard error
:math:`\sqrt{\sum_b s_b^2} / \sum_b u_b` (independent sequences).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from iresflow.data.datasets import SequenceDataset
from iresflow.models.config import ModelConfig
from iresflow.models.transformer import ResidualFlowTransformer
from iresflow.train.averaging import copy_parameters, load_average, moving_average
from iresflow.train.checkpoint import CheckpointError, load_checkpoint
from iresflow.train.config import ConfigError, TrainConfig
from iresflow.train.distributed import current_world
from iresflow.train.factories import load_data, model_from_config, resolve_device
from iresflow.train.likelihood import sharded_log_prob, trimmed_batch
from iresflow.train.paths import RunPaths
from iresflow.train.plots import plot_learning_curves, plot_marginals, plot_traces

__all__ = [
    "LoadedRun",
    "Samples",
    "check_guarantees",
    "evaluate_run",
    "load_run",
    "plotted_test_sequences",
    "sample_run",
    "write_plots",
]

#: Sequences sampled for the figures of :func:`write_plots`.
PLOT_SAMPLES = 64
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
            them (iterations and residuals of the fixed-point solves).
    """

    x: Tensor
    mask: Tensor
    lengths: Tensor
    diagnostics: dict[str, Any]


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
        model = model_from_config(ModelConfig.from_dict(state["model_config"]))
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
    steps would not be invertible, MATH.md A).

    Args:
        model: The loaded flow.
        source: The checkpoint it came from, named in the message.

    Raises:
        CheckpointError: a non-finite tensor or a certified bound ``>= 1``.

    Example:
        >>> model = model_from_config(ModelConfig(features=2, max_len=4, n_blocks=1, hidden=4))
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
    scores: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Negative log-likelihood of a split in the dataset's unit.

    Args:
        run: A loaded run.
        split: ``"test"``, ``"val"`` or ``"train"``.
        method: ``"exact"`` or ``"roulette"``.
        n_samples: Roulette estimates per sequence (at least 2 for a standard error).
        seed: Seed of the roulette estimates (torch's global generators are restored after).
        save: Merge the result into ``evaluation.json`` of the run (keyed by split, then
            method); in a process group only rank 0 writes it.
        scores: Also write the per-sequence scores to this ``.npz`` file (rank 0): ``log_prob``,
            the log-density of every sequence of the split in original units (in the split's
            order), and for roulette with ``n_samples >= 2`` its standard error ``stderr``.

    In a process group (``iresflow evaluate --nproc N`` or under ``torchrun``) the ranks share
    the batches of the split and every rank returns the same result, equal to one process's
    (:func:`~iresflow.train.likelihood.sharded_log_prob`).

    Returns:
        ``{"split", "method", "nll", "unit", "sequences", "checkpoint", "epoch"}`` plus
        ``"n_samples"`` and ``"stderr"`` for the roulette method.

    Raises:
        ValueError: unknown split or method, ``n_samples < 1``, or ``scores`` not ending in
            ``.npz``.
    """
    if scores is not None and not str(scores).endswith(".npz"):
        raise ValueError(f"scores must name an .npz file, got {str(scores)!r}")
    if split not in ("test", "val", "train"):
        raise ValueError(f"split must be test, val or train, got {split!r}")
    if method not in ("exact", "roulette"):
        raise ValueError(f"method must be exact or roulette, got {method!r}")
    data = getattr(run.dataset, split)
    log_prob, stderr = sharded_log_prob(
        run.model, data, method=method, n_samples=n_samples, batch_size=run.config.batch_size,
        seed=seed,
    )
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
    if scores is not None and current_world().main:
        arrays = {"log_prob": (log_prob + data.log_jacobian).numpy()}
        if stderr is not None:
            arrays["stderr"] = stderr.numpy()
        Path(scores).parent.mkdir(parents=True, exist_ok=True)
        np.savez(scores, **arrays)
    if save and current_world().main:
        results = _read_json(run.paths.evaluation)
        results.setdefault(split, {})[method] = result
        run.paths.evaluation.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return result


def sample_run(
    run: LoadedRun, num: int, *, length: int | None = None, seed: int = 0
) -> Samples:
    """Draw sequences from a run's model by inverting the flow.

    Args:
        run: A loaded run.
        num: Number of sequences.
        length: Common length of all samples; ``None`` draws the lengths from the training
            split's length distribution.
        seed: Seed of the lengths and of the base noise.

    Returns:
        :class:`Samples` in the data's original units.

    Raises:
        ValueError: ``num < 1``, or ``length`` outside ``[1, max_len]``.
        InversionError: a fixed-point inverse did not converge.
    """
    device = next(run.model.parameters()).device
    generator = torch.Generator(device).manual_seed(seed)
    if length is None:
        lengths = run.dataset.sample_lengths(num, generator=torch.Generator().manual_seed(seed))
        x, mask = run.model.sample(num, lengths=lengths, generator=generator)
    else:
        x, mask = run.model.sample(num, seq_len=length, generator=generator)
        lengths = torch.full((num,), length, dtype=torch.int64)
    diagnostics = run.model.inverse_diagnostics()
    return Samples(run.dataset.to_raw(x, mask).cpu(), mask.cpu(), lengths.cpu(), diagnostics)


def write_plots(run: LoadedRun, *, seed: int = 0) -> list[Path]:
    """Write the run's figures into ``plots/``.

    ``learning_curves.png`` (NLL and learning rate per epoch), ``samples.png`` (test sequences
    and model samples as per-feature traces) and ``marginals.png`` (per-feature histograms of
    the frames of the test sequences of :func:`plotted_test_sequences` and of the frames of
    :data:`PLOT_SAMPLES` sampled sequences), all in the data's original units.

    Args:
        run: A loaded run.
        seed: Seed of the samples.

    Returns:
        The paths written.
    """
    samples = sample_run(run, PLOT_SAMPLES, seed=seed)
    real, mask = plotted_test_sequences(run)
    folder = run.paths.plots
    written = [] if not run.history else [
        plot_learning_curves(run.history, folder / "learning_curves.png", unit=run.dataset.unit)
    ]
    written.append(plot_traces(real, mask, samples.x, samples.mask, folder / "samples.png"))
    written.append(plot_marginals(real, mask, samples.x, samples.mask, folder / "marginals.png"))
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


def _read_json(path: Path) -> dict[str, Any]:
    """Earlier results; an unreadable file is replaced (it only caches evaluations)."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return {}
    return data if isinstance(data, dict) else {}
