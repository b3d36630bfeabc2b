r"""One trainer and one evaluation routine for every model of the results table.

:func:`fit_model` minimises the negative log-likelihood per real frame,

.. math:: \mathcal L = -\frac{\sum_b \log p_\theta(x_b)}{\sum_b \sum_n m_{bn}},

with Adam on shuffled minibatches, within a fixed budget of epochs and of optimisation seconds,
stops early when the validation loss has not improved for ``patience`` epochs, and restores the
parameters of the best validation epoch. Any model with ``log_prob(x, mask) -> (B,)`` works.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from iresflow.data.datasets import SequenceSplit

__all__ = ["FitResult", "batch_of", "fit_model", "split_log_prob"]

LogProbFn = Callable[[Tensor, Tensor | None], Tensor | tuple[Tensor, ...]]


@dataclass
class FitResult:
    """Summary of one :func:`fit_model` call.

    Attributes:
        best_val_loss: Lowest validation loss (nats per real frame, model space).
        best_epoch: Epoch (1-based) of that loss; 0 if no epoch improved on the initial model.
        epochs: Epochs of optimisation done (fractional when the time budget ended an epoch).
        train_seconds: Wall time spent in optimisation steps (validation excluded).
        stopped: ``"patience"``, ``"time"``, ``"epochs"`` or ``"diverged"``.
        history: Validation loss after every epoch.
    """

    best_val_loss: float
    best_epoch: int
    epochs: float
    train_seconds: float
    stopped: str
    history: list[float] = field(default_factory=list)

    @property
    def seconds_per_epoch(self) -> float:
        """Optimisation wall time per epoch (NaN before the first step)."""
        return self.train_seconds / self.epochs if self.epochs > 0 else math.nan


def batch_of(split: SequenceSplit, index: Tensor) -> tuple[Tensor, Tensor | None]:
    """Sequences ``index`` of a split, cut to their longest real length.

    Padding never changes a density, so trimming only saves work. A mask with no padding left
    is returned as ``None``.

    Args:
        split: Source split.
        index: Integer indices ``(b,)``.

    Returns:
        ``x (b, n, D)`` and ``mask (b, n)`` or ``None``.

    Example:
        >>> split = SequenceSplit(torch.zeros(2, 4, 1), torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]]
        ...                       ).bool(), torch.zeros(2, dtype=torch.float64))
        >>> x, mask = batch_of(split, torch.tensor([0, 1]))
        >>> x.shape, mask.tolist()
        (torch.Size([2, 2, 1]), [[True, True], [True, False]])
    """
    mask = split.mask[index]
    n = int(mask.sum(1).max())
    x, mask = split.x[index, :n], mask[:, :n]
    return x, (None if bool(mask.all()) else mask)


def split_log_prob(
    log_prob: LogProbFn, split: SequenceSplit, batch_size: int = 256
) -> Tensor | tuple[Tensor, ...]:
    """Evaluate ``log_prob(x, mask)`` on a whole split in batches of similar lengths.

    Runs under ``torch.no_grad()`` (models that need autograd internally enable it themselves).

    Args:
        log_prob: Callable returning ``(b,)`` log-densities, or a tuple of ``(b,)`` tensors.
        split: Sequences to evaluate.
        batch_size: Sequences per call.

    Returns:
        ``(B,)`` float64 tensor(s) in the split's order, on the CPU.

    Example:
        >>> split = SequenceSplit(torch.ones(3, 2, 1), torch.ones(3, 2, dtype=torch.bool),
        ...                       torch.zeros(3, dtype=torch.float64))
        >>> split_log_prob(lambda x, mask: -x.sum((1, 2)), split, batch_size=2).tolist()
        [-2.0, -2.0, -2.0]
    """
    order = torch.argsort(split.mask.sum(1), stable=True)  # similar lengths share a batch
    parts: list[tuple[Tensor, ...]] = []
    with torch.no_grad():
        for index in order.split(batch_size):
            out = log_prob(*batch_of(split, index))
            parts.append(out if isinstance(out, tuple) else (out,))
    inverse = torch.argsort(order)
    merged = tuple(torch.cat([p[k] for p in parts]).double().cpu()[inverse]
                   for k in range(len(parts[0])))
    return merged if len(merged) > 1 else merged[0]


def _val_loss(log_prob: LogProbFn, split: SequenceSplit, batch_size: int) -> float:
    values = split_log_prob(log_prob, split, batch_size)
    assert isinstance(values, Tensor)
    return -float(values.sum()) / float(split.mask.sum())


def fit_model(
    model: nn.Module,
    train: SequenceSplit,
    val: SequenceSplit,
    *,
    lr: float = 1e-3,
    batch_size: int = 64,
    max_epochs: int = 100,
    max_seconds: float = 60.0,
    patience: int = 10,
    grad_clip: float = 100.0,
    eval_batch_size: int = 256,
    val_log_prob: LogProbFn | None = None,
    generator: torch.Generator | None = None,
    on_epoch: Callable[[int, float, bool], None] | None = None,
) -> FitResult:
    """Train ``model`` by maximum likelihood with early stopping on the validation loss.

    Args:
        model: Module with ``log_prob(x, mask) -> (B,)``.
        train: Training split.
        val: Validation split.
        lr: Adam learning rate.
        batch_size: Sequences per optimisation step.
        max_epochs: Epoch budget.
        max_seconds: Budget of optimisation wall time (checked after every step).
        patience: Epochs without improvement of the validation loss before stopping.
        grad_clip: Gradient-norm clipping threshold (the same for every model).
        eval_batch_size: Sequences per validation call.
        val_log_prob: Validation log-density ``(x, mask) -> (B,)``, evaluated in ``eval()``
            mode; defaults to ``model.log_prob``.
        generator: Generator of the shuffling order.
        on_epoch: Called as ``on_epoch(epoch, seconds, last)`` after the validation of every
            epoch (not after a diverged one), with the model in ``eval()`` mode, ``seconds`` the
            optimisation time so far and ``last`` whether training stops after this epoch
            (e.g. to record a learning curve; its own time is not counted).

    Returns:
        A :class:`FitResult`; ``model`` holds the parameters of the best validation epoch and
        is left in ``eval()`` mode.

    Example:
        >>> from benchmarks.baselines.nflows_models import frame_maf
        >>> split = SequenceSplit(torch.randn(8, 3, 2), torch.ones(8, 3, dtype=torch.bool),
        ...                       torch.zeros(8, dtype=torch.float64))
        >>> result = fit_model(frame_maf(2, 3, hidden=4, n_layers=1), split, split, max_epochs=2)
        >>> result.epochs
        2.0
    """
    if not isinstance(max_epochs, int) or max_epochs < 1:
        raise ValueError(f"max_epochs must be a positive int, got {max_epochs!r}")
    if max_seconds <= 0 or batch_size < 1 or patience < 1:
        raise ValueError("max_seconds, batch_size and patience must be positive")
    evaluate = val_log_prob if val_log_prob is not None else model.log_prob
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.eval()
    best = _val_loss(evaluate, val, eval_batch_size)
    best_state, best_epoch = copy.deepcopy(model.state_dict()), 0
    history: list[float] = []
    steps_per_epoch = math.ceil(len(train) / batch_size)
    steps, seconds, stopped = 0, 0.0, "epochs"
    for epoch in range(1, max_epochs + 1):
        model.train()
        order = torch.randperm(len(train), generator=generator)
        for index in order.split(batch_size):
            start = time.perf_counter()
            x, mask = batch_of(train, index)
            frames = x.shape[0] * x.shape[1] if mask is None else mask.sum()
            loss = -model.log_prob(x, mask).sum() / frames
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            finite = bool(torch.isfinite(loss))
            if finite:
                optimizer.step()
            seconds += time.perf_counter() - start
            steps += 1
            if not finite:
                stopped = "diverged"
                break
            if seconds >= max_seconds:
                stopped = "time"
                break
        model.eval()
        current = _val_loss(evaluate, val, eval_batch_size) if stopped != "diverged" else math.inf
        history.append(current)
        if current < best:
            best, best_epoch = current, epoch
            best_state = copy.deepcopy(model.state_dict())
        if stopped not in ("diverged", "time") and epoch - best_epoch >= patience:
            stopped = "patience"
        last = stopped != "epochs" or epoch == max_epochs
        if on_epoch is not None and stopped != "diverged":
            on_epoch(epoch, seconds, last)
        if last:
            break
    model.load_state_dict(best_state)
    model.eval()
    return FitResult(best, best_epoch, steps / steps_per_epoch, seconds, stopped, history)
