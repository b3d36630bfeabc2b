"""Causal L2 attention and causal relative mixing, and their certificates
(docs/math.md#causal-attention).

Oracles: the unmasked module on each prefix (row i of the causal map is row i of the unmasked map
of the frames up to i), autograd Jacobians, and the infinity-norm of the Jacobian maximised over
the inputs by Adam against the certificate.
"""

from __future__ import annotations

import pytest
import torch

from iresflow.cli import main
from iresflow.models.config import ConfigError
from iresflow.models.residual_flow import ResidualSequenceFlow
from iresflow.nn._heads import causal_keys
from iresflow.nn.attention import (
    ContractiveL2MultiheadAttention,
    L2MultiheadAttention,
    lipschitz_bound,
)
from iresflow.nn.bounds import causal_l2_attention_bound
from iresflow.nn.diagnostics import empirical_lipschitz
from iresflow.nn.relative import RelativeMixingBranch

F64 = torch.float64
#: Sequence 1: trailing padding; sequence 2: gaps, one at frame 0.
MASK = [[True] * 6, [True, True, True, False, False, False], [False, True, False, True, True, True]]


def attention(dim, heads, window, *, causal, scale=1.0, seed=0):
    """L2 attention with N(0, scale^2) weights and a relative bias in [-3, 3] (none without a
    window), frozen."""
    generator = torch.Generator().manual_seed(seed)
    attn = L2MultiheadAttention(dim, heads, window, causal=causal).to(F64)
    with torch.no_grad():
        for name, w in attn.named_parameters():
            w.copy_(3 * (2 * torch.rand(w.shape, generator=generator, dtype=F64) - 1)
                    if name == "relative_bias"
                    else scale * torch.randn(w.shape, generator=generator, dtype=F64))
    return attn.requires_grad_(False)


@pytest.mark.parametrize("window", [None, 2])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("grad", [False, True])  # the fused kernel and the explicit softmax
def test_a_causal_row_is_the_unmasked_row_of_its_prefix(window, masked, grad):
    causal = attention(4, 2, window, causal=True)
    full = attention(4, 2, window, causal=False)
    x = 2 * torch.randn(3, 6, 4, dtype=F64)
    mask = torch.tensor(MASK) if masked else None
    with torch.set_grad_enabled(grad):
        out = causal(x, mask)
        assert torch.isfinite(out).all()
        for b in range(3):
            for i in range(6):
                if mask is not None and not mask[b, i]:
                    continue  # a padded query's output is zero (below)
                prefix = full(x[b : b + 1, : i + 1],
                              None if mask is None else mask[b : b + 1, : i + 1])
                torch.testing.assert_close(out[b, i], prefix[0, i], atol=1e-12, rtol=0)
    if masked:
        assert (out[~mask] == 0).all()
    assert not torch.allclose(out, full(x, mask))  # the mask changes the map


@pytest.mark.parametrize("branch", ["attention", "relative"])
def test_output_t_reads_the_real_frames_up_to_t_only(branch):
    torch.manual_seed(1)
    g = (ContractiveL2MultiheadAttention(4, 2, causal=True, max_offset=2) if branch == "attention"
         else RelativeMixingBranch(4, 8, 3, causal=True)).to(F64)
    with torch.no_grad():
        for p in g.parameters():
            p.add_(0.5 * torch.randn_like(p))
    x = torch.randn(3, 6, 4, dtype=F64)
    mask = torch.tensor(MASK)
    jac = torch.autograd.functional.jacobian(lambda t: g(t, mask), x)  # (3, 6, 4, 3, 6, 4)
    for b in range(3):
        for t in range(6):
            reads = jac[b, t, :, b].abs().amax((0, 2))  # (6,): input frames
            later_or_padded = (torch.arange(6) > t) | ~mask[b]
            assert (reads[later_or_padded] == 0).all()
            earlier_real = (torch.arange(6) < t) & mask[b]
            if mask[b, t] and earlier_real.any():
                assert reads[earlier_real].amax() > 1e-6
    assert g.causal and not g.position_wise and g.receptive_radius is None


@pytest.mark.parametrize(("dim", "heads", "window", "n", "gaps"), [
    (2, 2, None, 2, None), (4, 2, 2, 5, [True, False, True, True, True]), (1, 1, None, 6, None),
    (3, 3, 1, 5, None)])
def test_every_frame_obeys_its_rows_bound_at_adversarial_inputs(dim, heads, window, n, gaps):
    """Adam over the inputs maximises the infinity-norm of the Jacobian of output frame t of the
    causal map: below entry t of causal_l2_attention_bound, by which the branch divides it."""
    generator = torch.Generator().manual_seed(n + dim)
    for scale in (0.5, 2.0):
        attn = attention(dim, heads, window, causal=True, scale=scale, seed=n + dim)
        mask = None if gaps is None else torch.tensor([gaps])
        bounds = causal_l2_attention_bound(attn.w_query, attn.w_value, attn.w_out, heads, n,
                                           attn.relative_bias, mask).reshape(n)
        x = 4 * (2 * torch.rand(3, n, dim, generator=generator, dtype=F64) - 1)
        masks = None if mask is None else mask.expand(3, -1)
        for t in range(n):
            if gaps is not None and not gaps[t]:
                continue
            found = empirical_lipschitz(lambda z, t=t, a=attn, m=masks: a(z, m)[:, t : t + 1],
                                        x, "inf", steps=20, lr=0.1)
            assert 0 < float(found.value) <= float(bounds[t]) * (1 + 1e-12)  # frame 0: equal


@pytest.mark.parametrize("window", [None, 2])
def test_a_rows_bound_is_the_whole_bound_of_its_prefix_or_less(window):
    """Without a bias row t's bound is l2_attention_bound of the frames up to t (its last row
    has the most keys); with one it is at most that. It reads no later frame."""
    attn = attention(4, 2, window, causal=True, scale=1.0)
    mask = torch.tensor(MASK)
    rows = causal_l2_attention_bound(attn.w_query, attn.w_value, attn.w_out, 2, 6,
                                     attn.relative_bias, mask)
    for b in range(3):
        for t in range(6):
            if not mask[b, t]:
                continue
            prefix = lipschitz_bound(attn, t + 1, mask=mask[b : b + 1, : t + 1])[0]
            if window is None:
                torch.testing.assert_close(rows[b, t], prefix, atol=1e-12, rtol=0)
            else:
                assert float(rows[b, t]) <= float(prefix) * (1 + 1e-12)
    shorter = causal_l2_attention_bound(attn.w_query, attn.w_value, attn.w_out, 2, 4,
                                        attn.relative_bias, mask[:, :4])
    torch.testing.assert_close(shorter, rows[:, :4], atol=1e-14, rtol=0)


def test_the_causal_contractive_branch_keeps_its_coefficient_and_refuses_the_2_norm():
    branch = ContractiveL2MultiheadAttention(4, 2, coeff=0.7, causal=True).to(F64)
    with torch.no_grad():
        for w in branch.parameters():
            w.mul_(4)
    x = 5 * torch.randn(3, 6, 4, dtype=F64)
    mask = torch.tensor(MASK)
    found = empirical_lipschitz(lambda z: branch(z, mask), x, "inf", steps=15, lr=0.3)
    assert 0 < float(found.value) <= 0.7
    assert float(branch.lipschitz_constant(6)) == pytest.approx(0.7)
    with pytest.raises(ValueError, match="causal"):
        ContractiveL2MultiheadAttention(4, 2, norm="2", causal=True)


def test_causal_mixing_weights_average_the_real_frames_up_to_each_frame():
    g = RelativeMixingBranch(2, 4, window=2, causal=True).to(F64)
    with torch.no_grad():
        g.scores.copy_(torch.tensor([0.1, -0.2, 0.05, 0.3, 0.2], dtype=F64))
    mask = torch.tensor(MASK)
    weights = g.mixing_weights(6, mask)
    reads = causal_keys(6, mask, torch.device("cpu"))
    assert (weights[~reads] == 0).all() and (weights[reads] > 0).all()
    torch.testing.assert_close(weights.sum(-1), torch.ones(3, 6, dtype=F64), atol=1e-14, rtol=0)
    assert torch.equal(causal_keys(6, None, torch.device("cpu")), torch.ones(6, 6).tril().bool())
    x = 3 * torch.randn(3, 6, 2, dtype=F64)
    found = empirical_lipschitz(lambda z: g(z, mask), x, "inf", steps=15, lr=0.3)
    assert 0 < float(found.value) <= float(g.lipschitz_constant().detach())


def test_causal_models_build_attention_and_relative_layers_but_not_lipschitznorm():
    flow = ResidualSequenceFlow(features=2, max_len=8, n_blocks=1, hidden=8, causal=True,
                                layers=("attention", "relative"), relative_window=3)
    assert flow.causal
    kinds = [type(step.branch.branch if hasattr(step.branch, "branch") else step.branch).__name__
             for _, step in flow.transform.named_steps() if hasattr(step, "branch")]
    assert kinds == ["ContractiveL2MultiheadAttention", "RelativeMixingBranch"]
    with pytest.raises(ConfigError, match="attention = l2"):
        ResidualSequenceFlow(features=2, max_len=8, causal=True, layers=("attention",),
                             attention="lipschitznorm")


def test_the_lipschitz_report_gives_a_causal_attentions_largest_frame_bound():
    torch.manual_seed(0)
    flow = ResidualSequenceFlow(features=2, max_len=8, n_blocks=1, hidden=8, causal=True,
                                layers=("attention",)).double().eval()
    (row,) = flow.lipschitz_report(seq_len=6, n_inputs=2)
    attn = dict(flow.transform.named_steps())["block0.attention"].branch.branch.attention
    rows = causal_l2_attention_bound(attn.w_query, attn.w_value, attn.w_out, attn.heads, 6)
    assert row["raw_bound"] == pytest.approx(float(rows.max()), rel=1e-12)
    assert 0 < row["estimate"] <= row["certified"] == pytest.approx(0.9)


def test_a_causal_attention_run_trains_forecasts_and_reports_from_the_command_line(tmp_path,
                                                                                  capsys):
    run = tmp_path / "run"
    assert main(["train", "--data", "co2_windows", "--causal", "--layers",
                 "attention,relative,mlp", "--alternative", "none", "--epochs", "1",
                 "--max-train", "16", "--max-eval", "8", "--n-blocks", "1", "--hidden", "8",
                 "--out", str(run), "--quiet", "--device", "cpu"]) == 0
    assert main(["forecast", str(run), "--horizon", "4", "--num", "5", "--out",
                 str(tmp_path / "forecast.npz")]) == 0
    assert main(["info", str(run)]) == 0
    out = capsys.readouterr().out
    assert "ContractiveL2MultiheadAttention" in out and "RelativeMixingBranch" in out
