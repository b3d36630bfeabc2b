"""Sampling speed of a trained flow against the frame-by-frame samplers of its peers, side by side.

The flow of a trained run (``iresflow train``'s folder) draws ``--num`` sequences of its
dataset's longest length ``N`` with ``flow.sample`` (every residual step inverted over all frames
at once by fixed-point iterations, every autoregressive step by sweeps that settle its frames in
order, by default one per sweep); the
GRU + MAF and the Transformer + MAF of the small-data suite
(:class:`benchmarks.baselines.recurrent.RecurrentFlow`, its state and MADE width) draw the same
number of sequences of the same length, one frame after another. A peer's drawing cost does not
depend on its weights (it runs the same layers whatever they hold), so the peers are timed
untrained; the flow's does (its inverses stop at their tolerance), so it is timed trained. Each
time is the median of ``--repeats`` calls after a warm-up, on ``--threads`` CPU threads; with
``--rounds R`` the samplers are timed in turn ``R`` times and each one's time is the median of
its rounds, so that a change of the machine's load reaches every sampler alike. Prints
the seconds, the ratio of every peer's time to the flow's (above 1: the flow is faster) and the
most iterations of every step of the flow's last inverse.

With ``--horizon H`` the samplers forecast instead: the last ``H`` frames of the first test
sequence are held out (:func:`iresflow.runs.forecast.hold_out`) and every sampler draws
``--num`` continuations of the frames before them (the flow, which must be a causal run, with
``flow.forecast``: all ``H`` frames at once, the past pinned), as ``iresflow forecast`` draws
them. Run from the repository root::

    iresflow train --data BasicMotions_TRAIN.ts --test-data BasicMotions_TEST.ts --out runs/bm
    python -m benchmarks sampling --run runs/bm
    iresflow train --data BasicMotions_TRAIN.ts --test-data BasicMotions_TEST.ts --causal \
        --out runs/bm-causal
    python -m benchmarks sampling --run runs/bm-causal --horizon 24

``--peers gru`` leaves out the Transformer + MAF, whose frame-by-frame draws take the longest.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks import cli
from benchmarks.baselines.recurrent import ENCODERS, GRU_HIDDEN, PEER_NAMES, RecurrentFlow
from benchmarks.timing import median_seconds
from iresflow.runs.forecast import hold_out
from iresflow.runs.load import LoadedRun, load_run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", type=Path, required=True, help="a trained run folder")
    parser.add_argument("--num", type=int, default=100, help="sequences per draw (default: 100)")
    parser.add_argument("--horizon", type=int, default=None,
                        help="time forecasts of this many frames of the first test sequence "
                             "instead (a causal run)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed calls per sampler (default: 3)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="times every sampler is timed, in turn; each one's time is the "
                             "median of its rounds (default: 1)")
    parser.add_argument("--peers", nargs="+", choices=ENCODERS, default=list(ENCODERS),
                        help="the peers' encoders of the past (default: both)")
    cli.add_threads(parser)


def _samplers(trained: LoadedRun, args: argparse.Namespace
              ) -> tuple[str, dict[str, Callable[[], object]]]:
    """What is drawn (a line) and the draw of every sampler, the flow's first."""
    flow, length, features = trained.model.eval(), trained.dataset.max_len, trained.dataset.features
    generator = torch.Generator().manual_seed(0)
    peers = {PEER_NAMES[encoder]: RecurrentFlow(features, length, hidden=GRU_HIDDEN,
                                                encoder=encoder).eval() for encoder in args.peers}
    if args.horizon is None:
        return (f"{args.num} sequences of N = {length} frames, D = {features}", {
            "iresflow": lambda: flow.sample(args.num, seq_len=length, generator=generator),
            **{name: (lambda peer=peer: peer.sample(args.num, seq_len=length,
                                                    generator=generator))
               for name, peer in peers.items()}})
    held = hold_out(trained.dataset.test, args.horizon)
    past, observed = held.x[:1], held.observed[:1]
    start = torch.where(observed[..., None], past, 0.0)
    return (f"{args.num} forecasts of H = {args.horizon} frames after {int(observed.sum())} "
            f"observed ones, D = {features}", {
        "iresflow": lambda: flow.forecast(start, observed, horizon=args.horizon,
                                          num_samples=args.num, generator=generator),
        **{name: (lambda peer=peer: peer.forecast(past, observed, args.horizon, args.num,
                                                  generator))
           for name, peer in peers.items()}})


def run(args: argparse.Namespace) -> int:
    """Time the samplers and print the table; 1 if the flow's inverse did not converge."""
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {args.rounds}")
    trained = load_run(args.run, device="cpu")
    if args.horizon is not None and not trained.model.causal:
        raise SystemExit(f"{args.run} is not a causal run: --horizon needs one (iresflow train "
                         "--causal)")
    what, samplers = _samplers(trained, args)
    with torch.no_grad():
        rounds = [{name: median_seconds(call, args.repeats) for name, call in samplers.items()}
                  for _ in range(args.rounds)]
        seconds = {name: statistics.median(r[name] for r in rounds) for name in samplers}
        samplers["iresflow"]()
    diagnostics = trained.model.inverse_diagnostics()
    print(f"{what} ({torch.get_num_threads()} thread(s))")
    for name, value in seconds.items():
        ratio = value / seconds["iresflow"]
        print(f"  {name:<20} {value:8.3f} s   {ratio:5.2f} x the flow's time")
    print("  flow's inverse, most iterations per step: " + ", ".join(
        f"{block['name']} {block['max_iterations']}" for block in diagnostics["blocks"]))
    return 0 if diagnostics["converged"] else 1
