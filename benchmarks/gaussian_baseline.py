"""Full-covariance Gaussian over frames: the floor a sequence flow should beat.

Fits one Gaussian :math:`\\mathcal N(\\mu, \\Sigma)` to the real frames of the training split (in
model space; the preprocessing is affine or frame-wise, so this is the same model class as a
Gaussian in raw space for the standardised datasets), by maximum likelihood without a ridge
(:class:`~benchmarks.baselines.gaussian.FrameGaussian`), and reports the test NLL in the
dataset's unit, in original units, via :meth:`SequenceDataset.nll`. Side by side, the same
Gaussian is fitted with scipy directly on raw frames (``to_raw`` of the training split, the raw
test file for ``japanese_vowels``) as the peer; the ratio checks the log-Jacobian bookkeeping.

Run: ``python -m benchmarks gaussian_baseline``
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from scipy.stats import multivariate_normal

import iresflow.data
from benchmarks.baselines.gaussian import FrameGaussian
from iresflow.data.datasets import SequenceDataset, load_dataset
from iresflow.data.readers import read_ts


def gaussian_frame_baseline(dataset: SequenceDataset) -> float:
    """Test NLL (in ``dataset.unit``) of a full-covariance Gaussian over the training frames."""
    train, test = dataset.train, dataset.test
    gaussian = FrameGaussian(dataset.features, dataset.max_len, ridge=0.0)
    gaussian.fit(train.x.double(), train.mask)
    return dataset.nll(gaussian.log_prob(test.x.double(), test.mask), test)


def scipy_japanese_vowels_peer(dataset: SequenceDataset) -> float:
    """The same Gaussian fitted by scipy on raw frames, scored on the raw official test file."""
    train_raw = dataset.to_raw(dataset.train.x.double(), dataset.train.mask)
    frames = train_raw[dataset.train.mask].numpy()
    fitted = multivariate_normal(frames.mean(axis=0), np.cov(frames.T, bias=True))
    test_file = Path(iresflow.data.__file__).parent / "files" / "JapaneseVowels_TEST.ts.gz"
    test_frames = np.concatenate([s.numpy() for s in read_ts(test_file).series])
    return float(-fitted.logpdf(test_frames).mean())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options."""


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    for name in ("japanese_vowels", "digits_rows", "co2_windows"):
        start = time.perf_counter()
        dataset = load_dataset(name, seed=0)
        nll = gaussian_frame_baseline(dataset)
        elapsed = time.perf_counter() - start
        print(f"{name:16s} Gaussian-over-frames test NLL {nll:8.4f} {dataset.unit}  "
              f"({elapsed:.2f} s)")
        if name == "japanese_vowels":
            peer = scipy_japanese_vowels_peer(dataset)
            print(f"{'':16s} scipy on raw frames (peer)    {peer:8.4f} nats/frame  "
                  f"ratio iresflow/scipy = {nll / peer:.6f}")
