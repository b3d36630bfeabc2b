r"""How tight is Kim's :math:`\infty`-norm bound on L2 self-attention? (Kim Fig. 2,
docs/math.md#experiments (E1), check H7 (docs/math.md#checks))

L2-MHA with :math:`H = D = 1` and every weight fixed to 1 is the map
:math:`F(x)_i = \sum_j P_{ij} x_j` with :math:`P_{ij} = \mathrm{softmax}_j(-(x_i - x_j)^2)` on
:math:`x \in \mathbb R^N`. Its Theorem 3.2 bound is :math:`4\varphi^{-1}(N-1) + 1`
(:func:`iresflow.nn.attention.lipschitz_bound`). A lower bound on :math:`\mathrm{lip}_\infty(F)` is
:math:`\|J_F(x)\|_\infty` at any :math:`x`; we maximise it with Adam (learning rate 0.1) from ``K``
random starts :math:`x_j \sim U[-c, c]`, :math:`c \sim U[0, 10]` per start (Kim App. H), and keep
the best value seen.

Efficiency: :math:`F` is permutation equivariant, so :math:`\sup_x \|J_F(x)\|_\infty =
\sup_x \sum_k |J_{0k}(x)|` (row 0 of the Jacobian), and row 0 has the closed form

.. math::
    J_{0k} = P_{0k}\big(1 + 2 (x_0 - x_k)(x_k - F_0)\big) + 2\,\delta_{0k}\,
        \mathrm{Var}_{P_0}(x),

with :math:`F_0 = \sum_j P_{0j} x_j` and
:math:`\mathrm{Var}_{P_0}(x) = \sum_j P_{0j} x_j^2 - F_0^2`: :math:`O(N)` per evaluation, so all
``K`` starts run as one batch even at :math:`N = 1000`. The reported lower bound is recomputed at
the best :math:`x` by reverse-mode autograd through the library's
:class:`~iresflow.nn.attention.L2MultiheadAttention` (one vector-Jacobian product for row 0); the
JSON records the difference to the closed form. For small :math:`N` the JSON also holds the dense
:math:`\|J_F\|_\infty` at that point (:func:`iresflow.nn.diagnostics.jacobian_norm`) and the
result of the library's own search, :func:`iresflow.nn.diagnostics.empirical_lipschitz`, from the
first starts with the budget of docs/math.md#experiments (E1). Everything runs in float64.

Run: ``python examples/bound_tightness.py`` (about a minute; writes
``docs/figures/bound_tightness.{json,png}``) or ``--quick`` (seconds).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from torch import Tensor

from iresflow.nn.attention import L2MultiheadAttention, lipschitz_bound
from iresflow.nn.bounds import phi_inv
from iresflow.nn.diagnostics import empirical_lipschitz, jacobian_norm

NAME = "bound_tightness"
DTYPE = torch.float64
# check_*: the library's dense-Jacobian search (empirical_lipschitz) from the first starts, run
# for N <= check_max_n with the budget of docs/math.md#experiments (E1; 8 starts x 400 steps) in the
# full run.
FULL = {"lengths": [10, 30, 100, 300, 1000], "inits": 50, "steps": 3000,
        "check_max_n": 30, "check_inits": 8, "check_steps": 400}
QUICK = {"lengths": [10, 30, 100], "inits": 4, "steps": 150,
         "check_max_n": 10, "check_inits": 2, "check_steps": 30}
TOP = 5


def row_jacobian_norm(x: Tensor) -> Tensor:
    r"""Closed-form :math:`\sum_k |J_{0k}(x)|` of unit-weight L2 attention with :math:`H = D = 1`.

    Args:
        x: Scalar token sequences, shape ``(K, N)``.

    Returns:
        Absolute row sum of row 0 of :math:`J_F(x)`, shape ``(K,)``.
    """
    diff = x[:, :1] - x  # x_0 - x_k
    p = torch.softmax(-(diff**2), dim=1)
    mean = (p * x).sum(dim=1, keepdim=True)
    var = (p * x * x).sum(dim=1) - mean[:, 0] ** 2
    row = p * (1 + 2 * diff * (x - mean))
    row = torch.cat([(row[:, :1] + 2 * var[:, None]), row[:, 1:]], dim=1)
    return row.abs().sum(dim=1)


def unit_attention(dtype: torch.dtype = DTYPE) -> L2MultiheadAttention:
    """L2-MHA with ``H = D = 1`` and all weights set to 1 (Kim App. H)."""
    attn = L2MultiheadAttention(dim=1, heads=1).to(dtype)
    with torch.no_grad():
        for w in attn.parameters():
            w.fill_(1.0)
    return attn


def autograd_row_norm(attn: L2MultiheadAttention, x: Tensor) -> Tensor:
    r"""``sum_k |dF_0 / dx_k|`` by one vector-Jacobian product through the library module.

    Args:
        attn: The attention module, ``D = 1``.
        x: One sequence, shape ``(N,)``.

    Returns:
        0-dim tensor.
    """
    x = x.detach().clone().requires_grad_(True)
    out = attn(x.reshape(1, -1, 1))
    (row,) = torch.autograd.grad(out[0, 0, 0], x)
    return row.abs().sum()


def random_starts(inits: int, length: int, generator: torch.Generator) -> Tensor:
    r"""Kim App. H starts: :math:`x_j \sim U[-c, c]` with :math:`c \sim U[0, 10]` per start.

    Returns:
        Shape ``(K, N)``, float64.
    """
    scale = 10 * torch.rand(inits, 1, generator=generator, dtype=DTYPE)
    return (2 * torch.rand(inits, length, generator=generator, dtype=DTYPE) - 1) * scale


def maximise(starts: Tensor, steps: int) -> tuple[Tensor, Tensor]:
    """Adam ascent (learning rate 0.1) of :func:`row_jacobian_norm` from every start.

    Args:
        starts: Initial sequences, shape ``(K, N)``.
        steps: Number of Adam steps.

    Returns:
        Best value seen per start ``(K,)`` and the input where it was seen ``(K, N)``.
    """
    x = starts.clone().requires_grad_(True)
    optimiser = torch.optim.Adam([x], lr=0.1)
    best = torch.full(starts.shape[:1], -math.inf, dtype=DTYPE)
    best_x = starts.clone()
    for step in range(steps + 1):
        value = row_jacobian_norm(x)
        with torch.no_grad():
            better = value > best
            best = torch.where(better, value, best)
            best_x[better] = x[better]
        if step == steps:
            break
        optimiser.zero_grad()
        (-value.sum()).backward()
        optimiser.step()
    return best, best_x


def fit_log_slope(lengths: list[int], values: list[float]) -> tuple[float, float]:
    """Least-squares fit ``value = intercept + slope * ln N``; returns ``(slope, intercept)``."""
    design = torch.stack([torch.ones(len(lengths)), torch.log(torch.tensor(lengths))], 1).to(DTYPE)
    solution = torch.linalg.lstsq(design, torch.tensor(values, dtype=DTYPE)[:, None]).solution
    return float(solution[1, 0]), float(solution[0, 0])


def run(settings: dict, seed: int) -> dict:
    """Upper and optimised lower bounds for every ``N``; see the module docstring."""
    generator = torch.Generator().manual_seed(seed)
    attn = unit_attention()
    rows = []
    for length in settings["lengths"]:
        start = time.perf_counter()
        starts = random_starts(settings["inits"], length, generator)
        best, best_x = maximise(starts, settings["steps"])
        order = torch.argsort(best, descending=True)
        top = best[order[:TOP]]
        lower = autograd_row_norm(attn, best_x[order[0]])
        upper = float(lipschitz_bound(attn, length, p="inf").detach())
        row = {
            "n": length,
            "upper_bound": upper,
            "four_phi_inv_plus_one": 4 * phi_inv(float(length - 1)) + 1,
            "lower_bound": float(lower),
            "top_lower_bounds": [float(v) for v in top],
            "ratio": float(lower) / upper,
            "closed_form_minus_autograd": float(top[0] - lower),
        }
        if length <= settings["check_max_n"]:
            # Cross-check with the library's dense-Jacobian tools (small N only).
            row["dense_jacobian_norm"] = float(
                jacobian_norm(attn, best_x[order[0]].reshape(1, length, 1), "inf").detach()
            )
            k = settings["check_inits"]
            search = empirical_lipschitz(attn, starts[:k].reshape(k, length, 1), "inf",
                                         steps=settings["check_steps"], lr=0.1)
            row["library_search"] = float(search.value)
        row["seconds"] = time.perf_counter() - start
        rows.append(row)
    n = [r["n"] for r in rows]
    slope_upper, intercept_upper = fit_log_slope(n, [r["upper_bound"] for r in rows])
    slope_lower, intercept_lower = fit_log_slope(n, [r["lower_bound"] for r in rows])
    return {
        "experiment": NAME,
        "config": {**settings, "lr": 0.1, "seed": seed, "dtype": "float64", "heads": 1, "dim": 1,
                   "weights": 1.0},
        "results": rows,
        "slope_upper": slope_upper,
        "slope_lower": slope_lower,
        "intercept_upper": intercept_upper,
        "intercept_lower": intercept_lower,
        "slope_ratio": slope_lower / slope_upper,
    }


def plot(result: dict, path: Path) -> None:
    """Upper and lower bounds against ``N`` (log x-axis), and their ratio."""
    rows = result["results"]
    n = [r["n"] for r in rows]
    grid = torch.logspace(math.log10(min(n)), math.log10(max(n)), 200, dtype=DTYPE)
    curve = [4 * phi_inv(float(v) - 1) + 1 for v in grid]
    figure = Figure(figsize=(10, 4), layout="constrained")
    FigureCanvasAgg(figure)
    bounds, ratio = figure.subplots(1, 2)
    bounds.plot(grid.tolist(), curve, "-", color="tab:red", label=r"upper: $4\varphi^{-1}(N-1)+1$")
    bounds.plot(n, [r["upper_bound"] for r in rows], "s", color="tab:red")
    for r in rows:
        bounds.plot([r["n"]] * len(r["top_lower_bounds"]), r["top_lower_bounds"], ".",
                    color="tab:blue", alpha=0.4)
    bounds.plot(n, [r["lower_bound"] for r in rows], "o-", color="tab:blue",
                label=r"lower: best $\|J_F(X)\|_\infty$ found")
    bounds.set(xscale="log", xlabel="sequence length N", ylabel="Lipschitz constant (inf-norm)",
               title=f"L2-MHA, H = D = 1, unit weights; slopes in ln N: upper "
                     f"{result['slope_upper']:.2f}, lower {result['slope_lower']:.2f}")
    bounds.title.set_fontsize(9)
    bounds.legend()
    ratio.plot(n, [r["ratio"] for r in rows], "o-", color="tab:purple")
    ratio.set(xscale="log", xlabel="sequence length N", ylabel="lower / upper", ylim=(0, 1),
              title="ratio of lower to upper bound")
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    """Run the experiment, write ``bound_tightness.json`` and ``.png`` into ``--out``.

    Returns:
        The result dictionary written to the JSON file.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/figures"))
    parser.add_argument("--quick", action="store_true", help="tiny run (seconds)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    start = time.perf_counter()
    result = run(settings, args.seed)
    result["quick"] = args.quick
    result["seconds"] = time.perf_counter() - start
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{NAME}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / f"{NAME}.png")
    for r in result["results"]:
        print(f"N={r['n']:5d}  upper {r['upper_bound']:.4f}  lower {r['lower_bound']:.4f}  "
              f"ratio {r['ratio']:.3f}")
    print(f"slope in ln N: upper {result['slope_upper']:.3f}, lower {result['slope_lower']:.3f}")
    return result


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
