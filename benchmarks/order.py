r"""Does a sequence model use the order of the frames? The order benchmark.

For every dataset and model, on the test split:

* **test NLL**: the exact negative log-likelihood in the dataset's unit (original units);
* **shuffled NLL**: the same with the real frames of every sequence permuted at random (one
  seeded permutation per sequence, :func:`shuffle_frames`). The preprocessing of every built-in
  dataset is frame-wise, so its log-Jacobian is the same for the shuffled sequence;
* **order gain** = shuffled NLL - test NLL: how much worse the model finds shuffled sequences.
  A model of i.i.d. frames has gain 0; the linear-Gaussian AR(1) model
  (:class:`~benchmarks.baselines.autoregressive.AutoregressiveGaussian`, fitted on train and
  validation) sets the gain a sequence flow should at least reach;
* **lag-1 autocorrelation** per feature (:func:`lag1_autocorrelation`) of the data and of the
  model's samples, drawn with the test split's lengths: a model that ignores order samples
  frames with autocorrelation near 0;
* the lag-1 autocorrelation of the noise ``model.transform_to_noise(test)``, which is near 0
  when the model has whitened the temporal dependence.

Any model with ``log_prob(x, mask[, method=...])``, ``sample(num, lengths=..., generator=...)``
and ``transform_to_noise(x, mask)`` works: the iresflow model, and both autoregressive baselines.

Run from the repository root::

    python -m benchmarks.order --quick                          # smoke run, under a minute
    python -m benchmarks.order --run japanese_vowels=runs/jv    # a trained iresflow run
    python -m benchmarks.order                                  # train the flows, ~5 min each

The table is printed and the numbers are written to ``benchmarks/out/order/order.json``
(``--out``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from benchmarks.baselines.autoregressive import AutoregressiveGaussian
from iresflow._validation import check_mask, check_sequence
from iresflow.data.datasets import SequenceDataset, SequenceSplit, load_dataset
from iresflow.train.likelihood import placement, split_log_prob

__all__ = ["lag1_autocorrelation", "order_metrics", "shuffle_frames"]

DATASETS = ("japanese_vowels", "digits_rows", "co2_windows")
ROOT = Path(__file__).resolve().parents[1]


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
    check_sequence(x, "x", allow_2d=False)
    checked = check_mask(mask, x)
    if checked is None:
        raise ValueError("mask must be a (B, N) boolean tensor, got None")
    keys = torch.rand(checked.shape, generator=generator, device=x.device)
    # real positions in order, then padded ones; and real positions in random order, then padded
    targets = torch.argsort((~checked).to(torch.uint8), dim=1, stable=True)
    sources = torch.argsort(torch.where(checked, keys, 2.0), dim=1, stable=True)
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
    check_sequence(x, "x", allow_2d=False)
    checked = check_mask(mask, x)
    real = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device) if checked is None \
        else checked
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


def _flow(name: str, args: argparse.Namespace) -> tuple[Any, SequenceDataset, str]:
    """The iresflow model of a dataset: a given run folder, or a freshly trained one."""
    from iresflow.runs.load import load_run
    from iresflow.train.config import TrainConfig
    from iresflow.train.loop import train

    runs = dict(item.split("=", 1) for item in args.run)
    if name in runs:
        run_dir = Path(runs[name])
    else:
        run_dir = args.out / "runs" / name
        settings = {"n_blocks": args.n_blocks, "hidden": args.hidden, "epochs": args.epochs}
        config = TrainConfig.from_dict(dict(
            data=name, max_train=args.max_train, max_eval=args.max_eval, seed=args.seed,
            device="cpu", **{k: v for k, v in settings.items() if v is not None}))
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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--datasets", nargs="+", choices=DATASETS, default=list(DATASETS))
    parser.add_argument("--run", action="append", default=[], metavar="DATASET=PATH",
                        help="use this iresflow run folder for a dataset (else train one)")
    parser.add_argument("--no-flow", action="store_true", help="only the AR baseline")
    parser.add_argument("--quick", action="store_true",
                        help="smoke settings: 2 blocks of width 32, 2 epochs, 64/32 sequences")
    parser.add_argument("--n-blocks", type=int, default=None, help="default: the library's")
    parser.add_argument("--hidden", type=int, default=None, help="default: the library's")
    parser.add_argument("--epochs", type=int, default=None, help="default: the library's")
    parser.add_argument("--max-train", type=int, default=None)
    parser.add_argument("--max-eval", type=int, default=None)
    parser.add_argument("--ar-order", type=int, default=1, help="order of the AR baseline")
    parser.add_argument("--seed", type=int, default=0, help="seed of training and shuffles")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "order")
    args = parser.parse_args(argv)
    if args.quick:
        args.n_blocks, args.hidden, args.epochs = 2, 32, 2
        args.max_train, args.max_eval = 64, 32
    if any("=" not in item for item in args.run):
        parser.error("--run takes DATASET=PATH")
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)

    report: dict[str, Any] = {"settings": {k: str(v) if isinstance(v, Path) else v
                                           for k, v in vars(args).items()}, "datasets": {}}
    print(f"{'dataset':16s} {'model':22s} {'test NLL':>9s} {'shuffled':>9s} {'gain':>8s} "
          f"{'|ac| dat':>7s} {'|ac| smp':>7s} {'|ac| z':>7s}")
    for name in args.datasets:
        entry: dict[str, Any] = {}
        if args.no_flow:
            dataset = load_dataset(name, seed=args.seed)
        else:
            flow, dataset, run_dir = _flow(name, args)
            entry["iresflow"] = order_metrics(
                flow, dataset, method="exact", generator=torch.Generator().manual_seed(args.seed))
            entry["iresflow"]["run"] = run_dir
            print(_row(name, "iresflow (exact)", entry["iresflow"]))
        ar = _fit_ar(dataset, args.ar_order)
        entry[f"ar{args.ar_order}_gaussian"] = order_metrics(
            ar, dataset, generator=torch.Generator().manual_seed(args.seed))
        print(_row(name, f"AR({args.ar_order}) Gaussian", entry[f"ar{args.ar_order}_gaussian"]))
        entry["unit"] = dataset.unit
        report["datasets"][name] = entry
    print("gain = shuffled - test NLL (dataset unit); |ac| = mean over features of the absolute "
          "lag-1 autocorrelation of the data, the samples and the noise")
    path = args.out / "order.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")
    return report


if __name__ == "__main__":
    main()
