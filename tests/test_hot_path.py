"""The hot path of ``SequenceFlow.log_prob``: what one default training evaluation runs.

Oracle: a ``sys.setprofile`` hook that records every Python call into the package during one
``log_prob`` of the default model in training mode (docs/architecture.md#log-prob-path).
The limits are those of the current path with a little slack; a change that adds layers of calls
to the path fails here and should be justified by raising them.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import torch

import iresflow
from iresflow.logdet.roulette import RouletteLogDet
from iresflow.models import ResidualSequenceFlow

PACKAGE = Path(iresflow.__file__).parent

#: Python calls into the package of one default training log_prob: 758 before the path was made
#: lean, then 413, 365 and 274; now about 250, 25 of them the vector-Jacobian products of the
#: power series and 10 the shifted sums (nn/frames.py tap_sum) through which those products
#: reach the first layer of a convolution branch without building the windows of its 64-channel
#: cotangent. The count depends on the roulette draws (fixed here by the seed), and a count
#: drawn for the first time adds three calls (its series weights are computed, then cached).
#: The limit is a third of the 740 the path had when it was first counted, plus those ten.
MAX_CALLS = 257
#: Distinct source files of the package it passes through (19 before the length and dtype checks
#: moved to _validation.py and repeat_rows beside the probes in logdet/_hutchinson.py; 18 since
#: the convolutions on frames moved from nn/layered.py to nn/frames.py, no call more).
MAX_MODULES = 18


def _profile(call: Callable[[], object]) -> list[tuple[str, str]]:
    """``(file relative to the package, function name)`` of every Python call into the package
    that ``call()`` makes, in order."""
    calls: list[tuple[str, str]] = []

    def hook(frame: FrameType, event: str, arg: object) -> None:
        if event == "call":
            path = Path(frame.f_code.co_filename)
            if PACKAGE in path.parents:
                calls.append((path.relative_to(PACKAGE).as_posix(), frame.f_code.co_name))

    sys.setprofile(hook)
    try:
        call()
    finally:
        sys.setprofile(None)
    return calls


def _default_model() -> tuple[ResidualSequenceFlow, torch.Tensor, torch.Tensor]:
    """The default model in training mode, initialised, after one warm-up evaluation."""
    torch.manual_seed(0)
    model = ResidualSequenceFlow(features=4, max_len=12).double()
    x = torch.randn(3, 10, 4, dtype=torch.float64)
    mask = torch.ones(3, 10, dtype=torch.bool)
    model.initialize(x, mask)
    model.log_prob(x, mask)  # caches (singular vectors) filled, as in a training loop
    return model, x, mask


def test_a_default_training_log_prob_stays_lean():
    model, x, mask = _default_model()
    calls = _profile(lambda: model.log_prob(x, mask))
    modules = {path for path, _ in calls}
    assert len(calls) <= MAX_CALLS, Counter(calls).most_common(20)
    assert len(modules) <= MAX_MODULES, sorted(modules)
    names = Counter(calls)
    # The inputs are checked once, at the flow's door; the base trusts it.
    assert names["_validation.py", "check_inputs"] == 1
    assert names["_validation.py", "check_sequence"] == 1
    # The roulette counts of the pass come from one draw (one generator), made at the door.
    assert names["logdet/roulette.py", "draw_counts"] == 1
    assert names["logdet/roulette.py", "sample_count"] == 0
    # The chain is not wrapped per step: one checked-or-not entry, members called directly.
    assert names["transforms/base.py", "forward"] == 1
    # Nothing initialises an initialised model.
    assert names["transforms/base.py", "initialize"] == 0


def test_the_roulette_estimators_hold_no_state_between_calls():
    model, x, mask = _default_model()
    estimators = [e for e in model.estimators() if isinstance(e, RouletteLogDet)]
    assert estimators
    before = [dict(vars(e)) for e in estimators]
    model.log_prob(x, mask)
    model.eval().log_prob(x, mask, n_samples=2)
    for estimator, state in zip(estimators, before, strict=True):
        assert vars(estimator).keys() == state.keys()
        assert all(vars(estimator)[k] is v for k, v in state.items())

