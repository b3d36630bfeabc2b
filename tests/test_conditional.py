"""Conditional flows p(x | c): branches certified in x for every context, the conditional residual
step and model (docs/math.md#contractive-attention, #change-of-variables, #fixed-point-inverse)."""

from __future__ import annotations

import pytest
import torch
from nflows.distributions import StandardNormal
from nflows.flows import Flow

from iresflow.logdet.roulette import RouletteLogDet
from iresflow.models.config import ConfigError, ModelConfig
from iresflow.models.residual_flow import ResidualSequenceFlow
from iresflow.nn.attention import (
    ContractiveL2MultiheadAttention,
    ContractiveLipschitzNormAttention,
)
from iresflow.nn.base import LipschitzBranch
from iresflow.nn.conditional import ConditionalBranch, ContextEncoder
from iresflow.nn.conv import TemporalConvBranch
from iresflow.nn.diagnostics import jacobian_norm
from iresflow.nn.mlp import LipschitzMLP
from iresflow.nn.positional import PositionalBranch, SinusoidalPositionalEncoding
from iresflow.transforms.conditional import ConditionalAffine
from iresflow.transforms.residual import ResidualTransform
from tests.oracles import real_indices

F64 = torch.float64


def _randomize_context_nets(module: torch.nn.Module, scale: float = 1.0) -> None:
    """Give every context network (zero at initialisation) a non-trivial random map."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "context_net" in name or "embedding" in name:
                p.copy_(torch.randn_like(p) * scale)


def _branches(device):
    mlp = ConditionalBranch(LipschitzMLP((3, 16, 16, 3), coeff=0.9 ** (1 / 3)), 2)
    conv = ConditionalBranch(TemporalConvBranch(3, 8, kernel_size=3, coeff=0.9, max_len=6), 2)
    return [b.to(device=device, dtype=F64).eval() for b in (mlp, conv)]


def _ratio(g, x1, x2, c, mask):
    num = (g(x1, mask, context=c) - g(x2, mask, context=c)).flatten(1).norm(dim=1)
    return num / (x1 - x2).flatten(1).norm(dim=1)


@pytest.mark.parametrize("kind", [0, 1], ids=["mlp", "conv"])
def test_certificate_holds_in_x_for_adversarial_contexts(device, kind):
    g = _branches(device)[kind]
    _randomize_context_nets(g, scale=3.0)
    bound = float(g.lipschitz_constant().detach())
    assert bound <= 0.9 + 1e-12
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2] * 4, device=device)
    x1 = torch.randn(8, 5, 3, device=device, dtype=F64, requires_grad=True)
    x2 = (x1.detach() + 0.1 * torch.randn_like(x1)).requires_grad_(True)
    # four random contexts, four optimised jointly with the inputs; some huge
    c = torch.randn(8, 2, device=device, dtype=F64) * torch.tensor(
        [1.0, 10.0, 100.0, 1.0, 1.0, 1.0, 1.0, 1.0], device=device, dtype=F64)[:, None]
    c_opt = c[4:].clone().requires_grad_(True)
    opt = torch.optim.Adam([x1, x2, c_opt], lr=0.05)
    best = torch.zeros(8, device=device, dtype=F64)
    for _ in range(60):
        context = torch.cat([c[:4], c_opt])
        ratio = _ratio(g, x1, x2, context, mask)
        best = torch.maximum(best, ratio.detach())
        opt.zero_grad()
        (-ratio.sum()).backward()
        opt.step()
    assert float(best.max()) <= bound + 1e-9
    assert float(best.max()) > 0.1 * bound  # the search is not vacuous
    # and the context does change the map
    x = torch.randn(8, 5, 3, device=device, dtype=F64)
    assert not torch.allclose(g(x, mask, context=c), g(x, mask, context=c.flip(0)))


@pytest.mark.parametrize("kind", [0, 1], ids=["mlp", "conv"])
def test_conditional_branch_contract(device, kind):
    g = _branches(device)[kind]
    _randomize_context_nets(g)
    x = torch.randn(2, 5, 3, device=device, dtype=F64)
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2], device=device)
    c = torch.randn(2, 2, device=device, dtype=F64)
    out = g(x, mask, context=c)
    assert bool((out[1, 3:] == 0).all())
    x_other = x.clone()
    x_other[1, 3:] = 100.0
    assert torch.equal(g(x_other, mask, context=c), out)
    with pytest.raises(ValueError, match=r"\bcontext\b"):
        g(x, mask, context=torch.zeros(3, 2, device=device, dtype=F64))
    with pytest.raises(TypeError, match=r"\bcontext\b"):
        g(x, mask, context=None)


def _attention_branch(kind: str, device) -> ConditionalBranch:
    """A conditional contractive attention branch (D = 4, 2 heads) with a positional table."""
    attention = (ContractiveL2MultiheadAttention(4, 2, coeff=0.9) if kind == "l2"
                 else ContractiveLipschitzNormAttention(4, 2, coeff=0.9))
    branch = ConditionalBranch(PositionalBranch(attention, SinusoidalPositionalEncoding(4)), 2)
    _randomize_context_nets(branch, scale=3.0)
    return branch.to(device=device, dtype=F64).eval()


#: Masks of length 7 with gaps, a padded end and a single real token.
GAP_MASKS = [[True] * 7, [True, False, True, True, False, False, True],
             [False, True, True, False, True, True, False], [True] + [False] * 6]


def _adversarial_jacobian_norms(g, mask, steps: int, generator: torch.Generator):
    """Gradient ascent of the Jacobian norm in the branch's own norm over the inputs and half of
    the contexts jointly (the other half random, some huge); the largest norm per sequence."""
    batch, length = mask.shape
    device = mask.device
    x = torch.randn(batch, length, 4, device=device, dtype=F64, generator=generator)
    x.requires_grad_(True)
    c = torch.randn(batch, 2, device=device, dtype=F64, generator=generator)
    c = c * torch.logspace(0, 2, batch, device=device, dtype=F64)[:, None]
    c_opt = c[batch // 2 :].clone().requires_grad_(True)
    opt = torch.optim.Adam([x, c_opt], lr=0.1)
    best = torch.zeros(batch, device=device, dtype=F64)
    for _ in range(steps):
        context = torch.cat([c[: batch // 2], c_opt])
        norm = jacobian_norm(lambda t, c=context: g(t, mask, context=c), x, g.norm)
        best = torch.maximum(best, norm.detach())
        opt.zero_grad()
        (-norm.sum()).backward()
        opt.step()
    return best, c


@pytest.mark.parametrize("kind", ["l2", "lipschitznorm"])
def test_attention_certificate_holds_in_x_for_adversarial_contexts(device, kind):
    """The norm never exceeds the certificate, with gaps in the masks."""
    g = _attention_branch(kind, device)
    mask = torch.tensor(GAP_MASKS * 2, device=device)
    best, c = _adversarial_jacobian_norms(g, mask, 40, torch.Generator(device).manual_seed(0))
    bound = float(g.lipschitz_constant().detach())
    assert bound == pytest.approx(0.9)
    assert float(best.max()) <= bound + 1e-9
    assert float(best.min()) > 0.01 * bound  # the search is not vacuous
    # the context changes the map, of its own sequence only
    x = torch.randn(8, 7, 4, device=device, dtype=F64)
    out = g(x, mask, context=c)
    other = c.clone()
    other[1] += 1.0
    changed = (g(x, mask, context=other) - out).abs().flatten(1).amax(1) > 0
    assert changed.tolist() == [False, True] + [False] * 6
    assert bool((out[~mask] == 0).all())


@pytest.mark.slow
@pytest.mark.parametrize("length", [2, 16, 48])
@pytest.mark.parametrize("kind", ["l2", "lipschitznorm"])
def test_attention_certificate_holds_for_adversarial_contexts_at_every_length(
    device, kind, length
):
    """As above on longer sequences: every fourth frame missing, the last third padded."""
    g = _attention_branch(kind, device)
    gen = torch.Generator(device).manual_seed(length)
    frames = torch.arange(length, device=device)
    gaps = (frames % 4 != 3) & (frames < max(1, 2 * length // 3))
    mask = torch.stack([torch.ones_like(gaps), gaps, gaps.roll(1), gaps.flip(0)])
    mask[:, 0] |= ~mask.any(1)  # at least one real frame
    best, _ = _adversarial_jacobian_norms(g, mask, 60, gen)
    assert float(best.max()) <= float(g.lipschitz_constant().detach()) + 1e-9
    assert float(best.min()) > 0


def test_context_moves_l2_attention_by_a_vector_per_sequence(device):
    """docs/math.md#conditional-branches: L2 scores are translation invariant and attention rows
    sum to one, so the context adds one vector to every real token of a sequence and leaves the
    Jacobian in x unchanged; LipschitzNorm attention's Jacobian does move with the context."""
    mask = torch.tensor(GAP_MASKS, device=device)
    x = torch.randn(4, 7, 4, device=device, dtype=F64)
    c1, c2 = torch.randn(2, 4, 2, device=device, dtype=F64)
    g = _attention_branch("l2", device)
    difference = g(x, mask, context=c1) - g(x, mask, context=c2)
    for b in range(4):
        rows = difference[b][mask[b]]
        assert torch.allclose(rows, rows[:1].expand_as(rows), atol=1e-12)
        assert rows.abs().max() > 1e-6
    jacobians = []
    for kind in ("l2", "lipschitznorm"):
        g = _attention_branch(kind, device)
        jacobians.append([
            torch.autograd.functional.jacobian(
                lambda t, c=c, g=g: g(t, mask[:1], context=c[:1]), x[:1])
            for c in (c1, c2)])
    assert torch.allclose(*jacobians[0], atol=1e-12)
    assert not torch.allclose(*jacobians[1], atol=1e-6)


@pytest.mark.parametrize("kind", ["l2", "lipschitznorm"])
def test_attention_step_with_context_round_trip_and_logdet(device, kind):
    g = _attention_branch(kind, device)
    block = ResidualTransform(g, logdet="exact").eval()
    x = torch.randn(4, 7, 4, device=device, dtype=F64)
    mask = torch.tensor(GAP_MASKS, device=device)
    c = torch.randn(4, 2, device=device, dtype=F64)
    y, logabsdet = block(x, c, mask=mask)
    x_rec, inverse_logabsdet = block.inverse(y, c, mask=mask)
    assert torch.allclose(x_rec, x, atol=1e-9)
    assert torch.allclose(logabsdet, -inverse_logabsdet, atol=1e-8)
    for b in range(4):
        mb, cb = mask[b : b + 1], c[b : b + 1]
        jac = torch.autograd.functional.jacobian(
            lambda t, mb=mb, cb=cb: t + g(t, mb, context=cb), x[b : b + 1]).reshape(28, 28)
        idx = real_indices(mask, b, 7, 4).to(device)
        assert torch.allclose(logabsdet[b], torch.linalg.slogdet(jac[idx][:, idx])[1],
                              atol=1e-8)


@pytest.mark.parametrize("logdet", ["exact", "roulette"])
def test_residual_step_with_context(device, logdet):
    g = _branches(device)[0]
    _randomize_context_nets(g)
    block = ResidualTransform(g, logdet=logdet).eval()
    x = torch.randn(3, 4, 3, device=device, dtype=F64)
    mask = torch.tensor([[True] * 4, [True] * 2 + [False] * 2, [True] * 3 + [False]],
                        device=device)
    c = torch.randn(3, 2, device=device, dtype=F64)
    for m in (None, mask):
        y, logabsdet = block(x, c, mask=m)
        x_rec, inverse_logabsdet = block.inverse(y, c, mask=m)
        assert torch.allclose(x_rec, x, atol=1e-9)
        oracle = []
        for b in range(3):  # dense Jacobian in x at fixed c
            mb = None if m is None else m[b : b + 1]
            jac = torch.autograd.functional.jacobian(
                lambda t, b=b, mb=mb: t + g(t, mb, context=c[b : b + 1]), x[b : b + 1]
            ).reshape(12, 12)
            idx = real_indices(m, b, 4, 3).to(device)
            oracle.append(torch.linalg.slogdet(jac[idx][:, idx])[1])
        oracle = torch.stack(oracle)
        if logdet == "exact":
            assert torch.allclose(logabsdet, -inverse_logabsdet, atol=1e-8)
            assert torch.allclose(logabsdet, oracle, atol=1e-8)
        else:  # unbiased: z-test of 400 independent estimates per sequence
            copies = 400
            with torch.no_grad():
                draws = block(x.repeat(copies, 1, 1), c.repeat(copies, 1),
                              mask=None if m is None else m.repeat(copies, 1))[1]
            draws = draws.view(copies, 3)
            stderr = draws.std(0) / copies**0.5
            assert bool(((draws.mean(0) - oracle).abs() <= 5 * stderr + 1e-10).all())
    with pytest.raises(ValueError, match=r"\bcontext\b"):
        block(x)
    with pytest.raises(ValueError, match=r"\bcontext\b"):
        block(x, c[:2])


@pytest.mark.parametrize("kind", [0, 1], ids=["mlp", "conv"])
def test_neumann_gradient_reaches_context(device, kind):
    """The memory-efficient Neumann backward (the linearization with the context's shift)
    returns the context's gradient, equal to the one of the plain autograd surrogate for the
    same draws."""
    g = _branches(device)[kind]
    _randomize_context_nets(g)
    x = torch.randn(3, 4, 3, device=device, dtype=F64)
    start = torch.randn(3, 2, device=device, dtype=F64)
    grads = []
    for efficient in (True, False):
        gen = torch.Generator(device=device).manual_seed(3)
        block = ResidualTransform(
            g, logdet=RouletteLogDet(memory_efficient=efficient, generator=gen)).train()
        embedding = start.clone().requires_grad_(True)
        c = torch.tanh(embedding)  # a non-leaf context, like an embedding's output
        y, logabsdet = block(x, c)
        (y.square().sum() + logabsdet.sum()).backward()
        grads.append(embedding.grad)
    assert grads[0].abs().sum() > 0
    assert torch.allclose(grads[0], grads[1], atol=1e-10)


def _model(device, *, mask=None, **settings):
    options = {"features": 3, "n_blocks": 1, "hidden": 8, "max_len": 6, "ar_order": 1,
               "layers": ("conv", "mlp"), "logdet": "exact", "base": "normal"} | settings
    model = ResidualSequenceFlow(**options).to(device=device, dtype=F64)
    _randomize_context_nets(model, scale=0.5)
    return model.eval()


def _contexts(device, config):
    if config.get("num_classes"):
        return torch.tensor([0, 2, 1, 2], device=device)
    return torch.randn(4, config["context_features"], device=device, dtype=F64)


def _padded_inputs(device):
    """Four float64 sequences ``(4, 5, 3)``, two of them padded at the end."""
    x = torch.randn(4, 5, 3, device=device, dtype=F64)
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2, [True] * 4 + [False],
                         [True] * 5], device=device)
    return x, mask


SETTINGS = [{"num_classes": 3}, {"num_classes": 3, "context_features": 4},
            {"context_features": 2}]


def _assert_exact_log_prob_matches_oracle(model, x, mask, context, base=None):
    """``log_prob(method="exact")`` against the autograd Jacobian of the whole flow + slogdet
    over the real entries, sequence by sequence, and the chunked evaluation against both.
    ``base`` is the torch distribution of every noise entry (default: standard normal)."""
    base = torch.distributions.Normal(0.0, 1.0) if base is None else base
    log_prob = model.log_prob(x, mask, method="exact", context=context)
    batch, length, features = x.shape
    for b in range(batch):
        mb, cb = mask[b : b + 1], context[b : b + 1]
        f = lambda t, mb=mb, cb=cb: model.transform_to_noise(t, mb, context=cb)  # noqa: E731
        jac = torch.autograd.functional.jacobian(f, x[b : b + 1])
        jac = jac.reshape(length * features, length * features)
        idx = real_indices(mask, b, length, features).to(x.device)
        z = f(x[b : b + 1])[0][mask[b]]
        expected = base.log_prob(z).sum() + torch.linalg.slogdet(jac[idx][:, idx])[1]
        assert torch.allclose(log_prob[b], expected, atol=1e-8)
    # chunked evaluation sees the same contexts
    chunked = model.log_prob(x, mask, method="exact", context=context, chunk_size=1)
    assert torch.allclose(chunked, log_prob, atol=1e-10)


@pytest.mark.parametrize("settings", SETTINGS, ids=["labels", "labels-c4", "covariates"])
def test_model_exact_log_prob_matches_jacobian_oracle(device, settings):
    model = _model(device, **settings)
    x, mask = _padded_inputs(device)
    _assert_exact_log_prob_matches_oracle(model, x, mask, _contexts(device, settings))


def test_conditional_model_with_a_student_t_base(device):
    """The base of a conditional flow may be a Student-t (docs/math.md#student-t-base): the
    exact density against the Jacobian oracle with torch's Student-t, and samples per label."""
    model = _model(device, num_classes=3, base="student-t")
    with torch.no_grad():
        model.base.log_excess.copy_(torch.log(torch.tensor([1.0, 3.0, 20.0])))
    x, mask = _padded_inputs(device)
    labels = _contexts(device, {"num_classes": 3})
    oracle = torch.distributions.StudentT(model.base.nu.detach())
    _assert_exact_log_prob_matches_oracle(model, x, mask, labels, base=oracle)
    samples, _ = model.sample(4, seq_len=5, context=labels,
                              generator=torch.Generator(device).manual_seed(0))
    assert samples.shape == (4, 5, 3) and torch.isfinite(samples).all()


#: The residual-flow Transformer recipe, conditional.
TRANSFORMER = {"layers": ("attention", "mlp"), "ar_order": 0}


def _gap_inputs(device):
    """Four float64 sequences ``(4, 6, 3)``: one full, one padded at the end, two with gaps."""
    x = torch.randn(4, 6, 3, device=device, dtype=F64)
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2,
                         [True, True, False, True, False, True],
                         [True, False, False, True, True, False]], device=device)
    return x, mask


@pytest.mark.parametrize("attention", ["l2", "lipschitznorm"])
@pytest.mark.parametrize("settings", SETTINGS[::2], ids=["labels", "covariates"])
def test_attention_model_exact_log_prob_matches_jacobian_oracle(device, settings, attention):
    model = _model(device, **TRANSFORMER, attention=attention, **settings)
    assert all(isinstance(step.branch, ConditionalBranch) for _, step in model.residual_steps())
    x, mask = _gap_inputs(device)
    _assert_exact_log_prob_matches_oracle(model, x, mask, _contexts(device, settings))


@pytest.mark.parametrize("layers", [{}, TRANSFORMER], ids=["conv-mlp", "attention-mlp"])
@pytest.mark.parametrize("settings", SETTINGS[::2], ids=["labels", "covariates"])
def test_model_round_trip_and_sampling(device, settings, layers):
    model = _model(device, **layers, **settings)
    x, mask = _gap_inputs(device) if layers else _padded_inputs(device)
    context = _contexts(device, settings)
    z = model.transform_to_noise(x, mask, context=context)
    assert torch.allclose(model.inverse(z, mask, context=context), x, atol=1e-9)
    gen = torch.Generator(device=device).manual_seed(0)
    samples, smask = model.sample(4, seq_len=x.shape[1], generator=gen, context=context)
    gen.manual_seed(0)
    noise = model.base.sample(smask, gen, 1.0, dtype=F64)
    assert torch.allclose(model.transform_to_noise(samples, smask, context=context), noise,
                          atol=1e-9)


@pytest.mark.parametrize("layers", [{}, TRANSFORMER], ids=["conv-mlp", "attention-mlp"])
@pytest.mark.parametrize("settings", SETTINGS[::2], ids=["labels", "covariates"])
def test_context_of_one_sequence_changes_only_its_density(device, settings, layers):
    model = _model(device, **layers, **settings)
    x = torch.randn(4, 5, 3, device=device, dtype=F64)
    context = _contexts(device, settings)
    other = context.clone()
    other[1] = 1 if settings.get("num_classes") else other[1] + 1.0
    a = model.log_prob(x, method="exact", context=context)
    b = model.log_prob(x, method="exact", context=other)
    changed = (a - b).abs() > 1e-9
    assert changed.tolist() == [False, True, False, False]
    assert torch.allclose(a[[0, 2, 3]], b[[0, 2, 3]], atol=0, rtol=0)


def test_gradients_reach_context_network_and_embedding(device):
    model = _model(device, num_classes=3, logdet="roulette").train()
    x = torch.randn(4, 5, 3, device=device, dtype=F64)
    model.initialize(x, context=torch.tensor([0, 1, 2, 0], device=device))
    loss = -model.log_prob(x, context=torch.tensor([0, 1, 2, 0], device=device)).mean()
    loss.backward()
    named = dict(model.named_parameters())
    assert named["context_encoder.embedding.weight"].grad.abs().sum() > 0
    nets = [p for n, p in named.items() if "context_net" in n]
    assert nets and all(p.grad is not None and p.grad.abs().sum() > 0 for p in nets)


def test_nflows_flow_with_context(device):
    model = _model(device, context_features=2, ar_order=0)
    x = torch.randn(4, 5, 3, device=device, dtype=F64)
    context = _contexts(device, {"context_features": 2})
    flow = Flow(model.transform, StandardNormal([5, 3]), embedding_net=model.context_encoder)
    assert torch.allclose(flow.log_prob(x, context=context),
                          model.log_prob(x, context=context), atol=1e-9)
    noise = flow.transform_to_noise(x, context=context)
    assert torch.allclose(model.inverse(noise, context=context), x, atol=1e-9)


def test_conditional_inputs_are_rejected(device):
    labels = _model(device, num_classes=3)
    plain = _model(device)
    x = torch.randn(2, 4, 3, device=device, dtype=F64)
    for call, context, error in [
        (labels.log_prob, None, ValueError),
        (labels.log_prob, torch.tensor([0, 3], device=device), ValueError),
        (labels.log_prob, torch.tensor([0], device=device), ValueError),
        (labels.log_prob, torch.zeros(2, device=device, dtype=F64), TypeError),
        (plain.log_prob, torch.zeros(2, 1, device=device, dtype=F64), ValueError),
    ]:
        with pytest.raises(error, match=r"\bcontext\b"):
            call(x, context=context)
    with pytest.raises(ValueError, match=r"\bcontext\b"):
        labels.sample(2, seq_len=3)
    covariates = ContextEncoder(2)
    with pytest.raises(ValueError, match=r"\bcontext\b"):
        covariates.check(torch.full((2, 2), float("nan"), dtype=F64), 2, x)
    with pytest.raises(ConfigError, match="num_classes"):
        ModelConfig(num_classes=-1)


def test_unconditional_model_has_no_context_parts():
    torch.manual_seed(1)
    plain = ResidualSequenceFlow(features=3, max_len=6, n_blocks=1, hidden=8)
    torch.manual_seed(1)
    explicit = ResidualSequenceFlow(features=3, max_len=6, n_blocks=1, hidden=8,
                                       context_features=0, num_classes=0)
    assert plain.context_encoder is None
    assert not any("context" in k for k in plain.state_dict())
    for (k, v), (k2, v2) in zip(plain.state_dict().items(), explicit.state_dict().items(),
                                strict=True):
        assert k == k2 and torch.equal(v, v2)


def test_lipschitz_report_of_conditional_model(device):
    model = _model(device, num_classes=3)
    report = model.lipschitz_report(seq_len=4, n_inputs=2)
    assert all(r["estimate"] <= r["certified"] + 1e-9 for r in report)


def test_lipschitz_report_names_and_bounds_the_wrapped_branch(device):
    # A conditional row reads like the unconditional one: the wrapped kind, and the raw bound of
    # attention (a ConditionalBranch around a PositionalBranch around the attention).
    settings = {"layers": ("attention", "conv", "mlp"), "relative_window": 2}
    plain = _model(device, **settings).lipschitz_report(seq_len=4, n_inputs=1)
    model = _model(device, num_classes=3, **settings)
    report = model.lipschitz_report(seq_len=4, n_inputs=1)
    assert [r["type"] for r in report] == [r["type"] for r in plain] == [
        "ContractiveL2MultiheadAttention", "TemporalConvBranch", "LipschitzMLP"]
    attention = dict(model.residual_steps())["block0.attention"].branch
    assert isinstance(attention, ConditionalBranch)
    expected = float(attention.branch.branch.raw_bound(4).detach())
    assert report[0]["raw_bound"] == pytest.approx(expected, rel=1e-12) and expected > 0
    assert [r["raw_bound"] is None for r in report] == [r["raw_bound"] is None for r in plain]


def test_conditional_affine(device):
    layer = ConditionalAffine(3, 2, max_log_scale=2.0).to(device=device, dtype=F64)
    _randomize_context_nets(layer)
    x = torch.randn(3, 4, 3, device=device, dtype=F64)
    mask = torch.tensor([[True] * 4, [True] * 2 + [False] * 2, [True] * 3 + [False]],
                        device=device)
    c = torch.randn(3, 2, device=device, dtype=F64) * 100  # extreme contexts stay bounded
    y, logabsdet = layer(x, c, mask=mask)
    assert torch.equal(y[~mask], x[~mask])
    x_rec, inverse_logabsdet = layer.inverse(y, c, mask=mask)
    assert torch.allclose(x_rec, x, atol=1e-12)
    assert torch.allclose(inverse_logabsdet, -logabsdet)
    for b in range(3):
        jac = torch.autograd.functional.jacobian(
            lambda t, b=b: layer(t, c[b : b + 1], mask=mask[b : b + 1])[0], x[b : b + 1]
        ).reshape(12, 12)
        idx = real_indices(mask, b, 4, 3).to(device)
        assert torch.allclose(logabsdet[b], torch.linalg.slogdet(jac[idx][:, idx])[1])
    assert float(logabsdet.detach().abs().max()) <= 2.0 * 3 * 4
    vectors = layer(x[:, 0], c)  # (B, D) inputs
    assert torch.allclose(vectors[0], y[:, 0]) and vectors[1].shape == (3,)
    with pytest.raises(ValueError, match=r"\bcontext\b"):
        layer(x)


def test_conditional_branch_needs_a_branch_that_takes_a_shift():
    class Half(LipschitzBranch):  # g(x) = x / 2: takes no shift
        position_wise, norm = True, "2"

        def forward(self, x, mask=None):
            return x / 2

        def lipschitz_constant(self, seq_len=None):
            return torch.tensor(0.5)

    with pytest.raises(ValueError, match="shift_features nor features"):
        ConditionalBranch(Half(), 2)
    Half.features = 3  # no shift point: the input is translated
    g = ConditionalBranch(Half(), 2)
    with torch.no_grad():
        g.context_net[-1].bias.copy_(torch.tensor([1.0, 2.0, 3.0]))
    x = torch.zeros(2, 4, 3)
    expected = torch.tensor([0.5, 1.0, 1.5]).expand(2, 4, 3)
    assert torch.equal(g(x, context=torch.zeros(2, 2)), expected)
    with pytest.raises(TypeError, match="LipschitzBranch"):
        ConditionalBranch(torch.nn.Linear(3, 3), 2)  # type: ignore[arg-type]
    g = _branches("cpu")[0]
    with pytest.raises(ValueError, match="shift"):
        g.branch(torch.zeros(2, 4, 3, dtype=F64), shift=torch.zeros(2, 3, dtype=F64))
