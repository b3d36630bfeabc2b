"""Full-covariance Gaussian over frames: the floor a sequence flow should beat.

Fits one Gaussian :math:`\\mathcal N(\\mu, \\Sigma)` to the real frames of the training split (in
model space; the preprocessing is affine or frame-wise, so this is the same model class as a
Gaussian in raw space for the standardised datasets) and reports the test NLL in the dataset's
unit, in original units, via :meth:`SequenceDataset.nll`. Side by side, the same Gaussian is
fitted with scipy directly on raw frames (``to_raw`` of the training split, the raw test file for
``japanese_vowels``) as the peer; the ratio checks the log-Jacobian bookkeeping.

Run: ``python benchmarks/gaussian_baseline.py``
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from scipy.stats import multivariate_normal

import iresflow.data.datasets as datasets
from iresflow.data.datasets import SequenceDataset, load_dataset
from iresflow.data.readers import read_ts


def gaussian_frame_baseline(dataset: SequenceDataset) -> float:
    """Test NLL of a full-covariance Gaussian over frames fitted on the training frames.

    Args:
        dataset: Any :class:`SequenceDataset`.

    Returns:
        The test NLL in ``dataset.unit`` (original units of the data).
    """
    train = dataset.train.x[dataset.train.mask].to(torch.float64)
    mean = train.mean(dim=0)
    cov = torch.cov(train.T, correction=0).reshape(dataset.features, dataset.features)
    gaussian = torch.distributions.MultivariateNormal(mean, covariance_matrix=cov)
    test = dataset.test
    frame_log_prob = gaussian.log_prob(test.x.to(torch.float64)) * test.mask
    return dataset.nll(frame_log_prob.sum(dim=1), test)


def scipy_japanese_vowels_peer(dataset: SequenceDataset) -> float:
    """The same Gaussian fitted by scipy on raw frames, scored on the raw official test file."""
    train_raw = dataset.to_raw(dataset.train.x.double(), dataset.train.mask)
    frames = train_raw[dataset.train.mask].numpy()
    fitted = multivariate_normal(frames.mean(axis=0), np.cov(frames.T, bias=True))
    test_file = Path(datasets.__file__).parent / "files" / "JapaneseVowels_TEST.ts.gz"
    test_frames = np.concatenate([s.numpy() for s in read_ts(test_file).series])
    return float(-fitted.logpdf(test_frames).mean())


def main() -> None:
    torch.set_num_threads(1)
    for name in ("japanese_vowels", "digits_rows", "co2_windows"):
        start = time.perf_counter()
        dataset = load_dataset(name, seed=0)
        nll = gaussian_frame_baseline(dataset)
        elapsed = time.perf_counter() - start
        print(
            f"{name:16s} Gaussian-over-frames test NLL {nll:8.4f} {dataset.unit}  ({elapsed:.2f} s)"
        )
        if name == "japanese_vowels":
            peer = scipy_japanese_vowels_peer(dataset)
            print(
                f"{'':16s} scipy on raw frames (peer)    {peer:8.4f} nats/frame  "
                f"ratio iresflow/scipy = {nll / peer:.6f}"
            )


if __name__ == "__main__":
    main()
