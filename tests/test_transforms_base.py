"""SequenceTransform's checked and unchecked paths, ``logdet=`` and SequenceCompositeTransform.

Oracles: dense autograd Jacobians (``slogdet``, ``torch.autograd.functional.jacobian``) and the
members applied one by one.
"""

from __future__ import annotations

import nflows.transforms as nft
import pytest
import torch
from oracles import MixingBranch, count_host_reads, jacobian_logdet

from iresflow.logdet.exact import ExactLogDet
from iresflow.logdet.roulette import RouletteLogDet
from iresflow.nn.attention import ContractiveL2MultiheadAttention
from iresflow.nn.mlp import LipschitzMLP
from iresflow.transforms.actnorm import ActNorm
from iresflow.transforms.base import SequenceTransform, check_logdet
from iresflow.transforms.composite import SequenceCompositeTransform
from iresflow.transforms.residual import ResidualTransform

F64 = torch.float64
D = 4  # features (2 attention heads of width 2)


def make_branch(kind: str, device: torch.device):
    if kind == "attention":
        return ContractiveL2MultiheadAttention(D, heads=2, coeff=0.9).to(device=device, dtype=F64)
    if kind == "mixing":
        return MixingBranch(D, 0.8, dtype=F64, device=device)
    return LipschitzMLP((D, 16, D), coeff=0.9).to(device=device, dtype=F64).eval()


def padding_mask(lengths: list[int], n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]


def make_chain(device: torch.device, logdet: str = "roulette") -> SequenceCompositeTransform:
    actnorm = ActNorm(D).to(device=device, dtype=F64)
    actnorm.initialize(torch.randn(5, 3, D, device=device, dtype=F64) * 2 + 1)
    blocks = [ResidualTransform(make_branch(kind, device), logdet=logdet)
              for kind in ("attention", "mlp", "mixing")]
    return SequenceCompositeTransform([actnorm.eval(), *blocks],
                                      names=["norm", "attention", "mlp", "mixing"])


def test_sequence_composite_passes_the_mask(device):
    branches = [make_branch(kind, device) for kind in ("attention", "mlp")]
    blocks = [ResidualTransform(b, logdet="exact") for b in branches]
    chain = SequenceCompositeTransform(blocks)
    assert isinstance(chain, SequenceTransform) and isinstance(chain, nft.Transform)
    x = torch.randn(3, 4, D, device=device, dtype=F64)
    mask = padding_mask([4, 1, 2], 4, device)
    z, logabsdet = chain(x, mask=mask)
    h, first = blocks[0](x, mask=mask)
    expected_z, second = blocks[1](h, mask=mask)
    assert torch.allclose(z, expected_z, atol=1e-14, rtol=0)
    assert torch.allclose(logabsdet, first + second, atol=1e-12, rtol=0)
    oracle = jacobian_logdet(lambda t, m: chain(t, mask=m)[0], x, mask)
    assert torch.allclose(logabsdet, oracle, atol=1e-8, rtol=0)
    x_rec, inverse_logabsdet = chain.inverse(z, mask=mask)
    assert torch.allclose(x_rec, x, atol=1e-9, rtol=0)
    assert torch.allclose(inverse_logabsdet, -logabsdet, atol=1e-9, rtol=0)


def test_sequence_composite_rejects_bad_members(device):
    with pytest.raises(TypeError, match="transforms\\[1\\]"):
        SequenceCompositeTransform([nft.IdentityTransform(), torch.nn.Identity()])
    chain = SequenceCompositeTransform([nft.IdentityTransform()])
    x = torch.randn(2, 3, 2, device=device, dtype=F64)
    assert torch.equal(chain(x)[0], x)
    with pytest.raises(TypeError, match="SequenceTransform"):
        chain(x, mask=padding_mask([3, 2], 3, device))


@pytest.mark.parametrize("direction", ["forward", "inverse"])
@pytest.mark.parametrize("member", ["chain", "actnorm", "residual"])
def test_logdet_false_gives_the_same_map_without_a_log_determinant(device, direction, member):
    chain = make_chain(device)
    transform = {"chain": chain, "actnorm": chain.steps[0], "residual": chain.steps[2]}[member]
    call = transform if direction == "forward" else transform.inverse
    x = torch.randn(3, 4, D, device=device, dtype=F64)
    mask = padding_mask([4, 2, 3], 4, device)
    for m in (mask, None):
        with_logdet, logabsdet = call(x, mask=m)
        state = torch.get_rng_state()
        outputs, nothing = call(x, mask=m, logdet=False)
        assert torch.equal(torch.get_rng_state(), state)  # no estimator, no random draws
        assert nothing is None and logabsdet.shape == (3,)
        torch.testing.assert_close(outputs, with_logdet, atol=1e-12, rtol=0)


def test_an_estimator_passed_as_logdet_reaches_every_residual_block(device):
    chain = make_chain(device, logdet="roulette")
    x = torch.randn(3, 4, D, device=device, dtype=F64)
    mask = padding_mask([4, 1, 3], 4, device)
    _, logabsdet = chain(x, mask=mask, logdet=ExactLogDet())
    oracle = jacobian_logdet(lambda t, m: chain(t, mask=m, logdet=False)[0], x, mask)
    torch.testing.assert_close(logabsdet, oracle, atol=1e-9, rtol=0)
    _, by_name = chain(x, mask=mask, logdet="exact")
    torch.testing.assert_close(by_name, logabsdet, atol=1e-12, rtol=0)


def test_logdet_argument_is_checked(device):
    chain = make_chain(device)
    x = torch.randn(2, 3, D, device=device, dtype=F64)
    assert check_logdet(RouletteLogDet()) is not None and check_logdet(True) is True
    with pytest.raises(TypeError, match="logdet"):
        chain(x, logdet=1)
    with pytest.raises(TypeError, match="logdet"):
        check_logdet(None)
    with pytest.raises(ValueError, match="method"):
        chain(x, logdet="magic")
    with pytest.raises(TypeError, match=r"float32 or torch\.float64"):
        chain.to(torch.bfloat16)(x.to(torch.bfloat16))


def test_named_steps(device):
    chain = make_chain(device)
    assert [name for name, _ in chain.named_steps()] == ["norm", "attention", "mlp", "mixing"]
    assert [step for _, step in chain.named_steps()] == list(chain.steps)
    assert chain.features == D
    with pytest.raises(ValueError, match="names"):
        SequenceCompositeTransform([ActNorm(2)], names=["a", "b"])
    with pytest.raises(ValueError, match="unique"):
        SequenceCompositeTransform([ActNorm(2), ActNorm(2)], names=["a", "a"])


def test_a_chain_validates_once_per_call(device):
    chain = make_chain(device)
    x = torch.randn(3, 4, D, device=device, dtype=F64)
    mask = padding_mask([4, 2, 3], 4, device)
    # One fused value check at the door; none in the members and branches.
    assert sum(count_host_reads(lambda: chain(x, mask=mask, logdet=False)).values()) == 1
    # A roulette block: the check and the draw of its term count.
    assert sum(count_host_reads(lambda: chain.steps[1](x, mask=mask)).values()) == 2
    with pytest.raises(ValueError, match="NaN"):
        chain(x.masked_fill(x > 1, float("nan")), mask=mask)
    with pytest.raises(ValueError, match="no real token"):
        chain(x, mask=padding_mask([4, 0, 3], 4, device))


def test_the_unchecked_entry_is_the_checked_map_without_the_check(device):
    chain = make_chain(device, logdet="exact")
    x = torch.randn(3, 4, D, device=device, dtype=F64)
    mask = padding_mask([4, 2, 3], 4, device)
    for call in (chain, chain.inverse):
        checked = call(x, mask=mask)
        unchecked = call(x, mask=mask, check=False)
        assert all(torch.equal(a, b) for a, b in zip(checked, unchecked, strict=True))
    # The forward map reads no value on the host (the inverse's solver reads its convergence).
    assert not count_host_reads(lambda: chain(x, mask=mask, logdet=False, check=False))
    bad = x.masked_fill(x > 1, float("nan"))
    assert bool(chain(bad, mask=mask, logdet=False, check=False)[0].isnan().any())


def _power_chain(device) -> SequenceCompositeTransform:
    """ActNorm (not initialised), a residual block with power-iteration spectral norms, ActNorm."""
    mlp = LipschitzMLP((D, 16, D), coeff=0.9, sigma="power")
    steps = [ActNorm(D), ResidualTransform(mlp, logdet="exact"), ActNorm(D)]
    return SequenceCompositeTransform(steps).to(device=device, dtype=F64)


def test_chain_initialize_sets_the_data_layers_from_one_pass_and_nothing_else(device):
    chain = _power_chain(device).eval()
    chain.steps[1].train()  # modes are restored member by member
    x = torch.randn(5, 4, D, device=device, dtype=F64) * 3 + 1
    mask = padding_mask([4, 1, 2, 3, 4], 4, device)
    buffers = {k: v.clone() for k, v in chain.named_buffers() if not k.endswith("initialized")}
    modes = {name: m.training for name, m in chain.named_modules()}
    assert not chain.is_initialized and chain.steps[1].is_initialized
    chain.initialize(x, mask)
    assert chain.is_initialized and all(step.is_initialized for step in chain.steps)
    assert {name: m.training for name, m in chain.named_modules()} == modes
    assert all(torch.equal(v, buffers[k]) for k, v in chain.named_buffers() if k in buffers)
    # The oracle: the layers one by one, in training mode, on the real frames.
    first, second = ActNorm(D).to(device, F64), ActNorm(D).to(device, F64)
    first.initialize(x, mask)
    hidden = chain.steps[1](first(x, mask=mask)[0], mask=mask, logdet=False)[0]
    second.initialize(hidden, mask)
    for layer, reference in ((chain.steps[0], first), (chain.steps[2], second)):
        torch.testing.assert_close(layer.shift, reference.shift, atol=1e-12, rtol=0)
        torch.testing.assert_close(layer.log_scale, reference.log_scale, atol=1e-12, rtol=0)
    # Initialised layers keep their parameters; a layer's own initialize fits it again.
    state = {k: v.clone() for k, v in chain.state_dict().items()}
    chain.initialize(5 * x, mask)
    assert all(torch.equal(v, state[k]) for k, v in chain.state_dict().items())
    chain.steps[0].initialize(5 * x, mask)
    torch.testing.assert_close(chain.steps[0].shift, 5 * first.shift, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="NaN"):
        _power_chain(device).initialize(x.masked_fill(x > 1, float("nan")), mask)


def test_chain_runs_under_torch_func(device):
    chain = make_chain(device)
    x = torch.randn(2, 4, D, device=device, dtype=F64)
    mask = padding_mask([4, 3], 4, device)

    def forward(t: torch.Tensor) -> torch.Tensor:
        return chain(t, mask=mask, logdet=False)[0]

    torch.testing.assert_close(torch.func.jacrev(forward)(x),
                               torch.autograd.functional.jacobian(forward, x),
                               atol=1e-12, rtol=1e-10)
    per_sample = torch.func.vmap(lambda t, m: chain(t[None], mask=m[None], logdet=False)[0][0])
    torch.testing.assert_close(per_sample(x, mask), forward(x), atol=1e-12, rtol=1e-10)
