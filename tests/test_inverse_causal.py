"""Fixed-point solves of causal maps that settle frame by frame, and the window evaluator of the
causal Transformer that makes their sweeps cost the unsettled frames only."""

from __future__ import annotations

import pytest
import torch

from iresflow.inverse.causal import causal_fixed_point_inverse
from iresflow.inverse.fixed_point import InversionError, InversionWarning
from iresflow.nn.causal import CausalTransformer

F64 = torch.float64


class CausalMap:
    """``T(x)_t = y_t + a * tanh(W x_{t-1} + V x_{t-2})``: causal over frames, with a record of
    the calls, which checks the contract of ``image`` (windows that start at the first frame
    some sample has not settled, ``first``, and then between the last start and stop, and the
    frames that the outputs before the start read, those before ``start - 1``, left as they
    were)."""

    def __init__(self, y: torch.Tensor, strength: float = 0.8, seed: int = 0,
                 first: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        features = y.shape[-1]
        self.y, self.strength, self.first = y, strength, first
        self.w = torch.randn(features, features, generator=generator, dtype=y.dtype)
        self.v = torch.randn(features, features, generator=generator, dtype=y.dtype)
        self.calls: list[tuple[int, int]] = []
        self.seen: torch.Tensor | None = None

    def full(self, x: torch.Tensor) -> torch.Tensor:
        one = torch.nn.functional.pad(x, (0, 0, 1, 0))[:, :-1]
        two = torch.nn.functional.pad(x, (0, 0, 2, 0))[:, :-2]
        return self.y + self.strength * torch.tanh(one @ self.w.T + two @ self.v.T)

    def __call__(self, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        if not self.calls:
            assert start == self.first
        else:
            last_start, last_stop = self.calls[-1]
            assert last_start <= start <= last_stop
            assert torch.equal(x[:, : start - 1], self.seen[:, : start - 1])
        self.calls.append((start, stop))
        self.seen = x.clone()
        return self.full(x)[:, start:stop]


@pytest.mark.parametrize("window", [1, 2, 5, None])
def test_solves_a_causal_map_within_n_sweeps_for_every_window(window):
    y = torch.randn(4, 12, 3, dtype=F64)
    image = CausalMap(y)
    x, stats = causal_fixed_point_inverse(image, y, window=window)
    torch.testing.assert_close(image.full(x), x, atol=1e-10, rtol=0)
    assert bool(stats.converged.all()) and (stats.residual < stats.tolerance).all()
    assert stats.evaluations == len(image.calls) <= 12
    assert int(stats.iterations.max()) == stats.evaluations
    if window == 1:  # one frame per sweep, each from settled frames alone
        assert stats.evaluations == 12 and all(stop - start <= 2 for start, stop in image.calls)


def test_frames_settle_in_order_so_a_window_of_one_is_the_sequential_solve():
    y = torch.randn(2, 7, 2, dtype=F64)
    image = CausalMap(y, strength=3.0)  # far from contracting: Jacobi gains nothing
    x, stats = causal_fixed_point_inverse(image, y, window=1)
    expected = y.clone()
    for t in range(7):  # frame after frame, each from the exact earlier ones
        expected[:, t] = image.full(expected)[:, t]
    torch.testing.assert_close(x, expected, atol=1e-12, rtol=0)
    assert [start for start, _ in image.calls] == list(range(7))
    assert stats.iterations.tolist() == [7, 7]


def test_a_window_that_settles_whole_doubles():
    y = torch.randn(3, 20, 2, dtype=F64)
    image = CausalMap(y, strength=0.0)  # T(x) = y: the start is the solution
    x, stats = causal_fixed_point_inverse(image, y, window=1)
    assert torch.equal(x, y)
    assert [stop - start for start, stop in image.calls] == [1, 2, 4, 8, 5]
    assert stats.evaluations == 5 and (stats.residual == 0).all()


def test_solved_frames_are_settled_from_the_start_and_never_evaluated():
    y = torch.randn(3, 10, 2, dtype=F64)
    truth, _ = causal_fixed_point_inverse(CausalMap(y), y, window=None)
    solved = torch.tensor([4, 6, 10])
    x0 = torch.where(torch.arange(10)[None, :, None] < solved[:, None, None], truth, y)
    image = CausalMap(y, first=4)
    x, stats = causal_fixed_point_inverse(image, y, window=1, x0=x0, solved=solved)
    torch.testing.assert_close(x, truth, atol=1e-10, rtol=0)
    # the sweeps begin at the first frame some sample has not solved, one frame at a time
    assert image.calls[:2] == [(4, 5), (5, 6)]
    # the window is the batch's: the second sample waits for the first to reach its frame 6
    assert stats.evaluations == 10 - 4 and stats.iterations.tolist() == [6, 6, 0]


def test_a_sample_that_does_not_settle_raises_or_warns_with_its_residual():
    y = torch.randn(2, 9, 2, dtype=F64)
    with pytest.raises(InversionError) as failure:
        causal_fixed_point_inverse(CausalMap(y, strength=2.0), y, window=1, max_iter=4)
    # four frames settle, one per sweep; one more evaluation measures the other five
    assert (failure.value.residual > 1e-3).all() and failure.value.iterations.tolist() == [4, 4]
    with pytest.warns(InversionWarning):
        x, stats = causal_fixed_point_inverse(CausalMap(y, strength=2.0), y, max_iter=3,
                                              on_failure="warn")
    assert not bool(stats.converged.any())


@pytest.mark.parametrize("window", [None, 1])  # 1: the one-frame sweeps
def test_non_finite_images_do_not_converge(window):
    y = torch.randn(2, 5, 1, dtype=F64)

    def image(x, start, stop):
        out = y[:, start:stop] + 0.5 * torch.nn.functional.pad(x, (0, 0, 1, 0))[:, start:stop]
        return torch.where(torch.arange(start, stop)[None, :, None] == 3, torch.nan, out)

    with pytest.warns(InversionWarning):
        _, stats = causal_fixed_point_inverse(image, y, window=window, on_failure="warn")
    assert not bool(stats.converged.any()) and torch.isnan(stats.residual).all()


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"window": 0}, "window"),
    ({"max_iter": 0}, "max_iter"),
    ({"solved": torch.tensor([1, 2])}, "solved"),
    ({"solved": torch.tensor([1.0, 2.0, 3.0])}, "solved"),
    ({"solved": torch.tensor([0, 0, 7])}, "solved"),
])
def test_bad_options_raise(kwargs, match):
    y = torch.randn(3, 6, 2, dtype=F64)
    with pytest.raises(ValueError, match=match):
        causal_fixed_point_inverse(CausalMap(y), y, **kwargs)


def test_y_must_be_frames():
    with pytest.raises(ValueError, match="shape"):
        causal_fixed_point_inverse(lambda x, a, b: x, torch.randn(3, 6, dtype=F64))


def _network(context_features: int, positional: str) -> CausalTransformer:
    torch.manual_seed(0)
    net = CausalTransformer(3, 6, width=8, depth=2, heads=2, positional=positional, max_len=9,
                            context_features=context_features).double()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return net


@pytest.mark.parametrize("positional", ["sinusoidal", "learned"])
@pytest.mark.parametrize("context_features", [0, 2])
@pytest.mark.parametrize("masked", [False, True])
def test_windows_equal_the_network_on_the_whole_sequence(masked, context_features, positional):
    net = _network(context_features, positional)
    x = torch.randn(4, 9, 3, dtype=F64)
    mask = None
    if masked:
        mask = torch.ones(4, 9, dtype=torch.bool)
        mask[1, 6:], mask[2, 3] = False, False  # end padding and a gap
    context = torch.randn(4, 2, dtype=F64) if context_features else None
    windows = net.windows(x, mask, context)
    for start, stop in ((0, 0), (0, 3), (0, 5), (2, 4), (4, 9), (7, 8), (8, 9), (9, 9)):
        x = _moved_call(windows, net, x, mask, context, start, stop)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("first", [(3, 4), (5, 9), (9, 9)])
def test_a_first_window_after_frame_0_reads_the_frames_before_it(masked, first):
    net = _network(2, "sinusoidal")
    x = torch.randn(4, 9, 3, dtype=F64)
    mask = None
    if masked:
        mask = torch.ones(4, 9, dtype=torch.bool)
        mask[1, 6:], mask[2, 1] = False, False
    context = torch.randn(4, 2, dtype=F64)
    windows = net.windows(x, mask, context)
    for start, stop in (first, (first[0], 9)):
        x = _moved_call(windows, net, x, mask, context, start, stop)


def _moved_call(windows, net, x, mask, context, start, stop):
    """One call of ``windows`` after the frames from ``start - 1`` on moved, checked against
    the network on the whole sequence; returns the frames of the call."""
    x = x.clone()
    x[:, max(start - 1, 0):] = torch.randn_like(x[:, max(start - 1, 0):])  # later frames move
    out = windows(x, start, stop)
    assert out.shape == (4, stop - start, 6)
    torch.testing.assert_close(out, net(x, mask, context)[:, start:stop], atol=1e-14, rtol=0)
    return x


@pytest.mark.parametrize(("calls", "bad"), [
    ([], (4, 3)),  # a start after the stop
    ([(0, 4)], (5, 6)),  # beyond the last stop: tokens 4 and on were never stored
    ([(0, 4), (3, 6)], (2, 6)),  # before the last start
    ([], (0, 10)),  # past N
])
def test_windows_that_break_the_rules_raise(calls, bad):
    net = _network(0, "sinusoidal")
    x = torch.randn(2, 9, 3, dtype=F64)
    windows = net.windows(x)
    for start, stop in calls:
        windows(x, start, stop)
    with pytest.raises(ValueError, match="window"):
        windows(x, *bad)
