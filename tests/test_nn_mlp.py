"""Tests of LipschitzMLP (docs/math.md#conventions, #lipswish, #spectral-norm; checks H15,
H16 (docs/math.md#checks))."""

from __future__ import annotations

import pytest
import torch
from torch.func import jacrev, vmap

from iresflow.nn.activations import LipSwish
from iresflow.nn.base import LipschitzBranch
from iresflow.nn.diagnostics import empirical_lipschitz
from iresflow.nn.linear import InfNormLinear, SpectralLinear
from iresflow.nn.mlp import LipschitzMLP

D = 3


def operator_norm(jac: torch.Tensor, norm: str) -> torch.Tensor:
    """Oracle: induced operator norm of a batch of Jacobians ``(..., m, n)``."""
    if norm == "2":
        return torch.linalg.svdvals(jac)[..., 0]
    return jac.abs().sum(-1).amax(-1)


def make_mlp(device, dtype, norm="2", coeff=0.9, sigma="exact") -> LipschitzMLP:
    mlp = LipschitzMLP((D, 8, 8, D), coeff=coeff, norm=norm, sigma=sigma)
    mlp = mlp.to(device=device, dtype=dtype)
    with torch.no_grad():  # push every layer past its constraint so the bound is attained
        for layer in mlp.net:
            if isinstance(layer, SpectralLinear | InfNormLinear):
                layer.weight.mul_(4.0)  # u, v stay the top singular pair
    return mlp


def token_jacobians(mlp: LipschitzMLP, tokens: torch.Tensor) -> torch.Tensor:
    """Per-token Jacobians ``(T, D, D)`` by plain autograd, one token at a time."""
    return torch.stack(
        [torch.autograd.functional.jacobian(lambda t: mlp(t[None])[0], t) for t in tokens]
    )


def test_structure_and_attributes():
    mlp = LipschitzMLP((D, 5, 7, D))
    kinds = [type(m) for m in mlp.net]
    assert kinds == [SpectralLinear, LipSwish, SpectralLinear, LipSwish, SpectralLinear]
    assert isinstance(mlp, LipschitzBranch)
    assert mlp.position_wise is True and mlp.norm == "2"
    inf = LipschitzMLP((D, D), norm="inf")
    assert inf.norm == "inf" and LipschitzMLP.norm == "2"
    assert [type(m) for m in inf.net] == [InfNormLinear]


@pytest.mark.parametrize("norm", ["2", "inf"])
def test_lipschitz_constant_is_product_of_layers(device, dtype, norm):
    mlp = make_mlp(device, dtype, norm).eval()
    expected = torch.ones((), device=device, dtype=dtype)
    for layer in mlp.net:
        if isinstance(layer, SpectralLinear | InfNormLinear):
            expected = expected * operator_norm(layer.weight_normalized().detach(), norm)
    torch.testing.assert_close(mlp.lipschitz_constant(seq_len=11), expected)
    torch.testing.assert_close(expected, torch.tensor(0.9**3, device=device, dtype=dtype))


@pytest.mark.parametrize("norm", ["2", "inf"])
@pytest.mark.parametrize("training", [False, True])
def test_jacobian_norm_below_certificate(device, dtype, norm, training):
    mlp = make_mlp(device, dtype, norm).train(training)
    bound = mlp.lipschitz_constant().detach()
    assert bound <= 1
    scales = torch.tensor([0.1, 1.0, 5.0], device=device, dtype=dtype)
    tokens = torch.randn(3, 4, D, device=device, dtype=dtype) * scales[:, None, None]
    jac = token_jacobians(mlp, tokens.reshape(-1, D))
    assert bool((operator_norm(jac, norm) <= bound * (1 + 1e-12)).all())

    # Inputs optimised to maximise the Jacobian norm.
    x = torch.randn(4, D, device=device, dtype=dtype).requires_grad_(True)
    opt = torch.optim.Adam([x], lr=0.1)
    values = []
    for _ in range(30):
        jac = vmap(jacrev(lambda t: mlp(t[None])[0]))(x)
        value = operator_norm(jac, norm)
        assert bool((value <= bound * (1 + 1e-12)).all())
        values.append(value.detach().max())
        opt.zero_grad()
        (-value.sum()).backward()
        opt.step()
    assert values[-1] > values[0]  # the search does climb


@pytest.mark.parametrize("norm", ["2", "inf"])
def test_single_layer_attains_certificate(device, dtype, norm):
    mlp = LipschitzMLP((D, D), coeff=0.8, norm=norm).to(device=device, dtype=dtype).eval()
    with torch.no_grad():
        mlp.net[0].weight.mul_(5.0)
    jac = token_jacobians(mlp, torch.randn(2, D, device=device, dtype=dtype))
    norms = operator_norm(jac, norm)
    torch.testing.assert_close(norms, mlp.lipschitz_constant().detach().expand(2))
    torch.testing.assert_close(norms, torch.full_like(norms, 0.8))


def test_sequence_jacobian_is_block_diagonal(device, dtype):
    mlp = make_mlp(device, dtype).eval()
    x = torch.randn(1, 4, D, device=device, dtype=dtype)
    jac = torch.autograd.functional.jacobian(mlp, x).reshape(4 * D, 4 * D)
    blocks = jac.reshape(4, D, 4, D).permute(0, 2, 1, 3)
    off_diagonal = ~torch.eye(4, dtype=torch.bool, device=device)
    assert bool((blocks[off_diagonal] == 0).all())
    assert torch.linalg.svdvals(jac)[0] <= mlp.lipschitz_constant() * (1 + 1e-12)


def test_mask_zeroes_padding_and_isolates_it(device, dtype):
    mlp = make_mlp(device, dtype)
    x = torch.randn(2, 5, D, device=device, dtype=dtype)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool, device=device)
    out = mlp.eval()(x, mask)
    assert bool((out[~mask] == 0).all())
    torch.testing.assert_close(out[mask], mlp(x)[mask])

    x_other = x.clone()
    x_other[~mask] = 1e6 * torch.randn_like(x_other[~mask])
    assert torch.equal(mlp(x_other, mask)[mask], out[mask])

    x_grad = x.clone().requires_grad_(True)
    mlp(x_grad, mask).sum().backward()
    assert bool((x_grad.grad[~mask] == 0).all()) and bool((x_grad.grad[mask] != 0).any())


def test_vectors_are_accepted(device, dtype):
    mlp = make_mlp(device, dtype).eval()
    x = torch.randn(4, D, device=device, dtype=dtype)
    torch.testing.assert_close(mlp(x), mlp(x[:, None])[:, 0])


@pytest.mark.parametrize("training", [False, True])
def test_every_parameter_gets_a_gradient(device, dtype, training):
    mlp = make_mlp(device, dtype).train(training)
    x = torch.randn(2, 4, D, device=device, dtype=dtype)
    (mlp(x).pow(2).sum() + mlp.lipschitz_constant()).backward()
    for name, parameter in mlp.named_parameters():
        assert parameter.grad is not None, name
        assert bool(parameter.grad.abs().sum() > 0), name


@pytest.mark.parametrize("norm", ["2", "inf"])
@pytest.mark.parametrize("training", [False, True])
def test_under_vmap_jacrev(device, dtype, norm, training):
    mlp = make_mlp(device, dtype, norm, sigma="power").train(training)
    x = torch.randn(2, 4, D, device=device, dtype=dtype)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool, device=device)
    oracle = token_jacobians(mlp, x.reshape(-1, D))
    y = mlp(x, mask)  # the plain forward; advances u, v in training mode
    state = {k: v.clone() for k, v in mlp.state_dict().items()}

    per_token = vmap(jacrev(lambda t: mlp(t[None, None])[0, 0]))(x.reshape(-1, D))
    torch.testing.assert_close(per_token, oracle)

    def per_sequence(seq, seq_mask):
        out = mlp(seq[None], seq_mask[None])[0]
        return out, out

    jac, y_vmapped = vmap(jacrev(per_sequence, has_aux=True))(x, mask)
    torch.testing.assert_close(y_vmapped, y)
    diagonal = jac.diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2)  # (B, N, D, D)
    expected = per_token.reshape(2, 4, D, D) * mask[..., None, None]
    torch.testing.assert_close(diagonal, expected)
    for key, value in mlp.state_dict().items():  # transforms never touch the buffers
        assert torch.equal(value, state[key]), key


def test_train_and_eval_agree_when_converged(device, dtype):
    mlp = make_mlp(device, dtype, sigma="power")  # u, v start at the exact singular pairs
    x = torch.randn(2, 4, D, device=device, dtype=dtype)
    torch.testing.assert_close(mlp.train()(x), mlp.eval()(x))


def test_state_dict_round_trip(device, dtype):
    source = make_mlp(device, dtype)
    x = torch.randn(2, 4, D, device=device, dtype=dtype)
    source(x)
    target = LipschitzMLP((D, 8, 8, D), coeff=0.9).to(device=device, dtype=dtype)
    target.load_state_dict(source.state_dict())
    torch.testing.assert_close(target(x), source(x))
    torch.testing.assert_close(target.eval()(x), source.eval()(x))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"dims": (D,)}, ValueError, "at least 2"),
        ({"dims": (D, 0, D)}, ValueError, "dims"),
        ({"dims": (D, 4.0, D)}, TypeError, "dims"),
        ({"dims": "33"}, TypeError, "dims"),
        ({"dims": 3}, TypeError, "dims"),
        ({"dims": (D, 4, D + 1)}, ValueError, "same size"),
        ({"dims": (D, D), "coeff": 1.0}, ValueError, "coeff"),
        ({"dims": (D, D), "coeff": 0.0}, ValueError, "coeff"),
        ({"dims": (D, D), "coeff": "0.5"}, TypeError, "coeff"),
        ({"dims": (D, D), "norm": "1"}, ValueError, "norm"),
        ({"dims": (D, D), "n_power_iterations": 0}, ValueError, "n_power_iterations"),
    ],
)
def test_bad_constructor_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        LipschitzMLP(**kwargs)


def test_bad_forward_inputs():
    mlp = LipschitzMLP((D, 4, D))
    x = torch.randn(2, 5, D)
    mask = torch.ones(2, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match="features"):
        mlp(torch.randn(2, 5, D + 1))
    with pytest.raises(ValueError, match="shape"):
        mlp(torch.randn(2, 5, 1, D))
    with pytest.raises(ValueError, match="NaN"):
        mlp(torch.full((2, 5, D), float("nan")))
    with pytest.raises(TypeError, match="floating-point"):
        mlp(torch.ones(2, 5, D, dtype=torch.long))
    with pytest.raises(TypeError, match="torch.bool"):
        mlp(x, mask.int())
    with pytest.raises(ValueError, match=r"\(B, N\)"):
        mlp(x, mask[:, :4])
    with pytest.raises(ValueError, match="no real token"):
        mlp(x, torch.zeros(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"\(B, N, D\)"):
        mlp(torch.randn(2, D), mask)


def test_default_branch_keeps_its_certificate_after_a_large_weight_change(device, dtype):
    # Audit defect 9: every layer gets a weight whose top singular pair is not the tracked one
    # (which stays a fixed point of the power iteration); output direction of one layer = input
    # direction of the next, so the expansion compounds. The default branch must stay below
    # its certificate coeff^3 in the training forward that follows.
    mlp = LipschitzMLP((D, 8, 8, D)).to(device=device, dtype=dtype).train()  # default settings
    layers = [m for m in mlp.net if isinstance(m, SpectralLinear)]
    gen = torch.Generator().manual_seed(0)
    direction = torch.randn(D, generator=gen, dtype=dtype).to(device)
    with torch.no_grad():
        for i, layer in enumerate(layers):
            u, v = layer.u, layer.v
            b = direction - (direction @ v) * v
            if i + 1 < len(layers):  # orthogonal to this layer's u and the next layer's v
                basis = torch.linalg.qr(torch.stack([u, layers[i + 1].v], dim=1))[0]
                a = torch.randn(u.shape[0], generator=gen, dtype=dtype).to(device)
                a = a - basis @ (basis.T @ a)
            else:
                a = torch.randn(u.shape[0], generator=gen, dtype=dtype).to(device)
                a = a - (a @ u) * u
            a, b = a / a.norm(), b / b.norm()
            layer.weight.copy_(0.5 * torch.outer(u, v) + 3.0 * torch.outer(a, b))
            direction = a
    x = torch.randn(16, D, device=device, dtype=dtype)
    mlp(x)  # the training forward right after the change
    certificate = 0.97**3
    found = empirical_lipschitz(mlp, x, "2", steps=40, generator=gen).value
    assert found <= certificate * (1 + 1e-9)
    assert mlp.lipschitz_constant() <= certificate * (1 + 1e-9)
