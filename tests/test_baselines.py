"""Checks of the results-table baselines (benchmarks/baselines) and of the table logic."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from scipy.stats import multivariate_normal
from torchdiffeq import odeint

from benchmarks import cli, records
from benchmarks.baselines.cnf import (
    CNF,
    FixedProbeValidation,
    exact_divergence,
    hutchinson_divergence,
)
from benchmarks.baselines.gaussian import FrameGaussian, SequenceGaussian, fit_gaussian
from benchmarks.baselines.nflows_models import frame_maf, sequence_maf, sequence_realnvp
from benchmarks.baselines.recurrent import ENCODERS, RecurrentFlow
from benchmarks.figures import mean_curve
from benchmarks.results_report import entries, provenance_text, summarize, target_check
from benchmarks.results_specs import FULL, mode_budget
from iresflow.data.datasets import SequenceDataset, SequenceSplit
from iresflow.models.distributions import sample_mask
from iresflow.models.reference import AutoregressiveGaussian, history_lags
from iresflow.train.config import TrainConfig
from iresflow.train.fit import fit
from iresflow.train.likelihood import split_log_prob
from tests.oracles import finite_difference_grad, jacobian, jacobian_logdet

MASK = torch.tensor([[True, True, True], [True, False, False], [True, True, False]])


def _split(x: torch.Tensor, mask: torch.Tensor | None = None) -> SequenceSplit:
    if mask is None:
        mask = torch.ones(x.shape[:2], dtype=torch.bool)
    x = torch.where(mask[..., None], x, 0.0)
    return SequenceSplit(x, mask, torch.zeros(x.shape[0], dtype=torch.float64))


def _tol(dtype: torch.dtype) -> float:
    """Relative tolerance of a float64 oracle comparison in ``dtype``."""
    return 1e-10 if dtype == torch.float64 else 1e-4


def _tiny_cnf(dtype: torch.dtype, **kwargs: object) -> CNF:
    cnf = CNF(2, max_len=3, hidden=8, heads=2, **kwargs).to(dtype)
    with torch.no_grad():  # leave the identity start: a field with real structure
        for p in cnf.field.out.parameters():
            p.normal_(0.0, 0.5)
    return cnf


# ------------------------------------------------------------------------------------------------
# Gaussians


def test_fit_gaussian_is_the_mle_with_ridge(dtype: torch.dtype) -> None:
    v = torch.randn(50, 3, dtype=dtype) @ torch.randn(3, 3, dtype=dtype)
    mean, tril = fit_gaussian(v, ridge=0.1)
    ref = v.numpy()
    np.testing.assert_allclose(mean.numpy(), ref.mean(0), atol=_tol(dtype))
    np.testing.assert_allclose((tril @ tril.T).numpy(),
                               np.cov(ref.T, bias=True) + 0.1 * np.eye(3), rtol=_tol(dtype))


def test_frame_gaussian_matches_scipy(dtype: torch.dtype) -> None:
    x = torch.randn(3, 3, 2, dtype=dtype) @ torch.tensor([[1.0, 0.5], [0.0, 2.0]], dtype=dtype)
    model = FrameGaussian(2, max_len=3, ridge=1e-3).fit(x, MASK)
    frames = x[MASK].numpy()
    ref = multivariate_normal(frames.mean(0), np.cov(frames.T, bias=True) + 1e-3 * np.eye(2))
    expected = [ref.logpdf(x[b][MASK[b]].numpy()).sum() for b in range(3)]
    garbage = torch.where(MASK[..., None], x, 1e3)  # padded values must not matter
    np.testing.assert_allclose(model.log_prob(garbage, MASK).numpy(), expected, rtol=_tol(dtype))
    assert model.num_parameters == 2 + 3


def test_sequence_gaussian_matches_scipy(dtype: torch.dtype) -> None:
    x = torch.randn(40, 2, 2, dtype=dtype).cumsum(1)  # correlated positions
    model = SequenceGaussian(2, 2, ridge=1e-4).fit(x)
    flat = x.reshape(40, 4).numpy()
    ref = multivariate_normal(flat.mean(0), np.cov(flat.T, bias=True) + 1e-4 * np.eye(4))
    np.testing.assert_allclose(model.log_prob(x).numpy(), ref.logpdf(flat), rtol=_tol(dtype))
    with pytest.raises(ValueError, match="fixed-length"):
        model.log_prob(x[:3, :, :], torch.tensor([[True, False]] * 3))


def test_gaussian_samples_have_the_fitted_moments() -> None:
    x = torch.randn(400, 2, 2, dtype=torch.float64) * torch.tensor([1.0, 3.0], dtype=torch.float64)
    model = SequenceGaussian(2, 2).fit(x)
    samples, mask = model.sample(20000, seq_len=2, generator=torch.Generator().manual_seed(1))
    cov = torch.cov(samples.reshape(-1, 4).T)
    fitted = model.scale_tril @ model.scale_tril.T
    assert mask.all()
    assert torch.allclose(cov, fitted, atol=0.15)  # 20000 draws: s.e. of a variance of 9 ~ 0.09


# ------------------------------------------------------------------------------------------------
# AR(p) Gaussian


def _simulate_ar1(num: int, length: int, a: torch.Tensor, b: torch.Tensor, chol: torch.Tensor,
                  generator: torch.Generator) -> torch.Tensor:
    """Sequences of x_t = a x_{t-1} + b + chol e_t started at x_1 = e_1 (a plain loop)."""
    x = torch.zeros(num, length, a.shape[0], dtype=torch.float64)
    eps = torch.randn(x.shape, generator=generator, dtype=torch.float64)
    x[:, 0] = eps[:, 0]
    for t in range(1, length):
        x[:, t] = x[:, t - 1] @ a.T + b + eps[:, t] @ chol.T
    return x


A1 = torch.tensor([[0.8, 0.1], [-0.2, 0.5]], dtype=torch.float64)
B1 = torch.tensor([0.3, -1.0], dtype=torch.float64)
C1 = torch.tensor([[0.5, 0.0], [0.2, 0.3]], dtype=torch.float64)


def test_lagged() -> None:
    x = torch.arange(1.0, 5.0).reshape(1, 4, 1)
    assert history_lags(x, None, 2)[0][0].tolist() == [[0, 0], [1, 0], [2, 1], [3, 2]]
    assert history_lags(x, None, 6)[0].shape == (1, 4, 6)
    assert history_lags(x, None, 0)[0].shape == (1, 4, 0)


def test_ar_joint_equals_the_implied_full_covariance_gaussian() -> None:
    """Fixed-length AR(1): the joint of (x_1..x_T) is the Gaussian vec(X) = F^{-1}(c + G e)."""
    x = _simulate_ar1(200, 4, A1, B1, C1, torch.Generator().manual_seed(0))
    model = AutoregressiveGaussian(2, max_len=4).fit(x, order=1)
    a, b = model.weight[1].T, model.bias[1]
    t, d = 4, 2
    f = torch.eye(t * d, dtype=torch.float64)
    for i in range(1, t):
        f[i * d : (i + 1) * d, (i - 1) * d : i * d] = -a
    c = torch.cat([model.bias[0]] + [b] * (t - 1))
    noise_cov = torch.block_diag(*[model.scale_tril[min(i, 1)] @ model.scale_tril[min(i, 1)].T
                                   for i in range(t)])
    f_inv = torch.linalg.inv(f)
    ref = multivariate_normal((f_inv @ c).numpy(), (f_inv @ noise_cov @ f_inv.T).numpy())
    test = _simulate_ar1(5, 4, A1, B1, C1, torch.Generator().manual_seed(1))
    np.testing.assert_allclose(model.log_prob(test).numpy(), ref.logpdf(test.reshape(5, -1)),
                               rtol=1e-10)


def test_ar_conditionals_match_scipy_with_variable_lengths(dtype: torch.dtype) -> None:
    x = torch.randn(6, 5, 2, dtype=torch.float64).cumsum(1)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0],
                         [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    model = AutoregressiveGaussian(2, max_len=5).fit(torch.where(mask[..., None], x, 0.0), mask,
                                                     order=2)
    expected = []
    for seq, m in zip(x, mask, strict=True):
        frames, total = seq[m], 0.0
        for i in range(len(frames)):
            k = min(i, 2)
            past = frames[i - k : i].flip(0).reshape(-1)
            mean = past @ model.weight[k, : 2 * k] + model.bias[k]
            cov = model.scale_tril[k] @ model.scale_tril[k].T
            total += multivariate_normal(mean.numpy(), cov.numpy()).logpdf(frames[i].numpy())
        expected.append(total)
    garbage = torch.where(mask[..., None], x, 1e3).to(dtype)  # padded values must not matter
    np.testing.assert_allclose(model.log_prob(garbage, mask).numpy(), expected, rtol=_tol(dtype))
    # real frames need not be a prefix: a gap ends the history, as in the flow's AR layer, so
    # the runs of real frames are independent sequences
    holes = torch.tensor([[False, True, False, True, True]])
    runs = torch.stack([x[0, 1:3], x[0, 3:5]])
    run_mask = torch.tensor([[True, False], [True, True]])
    torch.testing.assert_close(model.log_prob(x[:1], holes),
                               model.log_prob(runs, run_mask).sum(0, keepdim=True))


def test_ar_fit_is_least_squares_over_real_frame_pairs() -> None:
    x = torch.randn(8, 6, 2, dtype=torch.float64).cumsum(1)
    lengths = [6, 2, 3, 1, 5, 6, 4, 2]
    mask = torch.arange(6) < torch.tensor(lengths)[:, None]
    model = AutoregressiveGaussian(2, max_len=6, ridge=0.0).fit(x * mask[..., None], mask, 1)
    pairs = [(x[b, t - 1], x[b, t]) for b, n in enumerate(lengths) for t in range(1, n)]
    design = np.array([np.r_[p.numpy(), 1.0] for p, _ in pairs])
    target = np.array([q.numpy() for _, q in pairs])
    solution = np.linalg.lstsq(design, target, rcond=None)[0]
    residual = target - design @ solution
    np.testing.assert_allclose(model.weight[1].numpy(), solution[:2], rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(model.bias[1].numpy(), solution[2], rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose((model.scale_tril[1] @ model.scale_tril[1].T).numpy(),
                               residual.T @ residual / len(pairs), rtol=1e-8)
    first = x[:, 0].numpy()  # frame 1: the Gaussian of the first frames
    np.testing.assert_allclose(model.bias[0].numpy(), first.mean(0), rtol=1e-10)
    assert model.num_parameters == (2 + 3) + (4 + 2 + 3)
    with pytest.raises(ValueError, match="at least 7 real frames"):
        model.fit(x, mask, order=6)


def test_ar_recovers_a_synthetic_ar1_process() -> None:
    x = _simulate_ar1(2000, 11, A1, B1, C1, torch.Generator().manual_seed(2))
    model = AutoregressiveGaussian(2, max_len=11).fit(x, order=1)
    # 20000 pairs: standard errors of the coefficients are ~ 0.01
    torch.testing.assert_close(model.weight[1].T, A1, atol=0.04, rtol=0)
    torch.testing.assert_close(model.bias[1], B1, atol=0.04, rtol=0)
    torch.testing.assert_close(model.scale_tril[1], C1, atol=0.02, rtol=0)
    # ancestral samples come from the fitted process: refitting them recovers it
    samples, mask = model.sample(2000, seq_len=11, generator=torch.Generator().manual_seed(3))
    refit = AutoregressiveGaussian(2, max_len=11).fit(samples, mask, order=1)
    torch.testing.assert_close(refit.weight[1], model.weight[1], atol=0.04, rtol=0)
    torch.testing.assert_close(refit.scale_tril, model.scale_tril, atol=0.06, rtol=0)


def test_ar0_is_the_gaussian_over_frames() -> None:
    x = torch.randn(5, 4, 3, dtype=torch.float64).cumsum(1)
    mask = torch.arange(4) < torch.tensor([4, 1, 3, 2, 4])[:, None]
    x = x * mask[..., None]
    ar0 = AutoregressiveGaussian(3, max_len=4, ridge=1e-3).fit(x, mask, order=0)
    frames = FrameGaussian(3, max_len=4, ridge=1e-3).fit(x, mask)
    torch.testing.assert_close(ar0.log_prob(x, mask), frames.log_prob(x, mask))
    assert ar0.num_parameters == frames.num_parameters


def test_ar_noise_is_the_standardised_innovation() -> None:
    x = _simulate_ar1(50, 5, A1, B1, C1, torch.Generator().manual_seed(4))
    mask = torch.arange(5) < torch.randint(1, 6, (50,))[:, None]
    model = AutoregressiveGaussian(2, max_len=5).fit(x * mask[..., None], mask, order=1)
    z = model.transform_to_noise(x, mask)
    log_det = model.scale_tril.diagonal(dim1=1, dim2=2).log().sum(-1)
    per_frame = torch.distributions.Normal(0.0, 1.0).log_prob(z).sum(-1)
    per_frame = per_frame - torch.where(torch.arange(5) == 0, log_det[0], log_det[1])
    torch.testing.assert_close(model.log_prob(x, mask), (per_frame * mask).sum(-1))
    assert torch.equal(z[~mask], x[~mask])


def test_order_selection_picks_the_true_order_and_refits_on_both_splits() -> None:
    x = _simulate_ar1(300, 8, A1, B1, C1, torch.Generator().manual_seed(5))
    train, val = _split(x[:200]), _split(x[200:])
    model = AutoregressiveGaussian(2, max_len=8)
    val_nll = model.fit_selected_order(train, val, max_order=2)
    assert len(val_nll) == 3 and val_nll[1] < val_nll[0] - 0.1
    assert model.order == min(range(3), key=val_nll.__getitem__)
    refit = AutoregressiveGaussian(2, max_len=8).fit(x, order=model.order)
    torch.testing.assert_close(model.weight, refit.weight)
    with pytest.raises(ValueError, match="max_order"):
        model.fit_selected_order(train, val, max_order=-1)


# ------------------------------------------------------------------------------------------------
# GRU + conditional MAF


@pytest.fixture(params=ENCODERS)
def encoder(request: pytest.FixtureRequest) -> str:
    return request.param


def _tiny_recurrent(dtype: torch.dtype, encoder: str) -> RecurrentFlow:
    model = RecurrentFlow(2, max_len=4, hidden=8, n_layers=2, encoder=encoder).to(dtype)
    with torch.no_grad():  # leave nflows' identity start: a conditional with real structure
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


def test_recurrent_flow_is_the_product_of_its_conditionals(dtype: torch.dtype,
                                                           encoder: str) -> None:
    model = _tiny_recurrent(dtype, encoder)
    x = torch.randn(3, 3, 2, dtype=dtype)
    expected = []
    for seq, m in zip(x, MASK, strict=True):
        frames, total = seq[m], torch.zeros((), dtype=dtype)
        for t in range(len(frames)):  # the encoder rerun on the prefix, one frame at a time
            prefix = torch.cat([frames[:t], torch.full((1, 2), 7.0, dtype=dtype)])
            context = model.past(prefix[None])[:, -1]  # the last row reads frames[:t] only
            total = total + model.flow.log_prob(frames[t : t + 1], context=context)[0]
        expected.append(total)
    garbage = torch.where(MASK[..., None], x, 1e3)  # padded values must not matter
    torch.testing.assert_close(model.log_prob(garbage, MASK), torch.stack(expected))
    holes = torch.tensor([[False, True, True]])
    torch.testing.assert_close(model.log_prob(x[:1], holes), model.log_prob(x[:1, 1:]))


def test_recurrent_flow_gradients_noise_and_samples(dtype: torch.dtype, encoder: str) -> None:
    model = _tiny_recurrent(dtype, encoder)
    x = torch.randn(3, 3, 2, dtype=dtype)
    model.log_prob(x, MASK).sum().backward()
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in model.parameters())
    z = model.transform_to_noise(x, MASK)
    assert torch.equal(z[~MASK], x[~MASK])
    with torch.no_grad():  # the noise of the first frame is the MAF of the start state
        context = model.past(torch.zeros(1, 1, 2, dtype=dtype))[:, 0]
        first = model.flow._transform(x[:, 0], context=context.expand(3, -1))[0]
    torch.testing.assert_close(z[:, 0], first)
    samples, mask = model.sample(3, lengths=torch.tensor([3, 1, 2]),
                                 generator=torch.Generator().manual_seed(0))
    again, _ = model.sample(3, lengths=torch.tensor([3, 1, 2]),
                            generator=torch.Generator().manual_seed(0))
    assert torch.equal(mask, MASK) and bool((samples[~mask] == 0).all())
    assert torch.equal(samples, again) and samples.dtype == dtype


def test_recurrent_flow_samples_follow_its_density(encoder: str) -> None:
    """With one affine layer and D = 1 the model is a Gaussian per frame given its past: the
    sampled standardised noise must be standard normal and serially uncorrelated."""
    model = RecurrentFlow(1, max_len=3, hidden=4, n_layers=1, encoder=encoder).double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    samples, mask = model.sample(4000, seq_len=3, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        z = model.transform_to_noise(samples, mask)
    assert abs(float(z.mean())) < 4 / math.sqrt(12000)
    assert abs(float(z.var()) - 1) < 4 * math.sqrt(2 / 12000)
    lag = (z[:, 1:] * z[:, :-1]).mean()
    assert abs(float(lag)) < 4 / math.sqrt(8000)


# ------------------------------------------------------------------------------------------------
# nflows wrappers


def test_frame_maf_sums_real_frames_only(dtype: torch.dtype) -> None:
    model = frame_maf(2, max_len=3, hidden=8, n_layers=2).to(dtype)
    x = torch.randn(3, 3, 2, dtype=dtype)
    expected = torch.stack([model.flow.log_prob(x[b][MASK[b]]).sum() for b in range(3)])
    garbage = torch.where(MASK[..., None], x, 1e3)
    torch.testing.assert_close(model.log_prob(garbage, MASK), expected)
    samples, mask = model.sample(3, lengths=torch.tensor([3, 1, 2]))
    assert torch.equal(mask, MASK) and bool((samples[~mask] == 0).all())


@pytest.mark.parametrize("build", [sequence_maf, sequence_realnvp])
def test_flattened_flows_use_vec_x(build, dtype: torch.dtype) -> None:
    model = build(3, 2, hidden=8, n_layers=2).to(dtype)
    x = torch.randn(4, 3, 2, dtype=dtype)
    torch.testing.assert_close(model.log_prob(x), model.flow.log_prob(x.reshape(4, 6)))
    with pytest.raises(ValueError, match="fixed-length"):
        model.log_prob(x[:3], MASK)
    assert model.sample(2, seq_len=3)[0].shape == (2, 3, 2)


# ------------------------------------------------------------------------------------------------
# CNF


def test_exact_divergence_is_the_jacobian_trace(dtype: torch.dtype) -> None:
    field = _tiny_cnf(dtype).field
    x = torch.randn(3, 3, 2, dtype=dtype, requires_grad=True)
    t = torch.tensor(0.3, dtype=dtype)
    for mask in (None, MASK):
        div = exact_divergence(field(t, x, mask), x)
        jac = jacobian(lambda xb, mb: field(t, xb, mb), x.detach(), mask)
        torch.testing.assert_close(div, jac.diagonal(dim1=1, dim2=2).sum(-1))


def test_vector_field_respects_the_mask(dtype: torch.dtype) -> None:
    field = _tiny_cnf(dtype).field
    x = torch.randn(3, 3, 2, dtype=dtype)
    t = torch.tensor(0.7, dtype=dtype)
    v = field(t, x, MASK)
    assert bool((v[~MASK] == 0).all())
    moved = torch.where(MASK[..., None], x, torch.randn_like(x) * 10)
    torch.testing.assert_close(field(t, moved, MASK), v)


def test_hutchinson_divergence_is_unbiased(dtype: torch.dtype) -> None:
    field = _tiny_cnf(dtype).field
    t = torch.tensor(0.5, dtype=dtype)
    copies = 4000
    x = torch.randn(1, 3, 2, dtype=dtype).expand(copies, 3, 2).clone().requires_grad_(True)
    v = field(t, x)
    probe = torch.randint(0, 2, x.shape, dtype=dtype) * 2 - 1
    estimates = hutchinson_divergence(v, x, probe)
    x0 = x[:1].detach().requires_grad_(True)
    exact = exact_divergence(field(t, x0), x0)[0]
    assert float(estimates.std()) > 0  # the probes do vary
    z = (estimates.mean() - exact) / (estimates.std() / math.sqrt(copies))
    assert abs(float(z)) < 4


def test_cnf_log_prob_matches_change_of_variables(dtype: torch.dtype) -> None:
    if dtype != torch.float64:
        pytest.skip("tight ODE tolerances need float64")
    cnf = _tiny_cnf(dtype, eval_tol=1e-8).eval()
    x, mask = torch.randn(2, 3, 2, dtype=dtype), MASK[1:]
    times = torch.tensor([0.0, 1.0], dtype=dtype)

    def flow_map(xb: torch.Tensor, mb: torch.Tensor | None) -> torch.Tensor:
        velocity = lambda t, z: cnf.field(t, z, mb)  # noqa: E731
        return odeint(velocity, xb, times, rtol=1e-8, atol=1e-8, method="dopri5")[-1]

    z = torch.cat([flow_map(x[b : b + 1], mask[b : b + 1]) for b in range(2)])
    base = torch.distributions.Normal(0.0, 1.0).log_prob(z).sum(-1)
    expected = (base * mask).sum(-1) + jacobian_logdet(flow_map, x, mask)
    with torch.no_grad():
        torch.testing.assert_close(cnf.log_prob(x, mask, exact=True), expected, atol=1e-6,
                                   rtol=0)


def test_cnf_adjoint_gradient_matches_finite_differences(dtype: torch.dtype) -> None:
    if dtype != torch.float64:
        pytest.skip("finite differences need float64")
    # with a mask: the adjoint pass re-evaluates the masked dynamics after log_prob returned
    cnf = _tiny_cnf(dtype, divergence="exact", train_tol=1e-8, eval_tol=1e-8)
    x, mask = torch.randn(2, 3, 2, dtype=dtype), MASK[1:]
    params = [cnf.field.out.bias]  # enters the velocity directly, padded positions included
    cnf.train()
    grads = torch.autograd.grad(cnf.log_prob(x, mask).sum(), params)
    numeric = finite_difference_grad(lambda: cnf.log_prob(x, mask).sum(), params, eps=1e-5)
    for analytic, fd in zip(grads, numeric, strict=True):
        torch.testing.assert_close(analytic, fd, atol=1e-5, rtol=1e-4)


def test_cnf_samples_are_zero_at_padding() -> None:
    cnf = _tiny_cnf(torch.float32).eval()
    samples, mask = cnf.sample(3, lengths=torch.tensor([3, 1, 2]))
    assert torch.equal(mask, MASK) and bool((samples[~mask] == 0).all())


# ------------------------------------------------------------------------------------------------
# trainer and evaluation


def _dataset(train: SequenceSplit, val: SequenceSplit) -> SequenceDataset:
    return SequenceDataset("toy", train.x.shape[-1], train.x.shape[1], "nats/frame", train, val,
                           val)


def _config(**settings: object) -> TrainConfig:
    """The trainer of ``iresflow train`` with the results table's optimisation protocol."""
    protocol = {"scheduler": "none", "warmup": 0, "clip": 100.0, "device": "cpu", "min_steps": 1}
    return TrainConfig.from_dict({**protocol, **settings})


@pytest.mark.parametrize("name", ["frame_maf", "maf", "realnvp", "cnf", "recurrent"])
def test_baselines_train_to_finite_nll(name: str) -> None:
    builders = {
        "frame_maf": lambda: frame_maf(2, 3, hidden=8, n_layers=1),
        "maf": lambda: sequence_maf(3, 2, hidden=8, n_layers=1),
        "realnvp": lambda: sequence_realnvp(3, 2, hidden=8, n_layers=2),
        "cnf": lambda: FixedProbeValidation(CNF(2, 3, hidden=8, eval_tol=1e-3)),
        "recurrent": lambda: RecurrentFlow(2, 3, hidden=8, n_layers=1),
    }
    model = builders[name]()
    fixed = name in ("maf", "realnvp")
    mask = None if fixed else MASK.repeat(4, 1)
    split = _split(torch.randn(12, 3, 2), mask)
    result = fit(_config(lr=1e-2, batch_size=6, epochs=2), _dataset(split, split), model)
    values, _ = split_log_prob(model, split)
    assert len(result.history) == 2 and result.steps == 4
    assert bool(torch.isfinite(values).all()) and math.isfinite(result.best_val_nll)
    assert result.model is model and not model.training


def test_baselines_train_in_float64_and_restore_the_best_epoch() -> None:
    x = torch.randn(64, 3, 2, dtype=torch.float64) * 3.0 + 1.0  # far from a standard normal
    train, val = _split(x[:48]), _split(x[48:])
    model = frame_maf(2, 3, hidden=8, n_layers=1).double()
    initial = float(-split_log_prob(model, val)[0].sum()) / 48
    calls: list[tuple[int, bool, float]] = []

    def on_epoch(session: object, row: dict[str, float]) -> None:
        calls.append((row["epoch"], model.training, float(-split_log_prob(model, val)[0].sum())))

    result = fit(_config(lr=1e-2, batch_size=16, epochs=15, patience=3), _dataset(train, val),
                 model, on_epoch=on_epoch)
    final = float(-split_log_prob(model, val)[0].sum()) / 48
    assert next(model.parameters()).dtype == torch.float64
    assert [c[0] for c in calls] == list(range(1, len(result.history) + 1))
    assert not any(c[1] for c in calls)  # called in eval mode
    val_nll = [row["val_nll"] for row in result.history]
    assert [c[2] / 48 for c in calls] == pytest.approx(val_nll, rel=1e-12)  # float64
    assert result.best_val_nll < initial
    assert final == pytest.approx(result.best_val_nll, rel=1e-12)
    assert result.best_val_nll == min(val_nll)
    assert result.best_epoch == val_nll.index(min(val_nll)) + 1


def test_cnf_validation_uses_fixed_probes_and_training_mode_is_the_cnf() -> None:
    cnf = _tiny_cnf(torch.float64)
    model = FixedProbeValidation(cnf, seed=3)
    x = torch.randn(4, 3, 2, dtype=torch.float64)
    model.eval()
    expected = cnf.log_prob(x, exact=False, generator=torch.Generator().manual_seed(3))
    assert torch.equal(model.log_prob(x), expected) and torch.equal(model.log_prob(x), expected)
    model.train()
    torch.manual_seed(0)
    trained = model.log_prob(x)
    torch.manual_seed(0)
    assert torch.equal(trained, cnf.log_prob(x)) and trained.requires_grad


def test_sample_mask_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        sample_mask(2, 3, torch.tensor([1, 2]), 4)
    with pytest.raises(ValueError, match="lie in"):
        sample_mask(2, None, torch.tensor([0, 2]), 4)
    with pytest.raises(TypeError):
        sample_mask(2, None, torch.tensor([1.0, 2.0]), 4)


# ------------------------------------------------------------------------------------------------
# the table


def _entries(nll: dict[str, dict[str, float]]) -> dict[str, dict[str, dict]]:
    return {name: {key: {"status": "ok", "summary": {"test_nll": value, "params": 10}}
                   for key, value in models.items()} for name, models in nll.items()}


def test_target_check_counts_wins() -> None:
    nll = {
        "japanese_vowels": {"iresflow": 1.0, "cnf": 2.0, "gaussian_frames": 3.0},
        "digits_rows": {"iresflow": 1.0, "cnf": 2.0, "realnvp": 1.5, "maf": 0.5},
        "co2_windows": {"iresflow": 1.0, "cnf": 2.0, "realnvp": 1.5, "maf": 0.9},
    }
    check = target_check(_entries(nll))
    assert (check["best_overall_count"], check["best_parallel_count"]) == (1, 3)
    assert not check["holds"]
    nll["co2_windows"]["maf"] = 1.1
    assert target_check(_entries(nll))["holds"]
    nll["japanese_vowels"]["cnf"] = 0.5
    assert not target_check(_entries(nll))["holds"]


def test_summarize_reports_mean_and_std() -> None:
    runs = [{"seed": s, "test_nll": v, "params": 7} for s, v in enumerate([1.0, 2.0, 3.0])]
    summary = summarize(runs + [{"seed": 3, "error": "boom"}])
    assert summary["test_nll"] == 2.0 and summary["test_nll_std"] == 1.0
    assert summary["seeds"] == 3 and summary["errors"] == ["boom"]


def test_mode_budgets() -> None:
    assert mode_budget(FULL, "table") == FULL
    assert mode_budget(FULL, "table", 5).max_seconds == 5.0
    converge = mode_budget(FULL, "convergence")
    assert converge.max_epochs >= 1000 and converge.patience < converge.max_epochs
    capped = mode_budget(FULL, "convergence", 300)
    assert capped.max_seconds == 300.0 and capped.patience == converge.patience
    equal = mode_budget(FULL, "budget", 300)
    assert equal.max_seconds == 300.0 and equal.patience >= equal.max_epochs  # no early stop
    with pytest.raises(ValueError, match="--budget"):
        mode_budget(FULL, "budget")
    with pytest.raises(ValueError, match="mode"):
        mode_budget(FULL, "fast")


def test_mean_curve_interpolates_in_log_time() -> None:
    a = [[1.0, 3.0], [10.0, 1.0], [1000.0, 0.0]]
    b = [[2.0, 5.0], [100.0, 1.0]]
    seconds, nll = mean_curve([a, b, []], points=5)
    assert seconds[0] == pytest.approx(2.0) and seconds[-1] == pytest.approx(100.0)
    for t, v in zip(seconds, nll, strict=True):
        ya = np.interp(math.log(t), np.log([1.0, 10.0, 1000.0]), [3.0, 1.0, 0.0])
        yb = np.interp(math.log(t), np.log([2.0, 100.0]), [5.0, 1.0])
        assert v == pytest.approx((ya + yb) / 2)
    assert mean_curve([a]) == ([1.0, 10.0, 1000.0], [3.0, 1.0, 0.0])
    assert mean_curve([]) == ([], [])


def test_replace_between_markers() -> None:
    start, end = records.markers("results")
    text = f"intro\n{start}\nold\n{end}\nrest\n"
    assert records.replace_block(text, "results", "new", "x") == (
        f"intro\n{start}\nnew\n{end}\nrest\n")
    with pytest.raises(ValueError, match="markers"):
        records.replace_block("no markers", "results", "new", "README.md")


def test_merge_report_replaces_only_the_rerun_rows(tmp_path) -> None:
    budget = json.loads(json.dumps(dataclasses.asdict(FULL)))
    settings = {"mode": "table", "quick": False, "budget": budget}
    first = "python -m benchmarks results --jobs 2"
    old = {"generated_by": first}
    stored = [{"dataset": "japanese_vowels", "iresflow": {"old": 1, **old},
               "gaussian_frames": {"old": 2, **old}, "maf": {"old": 3, **old}},
              {"dataset": "co2_windows", "iresflow": {"old": 4, **old}, "maf": {"old": 5, **old}}]
    records.save(tmp_path / "results.json", stored, [first], settings)
    rerun = "python -m benchmarks results --models iresflow --datasets japanese_vowels --merge"
    args = argparse.Namespace(out=tmp_path / "results.json", merge=True, command_line=rerun)
    fresh = {"new": 1, "generated_by": rerun, "trainer": "`fit`"}
    rows, _ = cli.save(args, [{"dataset": "japanese_vowels", "iresflow": fresh}], ("dataset",),
                       settings, cli.stored(args, settings))
    merged = entries(rows)
    assert merged == {"japanese_vowels": {"gaussian_frames": {"old": 2, **old},
                                          "maf": {"old": 3, **old}, "iresflow": fresh},
                      "co2_windows": {"iresflow": {"old": 4, **old}, "maf": {"old": 5, **old}}}
    assert list(merged["japanese_vowels"]) == ["gaussian_frames", "maf", "iresflow"]  # table order
    text = provenance_text(merged)
    assert text.startswith("Rows of gaussian_frames, maf, iresflow generated by "
                           "`python -m benchmarks results --jobs 2` (trained by `fit_model` of "
                           "the former")
    assert text.endswith(f"Rows of iresflow generated by `{rerun}` (trained by `fit`).")
    with pytest.raises(SystemExit, match="budget"):
        cli.stored(args, {**settings, "budget": dataclasses.asdict(mode_budget(FULL, "table", 5))})
