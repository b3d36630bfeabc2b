"""Training-step time of the default model against sequence length and batch; sampling speed.

1. One training step (``log_prob`` + backward, as in an epoch) of the default
   :class:`~iresflow.models.config.ModelConfig` model (``D = 12``) for lengths
   ``N = 16, 32, ..., 1024`` and batches ``--batches``, with the roulette (training default) and
   the exact log-determinant; a method stops growing ``N`` at the first step slower than
   ``--max-step`` seconds. Times are CPU seconds of this process (robust on shared cores), the
   fastest of ``--repeats`` steps; the log-log slope of time against ``N`` closes each table.
2. Sampling: sequences per second of :meth:`~iresflow.models.flow.SequenceFlow.sample` with the
   Anderson-accelerated and the plain fixed-point inverse, and the mean and largest numbers of
   iterations per residual block.

The model is freshly initialised (ActNorm from the data of the step); for sampling its residual
weights are scaled up so that every layer sits at its Lipschitz bound, as the layers of a trained
model tend to (iteration counts grow with the Lipschitz constant). Run (about 4 minutes on one
core)::

    python -m benchmarks length_scaling [--device cpu|cuda] [--threads 1]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks import cli
from benchmarks.timing import device_clock, fastest, length_sweep
from iresflow.models.config import ModelConfig
from iresflow.models.residual_flow import ResidualSequenceFlow

FEATURES = 12


def step_seconds(
    method: str, length: int, batch: int, device: torch.device, repeats: int
) -> float:
    """Fastest of ``repeats`` training steps at length ``N`` (after one warm-up step)."""
    generator = torch.Generator().manual_seed(length)
    config = ModelConfig(features=FEATURES, max_len=length, logdet=method)
    model = ResidualSequenceFlow(config).to(device).train()
    x = torch.randn(batch, length, FEATURES, generator=generator).to(device)
    mask = torch.ones(batch, length, dtype=torch.bool, device=device)
    model.initialize(x, mask)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        (-model.log_prob(x, mask).sum()).backward()

    step()  # warm-up
    return fastest(step, repeats, device)


def sampling(length: int, num: int, device: torch.device) -> dict[str, tuple[float, float, int]]:
    """Sequences/s and the iterations per sequence and block (mean, largest) of each solver."""
    config = ModelConfig(features=FEATURES, max_len=length)
    model = ResidualSequenceFlow(config).to(device)
    with torch.no_grad():  # residual weights at their bounds, as after training (Lip ~ coeff)
        for _, step in model.residual_steps():
            for p in step.branch.parameters():
                p.mul_(3.0)
    x = torch.randn(64, length, FEATURES, generator=torch.Generator().manual_seed(0)).to(device)
    model.initialize(x)
    model.eval()
    out = {}
    for solver in ("anderson", "plain"):
        for _, step in model.residual_steps():
            step.inverse_solver = solver
        model.sample(num, seq_len=length, generator=torch.Generator(device).manual_seed(0))
        start = device_clock(device)
        model.sample(num, seq_len=length, generator=torch.Generator(device).manual_seed(1))
        seconds = device_clock(device) - start
        counts = torch.cat([
            step.last_inverse_stats.iterations.double() for _, step in model.residual_steps()
        ])
        out[solver] = (num / seconds, float(counts.mean()), int(counts.max()))
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu")
    cli.add_threads(parser)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--max-step", type=float, default=2.0, help="seconds before stopping")
    parser.add_argument("--repeats", type=int, default=2)


def run(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    print(f"training step of the default model (D = {FEATURES}), device {device}, "
          f"{args.threads} thread(s); seconds, fastest of {args.repeats}")
    for batch in args.batches:
        length_sweep(("roulette", "exact"), lambda method, n, batch=batch: {
            "seconds": step_seconds(method, n, batch, device, args.repeats)},
            args.max_length, args.max_step, f"batch {batch}")
    print("\nsampling (default model, layers at their bounds), sequences/s and fixed-point "
          "iterations per block (mean, max):")
    for length, num in ((29, 64), (256, 16)):
        for solver, (rate, mean, most) in sampling(length, num, device).items():
            print(f"  N = {length:<4} {num:>3} sequences  {solver:<9} {rate:9.1f} seq/s   "
                  f"iterations {mean:5.1f} mean, {most} max")
