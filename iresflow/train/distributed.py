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
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

__all__ = ["World", "all_gather_objects", "broadcast_object", "current_world", "shard", "spawn"]


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
    backend = "nccl" if device_type == "cuda" else "gloo"
    logger = logging.getLogger("torch.multiprocessing.spawn")  # "Terminating process ..."
    level = logger.level
    logger.setLevel(logging.ERROR)  # the other ranks of a failed run are stopped on purpose
    try:
        mp.start_processes(
            _worker, args=(nproc, _free_port(), backend, outcomes, function, args, kwargs),
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
    rank: int, size: int, port: int, backend: str, outcomes: Any,
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
) -> None:
    """One process: join the group, run ``function``, report its result or error."""
    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:  # share the cores: more threads than cores stall in intra-op barriers
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    try:
        result = function(*args, **kwargs)
    except Exception as error:  # re-raised in the parent; no traceback on stderr
        outcomes.put(("error", error))
        sys.stderr.flush()
        os._exit(1)  # the parent stops the other ranks, which may wait in a collective
    if rank == 0:
        outcomes.put(("result", result))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
