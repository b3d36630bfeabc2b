r"""Can :math:`x + c f(x)` be inverted by fixed-point iteration? (Kim Fig. 3,
docs/math.md#experiments (E2), check H8 (docs/math.md#checks))

For :math:`g(x) = x + c\,f(x)` with :math:`f` = dot-product MHA (not Lipschitz, Kim Thm 3.1) or
L2-MHA (Lipschitz, Thm 3.2), both raw (not normalised) with 8 heads, :math:`N = D = 64`, weights
drawn as ``nn.Linear`` does (:math:`U[-1/\sqrt D, 1/\sqrt D]`, the library default), and
:math:`c \in \{0.5, 0.7, 0.9\}`, we invert :math:`y = g(x)` by the plain iteration
:math:`x^{k+1} = y - c f(x^k)`, :math:`x^0 = y`, and record the reconstruction error
:math:`\max_b \|x^k_b - x_b\|_\infty` (largest absolute entry error over the batch of 128) at
every iteration. Inputs follow the pathological case of docs/math.md#dot-product-attention: in every
sequence one token (at a random position) is zero and the others are :math:`U[-10, 10]`. float32
throughout.

The same problems are then handed to the library's inverse engine,
:func:`iresflow.inverse.fixed_point.fixed_point_inverse` (plain and Anderson-accelerated, default
tolerance, ``on_failure="warn"``), whose verdict (converged or not) and final error are recorded
next to the trajectories, together with the number of samples declared converged at a point
:math:`z \ne x` (error above :math:`10^{-3}`) and the largest residual
:math:`\|z + c f(z) - y\|_\infty` among converged samples: a small residual there means
:math:`y` has a second preimage, i.e. :math:`g` is not injective.

Run: ``python examples/numerical_invertibility.py`` (about two minutes; writes
``docs/figures/numerical_invertibility.{json,png}``) or ``--quick`` (seconds).
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from torch import Tensor, nn

from iresflow.inverse.fixed_point import InversionWarning, fixed_point_inverse
from iresflow.nn.attention import (
    DotProductMultiheadAttention,
    L2MultiheadAttention,
    lipschitz_bound,
)

NAME = "numerical_invertibility"
DTYPE = torch.float32
FULL = {"coeffs": [0.5, 0.7, 0.9], "batch": 128, "iterations": 50, "solver_max_iter": 100}
QUICK = {"coeffs": [0.5, 0.9], "batch": 16, "iterations": 30, "solver_max_iter": 30}
LENGTH, DIM, HEADS, RANGE = 64, 64, 8, 10.0
MODELS = {"dot-product": DotProductMultiheadAttention, "L2": L2MultiheadAttention}


def pathological_inputs(batch: int, generator: torch.Generator) -> Tensor:
    """``U[-10, 10]`` tokens with one zero token per sequence at a random position.

    Returns:
        Shape ``(batch, N, D)``, float32.
    """
    x = (2 * torch.rand(batch, LENGTH, DIM, generator=generator) - 1) * RANGE
    zero = torch.randint(LENGTH, (batch,), generator=generator)
    x[torch.arange(batch), zero] = 0.0
    return x


def max_error(x_hat: Tensor, x: Tensor) -> float:
    """Largest absolute entry error over the whole batch."""
    return float((x_hat - x).abs().amax())


def trajectory(
    branch: Callable[[Tensor], Tensor], x: Tensor, iterations: int
) -> tuple[list[float], Tensor]:
    """Plain iteration ``x <- y - branch(x)`` from ``x = y`` for ``y = x + branch(x)``.

    Returns:
        The batch-max error at iterations ``0..K`` and the per-sample final error ``(B,)``.
    """
    y = x + branch(x)
    x_k = y
    errors = [max_error(x_k, x)]
    for _ in range(iterations):
        x_k = y - branch(x_k)
        errors.append(max_error(x_k, x))
    return errors, (x_k - x).flatten(1).abs().amax(1)


def library_solve(
    branch: Callable[[Tensor], Tensor], x: Tensor, solver: str, max_iter: int
) -> dict:
    """Invert with :func:`fixed_point_inverse`; report its verdict and the true error."""
    y = x + branch(x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", InversionWarning)
        x_hat, stats = fixed_point_inverse(branch, y, max_iter=max_iter, solver=solver,
                                           on_failure="warn")
    # A sample can meet the tolerance at a point z other than x: then z + branch(z) = y too,
    # i.e. y has a second preimage. Such samples are counted separately.
    converged = stats.converged
    error = (x_hat - x).flatten(1).abs().amax(1)
    residual = (x_hat + branch(x_hat) - y).flatten(1).abs().amax(1)
    return {
        "converged_fraction": float(converged.float().mean()),
        "max_iterations": int(stats.iterations.max()),
        "max_error": float(error.max()),
        "max_error_converged": float(error[converged].max()) if converged.any() else None,
        "max_residual_converged": float(residual[converged].max()) if converged.any() else None,
        "converged_elsewhere": int((converged & (error > 1e-3)).sum()),
        "warned": any(issubclass(w.category, InversionWarning) for w in caught),
    }


def run(coeffs: list[float], batch: int, iterations: int, solver_max_iter: int, seed: int) -> dict:
    """Trajectories and library verdicts for every model and coefficient."""
    torch.manual_seed(seed)  # module initialisation
    modules: dict[str, nn.Module] = {name: cls(DIM, HEADS) for name, cls in MODELS.items()}
    x = pathological_inputs(batch, torch.Generator().manual_seed(seed))
    rows = []
    with torch.no_grad():
        outputs = {name: float(f(x).abs().amax()) for name, f in modules.items()}
        for coeff in coeffs:
            for name, f in modules.items():

                def branch(z: Tensor, f: nn.Module = f, coeff: float = coeff) -> Tensor:
                    return coeff * f(z)

                errors, final = trajectory(branch, x, iterations)
                rows.append({
                    "model": name,
                    "coeff": coeff,
                    "errors": errors,
                    "final_error": errors[-1],
                    "fraction_below_1e-3": float((final < 1e-3).float().mean()),
                    "plain": library_solve(branch, x, "plain", solver_max_iter),
                    "anderson": library_solve(branch, x, "anderson", solver_max_iter),
                })
    l2 = modules["L2"]
    return {
        "experiment": NAME,
        "config": {"coeffs": coeffs, "batch": batch, "length": LENGTH, "dim": DIM,
                   "heads": HEADS, "input_range": RANGE, "iterations": iterations,
                   "solver_max_iter": solver_max_iter, "seed": seed, "dtype": "float32",
                   "init": "U[-1/sqrt(D), 1/sqrt(D)] (nn.Linear default)"},
        "input_max_abs": float(x.abs().amax()),
        "output_max_abs": outputs,
        "l2_theorem_bound_inf": float(lipschitz_bound(l2, LENGTH, p="inf").detach()),
        "results": rows,
    }


def plot(result: dict, path: Path) -> None:
    """Reconstruction error against iteration (log y), one panel per coefficient."""
    coeffs = result["config"]["coeffs"]
    figure = Figure(figsize=(4 * len(coeffs), 3.6), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, len(coeffs), sharey=True, squeeze=False)[0]
    colours = {"dot-product": "tab:orange", "L2": "tab:blue"}
    # Exact zeros cannot be drawn on a log axis; they are shown at this floor.
    floor = torch.finfo(DTYPE).tiny
    for ax, coeff in zip(axes, coeffs, strict=True):
        for row in result["results"]:
            if row["coeff"] == coeff:
                errors = [max(e, floor) for e in row["errors"]]
                ax.plot(range(len(errors)), errors, "-", color=colours[row["model"]],
                        label=f"{row['model']}-MHA")
        ax.set(yscale="log", xlabel="fixed-point iteration", title=f"c = {coeff}")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(r"max reconstruction error $\max_b\|x^k_b - x_b\|_\infty$")
    axes[0].legend()
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    """Run the experiment, write ``numerical_invertibility.json`` and ``.png`` into ``--out``.

    Returns:
        The result dictionary written to the JSON file.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/figures"))
    parser.add_argument("--quick", action="store_true", help="small batch, fewer iterations")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    start = time.perf_counter()
    result = run(settings["coeffs"], settings["batch"], settings["iterations"],
                 settings["solver_max_iter"], args.seed)
    result["quick"] = args.quick
    result["seconds"] = time.perf_counter() - start
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{NAME}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / f"{NAME}.png")
    for row in result["results"]:
        print(f"{row['model']:>11s}  c={row['coeff']}  error after {len(row['errors']) - 1} "
              f"iterations {row['final_error']:.3e}  library plain converged "
              f"{row['plain']['converged_fraction']:.2f}, anderson "
              f"{row['anderson']['converged_fraction']:.2f}")
    return result


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
