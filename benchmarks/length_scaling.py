"""Training-step time of the default model against sequence length and batch; sampling speed.

1. One training step (``log_prob`` + backward, as in an epoch) of the default
   :class:`~iresflow.models.config.ModelConfig` model (``D = 12``) for lengths
   ``N = 16, 32, ..., 1024`` and batches ``--batches``, with the roulette (training default) and
   the exact log-determinant; a method stops growing ``N`` at the first step slower than
   ``--max-step`` seconds. Times are CPU seconds of this process (robust on shared cores), the
   fastest of ``--repeats`` steps; the log-log slope of time against ``N`` closes the table.
2. Sampling: sequences per second of :meth:`~iresflow.models.flow.SequenceFlow.sample` with the
   Anderson-accelerated and the plain fixed-point inverse, and the mean and largest numbers of
   iterations per residual block.

The model is freshly initialised (ActNorm from the data of the step); for sampling its residual
weights are scaled up so that every layer sits at its Lipschitz bound, as the layers of a trained
model tend to (iteration counts grow with the Lipschitz constant). Run (about 4 minutes on one
core)::

    python -m benchmarks.length_scaling [--device cpu|cuda] [--threads 1]
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from benchmarks.scaling import slope
from iresflow.models.config import ModelConfig
from iresflow.models.transformer import ResidualFlowTransformer

FEATURES = 12


def device_clock(device: torch.device) -> float:
    """CPU seconds of this process, or wall seconds after a synchronisation on CUDA."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return time.perf_counter()
    return time.process_time()


def step_seconds(
    method: str, length: int, batch: int, device: torch.device, repeats: int
) -> float:
    """Fastest of ``repeats`` training steps at length ``N`` (after one warm-up step)."""
    generator = torch.Generator().manual_seed(length)
    config = ModelConfig(features=FEATURES, max_len=length, logdet=method)
    model = ResidualFlowTransformer(config).to(device).train()
    x = torch.randn(batch, length, FEATURES, generator=generator).to(device)
    mask = torch.ones(batch, length, dtype=torch.bool, device=device)
    model.initialize(x, mask)
    best = math.inf
    for i in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        start = device_clock(device)
        (-model.log_prob(x, mask).sum()).backward()
        if i > 0:
            best = min(best, device_clock(device) - start)
    return best


def sampling(length: int, num: int, device: torch.device) -> dict[str, tuple[float, float, int]]:
    """Sequences/s and the iterations per sequence and block (mean, largest) of each solver."""
    config = ModelConfig(features=FEATURES, max_len=length)
    model = ResidualFlowTransformer(config).to(device)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--max-step", type=float, default=2.0, help="seconds before stopping")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    print(f"training step of the default model (D = {FEATURES}), device {device}, "
          f"{args.threads} thread(s); seconds, fastest of {args.repeats}")
    print(f"{'method':<10}{'batch':>6}{'N':>6}{'seconds':>10}{'ms/frame':>10}{'/roulette':>11}")
    results: dict[tuple[str, int], tuple[list[int], list[float]]] = {}
    for batch in args.batches:
        for method in ("roulette", "exact"):
            lengths: list[int] = []
            times: list[float] = []
            length = 16
            while length <= args.max_length:
                seconds = step_seconds(method, length, batch, device, args.repeats)
                lengths.append(length)
                times.append(seconds)
                ratio = ""
                reference = results.get(("roulette", batch))
                if reference is not None and length in reference[0]:
                    ratio = f"{seconds / reference[1][reference[0].index(length)]:.2f}"
                print(f"{method:<10}{batch:>6}{length:>6}{seconds:>10.4f}"
                      f"{1e3 * seconds / (batch * length):>10.3f}{ratio:>11}", flush=True)
                if seconds > args.max_step:
                    break
                length *= 2
            results[(method, batch)] = (lengths, times)
    print("\nlog-log slope of step time against N:")
    for (method, batch), (lengths, times) in results.items():
        print(f"  {method:<10} batch {batch:<3} {slope(lengths, times):5.2f}   "
              f"(N = {lengths[0]}..{lengths[-1]})")

    print("\nsampling (default model, layers at their bounds), sequences/s and fixed-point "
          "iterations per block (mean, max):")
    for length, num in ((29, 64), (256, 16)):
        for solver, (rate, mean, most) in sampling(length, num, device).items():
            print(f"  N = {length:<4} {num:>3} sequences  {solver:<9} {rate:9.1f} seq/s   "
                  f"iterations {mean:5.1f} mean, {most} max")


if __name__ == "__main__":
    main()
