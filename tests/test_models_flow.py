"""SequenceFlow (a chain plus a base) and its base density (docs/math.md#change-of-variables).

Oracles: a dense autograd Jacobian with ``slogdet`` for the density, ``torch.distributions`` for
the base, ``torch.autograd.functional.jacobian`` for ``torch.func``; counted host reads for the
hot path of a training step. A second base written here (a diagonal normal with a learned
mean and scale, optionally shifted by the context) checks that any ``SequenceBase`` plugs in.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn

import iresflow
from iresflow.data.datasets import load_dataset
from iresflow.logdet.roulette import RouletteLogDet
from iresflow.models.config import ModelConfig
from iresflow.models.distributions import SequenceBase, StandardNormalSequence
from iresflow.models.flow import SequenceFlow
from iresflow.models.residual_flow import ResidualSequenceFlow
from iresflow.nn.conditional import ConditionalBranch, ContextEncoder
from iresflow.nn.linear import SpectralLinear
from iresflow.nn.mlp import LipschitzMLP
from iresflow.transforms.actnorm import ActNorm
from iresflow.transforms.composite import SequenceCompositeTransform
from iresflow.transforms.conditional import ConditionalAffine
from iresflow.transforms.residual import ResidualTransform
from tests.oracles import MixingBranch, count_host_reads, jacobian_logdet


def _mask(lengths: list[int], n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]


class DiagonalNormalSequence(SequenceBase):
    """Independent normal frames, mean ``loc + c W`` and standard deviation ``exp(log_scale)``."""

    def __init__(self, features: int, context_features: int = 0) -> None:
        super().__init__()
        self.features = features
        self.loc = nn.Parameter(0.5 * torch.randn(features))
        self.log_scale = nn.Parameter(0.3 * torch.randn(features))
        self.weight = nn.Parameter(torch.randn(context_features, features))

    def mean(self, context: Tensor | None, batch: int) -> Tensor:
        """``(B, 1, D)``: the mean of every sequence's frames."""
        loc = self.loc.expand(batch, -1)
        return (loc if context is None else loc + context @ self.weight).unsqueeze(1)

    def log_prob(self, z, mask=None, context=None):
        u = (z - self.mean(context, z.shape[0])) * torch.exp(-self.log_scale)
        per_frame = (-0.5 * u.square() - self.log_scale - 0.5 * math.log(2 * math.pi)).sum(-1)
        return (per_frame if mask is None else per_frame * mask).sum(-1)

    def sample(self, mask, generator=None, temperature=1.0, *, context=None, dtype=None):
        noise = torch.randn(*mask.shape, self.features, generator=generator, dtype=dtype)
        z = self.mean(context, mask.shape[0]) + temperature * torch.exp(self.log_scale) * noise
        return torch.where(mask.unsqueeze(-1), z, 0.0)


def _flow(device, dtype, base: SequenceBase | None = None) -> SequenceFlow:
    """ActNorm, a position-wise and a mixing residual block; ActNorm initialised, eval mode."""
    chain = SequenceCompositeTransform(
        [ActNorm(3), ResidualTransform(LipschitzMLP((3, 8, 3), coeff=0.9), logdet="exact"),
         ResidualTransform(MixingBranch(3, 0.7, max_len=5, dtype=dtype, device=device),
                           logdet="exact")],
        names=["actnorm", "mlp", "mixing"],
    )
    flow = SequenceFlow(chain, base, features=3, max_len=5).to(device=device, dtype=dtype)
    flow.initialize(torch.randn(6, 4, 3, device=device, dtype=dtype) * 2 + 1)
    return flow.eval()


def _conditional_chain(device, dtype, *tail) -> SequenceCompositeTransform:
    """ActNorm and a residual block whose branch takes a context of size 2."""
    branch = ConditionalBranch(LipschitzMLP((3, 8, 3), coeff=0.9), 2)
    steps = [ActNorm(3), ResidualTransform(branch, logdet="exact"), *tail]
    return SequenceCompositeTransform(steps).to(device=device, dtype=dtype)


def _model(device, dtype, **settings) -> ResidualSequenceFlow:
    options = {"features": 2, "n_blocks": 1, "hidden": 8, "max_len": 5, "ar_order": 0,
               "layers": ("attention", "mlp")} | settings
    model = ResidualSequenceFlow(**options).to(device=device, dtype=dtype)
    model.initialize(torch.randn(6, 4, 2, device=device, dtype=dtype) * 1.5 + 0.3)
    return model


def test_log_prob_is_base_plus_dense_jacobian_logdet(device, dtype):
    flow = _flow(device, dtype)
    x = torch.randn(3, 4, 3, device=device, dtype=dtype)
    mask = _mask([4, 2, 1], 4, device)
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    for m in (mask, None):
        z = flow.transform_to_noise(x, m)
        normal = torch.distributions.Normal(0.0, 1.0).log_prob(z).sum(-1)
        base = (normal if m is None else normal * m).sum(-1)
        expected = base + jacobian_logdet(lambda t, mb: flow.transform_to_noise(t, mb), x, m)
        for method in (None, "exact"):
            torch.testing.assert_close(flow.log_prob(x, m, method=method), expected, atol=tol,
                                       rtol=tol)


def test_log_prob_with_another_base_is_its_density_plus_dense_jacobian_logdet(device, dtype):
    base = DiagonalNormalSequence(3)
    flow = _flow(device, dtype, base)
    x = torch.randn(3, 4, 3, device=device, dtype=dtype)
    mask = _mask([4, 2, 1], 4, device)
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    normal = torch.distributions.Normal(base.loc, base.log_scale.exp())
    for m in (mask, None):
        z = flow.transform_to_noise(x, m)
        density = normal.log_prob(z).sum(-1)
        expected = (density if m is None else density * m).sum(-1)
        expected = expected + jacobian_logdet(lambda t, mb: flow.transform_to_noise(t, mb), x, m)
        for method in (None, "exact"):
            torch.testing.assert_close(flow.log_prob(x, m, method=method).detach(),
                                       expected.detach(), atol=tol, rtol=tol)
    flow.log_prob(x, mask).sum().backward()
    assert all(bool(p.grad.abs().sum() > 0) for p in (base.loc, base.log_scale))


def test_sampling_and_inverse_with_another_base(device, dtype):
    base = DiagonalNormalSequence(3)
    flow = _flow(device, dtype, base)
    lengths = torch.tensor([4, 2, 3], device=device)
    x, mask = flow.sample(3, lengths=lengths, generator=torch.Generator(device).manual_seed(1),
                          temperature=0.5)
    assert torch.equal(mask, _mask([4, 2, 3], 4, device)) and not bool(x[~mask].any())
    with torch.no_grad():
        z = base.sample(mask, torch.Generator(device).manual_seed(1), 0.5, dtype=dtype)
    tol = 1e-8 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(flow.transform_to_noise(x, mask), z, atol=tol, rtol=tol)
    torch.testing.assert_close(flow.inverse(z, mask), x, atol=tol, rtol=tol)
    # Sequences of one length are inverted without masking: the same values to the last bit.
    full, everywhere = flow.sample(3, seq_len=4, generator=torch.Generator(device).manual_seed(2))
    with torch.no_grad():
        z = base.sample(everywhere, torch.Generator(device).manual_seed(2), dtype=dtype)
        assert torch.equal(full, flow.transform.inverse(z, mask=everywhere, logdet=False)[0])
    assert torch.equal(flow.inverse(z, everywhere), full)  # the public inverse alike


def test_a_conditional_base_receives_the_context_vector(device):
    dtype = torch.float64
    base = DiagonalNormalSequence(3, context_features=2)
    flow = SequenceFlow(_conditional_chain(device, dtype), base, features=3,
                        context_encoder=ContextEncoder(2, num_classes=3)).to(device, dtype)
    labels = torch.tensor([0, 2, 1], device=device)
    x = torch.randn(3, 4, 3, device=device, dtype=dtype)
    mask = _mask([4, 2, 3], 4, device)
    flow.initialize(x, mask, context=labels)
    flow.eval()
    z = flow.transform_to_noise(x, mask, context=labels)
    c = flow.context_encoder(labels)
    mean, scale = base.loc + c @ base.weight, base.log_scale.exp()
    for b in range(3):
        frames = torch.distributions.Normal(mean[b], scale).log_prob(z[b]).sum(-1)
        density = (frames * mask[b]).sum()
        jacobian = jacobian_logdet(
            lambda t, mb, b=b: flow.transform_to_noise(t, mb, context=labels[b:b + 1]),
            x[b:b + 1], mask[b:b + 1])
        torch.testing.assert_close(flow.log_prob(x, mask, context=labels)[b].detach(),
                                   (density + jacobian[0]).detach(), atol=1e-10, rtol=1e-10)
    samples, _ = flow.sample(3, seq_len=4, generator=torch.Generator(device).manual_seed(2),
                             context=labels)
    with torch.no_grad():
        noise = base.sample(mask.new_ones(3, 4), torch.Generator(device).manual_seed(2),
                            context=c, dtype=dtype)
    torch.testing.assert_close(flow.transform_to_noise(samples, context=labels), noise,
                               atol=1e-8, rtol=1e-8)


class AffineBase(SequenceBase):
    """A standard normal seen through a ConditionalAffine: the conditional affine as a base."""

    def __init__(self, affine: ConditionalAffine) -> None:
        super().__init__()
        self.features = affine.features
        self.affine = affine
        self.normal = StandardNormalSequence(affine.features)

    def log_prob(self, z, mask=None, context=None):
        y, logabsdet = self.affine(z, context, mask=mask)
        return self.normal.log_prob(y, mask) + logabsdet

    def sample(self, mask, generator=None, temperature=1.0, *, context=None, dtype=None):
        y = self.normal.sample(mask, generator, temperature, dtype=dtype)
        return self.affine.inverse(y, context, mask=mask)[0]


def test_the_conditional_affine_step_and_the_same_map_as_a_base_give_one_density(device):
    dtype = torch.float64
    affine = ConditionalAffine(3, 2).to(device=device, dtype=dtype)
    with torch.no_grad():  # a map away from the identity it starts as
        for parameter in affine.parameters():
            parameter.add_(0.5 * torch.randn_like(parameter))
    step = _conditional_chain(device, dtype, affine)
    encoder = ContextEncoder(2, num_classes=3).to(device=device, dtype=dtype)
    in_chain = SequenceFlow(step, features=3, context_encoder=encoder)
    as_base = SequenceFlow(SequenceCompositeTransform(list(step.steps)[:-1]), AffineBase(affine),
                           features=3, context_encoder=encoder)
    labels = torch.tensor([1, 0, 2], device=device)
    x = torch.randn(3, 4, 3, device=device, dtype=dtype)
    mask = _mask([4, 1, 3], 4, device)
    in_chain.initialize(x, mask, context=labels)
    in_chain.eval()
    as_base.eval()
    torch.testing.assert_close(as_base.log_prob(x, mask, context=labels),
                               in_chain.log_prob(x, mask, context=labels), atol=1e-12, rtol=0)
    draws = [flow.sample(3, seq_len=4, context=labels,
                         generator=torch.Generator(device).manual_seed(3))[0]
             for flow in (in_chain, as_base)]
    torch.testing.assert_close(draws[1], draws[0], atol=1e-12, rtol=0)


def test_methods_call_the_chain(device, dtype):
    flow = _flow(device, dtype)
    x = torch.randn(3, 4, 3, device=device, dtype=dtype)
    mask = _mask([4, 3, 2], 4, device)
    z, logdet = flow.transform(x, mask=mask)
    assert torch.equal(flow.transform_to_noise(x, mask), z)
    torch.testing.assert_close(flow.log_prob(x, mask), flow.base.log_prob(z, mask) + logdet)
    x_back, _ = flow.transform.inverse(z, mask=mask)
    assert torch.equal(flow.inverse(z, mask), x_back)
    assert [name for name, _ in flow.residual_steps()] == ["mlp", "mixing"]
    assert [name for name, _ in flow.transform.named_steps()] == ["actnorm", "mlp", "mixing"]
    assert flow.estimators() == [step.logdet for _, step in flow.residual_steps()]


def test_flow_rejects_bad_construction():
    chain = SequenceCompositeTransform([ActNorm(2)])
    with pytest.raises(TypeError, match="transform"):
        SequenceFlow(ActNorm(2), features=2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="base"):
        SequenceFlow(chain, StandardNormalSequence(3), features=2)
    with pytest.raises(TypeError, match="base"):
        SequenceFlow(chain, nn.Linear(2, 2), features=2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_len"):
        SequenceFlow(chain, features=2, max_len=0)


@pytest.mark.parametrize("logdet", ["roulette", "series"])
def test_maps_and_sampling_leave_the_global_generator_alone(device, dtype, logdet):
    model = _model(device, dtype, logdet=logdet).eval()
    x = torch.randn(3, 4, 2, device=device, dtype=dtype)
    mask = _mask([4, 2, 3], 4, device)
    state = torch.get_rng_state()
    z = model.transform_to_noise(x, mask)
    model.inverse(z, mask)
    model.sample(2, seq_len=3, generator=torch.Generator(device).manual_seed(0))
    model.train()
    model.initialize(x, mask)
    model.transform_to_noise(x, mask)
    assert torch.equal(torch.get_rng_state(), state)


def test_set_generator_reaches_every_estimator_and_reproduces_log_prob(device, dtype):
    model = _model(device, dtype, n_blocks=2).train()
    x = torch.randn(3, 4, 2, device=device, dtype=dtype)
    mask = _mask([4, 2, 3], 4, device)
    values = []
    for _ in range(2):
        generator = torch.Generator(device).manual_seed(7)
        model.set_generator(generator)
        assert all(e.generator is generator for e in model.estimators())
        state = torch.get_rng_state()
        values.append(model.log_prob(x, mask))
        assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(values[0], values[1])
    assert len(model.estimators()) == 4
    assert all(isinstance(e, RouletteLogDet) for e in model.estimators())
    with pytest.raises(TypeError, match="generator"):
        model.set_generator(3)  # type: ignore[arg-type]


def test_initialize_sets_actnorm_from_the_whole_batch_and_nothing_else(device, dtype):
    model = ResidualSequenceFlow(features=2, n_blocks=1, hidden=8, max_len=5,
                                    spectral_norm="power").to(device=device, dtype=dtype).eval()
    x = torch.randn(5, 4, 2, device=device, dtype=dtype) * 3 + 1
    mask = _mask([4, 1, 2, 3, 4], 4, device)
    buffers = {k: v.clone() for k, v in model.named_buffers() if not k.endswith("initialized")}
    model.initialize(x, mask)
    assert not model.training
    assert all(torch.equal(v, buffers[k]) for k, v in model.named_buffers() if k in buffers)
    first = model.transform.steps[0]
    reference = ActNorm(2).to(device=device, dtype=dtype).train()
    reference.initialize(x[mask])
    torch.testing.assert_close(first.shift, reference.shift)
    torch.testing.assert_close(first.log_scale, reference.log_scale)
    assert all(m.is_initialized for m in model.modules() if isinstance(m, ActNorm))
    # Idempotent: initialised ActNorms keep their parameters.
    shift = first.shift.detach().clone()
    model.initialize(5 * x, mask)
    assert torch.equal(first.shift, shift)
    # The power iteration of a training forward still advances afterwards.
    spectral = next(m for m in model.modules() if isinstance(m, SpectralLinear))
    before = {k: v.clone() for k, v in spectral.named_buffers()}
    model.train().log_prob(x, mask)
    assert any(not torch.equal(v, before[k]) for k, v in spectral.named_buffers())


@pytest.mark.parametrize("call", ["log_prob", "transform_to_noise"])
def test_a_training_call_initialises_the_chain_at_the_door_as_initialize_does(device, call):
    """The one lazy initialisation: the data-to-noise methods of a flow in training mode call
    ``initialize`` on their batch while the chain is not initialised; eval mode never does."""
    dtype = torch.float64
    x = torch.randn(5, 4, 2, device=device, dtype=dtype) * 3 + 1
    mask = _mask([4, 1, 2, 3, 4], 4, device)
    models = []
    for _ in range(3):
        torch.manual_seed(0)
        models.append(ResidualSequenceFlow(features=2, n_blocks=1, hidden=8, max_len=5,
                                              ar_order=1)
                      .to(device=device, dtype=dtype))
    explicit, lazy, evaluated = models
    explicit.initialize(x, mask)
    getattr(evaluated.eval(), call)(x, mask)
    assert not evaluated.transform.is_initialized
    assert not lazy.transform.is_initialized
    torch.manual_seed(1)
    got = getattr(lazy, call)(x, mask)
    torch.manual_seed(1)
    expected = getattr(explicit, call)(x, mask)
    assert lazy.transform.is_initialized
    assert torch.equal(got, expected)
    for a, b in zip(lazy.state_dict().values(), explicit.state_dict().values(), strict=True):
        assert torch.equal(a, b)

RECIPES = [
    {"attention": "l2"},
    {"attention": "lipschitznorm"},
    {"layers": ("mlp",)},
    {"layers": ("conv", "mix", "mlp"), "ar_order": 1},
]


@pytest.mark.parametrize("recipe", RECIPES, ids=["l2", "lipschitznorm", "mlp", "temporal"])
def test_jacrev_of_transform_to_noise_matches_autograd_jacobian(device, recipe):
    dtype = torch.float64
    model = _model(device, dtype, positional="learned", **recipe).eval()
    x = torch.randn(2, 4, 2, device=device, dtype=dtype)
    mask = _mask([4, 3], 4, device)

    def noise(t: torch.Tensor) -> torch.Tensor:
        return model.transform_to_noise(t, mask)

    jac = torch.func.jacrev(noise)(x)
    reference = torch.autograd.functional.jacobian(noise, x)
    torch.testing.assert_close(jac, reference, atol=1e-12, rtol=1e-10)
    assert bool(reference.abs().sum() > 0)


def test_a_default_training_step_reads_the_host_at_most_four_times():
    data = load_dataset("japanese_vowels")
    config = ModelConfig(features=data.features, max_len=data.max_len)
    model = ResidualSequenceFlow(config)
    optimiser = torch.optim.Adam(model.parameters())
    x, mask = data.train.x[:8], data.train.mask[:8]

    def step() -> None:
        loss = -model.log_prob(x, mask).sum() / mask.sum()
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()

    for _ in range(2):  # the first step initialises ActNorm; the second is a plain step
        counts = count_host_reads(step)
        assert sum(counts.values()) <= 4, counts
    # The counter sees reads from iresflow code: the entry-point check is one of them.
    assert count_host_reads(lambda: model.transform_to_noise(x, mask))


def test_value_checks_can_be_switched_off(device, dtype):
    model = _model(device, dtype).eval()
    x = torch.randn(2, 4, 2, device=device, dtype=dtype)
    bad = x.clone()
    bad[0, 0, 0] = math.nan
    with pytest.raises(ValueError, match="NaN"):
        model.log_prob(bad)
    with iresflow.value_checks(False):
        assert not count_host_reads(lambda: model.transform_to_noise(x))
        value = model.log_prob(bad)
    assert bool(value[0].isnan()) and bool(value[1:].isfinite().all())
