r"""Data-parallel training over several processes with :mod:`torch.distributed`.

``iresflow train --nproc N`` (``nproc = N``) starts ``N`` processes with
:mod:`torch.multiprocessing` (``gloo`` on the CPU, ``nccl`` on CUDA with one GPU per process) and
wraps the flow in :class:`~torch.nn.parallel.DistributedDataParallel`. Every process draws the
same seeded permutation of the training sequences; each global minibatch :math:`\mathcal B` of
``batch_size`` sequences is split like :class:`~torch.utils.data.DistributedSampler` splits a
dataset, rank :math:`r` taking the sequences :math:`\mathcal B_r = \mathcal B[r::W]`. Rank
:math:`r` minimises

.. math:: \mathcal L_r = -W \frac{\sum_{b \in \mathcal B_r} \log p_\theta(x_b)}
    {\sum_{b \in \mathcal B} u_b},

so the gradient average of DDP, :math:`\frac1W \sum_r \nabla \mathcal L_r`, is the gradient of
the single-process loss on the whole global batch. A rank whose share of a short last batch is
empty runs the first sequence of the batch with weight 0, so every rank joins every all-reduce.

Random streams: the model initialisation and the minibatch order are the same on every rank
(seed ``seed``); the log-determinant estimator of rank :math:`r` (roulette draws, probes) is
seeded with ``seed + 1 + r``, so rank 0 draws what a single process draws. DDP broadcasts the
buffers of rank 0 (power-iteration vectors, ActNorm state) before every forward pass, and the
data-dependent ActNorm initialisation runs on the whole first global batch on every rank. Only
rank 0 writes the run folder; checkpoints hold the random states of every rank, so a run resumes
exactly with the same ``nproc``.

Two launchers, one code path: :func:`spawn` (``--nproc N`` on one machine) and ``torchrun``
(one or several machines, :func:`torchrun_launch` reads its ``env://`` rendezvous) both run each
process through :func:`run_rank`, which pins the process to its local GPU, joins the process
group with the backend of the device and runs the work of one rank. :func:`launch` chooses
between them; it is the one place every command (training, evaluation) starts its processes.
See ``docs/scaling.md``.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from iresflow._settings import ConfigError

__all__ = [
    "Launch",
    "World",
    "all_gather_objects",
    "backend_for",
    "broadcast_object",
    "current_world",
    "launch",
    "lead_process",
    "process_count",
    "run_rank",
    "shard",
    "spawn",
    "torchrun_launch",
]

#: Environment variables of the ``env://`` rendezvous that ``torchrun`` sets for every process.
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class World:
    """This process's place in the process group.

    Attributes:
        rank: Index of this process, ``0 <= rank < size``.
        size: Number of processes (1 without a process group).

    Example:
        >>> current_world()
        World(rank=0, size=1)
    """

    rank: int
    size: int

    @property
    def main(self) -> bool:
        """Whether this process writes files and prints (rank 0)."""
        return self.rank == 0


def current_world() -> World:
    """The rank and size of the initialised process group, or ``World(0, 1)`` without one."""
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size())
    return World(0, 1)


@dataclass(frozen=True)
class Launch:
    """Where a process to be started sits in a data-parallel run.

    Attributes:
        rank: Global rank, ``0 <= rank < world_size``.
        world_size: Number of processes over all machines.
        local_rank: Index of the process on its machine (its GPU on CUDA).
        local_world_size: Number of processes on its machine (they share its CPU cores).

    Example:
        >>> Launch(rank=3, world_size=4, local_rank=1, local_world_size=2).rank
        3
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    def __post_init__(self) -> None:
        if not 1 <= self.local_world_size <= self.world_size:
            raise ValueError(
                f"local_world_size must lie in [1, world_size={self.world_size}], got "
                f"{self.local_world_size}"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must lie in [0, {self.world_size}), got {self.rank}")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(
                f"local_rank must lie in [0, {self.local_world_size}), got {self.local_rank}"
            )


def torchrun_launch(environ: Mapping[str, str] | None = None) -> Launch | None:
    """This process's place in a ``torchrun`` launch, read from its environment.

    ``torchrun`` (``python -m torch.distributed.run``) sets ``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` for every
    process it starts; :func:`run_rank` then joins the group with ``init_method="env://"``.

    Args:
        environ: The environment (default: :data:`os.environ`).

    Returns:
        The :class:`Launch`, or ``None`` when ``RANK`` and ``WORLD_SIZE`` are both unset.

    Raises:
        ValueError: a partial rendezvous (some of :data:`TORCHRUN_VARIABLES` missing) or
            values that are not integers in range.

    Example:
        >>> torchrun_launch({}) is None
        True
        >>> torchrun_launch({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
        ...                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
        Launch(rank=1, world_size=2, local_rank=1, local_world_size=2)
    """
    env = os.environ if environ is None else environ
    if "RANK" not in env and "WORLD_SIZE" not in env:
        return None
    missing = [name for name in TORCHRUN_VARIABLES if name not in env]
    if missing:
        raise ValueError(
            f"incomplete torchrun environment: {', '.join(missing)} not set (launch with "
            "torchrun, or unset RANK and WORLD_SIZE)"
        )
    values = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        text = env.get(name, env["WORLD_SIZE"])  # LOCAL_WORLD_SIZE: all ranks on one machine
        try:
            values[name] = int(text)
        except ValueError:
            raise ValueError(f"{name} must be an integer, got {text!r}") from None
    return Launch(
        values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"], values["LOCAL_WORLD_SIZE"]
    )


def process_count(nproc: int) -> int:
    """The number of processes a command asking for ``nproc`` runs in.

    Under ``torchrun`` the launch decides: its ``WORLD_SIZE``, and ``nproc`` must be left at 1
    or equal it. Otherwise ``nproc``.

    Raises:
        ConfigError: ``nproc`` other than 1 and ``WORLD_SIZE`` under ``torchrun``.
        ValueError: a partial ``torchrun`` environment (:func:`torchrun_launch`).

    Example:
        >>> process_count(3)  # no torchrun in this process's environment
        3
    """
    torchrun = torchrun_launch()
    if torchrun is None:
        return nproc
    if nproc not in (1, torchrun.world_size):
        raise ConfigError(
            f"nproc={nproc}, but torchrun started {torchrun.world_size} processes: under "
            "torchrun the launch sets the processes (drop nproc, --nproc)"
        )
    return torchrun.world_size


def launch(function: Callable[..., Any], nproc: int, device_type: str, *args: Any,
           **kwargs: Any) -> Any:
    """Run ``function(*args, **kwargs)`` on every process of a command; the one launcher.

    Inside a process group, or with one process (:func:`process_count`), the function runs
    here. A process started by ``torchrun`` joins its ``env://`` group as its rank
    (:func:`run_rank`); otherwise ``nproc > 1`` processes are started on this machine
    (:func:`spawn`).

    Args:
        function: The work of one rank, a module-level function (pickled by name).
        nproc: Processes asked for (``nproc`` setting, ``--nproc``).
        device_type: ``"cpu"`` (``gloo``) or ``"cuda"`` (``nccl``, one GPU per process).
        *args: Positional arguments of ``function``.
        **kwargs: Keyword arguments of ``function``.

    Returns:
        What ``function`` returned here (on rank 0 when processes were started).

    Raises:
        ConfigError: ``nproc`` at odds with a ``torchrun`` launch.
        Exception: the first exception of any rank (:func:`spawn`).

    Example:
        >>> launch(max, 1, "cpu", 2, 5)
        5
    """
    count = process_count(nproc)
    if count == 1 or current_world().size > 1:
        return function(*args, **kwargs)
    torchrun = torchrun_launch()
    if torchrun is not None:
        return run_rank(torchrun, device_type, function, *args, **kwargs)
    return spawn(function, count, device_type, *args, **kwargs)


def lead_process() -> bool:
    """Whether this process reports a command's results: rank 0 of its process group or of its
    ``torchrun`` launch (also after the group is gone), or a process on its own.

    Example:
        >>> lead_process()
        True
    """
    torchrun = torchrun_launch()
    return current_world().main and (torchrun is None or torchrun.rank == 0)


def backend_for(device_type: str) -> str:
    """The collective backend of a device type: ``nccl`` on CUDA, ``gloo`` elsewhere.

    Example:
        >>> backend_for("cpu")
        'gloo'
    """
    return "nccl" if device_type == "cuda" else "gloo"


def run_rank(
    launch: Launch, device_type: str, function: Callable[..., Any], *args: Any,
    init_method: str = "env://", **kwargs: Any,
) -> Any:
    """Run ``function(*args, **kwargs)`` as one rank of a process group.

    Pins the process to GPU ``local_rank`` on CUDA (else shares the machine's cores among its
    ``local_world_size`` processes), joins the group with
    :func:`backend_for` the device, runs ``function`` and leaves the group. Both launchers use
    it: :func:`spawn` with a ``tcp://`` address on the loopback, ``torchrun`` with ``env://``.

    Args:
        launch: This process's rank, world size and local rank.
        device_type: ``"cpu"`` or ``"cuda"``.
        function: The work of one rank.
        *args: Positional arguments of ``function``.
        init_method: Rendezvous of :func:`torch.distributed.init_process_group`.
        **kwargs: Keyword arguments of ``function``.

    Returns:
        What ``function`` returned on this rank.

    Raises:
        RuntimeError: CUDA requested but ``local_rank`` has no GPU.
    """
    if device_type == "cuda":
        if torch.cuda.device_count() <= launch.local_rank:
            raise RuntimeError(
                f"local rank {launch.local_rank} needs GPU {launch.local_rank}, found "
                f"{torch.cuda.device_count()} GPUs"
            )
        torch.cuda.set_device(launch.local_rank)
    else:  # share the cores: more threads than cores stall in intra-op barriers
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // launch.local_world_size))
    dist.init_process_group(
        backend_for(device_type), init_method=init_method, rank=launch.rank,
        world_size=launch.world_size,
    )
    # An exception leaves the group as it is: the launcher stops the ranks that wait for it.
    result = function(*args, **kwargs)
    # Every rank tears the group down together: a rank that leaves while another is still in
    # its last collective (or still writing) can abort in gloo's teardown.
    dist.barrier()
    dist.destroy_process_group()
    return result


def shard(index: Tensor, world: World) -> tuple[Tensor, float]:
    """This rank's part of a global minibatch and its weight in the loss.

    Args:
        index: Sequence indices of the global minibatch, shape ``(B,)``, ``B >= 1``.
        world: The process group.

    Returns:
        ``(index[rank::size], 1.0)``, or ``(index[:1], 0.0)`` when that part is empty.

    Example:
        >>> shard(torch.arange(5), World(1, 2))
        (tensor([1, 3]), 1.0)
        >>> shard(torch.arange(1), World(1, 2))
        (tensor([0]), 0.0)
    """
    part = index[world.rank :: world.size]
    return (part, 1.0) if len(part) > 0 else (index[:1], 0.0)


def broadcast_object(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (the value itself without a process group)."""
    if current_world().size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_objects(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order (``[value]`` without a process group)."""
    world = current_world()
    if world.size == 1:
        return [value]
    values: list[Any] = [None] * world.size
    dist.all_gather_object(values, value)
    return values


def spawn(function: Callable[..., Any], nproc: int, device_type: str, *args: Any,
          **kwargs: Any) -> Any:
    """Run ``function(*args, **kwargs)`` in ``nproc`` processes joined in a process group.

    Args:
        function: A module-level function (it is pickled by name).
        nproc: Number of processes, at least 2.
        device_type: ``"cpu"`` (``gloo`` backend) or ``"cuda"`` (``nccl``).
        *args: Positional arguments of ``function``.
        **kwargs: Keyword arguments of ``function``.

    Returns:
        What ``function`` returned on rank 0.

    Raises:
        Exception: the first exception raised by ``function`` on any rank, re-raised here with
            its own type and message (the other processes are stopped).
        RuntimeError: a process died without raising (e.g. killed).
    """
    if nproc < 2:
        raise ValueError(f"nproc must be >= 2, got {nproc}")
    if device_type == "cuda" and torch.cuda.device_count() < nproc:
        raise RuntimeError(
            f"nproc={nproc} needs {nproc} GPUs, found {torch.cuda.device_count()}"
        )
    context = mp.get_context("spawn")
    outcomes = context.SimpleQueue()
    logger = logging.getLogger("torch.multiprocessing.spawn")  # "Terminating process ..."
    level = logger.level
    logger.setLevel(logging.ERROR)  # the other ranks of a failed run are stopped on purpose
    try:
        mp.start_processes(
            _worker, args=(nproc, _free_port(), device_type, outcomes, function, args, kwargs),
            nprocs=nproc, join=True, start_method="spawn",
        )
    except (mp.ProcessExitedException, mp.ProcessRaisedException) as error:
        failure = str(error).strip().splitlines()[0]  # the reason is in the queue, if any
    else:
        failure = "no result"
    finally:
        logger.setLevel(level)
    results, errors = [], []
    while not outcomes.empty():
        kind, value = outcomes.get()
        (errors if kind == "error" else results).append(value)
    if errors:
        raise errors[0]
    if not results:
        raise RuntimeError(f"a training process failed: {failure}")
    return results[0]


def _worker(
    rank: int, size: int, port: int, device_type: str, outcomes: Any,
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
) -> None:
    """One process of :func:`spawn`: run its rank, report its result or error."""
    launch = Launch(rank, size, rank, size)
    try:
        result = run_rank(
            launch, device_type, function, *args, init_method=f"tcp://127.0.0.1:{port}",
            **kwargs,
        )
    except Exception as error:  # re-raised in the parent; no traceback on stderr
        outcomes.put(("error", error))
        sys.stderr.flush()
        os._exit(1)  # the parent stops the other ranks, which may wait in a collective
    if rank == 0:
        outcomes.put(("result", result))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
