"""Tests of SpectralLinear and InfNormLinear (docs/math.md#conventions, #spectral-norm, check H16
(docs/math.md#checks))."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.autograd import gradcheck
from torch.func import functional_call, jacrev, vmap

from iresflow.nn.diagnostics import jacobian_norm
from iresflow.nn.linear import InfNormLinear, SpectralLinear, top_singular_vectors


def spectral_norm(matrix: torch.Tensor) -> torch.Tensor:
    """Oracle: largest singular value from ``svdvals``."""
    return torch.linalg.svdvals(matrix.detach())[0]


def inf_norm_by_vertices(matrix: torch.Tensor) -> torch.Tensor:
    """Oracle: sup of ||W x||_inf over the unit inf-ball, attained at one of its 2^in vertices."""
    n_in = matrix.shape[1]
    vertices = torch.tensor(
        list(itertools.product((-1.0, 1.0), repeat=n_in)), dtype=matrix.dtype, device=matrix.device
    )
    return (vertices @ matrix.detach().T).abs().amax()


def rounding(dtype: torch.dtype) -> float:
    """Relative slack for bounds that hold exactly up to floating-point rounding."""
    return max(1e-12, 10 * torch.finfo(dtype).eps)


def make_spectral(device, dtype, *, scale=3.0, coeff=0.9, **kwargs) -> SpectralLinear:
    layer = SpectralLinear(5, 4, coeff=coeff, device=device, dtype=dtype, **kwargs)
    with torch.no_grad():
        layer.weight.mul_(scale)
    return layer


def test_spectral_eval_mode_is_exact(device, dtype):
    layer = make_spectral(device, dtype).eval()
    assert spectral_norm(layer.weight) > 0.9  # the constraint is active
    norm = spectral_norm(layer.weight_normalized())
    assert norm <= 0.9 * (1 + rounding(dtype))
    torch.testing.assert_close(norm, torch.tensor(0.9, device=device, dtype=dtype))
    torch.testing.assert_close(layer.lipschitz_constant(), norm)


def test_spectral_inactive_constraint_leaves_weight_unchanged(device, dtype):
    layer = make_spectral(device, dtype, scale=0.01)
    for mode in (True, False):
        layer.train(mode)
        assert torch.equal(layer.weight_normalized(), layer.weight)
        torch.testing.assert_close(layer.lipschitz_constant(), spectral_norm(layer.weight))


def test_spectral_forward_matches_linear_map(device, dtype):
    layer = make_spectral(device, dtype).eval()
    x = torch.randn(3, 2, 5, device=device, dtype=dtype)
    expected = x @ layer.weight_normalized().T + layer.bias
    torch.testing.assert_close(layer(x), expected)


def test_spectral_train_mode_bound_without_update_calls(device, dtype):
    # Adam at lr 1e-2 on a regression loss, one power step per forward, weights kept above the
    # constraint. The lag of sigma_hat is second order in the rotation of the top singular pair
    # per step (about 1e-2 here) and is further contracted by the power step: well below 1e-3.
    layer = make_spectral(device, dtype, sigma="power")
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    x = torch.randn(64, 5, device=device, dtype=dtype)
    target = torch.tanh(x @ torch.randn(5, 4, device=device, dtype=dtype))
    for _ in range(40):
        y = layer(x)
        assert spectral_norm(layer.weight) > 0.9
        assert spectral_norm(layer.weight_normalized()) <= 0.9 * (1 + 1e-3)
        torch.testing.assert_close(
            layer.lipschitz_constant(), spectral_norm(layer.weight_normalized())
        )
        opt.zero_grad()
        ((y - target) ** 2).mean().backward()
        opt.step()
    layer.eval()
    assert spectral_norm(layer.weight_normalized()) <= 0.9 * (1 + rounding(dtype))


def test_power_iteration_converges_to_svd(device, dtype):
    layer = make_spectral(device, dtype, sigma="power")
    with torch.no_grad():
        layer.u.copy_(torch.nn.functional.normalize(torch.randn_like(layer.u), dim=0))
        layer.v.copy_(torch.nn.functional.normalize(torch.randn_like(layer.v), dim=0))
    x = torch.randn(2, 5, device=device, dtype=dtype)
    for _ in range(300):
        layer(x)
    sigma_hat = layer.u @ layer.weight.detach() @ layer.v
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(sigma_hat, spectral_norm(layer.weight), rtol=tol, atol=0)


def test_n_power_iterations_equals_repeated_single_steps(device, dtype):
    several = make_spectral(device, dtype, n_power_iterations=4, sigma="power")
    single = SpectralLinear(5, 4, coeff=0.9, device=device, dtype=dtype, sigma="power")
    with torch.no_grad():  # start away from the singular pair so that the steps matter
        several.u.copy_(torch.nn.functional.normalize(torch.randn_like(several.u), dim=0))
    single.load_state_dict(several.state_dict())
    x = torch.randn(2, 5, device=device, dtype=dtype)
    several(x)
    for _ in range(4):
        single(x)
    torch.testing.assert_close(several.u, single.u)
    torch.testing.assert_close(several.v, single.v)


def test_power_iteration_survives_zero_weight(device, dtype):
    layer = make_spectral(device, dtype, sigma="power")
    with torch.no_grad():
        layer.weight.zero_()
    layer(torch.randn(2, 5, device=device, dtype=dtype))
    for vector in (layer.u, layer.v):
        one = torch.ones((), device=device, dtype=dtype)
        torch.testing.assert_close(torch.linalg.vector_norm(vector), one)


def test_spectral_train_starts_converged_and_agrees_with_eval(device, dtype):
    layer = make_spectral(device, dtype, sigma="power")
    x = torch.randn(3, 5, device=device, dtype=dtype)
    y_train = layer(x)
    y_eval = layer.eval()(x)
    torch.testing.assert_close(y_train, y_eval)


def test_two_train_forwards_before_backward(device, dtype):
    layer = make_spectral(device, dtype, sigma="power")
    x = torch.randn(3, 5, device=device, dtype=dtype)
    loss = layer(x).sum() + layer(x).pow(2).sum()
    loss.backward()
    assert layer.weight.grad is not None and bool(torch.isfinite(layer.weight.grad).all())


@pytest.fixture
def count_svd(monkeypatch):
    """Counts the singular-vector computations (eigendecompositions of the Gram matrix)."""
    calls = []
    eigh = torch.linalg.eigh

    def counting_eigh(*args, **kwargs):
        calls.append(1)
        return eigh(*args, **kwargs)

    monkeypatch.setattr(torch.linalg, "eigh", counting_eigh)
    return calls


def test_eval_cache_reused_and_invalidated_by_optimizer_step(device, dtype, count_svd):
    layer = make_spectral(device, dtype).eval()
    x = torch.randn(4, 5, device=device, dtype=dtype)
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    count_svd.clear()  # construction warm-starts u, v with one SVD
    for _ in range(3):
        for _ in range(5):  # e.g. fixed-point iterations
            y = layer(x)
        assert len(count_svd) == 1  # one SVD per weight value
        opt.zero_grad()
        y.pow(2).sum().backward()
        old = layer.weight.detach().clone()
        opt.step()
        assert not torch.equal(old, layer.weight)
        count_svd.clear()
        norm = spectral_norm(layer.weight_normalized())  # first use of the new weight
        torch.testing.assert_close(norm, torch.tensor(0.9, device=device, dtype=dtype))


def test_eval_cache_sees_writes_through_data(device, dtype):
    layer = make_spectral(device, dtype).eval()
    layer.lipschitz_constant()
    version = layer.weight._version
    layer.weight.data.copy_(5.0 * torch.randn_like(layer.weight))  # new singular vectors
    assert layer.weight._version == version  # writes through .data bypass the version counter
    torch.testing.assert_close(
        spectral_norm(layer.weight_normalized()), torch.tensor(0.9, device=device, dtype=dtype)
    )


def test_eval_gradient_equals_matrix_norm_gradient(device, dtype):
    layer = make_spectral(device, dtype).eval()
    x = torch.randn(3, 5, device=device, dtype=dtype)
    for _ in range(2):  # second pass uses the cache
        layer.zero_grad()
        layer(x).pow(2).sum().backward()
        grad = layer.weight.grad.clone()
        weight = layer.weight.detach().clone().requires_grad_(True)
        sigma = torch.linalg.matrix_norm(weight, 2)
        oracle = x @ (weight / torch.clamp(sigma / 0.9, min=1)).T + layer.bias.detach()
        oracle.pow(2).sum().backward()
        torch.testing.assert_close(grad, weight.grad)


def test_load_state_dict_invalidates_cache(device, dtype):
    source = make_spectral(device, dtype, scale=5.0)
    target = make_spectral(device, dtype).eval()
    x = torch.randn(4, 5, device=device, dtype=dtype)
    target(x)  # fills the cache
    target.load_state_dict(source.state_dict())
    torch.testing.assert_close(target(x), source.eval()(x))
    torch.testing.assert_close(target.lipschitz_constant(), source.lipschitz_constant())


def test_state_dict_round_trip(device, dtype):
    source = make_spectral(device, dtype, sigma="power")
    x = torch.randn(4, 5, device=device, dtype=dtype)
    source(x)
    state = source.state_dict()
    assert set(state) == {"weight", "bias", "u", "v"}
    target = SpectralLinear(5, 4, coeff=0.9, device=device, dtype=dtype, sigma="power")
    target.load_state_dict(state)
    for a, b in zip(source.state_dict().values(), target.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    torch.testing.assert_close(target(x), source(x))  # train mode: same u, v, same update
    torch.testing.assert_close(target.u, source.u)


def test_buffers_follow_dtype_conversion():
    layer = SpectralLinear(5, 4).double()
    assert layer.u.dtype == layer.v.dtype == torch.float64
    x = torch.randn(2, 5, dtype=torch.float64)
    assert layer.eval()(x).dtype == torch.float64
    assert spectral_norm(layer.weight_normalized()) <= 0.97 * (1 + rounding(torch.float64))


def _gradcheck_layer(layer, x):
    params = dict(layer.named_parameters())
    names = list(params)

    def f(inputs, *tensors):
        return functional_call(layer, dict(zip(names, tensors, strict=True)), (inputs,))

    tensors = [p.detach().clone().requires_grad_(True) for p in params.values()]
    assert gradcheck(f, (x.requires_grad_(True), *tensors))


@pytest.mark.parametrize("sigma", ["power", "exact"])
@pytest.mark.parametrize("training", [False, True])
def test_spectral_gradcheck(device, training, sigma):
    layer = make_spectral(device, torch.float64, sigma=sigma).train(training)
    _gradcheck_layer(layer, torch.randn(3, 5, device=device, dtype=torch.float64))


@pytest.mark.parametrize("training", [False, True])
def test_inf_norm_gradcheck(device, training):
    layer = InfNormLinear(5, 4, coeff=0.9, device=device, dtype=torch.float64).train(training)
    with torch.no_grad():
        layer.weight.mul_(3.0)
    _gradcheck_layer(layer, torch.randn(3, 5, device=device, dtype=torch.float64))


@pytest.mark.parametrize("training", [False, True])
def test_spectral_under_vmap_jacrev(device, dtype, training):
    layer = make_spectral(device, dtype, sigma="power").train(training)
    x = torch.randn(6, 5, device=device, dtype=dtype)
    y_plain = layer(x)  # advances u, v once in training mode
    u, v = layer.u.clone(), layer.v.clone()
    jac, y = vmap(jacrev(lambda t: (layer(t), layer(t)), has_aux=True))(x)
    assert torch.equal(layer.u, u) and torch.equal(layer.v, v)  # no update under a transform
    torch.testing.assert_close(y, y_plain)
    expected = layer.weight_normalized().detach().expand(6, 4, 5)
    torch.testing.assert_close(jac, expected)


def test_inf_norm_is_exact_max_row_sum(device, dtype):
    layer = InfNormLinear(5, 4, coeff=0.8, device=device, dtype=dtype)
    with torch.no_grad():
        layer.weight.mul_(4.0)
    raw = inf_norm_by_vertices(layer.weight)
    assert raw > 0.8
    for mode in (True, False):
        layer.train(mode)
        norm = inf_norm_by_vertices(layer.weight_normalized())
        assert norm <= 0.8 * (1 + rounding(dtype))
        torch.testing.assert_close(norm, torch.tensor(0.8, device=device, dtype=dtype))
        torch.testing.assert_close(layer.lipschitz_constant(), norm)


def test_inf_norm_inactive_constraint(device, dtype):
    layer = InfNormLinear(5, 4, coeff=0.9, device=device, dtype=dtype)
    with torch.no_grad():
        layer.weight.mul_(0.01)
    assert torch.equal(layer.weight_normalized(), layer.weight)
    torch.testing.assert_close(layer.lipschitz_constant(), inf_norm_by_vertices(layer.weight))


def test_inf_norm_is_sequence_lipschitz_constant(device, dtype):
    # Entrywise inf-norm on (N, D) sequences: the Jacobian's max abs row sum equals the bound.
    layer = InfNormLinear(3, 3, coeff=0.7, bias=False, device=device, dtype=dtype)
    with torch.no_grad():
        layer.weight.mul_(5.0)
    x = torch.randn(4, 3, device=device, dtype=dtype)
    jac = torch.autograd.functional.jacobian(layer, x).reshape(12, 12)
    torch.testing.assert_close(jac.abs().sum(1).max(), layer.lipschitz_constant().detach())


@pytest.mark.parametrize("cls", [SpectralLinear, InfNormLinear])
def test_bad_constructor_arguments(cls):
    for coeff in (0.0, -0.5, 1.5, float("nan")):
        with pytest.raises(ValueError, match="coeff"):
            cls(3, 2, coeff=coeff)
    for coeff in (True, "0.5", torch.tensor(0.5)):
        with pytest.raises(TypeError, match="coeff"):
            cls(3, 2, coeff=coeff)
    assert cls(3, 2, coeff=1).coeff == 1.0  # allowed for a single layer
    with pytest.raises(ValueError, match="in_features"):
        cls(0, 2)
    with pytest.raises(TypeError, match="out_features"):
        cls(3, 2.0)


def test_bad_power_iterations():
    with pytest.raises(ValueError, match="n_power_iterations"):
        SpectralLinear(3, 2, n_power_iterations=0)
    with pytest.raises(TypeError, match="n_power_iterations"):
        SpectralLinear(3, 2, n_power_iterations=1.5)


@pytest.mark.parametrize("cls", [SpectralLinear, InfNormLinear])
def test_bad_forward_inputs(cls):
    layer = cls(3, 2)
    with pytest.raises(ValueError, match=r"\(\.\.\., 3\)"):
        layer(torch.randn(4, 2))
    with pytest.raises(ValueError, match=r"\(\.\.\., 3\)"):
        layer(torch.tensor(1.0))
    with pytest.raises(TypeError, match="floating-point"):
        layer(torch.ones(4, 3, dtype=torch.long))
    with pytest.raises(TypeError, match="floating-point"):
        layer([[1.0, 2.0, 3.0]])


def test_exact_sigma_holds_in_training_under_expansion(device, dtype):
    # An objective that rewards expansion makes power iteration lag; sigma="exact" must not.
    layer = SpectralLinear(4, 5, coeff=0.9, sigma="exact").to(device, dtype).train()
    optimizer = torch.optim.Adam(layer.parameters(), lr=1e-2)
    x = torch.randn(64, 4, device=device, dtype=dtype)
    for _ in range(30):
        optimizer.zero_grad()
        (-layer(x).pow(2).sum()).backward()
        optimizer.step()
        sigma = torch.linalg.matrix_norm(layer.weight_normalized().detach(), 2)
        assert sigma <= 0.9 * (1 + 1e-12)


def test_bad_sigma():
    with pytest.raises(ValueError, match="sigma"):
        SpectralLinear(3, 2, sigma="svd")


def overtaking_weight(u: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor):
    """``0.5 u v^T + 3 a b^T`` for unit ``a`` orthogonal to ``u`` and ``b`` to ``v``.

    ``(u, v)`` is a singular pair (value 0.5) and so a fixed point of the power iteration, while
    the spectral norm is 3: the adversarial large weight change of the audit.
    """
    a = a - (a @ u) * u
    b = b - (b @ v) * v
    return 0.5 * torch.outer(u, v) + 3.0 * torch.outer(a / a.norm(), b / b.norm())


def test_default_spectral_layer_keeps_its_bound_after_a_large_weight_change(device, dtype):
    layer = SpectralLinear(5, 4, device=device, dtype=dtype).train()  # default settings
    gen = torch.Generator().manual_seed(1)
    a, b = (torch.randn(n, generator=gen, dtype=dtype).to(device) for n in (4, 5))
    with torch.no_grad():
        layer.weight.copy_(overtaking_weight(layer.u, layer.v, a, b))
    x = torch.randn(8, 5, device=device, dtype=dtype)
    layer(x)  # a training forward right after the change
    # The map of that forward (transforms do not advance any buffer) is linear: its Jacobian
    # norm is its Lipschitz constant.
    lipschitz = jacobian_norm(layer, x, "2").max()
    assert lipschitz <= layer.coeff * (1 + rounding(dtype))
    torch.testing.assert_close(lipschitz, layer.lipschitz_constant().detach())
    power = SpectralLinear(5, 4, device=device, dtype=dtype, sigma="power").train()
    with torch.no_grad():
        power.weight.copy_(overtaking_weight(power.u, power.v, a, b))
    power(x)
    assert jacobian_norm(power, x, "2").max() > 3 * power.coeff  # the lag the default avoids


@pytest.mark.parametrize("shape", [(7, 3), (3, 7), (2, 5, 5)])
@pytest.mark.parametrize("complex_", [False, True])
def test_top_singular_vectors_match_the_svd(shape, complex_):
    gen = torch.Generator().manual_seed(4)
    kind = torch.complex128 if complex_ else torch.float64
    matrix = torch.randn(*shape, generator=gen, dtype=kind)
    u, v = top_singular_vectors(matrix)
    sigma = torch.linalg.svdvals(matrix)[..., 0]
    value = (u.conj().unsqueeze(-2) @ matrix @ v.unsqueeze(-1)).squeeze(-1).squeeze(-1)
    torch.testing.assert_close(value, sigma.to(kind), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(torch.linalg.vector_norm(u, dim=-1), torch.ones_like(sigma))
    torch.testing.assert_close(torch.linalg.vector_norm(v, dim=-1), torch.ones_like(sigma))
    zero_u, zero_v = top_singular_vectors(torch.zeros(3, 2, dtype=torch.float64))
    assert torch.isfinite(zero_u).all() and float(zero_u.abs().sum()) == 0.0


@pytest.mark.parametrize("training", [True, False])
def test_the_forward_weight_is_the_normalised_weight_with_the_exact_norm(training):
    """With the exact norm, one forward's weight is weight_normalized() bit for bit (the forward
    divides by the scale written out), and the layer maps by it."""
    torch.manual_seed(0)
    layer = SpectralLinear(5, 4, coeff=0.5).double().train(training)
    with torch.no_grad():
        layer.weight.mul_(3.0)  # a norm above the coefficient: the divisor is active
    assert torch.equal(layer.forward_weight(), layer.weight_normalized())
    x = torch.randn(2, 5, dtype=torch.float64)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight_normalized(),
                                                            layer.bias))


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_the_effective_weight_is_kept_without_a_graph_while_the_raw_weight_is_unchanged(
    kind: str,
) -> None:
    from iresflow.nn.conv import SpectralConv1d

    torch.manual_seed(0)
    if kind == "linear":
        layer = SpectralLinear(4, 3, coeff=0.9).double()
        effective = layer.forward_weight
    else:
        layer = SpectralConv1d(3, 4, 3, 0.9, max_len=10).double()
        effective = layer.weight_normalized
    with torch.no_grad():
        layer.weight.mul_(5.0)  # beyond the coefficient: the normalisation acts
    fresh = effective()  # training mode, with a graph: computed on every call
    assert fresh.grad_fn is not None and effective() is not fresh
    layer.eval()
    with torch.no_grad():
        kept = effective()
        assert effective() is kept and torch.equal(kept, fresh.detach())
        layer.weight.data.add_(0.1)  # in place, past autograd's version counter
        moved = effective()
        assert moved is not kept and not torch.equal(moved, kept)
    assert torch.equal(moved, effective().detach())  # with a graph: the same values, afresh
    layer.coeff = 0.5
    with torch.no_grad():
        assert not torch.equal(effective(), moved)  # a new coefficient is a new weight
