r"""Does a sequence model use the order of the frames? The order benchmark.

For every dataset and model, on the test split:

* **test NLL**: the exact negative log-likelihood in the dataset's unit (original units);
* **shuffled NLL**: the same with the real frames of every sequence permuted at random (one
  seeded permutation per sequence, :func:`shuffle_frames`). The preprocessing of every built-in
  dataset is frame-wise, so its log-Jacobian is the same for the shuffled sequence;
* **order gain** = shuffled NLL - test NLL: how much worse the model finds shuffled sequences.
  A model of i.i.d. frames has gain 0; the linear-Gaussian AR(1) model
  (:class:`~iresflow.models.reference.AutoregressiveGaussian`, fitted on train and
  validation) sets the gain a sequence flow should at least reach;
* **lag-1 autocorrelation** per feature (:func:`lag1_autocorrelation`) of the data and of the
  model's samples, drawn with the test split's lengths: a model that ignores order samples
  frames with autocorrelation near 0;
* the lag-1 autocorrelation of the noise ``model.transform_to_noise(test)``, which is near 0
  when the model has whitened the temporal dependence.

Any model with ``log_prob(x, mask[, method=...])``, ``sample(num, lengths=..., generator=...)``
and ``transform_to_noise(x, mask)`` works: the iresflow model, and both autoregressive baselines.

Run from the repository root::

    python -m benchmarks order --quick                          # smoke run, under a minute
    python -m benchmarks order --run japanese_vowels=runs/jv    # a trained iresflow run
    python -m benchmarks order                                  # train the flows, ~5 min each

The table is printed and the records (one per dataset and seed) are written to
``benchmarks/out/order.json`` (``--out``); the flows it trains go next to it, in ``runs/``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from benchmarks import cli
from iresflow.data.datasets import SequenceDataset, SequenceSplit, load_dataset
from iresflow.models.reference import AutoregressiveGaussian
from iresflow.runs.load import load_run
from iresflow.train.config import TrainConfig
from iresflow.train.likelihood import placement, split_log_prob
from iresflow.train.loop import train

DATASETS = ("japanese_vowels", "digits_rows", "co2_windows")
#: Settings of ``--quick``: 2 blocks of width 32, 2 epochs, 64/32 sequences.
QUICK = {"n_blocks": 2, "hidden": 32, "epochs": 2, "max_train": 64, "max_eval": 32}


class SequenceModel(Protocol):
    """What the benchmark needs of a model."""

    def log_prob(self, x: Tensor, mask: Tensor | None = None, **kwargs: Any) -> Tensor: ...

    def sample(self, num: int, *, lengths: Tensor, generator: torch.Generator | None
               ) -> tuple[Tensor, Tensor]: ...

    def transform_to_noise(self, x: Tensor, mask: Tensor | None = None) -> Tensor: ...


def shuffle_frames(x: Tensor, mask: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Permute the real frames of every sequence uniformly at random; padding stays in place.

    Args:
        x: Sequences ``(B, N, D)``.
        mask: Padding mask ``(B, N)``, ``True`` for real frames (not necessarily a prefix).
        generator: Optional generator of the permutations (on ``x``'s device).

    Returns:
        ``(B, N, D)``: the real positions of sequence ``b`` hold its real frames in a uniformly
        random order, the padded positions are unchanged.

    Example:
        >>> x = torch.arange(4.0).reshape(1, 4, 1)
        >>> out = shuffle_frames(x, torch.tensor([[True, True, True, False]]))
        >>> sorted(out[0, :3, 0].tolist()), out[0, 3, 0].item()
        ([0.0, 1.0, 2.0], 3.0)
    """
    if mask is None:
        raise ValueError("mask must be a (B, N) boolean tensor, got None")
    keys = torch.rand(mask.shape, generator=generator, device=x.device)
    # real positions in order, then padded ones; and real positions in random order, then padded
    targets = torch.argsort((~mask).to(torch.uint8), dim=1, stable=True)
    sources = torch.argsort(torch.where(mask, keys, 2.0), dim=1, stable=True)
    index = lambda i: i.unsqueeze(-1).expand_as(x)  # noqa: E731
    return x.scatter(1, index(targets), torch.gather(x, 1, index(sources)))


def lag1_autocorrelation(x: Tensor, mask: Tensor | None = None) -> Tensor:
    r"""Lag-1 autocorrelation of every feature, pooled over sequences.

    The Pearson correlation of :math:`x_{t,d}` and :math:`x_{t+1,d}` over all pairs of adjacent
    positions that are both real frames.

    Args:
        x: Sequences ``(B, N, D)``.
        mask: Padding mask ``(B, N)`` or ``None`` (all real).

    Returns:
        Correlations ``(D,)`` in ``x``'s dtype.

    Raises:
        ValueError: fewer than two adjacent real pairs.

    Example:
        >>> x = torch.tensor([[[1.0], [2.0], [3.0], [4.0]]])
        >>> lag1_autocorrelation(x).tolist()
        [1.0]
    """
    real = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device) if mask is None else mask
    pairs = real[:, 1:] & real[:, :-1]
    if int(pairs.sum()) < 2:
        raise ValueError("lag1_autocorrelation needs at least two pairs of adjacent real frames")
    a, b = x[:, :-1][pairs], x[:, 1:][pairs]
    a, b = a - a.mean(0), b - b.mean(0)
    return (a * b).sum(0) / (a.square().sum(0) * b.square().sum(0)).sqrt()


def order_metrics(
    model: SequenceModel,
    dataset: SequenceDataset,
    *,
    method: str | None = None,
    generator: torch.Generator | None = None,
    batch_size: int = 64,
    split: SequenceSplit | None = None,
) -> dict[str, Any]:
    """The order benchmark of one model on one dataset.

    Args:
        model: A trained model in ``eval()`` mode.
        dataset: The dataset (its unit and preprocessing).
        method: Passed as ``log_prob(..., method=method)`` when not ``None`` (``"exact"`` for
            the iresflow model).
        generator: Generator of the shuffles and of the samples, on the model's device.
        batch_size: Sequences per call of the model.
        split: The sequences to score (default ``dataset.test``).

    Returns:
        ``test_nll``, ``shuffled_nll``, ``order_gain`` (in ``dataset.unit``), the lag-1
        autocorrelation per feature of the data (``autocorr_data``), of the samples
        (``autocorr_samples``) and of the noise (``autocorr_noise``), and seconds taken.
    """
    split = dataset.test if split is None else split
    device = placement(model)[0]
    start = time.perf_counter()
    shuffled = SequenceSplit(shuffle_frames(split.x, split.mask, generator), split.mask,
                             split.log_jacobian)
    log_prob, _ = split_log_prob(model, split, method=method, batch_size=batch_size)
    test_nll = dataset.nll(log_prob, split)
    log_prob, _ = split_log_prob(model, shuffled, method=method, batch_size=batch_size)
    shuffled_nll = dataset.nll(log_prob, shuffled)
    lengths = split.mask.sum(1).to(device)
    samples, noise = [], []
    with torch.no_grad():
        for index in torch.arange(len(split)).split(batch_size):
            x, mask = split.x[index].to(device), split.mask[index].to(device)
            noise.append(model.transform_to_noise(x, mask).cpu())
            drawn, drawn_mask = model.sample(len(index), lengths=lengths[index.to(device)],
                                             generator=generator)
            width = split.x.shape[1] - drawn.shape[1]  # pad back to the split's length
            samples.append(torch.nn.functional.pad(drawn.cpu(), (0, 0, 0, width)))
    as_list = lambda v: [round(float(c), 4) for c in v]  # noqa: E731
    return {
        "unit": dataset.unit,
        "test_nll": test_nll,
        "shuffled_nll": shuffled_nll,
        "order_gain": shuffled_nll - test_nll,
        "autocorr_data": as_list(lag1_autocorrelation(split.x, split.mask)),
        "autocorr_samples": as_list(lag1_autocorrelation(torch.cat(samples), split.mask)),
        "autocorr_noise": as_list(lag1_autocorrelation(torch.cat(noise), split.mask)),
        "seconds": time.perf_counter() - start,
    }


# ------------------------------------------------------------------------------------------------
# the command


def _fit_ar(dataset: SequenceDataset, order: int) -> AutoregressiveGaussian:
    x = torch.cat([dataset.train.x, dataset.val.x])
    mask = torch.cat([dataset.train.mask, dataset.val.mask])
    return AutoregressiveGaussian(dataset.features, dataset.max_len).fit(x, mask, order)


def _flow(name: str, seed: int, args: argparse.Namespace) -> tuple[Any, SequenceDataset, str]:
    """The iresflow model of a dataset: a given run folder, or one trained with ``seed``."""
    runs = dict(item.split("=", 1) for item in args.run)
    if name in runs:
        run_dir = Path(runs[name])
    else:
        run_dir = args.out.parent / "runs" / name / f"seed{seed}"
        settings = (QUICK if args.quick else {}) | cli.settings(args)
        config = TrainConfig.from_dict({"data": name, "seed": seed, "device": "cpu", **settings})
        train(config, run_dir, overwrite=True, progress=False)
    run = load_run(run_dir, device="cpu")
    if run.dataset.name != name:
        raise ValueError(f"run {run_dir} was trained on {run.dataset.name!r}, not {name!r}")
    return run.model, run.dataset, str(run_dir)


def _row(name: str, label: str, r: dict[str, Any]) -> str:
    mean_abs = lambda v: sum(abs(c) for c in v) / len(v)  # noqa: E731
    return (f"{name:16s} {label:22s} {r['test_nll']:9.3f} {r['shuffled_nll']:9.3f} "
            f"{r['order_gain']:8.3f} {mean_abs(r['autocorr_data']):7.3f} "
            f"{mean_abs(r['autocorr_samples']):7.3f} {mean_abs(r['autocorr_noise']):7.3f}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cli.add_datasets(parser, DATASETS)
    parser.add_argument("--run", action="append", default=[], metavar="DATASET=PATH",
                        help="use this iresflow run folder for a dataset (else train one)")
    parser.add_argument("--no-flow", action="store_true", help="only the AR baseline")
    cli.add_quick(parser, "2 blocks of width 32, 2 epochs, 64/32 sequences")
    cli.add_settings(parser, epochs=None, max_train=None, max_eval=None)
    parser.add_argument("--ar-order", type=int, default=1, help="order of the AR baseline")
    cli.add_seeds(parser)
    cli.add_threads(parser)
    cli.add_records(parser, "order")


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Score the flows and the AR baseline of every dataset and seed; write the records."""
    if any("=" not in item for item in args.run):
        raise SystemExit("--run takes DATASET=PATH")
    print(f"{'dataset':16s} {'model':22s} {'test NLL':>9s} {'shuffled':>9s} {'gain':>8s} "
          f"{'|ac| dat':>7s} {'|ac| smp':>7s} {'|ac| z':>7s}")
    rows: list[dict[str, Any]] = []
    for name in args.datasets:
        for seed in cli.seeds(args):
            record: dict[str, Any] = {"dataset": name, "seed": seed}
            if args.no_flow:
                dataset = load_dataset(name, seed=seed)
            else:
                flow, dataset, run_dir = _flow(name, seed, args)
                record["iresflow"] = order_metrics(
                    flow, dataset, method="exact", generator=torch.Generator().manual_seed(seed))
                record["iresflow"]["run"] = run_dir
                print(_row(name, "iresflow (exact)", record["iresflow"]))
            x = torch.cat([dataset.train.x, dataset.val.x])
            mask = torch.cat([dataset.train.mask, dataset.val.mask])
            ar = AutoregressiveGaussian(dataset.features, dataset.max_len).fit(x, mask,
                                                                                args.ar_order)
            label = f"ar{args.ar_order}_gaussian"
            record[label] = order_metrics(ar, dataset,
                                          generator=torch.Generator().manual_seed(seed))
            print(_row(name, f"AR({args.ar_order}) Gaussian", record[label]))
            record["unit"] = dataset.unit
            rows.append(record)
    print("gain = shuffled - test NLL (dataset unit); |ac| = mean over features of the absolute "
          "lag-1 autocorrelation of the data, the samples and the noise")
    cli.save(args, rows, ("dataset", "seed"), {"ar_order": args.ar_order})
    print(f"wrote {args.out}")
    return rows
