"""ActNorm for sequences: docs/math.md#actnorm, check H17 (docs/math.md#checks)."""

from __future__ import annotations

import math

import pytest
import torch
from nflows.transforms import CompositeTransform, InverseTransform

from iresflow.transforms.actnorm import MIN_INIT_VARIANCE, ActNorm
from iresflow.transforms.composite import SequenceCompositeTransform


def _mask(lengths: list[int], n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]


def _randomised(features: int, device: torch.device, dtype: torch.dtype) -> ActNorm:
    """An initialised ActNorm with random parameters (eval mode: no further initialisation)."""
    actnorm = ActNorm(features).to(device=device, dtype=dtype)
    with torch.no_grad():
        actnorm.shift.normal_()
        actnorm.log_scale.normal_(std=0.5)
    return actnorm.eval()


def test_inverse_is_exact_and_padding_passes_through(device, dtype):
    actnorm = _randomised(3, device, dtype)
    x = torch.randn(3, 4, 3, device=device, dtype=dtype)
    mask = _mask([4, 2, 1], 4, device)
    y, logdet = actnorm(x, mask=mask)
    x_back, logdet_inv = actnorm.inverse(y, mask=mask)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(x_back, x, atol=tol, rtol=tol)
    torch.testing.assert_close(logdet_inv, -logdet, atol=tol, rtol=tol)
    padded = ~mask
    assert torch.equal(y[padded], x[padded])
    assert not torch.allclose(y[mask], x[mask])


@pytest.mark.parametrize("lengths", [[3, 1], [3, 3]])
def test_logdet_matches_slogdet_of_jacobian(device, dtype, lengths):
    actnorm = _randomised(2, device, dtype)
    x = torch.randn(len(lengths), 3, 2, device=device, dtype=dtype)
    mask = _mask(lengths, 3, device)
    _, logdet = actnorm(x, mask=mask)
    for b in range(len(lengths)):
        def f(v: torch.Tensor, b: int = b) -> torch.Tensor:
            return actnorm(v.reshape(1, 3, 2), mask=mask[b : b + 1])[0].reshape(-1)

        jac = torch.autograd.functional.jacobian(f, x[b].reshape(-1))
        sign, logabs = torch.linalg.slogdet(jac)
        assert sign.item() == 1.0
        torch.testing.assert_close(logdet[b], logabs)


def test_vectors_are_sequences_of_length_one(device, dtype):
    actnorm = _randomised(3, device, dtype)
    x = torch.randn(5, 3, device=device, dtype=dtype)
    y, logdet = actnorm(x)
    y_seq, logdet_seq = actnorm(x.unsqueeze(1))
    torch.testing.assert_close(y, y_seq.squeeze(1))
    torch.testing.assert_close(logdet, logdet_seq)
    jac = torch.autograd.functional.jacobian(lambda v: actnorm(v.unsqueeze(0))[0][0], x[0])
    torch.testing.assert_close(logdet[0], torch.linalg.slogdet(jac)[1])


def test_initialisation_standardises_real_tokens_and_ignores_padding(device, dtype):
    actnorm = ActNorm(3).to(device=device, dtype=dtype)
    scale = torch.tensor([0.5, 2.0, 3.0], device=device, dtype=dtype)
    x = torch.randn(6, 5, 3, device=device, dtype=dtype) * scale + 1.5
    mask = _mask([5, 4, 3, 2, 1, 5], 5, device)
    x = torch.where(mask.unsqueeze(-1), x, 1e3)  # padding values that would wreck the statistics
    actnorm.initialize(x, mask)
    y, _ = actnorm.train()(x, mask=mask)
    assert bool(actnorm.initialized)
    real = y[mask]
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(real.mean(0), torch.zeros_like(real[0]), atol=tol, rtol=0)
    torch.testing.assert_close(real.var(0, unbiased=False), torch.ones_like(real[0]), atol=tol,
                               rtol=tol)
    # The same statistics as an initialisation on the real tokens alone, as vectors.
    reference = ActNorm(3).to(device=device, dtype=dtype).train()
    reference.initialize(x[mask])
    torch.testing.assert_close(actnorm.shift, reference.shift)
    torch.testing.assert_close(actnorm.log_scale, reference.log_scale)


def test_variance_floor(device, dtype):
    actnorm = ActNorm(2).to(device=device, dtype=dtype).train()
    x = torch.randn(50, 2, device=device, dtype=dtype) * torch.tensor([0.01, 1.0], device=device,
                                                                        dtype=dtype)
    actnorm.initialize(x)
    rel = 1e-12 if dtype == torch.float64 else 1e-6
    expected = -0.5 * math.log(MIN_INIT_VARIANCE)
    assert actnorm.log_scale[0].item() == pytest.approx(expected, rel=rel)
    variance = x[:, 1].double().var(unbiased=False).item()
    assert actnorm.log_scale[1].item() == pytest.approx(-0.5 * math.log(variance), rel=1e-5)


def test_only_initialize_sets_the_layer(device, dtype):
    actnorm = ActNorm(2).to(device=device, dtype=dtype)
    x = torch.randn(8, 3, 2, device=device, dtype=dtype) * 3 + 2
    actnorm.eval()(x)
    actnorm.train().inverse(x)
    assert not bool(actnorm.initialized) and not actnorm.is_initialized
    assert torch.count_nonzero(actnorm.shift) == 0
    with pytest.raises(RuntimeError, match="initialize"):
        actnorm(x)  # a training forward refuses an uninitialised layer
    actnorm.initialize(x)
    assert bool(actnorm.initialized) and actnorm.is_initialized
    first = (actnorm.shift.clone(), actnorm.log_scale.clone())
    actnorm(x * 5 - 1)  # forwards never initialise
    assert torch.equal(actnorm.shift, first[0]) and torch.equal(actnorm.log_scale, first[1])


def test_state_dict_round_trip_does_not_reinitialise(device, dtype):
    actnorm = ActNorm(2).to(device=device, dtype=dtype).train()
    x = torch.randn(8, 3, 2, device=device, dtype=dtype) * 3 + 2
    actnorm.initialize(x)
    state = actnorm.state_dict()
    assert "initialized" in state
    loaded = ActNorm(2).to(device=device, dtype=dtype).train()
    loaded.load_state_dict(state)
    y_loaded, logdet_loaded = loaded(x + 7.0)  # a training forward on other data
    y, logdet = actnorm(x + 7.0)
    assert torch.equal(y_loaded, y) and torch.equal(logdet_loaded, logdet)
    # Loading an uninitialised state re-enables the initialisation.
    loaded.load_state_dict(ActNorm(2).to(device=device, dtype=dtype).state_dict())
    assert not loaded.is_initialized
    SequenceCompositeTransform([loaded]).initialize(x)
    assert bool(loaded.initialized)
    torch.testing.assert_close(loaded.shift, actnorm.shift)


def test_gradients_reach_both_parameters(device, dtype):
    actnorm = _randomised(2, device, dtype)
    x = torch.randn(4, 3, 2, device=device, dtype=dtype)
    y, logdet = actnorm(x, mask=_mask([3, 2, 1, 3], 3, device))
    (y.square().sum() + logdet.sum()).backward()
    for p in actnorm.parameters():
        assert p.grad is not None and bool(p.grad.abs().sum() > 0)


def test_nflows_inverse_composition_is_identity(device, dtype):
    actnorm = _randomised(3, device, dtype)
    x = torch.randn(4, 2, 3, device=device, dtype=dtype)
    y, logdet = CompositeTransform([InverseTransform(actnorm), actnorm])(x)
    torch.testing.assert_close(y, x)
    torch.testing.assert_close(logdet, torch.zeros_like(logdet))


def test_bad_inputs_raise(device, dtype):
    actnorm = ActNorm(3).to(device=device, dtype=dtype)
    x = torch.randn(2, 4, 3, device=device, dtype=dtype)
    with pytest.raises(ValueError, match="3 features"):
        actnorm(torch.randn(2, 4, 2, device=device, dtype=dtype))
    with pytest.raises(ValueError, match="shape"):
        actnorm(torch.randn(2, 4, 3, 1, device=device, dtype=dtype))
    with pytest.raises(TypeError, match="bool"):
        actnorm(x, mask=torch.ones(2, 4, device=device))
    with pytest.raises(ValueError, match=r"\(B, N\)"):
        actnorm(x, mask=torch.ones(2, 3, dtype=torch.bool, device=device))
    with pytest.raises(ValueError, match="requires inputs of shape"):
        actnorm(x[:, 0], mask=torch.ones(2, 4, dtype=torch.bool, device=device))
    with pytest.raises(ValueError, match="NaN"):
        actnorm.inverse(torch.full_like(x, float("nan")))
    with pytest.raises(TypeError, match="int"):
        ActNorm(2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive"):
        ActNorm(0)
