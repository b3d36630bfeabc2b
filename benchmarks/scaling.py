"""Scale-out and sequence-length scaling of training, measured side by side in one run.

1. Throughput of data-parallel training: one epoch of ``iresflow.train.loop.train`` with
   ``nproc = 1`` and ``nproc = 2`` (gloo, CPU) on the same data and global batch, in training
   sequences per second of the epoch itself (process start-up excluded); printed as the ratio of
   2 processes to 1 process.
2. Sequence-length scaling: one training step (``log_prob`` + backward) of a
   ``ResidualSequenceFlow`` for every training log-determinant (``roulette``, ``series``,
   ``exact``) at lengths ``N = 16, 32, ..., 1024``; a method stops at the first length whose step
   takes longer than ``--max-step`` seconds (the dense ``exact`` Jacobian stops early). Memory is
   the peak allocated CUDA memory on a GPU and, on the CPU, the bytes autograd saves for the
   backward pass (the part of the memory that grows with ``N``). Steps run on one thread; each
   time is also printed as a ratio to ``roulette`` at the same ``N``, and the log-log slopes of
   time and memory against ``N`` close the table.

Run: ``python -m benchmarks scaling [--quick] [--device cpu|cuda]``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import cli
from benchmarks.timing import length_sweep
from iresflow.models.residual_flow import ResidualSequenceFlow
from iresflow.train.config import TrainConfig
from iresflow.train.loop import train

FEATURES = 12
METHODS = ("roulette", "series", "exact")


def throughput(nproc: int, settings: dict[str, Any], folder: Path) -> float:
    """Training sequences per second of the second epoch with ``nproc`` processes.

    The first epoch is a warm-up; each of several processes uses ``cores / nproc`` threads, a
    single process the threads of this one.
    """
    name = f"nproc{nproc}-threads{torch.get_num_threads()}"
    config = TrainConfig.from_dict({"alternative": "none", **settings, "nproc": nproc})
    result = train(config, folder / name, overwrite=True, progress=False)
    return float(settings["max_train"]) / result.history[-1]["train_seconds"]


def step_cost(
    method: str, length: int, batch: int, device: torch.device, repeats: int
) -> tuple[float, float]:
    """Seconds (fastest of ``repeats``) and memory (MiB) of a training step at length ``N``."""
    generator = torch.Generator().manual_seed(length)
    model = ResidualSequenceFlow(
        features=FEATURES, n_blocks=1, hidden=32, max_len=length, logdet=method
    ).to(device)
    model.train()
    x = torch.randn(batch, length, FEATURES, generator=generator).to(device)
    mask = torch.ones(batch, length, dtype=torch.bool, device=device)
    model.log_prob(x, mask).sum().backward()  # ActNorm initialisation and warm-up
    return min(_timed_step(model, x, mask, device) for _ in range(repeats))  # fastest


def _timed_step(
    model: ResidualSequenceFlow, x: torch.Tensor, mask: torch.Tensor, device: torch.device
) -> tuple[float, float]:
    saved = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = -model.log_prob(x, mask).sum()
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        memory = torch.cuda.max_memory_allocated(device)
    else:
        memory = saved[0]
    return time.perf_counter() - start, memory / 2**20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cli.add_quick(parser, "N up to 256, 1 s step limit, 32 sequences")
    parser.add_argument("--device", default="cpu", help="device of the length scaling")
    parser.add_argument("--max-step", type=float, help="seconds per step before stopping")
    parser.add_argument("--batch", type=int, default=2, help="sequences per step")
    parser.add_argument("--repeats", type=int, default=2, help="timed steps per length")


def run(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    max_step = args.max_step if args.max_step is not None else (1.0 if args.quick else 5.0)
    settings = {"n_blocks": 1, "hidden": 16, "max_train": 32 if args.quick else 128,
                "max_eval": 4, "batch_size": 16, "epochs": 2, "device": "cpu",
                "logdet": "roulette"}
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as folder:
        all_threads = throughput(1, settings, Path(folder))
        double = throughput(2, settings, Path(folder))
        # One thread from here on (also for the length scaling): steadier on shared cores, and
        # raising the thread count again mid-process upsets some MKL builds.
        torch.set_num_threads(1)
        one_thread = throughput(1, settings, Path(folder))
    print(f"data-parallel training on the CPU (global batch {settings['batch_size']}, "
          f"{settings['max_train']} sequences, logdet roulette, {cores} cores):")
    print(f"  1 process,  1 thread  : {one_thread:8.1f} sequences/s")
    print(f"  1 process, {cores} threads : {all_threads:8.1f} sequences/s")
    print(f"  2 processes           : {double:8.1f} sequences/s  (ratio to 1 process: "
          f"{double / one_thread:.2f} vs 1 thread, {double / all_threads:.2f} vs {cores} threads)")

    print(f"\nlength scaling, one training step, batch {args.batch}, device {device} "
          "(memory in MiB):")

    def cost(method: str, length: int) -> dict[str, float]:
        seconds, memory = step_cost(method, length, args.batch, device, args.repeats)
        return {"seconds": seconds, "memory": memory}

    length_sweep(METHODS, cost, 256 if args.quick else 1024, max_step, f"batch {args.batch}")
