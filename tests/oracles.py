"""Independent oracles and reference branches shared by the test suite.

Oracles use only plain autograd (``torch.autograd.functional.jacobian``, one sample at a time),
``slogdet`` and finite differences, never iresflow's engines. Reference branches are tiny
:class:`~iresflow.nn.base.LipschitzBranch` es with exactly known Lipschitz certificates.
"""

from __future__ import annotations

import collections
import math
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.nn.utils.parametrizations import spectral_norm

import iresflow
from iresflow.nn.base import LipschitzBranch

PACKAGE = Path(iresflow.__file__).resolve().parent
#: Tensor methods that read a value on the host (a device synchronisation on accelerators).
HOST_READS = ("__bool__", "item", "tolist", "__int__", "__float__", "__index__")

SequenceMap = Callable[[Tensor, "Tensor | None"], Tensor]


def jacobian(
    f: SequenceMap, x: Tensor, mask: Tensor | None = None, *, create_graph: bool = False
) -> Tensor:
    """Dense Jacobian of a ``(B, N, D) -> (B, N, D)`` map, per sample.

    Args:
        f: Called as ``f(x_b, mask_b)`` with ``x_b`` of shape ``(1, N, D)`` and ``mask_b`` of
            shape ``(1, N)`` (or ``None``).
        x: Inputs ``(B, N, D)``.
        mask: Optional padding mask ``(B, N)``.
        create_graph: Make the Jacobian differentiable (for gradient oracles).

    Returns:
        ``(B, N D, N D)``: entry ``[b, i, j]`` is ``d vec(f(x_b))_i / d vec(x_b)_j`` in row-major
        ``(N, D)`` order.
    """
    batch, length, features = x.shape
    size = length * features
    rows = []
    for b in range(batch):
        mb = None if mask is None else mask[b : b + 1]
        jac = torch.autograd.functional.jacobian(
            lambda t, mb=mb: f(t, mb), x[b : b + 1], create_graph=create_graph
        )
        rows.append(jac.reshape(size, size))
    return torch.stack(rows)


def real_indices(mask: Tensor | None, b: int, length: int, features: int) -> Tensor:
    """Flat ``vec`` indices of the real tokens of sample ``b`` (all indices without a mask)."""
    tokens = torch.ones(length, dtype=torch.bool) if mask is None else mask[b].cpu()
    return (tokens[:, None].expand(length, features)).reshape(-1).nonzero().flatten()


def jacobian_logdet(
    f: SequenceMap, x: Tensor, mask: Tensor | None = None, *, create_graph: bool = False
) -> Tensor:
    """``log|det|`` of the Jacobian of ``f`` restricted to the real tokens, per sample.

    For a residual branch ``g`` pass ``f = lambda x, m: x + g(x, m)``. Padded rows and columns
    are removed before ``slogdet``, so the oracle does not rely on the padding contract.

    Args:
        f: Map as in :func:`jacobian`.
        x: Inputs ``(B, N, D)``.
        mask: Optional padding mask ``(B, N)``.
        create_graph: Make the result differentiable.

    Returns:
        ``(B,)`` log-absolute-determinants.

    Raises:
        AssertionError: a determinant is not positive (not a contractive residual map).
    """
    batch, length, features = x.shape
    jac = jacobian(f, x, mask, create_graph=create_graph)
    out = []
    for b in range(batch):
        idx = real_indices(mask, b, length, features).to(x.device)
        sign, logabsdet = torch.linalg.slogdet(jac[b][idx][:, idx])
        assert sign > 0, "non-positive Jacobian determinant"
        out.append(logabsdet)
    return torch.stack(out)


def residual_map(branch: SequenceMap) -> SequenceMap:
    """The residual map :math:`x + g(x)` of a branch ``g``, for :func:`jacobian_logdet`."""
    return lambda x, mask: x + branch(x, mask)


def padded_batch(device: torch.device, scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """Three float64 sequences ``(3, 4, 3)`` with entries ``scale * N(0, 1)`` and a mask padding
    the end of one sequence and the middle of another."""
    x = scale * torch.randn(3, 4, 3, dtype=torch.float64, device=device)
    mask = torch.tensor(
        [[True, True, True, True], [True, True, False, False], [True, False, True, True]],
        device=device,
    )
    return x, mask


def finite_difference_grad(
    fn: Callable[[], Tensor], tensors: Sequence[Tensor], eps: float = 1e-6
) -> list[Tensor]:
    """Central finite differences of a scalar function with respect to tensors it reads.

    Every entry of every tensor is perturbed in place (under ``torch.no_grad``) and restored.

    Args:
        fn: Zero-argument function returning a scalar tensor (reads ``tensors``).
        tensors: Leaf tensors or parameters.
        eps: Step size.

    Returns:
        One gradient tensor per input, same shapes.
    """
    grads = []
    for t in tensors:
        grad = torch.zeros_like(t)
        flat, gflat = t.data.view(-1), grad.view(-1)
        for i in range(flat.numel()):
            orig = flat[i].item()
            with torch.no_grad():
                flat[i] = orig + eps
                plus = fn().item()
                flat[i] = orig - eps
                minus = fn().item()
                flat[i] = orig
            gflat[i] = (plus - minus) / (2 * eps)
        grads.append(grad)
    return grads


def _masked(out: Tensor, mask: Tensor | None) -> Tensor:
    return out if mask is None else out * mask.unsqueeze(-1).to(out.dtype)


class TanhMLPBranch(LipschitzBranch):
    r"""Position-wise :math:`g(x_n) = W_2 \tanh(W_1 (x_n + e_n) + b_1) + b_2`.

    Scaled at construction so that :math:`\|W_1\|_2 \|W_2\|_2 =` ``lipschitz``, an exact
    2-norm certificate (tanh is 1-Lipschitz). With ``positional=True`` a fixed random table
    :math:`e` (a buffer of ``max_len`` rows) is added inside the branch, making the map
    position-dependent while staying position-wise.
    """

    position_wise = True
    norm = "2"

    def __init__(
        self,
        features: int,
        hidden: int,
        lipschitz: float,
        *,
        positional: bool = False,
        max_len: int = 8,
        dtype: torch.dtype = torch.float64,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        w1 = torch.randn(hidden, features, **kw)
        w2 = torch.randn(features, hidden, **kw)
        w1 = w1 / torch.linalg.matrix_norm(w1, 2)
        w2 = w2 * lipschitz / torch.linalg.matrix_norm(w2, 2)
        self.w1, self.w2 = nn.Parameter(w1), nn.Parameter(w2)
        self.b1 = nn.Parameter(0.5 * torch.randn(hidden, **kw))
        self.b2 = nn.Parameter(0.5 * torch.randn(features, **kw))
        self.positional = positional
        if positional:
            self.register_buffer("table", torch.randn(max_len, features, **kw))

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        if self.positional:
            x = x + self.table[: x.shape[1]]
        out = torch.tanh(x @ self.w1.T + self.b1) @ self.w2.T + self.b2
        return _masked(out, mask)

    def lipschitz_constant(self, seq_len: int | None = None) -> Tensor:
        with torch.no_grad():
            return torch.linalg.matrix_norm(self.w1, 2) * torch.linalg.matrix_norm(self.w2, 2)


class MixingBranch(LipschitzBranch):
    r"""Position-mixing :math:`g(X) = \tanh(A X W^\top + b)` with :math:`A = \mathrm{softmax}(S)`.

    :math:`A` (row-stochastic, learned logits :math:`S`) mixes tokens; with a mask its columns at
    padded tokens are zero and padded outputs are zeroed. :math:`\|A \otimes W\|_\infty =
    \|W\|_\infty` (max abs row sum), scaled to ``lipschitz`` at construction: an exact
    :math:`\infty`-norm certificate.
    """

    position_wise = False
    norm = "inf"

    def __init__(
        self,
        features: int,
        lipschitz: float,
        *,
        max_len: int = 8,
        dtype: torch.dtype = torch.float64,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        # a dominant negative diagonal keeps the log-determinant far from 0
        w = 0.5 * torch.randn(features, features, **kw) - torch.eye(features, **kw)
        self.w = nn.Parameter(w * lipschitz / w.abs().sum(1).max())
        self.b = nn.Parameter(0.2 * torch.randn(features, **kw))
        self.logits = nn.Parameter(torch.randn(max_len, max_len, **kw))

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        n = x.shape[1]
        logits = self.logits[:n, :n]
        if mask is not None:
            logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
        out = torch.tanh(torch.softmax(logits, -1) @ x @ self.w.T + self.b)
        return _masked(out, mask)

    def lipschitz_constant(self, seq_len: int | None = None) -> Tensor:
        with torch.no_grad():
            return self.w.abs().sum(1).max()


class SpectralNormBranch(LipschitzBranch):
    r"""Position-wise :math:`g(x_n) = c \tanh(\tilde W x_n + b)` with torch's power-iteration
    spectral normalisation :math:`\tilde W = W / \hat\sigma`.

    Stateful: every training forward advances the power iteration (buffers ``_u``, ``_v``),
    which starts from random, unconverged vectors, so consecutive training forwards give
    different maps.
    """

    position_wise = True
    norm = "2"

    def __init__(
        self,
        features: int,
        coeff: float,
        *,
        dtype: torch.dtype = torch.float64,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.coeff = coeff
        self.linear = spectral_norm(nn.Linear(features, features, dtype=dtype, device=device))
        sn = self.linear.parametrizations.weight[0]
        with torch.no_grad():
            sn._u.copy_(nn.functional.normalize(torch.randn_like(sn._u), dim=0))
            sn._v.copy_(nn.functional.normalize(torch.randn_like(sn._v), dim=0))

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        return _masked(self.coeff * torch.tanh(self.linear(x)), mask)

    def lipschitz_constant(self, seq_len: int | None = None) -> Tensor:
        """``c * sigma(W) / sigma_hat`` for the current power-iteration state."""
        sn = self.linear.parametrizations.weight[0]
        with torch.no_grad():
            weight = self.linear.parametrizations.weight.original
            sigma_hat = torch.dot(sn._u, weight @ sn._v)
            return self.coeff * torch.linalg.matrix_norm(weight, 2) / sigma_hat


class ScaleBranch(LipschitzBranch):
    r"""Linear position-wise :math:`g(x) = c\,x` with a learnable scalar :math:`c`, :math:`|c| < 1`.

    Closed forms: :math:`J = c I`, :math:`\log\det(I + J) = d \log(1 + c)` with :math:`d` the
    number of real entries, and with Rademacher probes :math:`v^\top J^k v = d\,c^k` exactly.
    """

    position_wise = True
    norm = "2"

    def __init__(
        self, c: float, *, dtype: torch.dtype = torch.float64, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__()
        self.c = nn.Parameter(torch.tensor(c, dtype=dtype, device=device))

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        return _masked(self.c * x, mask)

    def lipschitz_constant(self, seq_len: int | None = None) -> Tensor:
        return self.c.detach().abs()


def count_host_reads(fn: Callable[[], object]) -> collections.Counter:
    """Count the host reads of tensor values made from iresflow code while ``fn`` runs.

    Patches the tensor methods that read a value on the host (a device synchronisation on
    accelerators) and counts the calls whose Python stack holds a frame of the iresflow package,
    keyed by method and the innermost such frame.
    """
    counts: collections.Counter = collections.Counter()
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counting(name):
        original = originals[name]

        def read(self, *args, **kwargs):
            frames = [f for f in traceback.extract_stack()[:-1]
                      if Path(f.filename).resolve().is_relative_to(PACKAGE)]
            if frames:
                counts[f"{name} at {Path(frames[-1].filename).name}:{frames[-1].lineno}"] += 1
            return original(self, *args, **kwargs)
        return read

    try:
        for name in HOST_READS:
            setattr(torch.Tensor, name, counting(name))
        fn()
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
    return counts


def assert_close_runs(a: Path, b: Path, tolerance: float) -> None:
    """Two training runs ended alike: same epoch, parameters and per-epoch metrics.

    Parameters and metrics agree within ``tolerance`` (absolute and relative). The inverse
    check's iteration count is an integer threshold crossing: runs whose parameters differ by
    rounding (``tolerance > 0``) may stop one iteration apart; equal runs (``tolerance = 0``)
    must not.
    """
    from iresflow.train.checkpoint import load_checkpoint
    from iresflow.train.paths import RunPaths

    first, second = load_checkpoint(RunPaths(a).last), load_checkpoint(RunPaths(b).last)
    assert first["epoch"] == second["epoch"]
    for name, value in first["model"].items():
        torch.testing.assert_close(second["model"][name], value, rtol=tolerance, atol=tolerance)
    for row, other in zip(first["history"], second["history"], strict=True):
        for key, value in row.items():
            if key == "train_seconds":
                continue
            if key == "inverse_iterations":
                assert abs(other[key] - value) <= (1 if tolerance > 0 else 0), key
            else:
                assert math.isclose(other[key], value, rel_tol=tolerance, abs_tol=tolerance), key


def l2_attention_direct(attn: nn.Module, x: Tensor, mask: Tensor | None = None) -> Tensor:
    """L2 multi-head attention literally (Kim Eq. (8), docs/math.md#l2-attention): N x N x d_h
    differences, A_h, W^V, W^O, and the relative bias b_h(clip(j - i)) entry by entry
    (docs/math.md#relative-bias) when ``attn.relative_bias`` is set."""
    b, n, d = x.shape
    dh = d // attn.heads
    outs = []
    for h in range(attn.heads):
        wq = attn.w_query[:, h * dh : (h + 1) * dh]
        wv = attn.w_value[:, h * dh : (h + 1) * dh]
        q = x @ wq
        diff = q[:, :, None, :] - q[:, None, :, :]
        logits = -(diff**2).sum(-1) / math.sqrt(dh)
        if attn.relative_bias is not None:
            w = attn.max_offset
            bias = [[attn.relative_bias[h, min(max(j - i, -w), w) + w] for j in range(n)]
                    for i in range(n)]
            logits = logits + torch.stack([torch.stack(row) for row in bias])
        if mask is not None:
            logits = logits.masked_fill(~mask[:, None, :], -math.inf)
        p = torch.softmax(logits, dim=-1)
        a = wq @ wq.T / math.sqrt(dh)
        outs.append(p @ x @ a @ wv)
    out = torch.cat(outs, dim=-1) @ attn.w_out
    if mask is not None:
        out = out * mask[..., None]
    return out


def key_mass(table: Tensor, real: Sequence[bool], window: int) -> list[float]:
    """R_h = max over real queries i of sum over real keys k != i of exp(b_h(k - i) - b_h(0))
    (docs/math.md#relative-bias), one head at a time in Python floats."""
    positions = [i for i, r in enumerate(real) if r]
    masses = []
    for row in table.tolist():
        def b(offset: int, row: list[float] = row) -> float:
            return row[min(max(offset, -window), window) + window]
        masses.append(max(
            sum(math.exp(b(k - i) - b(0)) for k in positions if k != i) for i in positions
        ))
    return masses


def kim_inf_bound(attn: nn.Module, spread: float) -> float:
    """Kim's Theorem 3.2 infinity-bound (docs/math.md#l2-bounds) with phi^{-1}(N - 1) replaced
    by ``spread``, from the glossary norms of every head's weight blocks."""
    mn, inf = torch.linalg.matrix_norm, math.inf
    dh = attn.dim // attn.heads
    blocks = [(attn.w_query[:, h * dh : (h + 1) * dh], attn.w_value[:, h * dh : (h + 1) * dh])
              for h in range(attn.heads)]
    q_inf = max(float(mn(q, inf) * mn(q.T, inf)) for q, _ in blocks)
    v_inf = max(float(mn(v.T, inf)) for _, v in blocks)
    return (4 * spread + 1 / math.sqrt(dh)) * float(mn(attn.w_out.T, inf)) * q_inf * v_inf


def heads_inf_bound(attn: nn.Module, spreads: Sequence[float]) -> float:
    """docs/math.md#l2-bounds-heads one output column and one head at a time: the maximum over
    columns c of the sum over heads of ||(W^{Q,h} G_h)_{:,c}||_1 / sqrt(d_h)
    + 4 spreads[h] ||W^{Q,h T}||_inf ||(G_h)_{:,c}||_1, G_h = W^{Q,h T} W^{V,h} W^{O,h}."""
    dh = attn.dim // attn.heads
    columns = []
    for c in range(attn.dim):
        total = 0.0
        for h in range(attn.heads):
            q = attn.w_query[:, h * dh : (h + 1) * dh]
            g = q.T @ attn.w_value[:, h * dh : (h + 1) * dh] @ attn.w_out[h * dh : (h + 1) * dh, c]
            total += float((q @ g).abs().sum()) / math.sqrt(dh)
            total += 4 * spreads[h] * float(torch.linalg.matrix_norm(q.T, math.inf)) * float(
                g.abs().sum()
            )
        columns.append(total)
    return max(columns)
