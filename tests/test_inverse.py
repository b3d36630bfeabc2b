"""The fixed-point inverse engine (docs/math.md#contractive-attention, #fixed-point-inverse;
check H9 (docs/math.md#checks)) on maps with known constants."""

from __future__ import annotations

import math

import pytest
import torch

from iresflow.inverse.anderson import AndersonMixer, SecantMixer
from iresflow.inverse.fixed_point import (
    InversionError,
    InversionWarning,
    default_tolerance,
    fixed_point_inverse,
)

SOLVERS = ["plain", "anderson"]
F64 = torch.float64


def symmetric_unit_matrix(dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Symmetric matrix with eigenvalues evenly spread over [-1, 1] (spectral norm exactly 1)."""
    q, _ = torch.linalg.qr(torch.randn(dim, dim, device=device, dtype=F64))
    eigenvalues = torch.linspace(-1.0, 1.0, dim, device=device, dtype=F64)
    return (q @ torch.diag(eigenvalues) @ q.T).to(dtype)


def tanh_contraction(lipschitz: float, dim: int, device: torch.device, dtype=F64, bias=True):
    """g(x) = L tanh(A x + b) token-wise, with lip_2(g) <= L and near-tight near x = 0."""
    a = symmetric_unit_matrix(dim, device, dtype)
    b = 0.1 * torch.randn(dim, device=device, dtype=dtype) if bias else torch.zeros_like(a[0])

    def g(x: torch.Tensor) -> torch.Tensor:
        return lipschitz * torch.tanh(x @ a.T + b)

    return g


def per_sample_norm(t: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(t.reshape(t.shape[0], -1), dim=1)


def test_plain_iteration_obeys_banach_bound(device):
    lipschitz = 0.9
    g = tanh_contraction(lipschitz, 6, device)
    x = torch.randn(8, 6, device=device, dtype=F64)
    y = x + g(x)
    x_hat, stats = fixed_point_inverse(g, y, solver="plain")
    assert bool(stats.converged.all())
    # k evaluations of g return x_{k-1}, the last iterate whose residual was measured
    k = stats.iterations.to(F64) - 1
    # a priori: ||x_k - x*|| <= L^k / (1 - L) ||x_1 - x_0||, with x_0 = y and x_1 = y - g(y)
    bound = lipschitz**k / (1 - lipschitz) * per_sample_norm(g(y))
    error = per_sample_norm(x_hat - x)
    assert bool((error <= bound + 1e-13).all())
    assert float((x_hat - x).abs().max()) < 1e-9


@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize("lipschitz", [0.5, 0.97])
def test_solution_accuracy_and_a_posteriori_bound(device, solver, lipschitz):
    g = tanh_contraction(lipschitz, 5, device)
    x = torch.randn(4, 3, 5, device=device, dtype=F64)
    y = x + g(x)
    x_hat, stats = fixed_point_inverse(g, y, solver=solver)
    assert x_hat.shape == y.shape and x_hat.dtype == y.dtype
    assert bool(stats.converged.all())
    assert bool((stats.residual < default_tolerance(y)).all())
    # ||x - x*|| <= ||T(x) - x|| / (1 - L) for the returned point x (Banach, one step)
    step = per_sample_norm(y - g(x_hat) - x_hat)
    assert bool((per_sample_norm(x_hat - x) <= step / (1 - lipschitz) + 1e-13).all())
    assert float((x_hat - x).abs().max()) < 1e-9


def test_anderson_needs_fewer_evaluations_near_one(device):
    g = tanh_contraction(0.97, 8, device)
    x = 0.3 * torch.randn(16, 8, device=device, dtype=F64)
    y = x + g(x)
    _, plain = fixed_point_inverse(g, y, solver="plain")
    x_hat, anderson = fixed_point_inverse(g, y, solver="anderson")
    assert float((x_hat - x).abs().max()) < 1e-9
    assert 2 * int(anderson.iterations.sum()) < int(plain.iterations.sum())
    assert 2 * anderson.evaluations < plain.evaluations


def test_anderson_keeps_plain_steps_for_fast_contractions(device):
    # contraction 0.05: plain steps finish within the budget, so no sample switches to mixing
    g = tanh_contraction(0.05, 6, device)
    y = torch.randn(8, 6, device=device, dtype=F64)
    x_plain, plain = fixed_point_inverse(g, y, solver="plain")
    x_anderson, anderson = fixed_point_inverse(g, y, solver="anderson")
    assert torch.equal(x_plain, x_anderson)
    assert torch.equal(plain.iterations, anderson.iterations)


def test_anderson_solves_linear_problem_in_few_steps(device):
    # On an affine map in R^n, Anderson mixing with memory >= n is a Krylov method: it reaches
    # the fixed point after about n + 1 steps (twice that if the safeguard restarts it once),
    # where the plain iteration needs ~log(tol)/log(L).
    dim = 3
    m = 0.9 * symmetric_unit_matrix(dim, device, F64)
    y = torch.randn(2, dim, device=device, dtype=F64)

    def g(x):
        return x @ m.T

    x_hat, stats = fixed_point_inverse(g, y, solver="anderson", memory=5)
    expected = torch.linalg.solve(torch.eye(dim, dtype=F64, device=device) + m, y.T).T
    assert torch.allclose(x_hat, expected, atol=1e-10, rtol=0)
    assert int(stats.iterations.max()) <= 2 * (dim + 2)
    _, plain = fixed_point_inverse(g, y, solver="plain")
    assert int(plain.iterations.min()) > 100


def test_anderson_mixer_with_one_pair_is_the_plain_step(device):
    mixer = AndersonMixer(2, 3, memory=4, like=torch.zeros(1, dtype=F64, device=device))
    x = torch.randn(2, 3, device=device, dtype=F64)
    image = torch.randn(2, 3, device=device, dtype=F64)
    x_next = mixer.step(x, image, (image - x).abs().amax(1))
    assert torch.equal(x_next, image)


def test_anderson_converges_on_nonsmooth_contraction(device):
    # |.| is not differentiable at 0, which makes extrapolation unreliable; the safeguard keeps
    # the iteration convergent.
    a = 0.95 * symmetric_unit_matrix(6, device, F64)

    def g(x):
        return (x @ a.T).abs() - 0.5

    x = torch.randn(32, 6, device=device, dtype=F64)
    y = x + g(x)
    x_hat, stats = fixed_point_inverse(g, y, solver="anderson", memory=3)
    assert bool(stats.converged.all())
    assert float((x_hat - x).abs().max()) < 1e-9


@pytest.mark.parametrize("solver", SOLVERS)
def test_converged_samples_are_frozen(device, solver):
    g = tanh_contraction(0.9, 4, device, bias=False)
    scales = torch.tensor([1e-12, 1e-3, 1.0, 4.0], device=device, dtype=F64)
    x = scales[:, None] * torch.randn(4, 4, device=device, dtype=F64)
    y = x + g(x)
    calls: list[int] = []

    def recorded(z):
        calls.append(z.shape[0])
        return g(z)

    x_hat, stats = fixed_point_inverse(recorded, y, solver=solver)
    iterations = stats.iterations
    assert len(set(iterations.tolist())) > 1
    assert stats.evaluations == len(calls) == int(iterations.max())
    # call k evaluates exactly the samples that have not stopped before it
    assert calls == [int((iterations >= k).sum()) for k in range(1, len(calls) + 1)]
    for b in range(4):
        alone, stats_alone = fixed_point_inverse(g, y[b : b + 1], solver=solver)
        assert torch.allclose(alone[0], x_hat[b], atol=1e-14, rtol=0)
        assert int(stats_alone.iterations[0]) == int(iterations[b])


@pytest.mark.parametrize("solver", SOLVERS)
def test_extra_args_are_sliced_with_the_active_rows(device, solver):
    a = symmetric_unit_matrix(3, device, F64)
    scale = torch.tensor([[0.0], [0.5], [0.95]], device=device, dtype=F64)

    def g(x, s):
        return s * torch.tanh(x @ a.T)

    x = torch.randn(3, 3, device=device, dtype=F64)
    y = x + g(x, scale)
    x_hat, stats = fixed_point_inverse(g, y, args=(scale,), solver=solver)
    assert int(stats.iterations[0]) == 1
    assert torch.allclose(x_hat, x, atol=1e-9, rtol=0)


def test_failure_raises_with_residual(device):
    g = tanh_contraction(0.9, 4, device)
    y = torch.randn(5, 4, device=device, dtype=F64)
    with pytest.raises(InversionError) as info:
        fixed_point_inverse(g, y, max_iter=3)
    assert info.value.residual.shape == (5,)
    assert bool((info.value.residual > 1e-6).all())
    assert info.value.iterations.tolist() == [3] * 5


def test_failure_can_warn_and_return_the_last_iterate(device):
    g = tanh_contraction(0.9, 4, device)
    y = torch.randn(5, 4, device=device, dtype=F64)
    with pytest.warns(InversionWarning, match="did not converge"):
        x_hat, stats = fixed_point_inverse(g, y, max_iter=3, on_failure="warn")
    # three evaluations of g, at x0 = y, x1 and x2: the returned iterate is x2, whose residual
    # the third evaluation measured
    expected = y
    for _ in range(2):
        expected = y - g(expected)
    assert torch.equal(x_hat, expected)
    assert not bool(stats.converged.any())
    assert torch.allclose(stats.residual, (x_hat + g(x_hat) - y).abs().amax(1), atol=0, rtol=0)


def test_non_finite_iterates_stop_at_once(device):
    y = torch.randn(3, 2, device=device, dtype=F64)
    with pytest.raises(InversionError) as info:
        fixed_point_inverse(lambda x: x * float("nan"), y, max_iter=50)
    assert info.value.iterations.tolist() == [1, 1, 1]


def test_start_at_the_solution(device):
    g = tanh_contraction(0.9, 4, device)
    x = torch.randn(3, 4, device=device, dtype=F64)
    x_hat, stats = fixed_point_inverse(g, x + g(x), x0=x.clone())
    assert stats.iterations.tolist() == [1, 1, 1]
    assert torch.allclose(x_hat, x, atol=1e-14, rtol=0)


def test_default_tolerance_scales_with_the_input(device):
    y = torch.tensor([[0.1, -0.2], [30.0, 1.0]], device=device, dtype=F64)
    assert torch.allclose(default_tolerance(y), torch.tensor([1e-11, 3e-10], dtype=F64))
    assert float(default_tolerance(y.float())[0]) == pytest.approx(1e-6)


@pytest.mark.parametrize("solver", SOLVERS)
def test_float32_large_inputs_converge_with_the_default_tolerance(device, solver):
    a = 0.9 * symmetric_unit_matrix(4, device, torch.float32)

    def g(x):  # linear, so that large inputs do not saturate it
        return x @ a.T

    x = 1e3 * torch.randn(6, 4, device=device)
    y = x + g(x)
    x_hat, stats = fixed_point_inverse(g, y, solver=solver)
    assert bool(stats.converged.all())
    relative = (x_hat - x).abs().amax(1) / x.abs().amax(1)
    assert float(relative.max()) < 1e-5


def test_no_gradient_is_tracked(device):
    w = torch.tensor(0.5, device=device, dtype=F64, requires_grad=True)
    y = torch.randn(2, 3, device=device, dtype=F64, requires_grad=True)
    x_hat, _ = fixed_point_inverse(lambda x: w * torch.sin(x), y)
    assert not x_hat.requires_grad


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"y": torch.ones(2, 3, dtype=torch.int64)}, TypeError),
        ({"y": torch.tensor([[1.0, float("nan")]])}, ValueError),
        ({"y": torch.ones(0, 3)}, ValueError),
        ({"tol": -1.0}, ValueError),
        ({"tol": float("inf")}, ValueError),
        ({"max_iter": 0}, ValueError),
        ({"solver": "newton"}, ValueError),
        ({"memory": 0}, ValueError),
        ({"on_failure": "ignore"}, ValueError),
        ({"x0": torch.ones(2, 4)}, ValueError),
        ({"x0": torch.ones(2, 3, dtype=torch.float64)}, TypeError),
        ({"args": (torch.ones(3),)}, ValueError),
        ({"args": [torch.ones(2)]}, TypeError),
    ],
)
def test_bad_arguments_raise(kwargs, error):
    call = {"y": torch.ones(2, 3), **kwargs}
    with pytest.raises(error):
        fixed_point_inverse(lambda x, *a: 0.5 * torch.sin(x), **call)


def test_g_with_wrong_output_shape_raises():
    with pytest.raises(ValueError, match="shape"):
        fixed_point_inverse(lambda x: x.sum(1), torch.ones(2, 3))


def test_non_callable_g_raises():
    with pytest.raises(TypeError, match="callable"):
        fixed_point_inverse(torch.ones(2), torch.ones(2, 3))


def test_banach_iteration_count_estimate(device):
    # the plain solver stops no later than the a priori estimate of the iterations needed
    lipschitz = 0.8
    g = tanh_contraction(lipschitz, 3, device)
    y = torch.randn(4, 3, device=device, dtype=F64)
    tol = 1e-8
    _, stats = fixed_point_inverse(g, y, tol=tol, solver="plain")
    # max-abs step k+1 <= ||step k+1||_2 <= L^k ||g(y)||_2 < tol  once  k > log(tol/|g(y)|)/log L
    first = per_sample_norm(g(y))
    bound = torch.tensor(
        [math.ceil(math.log(tol / float(f)) / math.log(lipschitz)) + 2 for f in first]
    )
    assert bool((stats.iterations.cpu() <= bound).all())


def hadamard(n: int, device: torch.device) -> torch.Tensor:
    """Sylvester's symmetric Hadamard matrix of order ``n`` (a power of 2), entries +-1."""
    h = torch.ones(1, 1, device=device, dtype=F64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@pytest.mark.parametrize("solver", SOLVERS)
def test_reported_residual_is_the_residual_of_the_returned_solution(device, solver):
    # g(x) = c H x / sqrt(n) contracts in the 2-norm (||g||_2 = c) but not in the max-abs norm
    # (||g||_inf = c sqrt(n)), like a branch certified in the 2-norm of a whole sequence. From
    # y = a Hadamard row the residuals alternate between spread (max-abs small) and
    # concentrated (c sqrt(n) = 3.6 times larger): a sample stopped on a small step of x^k must
    # not return the unverified T(x^k), whose residual is above the tolerance.
    n, c, tol = 16, 0.9, 1e-8
    a = c * hadamard(n, device) / math.sqrt(n)

    def g(x):
        return x @ a.T

    y = torch.stack([hadamard(n, device)[3], -0.5 * hadamard(n, device)[7]])
    x_hat, stats = fixed_point_inverse(g, y, tol=tol, solver=solver)
    true_residual = (x_hat + g(x_hat) - y).abs().amax(1)
    # The solver evaluates g on the sub-batch still running, whose matmul may round differently
    # from the whole batch's: allow the rounding level of x + g(x) - y with O(1) terms (a few
    # ulps of |y|, ~1e-15), far below the 3.6x gap (~1e-8) between x^k and T(x^k) tested here.
    ulps = 32 * torch.finfo(F64).eps * float(y.abs().max())
    torch.testing.assert_close(stats.residual, true_residual, rtol=0, atol=ulps)
    assert bool(stats.converged.all()) and bool((true_residual < tol).all())
    assert torch.equal(stats.tolerance, torch.full_like(true_residual, tol))
    expected = torch.linalg.solve(torch.eye(n, dtype=F64, device=device) + a, y.T).T
    # Banach in the certificate's norm: ||x - x*||_2 <= ||x + g(x) - y||_2 / (1 - c)
    residual_2 = per_sample_norm(x_hat + g(x_hat) - y)
    assert bool((per_sample_norm(x_hat - expected) <= residual_2 / (1 - c) + 1e-14).all())


def test_converged_means_true_residual_below_default_tolerance(device):
    g = tanh_contraction(0.97, 6, device)
    y = torch.randn(4, 6, device=device, dtype=F64)
    y[3] *= 50  # a sample whose tolerance is relative
    x_hat, stats = fixed_point_inverse(g, y)
    true_residual = (x_hat + g(x_hat) - y).abs().amax(1)
    assert torch.equal(stats.tolerance, default_tolerance(y))
    assert bool(stats.converged.all())
    assert bool((true_residual < stats.tolerance).all())
    torch.testing.assert_close(stats.residual, true_residual, rtol=0, atol=1e-15)


def noisy_contraction(noise: float):
    """g(x) = x / 2 plus ``noise`` times a deterministic function of the last bits of ``x`` in
    [-1/2, 1/2): a stand-in for rounding noise, which no iterate's residual gets much below."""

    def g(x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x + noise * (torch.remainder(x * 1e14, 1.0) - 0.5)

    return g


@pytest.mark.parametrize("solver", SOLVERS)
def test_a_sample_at_the_rounding_floor_stops_there(device, solver):
    y = 2 * torch.rand(3, 20, device=device, dtype=F64) - 1
    tolerance = default_tolerance(y)  # 1e-11: |y| < 1
    g = noisy_contraction(3e-11)
    x, stats = fixed_point_inverse(g, y, solver=solver)
    assert bool(stats.converged.all())
    assert int(stats.iterations.max()) < 100  # stopped at the floor, not at max_iter
    raised = stats.tolerance == 10 * tolerance
    assert bool((raised | (stats.tolerance == tolerance)).all())
    if solver == "plain":  # plain steps do not average the ripple away (Anderson mixing may)
        assert bool(raised.all())
    assert bool((stats.residual < stats.tolerance).all())
    torch.testing.assert_close(stats.residual, (x + g(x) - y).abs().amax(1), rtol=0, atol=0)
    # An explicit tolerance is kept; a ripple far above the default is no floor
    with pytest.raises(InversionError):
        fixed_point_inverse(g, y, tol=1e-11, max_iter=200, solver=solver)
    with pytest.raises(InversionError):
        fixed_point_inverse(noisy_contraction(1e-9), y, max_iter=200, solver=solver)


# ------------------------------------------------------------------------------------------------
# position_wise: on one feature, every frame an equation of its own


@pytest.mark.parametrize("solver", SOLVERS)
def test_position_wise_solves_every_frame_to_the_samples_tolerance(device, solver):
    g = tanh_contraction(0.97, 1, device)  # acts on the last dimension: frame by frame
    x = 2 * torch.randn(4, 7, 1, device=device, dtype=F64)
    y = x + g(x)
    x_hat, stats = fixed_point_inverse(g, y, solver=solver, position_wise=True)
    assert bool(stats.converged.all())
    assert stats.iterations.shape == stats.residual.shape == stats.tolerance.shape == (4,)
    residual = (x_hat + g(x_hat) - y).abs().amax((1, 2))
    assert torch.equal(stats.residual, residual)
    assert bool((residual < default_tolerance(y)).all())
    assert float((x_hat - x).abs().max()) < 1e-9


def test_position_wise_frames_are_solved_as_alone(device):
    g = tanh_contraction(0.97, 1, device)
    x = 2 * torch.randn(3, 5, 1, device=device, dtype=F64)
    y = x + g(x)
    together, _ = fixed_point_inverse(g, y, solver="anderson", position_wise=True)
    for t in range(5):  # each frame as a sequence of one frame, with the sample's tolerance
        alone, _ = fixed_point_inverse(g, y[:, t:t + 1], solver="anderson", position_wise=True,
                                       tol=float(default_tolerance(y).min()))
        assert torch.allclose(together[:, t], alone[:, 0], atol=1e-9, rtol=0)


@pytest.mark.parametrize("solver", SOLVERS)
def test_position_wise_frames_that_stand_still_are_not_evaluated_again(device, solver):
    """Once some frame keeps its value, g sees the moving frames alone, as sequences of one
    frame with their rows of every argument, and the solution is the whole solve's."""
    lipschitz = 0.9
    x = torch.randn(5, 9, 1, device=device, dtype=F64)
    scale = 0.5 + 0.5 * torch.rand(5, 9, device=device, dtype=F64)  # a per-frame argument
    # frames that start near their fixed point stand still after a few evaluations
    scale[:, ::2] = 1e-3
    calls: list[tuple[int, ...]] = []

    def g(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return lipschitz * scale[..., None] * torch.tanh(x)

    y = x + g(x, scale)
    calls.clear()
    x_hat, stats = fixed_point_inverse(g, y, args=(scale,), solver=solver, position_wise=True)
    assert bool(stats.converged.all())
    residual = (x_hat + g(x_hat, scale) - y).abs().amax((1, 2))
    assert torch.equal(stats.residual, residual)
    assert float((x_hat - x).abs().max()) < 1e-9
    frames = [shape for shape in calls if shape[1] == 1]
    assert calls[0] == (5, 9, 1) and frames and all(shape[0] < 5 * 9 for shape in frames)
    assert sum(math.prod(shape) for shape in calls) < stats.evaluations * 5 * 9


def test_position_wise_arguments_must_be_per_frame(device):
    g = tanh_contraction(0.9, 1, device)
    y = torch.randn(3, 4, 1, device=device, dtype=F64)
    with pytest.raises(ValueError, match=r"args\[0\] must be per frame, \(B, N, ...\)"):
        fixed_point_inverse(lambda x, c: g(x), y, args=(torch.zeros(3, 2, device=device),),
                            position_wise=True)


def test_position_wise_secant_steps_need_fewer_evaluations(device):
    # slowly contracting frames, where a secant step per frame beats mixing whole samples
    g = tanh_contraction(0.97, 1, device, bias=False)
    x = 0.1 * torch.randn(6, 40, 1, device=device, dtype=F64)
    y = x + g(x)
    _, whole = fixed_point_inverse(g, y, solver="anderson")
    _, frames = fixed_point_inverse(g, y, solver="anderson", position_wise=True)
    assert bool(whole.converged.all() and frames.converged.all())
    assert frames.evaluations < whole.evaluations / 2


def test_position_wise_on_several_features_solves_whole_samples(device):
    g = tanh_contraction(0.97, 3, device)
    y = torch.randn(4, 6, 3, device=device, dtype=F64)
    x_whole, whole = fixed_point_inverse(g, y, solver="anderson")
    x_frames, frames = fixed_point_inverse(g, y, solver="anderson", position_wise=True)
    assert torch.equal(x_whole, x_frames) and whole.evaluations == frames.evaluations


def test_position_wise_needs_sequences(device):
    g = tanh_contraction(0.9, 2, device)
    with pytest.raises(ValueError, match=r"position_wise needs y of shape \(B, N, D\)"):
        fixed_point_inverse(g, torch.randn(3, 2, device=device, dtype=F64), position_wise=True)
    with pytest.raises(TypeError, match="position_wise must be a bool"):
        fixed_point_inverse(g, torch.randn(3, 1, 2, device=device, dtype=F64),
                            position_wise=1)  # type: ignore[arg-type]


def test_secant_mixer_is_anderson_of_depth_one(device):
    a = 0.9 * symmetric_unit_matrix(4, device, F64)
    target = torch.randn(5, 4, device=device, dtype=F64)
    secant = SecantMixer(5, 4, target)
    anderson = AndersonMixer(5, 4, 1, target)
    x_s = x_a = torch.zeros_like(target)
    for k in range(12):
        engage = torch.tensor([True, True, k >= 2, k >= 4, False], device=device)
        image_s, image_a = target - torch.tanh(x_s @ a.T), target - torch.tanh(x_a @ a.T)
        x_s = secant.step(x_s, image_s, (image_s - x_s).abs().amax(1), engage=engage)
        x_a = anderson.step(x_a, image_a, (image_a - x_a).abs().amax(1), engage=engage)
        assert torch.allclose(x_s, x_a, atol=1e-10, rtol=0)
    secant.keep(torch.tensor([True, False, True, True, False], device=device))
    assert secant.residual.shape == (3, 4) and secant.engaged.tolist() == [True] * 3


def test_secant_mixer_rejects_a_step_that_raises_the_residual(device):
    mixer = SecantMixer(1, 1, torch.zeros(1, 1, device=device, dtype=F64))
    x = torch.zeros(1, 1, device=device, dtype=F64)
    # two accepted pairs, then an extrapolated step whose residual grew: back to the plain
    # step from the last accepted iterate, whose image is known
    first = mixer.step(x, x + 1.0, torch.ones(1, device=device, dtype=F64))
    second = mixer.step(first, first + 0.5, torch.full((1,), 0.5, device=device, dtype=F64))
    assert bool(mixer.extrapolated.all())
    back = mixer.step(second, second + 3.0, torch.full((1,), 3.0, device=device, dtype=F64))
    assert torch.equal(back, first + 0.5) and not bool(mixer.extrapolated.any())


def test_anderson_mixer_rejects_a_step_that_raises_the_residual_row_by_row(device):
    # row 0's extrapolated step raises its residual: back to the plain step from its last
    # accepted iterate; row 1, whose residual falls, mixes as a mixer of its own would
    mixer = AndersonMixer(2, 1, 2, torch.zeros(1, 1, device=device, dtype=F64))
    alone = AndersonMixer(1, 1, 2, torch.zeros(1, 1, device=device, dtype=F64))
    x = torch.zeros(2, 1, device=device, dtype=F64)
    first = mixer.step(x, x + 1.0, torch.ones(2, device=device, dtype=F64))
    alone.step(x[1:], x[1:] + 1.0, torch.ones(1, device=device, dtype=F64))
    second = mixer.step(first, first + 0.5, torch.full((2,), 0.5, device=device, dtype=F64))
    alone.step(first[1:], first[1:] + 0.5, torch.full((1,), 0.5, device=device, dtype=F64))
    assert bool(mixer.extrapolated.all())
    steps = torch.tensor([3.0, 0.1], device=device, dtype=F64)
    image = second + steps[:, None]
    back = mixer.step(second, image, steps)
    assert torch.equal(back[0], first[0] + 0.5)
    assert mixer.extrapolated.tolist() == [False, True]
    expected = alone.step(second[1:], image[1:], steps[1:])
    torch.testing.assert_close(back[1:], expected, atol=1e-15, rtol=0)


def test_anderson_mixer_takes_the_plain_step_where_its_weights_are_not_finite(device):
    mixer = AndersonMixer(2, 3, 3, torch.zeros(1, 1, device=device, dtype=F64))
    alone = AndersonMixer(1, 3, 3, torch.zeros(1, 1, device=device, dtype=F64))
    a = 0.9 * symmetric_unit_matrix(3, device, F64)
    x = torch.randn(2, 3, device=device, dtype=F64)
    x_alone = x[1:]
    for k in range(3):
        image = 1.0 - torch.tanh(x @ a.T)
        if k == 2:  # row 0's residual is not finite: its weights are not either
            image[0, 0] = float("nan")
        step = (image - x).abs().amax(1)
        x, x_alone = mixer.step(x, image, step), alone.step(x_alone, image[1:], step[1:])
        torch.testing.assert_close(x[1:], x_alone, atol=1e-14, rtol=0)
    assert bool(torch.isnan(x[0, 0])) and torch.equal(x[0, 1:], image[0, 1:])  # the plain step
