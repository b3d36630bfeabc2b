"""The autoregressive affine step with a causal Transformer or GRU conditioner and its inverse by
sweeps that settle the frames in order (docs/math.md#autoregressive-step)."""

from __future__ import annotations

import io
import math

import nflows.transforms as nft
import pytest
import torch
from nflows.distributions import StandardNormal
from nflows.flows import Flow
from oracles import jacobian, jacobian_logdet, padded_batch

from iresflow.inverse.fixed_point import InversionError, InversionWarning
from iresflow.transforms.autoregressive import AutoregressiveAffine
from iresflow.transforms.base import SequenceTransform
from iresflow.transforms.composite import SequenceCompositeTransform

F64 = torch.float64
D = 3  # features
C = 2  # context features


def make_step(device, *, std: float = 0.3, seed: int = 0, **kwargs) -> AutoregressiveAffine:
    """A tiny float64 step with every parameter moved from its initial value (the zero output
    layer included), so that frames really depend on their past."""
    torch.manual_seed(seed)
    options = {"width": 8, "depth": 2, "heads": 2} | kwargs
    step = AutoregressiveAffine(D, **options).to(device=device, dtype=F64)
    with torch.no_grad():
        for p in step.parameters():
            p.add_(std * torch.randn_like(p))
    return step


@pytest.fixture(params=[{"conditioner": "transformer"}, {"conditioner": "gru"},
                        {"conditioner": "gru", "within_frame": True},
                        {"conditioner": "transformer", "within_frame": True,
                         "reverse_features": True}],
                ids=["transformer", "gru", "gru-within-frame", "transformer-within-frame-reversed"])
def variant(request) -> dict:
    """Each conditioner kind in turn, and the step conditioned within frames too."""
    return request.param


def feature_order(step: AutoregressiveAffine) -> list[int]:
    """The features in the order the step conditions them (all at once without a frame net)."""
    return list(range(D))[::-1] if step.frame_net is not None and step.frame_net.reverse \
        else list(range(D))


def step_map(step: SequenceTransform, context: torch.Tensor | None = None):
    """``step`` as ``f(x, mask)`` for the oracles (one sample at a time: ``context`` is a row)."""
    return lambda x, mask: step(x, context, mask=mask)[0]


@pytest.mark.parametrize("context_features", [0, C])
def test_starts_as_the_identity(device, variant, context_features):
    step = AutoregressiveAffine(D, width=8, heads=2, context_features=context_features,
                                **variant)
    step = step.to(device=device, dtype=F64)
    x, mask = padded_batch(device)
    context = torch.randn(3, C, dtype=F64, device=device) if context_features else None
    y, logabsdet = step(x, context, mask=mask)
    assert torch.equal(y, x) and torch.equal(logabsdet, torch.zeros_like(logabsdet))
    x_back, _ = step.inverse(y, context, mask=mask)
    assert torch.equal(x_back, x)
    # x^0 = y is the solution: every window settles whole, so the windows grow 1, 2, 4 frames
    assert step.last_inverse_stats.iterations.tolist() == [3, 3, 3]


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("options", [{"positional": "sinusoidal"}, {"positional": "learned"},
                                     {"conditioner": "gru", "depth": 1},
                                     {"conditioner": "gru", "positional": "learned"}])
def test_logdet_matches_the_jacobian_oracle(device, masked, options):
    step = make_step(device, max_len=6, **options)
    x, mask = padded_batch(device)  # end padding and a gap
    mask = mask if masked else None
    _, logabsdet = step(x, mask=mask)
    torch.testing.assert_close(logabsdet, jacobian_logdet(step_map(step), x, mask))


def test_conditional_logdet_matches_the_jacobian_oracle(device, variant):
    step = make_step(device, **variant, context_features=C)
    x, mask = padded_batch(device)
    context = torch.randn(3, C, dtype=F64, device=device)
    y, logabsdet = step(x, context, mask=mask)
    for b in range(3):
        expected = jacobian_logdet(step_map(step, context[b : b + 1]), x[b : b + 1],
                                   mask[b : b + 1])
        torch.testing.assert_close(logabsdet[b : b + 1], expected)
    # The context matters, and only for its own sequence.
    other = context.clone()
    other[1] += 1.0
    y_other, logabsdet_other = step(x, other, mask=mask)
    assert not torch.allclose(y_other[1], y[1]) and not torch.allclose(logabsdet_other[1],
                                                                        logabsdet[1])
    assert torch.equal(y_other[[0, 2]], y[[0, 2]])
    assert torch.equal(logabsdet_other[[0, 2]], logabsdet[[0, 2]])


def test_jacobian_is_block_lower_triangular_with_the_scales_on_the_diagonal(device, variant):
    step = make_step(device, **variant)
    x = torch.randn(2, 5, D, dtype=F64, device=device)
    jac = jacobian(step_map(step), x).view(2, 5, D, 5, D)
    _, log_scale = step.shift_and_log_scale(x)
    order = feature_order(step)
    for t in range(5):
        for u in range(t + 1, 5):
            assert torch.equal(jac[:, t, :, u, :], torch.zeros_like(jac[:, t, :, u, :]))
        # the diagonal block, features in the step's order: lower triangular (diagonal without
        # a frame net) with the scales on its diagonal
        block = jac[:, t, :, t, :][:, order][:, :, order]
        torch.testing.assert_close(torch.diagonal(block, dim1=1, dim2=2),
                                   (-log_scale[:, t, order]).exp())
        above = torch.ones(D, D, dtype=torch.bool, device=device).triu(1)
        assert torch.equal(block[:, above], torch.zeros_like(block[:, above]))
        below = block[:, above.T].abs().amax()
        assert below > 1e-3 if step.frame_net is not None else below == 0
    assert jac[:, 1:, :, 0, :].abs().amax() > 1e-3  # the past does matter


def test_a_frame_changes_nothing_before_it(device, variant):
    step = make_step(device, **variant, context_features=C)
    x = torch.randn(2, 6, D, dtype=F64, device=device)
    context = torch.randn(2, C, dtype=F64, device=device)
    y, _ = step(x, context)
    shift, log_scale = step.shift_and_log_scale(x, context)
    for t in range(6):
        moved = x.clone()
        moved[:, t] += 5.0
        y_moved, _ = step(moved, context)
        shift_moved, log_scale_moved = step.shift_and_log_scale(moved, context)
        assert torch.equal(y_moved[:, :t], y[:, :t])
        # a frame net reads frame t's features for its later features: its first one only is
        # a function of the past
        seen = t + 1 if step.frame_net is None else t
        assert torch.equal(shift_moved[:, :seen], shift[:, :seen])
        assert torch.equal(log_scale_moved[:, :seen], log_scale[:, :seen])
        first = feature_order(step)[0]
        assert torch.equal(shift_moved[:, t, first], shift[:, t, first])
        if t < 5:
            assert not torch.allclose(shift_moved[:, t + 1], shift[:, t + 1])


def test_within_a_frame_a_feature_reads_the_features_before_it_only(device):
    for reverse in (False, True):
        step = make_step(device, conditioner="gru", within_frame=True, reverse_features=reverse)
        x = torch.randn(2, 4, D, dtype=F64, device=device)
        shift, log_scale = step.shift_and_log_scale(x)
        order = feature_order(step)
        for place, d in enumerate(order):
            moved = x.clone()
            moved[:, 2, d] += 3.0
            shift_moved, log_scale_moved = step.shift_and_log_scale(moved)
            before, after = order[: place + 1], order[place + 1 :]
            assert torch.equal(shift_moved[:, 2, before], shift[:, 2, before])
            assert torch.equal(log_scale_moved[:, 2, before], log_scale[:, 2, before])
            if after:
                assert not torch.allclose(shift_moved[:, 2, after], shift[:, 2, after])
            assert not torch.allclose(shift_moved[:, 3], shift[:, 3])  # the next frame reads it


def test_within_frame_inverse_takes_one_pass_per_feature_and_a_sweep_per_frame(device):
    # The strongly coupled step: each sweep solves one frame exactly, by D passes of the frame
    # net, so every frame settles in the sweep that reaches it.
    step = make_step(device, conditioner="gru", within_frame=True, std=1.0, seed=1)
    x = torch.randn(4, 6, D, dtype=F64, device=device)
    y, _ = step(x)
    calls = []
    given = step.frame_net.given

    def counted(context):
        net = given(context)
        return lambda x: calls.append(x.shape[1]) or net(x)

    step.frame_net.given = counted
    x_back, _ = step.inverse(y)
    torch.testing.assert_close(x_back, x, atol=1e-9, rtol=0)
    stats = step.last_inverse_stats
    assert stats.iterations.tolist() == [6] * 4 and stats.evaluations == 6
    # D passes over the one frame of every sweep, one over all frames for the inverse's log-det
    assert calls == [1] * (6 * D) + [6]


def test_padded_frames_pass_through_and_influence_nothing(device, variant):
    step = make_step(device, **variant)
    x, mask = padded_batch(device)
    y, logabsdet = step(x, mask=mask)
    assert torch.equal(y[~mask], x[~mask])
    other = torch.where(mask[..., None], x, 50 * torch.randn_like(x))
    y_other, logabsdet_other = step(other, mask=mask)
    assert torch.equal(y_other[mask], y[mask]) and torch.equal(logabsdet_other, logabsdet)
    # Appending padding changes nothing; neither does trimming it.
    longer = torch.cat([x, torch.randn_like(x)], dim=1)
    longer_mask = torch.cat([mask, torch.zeros_like(mask)], dim=1)
    y_longer, logabsdet_longer = step(longer, mask=longer_mask)
    torch.testing.assert_close(y_longer[:, :4][mask], y[mask], rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(logabsdet_longer, logabsdet, rtol=1e-14, atol=1e-14)
    y_short, logabsdet_short = step(x[1:2, :2])  # sequence 1 has two real frames
    torch.testing.assert_close(y_short[0], y[1, :2], rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(logabsdet_short, logabsdet[1:2], rtol=1e-14, atol=1e-14)


def test_a_missing_frame_is_absent_and_the_frames_before_it_are_seen(device, variant):
    step = make_step(device, **variant)
    x, mask = padded_batch(device)  # sequence 2: frames 0, 2, 3 real, frame 1 missing
    shift, _ = step.shift_and_log_scale(x, mask=mask)
    # Not a frame of zeros: the missing frame is no key of the attention at all.
    zero_frame = x.clone()
    zero_frame[2, 1] = 0.0
    shift_zero, _ = step.shift_and_log_scale(zero_frame, mask=torch.ones_like(mask))
    assert torch.equal(shift_zero[2, 0], shift[2, 0])
    assert not torch.allclose(shift_zero[2, 2:], shift[2, 2:])
    # The real frame before the gap stays in the past of the frames after it.
    moved = x.clone()
    moved[2, 0] += 1.0
    shift_moved, _ = step.shift_and_log_scale(moved, mask=mask)
    assert not torch.allclose(shift_moved[2, 2], shift[2, 2])
    assert not torch.allclose(shift_moved[2, 3], shift[2, 3])


@pytest.mark.parametrize("window", [1, 3, None])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("context_features", [0, C])
def test_inverse_round_trip_within_n_sweeps(device, variant, masked, context_features, window):
    step = make_step(device, **variant, context_features=context_features,
                     inverse_window=window)
    x, mask = padded_batch(device)
    mask = mask if masked else None
    context = torch.randn(3, C, dtype=F64, device=device) if context_features else None
    y, logabsdet = step(x, context, mask=mask)
    x_back, inverse_logabsdet = step.inverse(y, context, mask=mask)
    torch.testing.assert_close(x_back, x, atol=1e-9, rtol=0)
    torch.testing.assert_close(inverse_logabsdet, -logabsdet, atol=1e-9, rtol=0)
    stats = step.last_inverse_stats
    assert stats.converged.all() and (stats.residual < stats.tolerance).all()
    assert stats.iterations.shape == (3,) and int(stats.iterations.max()) <= x.shape[1]
    assert not x_back.requires_grad and not inverse_logabsdet.requires_grad
    if masked:
        assert torch.equal(x_back[~mask], y[~mask])
        noisy = torch.where(mask[..., None], y, 50 * torch.randn_like(y))
        assert torch.equal(step.inverse(noisy, context, mask=mask)[0][mask], x_back[mask])


def test_jacobi_sweeps_are_exact_for_a_conditioner_that_does_not_contract(device, variant):
    # Strongly coupled frames: the Jacobi error does not shrink from sweep to sweep, it is only
    # pushed one frame further each time, so the solve needs all N sweeps and the check.
    length = 8
    step = make_step(device, **variant, std=1.0, seed=1)
    x = torch.randn(4, length, D, dtype=F64, device=device)
    y, _ = step(x)
    x_back, _ = step.inverse(y)
    torch.testing.assert_close(step(x_back)[0], y, atol=1e-11, rtol=0)
    # The frame net's map is ill-conditioned at these weights (log-scales at their bound, the
    # features coupled): errors of rounding grow about tenfold per frame.
    tolerance = 1e-9 if step.frame_net is None else 1e-5
    torch.testing.assert_close(x_back, x, atol=tolerance, rtol=0)
    assert step.last_inverse_stats.iterations.tolist() == [length] * 4


def test_inverse_failure_raises_or_warns(device, variant):
    step = make_step(device, **variant, std=1.0, seed=1, inverse_max_iter=2)
    y = torch.randn(3, 6, D, dtype=F64, device=device)
    with pytest.raises(InversionError):
        step.inverse(y)
    step = make_step(device, **variant, std=1.0, seed=1, inverse_max_iter=2,
                     on_failure="warn")
    with pytest.warns(InversionWarning):
        step.inverse(y)
    assert not bool(step.last_inverse_stats.converged.any())


def test_vectors_are_one_frame_sequences(device, variant):
    step = make_step(device, **variant, context_features=C)
    x = torch.randn(4, D, dtype=F64, device=device)
    context = torch.randn(4, C, dtype=F64, device=device)
    y, logabsdet = step(x, context)
    y_seq, logabsdet_seq = step(x[:, None], context)
    assert torch.equal(y, y_seq[:, 0]) and torch.equal(logabsdet, logabsdet_seq)
    x_back, inverse_logabsdet = step.inverse(y, context)
    torch.testing.assert_close(x_back, x, atol=1e-12, rtol=0)
    torch.testing.assert_close(inverse_logabsdet, -logabsdet)
    assert step.last_inverse_stats.iterations.max() <= 2


def test_log_scales_are_bounded(device):
    step = make_step(device, max_log_scale=0.5)
    with torch.no_grad():
        step.conditioner.head.weight.mul_(1e3)
    _, log_scale = step.shift_and_log_scale(torch.randn(2, 6, D, dtype=F64, device=device))
    assert log_scale.abs().max() <= 0.5 and log_scale.abs().max() > 0.49


def test_logdet_gradient_passes_gradcheck(device, variant):
    torch.manual_seed(0)
    step = AutoregressiveAffine(2, width=4, depth=1, heads=2, context_features=1,
                                **variant)
    step = step.to(device=device, dtype=F64)
    with torch.no_grad():
        for p in step.parameters():
            p.add_(0.3 * torch.randn_like(p))
    names = [name for name, _ in step.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_() for p in step.parameters())
    x = torch.randn(2, 3, 2, dtype=F64, device=device)
    mask = torch.tensor([[True, False, True], [True, True, False]], device=device)
    context = torch.randn(2, 1, dtype=F64, device=device)

    def outputs(*values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        state = dict(zip(names, values, strict=True))
        return torch.func.functional_call(step, state, (x, context), {"mask": mask})

    assert torch.autograd.gradcheck(outputs, params)


@pytest.mark.parametrize("options", [{}, {"positional": "learned", "max_len": 5,
                                          "context_features": C},
                                     {"conditioner": "gru", "context_features": C}])
def test_gradients_reach_every_parameter(device, options):
    step = make_step(device, **options)
    x, mask = padded_batch(device)
    context = torch.randn(3, C, dtype=F64, device=device) if options else None
    y, logabsdet = step(x, context, mask=mask)
    (y.square().sum() - logabsdet.sum()).backward()
    for name, p in step.named_parameters():
        assert p.grad is not None and p.grad.abs().max() > 0, name


@pytest.mark.parametrize("options", [{"positional": "learned", "max_len": 4},
                                     {"conditioner": "gru"}])
def test_state_dict_round_trip(device, options):
    step = make_step(device, **options)
    buffer = io.BytesIO()
    torch.save(step.state_dict(), buffer)
    other = make_step(device, seed=1, **options)
    buffer.seek(0)
    other.load_state_dict(torch.load(buffer))
    x = torch.randn(2, 4, D, dtype=F64, device=device)
    for a, b in zip(step(x), other(x), strict=True):
        assert torch.equal(a, b)


def test_train_and_eval_modes_agree_and_nothing_is_initialised_from_data(device, variant):
    step = make_step(device, **variant)
    x, mask = padded_batch(device)
    assert step.is_initialized
    before = {name: p.clone() for name, p in step.state_dict().items()}
    step.initialize(x, mask)
    y_train, logabsdet_train = step.train()(x, mask=mask)
    y_eval, logabsdet_eval = step.eval()(x, mask=mask)
    assert torch.equal(y_train, y_eval) and torch.equal(logabsdet_train, logabsdet_eval)
    for name, value in step.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_nflows_composite_inverse_transform_and_flow(device, variant):
    # Two steps with time reversed between them, as autoregressive flows alternate directions.
    # The reversal of 4 frames of 3 features is an even permutation: the oracle needs det > 0.
    first = make_step(device, **variant, seed=1)
    second = make_step(device, **variant, seed=2)
    chain = nft.CompositeTransform([first, nft.ReversePermutation(4, dim=1), second])
    x = torch.randn(5, 4, D, dtype=F64, device=device)
    z, logabsdet = chain(x)
    torch.testing.assert_close(logabsdet, jacobian_logdet(lambda t, m: chain(t)[0], x))
    x_back, inverse_logabsdet = chain.inverse(z)
    torch.testing.assert_close(x_back, x, atol=1e-9, rtol=0)
    torch.testing.assert_close(inverse_logabsdet, -logabsdet, atol=1e-9, rtol=0)
    inverted = nft.InverseTransform(first)
    u, u_logabsdet = inverted(x)
    back, back_logabsdet = inverted.inverse(u)
    torch.testing.assert_close(back, x, atol=1e-9, rtol=0)
    torch.testing.assert_close(u_logabsdet, -back_logabsdet, atol=1e-9, rtol=0)
    flow = Flow(chain, StandardNormal([4, D]))
    normal = -0.5 * z.square().sum((1, 2)) - 4 * D / 2 * math.log(2 * math.pi)
    torch.testing.assert_close(flow.log_prob(x), normal + logabsdet)


def test_masked_chain_with_a_conditional_step(device, variant):
    chain = SequenceCompositeTransform(
        [make_step(device, **variant, seed=seed, context_features=C)
         for seed in (1, 2)]
    )
    x, mask = padded_batch(device)
    context = torch.randn(3, C, dtype=F64, device=device)
    z, logabsdet = chain(x, context, mask=mask)
    for b in range(3):
        expected = jacobian_logdet(step_map(chain, context[b : b + 1]), x[b : b + 1],
                                   mask[b : b + 1])
        torch.testing.assert_close(logabsdet[b : b + 1], expected)
    x_back, inverse_logabsdet = chain.inverse(z, context, mask=mask)
    torch.testing.assert_close(x_back, x, atol=1e-9, rtol=0)
    torch.testing.assert_close(inverse_logabsdet, -logabsdet, atol=1e-9, rtol=0)


def test_runs_in_the_dtype_and_device_of_its_parameters(device, variant):
    step = make_step(device, **variant).float()
    x = torch.randn(3, 6, D, device=device)
    y, logabsdet = step(x)
    assert y.dtype == logabsdet.dtype == torch.float32 and y.device == x.device
    x_back, _ = step.inverse(y)
    assert step.last_inverse_stats.converged.all()
    torch.testing.assert_close(x_back, x, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda s, x, c: s(x.index_fill(1, torch.tensor([1], device=x.device), float("nan")),
                           c), ValueError, "NaN"),
        (lambda s, x, c: s.inverse(torch.full_like(x, float("inf")), c), ValueError, "Inf"),
        (lambda s, x, c: s(x[..., :2], c), ValueError, "3 features"),
        (lambda s, x, c: s(x.float(), c), TypeError, "dtype"),
        (lambda s, x, c: s(x, c, mask=torch.ones(2, 4, device=x.device)), TypeError, "bool"),
        (lambda s, x, c: s(x, c, mask=torch.zeros(2, 4, dtype=torch.bool, device=x.device)),
         ValueError, "all padding"),
        (lambda s, x, c: s(x), ValueError, "needs context"),
        (lambda s, x, c: s(x, c[:, :1]), ValueError, "context must have shape"),
        (lambda s, x, c: s.inverse(x, c.float()), TypeError, "context"),
        (lambda s, x, c: s(torch.cat([x, x], dim=1), c), ValueError, "max_len=5"),
    ],
)
def test_bad_inputs_raise(device, variant, call, error, match):
    step = make_step(device, **variant, context_features=C, positional="learned",
                     max_len=5)
    x = torch.randn(2, 4, D, dtype=F64, device=device)
    context = torch.randn(2, C, dtype=F64, device=device)
    with pytest.raises(error, match=match):
        call(step, x, context)
    with pytest.raises(ValueError, match="unconditional"):
        make_step(device)(x, context)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"width": 6, "heads": 4}, ValueError),
        ({"depth": 0}, ValueError),
        ({"positional": "learned"}, ValueError),  # without max_len
        ({"positional": "rotary"}, ValueError),
        ({"max_log_scale": 0.0}, ValueError),
        ({"inverse_tol": 0.0}, ValueError),
        ({"inverse_max_iter": 0}, ValueError),
        ({"inverse_window": 0}, ValueError),
        ({"on_failure": "ignore"}, ValueError),
        ({"conditioner": "lstm"}, ValueError),
        ({"conditioner": "gru", "depth": 0}, ValueError),
        ({"conditioner": "gru", "positional": "learned"}, ValueError),  # without max_len
        ({"context_features": 1.5}, TypeError),
        ({"reverse_features": True}, ValueError),  # without within_frame
    ],
)
def test_bad_options_raise(kwargs, error):
    with pytest.raises(error):
        AutoregressiveAffine(D, **kwargs)
