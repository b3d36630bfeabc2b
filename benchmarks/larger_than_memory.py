"""Training on data ten times larger than a memory cap, with bounded resident memory.

Writes a synthetic sequence store (:mod:`iresflow.data.store`) of ``--factor`` times ``--cap``
megabytes of float32 frames to disk (random lengths in ``[max_len / 4, max_len]``, AR(1) frames),
then trains one epoch of a small flow on it with ``memory_cap = --cap`` and length buckets. The
training runs in a fresh process. A thread samples, every 20 ms, the resident pages of the
store's memory maps (``/proc/self/smaps``, Linux): their peak is the memory the data occupy and
is printed against the cap and the size of the data. The process's resident set size (RSS)
before the training and at its peak (``VmRSS`` and ``VmHWM``) are printed too: their
difference adds the model, the optimiser, the activations of a batch and the allocator's
caches, which do not grow with the data. With ``--uncapped`` the same epoch runs again without a
cap, for comparison (its data pages approach the size of the data when the machine has the
memory to keep them).

Run: ``python -m benchmarks larger_than_memory [--cap 16] [--factor 10] [--uncapped]``.
The store is written to a temporary folder (or ``--folder``) and deleted afterwards unless
``--keep``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from iresflow.data.store import write_store
from iresflow.train.config import TrainConfig
from iresflow.train.loop import train

FEATURES = 8
MAX_LEN = 64
#: Frames generated (and written) per chunk.
CHUNK_FRAMES = 2**18
#: Interval of the thread that samples the resident pages of the store.
SAMPLE_SECONDS = 0.02
_MB = 2**20


def synthetic_store(folder: Path, megabytes: int, seed: int = 0) -> tuple[int, int]:
    """Write ``megabytes`` MB of float32 AR(1) sequences; return (sequences, frames)."""
    generator = torch.Generator().manual_seed(seed)
    frames = megabytes * _MB // (4 * FEATURES)
    lengths = torch.randint(MAX_LEN // 4, MAX_LEN + 1, (frames // (5 * MAX_LEN // 8) + 1,),
                            generator=generator)
    lengths = lengths[: int((lengths.cumsum(0) <= frames).sum())]
    mixing = torch.linspace(0.2, 0.9, FEATURES)

    def chunks() -> Iterator[torch.Tensor]:
        # Each chunk: whole sequences, x_t = a x_{t-1} + noise within a sequence.
        for part in lengths.split(CHUNK_FRAMES // MAX_LEN):
            noise = torch.randn(len(part), MAX_LEN, FEATURES, generator=generator)
            for t in range(1, MAX_LEN):
                noise[:, t] += mixing * noise[:, t - 1]
            yield noise[torch.arange(MAX_LEN) < part.unsqueeze(1)] * 2.0 + 1.0

    write_store(folder, lengths, chunks())
    return len(lengths), int(lengths.sum())


def mapped_megabytes(path: Path) -> float:
    """Resident MB of this process's memory maps of ``path`` (Linux ``/proc/self/smaps``)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            inside = fields[-1] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total / 1024


def status_megabytes(field: str) -> float:
    """A memory field of ``/proc/self/status`` in MB: ``VmRSS`` (now) or ``VmHWM`` (peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def train_and_measure(store: str, cap: int, run: str) -> dict[str, float]:
    """One epoch on ``store`` in this (fresh) process.

    Returns the RSS in MB before the training and at its peak, and the peak of the store's
    resident pages, sampled every :data:`SAMPLE_SECONDS` by a thread.
    """
    torch.set_num_threads(1)
    config = TrainConfig.from_dict({
        "data": store, "memory_cap": cap, "bucket": 8, "batch_size": 256, "epochs": 1,
        "n_blocks": 1, "hidden": 8, "max_eval": 256, "eval_method": "roulette",
        "eval_n_samples": 1, "device": "cpu", "scheduler": "none", "seed": 0,
        "alternative": "none"})
    values = (Path(store) / "values.npy").resolve()
    mapped = [0.0]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(SAMPLE_SECONDS):
            mapped[0] = max(mapped[0], mapped_megabytes(values))

    sampler = threading.Thread(target=sample, daemon=True)
    before = status_megabytes("VmRSS")
    sampler.start()
    start = time.perf_counter()
    result = train(config, run, progress=False)
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    peak = status_megabytes("VmHWM")
    return {
        "before": before, "peak": peak, "mapped": mapped[0], "seconds": seconds,
        "train_nll": result.history[-1]["train_nll"], "val_nll": result.best_val_nll,
    }


def _report(label: str, cap: int, data_mb: float, measured: dict[str, float]) -> None:
    growth = measured["peak"] - measured["before"]
    print(
        f"{label:>9}: peak resident data pages {measured['mapped']:6.1f} MB = "
        f"{measured['mapped'] / cap:5.2f} x cap = {measured['mapped'] / data_mb:5.3f} x data; "
        f"process RSS {measured['before']:.0f} MB before training, peak {measured['peak']:.0f} "
        f"MB (growth {growth:.0f} MB = {growth / data_mb:4.2f} x data); {measured['seconds']:.0f}"
        f" s, train NLL {measured['train_nll']:.3f}"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cap", type=int, default=16, help="memory cap in MB (default: 16)")
    parser.add_argument("--factor", type=int, default=10, help="data size / cap (default: 10)")
    parser.add_argument("--folder", type=Path, help="where to write the store (default: temp)")
    parser.add_argument("--keep", action="store_true", help="keep the store and the runs")
    parser.add_argument("--uncapped", action="store_true", help="also train without a cap")


def run(args: argparse.Namespace) -> None:
    folder = args.folder or Path(tempfile.mkdtemp(prefix="iresflow-store-"))
    try:
        start = time.perf_counter()
        sequences, frames = synthetic_store(folder / "store", args.cap * args.factor)
        data_mb = (folder / "store" / "values.npy").stat().st_size / _MB
        print(
            f"store: {sequences} sequences, {frames} frames of {FEATURES} float32 features, "
            f"{data_mb:.0f} MB on disk = {data_mb / args.cap:.1f} x the cap of {args.cap} MB "
            f"(written in {time.perf_counter() - start:.0f} s)"
        )
        runs = [("capped", args.cap)] + ([("uncapped", 0)] if args.uncapped else [])
        context = multiprocessing.get_context("spawn")
        for label, cap in runs:
            with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
                measured = pool.submit(
                    train_and_measure, str(folder / "store"), cap, str(folder / label)
                ).result()
            _report(label, args.cap, data_mb, measured)
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)

