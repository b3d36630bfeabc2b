"""RouletteLogDet: count distributions, weights, unbiasedness (docs/math.md#roulette, check H12
(docs/math.md#checks))."""

from __future__ import annotations

import math

import pytest
import torch
from oracles import MixingBranch, ScaleBranch, TanhMLPBranch
from scipy import stats

from iresflow.logdet.exact import ExactLogDet
from iresflow.logdet.roulette import RouletteCall, RouletteLogDet, draw_pass_counts

F64 = torch.float64


def _inputs(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    x = 0.3 * torch.randn(2, 3, 2, dtype=F64, device=device)
    mask = torch.tensor([[True, True, True], [True, False, True]], device=device)
    return x, mask


def _count_distribution(estimator: RouletteLogDet):
    if estimator.distribution == "geometric":
        return stats.geom(estimator.p)  # support {1, 2, ...}
    return stats.poisson(estimator.lam)  # support {0, 1, ...}


@pytest.mark.parametrize(
    "estimator",
    [
        RouletteLogDet("geometric", p=0.5),
        RouletteLogDet("geometric", p=0.2),
        RouletteLogDet("poisson", lam=2.0),
        RouletteLogDet("poisson", lam=0.7),
    ],
    ids=["geom0.5", "geom0.2", "poisson2", "poisson0.7"],
)
def test_tail_probability_matches_scipy(estimator):
    dist = _count_distribution(estimator)
    for j in range(0, 40):
        expected = dist.sf(j - 1)  # P(N >= j)
        assert estimator.tail_probability(j) == pytest.approx(expected, rel=1e-12, abs=0)
    # the docs/math.md#roulette form, where it does not cancel
    if estimator.distribution == "poisson":
        for j in range(1, 8):
            partial = sum(estimator.lam**i / math.factorial(i) for i in range(j))
            expected = 1 - math.exp(-estimator.lam) * partial
            assert estimator.tail_probability(j) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("distribution", ["geometric", "poisson"])
@pytest.mark.parametrize("m", [0, 2, 5])
def test_weights_make_the_series_unbiased(distribution, m):
    """E_n[sum_{k<=n+m} c_k t_k] = sum_k t_k, summing over the count pmf (scipy)."""
    estimator = RouletteLogDet(distribution)
    dist = _count_distribution(estimator)
    terms = [0.7**k * math.cos(k) / k for k in range(1, 200)]
    expectation = 0.0
    for n in range(0, 150):
        c = estimator.weights(n, m)
        assert len(c) == n + m + 1 and c[: m + 1] == [1.0] * (m + 1)
        expectation += dist.pmf(n) * sum(c[k] * terms[k - 1] for k in range(1, n + m + 1))
    assert expectation == pytest.approx(sum(terms), abs=1e-12)


def test_weights_follow_a_changed_distribution():
    """The weights are cached by value: an estimator whose p or lam changes after construction
    gets the weights of its new distribution, in weights() and in an estimate alike."""
    estimator = RouletteLogDet("geometric", p=0.5)
    assert estimator.weights(3, 1) == [1.0, 1.0, 1.0, 2.0, 4.0]
    estimator.p = 0.75
    assert estimator.weights(3, 1) == [1.0, 1.0, 1.0, 4.0, 16.0]
    poisson = RouletteLogDet("poisson", lam=2.0)
    before = poisson.tail_probabilities(4)
    poisson.lam = 0.5
    expected = [float(stats.poisson(0.5).sf(j - 1)) for j in range(1, 5)]
    assert poisson.tail_probabilities(4) == pytest.approx(expected, rel=1e-12)
    assert poisson.tail_probabilities(4) != before

    x = torch.zeros(1, 1, 1, dtype=F64)  # one entry: v^T J^k v = (1/2)^k for g(x) = x / 2
    with torch.no_grad():
        estimate = RouletteCall(estimator, 2).estimate(ScaleBranch(0.5).eval(), x, None)[1]
    c = estimator.weights(2, estimator.eval_exact_terms)
    expected = sum((-1) ** (k + 1) / k * c[k] * 0.5**k for k in range(1, len(c)))
    assert estimate.item() == pytest.approx(expected, rel=1e-14)


@pytest.mark.parametrize("distribution", ["geometric", "poisson"])
def test_sample_count_distribution(distribution):
    estimator = RouletteLogDet(distribution, generator=torch.Generator().manual_seed(0))
    dist = _count_distribution(estimator)
    draws = torch.tensor([estimator.sample_count() for _ in range(4000)], dtype=F64)
    assert draws.min() >= (1 if distribution == "geometric" else 0)
    z = (draws.mean() - dist.mean()) / (dist.std() / math.sqrt(len(draws)))
    assert abs(z) < 4
    for value in range(0, 4):  # frequencies of the smallest values
        p = dist.pmf(value)
        freq = (draws == value).to(F64).mean()
        assert abs(freq - p) < 4 * math.sqrt(p * (1 - p) / len(draws)) + 1e-12


@pytest.mark.parametrize("distribution", ["geometric", "poisson"])
@pytest.mark.parametrize("training", [True, False])
def test_scaled_identity_estimate_is_the_weighted_series(device, distribution, training):
    """J = c I with Rademacher probes: estimate = d sum_{k<=n+m} (-1)^{k+1}/k c_k c^k, exactly.

    ``m`` is ``n_exact_terms`` in training mode and ``eval_exact_terms`` in evaluation mode; the
    count ``n`` is drawn first, so a twin generator with the same seed reproduces it.
    """
    c = 0.55
    branch = ScaleBranch(c, device=device).train(training)
    x, mask = _inputs(device)
    kwargs = {"distribution": distribution, "n_exact_terms": 3, "eval_exact_terms": 7}
    m = 3 if training else 7
    dims = mask.sum(1).to(F64) * x.shape[-1]
    counts = set()
    for seed in range(6):
        gen = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            _, logdet = RouletteLogDet(**kwargs, generator=gen)(branch, x, mask)
        twin = RouletteLogDet(**kwargs, generator=torch.Generator(device=device).manual_seed(seed))
        n = twin.sample_count()
        counts.add(n)
        weights = twin.weights(n, m)
        series = sum((-1) ** (k + 1) / k * weights[k] * c**k for k in range(1, n + m + 1))
        torch.testing.assert_close(logdet, dims * series, atol=1e-12, rtol=1e-12)
    assert len(counts) > 1


def _z_scores(distribution, probe, lip, calls, device):
    """z-scores of the mean of ``calls`` independent estimates (64 probes each) vs slogdet.

    The branch is made strongly contracting-towards-minus-identity (``w = -L I``, near-diagonal
    mixing), so terms beyond the ``m = 2`` exact ones carry a large part of the log-det and
    mis-weighted roulette terms would shift the mean by several standard errors.
    """
    torch.manual_seed(0)
    branch = MixingBranch(2, lip, max_len=3, device=device).train()
    with torch.no_grad():
        branch.w.copy_(-lip * torch.eye(2, dtype=F64, device=device))
        branch.b.zero_()
        branch.logits.add_(2 * torch.eye(3, dtype=F64, device=device))
    assert branch.lipschitz_constant().item() == pytest.approx(lip)
    x, mask = _inputs(device)
    _, exact = ExactLogDet()(branch, x, mask)
    gen = torch.Generator(device=device).manual_seed(1)
    estimator = RouletteLogDet(distribution, n_probes=64, probe=probe, generator=gen)
    with torch.no_grad():
        draws = torch.stack([estimator(branch, x, mask)[1] for _ in range(calls)])
    return (draws.mean(0) - exact) / (draws.std(0) / math.sqrt(calls)), exact


@pytest.mark.parametrize(
    ("distribution", "probe", "lip"),
    [
        ("geometric", "rademacher", 0.5),
        ("geometric", "gaussian", 0.6),
        ("poisson", "rademacher", 0.6),
        ("poisson", "gaussian", 0.5),
    ],
)
def test_unbiased_against_slogdet(device, distribution, probe, lip):
    """H12 (fast): the mean of independent calls is within 4 standard errors of slogdet."""
    z, exact = _z_scores(distribution, probe, lip, 300, device)
    assert exact.abs().min() > 2
    assert (z.abs() < 4).all(), z


@pytest.mark.slow
@pytest.mark.parametrize("distribution", ["geometric", "poisson"])
@pytest.mark.parametrize("probe", ["rademacher", "gaussian"])
@pytest.mark.parametrize("lip", [0.5, 0.6])
def test_unbiased_against_slogdet_many_draws(device, distribution, probe, lip):
    """H12: as above with 5000 calls (3.2e5 probes)."""
    z, _ = _z_scores(distribution, probe, lip, 5000, device)
    assert (z.abs() < 4).all(), z


def test_generator_reproduces_draws(device):
    branch = TanhMLPBranch(2, 4, 0.6, device=device)
    x, mask = _inputs(device)

    def run(seed: int) -> torch.Tensor:
        gen = torch.Generator(device=device).manual_seed(seed)
        estimator = RouletteLogDet("poisson", n_probes=2, generator=gen)
        return torch.stack([estimator(branch, x, mask)[1] for _ in range(3)])

    first, again, other = run(7), run(7), run(8)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    assert not torch.equal(first[0], first[1])  # successive calls draw anew


def test_padding_does_not_matter(device):
    branch = MixingBranch(2, 0.6, max_len=3, device=device)
    x, mask = _inputs(device)
    other = torch.where(mask[..., None], x, torch.randn_like(x))
    results = []
    for inputs in (x, other):
        gen = torch.Generator(device=device).manual_seed(3)
        results.append(RouletteLogDet(n_probes=2, generator=gen)(branch, inputs, mask))
    torch.testing.assert_close(results[0][1], results[1][1], atol=0, rtol=0)
    assert results[0][0][~mask].abs().max() == 0


def test_dtype_and_device_follow_input(device):
    branch = TanhMLPBranch(2, 4, 0.6, dtype=torch.float32, device=device)
    x = torch.randn(2, 3, 2, device=device, requires_grad=True)
    out, logdet = RouletteLogDet(probe="gaussian")(branch, x)
    assert out.dtype == logdet.dtype == torch.float32
    assert logdet.device == x.device and logdet.shape == (2,)
    logdet.sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"p": 0.0}, ValueError, "p must lie"),
        ({"p": 1.0}, ValueError, "p must lie"),
        ({"p": 1.5}, ValueError, "p must lie"),
        ({"p": float("nan")}, ValueError, "p must lie"),
        ({"lam": -1.0}, ValueError, "lam must lie"),
        ({"lam": 0.0}, ValueError, "lam must lie"),
        ({"distribution": "uniform"}, ValueError, "distribution"),
        ({"probe": "sphere"}, ValueError, "probe"),
        ({"n_probes": 0}, ValueError, "n_probes"),
        ({"n_exact_terms": -1}, ValueError, "n_exact_terms"),
        ({"eval_exact_terms": -1}, ValueError, "eval_exact_terms"),
        ({"n_exact_terms": 2.0}, TypeError, "n_exact_terms"),
        ({"p": "0.5"}, TypeError, "p must be a float"),
        ({"neumann_gradient": 1}, TypeError, "neumann_gradient"),
        ({"memory_efficient": None}, TypeError, "memory_efficient"),
        ({"generator": 3}, TypeError, "generator"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        RouletteLogDet(**kwargs)


@pytest.mark.parametrize("distribution", ["geometric", "poisson"])
def test_draw_counts_has_the_count_distribution(distribution):
    estimator = RouletteLogDet(distribution, generator=torch.Generator().manual_seed(1))
    dist = _count_distribution(estimator)
    draws = torch.tensor(estimator.draw_counts(4000), dtype=F64)
    z = (draws.mean() - dist.mean()) / (dist.std() / math.sqrt(len(draws)))
    assert abs(z) < 4
    for value in range(0, 4):
        p = dist.pmf(value)
        freq = (draws == value).to(F64).mean()
        assert abs(freq - p) < 4 * math.sqrt(p * (1 - p) / len(draws)) + 1e-12


def test_pass_counts_are_one_draw_per_generator_given_in_call_order(device):
    shared = torch.Generator(device=device).manual_seed(3)
    a, b = RouletteLogDet(generator=shared), RouletteLogDet(generator=shared)
    c = RouletteLogDet("poisson", generator=shared)  # another distribution: its own draw
    got = draw_pass_counts([a, b, c, a])
    twin = torch.Generator(device=device).manual_seed(3)
    expected = RouletteLogDet(generator=twin).draw_counts(3)
    assert [got[0], got[1], got[3]] == expected
    assert got[2] == RouletteLogDet("poisson", generator=twin).draw_counts(1)[0]
    # Nothing is queued: the next count is a fresh draw from the generator.
    assert a.sample_count() == RouletteLogDet(generator=twin).draw_counts(1)[0]
    with pytest.raises(TypeError, match="RouletteLogDet"):
        draw_pass_counts([a, "roulette"])  # type: ignore[list-item]


def test_a_count_drawn_by_the_caller_gives_the_estimate_of_the_same_count(device):
    branch = ScaleBranch(0.5, device=device).train()
    x, mask = _inputs(device)
    estimator = RouletteLogDet(generator=torch.Generator(device=device).manual_seed(0))
    count = estimator.sample_count()
    with torch.no_grad():
        _, given = estimator.estimate(branch, x, mask, count)
        _, called = RouletteCall(estimator, count).estimate(branch, x, mask)
    estimator.generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        _, drawn = estimator(branch, x, mask)
    # Same count, same probes (Rademacher probes times c I: the estimate is deterministic).
    torch.testing.assert_close(given, drawn, atol=1e-12, rtol=0)
    torch.testing.assert_close(called, drawn, atol=1e-12, rtol=0)


def test_the_estimator_holds_no_state_between_calls(device):
    """Calls leave the estimator as it was: no queue of counts, nothing else that travels."""
    branch = ScaleBranch(0.5, device=device).train()
    x, mask = _inputs(device)
    estimator = RouletteLogDet(generator=torch.Generator(device=device).manual_seed(0))
    state = dict(vars(estimator))
    draw_pass_counts([estimator, estimator])
    estimator(branch, x, mask)
    RouletteCall(estimator, 4).estimate(branch, x, mask)
    assert vars(estimator).keys() == state.keys()
    assert all(vars(estimator)[k] is v for k, v in state.items())
