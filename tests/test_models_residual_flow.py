"""The residual sequence flow (ResidualSequenceFlow) and its positional encodings
(docs/math.md#contractive-attention, #change-of-variables, #actnorm)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from iresflow.models.branches import MAF_MAX_LOG_SCALE
from iresflow.models.config import ConfigError, ModelConfig, default_heads
from iresflow.models.distributions import StandardNormalSequence, StudentTSequence
from iresflow.models.residual_flow import ResidualSequenceFlow
from iresflow.nn.causal import CausalTransformer
from iresflow.nn.mlp import LipschitzMLP
from iresflow.nn.positional import (
    LearnedPositionalEncoding,
    PositionalBranch,
    SinusoidalPositionalEncoding,
)
from iresflow.nn.recurrent import CausalGRU
from iresflow.transforms.actnorm import ActNorm
from tests.oracles import MixingBranch, jacobian, jacobian_logdet


def _mask(lengths: list[int], n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]


def _model(device, dtype, *, features=2, seq_len=3, **kwargs) -> ResidualSequenceFlow:
    """A tiny model with ActNorm initialised on shifted, scaled data, in eval mode.

    The recipe is the attention Transformer (``attention`` and ``mlp`` layers, no autoregressive
    layer, a standard normal base: the oracles below write its density) unless ``kwargs`` say
    otherwise.
    """
    options = {"n_blocks": 1, "hidden": 8, "max_len": 6, "ar_order": 0,
               "layers": ("attention", "mlp"), "base": "normal"} | kwargs
    model = ResidualSequenceFlow(features=features, **options).to(device=device, dtype=dtype)
    data = torch.randn(8, seq_len, features, device=device, dtype=dtype) * 1.7 + 0.3
    model.train().log_prob(data, method="exact")
    return model.eval()


def _oracle_log_prob(model, x, mask):
    """Base log-density of the noise plus the dense-Jacobian log-det of the whole flow."""
    z = model.transform_to_noise(x, mask)
    base = -0.5 * z.square().sum(-1) - 0.5 * z.shape[-1] * math.log(2 * math.pi)
    if mask is not None:
        base = base * mask
    logdet = jacobian_logdet(lambda t, m: model.transform_to_noise(t, m), x, mask)
    return base.sum(-1) + logdet


CONFIGS = [
    {"attention": "l2", "positional": "sinusoidal"},
    {"attention": "l2", "positional": "learned", "n_blocks": 2},
    {"attention": "lipschitznorm", "positional": "sinusoidal"},
    {"layers": ("mlp",)},
    {"layers": ("conv", "mlp"), "ar_order": 2},
    {"layers": ("attention", "conv", "mix"), "ar_order": 1, "kernel_size": 5},
    {"layers": ("relative", "mlp"), "ar_order": 1, "relative_window": 2},
    {"layers": ("conv", "mlp"), "ar_order": 1, "n_blocks": 2, "dilation": 2},
]


def _config_id(config: dict) -> str:
    return "-".join("+".join(v) if isinstance(v, tuple) else str(v) for v in config.values())


@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
def test_exact_log_prob_matches_dense_jacobian_oracle(device, dtype, config):
    model = _model(device, dtype, **config)
    x = torch.randn(3, 3, 2, device=device, dtype=dtype)
    mask = _mask([3, 2, 1], 3, device)
    tol = 1e-10 if dtype == torch.float64 else 1e-3
    for m in (mask, None):
        expected = _oracle_log_prob(model, x, m)
        torch.testing.assert_close(model.log_prob(x, m, method="exact"), expected, atol=tol,
                                   rtol=tol)


def test_relative_bias_model_is_exact_invertible_and_certified(device, dtype):
    # A learned relative bias (docs/math.md#relative-bias), moved away from zero, with a mask
    # that has a gap: exact log-density against the dense oracle, inverse, certificate.
    model = _model(device, dtype, relative_window=1, seq_len=4)
    attention = model.transform.steps[1].branch.branch.attention
    assert attention.relative_bias.shape == (2, 3)  # 2 heads for 2 features, offsets -1..1
    with torch.no_grad():
        attention.relative_bias.uniform_(-3, 3)
    x = torch.randn(2, 4, 2, device=device, dtype=dtype) * 2
    mask = torch.tensor([[True, False, True, True], [True, True, True, False]], device=device)
    tol = 1e-10 if dtype == torch.float64 else 1e-3
    torch.testing.assert_close(model.log_prob(x, mask, method="exact"),
                               _oracle_log_prob(model, x, mask), atol=tol, rtol=tol)
    x_back = model.inverse(model.transform_to_noise(x, mask), mask)
    torch.testing.assert_close(x_back, x, atol=100 * tol, rtol=100 * tol)
    for row in model.lipschitz_report(4):
        assert row["estimate"] <= row["certified"] * (1 + 1e-6)


def test_exact_chunking_does_not_change_the_result(device, dtype):
    model = _model(device, dtype)
    x = torch.randn(5, 3, 2, device=device, dtype=dtype)
    mask = _mask([3, 1, 2, 3, 2], 3, device)
    whole = model.log_prob(x, mask, method="exact")
    torch.testing.assert_close(model.log_prob(x, mask, method="exact", chunk_size=2), whole)


@pytest.mark.parametrize("config", CONFIGS[:2] + CONFIGS[3:],
                         ids=lambda c: "-".join(map(str, c.values())))
def test_inverse_of_forward_is_identity(device, dtype, config):
    model = _model(device, dtype, **config)
    x = torch.randn(3, 4, 2, device=device, dtype=dtype) * 2
    mask = _mask([4, 2, 1], 4, device)
    z = model.transform_to_noise(x, mask)
    x_back = model.inverse(z, mask)
    tol = 1e-8 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(x_back, x, atol=tol, rtol=tol)
    assert torch.equal(z[~mask], x[~mask]) and torch.equal(x_back[~mask], x[~mask])
    diagnostics = model.inverse_diagnostics()
    assert diagnostics["converged"]
    assert len(diagnostics["blocks"]) == len(model.lipschitz_report())
    assert diagnostics["max_iterations"] == max(b["max_iterations"] for b in diagnostics["blocks"])


def test_chunked_exact_training_initialises_actnorm_from_the_whole_batch(device, dtype):
    model = ResidualSequenceFlow(features=2, n_blocks=1, hidden=8, max_len=4).to(device=device,
                                                                            dtype=dtype)
    x = torch.randn(5, 4, 2, device=device, dtype=dtype) * 3 + 1
    mask = _mask([4, 1, 2, 3, 4], 4, device)
    model.train().log_prob(x, mask, method="exact", chunk_size=1)
    first = model.transform.steps[0]
    reference = ActNorm(2).to(device=device, dtype=dtype).train()
    reference.initialize(x[mask])
    torch.testing.assert_close(first.shift, reference.shift)
    torch.testing.assert_close(first.log_scale, reference.log_scale)


def test_inverse_diagnostics_before_any_inverse_raises(device, dtype):
    with pytest.raises(RuntimeError, match="no inverse"):
        _model(device, dtype).inverse_diagnostics()


def test_padding_never_changes_a_sequence_log_prob(device, dtype):
    model = _model(device, dtype, n_blocks=2)
    x = torch.randn(2, 3, 2, device=device, dtype=dtype)
    reference = model.log_prob(x, method="exact")
    padded = torch.cat([x, 50 * torch.randn(2, 2, 2, device=device, dtype=dtype)], dim=1)
    mask = _mask([3, 3], 5, device)
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(model.log_prob(padded, mask, method="exact"), reference,
                               atol=tol, rtol=tol)
    # The noise of the real tokens does not depend on the padding either.
    torch.testing.assert_close(model.transform_to_noise(padded, mask)[:, :3],
                               model.transform_to_noise(x), atol=tol, rtol=tol)


def test_without_attention_frames_are_independent(device, dtype):
    model = _model(device, dtype, layers=("mlp",), n_blocks=2)
    x = torch.randn(2, 4, 2, device=device, dtype=dtype)
    per_frame = model.log_prob(x.reshape(8, 1, 2), method="exact").reshape(2, 4).sum(1)
    torch.testing.assert_close(model.log_prob(x, method="exact"), per_frame)


@pytest.mark.parametrize("shape", [(1, 1), (2, 1), (1, 2)])
def test_density_integrates_to_one(device, dtype, shape):
    if dtype != torch.float64:
        pytest.skip("quadrature check in float64 only")
    n, d = shape
    k = n * d
    model = _model(device, dtype, features=d, seq_len=n, max_len=2, n_blocks=2)
    # Integration box: the bounding box of the image of the noise cube [-7, 7]^k, which holds
    # all but ~1e-11 of the mass (the flow is a homeomorphism, so the image of the cube is
    # bounded by the image of its boundary).
    edge = torch.linspace(-7.0, 7.0, 201, device=device, dtype=dtype)
    if k == 1:
        boundary = torch.tensor([[-7.0], [7.0]], device=device, dtype=dtype)
    else:
        side = torch.full_like(edge, 7.0)
        boundary = torch.cat([torch.stack([edge, s * side], -1) for s in (-1, 1)]
                             + [torch.stack([s * side, edge], -1) for s in (-1, 1)])
    corners = model.inverse(boundary.reshape(-1, n, d)).reshape(-1, k)
    points = 1201 if k == 1 else 241
    grids = [torch.linspace(lo.item(), hi.item(), points, device=device, dtype=dtype)
             for lo, hi in zip(corners.amin(0), corners.amax(0), strict=True)]
    axes = torch.meshgrid(*grids, indexing="ij")
    x = torch.stack([a.reshape(-1) for a in axes], dim=-1).reshape(-1, n, d)
    with torch.no_grad():
        density = model.log_prob(x, method="exact").exp().reshape([points] * k)
    for grid in grids:
        density = torch.trapezoid(density, grid, dim=0)
    assert density.item() == pytest.approx(1.0, abs=1e-3)


def test_sample_shapes_masks_and_reproducibility(device, dtype):
    model = _model(device, dtype)
    x, mask = model.sample(5, seq_len=4, generator=torch.Generator(device).manual_seed(1))
    assert x.shape == (5, 4, 2) and mask.shape == (5, 4) and bool(mask.all())
    again, _ = model.sample(5, seq_len=4, generator=torch.Generator(device).manual_seed(1))
    assert torch.equal(x, again)
    lengths = torch.tensor([1, 3, 2, 3], device=device)
    x, mask = model.sample(4, lengths=lengths, generator=torch.Generator(device).manual_seed(2))
    assert x.shape == (4, 3, 2)
    assert torch.equal(mask, _mask([1, 3, 2, 3], 3, device))
    assert bool((x[~mask] == 0).all()) and bool(torch.isfinite(x).all())
    # The samples map back to the drawn noise (zero at padding).
    z = torch.randn(4, 3, 2, generator=torch.Generator(device).manual_seed(2), device=device,
                    dtype=dtype)
    z = torch.where(mask.unsqueeze(-1), z, 0.0)
    tol = 1e-8 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(model.transform_to_noise(x, mask), z, atol=tol, rtol=tol)
    cold, _ = model.sample(4, lengths=lengths, generator=torch.Generator(device).manual_seed(2),
                           temperature=1e-3)
    torch.testing.assert_close(model.transform_to_noise(cold, mask), 1e-3 * z, atol=tol,
                               rtol=tol)


@pytest.mark.parametrize("method", [None, "exact"])
@pytest.mark.parametrize("config", CONFIGS[1:3] + CONFIGS[4:], ids=_config_id)
def test_every_parameter_gets_a_gradient(device, dtype, method, config):
    model = ResidualSequenceFlow(features=2, hidden=8, max_len=4, **(config | {"n_blocks": 2}))
    model = model.to(device=device, dtype=dtype)
    x = torch.randn(4, 3, 2, device=device, dtype=dtype)
    mask = _mask([3, 2, 3, 1], 3, device)
    model.log_prob(x, mask, method=method).mean().neg().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and bool(p.grad.abs().sum() > 0), name


def test_save_load_round_trip(device, dtype):
    model = _model(device, dtype, positional="learned", n_blocks=2)  # a table shared by 2 blocks
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    config = json.loads(json.dumps(model.config.to_dict()))
    rebuilt = ResidualSequenceFlow(**config).to(device=device, dtype=dtype)
    rebuilt.load_state_dict(model.state_dict())
    x = torch.randn(3, 4, 2, device=device, dtype=dtype)
    mask = _mask([4, 2, 3], 4, device)
    assert torch.equal(rebuilt.eval().log_prob(x, mask, method="exact"),
                       model.log_prob(x, mask, method="exact"))
    # A training forward of the loaded model does not re-initialise its ActNorms.
    state = {k: v.clone() for k, v in rebuilt.state_dict().items() if "shift" in k}
    rebuilt.train().log_prob(5 * x + 3, mask, method="exact")
    for key, value in state.items():
        assert torch.equal(rebuilt.state_dict()[key], value), key


def test_transform_is_the_flow(device, dtype):
    model = _model(device, dtype, logdet="exact")
    x = torch.randn(3, 4, 2, device=device, dtype=dtype)
    mask = _mask([4, 1, 3], 4, device)
    z, logdet = model.transform(x, mask=mask)
    torch.testing.assert_close(z, model.transform_to_noise(x, mask))
    torch.testing.assert_close(model.log_prob(x, mask), _oracle_log_prob(model, x, mask))
    base = torch.distributions.Normal(0.0, 1.0).log_prob(z).sum(-1) * mask
    torch.testing.assert_close(model.log_prob(x, mask), base.sum(-1) + logdet)


def test_exact_and_roulette_agree_within_four_standard_errors(device, dtype):
    model = ResidualSequenceFlow(features=2, n_blocks=1, hidden=8, max_len=4).to(device=device,
                                                                            dtype=dtype)
    data = torch.randn(16, 4, 2, device=device, dtype=dtype) @ torch.tensor(
        [[1.0, 0.8], [0.0, 0.5]], device=device, dtype=dtype)
    optimiser = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(5):
        optimiser.zero_grad()
        model.log_prob(data).mean().neg().backward()
        optimiser.step()
    model.eval()
    x, mask = data[:4], _mask([4, 3, 2, 4], 4, device)
    exact = model.log_prob(x, mask, method="exact")
    estimate, stderr = model.log_prob(x, mask, method="roulette", n_samples=30,
                                      return_stderr=True)
    assert bool((stderr > 0).all())
    assert bool(((estimate - exact).abs() <= 4 * stderr + 1e-9).all())
    exact_again, zero = model.log_prob(x, mask, method="exact", return_stderr=True)
    assert torch.equal(exact_again, exact) and not bool(zero.any())


def test_lipschitz_report(device, dtype):
    model = _model(device, dtype, n_blocks=2, coeff=0.8)
    report = model.lipschitz_report(seq_len=4, generator=torch.Generator(device).manual_seed(0))
    assert [r["name"] for r in report] == [
        "block0.attention", "block0.mlp", "block1.attention", "block1.mlp"
    ]
    assert [r["norm"] for r in report] == ["inf", "2", "inf", "2"]
    assert report[1]["type"] == "LipschitzMLP"
    slack = 1e-9 if dtype == torch.float64 else 1e-6
    for r in report:
        assert 0 < r["estimate"] <= r["certified"] <= 0.8 + slack
    assert report[0]["raw_bound"] > 0 and report[1]["raw_bound"] is None
    # The estimate is the local Jacobian norm of the branch at random inputs: check one by hand.
    branch = model.transform.steps[1].branch
    probe = torch.randn(4, 4, 2, generator=torch.Generator(device).manual_seed(0), device=device,
                        dtype=dtype)
    jac = jacobian(lambda t, m: branch(t, m), probe)
    assert report[0]["estimate"] == pytest.approx(jac.abs().sum(-1).amax().item(), rel=1e-9)


def test_lipschitz_report_describes_the_evaluation_mode_model(device, dtype):
    model = ResidualSequenceFlow(features=2, n_blocks=1, hidden=8, max_len=4, coeff=0.8,
                                    spectral_norm="power", ar_order=0,
                                    layers=("attention", "mlp"))
    model = model.to(device=device, dtype=dtype).train()
    # Weights far from the power iteration's state: training-mode estimates would exceed 0.8.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("weight"):
                p.copy_(5 * torch.randn_like(p))
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    report = model.lipschitz_report(seq_len=3, n_inputs=1)
    assert model.training
    assert all(torch.equal(v, buffers[k]) for k, v in model.named_buffers())
    slack = 1e-9 if dtype == torch.float64 else 1e-6
    assert max(r["certified"] for r in report) <= 0.8 + slack
    with torch.no_grad():  # the training-mode certificate lags behind the weights
        assert float(model.transform.steps[3].branch.lipschitz_constant()) > 0.8 + 1e-3


def test_config_and_defaults(device, dtype):
    model = ResidualSequenceFlow(features=12, n_blocks=4, max_len=512,
                                    layers=("attention", "mlp"), ar_order=0, base="normal")
    assert model.config.to_dict() == {
        "features": 12, "n_blocks": 4, "hidden": 64, "heads": None, "coeff": 0.9,
        "attention": "l2", "positional": "sinusoidal", "max_len": 512, "logdet": "roulette",
        "n_power_iterations": 1, "spectral_norm": "exact", "ar_order": 0, "volatility": 0,
        "layers": ("attention", "mlp"), "kernel_size": 3, "dilation": 1, "causal": False,
        "base": "normal",
        "context_features": 0, "num_classes": 0, "relative_window": None,
        "position_norm": "auto", "conditioner": "transformer",
    }
    assert type(model.base) is StandardNormalSequence
    heavy = ResidualSequenceFlow(model.config, base="multivariate-t").base
    assert isinstance(heavy, StudentTSequence) and heavy.group == "frame"
    assert model.config.resolved_heads == 4
    assert model.config == ModelConfig(features=12, n_blocks=4, max_len=512,
                                       layers=("attention", "mlp"), ar_order=0, base="normal")
    default = ResidualSequenceFlow(features=12, max_len=8).base
    assert isinstance(default, StudentTSequence) and default.group == "sequence"
    assert ResidualSequenceFlow(**model.config.to_dict()).config == model.config
    assert ResidualSequenceFlow(model.config, hidden=8).config == model.config.replace(hidden=8)
    assert [default_heads(d) for d in (1, 2, 3, 4, 5, 6, 12)] == [1, 2, 3, 4, 1, 3, 4]
    assert len(model.lipschitz_report(seq_len=2, n_inputs=1)) == 8
    none = ResidualSequenceFlow(features=3, n_blocks=3, layers=("mlp",), ar_order=0,
                                   max_len=16)
    assert len(none.lipschitz_report()) == 3


def test_bad_inputs_raise(device, dtype):
    model = _model(device, dtype, positional="learned")
    x = torch.randn(2, 3, 2, device=device, dtype=dtype)
    with pytest.raises(ValueError, match="2 features"):
        model.log_prob(torch.randn(2, 3, 3, device=device, dtype=dtype))
    with pytest.raises(ValueError, match=r"\(B, N, D\)"):
        model.log_prob(x[:, 0])
    with pytest.raises(ValueError, match="max_len"):
        model.log_prob(torch.randn(1, 7, 2, device=device, dtype=dtype))
    with pytest.raises(TypeError, match="bool"):
        model.log_prob(x, torch.ones(2, 3, device=device))
    with pytest.raises(ValueError, match="NaN"):
        model.transform_to_noise(torch.full_like(x, float("inf")))
    with pytest.raises(ValueError, match="method"):
        model.log_prob(x, method="series")
    with pytest.raises(ValueError, match="n_samples >= 2"):
        model.log_prob(x, method="roulette", return_stderr=True)
    with pytest.raises(ValueError, match="deterministic"):
        model.log_prob(x, method="exact", n_samples=3)
    with pytest.raises(ValueError, match="n_samples"):
        model.log_prob(x, n_samples=0)
    with pytest.raises(ValueError, match="exactly one"):
        model.sample(2)
    with pytest.raises(ValueError, match="exactly one"):
        model.sample(2, seq_len=2, lengths=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"lengths must lie"):
        model.sample(2, lengths=torch.tensor([1, 7]))
    with pytest.raises(TypeError, match="integer"):
        model.sample(2, lengths=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="temperature"):
        model.sample(2, seq_len=2, temperature=0.0)
    with pytest.raises(ValueError, match="max_len"):
        model.lipschitz_report(seq_len=7)
    with pytest.raises(ValueError, match="heads"):
        ResidualSequenceFlow(features=4, heads=3)
    with pytest.raises(ValueError, match="attention"):
        ResidualSequenceFlow(features=4, attention="dot")
    with pytest.raises(ValueError, match="positional"):
        ResidualSequenceFlow(features=4, positional="rotary")
    with pytest.raises(ValueError, match="coeff"):
        ResidualSequenceFlow(features=4, coeff=1.0)
    with pytest.raises(ValueError, match="logdet"):
        ResidualSequenceFlow(features=4, logdet="hutchinson")
    with pytest.raises(ConfigError, match="features"):
        ResidualSequenceFlow(features=4.0, max_len=4)
    with pytest.raises(ConfigError, match="max_len"):
        ResidualSequenceFlow(features=4)
    with pytest.raises(ConfigError, match="unknown option"):
        ResidualSequenceFlow(features=4, max_len=4, blocks=2)
    with pytest.raises(TypeError, match="config"):
        ResidualSequenceFlow(4)


# ------------------------------------------------------------------------------------------
# positional encodings


def test_sinusoidal_table_matches_the_formula(device, dtype):
    table = SinusoidalPositionalEncoding(5)(torch.zeros(1, 7, 5, device=device, dtype=dtype))
    expected = [
        [
            math.sin(n / 10000 ** (d / 5)) if d % 2 == 0 else math.cos(n / 10000 ** ((d - 1) / 5))
            for d in range(5)
        ]
        for n in range(7)
    ]
    torch.testing.assert_close(table, torch.tensor(expected, device=device, dtype=dtype))


def test_learned_table_rejects_longer_sequences(device, dtype):
    encoding = LearnedPositionalEncoding(3, max_len=4).to(device=device, dtype=dtype)
    assert encoding(torch.zeros(2, 4, 3, device=device, dtype=dtype)).shape == (4, 3)
    with pytest.raises(ValueError, match="max_len=4"):
        encoding(torch.zeros(2, 5, 3, device=device, dtype=dtype))
    with pytest.raises(ValueError, match=r"\(B, N, 3\)"):
        encoding(torch.zeros(2, 5, 2, device=device, dtype=dtype))


@pytest.mark.parametrize("inner", ["mlp", "mixing"])
def test_positional_branch_is_a_translated_branch(device, dtype, inner):
    if inner == "mlp":
        branch = LipschitzMLP((3, 8, 3), coeff=0.9).to(device=device, dtype=dtype).eval()
    else:
        branch = MixingBranch(3, 0.7, max_len=5, dtype=dtype, device=device)
    encoding = LearnedPositionalEncoding(3, max_len=5, init_std=1.0).to(device=device,
                                                                       dtype=dtype)
    wrapped = PositionalBranch(branch, encoding)
    assert wrapped.position_wise == branch.position_wise and wrapped.norm == branch.norm
    assert torch.equal(wrapped.lipschitz_constant(5), branch.lipschitz_constant(5))
    x = torch.randn(2, 5, 3, device=device, dtype=dtype)
    mask = _mask([5, 3], 5, device)
    shifted = x + encoding.table
    out = wrapped(x, mask)
    torch.testing.assert_close(out, branch(shifted, mask))
    assert bool((out[~mask] == 0).all())
    torch.testing.assert_close(jacobian(wrapped, x, mask), jacobian(branch, shifted, mask))


def test_positional_branch_rejects_non_branches():
    with pytest.raises(TypeError, match="LipschitzBranch"):
        PositionalBranch(torch.nn.Identity(), SinusoidalPositionalEncoding(2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="encoding"):
        PositionalBranch(LipschitzMLP((2, 2)), lambda x: x)  # type: ignore[arg-type]


@pytest.mark.parametrize("conditioner", ["transformer", "gru"])
@pytest.mark.parametrize("conditional", [False, True])
@pytest.mark.parametrize("step_kind", ["autoregressive", "maf"])
def test_autoregressive_layers_mix_with_residual_steps(device, dtype, conditional, conditioner,
                                                       step_kind):
    # The autoregressive step kinds in a block recipe: exact log-density against the dense
    # Jacobian of the whole flow, an exact inverse by Jacobi sweeps, gradients everywhere.
    model = ResidualSequenceFlow(
        features=2, hidden=8, max_len=5, n_blocks=2, ar_order=1, base="normal",
        layers=(step_kind, "conv"), num_classes=2 if conditional else 0,
        conditioner=conditioner,
    ).to(device=device, dtype=dtype)
    steps = dict(model.transform.named_steps())
    steps["block0.autoregressive"], steps["block1.autoregressive"] = (
        steps[f"block0.{step_kind}"], steps[f"block1.{step_kind}"])
    assert "block0.autoregressive.actnorm" not in steps  # a step kind, not a residual one
    kind = CausalGRU if conditioner == "gru" else CausalTransformer
    assert isinstance(steps["block0.autoregressive"].conditioner, kind)
    # a maf layer conditions within frames, the order of the features reversed in block 1
    nets = [steps[f"block{i}.autoregressive"].frame_net for i in (0, 1)]
    assert ([net.reverse for net in nets] == [False, True] if step_kind == "maf"
            else nets == [None, None])
    bound = MAF_MAX_LOG_SCALE if step_kind == "maf" else 3.0  # a maf step's scales are tighter
    assert [steps[f"block{i}.autoregressive"].max_log_scale for i in (0, 1)] == [bound] * 2
    x = torch.randn(3, 5, 2, device=device, dtype=dtype) * 1.5 + 0.2
    mask = torch.tensor([[True] * 5, [True, True, False, True, True], [True] * 2 + [False] * 3],
                        device=device)
    context = {"context": torch.tensor([0, 1, 1], device=device)} if conditional else {}
    model.initialize(x, mask, **context)
    with torch.no_grad():  # away from the identity the steps start as, and the context's zeros
        for name, p in model.named_parameters():
            if any(part in name for part in ("conditioner", "frame_net", "context", "embedding")):
                p.add_(0.2 * torch.randn_like(p))
    model.log_prob(x, mask, method="exact", **context).mean().neg().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and bool(p.grad.abs().sum() > 0), name
    model.eval()

    def chain(t, m, b):
        c = {"context": context["context"][b : b + 1]} if conditional else {}
        return model.transform_to_noise(t, m, **c)

    z = model.transform_to_noise(x, mask, **context)
    base = (-0.5 * z.square().sum(-1) - math.log(2 * math.pi)) * mask
    logdet = torch.cat([jacobian_logdet(lambda t, m, b=b: chain(t, m, b), x[b : b + 1],
                                        mask[b : b + 1]) for b in range(3)])
    tol = 1e-10 if dtype == torch.float64 else 1e-3
    torch.testing.assert_close(model.log_prob(x, mask, method="exact", **context),
                               base.sum(-1) + logdet, atol=tol, rtol=tol)
    x_back = model.inverse(z, mask, **context)
    torch.testing.assert_close(x_back, x, atol=1e3 * tol, rtol=1e3 * tol)
    sweeps = steps["block1.autoregressive"].last_inverse_stats.iterations
    assert int(sweeps.max()) <= 6  # at most N + 1 sweeps
    reported = {block["name"]: block for block in model.inverse_diagnostics()["blocks"]}
    assert reported[f"block1.{step_kind}"]["max_iterations"] == int(sweeps.max())
    assert {f"block0.{step_kind}", "block0.conv", "block1.conv"} <= set(reported)


def test_the_former_name_still_builds_the_model_with_a_warning():
    import iresflow.models

    with pytest.warns(DeprecationWarning, match="now ResidualSequenceFlow"):
        cls = iresflow.models.ResidualFlowTransformer
    assert cls is ResidualSequenceFlow
    with pytest.raises(AttributeError, match="no attribute 'ResidualFlowTransformers'"):
        iresflow.models.ResidualFlowTransformers  # noqa: B018


def test_conv_dilation_grows_by_block_and_restarts_within_the_longest_sequence():
    model = ResidualSequenceFlow(features=2, max_len=20, n_blocks=6, dilation=2, ar_order=0)
    convs = [step.branch for name, step in model.residual_steps() if name.endswith(".conv")]
    assert [conv.dilation for conv in convs] == [1, 2, 4, 8, 1, 2]
    assert [conv.receptive_radius for conv in convs] == [2, 4, 8, 16, 2, 4]
    causal = ResidualSequenceFlow(features=2, max_len=20, n_blocks=2, dilation=3, causal=True)
    assert [step.branch.receptive_radius for name, step in causal.residual_steps()
            if name.endswith(".conv")] == [4, 12]
    assert ModelConfig(features=2, max_len=20, dilation=2, kernel_size=1).block_dilation(3) == 1
    assert ModelConfig(features=2, max_len=20).block_dilation(5) == 1
    with pytest.raises(ConfigError, match="dilation must be >= 1"):
        ModelConfig(dilation=0)
    with pytest.raises(ConfigError, match="max_len must be set"):
        ModelConfig(dilation=2).block_dilation(1)
