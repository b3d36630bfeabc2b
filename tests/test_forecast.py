"""Forecasts and per-frame scores of causal flows (docs/forecasting.md).

Oracles: the dense autograd Jacobian of every step (its diagonal blocks), prefix
log-likelihoods of sliced sequences, scipy's multivariate t, the Gaussian conditional of a
linear flow, and the forward map of the flow at the forecast.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from iresflow.models.distributions import StudentTSequence, make_base
from iresflow.models.residual_flow import ResidualSequenceFlow
from iresflow.transforms.autoregressive import AutoregressiveAffine
from iresflow.transforms.base import FRAMES, SequenceTransform
from iresflow.transforms.residual import ResidualTransform
from iresflow.transforms.temporal import AutoregressiveLinear
from tests.oracles import jacobian

LENGTH, FEATURES = 7, 2


def _model(device, dtype, features: int = FEATURES, **settings) -> ResidualSequenceFlow:
    """A causal model, initialised on data and moved away from its initial identity steps."""
    options = {"n_blocks": 2, "hidden": 8, "max_len": LENGTH + 3, "causal": True} | settings
    model = ResidualSequenceFlow(features=features, **options).to(device=device, dtype=dtype)
    data = torch.randn(8, LENGTH, features, device=device, dtype=dtype) * 1.7 + 0.3
    model.initialize(data, **_context(model, 8, device))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def _context(model: ResidualSequenceFlow, batch: int, device) -> dict[str, torch.Tensor]:
    if not model.config.num_classes:
        return {}
    return {"context": torch.arange(batch, device=device) % model.config.num_classes}


def _batch(device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(3, LENGTH, FEATURES, device=device, dtype=dtype) * 1.5 + 0.2
    mask = torch.ones(3, LENGTH, dtype=torch.bool, device=device)
    mask[1, 5:] = False  # end padding
    mask[2, 2] = False  # a gap
    return x, mask


RECIPES = {
    "default": {},
    "every kind": {"layers": ("conv", "autoregressive", "mix", "mlp"), "position_norm": "on",
                   "volatility": 2},
    "conditional": {"num_classes": 2, "layers": ("conv", "autoregressive", "mlp")},
    "recurrent": {"num_classes": 2, "layers": ("autoregressive", "conv", "mlp"),
                  "conditioner": "gru"},
    "dilated": {"dilation": 2},
    "maf": {"layers": ("maf", "conv"), "conditioner": "gru", "ar_order": 0},
    "attention": {"layers": ("attention", "relative", "mlp"), "relative_window": 3},
}
BASES = ("sequence-t", "normal", "student-t", "multivariate-t")


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_step_splits_its_logdet_into_its_diagonal_blocks(device, recipe):
    """Frame t's log-det of every step is log|det| of the t-th diagonal block of the step's
    dense Jacobian (zero at padding), and the Jacobian has nothing above those blocks."""
    model = _model(device, torch.float64, **RECIPES[recipe])
    x, mask = _batch(device, torch.float64)
    context = _context(model, 3, device).get("context")
    c = None if context is None else model.context_encoder(context)
    trace = model.transform.forward_trace(x, c, mask=mask).states
    for (name, step), h in zip(model.transform.named_steps(), trace[:-1], strict=True):
        frames = step._forward(h, c, mask, FRAMES)[1]
        for b in range(3):
            cb = None if c is None else c[b : b + 1]
            full = jacobian(lambda t, m, cb=cb, step=step: step._forward(t, cb, m, False)[0],
                            h[b : b + 1], mask[b : b + 1])[0]
            full = full.reshape(LENGTH, FEATURES, LENGTH, FEATURES)
            for t in range(LENGTH):
                assert (full[t, :, t + 1 :] == 0).all(), name
                expected = torch.linalg.slogdet(full[t, :, t])[1] if mask[b, t] else 0.0
                torch.testing.assert_close(frames[b, t], torch.as_tensor(expected).to(frames),
                                           atol=1e-10, rtol=1e-10, msg=name)


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("recipe", RECIPES)
def test_frame_scores_are_differences_of_prefix_log_likelihoods(device, dtype, base, recipe):
    model = _model(device, dtype, base=base, **RECIPES[recipe])
    x, mask = _batch(device, dtype)
    context = _context(model, 3, device)
    frames = model.frame_log_prob(x, mask, **context)
    assert frames.shape == (3, LENGTH) and (frames[~mask] == 0).all()
    tol = 1e-10 if dtype == torch.float64 else 1e-3
    for t in range(1, LENGTH + 1):  # the prefix of length t, cut off as a user would
        prefix = model.log_prob(x[:, :t], mask[:, :t], method="exact", **context)
        torch.testing.assert_close(frames[:, :t].sum(-1), prefix, atol=tol, rtol=tol)


def test_frame_scores_have_the_gradient_of_the_exact_log_likelihood(device):
    model = _model(device, torch.float64)
    x, mask = _batch(device, torch.float64)
    x.requires_grad_(True)
    (frame_grad,) = torch.autograd.grad(model.frame_log_prob(x, mask).sum(), x)
    (exact_grad,) = torch.autograd.grad(model.log_prob(x, mask, method="exact").sum(), x)
    torch.testing.assert_close(frame_grad, exact_grad, atol=1e-10, rtol=1e-10)


def test_sequence_t_frame_density_is_scipys_conditional_t(device):
    """Frame t of the sequence-level t given the earlier real frames: a D-variate t with
    nu + k degrees of freedom and squared scale (nu + q) / (nu + k), from the k earlier
    coordinates of squared norm q."""
    base = StudentTSequence(3, group="sequence", nu_init=4.5).to(device, torch.float64)
    z = torch.randn(2, 5, 3, device=device, dtype=torch.float64) * 1.3
    mask = torch.tensor([[1, 1, 0, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool, device=device)
    frames = base.frame_log_prob(z, mask).detach().cpu().numpy()
    nu = float(base.nu.detach())
    for b in range(2):
        k, q = 0, 0.0
        for t in range(5):
            if not mask[b, t]:
                assert frames[b, t] == 0
                continue
            zt = z[b, t].cpu().numpy()
            expected = stats.multivariate_t(np.zeros(3), (nu + q) / (nu + k) * np.eye(3),
                                            df=nu + k).logpdf(zt)
            assert abs(frames[b, t] - expected) < 1e-10
            k, q = k + 3, q + float((zt**2).sum())


@pytest.mark.parametrize("base", BASES)
def test_sample_given_keeps_the_observed_frames_and_zeros_the_others(device, base):
    density = make_base(base, 2).to(device, torch.float64)
    z = torch.randn(2, 6, 2, device=device, dtype=torch.float64)
    observed = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 0, 1, 0, 0, 0]], dtype=torch.bool,
                            device=device)
    mask = observed.clone()
    mask[0, 3:5] = True
    mask[1, 3] = True
    drawn = density.sample_given(z, observed, mask, torch.Generator(device).manual_seed(0))
    assert torch.equal(drawn[observed], z[observed])
    assert (drawn[~mask] == 0).all() and (drawn[mask & ~observed] != 0).all()


def test_sequence_t_draw_given_observed_frames_is_the_conditional_t(device):
    """||z_new||^2 / (k_new s^2) ~ F(k_new, nu + k_o), s^2 = (nu + q_o) / (nu + k_o): a
    Kolmogorov-Smirnov test against scipy, and a plain t for the frame group."""
    nu, draws = 5.0, 4000
    base = StudentTSequence(2, group="sequence", nu_init=nu).to(device, torch.float64)
    z = torch.zeros(draws, 5, 2, device=device, dtype=torch.float64)
    z[:, :3] = torch.tensor([[2.0, -1.0], [0.5, 3.0], [-2.5, 1.5]], dtype=torch.float64)
    observed = torch.zeros(draws, 5, dtype=torch.bool, device=device)
    observed[:, :3] = True
    mask = torch.ones_like(observed)
    drawn = base.sample_given(z, observed, mask, torch.Generator(device).manual_seed(3))
    known, square = 6, float(z[0, :3].square().sum())
    scale = (nu + square) / (nu + known)
    statistic = (drawn[:, 3:].square().sum((1, 2)) / (4 * scale)).cpu().numpy()
    assert stats.kstest(statistic, stats.f(4, nu + known).cdf).pvalue > 1e-3
    nu_stored = float(base.nu.detach())  # 5 up to the rounding of its parameter
    expected = (nu_stored + square) / (nu_stored + known)
    assert base.given_scale(z, observed).square().sub(expected).abs().max() < 1e-12
    frame = StudentTSequence(2, group="frame", nu_init=nu).to(device, torch.float64)
    assert torch.equal(frame.given_scale(z, observed), torch.ones_like(z[:, 0, 0]))
    drawn = frame.sample_given(z, observed, mask, torch.Generator(device).manual_seed(4))
    statistic = (drawn[:, 3].square().sum(-1) / 2).cpu().numpy()
    assert stats.kstest(statistic, stats.f(2, nu).cdf).pvalue > 1e-3


def test_prior_noise_of_new_frames_ignores_the_observed_noise(device):
    """``sample_new`` of a sequence-level t: the same new frames, from the same generator,
    after quiet and loud observed noise (those of an unconditional draw); ``sample_given``
    scales them by the ratio of the conditional scales."""
    base = StudentTSequence(2, group="sequence", nu_init=5.0).to(device, torch.float64)
    quiet = 0.5 * torch.randn(3, 6, 2, device=device, dtype=torch.float64)
    loud = 10.0 * quiet
    observed = torch.zeros(3, 6, dtype=torch.bool, device=device)
    observed[:, :4] = True
    mask = torch.ones_like(observed)
    new = mask & ~observed

    def draw(method, z):
        return method(z, observed, mask, torch.Generator(device).manual_seed(7))

    prior = draw(base.sample_new, quiet)
    torch.testing.assert_close(prior[new], draw(base.sample_new, loud)[new], rtol=0, atol=0)
    fresh = base.sample(new, torch.Generator(device).manual_seed(7), dtype=torch.float64)
    torch.testing.assert_close(prior[new], fresh[new], rtol=0, atol=0)
    assert torch.equal(prior[observed], quiet[observed]) and torch.equal(prior[~mask], fresh[~mask])
    ratio = base.given_scale(loud, observed) / base.given_scale(quiet, observed)
    given_loud, given_quiet = draw(base.sample_given, loud), draw(base.sample_given, quiet)
    torch.testing.assert_close(given_loud[new].reshape(3, -1),
                               given_quiet[new].reshape(3, -1) * ratio[:, None])
    assert bool((ratio > 3).all())  # the loud past widens the given draw, not the prior one


@pytest.mark.parametrize("noise", ["given", "prior"])
@pytest.mark.parametrize("ragged", [True, False])
@pytest.mark.parametrize("recipe", RECIPES)
def test_forecast_solves_the_flow_on_the_new_frames_with_the_past_fixed(device, dtype, recipe,
                                                                        ragged, noise):
    """The flow maps the observed frames followed by the forecast to the observed frames' own
    noise followed by the noise drawn for the new ones (reproduced from the same generator,
    given the observed noise or not); with sequences of different lengths (padded solving
    windows) and of one length (none)."""
    model = _model(device, dtype, **RECIPES[recipe])
    x, mask = _batch(device, dtype)
    mask = mask if ragged else torch.ones_like(mask)
    context = _context(model, 3, device)
    horizon, num = 3, 2
    samples = model.forecast(x, mask, horizon=horizon, num_samples=num, **context,
                             generator=torch.Generator(device).manual_seed(5), noise=noise)
    assert samples.shape == (num, 3, horizon, FEATURES)
    ends = torch.tensor([LENGTH, 5 if ragged else LENGTH, LENGTH], device=device)
    total = LENGTH + horizon
    positions = torch.arange(total, device=device)
    new = (positions >= ends[:, None]) & (positions < ends[:, None] + horizon)
    known = torch.nn.functional.pad(mask, (0, horizon))
    data = torch.nn.functional.pad(x, (0, 0, 0, horizon))
    observed_noise = model.transform_to_noise(data, known, **context)
    c = None if not context else model.context_encoder(context["context"].repeat(num))
    draw = model.base.sample_given if noise == "given" else model.base.sample_new
    drawn = draw(observed_noise.repeat(num, 1, 1), known.repeat(num, 1),
                 (known | new).repeat(num, 1), torch.Generator(device).manual_seed(5), context=c)
    tol = 1e-8 if dtype == torch.float64 else 1e-3
    for s in range(num):
        full = data.clone()
        full[new] = samples[s].reshape(-1, FEATURES)
        z = model.transform_to_noise(full, known | new, **context)
        torch.testing.assert_close(z[known | new], drawn[s * 3 : (s + 1) * 3][known | new],
                                   atol=tol, rtol=tol)
    assert model.inverse_diagnostics()["converged"]


def test_forecast_of_a_linear_gaussian_flow_is_the_gaussian_conditional(device):
    """An AR(2) layer and a feature mixing with the normal base are a Gaussian x ~ N(mu, S)
    with S^-1 = J^T J (J the constant Jacobian of the flow): the forecast's draws, whitened by
    the conditional covariance of the last frames given the first ones, are standard normal."""
    model = ResidualSequenceFlow(features=2, max_len=6, ar_order=2, n_blocks=1, layers=("mix",),
                                 base="normal", causal=True).to(device, torch.float64)
    series = torch.randn(16, 6, 2, device=device, dtype=torch.float64).cumsum(1) * 0.5
    model.initialize(series)
    model.eval()
    observed, horizon, draws = 4, 2, 6000
    past = series[:1, :observed]
    zero = torch.zeros(1, observed + horizon, 2, device=device, dtype=torch.float64)
    mean = model.inverse(zero).flatten()
    jac = jacobian(lambda t, m: model.transform_to_noise(t, m), zero)[0]
    covariance = torch.linalg.inv(jac.mT @ jac)
    p = observed * 2
    gain = covariance[p:, :p] @ torch.linalg.inv(covariance[:p, :p])
    cond_mean = mean[p:] + gain @ (past.flatten() - mean[:p])
    cond_cov = covariance[p:, p:] - gain @ covariance[:p, p:]
    samples = model.forecast(past, horizon=horizon, num_samples=draws,
                             generator=torch.Generator(device).manual_seed(7)).reshape(draws, -1)
    white = torch.linalg.solve_triangular(torch.linalg.cholesky(cond_cov),
                                          (samples - cond_mean).T, upper=False).T
    assert white.mean(0).abs().max() < 4.5 / draws**0.5
    eye = torch.eye(white.shape[1], dtype=white.dtype, device=device)
    assert (torch.cov(white.T) - eye).abs().max() < 5 * (2 / draws) ** 0.5


def test_log_prob_given_observed_frames_is_the_conditional_density(device, dtype):
    model = _model(device, dtype)
    x, mask = _batch(device, dtype)
    given = mask.clone()
    given[:, 3:] = False
    value = model.log_prob(x, mask, given=given)
    expected = model.log_prob(x, mask, method="exact") - model.log_prob(x, given, method="exact")
    tol = 1e-10 if dtype == torch.float64 else 1e-3
    torch.testing.assert_close(value, expected, atol=tol, rtol=tol)
    value, stderr = model.log_prob(x, mask, given=given, return_stderr=True, method="exact")
    assert (stderr == 0).all()
    later = given.clone()
    later[0, 5] = True  # a given frame after new ones
    with pytest.raises(ValueError, match="before the other real frames"):
        model.log_prob(x, mask, given=later)
    outside = given.clone()
    outside[1, 6] = True  # a padded frame
    with pytest.raises(ValueError, match="before the other real frames"):
        model.log_prob(x, mask, given=outside)
    with pytest.raises(ValueError, match="exact"):
        model.log_prob(x, mask, given=given, method="roulette")
    with pytest.raises(TypeError, match="given"):
        model.log_prob(x, mask, given=given.int())


def test_flows_that_read_later_frames_refuse_forecasts_and_frame_scores(device):
    model = ResidualSequenceFlow(features=FEATURES, max_len=LENGTH, n_blocks=1, hidden=8)
    model = model.to(device, torch.float64).eval()
    assert not model.causal and _model(device, torch.float64).causal
    x, mask = _batch(device, torch.float64)
    for call in (lambda: model.forecast(x, mask, horizon=1), lambda: model.frame_log_prob(x),
                 lambda: model.log_prob(x, mask, given=mask)):
        with pytest.raises(ValueError, match="only a causal flow .* block0.conv read later"):
            call()


def test_forecast_rejects_bad_options(device):
    model = _model(device, torch.float64)
    x, mask = _batch(device, torch.float64)
    with pytest.raises(ValueError, match="horizon"):
        model.forecast(x, mask, horizon=0)
    with pytest.raises(ValueError, match="exceeds max_len=10"):
        model.forecast(x, mask, horizon=4)
    with pytest.raises(ValueError, match="num_samples"):
        model.forecast(x, mask, horizon=1, num_samples=0)
    with pytest.raises(ValueError, match="temperature"):
        model.forecast(x, mask, horizon=1, temperature=0.0)
    with pytest.raises(ValueError, match="noise must be one of given, prior"):
        model.forecast(x, mask, horizon=1, noise="fresh")
    bad = x.clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        model.forecast(bad, mask, horizon=1)


def _pinned_case(model: ResidualSequenceFlow, features: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """States ``x`` of three float64 sequences of ``LENGTH + 3`` frames, their mask (the second
    ends at frame 8), their known frames (the first 7, 6 and 8, the first sequence with a padded
    gap at frame 3 among them) and the encoded context of a conditional model (else ``None``)."""
    total = LENGTH + 3
    x = torch.randn(3, total, features, dtype=torch.float64)
    mask = torch.ones(3, total, dtype=torch.bool)
    mask[1, 8:] = False
    known = torch.zeros(3, total, dtype=torch.bool)
    known[0, :7], known[1, :6], known[2, :8] = True, True, True
    known[0, 3] = mask[0, 3] = False  # a gap among the known frames
    context = _context(model, 3, torch.device("cpu"))
    c = None if not context else model.context_encoder(context["context"])
    return x, mask, known, c


@pytest.mark.parametrize("features", [FEATURES, 1])  # one: per-frame steps solved frame by frame
@pytest.mark.parametrize("recipe", ["default", "conditional", "dilated"])
def test_residual_steps_solve_the_new_frames_on_their_window_as_the_whole_inverse(
        recipe, features, monkeypatch):
    """The windowed, pinned fixed-point solve of a causal residual step equals inverting it
    whole and putting the known frames back, and never evaluates the frames before it."""
    model = _model(torch.device("cpu"), torch.float64, features, **RECIPES[recipe])
    x, mask, known, c = _pinned_case(model, features)
    total = x.shape[1]
    steps = [t for t in model.transform.steps if isinstance(t, ResidualTransform)]
    assert steps
    for step in steps:
        y = step._forward(x, c, mask, False)[0]
        y = torch.where(known[..., None], y, torch.randn_like(y))
        lengths: list[int] = []
        # the lengths the solve evaluates: on the branch itself or on its solve map
        hook = step.branch.register_forward_hook(
            lambda module, args, out, seen=lengths: seen.append(args[0].shape[1]))

        def recording(linearization=None, solve=step.branch.solve_map, seen=lengths):
            inner = solve(linearization)
            return lambda x, *rest, **kw: seen.append(x.shape[1]) or inner(x, *rest, **kw)

        monkeypatch.setattr(step.branch, "solve_map", recording)
        windowed = step.inverse_pinned(y, x, known, c, mask)
        hook.remove()
        monkeypatch.undo()
        assert bool(step.last_inverse_stats.converged.all())
        whole = SequenceTransform.inverse_pinned(step, y, x, known, c, mask)
        torch.testing.assert_close(windowed, whole, atol=1e-10, rtol=0)
        reach = 0 if step.branch.position_wise else step.branch.receptive_radius
        first_new, last = torch.tensor([7, 6, 8]), torch.tensor([total, 8, total])
        width = int((last - (first_new - reach).clamp(min=0)).max())
        # per-frame steps on one feature evaluate their moving frames alone, too
        alone = {1} if step.branch.position_wise and features == 1 else set()
        assert width in lengths and set(lengths) <= {width} | alone, (lengths, reach)
        assert width < total or reach >= int(first_new.min()), (width, reach)


@pytest.mark.parametrize("recipe", ["default", "conditional"])
def test_the_autoregressive_step_recovers_new_frames_from_the_first_one_on(recipe):
    """The linear autoregressive step's pinned inverse equals inverting it whole and putting the
    known frames back, and reads nothing of the frames before the first new one but the states
    of its history."""
    model = _model(torch.device("cpu"), torch.float64, **RECIPES[recipe])
    (step,) = [t for t in model.transform.steps if isinstance(t, AutoregressiveLinear)]
    assert step.order > 0
    x, mask, known, c = _pinned_case(model, FEATURES)
    y = step._forward(x, c, mask, False)[0]
    y = torch.where(known[..., None], y, torch.randn_like(y))
    pinned = step.inverse_pinned(y, x, known, c, mask)
    whole = SequenceTransform.inverse_pinned(step, y, x, known, c, mask)
    torch.testing.assert_close(pinned, whole, atol=1e-10, rtol=0)
    first = 6  # the first new frame of any sequence
    garbage = y.clone()
    garbage[:, :first] = 1e3
    assert torch.equal(step.inverse_pinned(garbage, x, known, c, mask)[:, first:],
                       pinned[:, first:])


def test_the_trace_keeps_what_the_pinned_inverse_reuses_and_repeats_it_by_draw():
    """The trace holds every member's input and the GRU-conditioned steps' states (the other
    members keep nothing); repeated for two draws, copy i of sequence b sits at row 3 i + b."""
    model = _model(torch.device("cpu"), torch.float64, **RECIPES["recurrent"])
    x, mask, known, c = _pinned_case(model, FEATURES)
    trace = model.transform.forward_trace(x, c, mask=known)
    assert len(trace.states) == len(trace.memory) + 1 == len(model.transform.steps) + 1
    for step, state, kept in zip(model.transform.steps, trace.states, trace.memory,
                                 strict=False):
        assert (kept is not None) == isinstance(step, AutoregressiveAffine)
        if kept is not None:
            assert torch.equal(kept, step.conditioner.states(state, known, c))
    repeated = trace.repeat(2)
    for one, two in zip(trace.states + trace.memory, repeated.states + repeated.memory,
                        strict=True):
        if one is not None:
            assert torch.equal(two, torch.cat([one, one]))


@pytest.mark.parametrize("recipe", ["every kind", "conditional", "recurrent", "maf"])
def test_the_autoregressive_affine_step_solves_the_new_frames_only(recipe):
    """The Transformer- or GRU-conditioned step's pinned inverse equals inverting it whole and
    putting the known frames back; the known frames are settled from the start, so with its
    window of one frame it sweeps once per new frame of the batch's longest history."""
    model = _model(torch.device("cpu"), torch.float64, **RECIPES[recipe])
    x, mask, known, c = _pinned_case(model, FEATURES)
    for step in [t for t in model.transform.steps if isinstance(t, AutoregressiveAffine)]:
        y = step._forward(x, c, mask, False)[0]
        y = torch.where(known[..., None], y, torch.randn_like(y))
        pinned = step.inverse_pinned(y, x, known, c, mask)
        assert step.last_inverse_stats.evaluations == x.shape[1] - 6  # the first new frame: 6
        whole = SequenceTransform.inverse_pinned(step, y, x, known, c, mask)
        assert step.last_inverse_stats.evaluations == x.shape[1]
        torch.testing.assert_close(pinned, whole, atol=1e-10, rtol=0)
        torch.testing.assert_close(step._forward(pinned, c, mask, False)[0][mask], y[mask],
                                   atol=1e-10, rtol=0)
        # A GRU's states kept by the forward of the known frames (a forecast's trace): the
        # solve starts from them, to the same frames; other states would move them.
        outputs, memory = step.forward_with_memory(x, c, known)
        assert torch.equal(outputs, step._forward(x, c, known, False)[0])
        assert (memory is not None) == (RECIPES[recipe].get("conditioner") == "gru")
        if memory is not None:
            torch.testing.assert_close(step.inverse_pinned(y, x, known, c, mask, memory), pinned,
                                       atol=1e-12, rtol=0)
            other = step.inverse_pinned(y, x, known, c, mask, torch.zeros_like(memory))
            assert not torch.allclose(other, pinned)
