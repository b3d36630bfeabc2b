r"""One training run between epochs: the optimisation state, a training epoch, validation.

Every epoch passes over the training sequences (as often as ``min_steps`` steps take), each pass
in an order drawn from a seeded :class:`torch.Generator`, minimising the negative log-likelihood
per unit of the batch,

.. math:: \mathcal L = -\frac{\sum_b \log p_\theta(x_b)}{\sum_b u_b},

with :math:`u_b` the frames (or dimensions, for ``bits/dim`` data) of sequence :math:`b` (for a
conditional run :math:`\log p_\theta(x_b \mid c_b)` with the sequence's label or covariates
:math:`c_b`, :func:`~iresflow.train.likelihood.batch_context`); the
log-density comes from the model's training log-determinant (the unbiased Russian-roulette
estimator by default, with the Neumann-series gradient). After each epoch the validation NLL is
computed in the dataset's unit with the evaluation log-determinant, the invertibility of the model
is checked on a few validation sequences, and the learning-rate schedule advances.

Learning rate: a linear warm-up over the optimiser steps of the first ``warmup`` epochs
(:class:`torch.optim.lr_scheduler.LinearLR`, from ``lr / (W + 1)`` to ``lr``), then the epoch
schedule (cosine annealing to a floor by epoch ``anneal``, then the floor; halving on a plateau;
or constant). Early stopping counts an epoch without improvement only when
:meth:`TrainingSession.patience_counts`: a run trains on while validation improves, up to
``epochs`` or the time budget ``max_seconds``.

Numerical health: a step whose loss or gradient norm is not finite never reaches the optimiser;
a non-finite validation NLL or an inverse that stops converging is detected after the epoch.
With ``on_nan = "stop"`` (default) training ends with :class:`TrainingDivergedError`; with
``"skip"`` a warning line goes to stderr and the step is skipped (the epoch's ``skipped_steps``
counts them). An epoch becomes ``best`` only with a finite validation NLL, a converging inverse
and finite weights.

Exact resume: :meth:`TrainingSession.state` holds the model, the optimiser, the schedule and its
warm-up, the moving average of the weights, every random state (torch's global CPU and CUDA
generators, the shuffling generator, the log-determinant's generator) and the metric history, so
a session restored from it continues with the same losses as an uninterrupted one with the same
seed.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from iresflow.data.batching import epoch_batches, epoch_steps
from iresflow.data.datasets import SequenceDataset
from iresflow.models.flow import SequenceFlow
from iresflow.train.averaging import averaged_parameters, load_average, moving_average
from iresflow.train.config import TrainConfig
from iresflow.train.distributed import World, all_gather_objects, broadcast_object, shard
from iresflow.train.likelihood import (
    batch_context,
    inverse_check,
    placement,
    reconstructs,
    split_log_prob,
    trimmed_batch,
    validation_method,
)

__all__ = ["CHECKPOINT_FORMAT", "TrainingDivergedError", "TrainingSession"]

#: Version of the checkpoint layout of :meth:`TrainingSession.state` (2: the moving average is
#: the ``state_dict`` of a :class:`torch.optim.swa_utils.AveragedModel`; 3: the model settings
#: are stored once, in ``config``).
CHECKPOINT_FORMAT = 3
#: ReduceLROnPlateau settings of ``scheduler = "plateau"``; the floor of ``"cosine"``, in ``lr``.
PLATEAU_FACTOR, PLATEAU_PATIENCE, COSINE_FLOOR = 0.5, 2, 0.01
#: Leading training sequences the data-dependent layers are initialised from.
INIT_SEQUENCES = 512
#: With ``scheduler = "cosine"``, epochs count towards ``patience`` only once the learning rate
#: is at most this fraction of ``lr`` (the second half of the schedule).
PATIENCE_LR_FRACTION = 0.5


class TrainingDivergedError(RuntimeError):
    """The training loss, a gradient or the validation NLL became non-finite, or the inverse
    stopped converging (with ``on_nan = "stop"``)."""


class TrainingSession:
    """The mutable state of one training run between epochs, and the epochs themselves.

    The model is any :class:`~iresflow.train.likelihood.DensityModel` (the benchmarks train
    their baselines here); the steps of a flow on top of that (data-dependent initialisation,
    the generator of its estimators, the validation ``eval_method`` and the inverse check, the
    context of a conditional flow) apply to a :class:`~iresflow.models.flow.SequenceFlow`.
    Batches take the model's floating dtype, so a float64 model trains in float64.

    Args:
        config: All settings of the run (the model settings are used for a flow only).
        dataset: Its data (:func:`~iresflow.train.factories.load_data`).
        model: Its model (:func:`~iresflow.train.factories.build_model`), on ``device``.
        device: The training device.
        world: This process's place in the process group (data-parallel runs).

    Attributes:
        epoch: Epochs completed.
        best_epoch: Epoch of the lowest validation NLL so far (0: none yet).
        best_metric: That NLL (``inf`` before the first candidate).
        bad_epochs: Epochs since the last improvement.
        out_of_time: Whether the optimisation seconds reached ``max_seconds``.
        history: One metrics dict per completed epoch.
    """

    def __init__(self, config: TrainConfig, dataset: SequenceDataset, model: nn.Module,
                 device: torch.device, world: World) -> None:
        self.config, self.dataset, self.model, self.device = config, dataset, model, device
        self.world = world
        self.flow = model if isinstance(model, SequenceFlow) else None
        self.dtype = placement(model)[1]
        self.replica: nn.Module = _LogProb(model)
        if world.size > 1:
            self.replica = nn.parallel.DistributedDataParallel(
                self.replica, device_ids=[device] if device.type == "cuda" else None
            )
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        optimizer_type = torch.optim.AdamW if config.optimizer == "adamw" else torch.optim.Adam
        # Fused: one kernel per step on the CPU and CUDA instead of ~10 small ops per parameter
        # (torch's CPU default is a per-parameter loop); the same update up to rounding.
        self.optimizer = optimizer_type(
            self.parameters, lr=config.lr, weight_decay=config.weight_decay,
            fused=True if device.type in ("cpu", "cuda") else None,
        )
        # Warm-up first: it scales the starting lr, which the epoch schedule then multiplies.
        self.warmup_steps = config.warmup * self.steps_per_epoch
        self.warmup: torch.optim.lr_scheduler.LinearLR | None = None
        if self.warmup_steps > 0:
            self.warmup = torch.optim.lr_scheduler.LinearLR(
                self.optimizer, start_factor=1.0 / (self.warmup_steps + 1),
                total_iters=self.warmup_steps,
            )
        self.scheduler: Any = None
        if config.scheduler == "plateau":
            self.scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
                self.optimizer, factor=PLATEAU_FACTOR, patience=PLATEAU_PATIENCE
            )
        elif config.scheduler == "cosine":
            self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
                self.optimizer, T_max=self.cosine_epochs, eta_min=config.lr * COSINE_FLOOR
            )
        self.average = moving_average(model, config.ema) if config.ema > 0 else None
        self.shuffle = torch.Generator().manual_seed(config.seed)
        self.estimator_generator = torch.Generator(device).manual_seed(
            config.seed + 1 + world.rank
        )
        if self.flow is not None:
            self.flow.set_generator(self.estimator_generator)
        self.epoch = 0
        self.best_epoch = 0
        self.best_metric = math.inf
        self.bad_epochs = 0
        self.out_of_time = False
        self.history: list[dict[str, float]] = []

    @property
    def steps_per_epoch(self) -> int:
        """Optimiser steps of a full epoch (:func:`~iresflow.data.batching.epoch_steps`)."""
        return epoch_steps(len(self.dataset.train), self.config.batch_size, self.config.min_steps)

    @property
    def cosine_epochs(self) -> int:
        """Epochs of the cosine annealing: after the warm-up, to ``min(anneal, epochs)`` or
        ``epochs`` (``anneal = 0``); at least one."""
        end = min(self.config.anneal or self.config.epochs, self.config.epochs)
        return max(1, end - self.config.warmup)

    @property
    def train_seconds(self) -> float:
        """Optimisation seconds of the completed epochs (validation excluded)."""
        return sum(row["train_seconds"] for row in self.history)

    def stop_reason(self) -> str | None:
        """Why training ends now: ``"patience"`` (early stopping), ``"time"`` (``max_seconds``),
        ``"epochs"``, or ``None`` to go on."""
        config = self.config
        if config.patience > 0 and self.bad_epochs >= config.patience:
            return "patience"
        if self.out_of_time:
            return "time"
        return "epochs" if self.epoch >= config.epochs else None

    # -- checkpoint state -------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Everything a checkpoint holds (a collective call in data-parallel runs).

        The layout is described in :mod:`iresflow.train.checkpoint`.
        """
        rng: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "shuffle": self.shuffle.get_state(),
            "estimator": self.estimator_generator.get_state(),
        }
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        ranks = all_gather_objects({k: v.cpu() for k, v in rng.items()})
        return {
            "format": CHECKPOINT_FORMAT,
            "config": self.config.to_dict(),
            "model": self.model.state_dict(),
            "ema": self.average.state_dict() if self.average is not None else None,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "warmup": self.warmup.state_dict() if self.warmup is not None else None,
            "rng": rng,
            "epoch": self.epoch,
            "best_epoch": self.best_epoch,
            "best_metric": self.best_metric,
            "bad_epochs": self.bad_epochs,
            "history": self.history,
            "nproc": self.world.size,
            "rng_ranks": ranks if self.world.size > 1 else None,
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state` of the same settings."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
            if isinstance(self.scheduler, torch.optim.lr_scheduler.CosineAnnealingLR):
                self.scheduler.T_max = self.cosine_epochs  # a longer run keeps annealing
        if self.warmup is not None:
            if state.get("warmup") is not None:
                self.warmup.load_state_dict(state["warmup"])
            else:  # a checkpoint of a run without warm-up: never warm up mid-run
                self.warmup.last_epoch = self.warmup_steps
        if self.average is not None:
            load_average(self.average, state["ema"])
        rng = state["rng"] if self.world.size == 1 else state["rng_ranks"][self.world.rank]
        torch.set_rng_state(rng["torch"])
        self.shuffle.set_state(rng["shuffle"])
        self.estimator_generator.set_state(rng["estimator"])
        if "cuda" in rng and self.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], self.device)
        for name in ("epoch", "best_epoch", "best_metric", "bad_epochs"):
            setattr(self, name, state[name])
        self.history = list(state["history"])
        # The same on every rank: the history is the checkpoint's.
        self.out_of_time = 0 < self.config.max_seconds <= self.train_seconds

    # -- epochs -----------------------------------------------------------------------------
    def train_epoch(self, bar: tqdm) -> dict[str, float]:
        """One epoch (one pass, or the passes ``min_steps`` asks for); its training metrics.

        The epoch ends early, after the step at which the optimisation seconds of the run reach
        ``max_seconds`` (:attr:`out_of_time`).

        Raises:
            TrainingDivergedError: every step was non-finite, or one was with ``on_nan = stop``.
        """
        train, world, config = self.dataset.train, self.world, self.config
        start, spent, budget = time.perf_counter(), self.train_seconds, config.max_seconds
        batches = epoch_batches(train.frames, config.batch_size, self.shuffle, config.bucket,
                                config.min_steps)
        log_prob = torch.zeros(len(train), dtype=torch.float64)
        kept = torch.zeros(len(train), dtype=torch.bool)  # sequences of the finite steps
        grad_norms = []
        self.model.train()
        if self.epoch == 1 and self.flow is not None:
            self.initialize_flow(self.flow)
        steps = 0
        for steps, index in enumerate(batches, start=1):
            part, weight = shard(index, world)
            batch_log_prob, loss, norm = self._backward(index, part, weight)
            bar.update()
            # One host sync per step, after the backward pass: a non-finite loss or gradient
            # must never reach the optimiser, the moving average or a checkpoint.
            over = budget > 0 and spent + time.perf_counter() - start >= budget
            finite, self.out_of_time = self._agree(
                torch.isfinite(loss.detach()) & torch.isfinite(norm), over
            )
            if finite:
                grad_norms.append(norm)
                self._apply()
                kept[index] = True
                log_prob[index] = 0.0  # a later pass replaces an earlier one, on whichever rank
                if weight > 0:
                    log_prob[part] = batch_log_prob.detach().double().cpu()
                if not bar.disable and bar.n % 10 == 1:
                    bar.set_postfix(loss=f"{float(loss):.4g}")
            else:
                self.unhealthy(f"non-finite loss or gradient at epoch {self.epoch}, step {steps}")
                self.optimizer.zero_grad(set_to_none=True)
            if self.out_of_time:
                break
        if not grad_norms:
            raise TrainingDivergedError(
                f"training diverged at epoch {self.epoch}: every step had a non-finite loss or "
                "gradient; try a smaller lr or a gradient clip"
            )
        norms = torch.stack(grad_norms)
        if world.size > 1:  # each rank holds the log-densities of its shards
            torch.distributed.all_reduce(log_prob)
        return {
            "epoch": self.epoch,
            "train_nll": self.dataset.nll(log_prob[kept], train.subset(kept)),
            "skipped_steps": float(steps - len(grad_norms)),
            "steps": float(steps),
            "lr": self.optimizer.param_groups[0]["lr"],
            "grad_norm": float(norms.mean()),
            "grad_norm_max": float(norms.max()),
            "train_seconds": time.perf_counter() - start,
        }

    def initialize_flow(self, flow: SequenceFlow) -> None:
        """Data-dependent layers of a flow (ActNorm, the autoregressive fit) from the same
        leading training sequences on every rank, before the first step."""
        train = self.dataset.train
        first = torch.arange(min(len(train), INIT_SEQUENCES))
        x, mask = trimmed_batch(train, first, self.device, self.dtype)
        flow.initialize(x, mask, context=batch_context(flow, train, first, self.device))

    def _backward(
        self, index: Tensor, part: Tensor, weight: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Loss and gradients of this rank's ``part`` of the batch ``index``.

        Returns:
            The log-densities of ``part`` ``(b,)``, the loss and the gradient norm (clipped to
            ``clip``; before clipping).
        """
        train = self.dataset.train
        x, mask = trimmed_batch(train, part, self.device, self.dtype)
        context = batch_context(self.model, train, part, self.device)
        batch_log_prob = self.replica(x, mask, context)
        # Global-batch normalisation; times W to undo DDP's gradient average.
        units = float(self.dataset.units(train.batch_mask(index)).sum())
        loss = -batch_log_prob.sum() * (weight * self.world.size) / units
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = nn.utils.clip_grad_norm_(self.parameters, self.config.clip or math.inf)
        return batch_log_prob, loss, norm

    def _agree(self, finite: Tensor, over: bool) -> tuple[bool, bool]:
        """Whether the step is finite on every rank, and whether any rank is out of time."""
        if self.world.size == 1:
            return bool(finite), over
        flags = torch.stack([finite, torch.full_like(finite, not over)]).to(torch.int32)
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MIN)
        every_finite, in_time = flags.tolist()  # every rank skips and stops alike
        return bool(every_finite), not in_time

    def _apply(self) -> None:
        """The optimiser step of a finite batch, with the warm-up and the moving average."""
        self.optimizer.step()
        if self.warmup is not None and self.warmup.last_epoch < self.warmup_steps:
            self.warmup.step()
        if self.average is not None:
            self.average.update_parameters(self.model)

    def validate(self) -> dict[str, float]:
        """Validation NLL (with the averaged weights, if kept) and, for a flow, the inverse check.

        A flow is validated with ``eval_method``
        (:func:`~iresflow.train.likelihood.validation_method`), any other model with its own
        ``log_prob`` in eval mode.

        Raises:
            TrainingDivergedError: a non-finite NLL or a diverging inverse with ``on_nan = stop``.
        """
        config, val = self.config, self.dataset.val
        method = validation_method(self.model, config.eval_method)
        with averaged_parameters(self.model, self.average):
            log_prob, stderr = split_log_prob(
                self.model, val, method=method, n_samples=config.eval_n_samples,
                batch_size=config.batch_size,
            )
            finite = bool(torch.isfinite(log_prob).all())
            row = {"val_nll": self.dataset.nll(log_prob, val) if finite else math.nan}
            if stderr is not None and finite:
                row["val_nll_stderr"] = self.dataset.nll_stderr(stderr, val)
            if self.flow is not None:
                row.update(inverse_check(self.flow, val))
        if not math.isfinite(row["val_nll"]):
            self.unhealthy(f"non-finite validation NLL at epoch {self.epoch}")
        if not math.isfinite(row.get("reconstruction_error", 0.0)):
            self.unhealthy(
                f"the inverse stopped converging at epoch {self.epoch} (residual "
                f"{row['inverse_residual']:.2e} after {row['inverse_iterations']:.0f} iterations)"
            )
        return broadcast_object(row)  # every rank takes the same schedule and early stop

    def unhealthy(self, problem: str) -> None:
        """Stop on a numerical problem, or warn and go on (``on_nan``)."""
        if self.config.on_nan == "stop":
            raise TrainingDivergedError(
                f"{problem}; training stopped (the last checkpoint is intact; try a smaller lr, "
                "a gradient clip, or on_nan = skip)"
            )
        if self.world.main:
            tqdm.write(f"iresflow: warning: {problem}; skipped", file=sys.stderr)

    def healthy(self) -> bool:
        """Whether every parameter (and moving average) is finite."""
        tensors = list(self.model.parameters())
        if self.average is not None:
            tensors += list(self.average.parameters())
        return all(bool(torch.isfinite(t).all()) for t in tensors)

    def advance(self, row: dict[str, float]) -> None:
        """Early-stopping bookkeeping and the learning-rate schedule.

        An epoch becomes ``best`` only with a finite validation NLL, an inverse that converges
        and :func:`reconstructs` and finite weights: ``best`` holds no broken model. An epoch
        without improvement counts towards ``patience`` only when :meth:`patience_counts`.
        """
        metric = row["val_nll"]
        candidate = math.isfinite(metric) and reconstructs(row)
        if candidate and metric < self.best_metric and self.healthy():
            self.best_metric, self.best_epoch, self.bad_epochs = metric, self.epoch, 0
        elif self.patience_counts():
            self.bad_epochs += 1
        if self.epoch <= self.config.warmup:
            return  # the plateau rule and the cosine start once the warm-up is over
        if isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            self.scheduler.step(metric if math.isfinite(metric) else math.inf)
        elif self.scheduler is not None and self.epoch - self.config.warmup <= self.cosine_epochs:
            self.scheduler.step()  # past the annealing the rate stays at its floor

    def patience_counts(self) -> bool:
        """Whether an epoch without a better validation NLL now counts towards ``patience``.

        Not during the warm-up, and with the cosine schedule not before the learning rate has
        annealed to half of ``lr``: while it is high, the validation NLL of a good run can
        stall or rise for many epochs before it improves again at a smaller rate.
        """
        if self.epoch <= self.config.warmup:
            return False
        if self.config.scheduler == "cosine":
            return self.optimizer.param_groups[0]["lr"] <= PATIENCE_LR_FRACTION * self.config.lr
        return True


class _LogProb(nn.Module):
    """The model's training log-density as ``forward``, the method DDP wraps."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor, mask: Tensor, context: Tensor | None = None) -> Tensor:
        """``log p(x | context)`` of ``x`` ``(B, N, D)`` with mask ``(B, N)``, shape ``(B,)``."""
        if context is None:
            return self.model.log_prob(x, mask)
        return self.model.log_prob(x, mask, context=context)
