"""The volatility step: every frame divided by a scale that follows the squares of the frames
before it (docs/math.md#volatility-step).

Oracles: the dense autograd Jacobian (``slogdet`` and its diagonal blocks), ``gradcheck`` and
the inverse against the forward."""

from __future__ import annotations

import pytest
import torch
from oracles import jacobian, jacobian_logdet, padded_batch

from iresflow.models.residual_flow import ResidualSequenceFlow
from iresflow.transforms.base import FRAMES
from iresflow.transforms.volatility import VolatilityScale

F64 = torch.float64
D = 3


def make_step(device, order: int = 2, seed: int = 0, **kwargs) -> VolatilityScale:
    """A float64 step, initialised and moved away from its fit: weights of order one."""
    torch.manual_seed(seed)
    step = VolatilityScale(D, order, **kwargs).to(device=device, dtype=F64)
    step.initialize(torch.randn(4, 6, D, dtype=F64, device=device))
    with torch.no_grad():
        step.raw_floor.normal_()
        step.raw_weights.normal_()
    return step


def _arch_series(floor: torch.Tensor, weights: torch.Tensor, batch: int, length: int):
    """Frames of the model itself: x_t = sigma_t * standard normal noise."""
    order = weights.shape[0] // floor.shape[0]
    x = torch.zeros(batch, length + order, floor.shape[0], dtype=F64)
    for t in range(order, length + order):
        lags = torch.cat([x[:, t - j].square() for j in range(1, order + 1)], dim=-1)
        x[:, t] = (floor + lags @ weights).sqrt() * torch.randn(batch, floor.shape[0],
                                                               dtype=F64)
    return x[:, order:]


def test_initialisation_is_the_least_squares_arch_fit():
    torch.manual_seed(0)
    floor = torch.tensor([0.5, 1.0], dtype=F64)
    weights = torch.tensor([[0.4, 0.0], [0.1, 0.2]], dtype=F64)  # q = 1: (q D, D)
    x = _arch_series(floor, weights, 400, 60)
    step = VolatilityScale(2, 1).double()
    step.initialize(x)
    fitted = torch.nn.functional.softplus(step.raw_weights)
    torch.testing.assert_close(fitted, weights.clamp_min(1e-4), atol=0.05, rtol=0)
    mean = x.square().mean((0, 1))
    implied = torch.nn.functional.softplus(step.raw_floor) + x.square().mean((0, 1)) @ fitted
    torch.testing.assert_close(implied, mean, atol=0.05 * float(mean.max()), rtol=0)


def test_without_enough_frames_the_step_stays_close_to_the_identity(device):
    step = VolatilityScale(D, 3).to(device=device, dtype=F64)
    x, mask = padded_batch(device)  # no real frame has three real predecessors
    step.initialize(x, mask)
    y, logabsdet = step(x, mask=mask)
    torch.testing.assert_close(y, x, atol=1e-2, rtol=1e-2)
    assert logabsdet.abs().max() < 0.05 and step.is_initialized


@pytest.mark.parametrize("masked", [False, True])
def test_logdet_and_its_frames_match_the_jacobian_oracle(device, masked):
    step = make_step(device)
    x, mask = padded_batch(device)
    mask = mask if masked else None
    y, logabsdet = step(x, mask=mask)
    torch.testing.assert_close(logabsdet, jacobian_logdet(lambda a, m: step(a, mask=m)[0], x,
                                                          mask))
    frames = step(x, mask=mask, logdet=FRAMES)[1]
    jac = jacobian(lambda a, m: step(a, mask=m)[0], x, mask).view(3, 4, D, 4, D)
    for t in range(4):
        assert (jac[:, t, :, t + 1 :] == 0).all()  # nothing above the diagonal blocks
        blocks = torch.linalg.slogdet(jac[:, t, :, t, :])[1]
        expected = blocks if mask is None else torch.where(mask[:, t], blocks, 0.0)
        torch.testing.assert_close(frames[:, t], expected)


def test_the_scale_reads_the_q_frames_before_and_no_padding(device):
    step = make_step(device, order=2)
    x = torch.randn(2, 7, D, dtype=F64, device=device)
    y, _ = step(x)
    for t in range(7):
        moved = x.clone()
        moved[:, t] += 3.0
        y_moved, _ = step(moved)
        assert torch.equal(y_moved[:, :t], y[:, :t])
        changed = (y_moved - y).abs().amax((0, 2)) > 0
        assert changed.tolist() == [t <= u <= t + 2 for u in range(7)]
    x, mask = padded_batch(device)
    y, logabsdet = step(x, mask=mask)
    other = torch.where(mask[..., None], x, 50 * torch.randn_like(x))
    y_other, logabsdet_other = step(other, mask=mask)
    assert torch.equal(y_other[mask], y[mask]) and torch.equal(logabsdet_other, logabsdet)
    assert torch.equal(y[~mask], x[~mask])


def test_windows_of_the_variance_equal_the_whole(device):
    step = make_step(device, order=3)
    x, mask = padded_batch(device)
    whole = step.variance(x, mask)
    for start, stop in ((0, 1), (0, 4), (1, 3), (2, 4), (3, 4), (4, 4)):
        torch.testing.assert_close(step.variance(x, mask, start, stop), whole[:, start:stop],
                                   atol=1e-14, rtol=0)
    assert (whole >= torch.nn.functional.softplus(step.raw_floor)).all()


@pytest.mark.parametrize("window", [1, 2, None])
@pytest.mark.parametrize("masked", [False, True])
def test_inverse_round_trip_within_n_sweeps(device, masked, window):
    step = make_step(device, inverse_window=window)
    x, mask = padded_batch(device, scale=2.0)
    mask = mask if masked else None
    y, logabsdet = step(x, mask=mask)
    x_back, inverse_logabsdet = step.inverse(y, mask=mask)
    torch.testing.assert_close(x_back, x, atol=1e-9, rtol=0)
    torch.testing.assert_close(inverse_logabsdet, -logabsdet, atol=1e-9, rtol=0)
    stats = step.last_inverse_stats
    assert bool(stats.converged.all()) and int(stats.iterations.max()) <= x.shape[1]


def test_outputs_and_logdet_pass_gradcheck(device):
    step = make_step(device)
    x, mask = padded_batch(device)
    x.requires_grad_(True)
    floor, weights = (p.detach().clone().requires_grad_(True)
                      for p in (step.raw_floor, step.raw_weights))

    def outputs(x, floor, weights):
        y, logabsdet = torch.func.functional_call(
            step, {"raw_floor": floor, "raw_weights": weights}, (x,), {"mask": mask})
        return y, logabsdet

    assert torch.autograd.gradcheck(outputs, (x, floor, weights))


def test_vectors_are_one_frame_sequences(device):
    step = make_step(device)
    x = torch.randn(4, D, dtype=F64, device=device)
    y, logabsdet = step(x)
    floor = torch.nn.functional.softplus(step.raw_floor)
    torch.testing.assert_close(y, x / floor.sqrt())
    torch.testing.assert_close(logabsdet, (-0.5 * floor.log().sum()).expand(4))
    torch.testing.assert_close(step.inverse(y)[0], x)


def test_a_flow_with_a_volatility_step_forecasts_and_samples(device):
    model = ResidualSequenceFlow(features=2, max_len=9, n_blocks=1, hidden=8, volatility=2,
                                 causal=True).to(device=device, dtype=F64)
    data = torch.randn(8, 9, 2, dtype=F64, device=device) * torch.linspace(0.2, 3, 9,
                                                                           device=device)[:, None]
    model.initialize(data)
    names = [name for name, _ in model.transform.named_steps()]
    assert names.index("input.volatility") == names.index("input.autoregressive") + 1
    forecast = model.eval().forecast(data[:2, :5], horizon=4, num_samples=3)
    assert forecast.shape == (3, 2, 4, 2) and torch.isfinite(forecast).all()


@pytest.mark.parametrize(("kwargs", "error"), [
    ({"features": 0}, ValueError),
    ({"order": 0}, ValueError),
    ({"order": 1.5}, TypeError),
    ({"inverse_window": 0}, ValueError),
    ({"on_failure": "ignore"}, ValueError),
])
def test_bad_options_raise(kwargs, error):
    with pytest.raises(error):
        VolatilityScale(**({"features": D} | kwargs))
