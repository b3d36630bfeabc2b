"""The log-determinant method of a density evaluation (iresflow.logdet.policy).

Oracles: the method table of SequenceFlow.log_prob's documentation and one draw of counts from
a generator with the same seed.
"""

from __future__ import annotations

import pytest
import torch

from iresflow.logdet.exact import ExactLogDet
from iresflow.logdet.policy import logdet_policy, set_generator
from iresflow.logdet.roulette import RouletteCall, RouletteLogDet
from iresflow.logdet.series import SeriesLogDet


def test_the_configured_estimators_unless_a_method_is_asked_for():
    exact, roulette, series = ExactLogDet(), RouletteLogDet(), SeriesLogDet()
    mixed = logdet_policy([roulette, series, exact])
    assert mixed.request is True and mixed.calls == (roulette, series, exact)
    assert not mixed.exact
    assert logdet_policy([roulette, roulette], "roulette").calls == (roulette, roulette)
    assert not logdet_policy([]).exact


@pytest.mark.parametrize("configured", [["exact", "exact"], ["roulette", "exact"]])
def test_the_exact_method_is_one_dense_jacobian_estimator_for_every_step(configured):
    estimators = [ExactLogDet() if n == "exact" else RouletteLogDet() for n in configured]
    method = None if configured == ["exact", "exact"] else "exact"
    policy = logdet_policy(estimators, method)
    assert policy.exact and isinstance(policy.request, ExactLogDet)
    assert policy.request not in estimators
    assert policy.calls == (policy.request, policy.request)


def test_roulette_on_other_estimators_is_one_default_roulette_estimator():
    configured = [RouletteLogDet(generator=torch.Generator()), ExactLogDet()]
    policy = logdet_policy(configured, "roulette")
    assert isinstance(policy.request, RouletteLogDet) and policy.request not in configured
    assert policy.request.generator is None and policy.calls == (policy.request,) * 2
    assert not policy.exact


def test_unknown_methods_are_rejected():
    with pytest.raises(ValueError, match="method"):
        logdet_policy([ExactLogDet()], "series")


def test_a_pass_draws_the_counts_of_every_step_at_once():
    generator = torch.Generator().manual_seed(4)
    first, second = RouletteLogDet(generator=generator), RouletteLogDet(generator=generator)
    exact = ExactLogDet()
    policy = logdet_policy([first, exact, second, first])
    steps = [torch.nn.Identity() for _ in range(4)]
    request = policy.pass_request(steps)
    assert list(request) == steps and request[steps[1]] is exact
    calls = [request[steps[i]] for i in (0, 2, 3)]
    assert all(isinstance(call, RouletteCall) for call in calls)
    assert [call.estimator for call in calls] == [first, second, first]
    expected = RouletteLogDet(generator=torch.Generator().manual_seed(4)).draw_counts(3)
    assert [call.count for call in calls] == expected
    # Nothing travels to the next pass: its counts are the next draw of the generator.
    again = policy.pass_request(steps)
    assert again[steps[0]].count == RouletteLogDet(
        generator=torch.Generator().manual_seed(4)).draw_counts(6)[3]
    deterministic = logdet_policy([ExactLogDet(), SeriesLogDet()])
    assert deterministic.pass_request(steps[:2]) is True  # nothing to draw


def test_set_generator_reaches_the_stochastic_estimators():
    roulette, series, exact = RouletteLogDet(), SeriesLogDet(), ExactLogDet()
    generator = torch.Generator()
    set_generator([roulette, series, exact], generator)
    assert roulette.generator is generator and series.generator is generator
    assert not hasattr(exact, "generator")
    with pytest.raises(TypeError, match="generator"):
        set_generator([roulette], 3)  # type: ignore[arg-type]
