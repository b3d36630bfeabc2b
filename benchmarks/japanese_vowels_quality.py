"""Quality on JapaneseVowels: the sequence flow against frame-wise peers, side by side.

Three models of the same data (the ``japanese_vowels`` splits and preprocessing of
:func:`iresflow.data.datasets.load_dataset`), scored by the exact test negative log-likelihood in
nats per frame, in the original units of the data:

* **ours**: :class:`~iresflow.models.transformer.ResidualFlowTransformer` with the default
  recipe (autoregressive layer, temporal convolutions and MLPs), trained by
  :func:`iresflow.train.loop.train` (the trainer of the ``iresflow train`` command) with the
  settings below;
* **i.i.d.-frame flow** (the peer): the same model with ``layers=("mlp",)`` and
  ``ar_order=0``, i.e. a residual flow applied to every frame independently, with the MLP
  width raised until it has at least as many parameters as ours, trained by the same trainer
  with the same settings;
* **nflows MAF over frames** (the second peer): nflows' masked autoregressive flow on single
  frames, frames i.i.d. (:func:`benchmarks.baselines.nflows_models.frame_maf`, 4 layers), its
  width raised until it has at least as many parameters as ours, trained with the same settings
  by the same loop (:func:`iresflow.train.fit.fit`, the loop of ``iresflow train`` in memory;
  best validation epoch kept);
* **Gaussian over frames**: one full-covariance Gaussian fitted in closed form to the training
  frames (:func:`benchmarks.gaussian_baseline.gaussian_frame_baseline`).

Both flows keep the checkpoint with the best validation NLL (Russian-roulette estimate, 4
samples per sequence, in evaluation mode) and are scored on the test split with the exact
log-determinant (dense Jacobians). Printed: test NLL, the difference to ours, and the per-frame
likelihood ratio ``exp(NLL_peer - NLL_ours)`` (> 1: ours assigns the test frames more density).
Timings are wall-clock on a shared machine and only indicative.

Run from the repository root::

    python -m benchmarks.japanese_vowels_quality           # recommended settings, a few minutes
    python -m benchmarks.japanese_vowels_quality --quick   # smoke run, under a minute
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.baselines.nflows_models import FrameFlow, frame_maf
from benchmarks.gaussian_baseline import gaussian_frame_baseline
from iresflow.data.datasets import SequenceDataset
from iresflow.models.transformer import ResidualFlowTransformer
from iresflow.runs.evaluate import evaluate_run
from iresflow.runs.load import load_run
from iresflow.train.config import TrainConfig
from iresflow.train.factories import load_data
from iresflow.train.fit import fit
from iresflow.train.likelihood import split_log_prob
from iresflow.train.loop import train

#: Settings of ours: the library defaults, trained for the full schedule (no early stop).
RECOMMENDED = {
    key: TrainConfig().to_dict()[key]
    for key in ("n_blocks", "hidden", "lr", "batch_size", "epochs", "scheduler", "eval_method")
} | {"patience": 0}
#: Smoke-run settings of ``--quick``.
QUICK = {"n_blocks": 2, "hidden": 32, "batch_size": 32, "epochs": 3, "max_eval": 48}


def parameter_count(config: TrainConfig, features: int, max_len: int) -> int:
    """Trainable parameters of the model a configuration builds."""
    model = ResidualFlowTransformer(config.model.replace(features=features, max_len=max_len))
    return sum(p.numel() for p in model.parameters())


def matched_iid_config(config: TrainConfig, features: int, max_len: int) -> TrainConfig:
    """The frame-wise peer (MLP layers only, no autoregressive layer) with the smallest MLP width
    reaching ours in parameters."""
    target = parameter_count(config, features, max_len)
    peer = config.replace(model=config.model.replace(layers=("mlp",), ar_order=0))
    while parameter_count(peer, features, max_len) < target:
        peer = peer.replace(model=peer.model.replace(hidden=peer.model.hidden + 1))
    return peer


def matched_maf(target: int, features: int, max_len: int) -> tuple[FrameFlow, int]:
    """The frame MAF with the smallest width reaching ``target`` parameters, and that width."""
    hidden = 1
    while sum(p.numel() for p in frame_maf(features, max_len, hidden).parameters()) < target:
        hidden += 1
    return frame_maf(features, max_len, hidden), hidden


def train_and_test_maf(
    maf: FrameFlow, config: TrainConfig, dataset: SequenceDataset
) -> dict[str, float]:
    """Train the frame MAF with the flows' settings and loop; exact test NLL."""
    start = time.perf_counter()
    result = fit(config, dataset, maf)
    trained = time.perf_counter() - start
    start = time.perf_counter()
    log_prob, _ = split_log_prob(maf, dataset.test, batch_size=256)
    return {
        "nll": dataset.nll(log_prob, dataset.test),
        "best_epoch": result.best_epoch,
        "train_seconds": trained,
        "test_seconds": time.perf_counter() - start,
        "parameters": sum(p.numel() for p in maf.parameters()),
    }


def train_and_test(config: TrainConfig, run_dir: Path) -> dict[str, float]:
    """Train one flow, reload its best checkpoint, return its exact test NLL and timings."""
    start = time.perf_counter()
    result = train(config, run_dir, overwrite=True, progress=False)
    trained = time.perf_counter() - start
    run = load_run(run_dir, device="cpu")
    start = time.perf_counter()
    evaluation = evaluate_run(run, method="exact", save=False)
    return {
        "nll": evaluation["nll"],
        "best_epoch": result.best_epoch,
        "val_nll": result.best_val_nll,
        "train_seconds": trained,
        "test_seconds": time.perf_counter() - start,
        "parameters": sum(p.numel() for p in run.model.parameters()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run (tiny models, 3 epochs)")
    for key, value in RECOMMENDED.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=None,
                            help=f"default {value}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--out", type=Path, default=None,
                        help="keep the two run folders here (default: a temporary folder)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    settings = RECOMMENDED | (QUICK if args.quick else {})
    settings |= {k: v for k in RECOMMENDED if (v := getattr(args, k)) is not None}
    ours = TrainConfig.from_dict(
        {"data": "japanese_vowels", "seed": args.seed, "device": "cpu", **settings})
    dataset = load_data(ours)  # the splits both flows see (test cut to max_eval with --quick)
    peer = matched_iid_config(ours, dataset.features, dataset.max_len)
    print(f"settings: {settings}")

    gaussian = gaussian_frame_baseline(dataset)
    with tempfile.TemporaryDirectory() as scratch:
        root = args.out if args.out is not None else Path(scratch)
        results = {"ours (L2 attention)": train_and_test(ours, root / "ours")}
        results[f"i.i.d.-frame flow (hidden {peer.model.hidden})"] = train_and_test(
            peer, root / "iid")
    torch.manual_seed(args.seed)
    maf, width = matched_maf(results["ours (L2 attention)"]["parameters"], dataset.features,
                             dataset.max_len)
    results[f"nflows MAF over frames (hidden {width})"] = train_and_test_maf(maf, ours, dataset)
    ours_nll = results["ours (L2 attention)"]["nll"]

    print(f"\nJapaneseVowels test NLL, nats/frame (exact; {len(dataset.test)} sequences)")
    header = (f"{'model':34s} {'params':>7s} {'best ep':>7s} {'train s':>8s} {'test s':>7s} "
              f"{'NLL':>8s} {'NLL-ours':>9s} {'ratio':>7s}")
    print(header)
    rows = list(results.items()) + [("Gaussian over frames", {"nll": gaussian})]
    for name, r in rows:
        if "parameters" in r:
            stats = (f"{r['parameters']:7d} {r['best_epoch']:7d} {r['train_seconds']:8.1f} "
                     f"{r['test_seconds']:7.1f}")
        else:
            stats = f"{'-':>7s} {'-':>7s} {'-':>8s} {'-':>7s}"
        ratio = math.exp(r["nll"] - ours_nll)
        print(f"{name:34s} {stats} {r['nll']:8.3f} {r['nll'] - ours_nll:9.3f} {ratio:7.3f}")
    print("ratio = per-frame likelihood of ours over the model's, exp(NLL_model - NLL_ours)")


if __name__ == "__main__":
    main()
