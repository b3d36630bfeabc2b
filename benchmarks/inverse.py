r"""Inverse of a residual block: plain fixed point vs Anderson acceleration, side by side.

For each Lipschitz constant ``L`` in (0.9, 0.97) a position-wise ``LipschitzMLP`` branch
``16 -> 64 -> 16`` is inverted on a batch of 128 sequences of 16 tokens (float64) with
:func:`iresflow.inverse.fixed_point.fixed_point_inverse`, once per solver. Two branches per ``L``:

* ``tight``: weights with all singular values at the bound (orthonormal directions, a symmetric
  orthogonal product with eigenvalues +-1) and biases that put LipSwish at its maximal slope, so
  the Jacobian norm is close to ``L``: the hard case, as in a trained flow that uses its
  Lipschitz budget;
* ``init``: torch's default initialisation with the normalisation binding (each layer rescaled to
  norm ``sqrt(L)``): typical at the start of training, contracting much faster than ``L``.

Both solvers stop with the same rule, a max-abs residual of the returned solution below
``(1 - L) / sqrt(D) 1e-6``, which certifies a max-abs error of at most ``1e-6``: per token (2-norm
certificate, error ``e``, residual ``r = x + g(x) - y``),
:math:`\|e\|_\infty \le \|e\|_2 \le \frac{1}{1-L}\|r\|_2 \le \frac{\sqrt D}{1-L}\,\|r\|_\infty`.

Reported per solver: calls of the branch (each on the batch of samples still running), branch
evaluations per sample (mean; their total is the branch work, since converged samples are no
longer evaluated), the median over repeats of the process CPU time (less sensitive to other load
on the machine than wall time), the achieved max-abs error, and the observed contraction rate of
the plain iteration. The ratios are plain / Anderson.

Run: ``python -m benchmarks inverse [--quick] [--threads N]``
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from benchmarks import cli
from iresflow.inverse.fixed_point import fixed_point_inverse
from iresflow.nn.linear import SpectralLinear
from iresflow.nn.mlp import LipschitzMLP

BATCH, LENGTH, FEATURES, HIDDEN = 128, 16, 16, 64
F64 = torch.float64


def branch_for(kind: str, lipschitz: float) -> LipschitzMLP:
    """A ``LipschitzMLP`` with certificate ``lipschitz`` (see the module docstring)."""
    coeff = math.sqrt(lipschitz)
    mlp = LipschitzMLP((FEATURES, HIDDEN, FEATURES), coeff=coeff).to(F64)
    first, second = (m for m in mlp.modules() if isinstance(m, SpectralLinear))
    with torch.no_grad():
        if kind == "tight":
            q, _ = torch.linalg.qr(torch.randn(HIDDEN, FEATURES, dtype=F64))  # orthonormal columns
            basis, _ = torch.linalg.qr(torch.randn(FEATURES, FEATURES, dtype=F64))
            signs = torch.tensor([(-1.0) ** i for i in range(FEATURES)], dtype=F64)
            reflection = basis @ torch.diag(signs) @ basis.T  # symmetric orthogonal
            first.weight.copy_(10 * q)
            second.weight.copy_(10 * reflection @ q.T)
            # LipSwish z sigma(beta z) / 1.1 has its maximal slope (~1) at beta z = 2.3994
            act_beta = float(torch.nn.functional.softplus(torch.tensor(0.5)))
            first.bias.fill_(2.3994 / act_beta)
            second.bias.zero_()
        else:
            first.weight.mul_(10.0)
            second.weight.mul_(10.0)
    return mlp.eval()


def solve(branch: LipschitzMLP, y: torch.Tensor, solver: str, tol: float):
    """Solve once; returns the solution, its stats and the process CPU seconds spent."""
    start = time.process_time()
    x, stats = fixed_point_inverse(branch, y, tol=tol, solver=solver, max_iter=5000)
    return x, stats, time.process_time() - start


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cli.add_quick(parser, "fewer repeats")
    cli.add_threads(parser)


def run(args: argparse.Namespace) -> None:
    repeats = 3 if args.quick else 5
    print(
        f"fixed-point inverse to max-abs error 1e-6: B={BATCH} N={LENGTH} D={FEATURES} "
        f"hidden={HIDDEN}, float64, Anderson memory 5, median of {repeats} repeats"
    )
    header = (
        f"{'branch':>6} {'L':>5} {'solver':>9} {'calls':>6} {'evals/sample':>12} "
        f"{'CPU ms':>8} {'max error':>10} {'plain rate':>10}"
    )
    print(header)
    for lipschitz in (0.9, 0.97):
        for kind in ("tight", "init"):
            torch.manual_seed(0)
            branch = branch_for(kind, lipschitz)
            certificate = float(branch.lipschitz_constant().detach())
            x = 0.5 * torch.randn(BATCH, LENGTH, FEATURES, dtype=F64)
            with torch.no_grad():
                y = x + branch(x)
            tol = (1 - certificate) / math.sqrt(FEATURES) * 1e-6
            results = {}
            for solver in ("plain", "anderson"):
                solve(branch, y, solver, tol)  # warm-up
                times, (x_hat, stats) = [], (None, None)
                for _ in range(repeats):
                    x_hat, stats, seconds = solve(branch, y, solver, tol)
                    times.append(seconds)
                results[solver] = (stats, statistics.median(times))
                error = float((x_hat - x).abs().max())
                per_sample = float(stats.iterations.double().mean())
                rate = ""
                if solver == "plain":
                    with torch.no_grad():
                        first = branch(y).abs().flatten(1).amax(1)
                    k = stats.iterations.double()
                    observed = (stats.residual / first).log() / (k - 1).clamp_min(1)
                    rate = f"{math.exp(float(observed.max())):.3f}"
                print(
                    f"{kind:>6} {certificate:5.2f} {solver:>9} {stats.evaluations:6d} "
                    f"{per_sample:12.1f} {1e3 * results[solver][1]:8.1f} {error:10.2e} {rate:>10}"
                )
            (plain, plain_time), (anderson, anderson_time) = results["plain"], results["anderson"]
            print(
                f"{'':>6} {'':>5} {'ratio':>9} {plain.evaluations / anderson.evaluations:6.2f} "
                f"{float(plain.iterations.sum()) / float(anderson.iterations.sum()):12.2f} "
                f"{plain_time / anderson_time:8.2f}   (plain / anderson; target >= 3 at L = 0.97)"
            )

