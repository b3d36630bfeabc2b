r"""Class-conditional flows on Japanese Vowels: conditional NLL and generative classification.

On the official split (270 training utterances of the nine speakers, 370 test utterances):

* a class-conditional flow :math:`p(x \mid y)` (``condition = label``: the speaker label through
  a learned embedding, :mod:`iresflow.nn.conditional`) and the same flow without the label
  (``condition = none``), both trained by :func:`iresflow.train.fit.fit`, the loop of
  ``iresflow train``, with the settings, hence the weights, of the command lines
  (``iresflow train --data japanese_vowels --n-blocks 2 --hidden 32 --ar-order 1
  --device cpu`` with ``--condition label --context-features 16`` for the conditional flow);
  10% of the official training utterances are held out for validation, which chooses the
  epoch kept and stops training early (``patience``), as ``iresflow train`` does;
* their exact test NLL (nats/frame, original units;
  :func:`~iresflow.train.likelihood.split_log_prob`), for the conditional model
  :math:`-\log p(x \mid y)` with the true speaker;
* generative classification as ``iresflow evaluate --classify`` does it
  (:mod:`iresflow.runs.classify`): Bayes' rule with the class frequencies of the training
  split as prior, :math:`\hat y = \arg\max_y \log p(x \mid y) + \log \pi_y`, with the exact
  log-likelihoods: test accuracy and confusion matrix;
* baselines on the same split: 1-nearest-neighbour and logistic regression on the flattened,
  zero-padded, standardised frames of all 270 training utterances (scikit-learn).

Both flows use the recipe :data:`RECIPE` (2 blocks of width 32 and an AR(1) input layer, which
in the conditional model is the conditional autoregressive layer: a per-speaker AR(1) Gaussian
is within its reach); every other setting is ``iresflow train``'s default
(:class:`~iresflow.train.config.TrainConfig`), or as given by ``--set`` and ``--epochs``.

Run from the repository root::

    python -m benchmarks conditional --quick     # smoke run: 2 epochs per flow
    python -m benchmarks conditional --seeds 3 --set max_seconds=200

Seeds 0, 1, 2 (``--seeds 3 --set max_seconds=200``; the time budget never bound: every flow
stopped early or after its 60 epochs): test NLL -22.52, -22.53, -22.56 (unconditional) and
-23.56, -23.52, -23.53 (conditional, true speaker) nats/frame; generative accuracy 95.9%,
96.5%, 95.9% (mean 96.1%), next to 93.8-94.1% for 1-NN and 97.8-98.1% for logistic regression
on the same seeds. The class-conditional samples of the first seed are drawn per speaker in
``conditional_class_samples.png`` next to ``--out``
(``docs/figures/conditional_class_samples.png`` is seed 0's).

The numbers are printed and written to ``--out`` (default ``benchmarks/out/conditional.json``),
one record per seed.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from benchmarks import cli
from iresflow.data.datasets import SequenceDataset, SequenceSplit
from iresflow.models.flow import SequenceFlow
from iresflow.runs.classify import (
    bayes_classify,
    class_log_likelihoods,
    class_prior,
    confusion_matrix,
)
from iresflow.train.config import TrainConfig
from iresflow.train.factories import load_data
from iresflow.train.fit import fit
from iresflow.train.likelihood import split_log_prob

#: The flows' recipe on top of the defaults of ``iresflow train``: a per-class AR(1) separates
#: the speakers better than AR(3) on 30 utterances each.
RECIPE = {"data": "japanese_vowels", "device": "cpu", "n_blocks": 2, "hidden": 32, "ar_order": 1}
#: What the conditional flow adds: the speaker label through an embedding of this size.
CONDITIONAL = {"condition": "label", "context_features": 16}


def train_configs(args: argparse.Namespace, seed: int) -> dict[str, TrainConfig]:
    """The settings of both flows: ``iresflow train``'s defaults with the benchmark's recipe.

    Args:
        args: The parsed command line (``--quick``, ``--epochs``, ``--set``).
        seed: The seed of both.

    Returns:
        ``{"unconditional": ..., "conditional": ...}``; they differ only in ``condition`` and
        the size of the label embedding.
    """
    base = {**RECIPE, "seed": seed, **({"epochs": 2} if args.quick else {}),
            **cli.settings(args)}
    return {"unconditional": TrainConfig.from_dict(base),
            "conditional": TrainConfig.from_dict({**base, **CONDITIONAL})}


def evaluate_flow(model: SequenceFlow, ds: SequenceDataset) -> dict:
    """Exact test NLL of a trained flow and, if label-conditional, its generative classifier.

    Args:
        model: A flow trained on ``ds`` (conditional: ``condition = label``).
        ds: Its dataset.

    Returns:
        ``{"test NLL"}`` in the dataset's unit (the true label as context), plus
        ``"generative accuracy"`` and ``"confusion"`` (rows true, columns predicted) for a
        label-conditional flow.
    """
    test = ds.test
    log_prob, _ = split_log_prob(model, test, method="exact")
    result: dict = {"test NLL": ds.nll(log_prob, test)}
    if model.context_encoder is not None:
        num_classes = len(ds.classes)
        scores = class_log_likelihoods(model, test)
        predicted = bayes_classify(scores, class_prior(ds.train.labels, num_classes))
        result["generative accuracy"] = float((predicted == test.labels).double().mean())
        result["confusion"] = confusion_matrix(test.labels, predicted, num_classes).tolist()
    return result


def plot_class_samples(model: SequenceFlow, ds: SequenceDataset, path: Path, *,
                       per_class: int = 3, seed: int = 0) -> Path:
    """One panel per class: feature 1 of ``per_class`` test sequences and as many samples.

    Each sample of class ``k`` is drawn with the length of a test sequence of that class and
    mapped back to the original units.

    Args:
        model: A trained label-conditional flow.
        ds: Its dataset (labelled test split, class names).
        path: Destination ``.png``.
        per_class: Real and sampled sequences per panel.
        seed: Seed of the sampling noise.

    Returns:
        ``path``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    test, names = ds.test, ds.classes
    columns = 3
    rows = -(-len(names) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(3.2 * columns, 2.2 * rows),
                                sharex=True, sharey=True, squeeze=False)
    generator = torch.Generator().manual_seed(seed)
    model.eval()
    for k, axis in enumerate(axes.flat):
        if k >= len(names):
            axis.axis("off")
            continue
        members = torch.nonzero(test.labels == k).squeeze(1)[:per_class]
        lengths = test.mask[members].sum(1)
        with torch.no_grad():
            x, mask = model.sample(len(members), lengths=lengths, generator=generator,
                                   context=torch.full((len(members),), k))
        real = ds.to_raw(test.x[members], test.mask[members])
        sampled = ds.to_raw(x, mask)
        for b in range(len(members)):
            n = int(lengths[b])
            axis.plot(real[b, :n, 0], color="tab:blue", lw=1,
                      label="data" if b == 0 else None)
            axis.plot(sampled[b, :n, 0], color="tab:orange", lw=1,
                      label="samples" if b == 0 else None)
        axis.set_title(f"speaker {names[k]}", fontsize=9)
    axes.flat[0].legend(fontsize=7)
    figure.supxlabel("frame")
    figure.supylabel("LPC cepstrum coefficient 1")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _baselines(train_split: SequenceSplit, test: SequenceSplit) -> dict[str, float]:
    """Test accuracy of 1-NN and logistic regression on flattened zero-padded frames."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.neighbors import KNeighborsClassifier

    x_train, x_test = train_split.x.flatten(1).numpy(), test.x.flatten(1).numpy()
    y_train, y_test = train_split.labels.numpy(), test.labels.numpy()
    results = {}
    for name, classifier in (("1-NN", KNeighborsClassifier(1)),
                             ("logistic regression", LogisticRegression(max_iter=2000))):
        classifier.fit(x_train, y_train)
        results[name] = float((classifier.predict(x_test) == y_test).mean())
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cli.add_quick(parser, "2 epochs per flow")
    cli.add_settings(parser, epochs=None)
    cli.add_seeds(parser)
    cli.add_records(parser, "conditional")


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Train and score both flows and the baselines for every seed; write the records."""
    rows = []
    for seed in cli.seeds(args):
        configs = train_configs(args, seed)
        ds = load_data(configs["conditional"])  # the same data for both: condition loads nothing
        results: dict[str, Any] = {"seed": seed}
        for name, config in configs.items():
            fitted = fit(config, ds)
            results[f"{name} settings"] = config.to_dict()
            results[f"{name} training"] = {
                "epochs": len(fitted.history), "best_epoch": fitted.best_epoch,
                "best_val_nll": fitted.best_val_nll, "stopped": fitted.stopped,
                "steps": fitted.steps, "train_seconds": fitted.train_seconds,
            }
            results |= {f"{name} {key}": value
                        for key, value in evaluate_flow(fitted.model, ds).items()}
            if name == "conditional" and seed == args.first_seed:
                path = plot_class_samples(fitted.model, ds, args.out.parent
                                          / "conditional_class_samples.png", seed=seed)
                results["figure"] = str(path)
        official = SequenceSplit(torch.cat([ds.train.x, ds.val.x]),
                                 torch.cat([ds.train.mask, ds.val.mask]),
                                 torch.cat([ds.train.log_jacobian, ds.val.log_jacobian]),
                                 torch.cat([ds.train.labels, ds.val.labels]))
        results |= {f"{k} accuracy": v for k, v in _baselines(official, ds.test).items()}
        _report(results)
        rows.append(results)
        cli.save(args, rows, ("seed",), {})
    return rows


def _report(results: dict) -> None:
    """Print the numbers, then the confusion matrix of the generative classifier."""
    for key, value in results.items():
        if not key.endswith(("confusion", "settings")):
            print(f"{key:>32}: {value}")
    print("confusion (rows: true speaker, columns: predicted):")
    for row in results["conditional confusion"]:
        print(" ".join(f"{v:3d}" for v in row))

