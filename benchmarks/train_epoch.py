r"""Training-epoch and exact-evaluation speed against a reference commit, side by side.

Times one training epoch on JapaneseVowels through the training code path of the command line
(the training session of :mod:`iresflow.train`, default :class:`~iresflow.train.TrainConfig`
settings, seed 0, CPU, one thread) for

* the reference commit (default ``2f31ab0``) with its default model: 8 blocks of
  ActNorm -> contractive L2 attention -> ActNorm -> LipSwish MLP ("attention" below);
* the current code with the same architecture
  (``layers=("attention", "mlp"), ar_order=0, n_blocks=8``);
* the current code with its own default model;

then the exact test-set evaluation (``log_prob`` with the exact log-determinant, in batches of
``--eval-batch`` sequences) of each default model, and prints the ratios. The epoch time is the
fastest of ``--epochs`` epochs after the first (the first one includes the data-dependent
initialisation and warm-up), over ``--rounds`` interleaved runs of the three models (the fastest
is the least disturbed by other processes on shared cores).

It also checks that the current code reproduces the reference's loss trajectory: a few training
steps of the attention model with the exact log-determinant in float64, from the same initial
weights and on the same batches, must give losses equal to the reference's within ``1e-10``.

Every measurement runs in its own subprocess with ``OMP_NUM_THREADS=1``; the reference runs with
``PYTHONPATH`` pointing at a checkout of the reference commit, made with
``git worktree add <dir> <commit>`` when ``<dir>`` does not exist yet (this needs git and the
repository's history). The workers run this file as a script, so it imports nothing but the
standard library at the top. Times are CPU seconds of the measuring process (on shared cores the
wall time also counts other processes' work). Usage, from the repository root::

    python -m benchmarks train_epoch                 # about 3-4 minutes on one CPU core
    python -m benchmarks train_epoch --epochs 1 --skip-eval
    git worktree remove /tmp/iresflow-2f31ab0        # afterwards, to drop the checkout
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = "2f31ab0"
#: The architecture of the reference's default model, in current settings.
ATTENTION = {"layers": ("attention", "mlp"), "ar_order": 0, "n_blocks": 8}
TOLERANCE = 1e-10
#: Minibatch size of both versions: the reference's default.
BATCH_SIZE = 8
#: The reference's optimisation defaults (no learning-rate warm-up then), given to the current
#: code in the trajectory check so that both take the same optimiser steps.
REFERENCE_OPTIMISATION = {"lr": 6e-3, "warmup": 0}


# -- workers: run inside a subprocess with PYTHONPATH at one version of the code -------------
def _is_reference() -> bool:
    import importlib.util

    return importlib.util.find_spec("iresflow.train.epoch") is None


def _session(model_settings: dict[str, Any], dtype: Any = None) -> Any:
    """A training session of the version on ``sys.path`` with default settings, on the CPU.

    Both versions train with the reference's batch size (:data:`BATCH_SIZE`), so an epoch is the
    same 31 steps on the same data in both.
    """
    import torch

    if dtype is not None:
        torch.set_default_dtype(dtype)
    model_settings = {k: tuple(v) if isinstance(v, list) else v for k, v in model_settings.items()}
    if _is_reference():
        from iresflow.train import loop

        config = loop.TrainConfig(device="cpu", batch_size=BATCH_SIZE, **model_settings)
        dataset = loop.load_data(config)
        torch.manual_seed(config.seed)
        model = loop.build_model(config, dataset)
        return loop._Session(config, dataset, model, torch.device("cpu"), loop.current_world())
    from iresflow.train.config import TrainConfig
    from iresflow.train.distributed import current_world
    from iresflow.train.epoch import TrainingSession
    from iresflow.train.factories import build_model, load_data

    config = TrainConfig.from_dict({"device": "cpu", "batch_size": BATCH_SIZE, **model_settings})
    dataset = load_data(config)
    torch.manual_seed(config.seed)
    model = build_model(config, dataset)
    return TrainingSession(config, dataset, model, torch.device("cpu"), current_world())


def _worker_epoch(args: dict[str, Any]) -> dict[str, Any]:
    """Seconds per training epoch (mean over epochs 2..n) and the test-set exact evaluation."""
    import torch
    from tqdm.auto import tqdm

    torch.set_num_threads(1)
    session = _session(args["model"])
    times = []
    for _ in range(args["epochs"] + 1):
        session.epoch += 1
        with tqdm(disable=True) as bar:
            start = time.process_time()
            session.train_epoch(bar)
            times.append(time.process_time() - start)
    out: dict[str, Any] = {
        "epoch_s": min(times[1:]),
        "first_epoch_s": times[0],
        "steps": session.steps_per_epoch,
        "parameters": sum(p.numel() for p in session.model.parameters()),
    }
    if args["eval"]:
        test = session.dataset.test
        if args["eval_max"] is not None:
            test = type(test)(*(t[: args["eval_max"]] for t in (test.x, test.mask,
                                                                 test.log_jacobian)))
        model = session.model.eval()
        start = time.process_time()
        with torch.no_grad():
            values = []
            for index in torch.arange(len(test)).split(args["eval_batch"]):
                x, mask = test.x[index], test.mask[index]
                width = int(mask.sum(1).max())
                x, mask = x[:, :width].contiguous(), mask[:, :width].contiguous()
                values.append(model.log_prob(x, mask, method="exact"))
        out["eval_s"] = time.process_time() - start
        out["eval_sequences"] = len(test)
        out["eval_mean_log_prob"] = float(torch.cat(values).mean())
    return out


def _worker_trajectory(args: dict[str, Any]) -> dict[str, Any]:
    """Losses of a few exact-log-det float64 steps from given weights on the epoch's batches."""
    import torch

    torch.set_num_threads(1)
    settings = {**args["model"], "logdet": "exact"}
    if not _is_reference():
        settings |= REFERENCE_OPTIMISATION
    session = _session(settings, dtype=torch.float64)
    model, train = session.model, session.dataset.train
    path = Path(args["weights"])
    if args["save"]:
        torch.save(model.state_dict(), path)
    else:  # the reference's names: ``steps`` was ``_transforms``
        reference = torch.load(path)
        model.load_state_dict({
            name: reference[name.replace("transform.steps.", "transform._transforms.")]
            for name in model.state_dict()
        })
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(0))
    losses = []
    model.train()
    for step, index in enumerate(order.split(session.config.batch_size)[: args["steps"]]):
        width = int(train.mask[index].sum(1).max())
        x = train.x[index][:, :width].double()
        mask = train.mask[index][:, :width]
        if step == 0 and not _is_reference():  # the reference initialises in its first forward
            model.initialize(x, mask)
        loss = -session.replica(x, mask).sum() / mask.sum()
        session.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(session.parameters, session.config.clip)
        session.optimizer.step()
        losses.append(loss.item())
    return {"losses": losses}


# -- driver --------------------------------------------------------------------------------
def _run(path: Path, worker: str, args: dict[str, Any]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(path), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", worker,
               json.dumps(args)]
    result = subprocess.run(command, env=env, cwd=path, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{worker} worker at {path} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _checkout(commit: str, path: Path) -> Path:
    if not path.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), commit],
                       check=True, capture_output=True)
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reference", default=REFERENCE, help="commit to compare against")
    parser.add_argument("--reference-dir", type=Path, default=None,
                        help="checkout of the reference (default /tmp/iresflow-<commit>)")
    parser.add_argument("--epochs", type=int, default=2, help="timed epochs after the first")
    parser.add_argument("--rounds", type=int, default=2,
                        help="interleaved repetitions of the epoch timings (fastest kept)")
    parser.add_argument("--steps", type=int, default=4, help="steps of the trajectory check")
    parser.add_argument("--eval-batch", type=int, default=8)
    parser.add_argument("--eval-max", type=int, default=None,
                        help="evaluate at most this many test sequences (default: all)")
    parser.add_argument("--skip-eval", action="store_true")


def run(opts: argparse.Namespace) -> None:
    reference = _checkout(opts.reference,
                          opts.reference_dir or Path(f"/tmp/iresflow-{opts.reference}"))
    common = {"epochs": opts.epochs, "eval": not opts.skip_eval, "eval_batch": opts.eval_batch,
              "eval_max": opts.eval_max}

    with tempfile.TemporaryDirectory() as tmp:
        weights = str(Path(tmp) / "weights.pt")
        traj = {"model": {}, "steps": opts.steps, "weights": weights}
        ref_losses = _run(reference, "trajectory", {**traj, "save": True})["losses"]
        cur_losses = _run(ROOT, "trajectory", {**traj, "model": ATTENTION, "save": False})[
            "losses"]
    gap = max(abs(a - b) for a, b in zip(ref_losses, cur_losses, strict=True))
    print(f"exact-log-det float64 trajectory, {opts.steps} steps (attention model): max |loss "
          f"difference| = {gap:.2e} ({'OK' if gap <= TOLERANCE else 'MISMATCH'}, "
          f"tolerance {TOLERANCE:g})")
    print(f"  reference {[f'{v:.12f}' for v in ref_losses]}")
    print(f"  current   {[f'{v:.12f}' for v in cur_losses]}")

    runs = {
        f"{opts.reference} default (attention)": (reference, {}),
        "current, attention model": (ROOT, ATTENTION),
        "current default (conv)": (ROOT, {}),
    }
    rows: dict[str, dict[str, Any]] = {}
    for round_ in range(opts.rounds):  # interleaved, so that load changes hit every model
        for name, (path, model) in runs.items():
            evaluate = round_ == 0 and common["eval"] and name != "current, attention model"
            row = _run(path, "epoch", {**common, "model": model, "eval": evaluate})
            if name in rows:
                rows[name]["epoch_s"] = min(rows[name]["epoch_s"], row["epoch_s"])
            else:
                rows[name] = row
    base = next(iter(rows.values()))
    print(f"\ntraining epoch on JapaneseVowels ({base['steps']} steps of batch 8, 1 thread; "
          f"fastest of {opts.epochs} epoch(s) after the first in each of {opts.rounds} "
          f"interleaved round(s); CPU seconds)")
    print(f"{'model':<34}{'params':>8}{'epoch s':>10}{'first s':>10}{'vs ref':>9}")
    for name, row in rows.items():
        print(f"{name:<34}{row['parameters']:>8}{row['epoch_s']:>10.2f}"
              f"{row['first_epoch_s']:>10.2f}{row['epoch_s'] / base['epoch_s']:>9.3f}")
    same, own = (rows[name]["epoch_s"] / base["epoch_s"] for name in list(runs)[1:])
    print(f"target (epoch <= 1/3 of {opts.reference}'s): same architecture {same:.3f} "
          f"({'met' if same <= 1 / 3 else 'not met'}), each version's default {own:.3f} "
          f"({'met' if own <= 1 / 3 else 'not met'})")
    if not opts.skip_eval:
        print(f"\nexact test-set evaluation, batches of {opts.eval_batch}")
        for name, row in rows.items():
            if "eval_s" in row:
                print(f"{name:<34}{row['eval_sequences']:>5} seqs {row['eval_s']:>8.2f} s  "
                      f"mean log p {row['eval_mean_log_prob']:.3f}  speed-up "
                      f"{base['eval_s'] / row['eval_s']:.1f}x")


if __name__ == "__main__":  # a worker process (:func:`_run`)
    worker = {"epoch": _worker_epoch, "trajectory": _worker_trajectory}[sys.argv[2]]
    print(json.dumps(worker(json.loads(sys.argv[3]))))
