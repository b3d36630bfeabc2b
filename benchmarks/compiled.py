"""Does ``torch.compile`` speed up sampling or a training step of the default model? Measured.

On the default JapaneseVowels model (data-initialised, untrained weights: the cost of a step does
not depend on their values), side by side in one run:

* sampling ``--num`` sequences with the lengths of the first test sequences, eager against the
  same model whose residual branches are compiled (``module.compile(dynamic=True)``); the first
  compiled call (compilation) is reported apart, and the samples must agree to ``1e-4``;
* one training step (roulette log-determinant with its Neumann-series gradient, backward,
  optimiser step) eager, and with the compiled branches, or the error that stops it.

Every figure is the fastest of ``--repeats`` calls in CPU seconds of this process. Run from the
repository root::

    python -m benchmarks compiled            # a few minutes on the CPU (compilation dominates)
    python -m benchmarks compiled --device cuda
"""

from __future__ import annotations

import argparse
import copy
import time
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from benchmarks.timing import fastest
from iresflow.data.datasets import load_dataset
from iresflow.models.residual_flow import ResidualSequenceFlow
from iresflow.train.likelihood import trimmed_batch
from iresflow.transforms.residual import ResidualTransform


def compile_branches(model: ResidualSequenceFlow) -> ResidualSequenceFlow:
    """A copy of ``model`` whose residual branches run through ``torch.compile``."""
    compiled = copy.deepcopy(model)
    for module in compiled.modules():
        if isinstance(module, ResidualTransform):
            module.branch.compile(dynamic=True)
    return compiled


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num", type=int, default=64, help="sequences per sampling call")
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per training step")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")


def run(args: argparse.Namespace) -> dict[str, object]:
    warnings.filterwarnings("ignore", module=r"torch\.")  # the compiler's graph-break notes
    device = torch.device(args.device)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    ds = load_dataset("japanese_vowels")
    model = ResidualSequenceFlow(features=ds.features, max_len=ds.max_len).to(device)
    model.initialize(*trimmed_batch(ds.train, torch.arange(len(ds.train)), device))
    lengths = ds.test.mask[: args.num].sum(1).to(device)
    results: dict[str, object] = {}

    def sampler(flow: ResidualSequenceFlow) -> Callable[[], Tensor]:
        def draw() -> Tensor:
            flow.eval()
            generator = torch.Generator(device).manual_seed(1)
            with torch.no_grad():
                return flow.sample(args.num, lengths=lengths, generator=generator)[0]
        return draw

    compiled = compile_branches(model)
    eager_draw, compiled_draw = sampler(model), sampler(compiled)
    start = time.perf_counter()
    difference = float((compiled_draw() - eager_draw()).abs().max())
    results["compile seconds (first sampling call)"] = time.perf_counter() - start
    results["samples max |compiled - eager|"] = difference
    eager = fastest(eager_draw, args.repeats, device)
    fast = fastest(compiled_draw, args.repeats, device)
    results["sampling s, eager"], results["sampling s, compiled"] = eager, fast
    results["sampling compiled / eager"] = fast / eager

    batch = trimmed_batch(ds.train, torch.arange(args.batch_size), device)

    def stepper(flow: ResidualSequenceFlow) -> Callable[[], None]:
        optimizer = torch.optim.Adam(flow.parameters(), lr=1e-4)

        def step() -> None:
            flow.train()
            loss = -flow.log_prob(*batch).sum() / batch[1].sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        return step

    results["training step s, eager"] = fastest(stepper(model), args.repeats, device)
    try:
        step = stepper(compiled)
        step()  # compilation
        results["training step s, compiled"] = fastest(step, args.repeats, device)
        results["training compiled / eager"] = (results["training step s, compiled"]
                                                / results["training step s, eager"])
    except Exception as error:  # report why the compiled step cannot run
        results["training step, compiled"] = f"fails: {type(error).__name__}: " + \
            str(error).strip().splitlines()[0][:200]
    for key, value in results.items():
        print(f"{key:>40}: {value:.4g}" if isinstance(value, float) else f"{key:>40}: {value}")
    return results
