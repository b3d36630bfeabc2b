"""Train step of a residual MLP flow: iresflow vs normflows, measured side by side.

Both flows: 4 residual blocks on ``D = 16``, branch MLP ``16 -> 128 -> 128 -> 16`` with
spectral normalisation (per-layer bound 0.97) and LipSwish, batch 256, float32, Adam. The
log-determinant estimator has the same settings on both sides: Russian roulette with a geometric
count (``p = 0.5``), 2 exact terms, 1 Gaussian probe, Neumann-series gradient, memory-efficient
backward. One train step is forward + log-det estimate + backward + optimiser step; for normflows
it also includes ``normflows.utils.update_lipschitz(model, 5)``, which its spectral
normalisation needs after every step (iresflow's ``SpectralLinear`` advances its power iteration
inside the training forward). normflows' MLP starts with an activation (``Swish -> Linear -> ...``)
and so has one more elementwise activation per block than ``LipschitzMLP``.

Time: per-step process CPU time (``time.process_time``, less sensitive to other load on the
machine than wall time, which is printed as well), median over repeats; the two libraries are
measured alternately within every repeat, each with a warm-up. The roulette counts are random
(mean 2 extra terms per block); every repeat re-seeds torch and numpy.

Peak memory: the largest amount of tensor memory held at any point of one train step, from the
allocation and free events of PyTorch's CPU allocator recorded by ``torch.profiler``
(``profile_memory=True``, one ``[memory]`` event with its size per allocation and free): the
maximum of their running sum in time order, after warm-up so that parameters, optimiser state and
caches already exist. It measures what a step adds on top of the model (activations, saved
tensors, gradients), median over steps.

Run: ``python -m benchmarks residual_mlp [--quick] [--threads N]`` (needs normflows)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from collections.abc import Callable

import numpy as np
import torch
from nflows.distributions import StandardNormal
from nflows.flows import Flow
from nflows.transforms import CompositeTransform
from torch.profiler import ProfilerActivity, profile

from benchmarks import cli
from benchmarks.timing import measure
from iresflow.logdet.roulette import RouletteLogDet
from iresflow.nn.mlp import LipschitzMLP
from iresflow.transforms.residual import ResidualTransform

BATCH, FEATURES, HIDDEN, BLOCKS, COEFF = 256, 16, 128, 4, 0.97


def iresflow_step(data: torch.Tensor) -> tuple[Callable[[], None], int]:
    """A train step of the iresflow flow (nflows ``Flow`` around ``ResidualTransform`` s)."""
    blocks = [
        ResidualTransform(
            # power iteration, as in the normflows flow compared against
            LipschitzMLP((FEATURES, HIDDEN, HIDDEN, FEATURES), coeff=COEFF, sigma="power"),
            logdet=RouletteLogDet(
                "geometric",
                p=0.5,
                n_exact_terms=2,
                n_probes=1,
                probe="gaussian",
                neumann_gradient=True,
                memory_efficient=True,
            ),
        )
        for _ in range(BLOCKS)
    ]
    flow = Flow(CompositeTransform(blocks), StandardNormal([FEATURES]))
    optimizer = torch.optim.Adam(flow.parameters(), lr=1e-3)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = -flow.log_prob(data).mean()
        loss.backward()
        optimizer.step()

    return step, sum(p.numel() for p in flow.parameters())


def normflows_step(data: torch.Tensor) -> tuple[Callable[[], None], int]:
    """A train step of the normflows flow (``Residual(LipschitzMLP)``, reverse=True default)."""
    import normflows as nf

    flows = [
        nf.flows.Residual(
            nf.nets.LipschitzMLP([FEATURES, HIDDEN, HIDDEN, FEATURES], lipschitz_const=COEFF),
            reduce_memory=True,
            geom_p=0.5,
            n_dist="geometric",
            n_exact_terms=2,
            n_samples=1,
        )
        for _ in range(BLOCKS)
    ]
    model = nf.NormalizingFlow(nf.distributions.DiagGaussian(FEATURES, trainable=False), flows)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = model.forward_kld(data)
        loss.backward()
        optimizer.step()
        nf.utils.update_lipschitz(model, 5)

    return step, sum(p.numel() for p in model.parameters())


def peak_step_memory(step: Callable[[], None]) -> int:
    """Peak tensor memory (bytes) allocated during one step, from the allocator's events.

    The profiler records every CPU allocation and free (``[memory]`` events with their size);
    the peak of their running sum in time order is the most memory the step held at once on top
    of what existed before it.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    sizes = [
        (e["ts"], e["args"]["Bytes"])
        for e in events
        if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0
    ]
    current = peak = 0
    for _, size in sorted(sizes):
        current += size
        peak = max(peak, current)
    return peak


def seed(value: int) -> None:
    torch.manual_seed(value)
    np.random.seed(value)  # normflows draws its roulette counts with numpy


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cli.add_quick(parser, "fewer repeats")
    cli.add_threads(parser)


def run(args: argparse.Namespace) -> None:
    repeats, steps, memory_steps = (3, 5, 3) if args.quick else (7, 15, 7)

    seed(0)
    data = torch.randn(BATCH, FEATURES)
    ours, ours_params = iresflow_step(data)
    theirs, theirs_params = normflows_step(data)
    for step in (ours, theirs):
        for _ in range(3):
            step()

    cpu: dict[str, list[float]] = {"iresflow": [], "normflows": []}
    wall: dict[str, list[float]] = {"iresflow": [], "normflows": []}
    for r in range(repeats):
        for name, step in (("iresflow", ours), ("normflows", theirs)):
            seed(r)
            w, c = measure(step, steps)
            cpu[name].append(c)
            wall[name].append(w)
    peaks: dict[str, list[int]] = {"iresflow": [], "normflows": []}
    for r in range(memory_steps):
        for name, step in (("iresflow", ours), ("normflows", theirs)):
            seed(100 + r)
            peaks[name].append(peak_step_memory(step))

    med = {k: statistics.median(v) for k, v in cpu.items()}
    med_wall = {k: statistics.median(v) for k, v in wall.items()}
    mem = {k: statistics.median(v) for k, v in peaks.items()}
    print(
        f"residual MLP flow train step: B={BATCH} D={FEATURES} blocks={BLOCKS} "
        f"hidden={HIDDEN}x2, roulette geometric(0.5) + 2 exact terms, 1 probe, Neumann "
        f"gradient, memory-efficient; threads={args.threads}, {repeats} repeats x {steps} steps"
    )
    print(f"parameters: iresflow {ours_params}, normflows {theirs_params}")
    for name in ("iresflow", "normflows"):
        print(
            f"{name:>10}: {1e3 * med[name]:7.2f} ms CPU/step ({1e3 * med_wall[name]:7.2f} ms wall)"
            f", peak step memory {mem[name] / 2**20:6.2f} MiB"
        )
    print(
        f"speed-up (normflows / iresflow time): {med['normflows'] / med['iresflow']:.2f}x CPU, "
        f"{med_wall['normflows'] / med_wall['iresflow']:.2f}x wall   [target >= 1.5x]"
    )
    print(
        f"peak memory ratio (iresflow / normflows): {mem['iresflow'] / mem['normflows']:.2f}x"
        "   [target <= 0.8x]"
    )

