r"""The closed-form reference of an evaluation: an AR(p) Gaussian beside the flow.

Every evaluation of a run (``iresflow evaluate``, and the test NLL that ``iresflow train``
prints) also fits the linear-Gaussian :math:`\mathrm{AR}(p)` model
(:class:`~iresflow.models.reference.AutoregressiveGaussian`) on the run's training split, in the
model space the flow sees (after the dataset's preprocessing), with the order
:math:`p \in \{0, \dots, 3\}` chosen by the likelihood of the run's validation split, and scores
the evaluated split with it, converted to the dataset's unit like the flow's NLL
(:meth:`~iresflow.data.datasets.SequenceDataset.nll`). It is fitted on the training sequences
only (no refit on the validation split), so that it has seen the same data as the flow. A flow
that is worse than this closed-form model, or that has sequences far above its median NLL
(:func:`~iresflow.models.worst_cases.summarize_sequence_nll`) where the reference has none, is
reported with a :class:`ReferenceWarning` (docs/cli.md#reference).

The reference is unconditional, :math:`p(x)`: for a conditional run, whose NLL is that of
:math:`p(x \mid c)`, it is still a valid yardstick (a conditional model can only gain from the
context) and is labelled unconditional.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from iresflow.data.readers import pad_to
from iresflow.data.splits import SequenceDataset, SequenceSplit
from iresflow.data.store import StoredSplit
from iresflow.models.reference import AutoregressiveGaussian
from iresflow.models.worst_cases import summarize_sequence_nll

__all__ = [
    "REFERENCE_MAX_ORDER",
    "REFERENCE_MAX_VALUES",
    "ReferenceWarning",
    "compare_with_reference",
    "fit_reference",
]

#: Highest order :math:`P` that the validation split chooses from.
REFERENCE_MAX_ORDER = 3
#: Most padded values (sequences x frames x features) of the training, validation and evaluated
#: splits together that the reference holds in memory; above it (a large sequence store) the
#: reference is skipped with the reason.
REFERENCE_MAX_VALUES = 20_000_000


class ReferenceWarning(UserWarning):
    """The flow is worse than the closed-form reference of its evaluation."""


class _Frames(NamedTuple):
    """A split held in memory: ``x`` ``(B, N, D)`` and ``mask`` ``(B, N)``."""

    x: Tensor
    mask: Tensor


def _in_memory(split: SequenceSplit | StoredSplit, max_len: int) -> _Frames:
    """The frames of a split padded to ``max_len`` (a store's are read in one pass)."""
    if isinstance(split, StoredSplit):
        x, mask = split.batch(torch.arange(len(split)), torch.device("cpu"))
    else:
        x, mask = split.x, split.mask
    return _Frames(*pad_to(x, mask, max_len))


def fit_reference(
    dataset: SequenceDataset, split: str, *, condition: str = "none"
) -> dict[str, Any]:
    r"""Fit the AR(p) Gaussian on a dataset's training split and score one of its splits.

    The order :math:`p \le` :data:`REFERENCE_MAX_ORDER` is chosen by the validation NLL of the
    fits on the training split (:meth:`~iresflow.models.reference.AutoregressiveGaussian.
    fit_selected_order` with ``refit=False``); the model is not refitted on the validation
    split. The NLLs are in the dataset's unit and original units, like the flow's.

    Args:
        dataset: The run's data (its ``train``, ``val`` and ``split``).
        split: ``"test"``, ``"val"`` or ``"train"``: the split to score.
        condition: The run's condition (``"none"``, ``"label"``, ``"covariates"``), stored
            as ``"flow_condition"``: the reference itself is always unconditional.

    Returns:
        ``{"model", "order", "max_order", "parameters", "nll", "val_nll", "per_sequence",
        "flow_condition"}``: the model's name (e.g. ``"AR(2) Gaussian"``), the chosen order, its
        free parameters, the NLL of ``split`` and of the validation split, the
        :class:`~iresflow.models.worst_cases.NLLDistribution` of the per-sequence NLLs of
        ``split`` as a dict, and the run's condition; or ``{"skipped": reason}``
        when the splits do not fit in memory (:data:`REFERENCE_MAX_VALUES`) or admit no fit.
    """
    if split not in ("test", "val", "train"):
        raise ValueError(f"split must be test, val or train, got {split!r}")
    splits = {name: getattr(dataset, name) for name in ("train", "val", split)}
    values = sum(len(part) for part in splits.values()) * dataset.max_len * dataset.features
    if values > REFERENCE_MAX_VALUES:
        return {"skipped": (
            f"the training, validation and {split} splits hold {values:.2e} padded values, more "
            f"than the {REFERENCE_MAX_VALUES:.0e} the closed-form fit keeps in memory"
        )}
    frames = {name: _in_memory(part, dataset.max_len) for name, part in splits.items()}
    model = AutoregressiveGaussian(dataset.features, dataset.max_len)
    try:
        model.fit_selected_order(
            frames["train"], frames["val"], REFERENCE_MAX_ORDER, refit=False
        )
    except (ValueError, torch.linalg.LinAlgError) as error:
        return {"skipped": f"no closed-form fit: {error}"}
    log_prob = model.log_prob(*frames[split])
    data = splits[split]
    return {
        "model": f"AR({model.order}) Gaussian",
        "order": model.order,
        "max_order": REFERENCE_MAX_ORDER,
        "parameters": model.num_parameters,
        "nll": dataset.nll(log_prob, data),
        "val_nll": dataset.nll(model.log_prob(*frames["val"]), dataset.val),
        "per_sequence": summarize_sequence_nll(dataset.sequence_nll(log_prob, data)).to_dict(),
        "flow_condition": condition,
    }


def compare_with_reference(result: dict[str, Any]) -> list[str]:
    """The warnings of an evaluation against its reference, as sentences.

    A flow is flagged when its NLL is above the reference's (the point estimates, also for
    the roulette method), and when it has sequences far above its median NLL while the
    reference has none.

    Args:
        result: A result of :func:`~iresflow.runs.evaluate.evaluate_run` with
            ``"per_sequence"`` and ``"reference"``.

    Returns:
        Zero, one or two sentences.

    Example:
        >>> flow = {"far_above": 2, "worst": 3788.0, "threshold": 56.5}
        >>> result = {"split": "test", "nll": 117.4, "unit": "nats/frame", "per_sequence": flow,
        ...           "reference": {"model": "AR(3) Gaussian", "nll": 13.7,
        ...                         "per_sequence": {"far_above": 0}}}
        >>> for line in compare_with_reference(result):
        ...     print(line[:44])
        the flow's test NLL 117.4000 nats/frame is w
        2 test sequences of the flow are far above i
    """
    reference, flow = result.get("reference", {}), result.get("per_sequence")
    if "nll" not in reference or flow is None:
        return []
    split, unit, name = result["split"], result["unit"], reference["model"]
    warnings = []
    if result["nll"] > reference["nll"]:
        warnings.append(
            f"the flow's {split} NLL {result['nll']:.4f} {unit} is worse than the closed-form "
            f"{name}'s {reference['nll']:.4f}"
        )
    if flow["far_above"] > 0 and reference["per_sequence"]["far_above"] == 0:
        warnings.append(
            f"{flow['far_above']} {split} sequences of the flow are far above its median NLL "
            f"(worst {flow['worst']:.4f}, threshold {flow['threshold']:.4f} {unit}); the {name} "
            "has none"
        )
    return warnings
