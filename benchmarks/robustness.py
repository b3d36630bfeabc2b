"""Do the training defaults train stably on every kind of data? One short run per dataset.

Trains the defaults of ``iresflow train`` (:class:`~iresflow.train.config.TrainConfig()`, only
the data budget reduced with ``max_train``/``max_eval`` and ``epochs``) on every shipped dataset
(``japanese_vowels``, ``digits_rows``, ``co2_windows``) and on synthetic sequences with
``D = 1, 2, 6`` features generated here: stationary vector AR(1) processes with a seasonal term
and observation noise, of random lengths, written as ``.npz`` files to a temporary folder.

A run is flagged as **degrading** when its training NLL stays more than 0.05 nats/frame above its
best value so far for 5 epochs in a row (the symptom of a learning rate too high for the data:
the NLL jumps and does not recover). For ``bits/dim`` data the threshold is converted,
``0.05 / (D ln 2)`` bits/dim. Printed: one row per run (best and final training and validation
NLL, the epoch of the best validation NLL, early stopping, the longest run of degraded epochs)
and a verdict.

Run from the repository root::

    python -m benchmarks robustness                       # a few minutes on 2 CPU cores
    python -m benchmarks robustness --epochs 40 --max-train 400 --set warmup=0 clip=10
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks import cli
from iresflow.train.config import TrainConfig
from iresflow.train.factories import load_data
from iresflow.train.loop import train

#: Degradation rule: more than this many nats/frame above the best training NLL so far ...
DEGRADATION_NATS = 0.05
#: ... for this many consecutive epochs.
DEGRADATION_EPOCHS = 5
SHIPPED = ("japanese_vowels", "digits_rows", "co2_windows")
SYNTHETIC_FEATURES = (1, 2, 6)


def synthetic_sequences(
    features: int, sequences: int, max_len: int, generator: torch.Generator
) -> tuple[np.ndarray, np.ndarray]:
    r"""Noisy vector AR(1) sequences with a seasonal term, of random lengths.

    :math:`s_t = A s_{t-1} + 0.5\,\epsilon_t`, :math:`x_t = s_t + \sin(2\pi t / 12 + \phi) +
    0.1\,\eta_t`, with :math:`A` a random matrix scaled to spectral norm 0.8, a random phase per
    sequence and standard normal noises; lengths uniform in ``[max_len // 2, max_len]``.

    Returns:
        ``x`` of shape ``(sequences, max_len, features)`` (zero after each length) and the
        ``lengths`` ``(sequences,)``, as NumPy arrays for :func:`numpy.savez`.
    """
    a = torch.randn(features, features, generator=generator, dtype=torch.float64)
    a = 0.8 * a / torch.linalg.matrix_norm(a, 2)
    state = torch.randn(sequences, features, generator=generator, dtype=torch.float64)
    phase = 2 * math.pi * torch.rand(sequences, 1, generator=generator, dtype=torch.float64)
    frames = []
    for t in range(max_len):
        noise = torch.randn(sequences, features, generator=generator, dtype=torch.float64)
        state = state @ a.T + 0.5 * noise
        season = torch.sin(2 * math.pi * t / 12 + phase)
        observation = torch.randn(sequences, features, generator=generator, dtype=torch.float64)
        frames.append(state + season + 0.1 * observation)
    x = torch.stack(frames, dim=1)
    lengths = torch.randint(max_len // 2, max_len + 1, (sequences,), generator=generator)
    x = torch.where((torch.arange(max_len) < lengths[:, None])[..., None], x, 0.0)
    return x.numpy(), lengths.numpy()


def degraded_run(history: list[dict[str, float]], threshold: float) -> int:
    """Longest run of consecutive epochs whose training NLL exceeds the best so far by more
    than ``threshold``.

    Example:
        >>> rows = [{"train_nll": v} for v in (3.0, 2.9, 3.0, 3.0, 2.95, 2.9)]
        >>> degraded_run(rows, 0.05)
        2
    """
    best, current, longest = math.inf, 0, 0
    for row in history:
        value = row["train_nll"]
        current = current + 1 if value > best + threshold else 0
        longest = max(longest, current)
        best = min(best, value)
    return longest


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cli.add_settings(parser, epochs=20, max_train=96, max_eval=48)
    cli.add_seeds(parser)
    parser.add_argument("--curves", action="store_true", help="print the NLL of every epoch")
    parser.add_argument("--only", nargs="*", help="run only these datasets (names as printed)")


def run(args: argparse.Namespace) -> None:
    """Train every dataset with every seed, print a row per run and the verdict."""
    settings = cli.settings(args)
    print(f"settings: TrainConfig defaults with {settings}")
    flagged = []
    for seed in cli.seeds(args):
        flagged += [f"{label} (seed {seed})" for label in _run_seed(args, settings, seed)]
    if flagged:
        print(f"verdict: UNSTABLE on {', '.join(flagged)} (training NLL more than "
              f"{DEGRADATION_NATS} nats/frame above its best for {DEGRADATION_EPOCHS}+ epochs)")
    else:
        print(f"verdict: stable: no run's training NLL stayed more than {DEGRADATION_NATS} "
              f"nats/frame above its best for {DEGRADATION_EPOCHS} epochs in a row")


def _run_seed(args: argparse.Namespace, settings: dict[str, object], seed: int) -> list[str]:
    """The runs of one seed, printed; the datasets whose run degraded."""
    generator = torch.Generator().manual_seed(seed)
    flagged = []
    with tempfile.TemporaryDirectory() as folder:
        datasets = {name: name for name in SHIPPED}
        for features in SYNTHETIC_FEATURES:
            x, lengths = synthetic_sequences(features, 400, 48, generator)
            path = Path(folder) / f"ar_d{features}.npz"
            np.savez(path, x=x, lengths=lengths)
            datasets[f"synthetic D={features}"] = str(path)
        base = TrainConfig.from_dict({**settings, "seed": seed})
        print(f"seed {seed}: warmup={base.warmup}, clip={base.clip}, lr={base.lr}, "
              f"scheduler={base.scheduler}, patience={base.patience}")
        print(f"{'data':<18}{'unit':>11}{'best train':>11}{'last train':>11}"
              f"{'best val':>10}{'at epoch':>9}{'epochs':>7}{'early':>6}{'degraded':>9}"
              f"{'time':>7}")
        for label, data in datasets.items():
            if args.only and label not in args.only:
                continue
            config = TrainConfig.from_dict({**settings, "seed": seed, "data": data})
            start = time.perf_counter()
            result = train(config, Path(folder) / "runs" / label.replace(" ", "_"),
                           progress=False)
            seconds = time.perf_counter() - start
            dataset = load_data(config)
            unit, threshold = dataset.unit, DEGRADATION_NATS
            if unit == "bits/dim":
                threshold /= dataset.features * math.log(2)
            longest = degraded_run(result.history, threshold)
            train_nll = [row["train_nll"] for row in result.history]
            print(f"{label:<18}{unit:>11}{min(train_nll):>11.4f}{train_nll[-1]:>11.4f}"
                  f"{result.best_val_nll:>10.4f}{result.best_epoch:>9}{result.epochs:>7}"
                  f"{'yes' if result.stopped_early else 'no':>6}{longest:>9}{seconds:>6.0f}s",
                  flush=True)
            if args.curves:
                print("  train", " ".join(f"{value:.3f}" for value in train_nll))
                print("  val  ", " ".join(f"{row['val_nll']:.3f}" for row in result.history))
            if longest >= DEGRADATION_EPOCHS:
                flagged.append(label)
    return flagged
