"""The settings of using a finished run: which checkpoint, and how to evaluate, sample, inspect.

One record per job, built with the settings gate of :mod:`iresflow._settings` like
:class:`~iresflow.train.config.TrainConfig`: every default is defined here once, the Python
functions take the record (or its fields as keywords) and the flags of ``iresflow evaluate``,
``sample``, ``forecast`` and ``info`` derive from the fields, so a value is checked in one
place, the record.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from iresflow._settings import ConfigError, SettingsRecord, check_device, check_minimum, setting
from iresflow.models.forecasting import FORECAST_NOISE
from iresflow.train.metrics import SCORE_SUFFIXES
from iresflow.train.selection import ALTERNATIVES, CONFIGURED

__all__ = [
    "KEPT", "EvaluateSettings", "ForecastSettings", "InfoSettings", "RunSettings",
    "SampleSettings",
]

#: The ``candidate`` of a forecast that is the run's own model, the one its training kept.
KEPT = "kept"


@dataclass(frozen=True)
class RunSettings(SettingsRecord):
    """Which state of a run to load (:func:`~iresflow.runs.load.load_run`).

    Example:
        >>> RunSettings().checkpoint
        'best'
        >>> RunSettings(device="tpu")
        Traceback (most recent call last):
        ...
        iresflow._settings.ConfigError: device must be cpu, cuda, cuda:N or auto, got 'tpu'
    """

    checkpoint: str = setting(
        "best", "which checkpoint to use (best: lowest validation NLL; last: latest epoch)",
        ("best", "last"),
    )
    device: str | None = setting(
        None, "device for the model: cpu, cuda, cuda:N or auto", unset="the run's"
    )

    def check(self) -> None:
        if self.device is not None:
            check_device(self.device)


@dataclass(frozen=True)
class EvaluateSettings(SettingsRecord):
    """How to measure a run's NLL (:func:`~iresflow.runs.evaluate.evaluate_run`).

    Example:
        >>> EvaluateSettings(method="roulette", n_samples=8).split
        'test'
        >>> EvaluateSettings(scores="out.txt")
        Traceback (most recent call last):
        ...
        iresflow._settings.ConfigError: scores must name a .csv or .npz file, got 'out.txt'
    """

    split: str = setting("test", "split to evaluate", ("test", "val", "train"))
    method: str = setting(
        "exact",
        "log-determinant: exact, unbiased Russian-roulette estimates, or auto (exact when "
        "affordable, else enough roulette estimates for a standard error below target_stderr; "
        "what train reports at its end)",
        ("exact", "roulette", "auto"),
    )
    n_samples: int = setting(
        4, "roulette estimates per sequence (>= 2 gives a standard error; for auto, the pilot's)"
    )
    seed: int = setting(0, "seed of the roulette estimates")
    target_stderr: float = setting(
        0.01, "standard error, in the dataset's unit, that the auto method aims for"
    )
    scores: str | None = setting(
        None,
        "also write per-sequence scores, one row per sequence in the split's order (index, "
        "length, log_prob in nats and nll in the dataset's unit, label; with classify the "
        "predicted label and the log-likelihood of every class) to this .csv or .npz file; for "
        "a causal run also the score of every frame given the earlier ones (an .npz gets "
        "frame_log_prob and frame_nll arrays, a .csv a second file NAME_frames.csv with one "
        "row per real frame) and a plot of the worst sequence's frame scores beside its data "
        "(NAME_frames.png)",
        unset="none",
    )
    classify: bool = setting(
        False,
        "label-conditional runs: classify every sequence by Bayes' rule, argmax_k log "
        "p(x | y=k) + log pi_k with pi the class frequencies of the training split, and report "
        "the accuracy and the confusion matrix",
    )
    reference: bool = setting(
        True,
        "also fit the closed-form AR(p) Gaussian on the training split (order 0..3 chosen on "
        "the validation split), print its NLL and per-sequence NLLs beside the flow's, and "
        "warn when the flow is worse",
    )
    nproc: int = setting(
        1,
        "processes sharing the split, started by evaluate (gloo on the CPU, nccl with one GPU "
        "each; under torchrun the launch decides)",
    )

    def check(self) -> None:
        check_minimum(self, ("n_samples", "nproc"), 1)
        if not self.target_stderr > 0:
            raise ConfigError(f"target_stderr must be > 0, got {self.target_stderr}")
        if self.scores is not None and Path(self.scores).suffix not in SCORE_SUFFIXES:
            raise ConfigError(f"scores must name a .csv or .npz file, got {self.scores!r}")


@dataclass(frozen=True)
class SampleSettings(SettingsRecord):
    """What to draw from a run (:func:`~iresflow.runs.sample.sample_run`).

    Example:
        >>> SampleSettings(num=0)
        Traceback (most recent call last):
        ...
        iresflow._settings.ConfigError: num must be >= 1, got 0
    """

    num: int = setting(16, "sequences to draw")
    length: int | None = setting(
        None, "length of every sequence", unset="drawn from the training lengths"
    )
    seed: int = setting(0, "seed of the lengths and of the base noise")
    label: str | None = setting(
        None,
        "class of every sample, one of the dataset's class names (runs trained with condition "
        "label)",
        unset="none",
    )
    covariates: tuple[float, ...] | None = setting(
        None,
        "covariates of every sample, one value per covariate (runs trained with condition "
        "covariates; write --covariates=-1,2 for a leading minus sign)",
        unset="none",
    )
    temperature: float = setting(
        1.0, "scale of the base noise (1: the model's; below 1 concentrates the draws)"
    )

    def check(self) -> None:
        check_minimum(self, ("num", "length"), 1)
        if self.label is not None and self.covariates is not None:
            raise ConfigError("label and covariates exclude each other")
        if not self.temperature > 0:
            raise ConfigError(f"temperature must be > 0, got {self.temperature}")


@dataclass(frozen=True)
class ForecastSettings(SettingsRecord):
    """What to forecast from a causal run (:func:`~iresflow.runs.forecast.forecast_run`).

    Example:
        >>> ForecastSettings(horizon=6).num
        100
        >>> ForecastSettings(num=1)
        Traceback (most recent call last):
        ...
        iresflow._settings.ConfigError: num must be >= 2, got 1
    """

    horizon: int = setting(10, "frames to forecast after the observed ones")
    num: int = setting(100, "forecast draws per sequence (>= 2: the scores and quantiles need two)")
    data: str | None = setting(
        None,
        "forecast the next horizon frames after the end of every sequence of this file, "
        "conditioned on its latest frames that leave room for them in the run's longest "
        "sequence (a table is read as whole series with the run's columns)",
        unset="hold out the last horizon frames of every sequence of split, forecast and "
        "score them",
    )
    split: str = setting(
        "test", "split whose sequences are held out and scored when data is not given",
        ("test", "val", "train"),
    )
    seed: int = setting(0, "seed of the forecast noise")
    temperature: float = setting(1.0, "scale of the forecast noise (1: the model's)")
    noise: str = setting(
        "auto",
        "noise of the new frames: given, drawn from the base given the observed frames' noise "
        "(the model's conditional); prior, from the base's own density of new frames, which a "
        "surprising past does not widen (differs for the sequence-level t base only); auto, "
        "the one of the two whose forecasts of the validation sequences (validation_origins "
        "windows of horizon frames each) score the lower CRPS",
        ("auto", *FORECAST_NOISE),
    )
    candidate: str = setting(
        "auto",
        "model that forecasts: kept, the run's own, which its model selection kept for the "
        "lowest validation NLL; configured, recurrent or maf, that candidate of the selection; "
        "auto, among the run's candidates (the run's own model where it has none) the one "
        "whose forecasts of the validation sequences (validation_origins windows of horizon "
        "frames each) score the lowest CRPS (with noise auto, choosing candidate and noise "
        "together)",
        ("auto", KEPT, CONFIGURED, *ALTERNATIVES),
    )
    origins: int = setting(
        1, "forecasts per held-out sequence when data is not given: 1, its last horizon frames; "
        "k, also the horizon frames before those, and so on, each from the frames before it, "
        "scored together")
    validation_origins: int = setting(
        3, "forecasts per validation sequence by which auto chooses the candidate or the noise "
        "(as origins)")
    plot_sequence: int = setting(0, "index of the sequence whose fan chart is drawn")

    def check(self) -> None:
        check_minimum(self, ("plot_sequence",), 0)
        check_minimum(self, ("horizon", "origins", "validation_origins"), 1)
        check_minimum(self, ("num",), 2)
        if self.origins > 1 and self.data is not None:
            raise ConfigError("origins applies to the held-out frames of a split: leave it at "
                              "1 with data")
        if not self.temperature > 0:
            raise ConfigError(f"temperature must be > 0, got {self.temperature}")


@dataclass(frozen=True)
class InfoSettings(SettingsRecord):
    """What the report of a run covers (:func:`~iresflow.runs.report.describe_run`)."""

    seq_len: int | None = setting(
        None, "sequence length of the Lipschitz report", unset="the data's longest"
    )

    def check(self) -> None:
        check_minimum(self, ("seq_len",), 1)
