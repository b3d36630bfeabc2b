"""Whole splits through a density model: log-densities in batches and a check of the inverse.

Used after every training epoch (validation), by the evaluation of a finished run, which
shares the batches among the ranks of a process group (:func:`sharded_log_prob`), and by the
benchmarks for every model they train. The trainer and these functions need only a
:class:`DensityModel`; the options of a flow (the log-determinant method, a context, the
inverse) apply to a :class:`~iresflow.models.flow.SequenceFlow`.
"""

from __future__ import annotations

import itertools
import math
import warnings
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from iresflow.data.datasets import SequenceSplit
from iresflow.data.store import StoredSplit
from iresflow.inverse.fixed_point import InversionError
from iresflow.models.config import ModelConfig
from iresflow.models.flow import SequenceFlow
from iresflow.train.distributed import all_gather_objects, current_world

__all__ = [
    "INVERSE_CHECK_SEQUENCES",
    "MAX_RECONSTRUCTION_ERROR",
    "DensityModel",
    "batch_context",
    "inverse_check",
    "log_prob_cost",
    "placement",
    "reconstructs",
    "sharded_log_prob",
    "split_log_prob",
    "trimmed_batch",
    "validation_method",
]

#: Sequences reconstructed by :func:`inverse_check`.
INVERSE_CHECK_SEQUENCES = 8
#: Largest reconstruction error of :func:`inverse_check`, in model space (standardised data: a
#: hundredth of a standard deviation, hundreds of times a sound float32 inverse's), of a model
#: fit to be kept as the best of a run: beyond it the inverse of an ill-conditioned model is
#: wrong although its solver converged, and so are its samples.
MAX_RECONSTRUCTION_ERROR = 1e-2
#: Forward-pass equivalents of one roulette estimate of a residual step in evaluation mode
#: (calibrated on the CPU against the exact method's cost model, JapaneseVowels and CO2).
ROULETTE_PASSES = 12


@runtime_checkable
class DensityModel(Protocol):
    """What the trainer needs of a model: per-sequence log-densities of a padded batch.

    ``log_prob(x, mask)`` takes sequences ``(B, N, D)`` and their padding mask ``(B, N)``
    (``True`` for real frames) and returns log-densities ``(B,)``, differentiable in training
    mode; in ``eval()`` mode it is the estimate validation uses. Every
    :class:`~iresflow.models.flow.SequenceFlow` is one, and so is each baseline of the
    benchmarks.
    """

    def log_prob(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """Log-densities ``(B,)`` of ``x`` ``(B, N, D)`` with mask ``(B, N)``."""
        ...


def placement(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    """The device and floating dtype of a model's parameters (or buffers), where its batches go.

    Example:
        >>> placement(nn.Linear(2, 2).double())
        (device(type='cpu'), torch.float64)
    """
    tensors = itertools.chain(model.parameters(), model.buffers())
    parameter = next((t for t in tensors if t.is_floating_point()), None)
    if parameter is None:
        return torch.device("cpu"), torch.get_default_dtype()
    return parameter.device, parameter.dtype


def trimmed_batch(
    split: SequenceSplit | StoredSplit,
    index: Tensor,
    device: torch.device,
    dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """The sequences ``index`` of a split, trimmed to the longest of them, on ``device``.

    Trailing padding is dropped (a density never depends on padding), so attention and exact
    Jacobians cost what the real frames need.

    Args:
        split: Sequences ``(B, N, D)`` with their mask ``(B, N)``.
        index: Indices of the sequences to take, shape ``(b,)``.
        device: Where the batch goes.
        dtype: Floating dtype of the sequences (default: the split's), e.g. a float64 model's.

    Returns:
        ``(x, mask)`` of shapes ``(b, n, D)`` and ``(b, n)``, ``n`` the longest length taken.

    Example:
        >>> mask = torch.tensor([[True, True, False], [True, False, False]])
        >>> split = SequenceSplit(mask.unsqueeze(-1).float(), mask, torch.zeros(2))
        >>> x, m = trimmed_batch(split, torch.tensor([1]), torch.device("cpu"), torch.float64)
        >>> x.shape, x.dtype, m.tolist()
        (torch.Size([1, 1, 1]), torch.float64, [[True]])
    """
    if isinstance(split, StoredSplit):  # read from disk
        x, mask = split.batch(index, device)
        return x.to(dtype=dtype), mask
    mask = split.mask[index]
    longest = int((mask * torch.arange(1, mask.shape[1] + 1)).amax())  # past the last real frame
    return split.x[index, :longest].to(device, dtype), mask[:, :longest].to(device)


def batch_context(
    model: nn.Module,
    split: SequenceSplit | StoredSplit,
    index: Tensor,
    device: torch.device,
    *,
    label: int | None = None,
) -> Tensor | None:
    """The context of the sequences ``index`` of a split for a model, on ``device``.

    A label-conditional flow (a context encoder with ``num_classes > 0``) takes the split's
    class labels, a covariate-conditional one its covariates; an unconditional flow and any
    other :class:`DensityModel` take ``None``.

    Args:
        model: The model.
        split: Sequences with their ``labels`` ``(B,)`` or ``covariates`` ``(B, C)``.
        index: Indices of the sequences, shape ``(b,)``.
        device: Where the context goes.
        label: Give every sequence this class instead of its own (label-conditional flows;
            to score each class, :func:`~iresflow.runs.classify.class_log_likelihoods`).

    Returns:
        Labels ``(b,)`` int64, covariates ``(b, C)``, or ``None``.

    Raises:
        ValueError: a conditional flow and a split without its context, or ``label`` for a
            model that is not label-conditional.

    Example:
        >>> from iresflow.models.residual_flow import ResidualSequenceFlow
        >>> model = ResidualSequenceFlow(features=1, max_len=3, n_blocks=1, hidden=4,
        ...                                 num_classes=2)
        >>> mask = torch.ones(3, 3, dtype=torch.bool)
        >>> split = SequenceSplit(torch.zeros(3, 3, 1), mask, torch.zeros(3),
        ...                       labels=torch.tensor([1, 0, 1]))
        >>> batch_context(model, split, torch.tensor([0, 2]), torch.device("cpu")).tolist()
        [1, 1]
    """
    encoder = model.context_encoder if isinstance(model, SequenceFlow) else None
    if label is not None:
        if encoder is None or encoder.num_classes == 0:
            raise ValueError("label needs a label-conditional model (num_classes > 0)")
        return torch.full((len(index),), label, dtype=torch.int64, device=device)
    if encoder is None:
        return None
    kind = "labels" if encoder.num_classes > 0 else "covariates"
    values = getattr(split, kind, None)  # a StoredSplit holds neither
    if values is None:
        raise ValueError(f"the model is conditional but the split has no {kind}")
    return values[index].to(device)


def validation_method(model: nn.Module, eval_method: str) -> str | None:
    r"""The log-determinant method of a model's validation NLL for the setting ``eval_method``.

    A model that is not a flow has its own ``log_prob`` (``None``). For a flow, ``"auto"`` is
    ``"exact"`` when its exact log-determinant splits by frames
    (:attr:`~iresflow.models.flow.SequenceFlow.exact_by_frames`: a causal or position-wise
    chain, a few branch passes per step and a :math:`D \times D` determinant per frame) and
    ``"roulette"`` otherwise; ``"exact"`` and ``"roulette"`` are taken as they are.

    Raises:
        ValueError: ``eval_method`` is not ``"auto"``, ``"exact"`` or ``"roulette"``.

    Example:
        >>> from iresflow.models.residual_flow import ResidualSequenceFlow
        >>> flow = ResidualSequenceFlow(features=2, max_len=8, n_blocks=1, causal=True)
        >>> validation_method(flow, "auto"), validation_method(nn.Linear(2, 2), "auto")
        ('exact', None)
    """
    if eval_method not in ("auto", "exact", "roulette"):
        raise ValueError(f"eval_method must be auto, exact or roulette, got {eval_method!r}")
    if not isinstance(model, SequenceFlow):
        return None
    if eval_method == "auto":
        return "exact" if model.exact_by_frames else "roulette"
    return eval_method


def split_log_prob(
    model: nn.Module,
    split: SequenceSplit | StoredSplit,
    *,
    method: str | None = None,
    n_samples: int = 1,
    batch_size: int = 64,
    label: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Per-sequence log-densities of a whole split, in batches; leaves the model in eval mode.

    A conditional flow is given the context of every sequence (:func:`batch_context`); the
    batches take the model's device and floating dtype (:func:`placement`).

    Args:
        model: A :class:`DensityModel`.
        split: Sequences ``(B, N, D)`` with their mask (and context).
        method: A flow's log-determinant, ``"exact"`` or ``"roulette"``; ``None``: the model's
            own ``log_prob`` in eval mode (for a flow, its configured estimators).
        n_samples: Roulette estimates averaged per sequence (``method = "roulette"`` only).
        batch_size: Sequences per forward pass.
        label: Score every sequence under this class instead of its own (label-conditional
            flows).

    Returns:
        ``(log_prob, stderr)``, each of shape ``(B,)`` on the CPU in float64; ``stderr`` (the
        standard error of the roulette average) is ``None`` unless ``n_samples > 1``.

    Example:
        >>> from iresflow.models.residual_flow import ResidualSequenceFlow
        >>> model = ResidualSequenceFlow(features=2, max_len=3, n_blocks=1, hidden=4)
        >>> split = SequenceSplit(torch.randn(5, 3, 2), torch.ones(5, 3, dtype=torch.bool),
        ...                       torch.zeros(5, dtype=torch.float64))
        >>> log_prob, stderr = split_log_prob(model.double(), split, method="exact")
        >>> log_prob.shape, log_prob.dtype, stderr
        (torch.Size([5]), torch.float64, None)
    """
    if method not in (None, "exact", "roulette"):
        raise ValueError(f"method must be None, exact or roulette, got {method!r}")
    model.eval()
    values, errors = [], []
    with torch.no_grad():  # the estimators enable gradients where they need them
        for index in torch.arange(len(split)).split(batch_size):
            value, error = _batch_log_prob(model, split, index, method, n_samples, label)
            values.append(value)
            if error is not None:
                errors.append(error)
    log_prob = torch.cat(values).double().cpu()
    stderr = torch.cat(errors).double().cpu() if errors else None
    return log_prob, stderr


def log_prob_cost(
    config: ModelConfig, features: int, mask: Tensor, *, method: str, n_samples: int = 1
) -> float:
    r"""Estimated multiply-adds of the log-densities of a split (to choose a method).

    For a sequence of :math:`n` real frames of :math:`D` features, MLP and convolution width
    :math:`H` and kernel size :math:`k`, one forward pass of a residual branch costs about
    :math:`c = 2nD^2 + 2nDH` (``mlp``), :math:`n(2kDH + H^2)` (``conv``) or
    :math:`n^2 D + 2nD^2` (``attention``). The exact method reads the per-frame
    :math:`D \times D` blocks of an MLP step from :math:`D` backward passes, the banded
    Jacobian of a convolution step from :math:`(2k - 1) D` and the dense Jacobian of an
    attention step from :math:`nD`, and factorises the :math:`nD \times nD` Jacobians,
    :math:`(nD)^3 / 3`, or only their :math:`n` diagonal blocks, :math:`n D^3 / 3`, in a
    causal flow (docs/forecasting.md#frame-scores); each roulette estimate costs
    :data:`ROULETTE_PASSES` forward-pass equivalents per residual step. The autoregressive and
    mixing layers are linear with closed-form log-determinants and are not counted. Constant
    factors are rough: the estimate compares methods and sizes, it does not predict seconds.

    Args:
        config: Model settings (``n_blocks``, ``layers``, ``hidden``, ``kernel_size`` and
            ``causal`` are used).
        features: Features ``D`` per frame.
        mask: Padding mask of the split ``(B, N)``, ``True`` for real frames.
        method: ``"exact"`` or ``"roulette"``.
        n_samples: Roulette estimates per sequence.

    Returns:
        The estimated number of multiply-adds, summed over sequences and blocks.

    Example:
        >>> mask = torch.ones(1, 10, dtype=torch.bool)
        >>> config = ModelConfig(n_blocks=1, hidden=4, layers=("mlp",))
        >>> round(log_prob_cost(config, 2, mask, method="exact"), 1)
        480.0
    """
    if method not in ("exact", "roulette"):
        raise ValueError(f"method must be exact or roulette, got {method!r}")
    n, d, h = mask.sum(dim=1).double(), float(features), float(config.hidden)
    k = float(config.kernel_size)
    forward = {
        "mlp": 2 * n * d * d + 2 * n * d * h,
        "conv": n * (2 * k * d * h + h * h),
        "attention": n * n * d + 2 * n * d * d,
    }
    factorised = n * d**3 / 3 if config.causal else (n * d) ** 3 / 3
    exact = {
        "mlp": d * forward["mlp"],
        "conv": (2 * k - 1) * d * forward["conv"] + factorised,
        "attention": n * d * forward["attention"] + (n * d) ** 3 / 3,
    }
    steps = [kind for kind in config.layers if kind in forward]
    if method == "roulette":
        per_block = sum(n_samples * ROULETTE_PASSES * forward[kind] for kind in steps)
    else:
        per_block = sum(exact[kind] for kind in steps)
    return config.n_blocks * float(torch.as_tensor(per_block).sum())


def sharded_log_prob(
    model: nn.Module,
    split: SequenceSplit | StoredSplit,
    *,
    method: str | None = None,
    n_samples: int = 1,
    batch_size: int = 64,
    seed: int = 0,
    label: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """:func:`split_log_prob` shared among the ranks of a process group, gathered in order.

    The split is cut into batches of ``batch_size`` consecutive sequences; rank ``r`` of ``W``
    computes the batches ``r, r + W, ...`` and every rank receives all of them in the order of
    the split. Before each batch torch's global generators (those of the per-call roulette
    estimators) are seeded with the batch's own seed, drawn from ``seed``, so the result does not
    depend on the number of processes: any ``W`` gives what one process gives. The caller's
    random states are restored afterwards. Without a process group it runs every batch itself.

    Args:
        model: A :class:`DensityModel`, the same on every rank.
        split: Sequences ``(B, N, D)`` with their mask, the same on every rank.
        method: As in :func:`split_log_prob`.
        n_samples: Roulette estimates averaged per sequence (``method = "roulette"`` only).
        batch_size: Sequences per forward pass.
        seed: Seed of the per-batch seeds.
        label: Score every sequence under this class instead of its own (label-conditional
            models).

    Returns:
        ``(log_prob, stderr)`` of shape ``(B,)`` on the CPU in float64, on every rank, as in
        :func:`split_log_prob`.

    Example:
        >>> from iresflow.models.config import ModelConfig
        >>> from iresflow.models.residual_flow import ResidualSequenceFlow
        >>> model = ResidualSequenceFlow(features=2, max_len=3, n_blocks=1, hidden=4)
        >>> split = SequenceSplit(torch.randn(5, 3, 2), torch.ones(5, 3, dtype=torch.bool),
        ...                       torch.zeros(5, dtype=torch.float64))
        >>> log_prob, _ = sharded_log_prob(model, split, method="exact", batch_size=2)
        >>> torch.allclose(log_prob, split_log_prob(model, split, method="exact")[0])
        True
    """
    device = placement(model)[0]
    world = current_world()
    batches = torch.arange(len(split)).split(batch_size)
    seeds = torch.randint(
        2**62, (len(batches),), generator=torch.Generator().manual_seed(seed)
    ).tolist()
    mine = []
    model.eval()
    with torch.no_grad(), torch.random.fork_rng(
        devices=[device] if device.type == "cuda" else []
    ):
        for k in range(world.rank, len(batches), world.size):
            torch.manual_seed(seeds[k])
            value, error = _batch_log_prob(model, split, batches[k], method, n_samples, label)
            mine.append((k, value.double().cpu(), None if error is None else error.double().cpu()))
    parts = sorted(part for rank_parts in all_gather_objects(mine) for part in rank_parts)
    log_prob = torch.cat([value for _, value, _ in parts])
    errors = [error for _, _, error in parts if error is not None]
    return log_prob, torch.cat(errors) if errors else None


def _batch_log_prob(
    model: nn.Module, split: SequenceSplit | StoredSplit, index: Tensor, method: str | None,
    n_samples: int, label: int | None,
) -> tuple[Tensor, Tensor | None]:
    """Log-densities of the sequences ``index`` (and their standard errors, or ``None``)."""
    device, dtype = placement(model)
    x, mask = trimmed_batch(split, index, device, dtype)
    options: dict[str, object] = {}
    context = batch_context(model, split, index, device, label=label)
    if context is not None:
        options["context"] = context
    if method is not None:
        options["method"] = method
    if method == "roulette" and n_samples > 1:
        return model.log_prob(x, mask, n_samples=n_samples, return_stderr=True, **options)
    return model.log_prob(x, mask, **options), None


def inverse_check(model: SequenceFlow, split: SequenceSplit | StoredSplit) -> dict[str, float]:
    """Map the first :data:`INVERSE_CHECK_SEQUENCES` sequences to noise and back.

    A fixed-point inverse that stops converging is reported, not raised (training goes on and
    decides with its ``on_nan`` setting). Leaves the model in eval mode.

    Args:
        model: The flow (its device is used).
        split: Sequences ``(B, N, D)`` with their mask (and context, :func:`batch_context`).

    Returns:
        ``{"inverse_iterations", "inverse_residual", "reconstruction_error"}``: the solver's
        largest iteration count and residual, and the largest absolute error over the real
        frames (``inf`` when the inverse did not converge).
    """
    device, dtype = placement(model)
    index = torch.arange(min(INVERSE_CHECK_SEQUENCES, len(split)))
    x, mask = trimmed_batch(split, index, device, dtype)
    context = batch_context(model, split, index, device)
    model.eval()
    with torch.no_grad():
        z = model.transform_to_noise(x, mask, context=context)
        try:
            x_back = model.inverse(z, mask, context=context)
        except InversionError as error:
            return {
                "inverse_iterations": float(error.iterations.max()),
                "inverse_residual": float(error.residual.max()),
                "reconstruction_error": math.inf,
            }
    diagnostics = model.inverse_diagnostics()
    row = {
        "inverse_iterations": float(diagnostics["max_iterations"]),
        "inverse_residual": float(diagnostics["max_residual"]),
        "reconstruction_error": float((x_back - x)[mask].abs().max()),
    }
    if not reconstructs(row):
        warnings.warn(f"the inverse misses the checked validation sequences by more than "
                      f"{MAX_RECONSTRUCTION_ERROR:g} (the error of the progress line) although "
                      f"its solver converged: the model is ill-conditioned, its samples are "
                      f"wrong, and such an epoch is not kept as the best", UserWarning,
                      stacklevel=2)
    return row


def reconstructs(row: dict[str, float]) -> bool:
    """Whether an epoch's :func:`inverse_check` (its keys in ``row``, absent: no check) found
    a reconstruction error within :data:`MAX_RECONSTRUCTION_ERROR`; ``False`` for ``inf``."""
    return row.get("reconstruction_error", 0.0) <= MAX_RECONSTRUCTION_ERROR
