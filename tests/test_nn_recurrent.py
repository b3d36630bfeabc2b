"""The causal GRU conditioner and its window evaluator (docs/math.md#autoregressive-step)."""

from __future__ import annotations

import pytest
import torch
from oracles import padded_batch

from iresflow.nn.recurrent import CausalGRU, left_align, real_first

F64 = torch.float64
D = 3  # features


def make_net(device, *, depth: int = 2, context_features: int = 0) -> CausalGRU:
    """A tiny float64 network with its zero output layer moved, so that outputs vary."""
    torch.manual_seed(0)
    net = CausalGRU(D, 4, width=6, depth=depth, context_features=context_features)
    net = net.to(device=device, dtype=F64)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return net


def test_output_t_reads_the_frames_before_t_only(device):
    net = make_net(device)
    x = torch.randn(2, 5, D, dtype=F64, device=device)
    jac = torch.autograd.functional.jacobian(net, x)  # (2, 5, 4, 2, 5, D)
    for b in range(2):
        assert torch.equal(jac[b, :, :, 1 - b], torch.zeros_like(jac[b, :, :, 1 - b]))
        for t in range(5):
            assert torch.equal(jac[b, t, :, b, t:], torch.zeros_like(jac[b, t, :, b, t:]))
            if t:
                assert jac[b, t, :, b, t - 1].abs().amax() > 1e-3


def test_a_gap_is_skipped_and_padding_is_never_read(device):
    net = make_net(device, context_features=2)
    x, mask = padded_batch(device)  # sequence 2: frame 1 missing; sequence 1: end padding
    context = torch.randn(3, 2, dtype=F64, device=device)
    out = net(x, mask, context)
    noisy = torch.where(mask[..., None], x, 50 * torch.randn_like(x))
    assert torch.equal(net(noisy, mask, context)[mask], out[mask])
    # Sequence 2 by the formula: tokens of its real frames 0, 2, 3 only, each with the position
    # of the frame whose output follows it.
    with torch.no_grad():
        table = net.encoding(x.new_empty(1, 4, 6))
        tokens = torch.stack([net.start + table[0], net.embed(x[2, 0]) + table[2],
                              net.embed(x[2, 2]) + table[3]]) + net.context_embed(context[2])
        states, _ = net.gru(tokens[None])
        torch.testing.assert_close(out[2, mask[2]], net.head(states[0]), rtol=1e-14,
                                   atol=1e-14)
    # Not a frame of zeros: the gap leaves the state as it was.
    zero_frame = x.clone()
    zero_frame[2, 1] = 0.0
    assert not torch.allclose(net(zero_frame, None, context)[2, 2:], out[2, 2:])


@pytest.mark.parametrize("context_features", [0, 2])  # without: the input map folded in
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("windows", [[(0, 1), (1, 2), (2, 3), (3, 4)], [(0, 2), (1, 4)],
                                     [(0, 4)], [(0, 3), (3, 3), (3, 4)],
                                     [(2, 3), (3, 4)], [(3, 4)]])  # a first call reads before
def test_windows_equal_the_whole_sequence(device, masked, windows, context_features):
    net = make_net(device, context_features=context_features)
    x, mask = padded_batch(device)
    mask = mask if masked else None
    context = torch.randn(3, 2, dtype=F64, device=device) if context_features else None
    expected = net(x, mask, context)
    evaluator = net.windows(x, mask, context)
    for start, stop in windows:
        out = evaluator(x, start, stop)
        assert out.shape == (3, stop - start, 4)
        if mask is None:
            torch.testing.assert_close(out, expected[:, start:stop], rtol=1e-13, atol=1e-13)
        else:
            real = mask[:, start:stop]
            torch.testing.assert_close(out[real], expected[:, start:stop][real], rtol=1e-13,
                                       atol=1e-13)


@pytest.mark.parametrize("context_features", [0, 2])
@pytest.mark.parametrize("first", [1, 3])  # 1: the start token alone before the window
def test_draws_that_share_their_past_share_its_pass_and_keep_their_outputs(device, first,
                                                                          context_features):
    net = make_net(device, context_features=context_features)
    past = torch.randn(2, 5, D, dtype=F64, device=device)
    x = past[[0, 1, 0, 0]].clone()  # four draws of two sequences
    x[:, first:] = torch.randn(4, 5 - first, D, dtype=F64, device=device)  # new frames differ
    context = torch.randn(2, 2, dtype=F64, device=device)[[0, 1, 0, 0]] if context_features \
        else None
    evaluator = net.windows(x, None, context)
    torch.testing.assert_close(evaluator(x, first, first + 1),
                               net(x, None, context)[:, first:first + 1], rtol=1e-13, atol=1e-13)
    if context_features:  # equal frames under another context are not shared
        context[3] = torch.randn(2, dtype=F64, device=device)
        evaluator = net.windows(x, None, context)
        torch.testing.assert_close(evaluator(x, first, 5), net(x, None, context)[:, first:],
                                   rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("context_features", [0, 2])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("windows", [[(2, 3), (3, 4)], [(1, 4)], [(3, 4)], [(0, 2), (1, 4)]])
def test_a_first_window_starts_from_the_states_kept_in_memory(device, masked, windows,
                                                               context_features):
    """The states of the whole sequence (:meth:`CausalGRU.states`) as memory: a first window
    after frame 0 starts from the state before it and equals the network's outputs; a memory
    that is not the frames' states changes them (it is read, not recomputed)."""
    net = make_net(device, depth=1, context_features=context_features)
    x, mask = padded_batch(device)
    mask = mask if masked else None
    context = torch.randn(3, 2, dtype=F64, device=device) if context_features else None
    expected, memory = net(x, mask, context), net.states(x, mask, context)
    torch.testing.assert_close(net.head(memory), expected, rtol=0, atol=0)
    evaluator = net.windows(x, mask, context, memory=memory)
    real = torch.ones(3, 4, dtype=torch.bool, device=device) if mask is None else mask
    for start, stop in windows:
        out = evaluator(x, start, stop)
        inside = real[:, start:stop]
        torch.testing.assert_close(out[inside], expected[:, start:stop][inside], rtol=1e-13,
                                   atol=1e-13)
    start, stop = windows[0]
    if start:
        wrong = net.windows(x, mask, context, memory=torch.zeros_like(memory))(x, start, stop)
        assert not torch.allclose(wrong, expected[:, start:stop])


@pytest.mark.parametrize(("depth", "shape"), [(2, (3, 4, 6)), (1, (3, 4, 5)), (1, (2, 4, 6))])
def test_a_memory_of_another_shape_or_depth_raises(device, depth, shape):
    net = make_net(device, depth=depth)
    x = torch.randn(3, 4, D, dtype=F64, device=device)
    with pytest.raises(ValueError, match="memory must be the states"):
        net.windows(x, memory=torch.zeros(shape, dtype=F64, device=device))


def test_a_window_reads_the_frames_of_its_call(device):
    # Frames in the window (and the one before it) may change from call to call, as in a
    # fixed-point sweep; the frames before that are settled.
    net = make_net(device)
    x = torch.randn(2, 4, D, dtype=F64, device=device)
    evaluator = net.windows(x)
    evaluator(torch.zeros_like(x), 0, 2)
    torch.testing.assert_close(evaluator(x, 1, 4), net(x)[:, 1:], rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("windows", [[(3, 2)], [(0, 2), (3, 4)], [(0, 2), (1, 5)]])
def test_windows_that_break_the_rules_raise(device, windows):
    net = make_net(device)
    x = torch.randn(2, 4, D, dtype=F64, device=device)
    evaluator = net.windows(x)
    *allowed, broken = windows
    for start, stop in allowed:
        evaluator(x, start, stop)
    with pytest.raises(ValueError, match="window"):
        evaluator(x, *broken)


def test_starts_at_zero_and_every_parameter_gets_a_gradient(device):
    net = CausalGRU(D, 4, width=6, context_features=2).to(device=device, dtype=F64)
    x, mask = padded_batch(device)
    context = torch.randn(3, 2, dtype=F64, device=device)
    assert torch.equal(net(x, mask, context), torch.zeros(3, 4, 4, dtype=F64, device=device))
    net = make_net(device, context_features=2)
    net(x, mask, context).square().sum().backward()
    for name, p in net.named_parameters():
        assert p.grad is not None and p.grad.abs().max() > 0, name


@pytest.mark.parametrize("kwargs", [{"width": 0}, {"depth": 0}, {"context_features": -1},
                                    {"out_features": 0}, {"positional": "learned"},
                                    {"positional": "rotary"}])
def test_bad_options_raise(kwargs):
    with pytest.raises(ValueError):
        CausalGRU(**({"features": D, "out_features": 4} | kwargs))


def test_left_align_moves_the_real_frames_to_the_front_in_order():
    x = torch.arange(1.0, 5.0).reshape(1, 4, 1)
    aligned, mask = left_align(x, torch.tensor([[True, False, True, True]]))
    assert aligned.flatten().tolist() == [1, 3, 4, 0] and mask.tolist() == [[1, 1, 1, 0]]
    aligned, mask = left_align(x, None)
    assert torch.equal(aligned, x) and bool(mask.all())


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: left_align(torch.zeros(2, 3), None), ValueError, "x must"),
        (lambda: left_align(torch.zeros(2, 3, 1), torch.ones(2, 3)), TypeError, "bool"),
        (lambda: left_align(torch.zeros(2, 3, 1), torch.ones(2, 4, dtype=torch.bool)),
         ValueError, "shape"),
        (lambda: left_align(torch.zeros(1, 3, 1), torch.zeros(1, 3, dtype=torch.bool)),
         ValueError, "padding"),
        (lambda: real_first(torch.ones(2, 3)), TypeError, "boolean"),
        (lambda: real_first(torch.ones(3, dtype=torch.bool)), ValueError, "shape"),
    ],
)
def test_bad_masks_raise(call, error, match):
    with pytest.raises(error, match=match):
        call()
