r"""Generative classification with a label-conditional flow: Bayes' rule over its likelihoods.

A flow :math:`p_\theta(x \mid y)` trained on labelled sequences classifies a sequence by the
posterior mode

.. math:: \hat y = \arg\max_k \; \log p_\theta(x \mid y = k) + \log \pi_k,

with :math:`\pi` the class frequencies of the training split (uniform when every class is
equally frequent). :func:`class_log_likelihoods` scores every sequence under every class with
the exact or the Russian-roulette log-determinant, shared among the ranks of a process group
like any evaluation (:func:`~iresflow.train.likelihood.sharded_log_prob`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from iresflow.data.datasets import SequenceSplit
from iresflow.models.flow import SequenceFlow
from iresflow.train.likelihood import sharded_log_prob

__all__ = ["bayes_classify", "class_log_likelihoods", "class_prior", "confusion_matrix"]


def class_log_likelihoods(
    model: SequenceFlow,
    split: SequenceSplit,
    *,
    method: str = "exact",
    n_samples: int = 1,
    batch_size: int = 64,
    seed: int = 0,
) -> Tensor:
    r""":math:`\log p(x_b \mid y = k)` of every sequence under every class of a model.

    Every class is scored with the same per-batch seeds, so roulette estimates of different
    classes share their random draws and their differences vary less than the estimates.

    Args:
        model: A label-conditional flow (``num_classes = K > 0``), in evaluation mode after
            the call.
        split: Sequences ``(B, N, D)`` with their mask.
        method: ``"exact"`` or ``"roulette"``.
        n_samples: Roulette estimates averaged per sequence and class.
        batch_size: Sequences per forward pass.
        seed: Seed of the roulette estimates (the same for every class).

    Returns:
        Model-space log-densities ``(B, K)``, float64, on the CPU.

    Raises:
        ValueError: the model is not label-conditional.

    Example:
        >>> from iresflow.models.residual_flow import ResidualSequenceFlow
        >>> model = ResidualSequenceFlow(features=1, max_len=3, n_blocks=1, hidden=4,
        ...                                 num_classes=2)
        >>> split = SequenceSplit(torch.randn(5, 3, 1), torch.ones(5, 3, dtype=torch.bool),
        ...                       torch.zeros(5))
        >>> class_log_likelihoods(model, split).shape
        torch.Size([5, 2])
    """
    encoder = model.context_encoder
    num_classes = 0 if encoder is None else encoder.num_classes
    if num_classes == 0:
        raise ValueError("class_log_likelihoods needs a label-conditional model (num_classes > 0)")
    columns = [
        sharded_log_prob(
            model, split, method=method, n_samples=n_samples, batch_size=batch_size, seed=seed,
            label=k,
        )[0]
        for k in range(num_classes)
    ]
    return torch.stack(columns, dim=1)


def class_prior(labels: Tensor, num_classes: int) -> Tensor:
    r"""Class frequencies :math:`\pi_k` of labels, the prior of :func:`bayes_classify`.

    Args:
        labels: Class indices ``(B,)``, int64, in ``[0, num_classes)``.
        num_classes: Number of classes ``K``.

    Returns:
        Frequencies ``(K,)``, float64, summing to 1.

    Example:
        >>> class_prior(torch.tensor([0, 2, 2, 2]), 3).tolist()
        [0.25, 0.0, 0.75]
    """
    counts = torch.bincount(labels, minlength=num_classes).double()
    return counts / counts.sum()


def bayes_classify(log_likelihoods: Tensor, prior: Tensor) -> Tensor:
    r"""Bayes' rule: :math:`\hat y_b = \arg\max_k \log p(x_b \mid y = k) + \log \pi_k`.

    A class of prior 0 is never chosen.

    Args:
        log_likelihoods: :math:`\log p(x_b \mid y = k)`, shape ``(B, K)``.
        prior: Class probabilities :math:`\pi`, shape ``(K,)``.

    Returns:
        Predicted classes ``(B,)``, int64.

    Example:
        >>> scores = torch.tensor([[-1.0, -1.2], [-3.0, -1.0]])
        >>> bayes_classify(scores, torch.tensor([0.5, 0.5])).tolist()
        [0, 1]
        >>> bayes_classify(scores, torch.tensor([0.1, 0.9])).tolist()
        [1, 1]
    """
    if log_likelihoods.dim() != 2 or prior.shape != log_likelihoods.shape[1:]:
        raise ValueError(
            f"log_likelihoods must be (B, K) and prior (K,), got {tuple(log_likelihoods.shape)} "
            f"and {tuple(prior.shape)}"
        )
    log_prior = prior.to(log_likelihoods).log()
    return (log_likelihoods + log_prior).argmax(dim=1)


def confusion_matrix(true: Tensor, predicted: Tensor, num_classes: int) -> Tensor:
    """Counts ``(K, K)``: row = true class, column = predicted class.

    Args:
        true: True classes ``(B,)``, int64.
        predicted: Predicted classes ``(B,)``, int64.
        num_classes: Number of classes ``K``.

    Returns:
        Counts ``(K, K)``, int64; the trace counts the correct predictions.

    Example:
        >>> confusion_matrix(torch.tensor([0, 1, 1]), torch.tensor([0, 0, 1]), 2).tolist()
        [[1, 0], [1, 1]]
    """
    return torch.bincount(true * num_classes + predicted, minlength=num_classes**2).view(
        num_classes, num_classes
    )
