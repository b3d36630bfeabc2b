r"""The exponential moving average of the weights, kept with torch's own averaging wrapper.

With ``ema = β > 0`` the run keeps a :class:`torch.optim.swa_utils.AveragedModel` updated after
every optimiser step by :func:`~torch.optim.swa_utils.get_ema_multi_avg_fn`: the first update
copies the weights, every later one moves the averages towards them,
:math:`\bar\theta \leftarrow \beta\bar\theta + (1-\beta)\theta`. Only parameters are averaged;
buffers (ActNorm state, power-iteration vectors) stay the model's own. Validation and the
evaluation of a run swap the averages into the live model (:func:`averaged_parameters`), so its
log-determinant estimators keep their random streams.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

__all__ = ["averaged_parameters", "copy_parameters", "load_average", "moving_average"]


def moving_average(model: nn.Module, decay: float) -> AveragedModel:
    r"""An exponential moving average of ``model``'s parameters with decay :math:`\beta`.

    Call ``average.update_parameters(model)`` after every optimiser step.

    Args:
        model: The model whose parameters are averaged (copied once, on its device).
        decay: :math:`\beta \in (0, 1)`.

    Raises:
        ValueError: ``decay`` outside ``(0, 1)``.

    Example:
        >>> model = nn.Linear(2, 1)
        >>> average = moving_average(model, decay=0.5)
        >>> average.update_parameters(model)  # the first update copies
        >>> with torch.no_grad():
        ...     _ = model.bias.add_(1.0)
        >>> start = average.module.bias.detach().clone()
        >>> average.update_parameters(model)
        >>> torch.allclose(average.module.bias, (start + model.bias) / 2)
        True
    """
    if not 0.0 < decay < 1.0:
        raise ValueError(f"decay must lie in (0, 1), got {decay}")
    return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay))


def load_average(average: AveragedModel, state: dict[str, Tensor]) -> None:
    """Restore a moving average from a checkpoint's ``ema`` entry.

    Args:
        average: The average of the model the checkpoint belongs to.
        state: ``average.state_dict()`` as saved, or, from checkpoints of format 1, the averages
            by parameter name (they had been updated at least once).

    Raises:
        RuntimeError: the state does not match the model's parameters.
    """
    if "n_averaged" not in state:  # format 1
        state = {
            **{f"module.{name}": value for name, value in state.items()},
            **{f"module.{name}": value for name, value in average.module.named_buffers()},
            "n_averaged": torch.ones_like(average.n_averaged),
        }
    average.load_state_dict(state)


@torch.no_grad()
def copy_parameters(model: nn.Module, values: dict[str, Tensor]) -> None:
    """Overwrite every parameter of ``model`` with the tensor of the same name in ``values``.

    Example:
        >>> model = nn.Linear(2, 1)
        >>> copy_parameters(model, {"weight": torch.ones(1, 2), "bias": torch.zeros(1)})
        >>> model.weight.tolist()
        [[1.0, 1.0]]
    """
    for name, parameter in model.named_parameters():
        parameter.copy_(values[name])


@contextmanager
def averaged_parameters(model: nn.Module, average: AveragedModel | None) -> Iterator[None]:
    """Within the block, ``model``'s parameters are the averages (nothing changes for ``None``).

    Example:
        >>> model = nn.Linear(2, 1)
        >>> average = moving_average(model, decay=0.5)
        >>> with torch.no_grad():
        ...     _ = model.bias.fill_(3.0)
        >>> with averaged_parameters(model, average):
        ...     torch.equal(model.bias, average.module.bias)
        True
        >>> model.bias.item()
        3.0
    """
    if average is None:
        yield
        return
    current = {name: p.detach().clone() for name, p in model.named_parameters()}
    copy_parameters(model, dict(average.module.named_parameters()))
    try:
        yield
    finally:
        copy_parameters(model, current)
