r"""The training loop: minibatch maximum likelihood with early stopping and exact resume.

Every epoch visits the training sequences once, in an order drawn from a seeded
:class:`torch.Generator`, and minimises the negative log-likelihood per unit of the batch,

.. math:: \mathcal L = -\frac{\sum_b \log p_\theta(x_b)}{\sum_b u_b},

with :math:`u_b` the frames (or dimensions, for ``bits/dim`` data) of sequence :math:`b`; the
log-density comes from the model's training log-determinant (the unbiased Russian-roulette
estimator by default, with the Neumann-series gradient). After each epoch the validation NLL is
computed in the dataset's unit with the evaluation log-determinant, the invertibility of the model
is checked on a few validation sequences, the learning-rate schedule advances, and the ``last``
(and, on improvement, ``best``) checkpoint is written atomically.

Numerical health: a step whose loss or gradient norm is not finite never reaches the optimiser;
a non-finite validation NLL or an inverse that stops converging is detected after the epoch.
With ``on_nan = "stop"`` (default) training ends with :class:`TrainingDivergedError` and the last
checkpoint untouched; with ``"skip"`` a warning line goes to stderr and the step is skipped (the
epoch's ``skipped_steps`` counts them). An epoch becomes ``best`` only with a finite validation
NLL, a converging inverse and finite weights.

Exact resume: a checkpoint stores the model, the optimiser, the schedule, the moving average of
the weights, every random state (torch's global CPU and CUDA generators, the shuffling generator,
the log-determinant's generator) and the metric history, so a resumed run continues with the same
losses as an uninterrupted one with the same seed.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from iresflow.data.datasets import SequenceDataset, SequenceSplit, load_dataset
from iresflow.inverse.fixed_point import InversionError
from iresflow.models.transformer import ResidualFlowTransformer
from iresflow.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from iresflow.train.config import DEVICE_PATTERN, ConfigError, TrainConfig
from iresflow.train.distributed import (
    World,
    all_gather_objects,
    broadcast_object,
    current_world,
    shard,
    spawn,
)

__all__ = [
    "ExponentialMovingAverage",
    "RunPaths",
    "TrainResult",
    "TrainingDivergedError",
    "build_model",
    "copy_parameters",
    "load_data",
    "resolve_device",
    "split_log_prob",
    "train",
]

CHECKPOINT_FORMAT = 1
#: ReduceLROnPlateau settings of ``scheduler = "plateau"``.
PLATEAU_FACTOR = 0.5
PLATEAU_PATIENCE = 2
#: Final learning rate of ``scheduler = "cosine"``, relative to ``lr``.
COSINE_FLOOR = 0.01
#: Validation sequences reconstructed after every epoch to monitor the inverse.
INVERSE_CHECK_SEQUENCES = 8


class TrainingDivergedError(RuntimeError):
    """The training loss, a gradient or the validation NLL became non-finite, or the inverse
    stopped converging (with ``on_nan = "stop"``)."""


@dataclass(frozen=True)
class RunPaths:
    """The files of a run folder.

    Attributes:
        root: The run folder.

    Example:
        >>> RunPaths(Path("runs/vowels")).best.as_posix()
        'runs/vowels/checkpoints/best.pt'
    """

    root: Path

    @property
    def config(self) -> Path:
        """``config.toml``: the settings of the run."""
        return self.root / "config.toml"

    @property
    def checkpoints(self) -> Path:
        """``checkpoints/``: ``last.pt`` and ``best.pt``."""
        return self.root / "checkpoints"

    @property
    def last(self) -> Path:
        """The checkpoint written after every epoch."""
        return self.checkpoints / "last.pt"

    @property
    def best(self) -> Path:
        """The checkpoint of the epoch with the lowest validation NLL."""
        return self.checkpoints / "best.pt"

    @property
    def metrics_jsonl(self) -> Path:
        """One JSON object per epoch."""
        return self.root / "metrics.jsonl"

    @property
    def metrics_csv(self) -> Path:
        """The same metrics as a CSV table."""
        return self.root / "metrics.csv"

    @property
    def evaluation(self) -> Path:
        """``evaluation.json``: results of ``iresflow evaluate``."""
        return self.root / "evaluation.json"

    @property
    def plots(self) -> Path:
        """``plots/``: PNG figures."""
        return self.root / "plots"

    @property
    def tensorboard(self) -> Path:
        """``tensorboard/``: event files, when enabled."""
        return self.root / "tensorboard"

    def is_run(self) -> bool:
        """Whether the folder holds a run (a config or checkpoint)."""
        return self.config.is_file() or self.checkpoints.is_dir()


@dataclass(frozen=True)
class TrainResult:
    """Summary of a finished :func:`train` call.

    Attributes:
        paths: The run folder.
        epochs: Epochs completed in total (including those before a resume).
        best_epoch: Epoch of the lowest validation NLL.
        best_val_nll: That NLL, in the dataset's unit.
        stopped_early: Whether early stopping ended the run.
        history: One metrics dict per completed epoch.
    """

    paths: RunPaths
    epochs: int
    best_epoch: int
    best_val_nll: float
    stopped_early: bool
    history: list[dict[str, float]]


class ExponentialMovingAverage:
    r"""Exponential moving average of a model's parameters.

    After every optimiser step, :math:`\bar\theta \leftarrow \beta\bar\theta + (1-\beta)\theta`.
    :meth:`applied` temporarily swaps the averages into the model (buffers stay the model's own).

    Args:
        model: The model whose parameters are averaged.
        decay: :math:`\beta \in (0, 1)`.

    Example:
        >>> model = nn.Linear(2, 1)
        >>> ema = ExponentialMovingAverage(model, decay=0.5)
        >>> with torch.no_grad():
        ...     _ = model.bias.fill_(1.0)
        >>> shadow = ema.shadow["bias"].clone()
        >>> ema.update(model)
        >>> torch.allclose(ema.shadow["bias"], (shadow + 1.0) / 2)
        True
    """

    def __init__(self, model: nn.Module, decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must lie in (0, 1), got {decay}")
        self.decay = decay
        self.shadow = {name: p.detach().clone() for name, p in model.named_parameters()}

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Move the averages towards the current parameters."""
        for name, parameter in model.named_parameters():
            self.shadow[name].lerp_(parameter.detach(), 1.0 - self.decay)

    @contextmanager
    def applied(self, model: nn.Module) -> Iterator[None]:
        """Within the block, the model's parameters are the averages."""
        current = {name: p.detach().clone() for name, p in model.named_parameters()}
        copy_parameters(model, self.shadow)
        try:
            yield
        finally:
            copy_parameters(model, current)

    def state_dict(self) -> dict[str, Tensor]:
        """The averages, by parameter name."""
        return dict(self.shadow)

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Restore averages saved by :meth:`state_dict`."""
        if set(state) != set(self.shadow):
            raise ValueError("EMA state does not match the model's parameters")
        with torch.no_grad():
            for name, value in state.items():
                self.shadow[name].copy_(value)


@torch.no_grad()
def copy_parameters(model: nn.Module, values: dict[str, Tensor]) -> None:
    """Overwrite every parameter of ``model`` with the tensor of the same name in ``values``.

    Example:
        >>> model = nn.Linear(2, 1)
        >>> copy_parameters(model, {"weight": torch.ones(1, 2), "bias": torch.zeros(1)})
        >>> model.weight.tolist()
        [[1.0, 1.0]]
    """
    for name, parameter in model.named_parameters():
        parameter.copy_(values[name])


def resolve_device(name: str) -> torch.device:
    """Turn ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` into an available device.

    Raises:
        ConfigError: an unknown device, or CUDA requested but not available.

    Example:
        >>> resolve_device("cpu")
        device(type='cpu')
    """
    if not DEVICE_PATTERN.match(name):
        raise ConfigError(f"device must be cpu, cuda, cuda:N or auto, got {name!r}")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but CUDA is not available")
    return device


def load_data(config: TrainConfig) -> SequenceDataset:
    """Load the dataset of a configuration, with random subsets of ``max_train``/``max_eval``.

    Raises:
        ConfigError: unknown dataset, missing or malformed file (the message of
            :func:`~iresflow.data.datasets.load_dataset`).

    Example:
        >>> dataset = load_data(TrainConfig(max_train=10, max_eval=5))
        >>> len(dataset.train), len(dataset.val), len(dataset.test)
        (10, 5, 5)
    """
    try:
        dataset = load_dataset(config.data, seed=config.seed, val_fraction=config.val_fraction)
    except (ValueError, OSError, ImportError) as error:
        raise ConfigError(f"cannot load dataset {config.data!r}: {error}") from None

    generator = torch.Generator().manual_seed(config.seed)

    def subset(split: SequenceSplit, limit: int | None) -> SequenceSplit:
        # A random subset: the splits of some datasets are ordered (e.g. by speaker).
        if limit is None or limit >= len(split):
            return split
        index = torch.randperm(len(split), generator=generator)[:limit].sort().values
        return SequenceSplit(split.x[index], split.mask[index], split.log_jacobian[index])

    return dataclasses.replace(
        dataset,
        train=subset(dataset.train, config.max_train),
        val=subset(dataset.val, config.max_eval),
        test=subset(dataset.test, config.max_eval),
    )


def build_model(config: TrainConfig, dataset: SequenceDataset) -> ResidualFlowTransformer:
    """Construct the (untrained) flow for a configuration and dataset.

    Raises:
        ConfigError: settings the model rejects for this dataset, e.g. heads that do not divide
            the number of features.

    Example:
        >>> config = TrainConfig(n_blocks=1, hidden=8)
        >>> build_model(config, load_data(config)).config.max_len
        29
    """
    if config.max_len is not None and config.max_len < dataset.max_len:
        raise ConfigError(
            f"max_len={config.max_len} is shorter than the longest sequence of {dataset.name} "
            f"({dataset.max_len})"
        )
    try:
        return ResidualFlowTransformer(
            features=dataset.features,
            n_blocks=config.n_blocks,
            hidden=config.hidden,
            heads=config.heads,
            coeff=config.coeff,
            attention=config.attention,
            positional=config.positional,
            max_len=config.max_len if config.max_len is not None else dataset.max_len,
            logdet=config.logdet,
            n_power_iterations=config.n_power_iterations,
            spectral_norm=config.spectral_norm,
        )
    except ValueError as error:
        raise ConfigError(f"incompatible model settings for {dataset.name}: {error}") from None


def split_log_prob(
    model: ResidualFlowTransformer,
    split: SequenceSplit,
    *,
    method: str,
    n_samples: int = 1,
    batch_size: int = 64,
) -> tuple[Tensor, Tensor | None]:
    """Per-sequence log-densities of a whole split, in batches; leaves the model in eval mode.

    Args:
        model: The flow (its device is used).
        split: Sequences ``(B, N, D)`` with their mask.
        method: ``"exact"`` or ``"roulette"``.
        n_samples: Roulette estimates averaged per sequence (ignored by the exact method).
        batch_size: Sequences per forward pass.

    Returns:
        ``(log_prob, stderr)``, each of shape ``(B,)`` on the CPU in float64; ``stderr`` (the
        standard error of the roulette average) is ``None`` for the exact method and for a
        single roulette sample.
    """
    device = next(model.parameters()).device
    model.eval()
    values, errors = [], []
    with torch.no_grad():  # the estimators enable gradients where they need them
        for index in torch.arange(len(split)).split(batch_size):
            x, mask = _batch(split, index, device)
            if method == "exact":
                value = model.log_prob(x, mask, method="exact")
            elif n_samples == 1:
                value = model.log_prob(x, mask, method="roulette")
            else:
                value, error = model.log_prob(
                    x, mask, method="roulette", n_samples=n_samples, return_stderr=True
                )
                errors.append(error)
            values.append(value)
    log_prob = torch.cat(values).double().cpu()
    stderr = torch.cat(errors).double().cpu() if errors else None
    return log_prob, stderr


def train(
    config: TrainConfig,
    run_dir: str | os.PathLike,
    *,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
) -> TrainResult:
    """Train a :class:`~iresflow.models.transformer.ResidualFlowTransformer`.

    Args:
        config: All settings.
        run_dir: Run folder for the configuration, checkpoints and metrics.
        resume: Continue from ``run_dir/checkpoints/last.pt``; only the settings in
            :data:`~iresflow.train.config.RESUMABLE_FIELDS` (e.g. ``epochs``) may differ from
            the checkpoint's.
        overwrite: Replace an existing run in ``run_dir``.
        progress: Show a progress bar (on a terminal) and one summary line per epoch (stderr).

    With ``config.nproc > 1`` and no process group yet, ``nproc`` processes are started
    (:func:`~iresflow.train.distributed.spawn`), each runs this function as one rank of a
    data-parallel run, and rank 0's result is returned; an error of any rank is re-raised here.

    Returns:
        A :class:`TrainResult`.

    Raises:
        ConfigError: ``run_dir`` already holds a run (without ``resume``/``overwrite``), is not
            a run folder, or the settings are incompatible with the checkpoint.
        CheckpointError: the checkpoint to resume from is missing or unreadable.
        TrainingDivergedError: a non-finite loss, gradient or validation NLL, or an inverse
            that stopped converging, with ``on_nan = "stop"``.
    """
    paths = RunPaths(Path(run_dir))
    device = resolve_device(config.device)
    world = current_world()
    if config.nproc > 1 and world.size == 1:  # start the processes; each one calls train
        return spawn(
            train, config.nproc, device.type, config, run_dir, resume=resume,
            overwrite=overwrite, progress=progress,
        )
    if world.size != config.nproc:
        raise ConfigError(f"nproc={config.nproc} but the process group has {world.size} ranks")
    if world.size > 1 and device.type == "cuda":  # one GPU per process
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":  # deterministic cuBLAS; must be set before the first CUDA matmul
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    dataset = load_data(config)
    # The run owns torch's global generators while it trains; the caller's are restored after.
    devices = [device] if device.type == "cuda" else []
    with _deterministic_algorithms(), torch.random.fork_rng(devices=devices):
        torch.manual_seed(config.seed)
        model = build_model(config, dataset).to(device)  # settings checked before any deletion
        outcome: Any = None
        if world.main:  # only rank 0 touches the folder; the others learn the outcome
            try:
                state = _prepare_folder(paths, config, resume=resume, overwrite=overwrite)
            except (ConfigError, CheckpointError, OSError) as error:
                outcome = error
        outcome = broadcast_object(outcome)
        if outcome is not None:
            raise outcome
        if not world.main:
            state = load_checkpoint(paths.last) if resume else None
        session = _Session(config, dataset, model, device, world)
        if state is not None:
            session.restore(state)
        if world.main:
            paths.checkpoints.mkdir(parents=True, exist_ok=True)
            for stale in paths.checkpoints.glob(".*.tmp"):  # a write cut short by a killed run
                stale.unlink()
            config.save(paths.config)
            _write_metrics(paths, session.history)
        return session.run(paths, progress and world.main)


class _Session:
    """The mutable state of one training run between epochs."""

    def __init__(
        self,
        config: TrainConfig,
        dataset: SequenceDataset,
        model: ResidualFlowTransformer,
        device: torch.device,
        world: World,
    ) -> None:
        self.config, self.dataset, self.model, self.device = config, dataset, model, device
        self.world = world
        self.replica: nn.Module = _LogProb(model)
        if world.size > 1:
            self.replica = nn.parallel.DistributedDataParallel(
                self.replica, device_ids=[device] if device.type == "cuda" else None
            )
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        optimizer_type = torch.optim.AdamW if config.optimizer == "adamw" else torch.optim.Adam
        self.optimizer = optimizer_type(
            self.parameters, lr=config.lr, weight_decay=config.weight_decay
        )
        self.scheduler: Any = None
        if config.scheduler == "plateau":
            self.scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
                self.optimizer, factor=PLATEAU_FACTOR, patience=PLATEAU_PATIENCE
            )
        elif config.scheduler == "cosine":
            self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
                self.optimizer, T_max=config.epochs, eta_min=config.lr * COSINE_FLOOR
            )
        self.ema = ExponentialMovingAverage(model, config.ema) if config.ema > 0 else None
        self.shuffle = torch.Generator().manual_seed(config.seed)
        self.estimator_generator = torch.Generator(device).manual_seed(
            config.seed + 1 + world.rank
        )
        model.set_generator(self.estimator_generator)
        self.epoch = 0
        self.best_epoch = 0
        self.best_metric = math.inf
        self.bad_epochs = 0
        self.history: list[dict[str, float]] = []

    # -- checkpoint state -------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
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
            "model_config": self.model.config.to_dict(),
            "model": self.model.state_dict(),
            "ema": self.ema.state_dict() if self.ema is not None else None,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
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
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
            if isinstance(self.scheduler, torch.optim.lr_scheduler.CosineAnnealingLR):
                self.scheduler.T_max = self.config.epochs  # a longer run keeps annealing
        if self.ema is not None:
            self.ema.load_state_dict(state["ema"])
        rng = state["rng"] if self.world.size == 1 else state["rng_ranks"][self.world.rank]
        torch.set_rng_state(rng["torch"])
        self.shuffle.set_state(rng["shuffle"])
        self.estimator_generator.set_state(rng["estimator"])
        if "cuda" in rng and self.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], self.device)
        self.epoch = state["epoch"]
        self.best_epoch = state["best_epoch"]
        self.best_metric = state["best_metric"]
        self.bad_epochs = state["bad_epochs"]
        self.history = list(state["history"])

    # -- epochs -----------------------------------------------------------------------------
    def run(self, paths: RunPaths, progress: bool) -> TrainResult:
        config = self.config
        writer = None
        if config.tensorboard and self.world.main:
            writer = _tensorboard_writer(paths, self.epoch)
        stopped_early = config.patience > 0 and self.bad_epochs >= config.patience
        try:
            while self.epoch < config.epochs and not stopped_early:
                self.epoch += 1
                bar = tqdm(
                    total=math.ceil(len(self.dataset.train) / config.batch_size),
                    desc=f"epoch {self.epoch}/{config.epochs}",
                    disable=None if progress else True,
                    leave=False,
                )
                row = self.train_epoch(bar)
                bar.set_postfix_str(f"train {row['train_nll']:.4g}, validating")
                row.update(self.validate())
                bar.close()  # the summary line below replaces it
                self.advance(row)
                self.history.append(row)
                state = self.state()
                if self.world.main:
                    save_checkpoint(state, paths.last)
                    if self.best_epoch == self.epoch:
                        save_checkpoint(state, paths.best)
                    _write_metrics(paths, self.history)
                if writer is not None:
                    for key, value in row.items():
                        if key != "epoch":
                            writer.add_scalar(key, value, self.epoch)
                    writer.flush()
                if progress:  # stderr: unbuffered, so logs of background runs stay current
                    tqdm.write(_summary(row, config.epochs), file=sys.stderr)
                stopped_early = config.patience > 0 and self.bad_epochs >= config.patience
        finally:
            if writer is not None:
                writer.close()
        if progress and stopped_early:
            tqdm.write(
                f"early stop: no better validation NLL for {config.patience} epochs",
                file=sys.stderr,
            )
        return TrainResult(
            paths, self.epoch, self.best_epoch, self.best_metric, stopped_early, self.history
        )

    def train_epoch(self, bar: tqdm) -> dict[str, float]:
        start = time.perf_counter()
        train = self.dataset.train
        order = torch.randperm(len(train), generator=self.shuffle)
        log_prob = torch.zeros(len(train), dtype=torch.float64)
        kept = torch.ones(len(train), dtype=torch.bool)
        grad_norms = []
        self.model.train()
        world = self.world
        for step, index in enumerate(order.split(self.config.batch_size), start=1):
            if world.size > 1 and step == 1 and self.epoch == 1:
                # ActNorm from the whole first global batch on every rank, not from a shard.
                self.model.initialize(*_batch(train, index, self.device))
            part, weight = shard(index, world)
            x, mask = _batch(train, part, self.device)
            batch_log_prob = self.replica(x, mask)
            # Global-batch normalisation; times W to undo DDP's gradient average.
            units = float(self.dataset.units(train.mask[index]).sum())
            loss = -batch_log_prob.sum() * (weight * world.size) / units
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            norm = nn.utils.clip_grad_norm_(self.parameters, self.config.clip or math.inf)
            bar.update()
            # One host sync per step, after the backward pass: a non-finite loss or gradient
            # must never reach the optimiser, the moving average or a checkpoint.
            finite = torch.isfinite(loss.detach()) & torch.isfinite(norm)
            if world.size > 1:  # every rank skips the same steps
                finite = finite.to(torch.int32)
                torch.distributed.all_reduce(finite, op=torch.distributed.ReduceOp.MIN)
            if not bool(finite):
                self.unhealthy(f"non-finite loss or gradient at epoch {self.epoch}, step {step}")
                self.optimizer.zero_grad(set_to_none=True)
                kept[index] = False
                continue
            grad_norms.append(norm)
            self.optimizer.step()
            if self.ema is not None:
                self.ema.update(self.model)
            if weight > 0:
                log_prob[part] = batch_log_prob.detach().double().cpu()
            if not bar.disable and bar.n % 10 == 1:
                bar.set_postfix(loss=f"{float(loss):.4g}")
        if not grad_norms:
            raise TrainingDivergedError(
                f"training diverged at epoch {self.epoch}: every step had a non-finite loss or "
                "gradient; try a smaller lr or a gradient clip"
            )
        norms = torch.stack(grad_norms)
        if world.size > 1:  # each rank holds the log-densities of its shards
            torch.distributed.all_reduce(log_prob)
        trained = SequenceSplit(train.x[kept], train.mask[kept], train.log_jacobian[kept])
        return {
            "epoch": self.epoch,
            "train_nll": self.dataset.nll(log_prob[kept], trained),
            "skipped_steps": float(len(order.split(self.config.batch_size)) - len(grad_norms)),
            "lr": self.optimizer.param_groups[0]["lr"],
            "grad_norm": float(norms.mean()),
            "grad_norm_max": float(norms.max()),
            "train_seconds": time.perf_counter() - start,
        }

    def validate(self) -> dict[str, float]:
        config, val = self.config, self.dataset.val
        with self.ema.applied(self.model) if self.ema is not None else _nothing():
            log_prob, stderr = split_log_prob(
                self.model, val, method=config.eval_method, n_samples=config.eval_n_samples,
                batch_size=config.batch_size,
            )
            finite = bool(torch.isfinite(log_prob).all())
            row = {"val_nll": self.dataset.nll(log_prob, val) if finite else math.nan}
            if stderr is not None and finite:
                row["val_nll_stderr"] = self.dataset.nll_stderr(stderr, val)
            row.update(_inverse_check(self.model, val, self.device))
        if not math.isfinite(row["val_nll"]):
            self.unhealthy(f"non-finite validation NLL at epoch {self.epoch}")
        if not math.isfinite(row["reconstruction_error"]):
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
        if self.ema is not None:
            tensors += list(self.ema.shadow.values())
        return all(bool(torch.isfinite(t).all()) for t in tensors)

    def advance(self, row: dict[str, float]) -> None:
        """Early-stopping bookkeeping and the learning-rate schedule.

        An epoch becomes ``best`` only with a finite validation NLL, a converging inverse and
        finite weights, so a ``best`` checkpoint never holds a broken model.
        """
        metric = row["val_nll"]
        candidate = math.isfinite(metric) and math.isfinite(row["reconstruction_error"])
        if candidate and metric < self.best_metric and self.healthy():
            self.best_metric, self.best_epoch, self.bad_epochs = metric, self.epoch, 0
        else:
            self.bad_epochs += 1
        if isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            self.scheduler.step(metric if math.isfinite(metric) else math.inf)
        elif self.scheduler is not None:
            self.scheduler.step()


class _LogProb(nn.Module):
    """The flow's training log-density as ``forward``, the method DDP wraps."""

    def __init__(self, flow: ResidualFlowTransformer) -> None:
        super().__init__()
        self.flow = flow

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return self.flow.log_prob(x, mask)


def _inverse_check(
    model: ResidualFlowTransformer, split: SequenceSplit, device: torch.device
) -> dict[str, float]:
    """Map a few sequences to noise and back; report the solver's effort and the error."""
    x, mask = _batch(split, torch.arange(min(INVERSE_CHECK_SEQUENCES, len(split))), device)
    model.eval()
    with torch.no_grad():
        z = model.transform_to_noise(x, mask)
        try:
            x_back = model.inverse(z, mask)
        except InversionError as error:  # reported in the metrics; training goes on
            return {
                "inverse_iterations": float(error.iterations.max()),
                "inverse_residual": float(error.residual.max()),
                "reconstruction_error": math.inf,
            }
    diagnostics = model.inverse_diagnostics()
    return {
        "inverse_iterations": float(diagnostics["max_iterations"]),
        "inverse_residual": float(diagnostics["max_residual"]),
        "reconstruction_error": float((x_back - x)[mask].abs().max()),
    }


def _batch(split: SequenceSplit, index: Tensor, device: torch.device) -> tuple[Tensor, Tensor]:
    """The sequences ``index`` of a split, trimmed to the longest of them, on ``device``.

    Trailing padding is dropped (a density never depends on padding), so attention and exact
    Jacobians cost what the real frames need.
    """
    mask = split.mask[index]
    longest = int(mask.sum(dim=1).max())
    return split.x[index, :longest].to(device), mask[:, :longest].to(device)


@contextmanager
def _nothing() -> Iterator[None]:
    yield


@contextmanager
def _deterministic_algorithms() -> Iterator[None]:
    """Deterministic kernels where torch has them (warnings elsewhere), restored afterwards."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def _prepare_folder(
    paths: RunPaths, config: TrainConfig, *, resume: bool, overwrite: bool
) -> dict[str, Any] | None:
    """Check or create the run folder; return the checkpoint state to resume from."""
    if resume and overwrite:
        raise ConfigError("resume and overwrite exclude each other")
    if resume:
        state = load_checkpoint(paths.last)
        saved = TrainConfig.from_dict(state["config"])
        changed = saved.incompatible_fields(config)
        if changed:
            raise ConfigError(
                f"cannot resume {paths.root} with different settings: {', '.join(changed)} "
                "(only epochs, patience, device, tensorboard, max_eval and on_nan may change)"
            )
        return state
    if paths.root.exists() and any(paths.root.iterdir()):
        if not overwrite:
            raise ConfigError(
                f"run folder {paths.root} is not empty; use resume to continue it or "
                "overwrite to start again"
            )
        if not paths.is_run():
            raise ConfigError(f"refusing to overwrite {paths.root}: it does not hold a run")
        shutil.rmtree(paths.root)
    paths.root.mkdir(parents=True, exist_ok=True)
    return None


def _write_metrics(paths: RunPaths, history: list[dict[str, float]]) -> None:
    """Rewrite ``metrics.jsonl`` and ``metrics.csv`` from the history."""
    with paths.metrics_jsonl.open("w", encoding="utf-8") as file:
        for row in history:
            file.write(json.dumps(row) + "\n")
    with paths.metrics_csv.open("w", encoding="utf-8", newline="") as file:
        if history:
            writer = csv.DictWriter(file, fieldnames=list(history[0]))
            writer.writeheader()
            writer.writerows(history)


def _tensorboard_writer(paths: RunPaths, epoch: int) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError("tensorboard = true needs the tensorboard package") from None
    return SummaryWriter(log_dir=str(paths.tensorboard), purge_step=epoch + 1)


def _summary(row: dict[str, float], epochs: int) -> str:
    text = f"epoch {row['epoch']}/{epochs}  train {row['train_nll']:.4f}  val {row['val_nll']:.4f}"
    if "val_nll_stderr" in row:
        text += f" ± {row['val_nll_stderr']:.4f}"
    return (
        f"{text}  lr {row['lr']:.2e}  inverse {row['inverse_iterations']:.0f} it, "
        f"residual {row['inverse_residual']:.1e}, error {row['reconstruction_error']:.1e}  "
        f"({row['train_seconds']:.1f} s)"
    )
