"""Speed of L2 self-attention against SDPA-based dot-product attention, measured side by side.

Forward+backward (training) and no-grad forward (inversion/sampling) wall and CPU time of
``L2MultiheadAttention``, ``ContractiveL2MultiheadAttention`` and iresflow's
``DotProductMultiheadAttention``, each printed as a ratio to ``torch.nn.MultiheadAttention``
(no biases, ``scaled_dot_product_attention`` inside) on the same input, float32.

Run: ``python -m benchmarks attention [--lengths 128 512] [--repeats 3] [--threads 1]``; use
``--threads 2`` only on an otherwise idle machine (on shared cores, intra-op thread barriers wait
for descheduled threads and swamp the measurement).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from torch import Tensor, nn

from benchmarks import cli
from benchmarks.timing import measure
from iresflow.nn.attention import (
    ContractiveL2MultiheadAttention,
    DotProductMultiheadAttention,
    L2MultiheadAttention,
)


def paired_ratios(
    step: Callable[[], None], peer: Callable[[], None], repeats: int
) -> tuple[float, float, float]:
    """Ratios of the fastest times of ``step`` and ``peer``, timed alternately.

    Other processes only ever add time, so minima over alternating calls are the least disturbed
    figures; process CPU time is the steadier of the two when the cores are shared.

    Returns:
        Wall-time ratio, CPU-time ratio, fastest peer wall time (seconds).
    """
    step()
    peer()
    own, other = [], []
    for _ in range(repeats):
        own.append(measure(step))
        other.append(measure(peer))
    own_wall, own_cpu = min(t[0] for t in own), min(t[1] for t in own)
    peer_wall, peer_cpu = min(t[0] for t in other), min(t[1] for t in other)
    return own_wall / peer_wall, own_cpu / peer_cpu, peer_wall


def train_step(module: Callable[[Tensor], Tensor], x: Tensor) -> Callable[[], None]:
    def step() -> None:
        x.grad = None
        module(x).square().mean().backward()

    return step


def inference_step(module: Callable[[Tensor], Tensor], x: Tensor) -> Callable[[], None]:
    def step() -> None:
        with torch.no_grad():
            module(x)

    return step


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--repeats", type=int, default=3)
    cli.add_threads(parser)


def run(args: argparse.Namespace) -> None:
    torch.manual_seed(0)

    peer = nn.MultiheadAttention(args.dim, args.heads, bias=False, batch_first=True)
    modules: dict[str, Callable[[Tensor], Tensor]] = {
        "L2MultiheadAttention": L2MultiheadAttention(args.dim, args.heads),
        "ContractiveL2MultiheadAttention": ContractiveL2MultiheadAttention(args.dim, args.heads),
        "DotProductMultiheadAttention": DotProductMultiheadAttention(args.dim, args.heads),
    }

    def sdpa(x: Tensor) -> Tensor:
        return peer(x, x, x, need_weights=False)[0]

    print(
        f"B={args.batch} D={args.dim} H={args.heads} float32, {args.threads} threads; ratio = "
        "fastest time / fastest time of nn.MultiheadAttention (SDPA), timed alternately: wall (cpu)"
    )
    for n in args.lengths:
        x = torch.randn(args.batch, n, args.dim, requires_grad=True)
        for mode, make_step in (("fwd+bwd", train_step), ("no-grad fwd", inference_step)):
            peer_step = make_step(sdpa, x)
            for name, module in modules.items():
                wall, cpu, peer_wall = paired_ratios(make_step(module, x), peer_step, args.repeats)
                print(
                    f"N={n:<4} {mode:<11}  {name:<32} x{wall:.2f} (x{cpu:.2f})   "
                    f"[SDPA {peer_wall * 1e3:.0f} ms]"
                )

