r"""Deep attention stacks at a fixed learning rate (Kim App. M, Dasoulas Sec. 6;
docs/math.md#experiments (E3), #lipschitznorm (F10)).

A stack of ``L`` residual attention blocks :math:`h \leftarrow h + \mathrm{attn}_l(h)` between a
linear embedding and a linear read-out is trained with Adam at a fixed learning rate (no warm-up,
no gradient clipping) for four choices of the attention:

* ``dot-product``: :class:`~iresflow.nn.attention.DotProductMultiheadAttention` (not Lipschitz);
* ``dot-product + LipschitzNorm``: the same with ``lipschitz_norm="transformer"``, :math:`\alpha=1`
  (docs/math.md#lipschitznorm (F6));
* ``L2 (tied)``: :class:`~iresflow.nn.attention.L2MultiheadAttention`, raw (Lipschitz, not
  normalised);
* ``contractive L2``: :class:`~iresflow.nn.attention.ContractiveL2MultiheadAttention`,
  :math:`c = 0.9` (each block :math:`0.9`-Lipschitz in the :math:`\infty`-norm, so invertible).

The blocks hold attention only: no position-wise MLP and no normalisation layer, so the attention
branch alone decides whether the stack stays trainable. For a given seed all models start from the
same random state and see the same batches; the default run uses ``L = 24``, 250 steps, learning
rates :math:`3\cdot10^{-3}` and :math:`3\cdot10^{-2}` and seeds 0 and 1.

Task (in-context cluster denoising): every sequence has ``N = 16`` tokens in :math:`\mathbb R^4`;
three centres :math:`\mu_k \sim \mathcal N(0, I)` are drawn per sequence, each token picks one at
random and is observed as :math:`x_i = \mu_{z_i} + 0.5\,\varepsilon_i`; the target of token
:math:`i` is its centre :math:`\mu_{z_i}`. The mean squared error of the identity map is
:math:`0.25`; averaging each token with the tokens of its own cluster (labels known) gives a
reference that only attention over the sequence can approach.

Logged: the training loss, the total gradient norm and the largest gradient norm of one block's
parameters at every step; the gradient norm of every block and the largest activation
:math:`\max|h_L|` every ``log_every`` steps; the loss on a fixed evaluation batch at the end. A
run counts as exploded when its loss becomes non-finite or ends above ten times the best loss it
had reached.

Run: ``python examples/depth_stability.py`` (a few minutes; writes
``docs/figures/depth_stability.{json,png}``) or ``--quick`` (seconds).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from torch import Tensor, nn

from iresflow.nn.attention import (
    ContractiveL2MultiheadAttention,
    DotProductMultiheadAttention,
    L2MultiheadAttention,
)

NAME = "depth_stability"
FULL = {"layers": 24, "steps": 250, "lrs": [3e-3, 3e-2], "log_every": 10, "seeds": 2}
QUICK = {"layers": 6, "steps": 12, "lrs": [3e-3, 3e-2], "log_every": 4, "seeds": 1}
LENGTH, FEATURES, CLUSTERS, NOISE = 16, 4, 3, 0.5
DIM, HEADS, BATCH, EVAL_BATCH = 16, 2, 32, 256
EXPLOSION_FACTOR = 10.0

BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "dot-product": lambda: DotProductMultiheadAttention(DIM, HEADS),
    "dot-product + LipschitzNorm": lambda: DotProductMultiheadAttention(
        DIM, HEADS, lipschitz_norm="transformer", alpha=1.0
    ),
    "L2 (tied)": lambda: L2MultiheadAttention(DIM, HEADS),
    "contractive L2": lambda: ContractiveL2MultiheadAttention(DIM, HEADS, coeff=0.9),
}


def cluster_batch(batch: int, generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """Sample the cluster-denoising task.

    Args:
        batch: Number of sequences ``B``.
        generator: Source of randomness.

    Returns:
        Noisy tokens ``(B, N, 4)``, their centres ``(B, N, 4)`` and cluster labels ``(B, N)``.
    """
    centres = torch.randn(batch, CLUSTERS, FEATURES, generator=generator)
    labels = torch.randint(CLUSTERS, (batch, LENGTH), generator=generator)
    target = centres[torch.arange(batch)[:, None], labels]
    noisy = target + NOISE * torch.randn(batch, LENGTH, FEATURES, generator=generator)
    return noisy, target, labels


def same_cluster_mean(x: Tensor, labels: Tensor) -> Tensor:
    """Reference predictor: mean of the tokens that share a token's label, ``(B, N, 4)``."""
    same = (labels[:, :, None] == labels[:, None, :]).to(x.dtype)  # (B, N, N)
    return same @ x / same.sum(dim=-1, keepdim=True)


class AttentionStack(nn.Module):
    """Embedding, ``L`` residual attention blocks, read-out.

    Args:
        layers: Number of blocks ``L``.
        build: Factory of one attention module ``(B, N, D) -> (B, N, D)``.
    """

    def __init__(self, layers: int, build: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.embed = nn.Linear(FEATURES, DIM)
        self.blocks = nn.ModuleList(build() for _ in range(layers))
        self.readout = nn.Linear(DIM, FEATURES)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Map tokens ``(B, N, 4)`` to predictions ``(B, N, 4)``; also return the last hidden
        state ``(B, N, D)``."""
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.readout(h), h


def train(name: str, layers: int, lr: float, steps: int, log_every: int, seed: int) -> dict:
    """Train one stack; see the module docstring for what is logged."""
    torch.manual_seed(seed)  # parameter initialisation, identical for every learning rate
    model = AttentionStack(layers, BUILDERS[name])
    optimiser = torch.optim.Adam(model.parameters(), lr=lr)
    data = torch.Generator().manual_seed(seed + 1)
    losses: list[float] = []
    grad_norms: list[float] = []
    block_norms: list[float] = []
    logged: list[dict] = []
    diverged_at = None
    for step in range(steps):
        x, target, _ = cluster_batch(BATCH, data)
        prediction, hidden = model(x)
        loss = (prediction - target).pow(2).mean()
        optimiser.zero_grad()
        loss.backward()
        layer_norms = torch.stack([
            torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in block.parameters()]))
            for block in model.blocks
        ])
        total = torch.linalg.vector_norm(
            torch.stack([p.grad.norm() for p in model.parameters()])
        )
        losses.append(_short(loss.detach()))
        grad_norms.append(_short(total))
        block_norms.append(_short(layer_norms.max()))
        finite = math.isfinite(losses[-1]) and math.isfinite(grad_norms[-1])
        if step % log_every == 0 or step == steps - 1 or not finite:
            logged.append({"step": step, "layer_grad_norms": [_short(v) for v in layer_norms],
                           "max_abs_hidden": _short(hidden.detach().abs().amax())})
        if not finite:
            diverged_at = step
            break
        optimiser.step()

    x, target, _ = evaluation_batch(seed)
    with torch.no_grad():
        eval_loss = float((model(x)[0] - target).pow(2).mean())
    tail = losses[-max(1, len(losses) // 10):]
    final_loss = sum(tail) / len(tail)
    best_loss = min(losses)
    exploded = diverged_at is not None or not final_loss <= EXPLOSION_FACTOR * best_loss
    return {
        "model": name,
        "lr": lr,
        "seed": seed,
        "loss": losses,
        "grad_norm": grad_norms,
        "max_block_grad_norm": block_norms,
        "logged": logged,
        "diverged_at_step": diverged_at,
        "final_loss": final_loss,
        "best_loss": best_loss,
        "eval_loss": eval_loss,
        "max_grad_norm": max(grad_norms),
        "initial_grad_norm": grad_norms[0],
        "max_block_grad_norm_overall": max(block_norms),
        "initial_max_block_grad_norm": block_norms[0],
        "max_abs_hidden": max(row["max_abs_hidden"] for row in logged),
        "exploded": exploded,
    }


def _short(value: Tensor | float) -> float:
    """A float with 4 significant digits (keeps the JSON small)."""
    return float(f"{float(value):.4g}")


def evaluation_batch(seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """The fixed evaluation batch of a seed, drawn from its own random stream."""
    return cluster_batch(EVAL_BATCH, torch.Generator().manual_seed(10_000 + seed))


def references(seed: int) -> dict:
    """Losses of the identity map and of the same-cluster mean on the evaluation batch."""
    x, target, labels = evaluation_batch(seed)
    return {
        "identity": float((x - target).pow(2).mean()),
        "same_cluster_mean": float((same_cluster_mean(x, labels) - target).pow(2).mean()),
    }


def run(settings: dict) -> dict:
    """Every model at every learning rate and seed."""
    runs = []
    seeds = settings["seeds"]
    for lr in settings["lrs"]:
        for seed in range(seeds):
            for name in BUILDERS:
                start = time.perf_counter()
                row = train(name, settings["layers"], lr, settings["steps"],
                            settings["log_every"], seed)
                row["seconds"] = time.perf_counter() - start
                runs.append(row)
    return {
        "experiment": NAME,
        "config": {**settings, "length": LENGTH, "features": FEATURES,
                   "clusters": CLUSTERS, "noise": NOISE, "dim": DIM, "heads": HEADS,
                   "batch": BATCH, "eval_batch": EVAL_BATCH, "optimiser": "Adam",
                   "explosion_factor": EXPLOSION_FACTOR, "mlp": False, "normalisation": None},
        "references": [references(seed) for seed in range(seeds)],
        "runs": runs,
    }


def plot(result: dict, path: Path) -> None:
    """Loss and gradient-norm curves per learning rate (seed 0), and per-layer gradient norms."""
    lrs = result["config"]["lrs"]
    names = list(BUILDERS)
    colours = dict(zip(names, ["tab:orange", "tab:red", "tab:blue", "tab:green"], strict=True))
    runs = {(r["model"], r["lr"]): r for r in result["runs"] if r["seed"] == 0}
    figure = Figure(figsize=(4 * len(names), 3.2 * (1 + len(lrs))), layout="constrained")
    FigureCanvasAgg(figure)
    top, bottom = figure.subfigures(2, 1, height_ratios=[1, len(lrs)])
    curves = top.subplots(1, 2 * len(lrs), squeeze=False)[0]
    for i, lr in enumerate(lrs):
        loss_ax, grad_ax = curves[2 * i], curves[2 * i + 1]
        for name in names:
            r = runs[(name, lr)]
            loss_ax.plot(r["loss"], color=colours[name], label=name, lw=1)
            grad_ax.plot(r["max_block_grad_norm"], color=colours[name], lw=1)
        for key, style in (("identity", ":"), ("same_cluster_mean", "--")):
            loss_ax.axhline(result["references"][0][key], color="gray", ls=style, lw=1,
                            label=key.replace("_", " "))
        loss_ax.set(yscale="log", xlabel="step", title=f"training loss, lr = {lr:g}")
        grad_ax.set(yscale="log", xlabel="step",
                    title=f"largest block gradient norm, lr = {lr:g}")
    curves[0].legend(fontsize=8)
    layer_axes = bottom.subplots(len(lrs), len(names), squeeze=False, sharey="row")
    for i, lr in enumerate(lrs):
        for j, name in enumerate(names):
            ax = layer_axes[i, j]
            logged = runs[(name, lr)]["logged"]
            finite = [k for k, row in enumerate(logged)
                      if all(math.isfinite(v) for v in row["layer_grad_norms"])]
            picks = sorted({0, finite[len(finite) // 3], finite[2 * len(finite) // 3], finite[-1]})
            for k in picks:
                norms = logged[k]["layer_grad_norms"]
                ax.plot(range(1, len(norms) + 1), norms, "o-", ms=2, lw=1,
                        label=f"step {logged[k]['step']}")
            ax.set(yscale="log", xlabel="layer", title=f"{name}, lr = {lr:g}")
            ax.title.set_fontsize(9)
            ax.legend(fontsize=7)
        layer_axes[i, 0].set_ylabel("gradient norm of the block's parameters")
    figure.suptitle("seed 0")
    figure.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> dict:
    """Run the experiment, write ``depth_stability.json`` and ``.png`` into ``--out``.

    Returns:
        The result dictionary written to the JSON file.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/figures"))
    parser.add_argument("--quick", action="store_true", help="6 layers, a few steps")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    start = time.perf_counter()
    result = run(settings)
    result["quick"] = args.quick
    result["seconds"] = time.perf_counter() - start
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{NAME}.json").write_text(json.dumps(result) + "\n")
    plot(result, args.out / f"{NAME}.png")
    for r in result["runs"]:
        status = "EXPLODED" if r["exploded"] else "ok"
        print(f"lr={r['lr']:g} seed={r['seed']} {r['model']:>28s}: final loss {r['final_loss']:.3g}"
              f", eval {r['eval_loss']:.3g}, max grad norm {r['max_grad_norm']:.3g}  {status}")
    return result


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
