"""The moving average of the weights: the EMA recursion, the swap, checkpoint round trips."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from iresflow.train.averaging import (
    averaged_parameters,
    copy_parameters,
    load_average,
    moving_average,
)


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _random_steps(model: nn.Module, n: int, generator: torch.Generator) -> list[dict]:
    """Perturb the weights ``n`` times; the weights after every perturbation."""
    states = []
    for _ in range(n):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, dtype=p.dtype, generator=generator))
        states.append(_snapshot(model))
    return states


def test_moving_average_follows_the_ema_recursion() -> None:
    model = nn.Linear(3, 2).double()
    decay = 0.75
    average = moving_average(model, decay)
    expected: dict[str, torch.Tensor] | None = None
    generator = torch.Generator().manual_seed(0)
    for _ in range(4):
        (weights,) = _random_steps(model, 1, generator)
        average.update_parameters(model)
        if expected is None:  # the first update copies the weights
            expected = dict(weights)
        else:
            expected = {k: decay * expected[k] + (1 - decay) * weights[k] for k in weights}
        for name, p in average.module.named_parameters():
            torch.testing.assert_close(p, expected[name], rtol=1e-14, atol=1e-14)
    for decay in (0.0, 1.0, -0.5):
        with pytest.raises(ValueError, match="decay"):
            moving_average(model, decay)


def test_averaged_parameters_swap_in_and_back() -> None:
    model = nn.Linear(3, 2).double()
    average = moving_average(model, 0.5)
    _random_steps(model, 1, torch.Generator().manual_seed(1))
    average.update_parameters(model)
    _random_steps(model, 1, torch.Generator().manual_seed(2))
    live = _snapshot(model)
    with averaged_parameters(model, average):
        for name, p in model.named_parameters():
            assert torch.equal(p, dict(average.module.named_parameters())[name])
            assert not torch.equal(p, live[name])
    for name, p in model.named_parameters():
        assert torch.equal(p, live[name])
    with averaged_parameters(model, None):
        for name, p in model.named_parameters():
            assert torch.equal(p, live[name])
    with pytest.raises(RuntimeError, match="inside"), averaged_parameters(model, average):
        raise RuntimeError("inside")
    for name, p in model.named_parameters():  # restored after an error too
        assert torch.equal(p, live[name])


def test_load_average_continues_exactly() -> None:
    generator = torch.Generator().manual_seed(3)
    model = nn.Linear(3, 2).double()
    average = moving_average(model, 0.9)
    _random_steps(model, 1, generator)
    average.update_parameters(model)
    copy = moving_average(model, 0.9)
    load_average(copy, average.state_dict())
    _random_steps(model, 1, generator)
    average.update_parameters(model)
    copy.update_parameters(model)
    for a, b in zip(average.module.parameters(), copy.module.parameters(), strict=True):
        assert torch.equal(a, b)


def test_load_average_reads_format_one_averages() -> None:
    """Format-1 checkpoints stored the averages by parameter name; updates continue the EMA."""
    model = nn.Linear(3, 2).double()
    saved = {name: torch.full_like(p, 2.0) for name, p in model.named_parameters()}
    average = moving_average(model, 0.5)
    load_average(average, saved)
    for name, p in average.module.named_parameters():
        assert torch.equal(p, saved[name])
    copy_parameters(model, {name: torch.zeros_like(v) for name, v in saved.items()})
    average.update_parameters(model)  # a moving-average step, not a first copy
    for p in average.module.parameters():
        assert torch.equal(p, torch.ones_like(p))
