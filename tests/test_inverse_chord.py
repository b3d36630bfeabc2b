"""Chord steps for causal maps (docs/guide.md#inversion): the frame Jacobian of the convolution
stack against autograd, the engine's chord steps against its plain solve, their safeguard, and
their use by the inverse of a causal convolution step on one feature."""

from __future__ import annotations

import pytest
import torch
from test_transforms_residual import round_trip

from iresflow.inverse.chord import ChordSteps
from iresflow.inverse.fixed_point import fixed_point_inverse
from iresflow.nn.conv import TemporalConvBranch
from iresflow.nn.layered import ConvStackLinearization
from iresflow.nn.mlp import LipschitzMLP
from iresflow.transforms.residual import ResidualTransform

F64 = torch.float64


def conv_branch(device, features=1, causal=True, dilation=1, length=12, std=0.5):
    branch = TemporalConvBranch(features, 8, kernel_size=3, coeff=0.9, max_len=length,
                                causal=causal, dilation=dilation).to(device=device, dtype=F64)
    for p in branch.parameters():  # weights that make the slopes vary from frame to frame
        torch.nn.init.normal_(p, std=std)
    return branch.eval()


@pytest.mark.parametrize(("causal", "dilation", "features", "masked"), [
    (True, 1, 1, False), (False, 1, 1, True), (True, 2, 3, True), (False, 2, 2, False)])
def test_frame_jacobian_is_the_autograd_jacobian(device, causal, dilation, features, masked):
    branch = conv_branch(device, features, causal, dilation)
    x = torch.randn(2, 12, features, device=device, dtype=F64)
    mask = None
    if masked:
        mask = torch.ones(2, 12, dtype=torch.bool, device=device)
        mask[1, 9:], mask[0, 4] = False, False  # padding at the end and inside
    linearization = branch.linearize()
    value, blocks = linearization.frame_jacobian(x, mask)
    torch.testing.assert_close(value, branch(x, mask), atol=1e-12, rtol=0)
    assert blocks.shape == (2, 12, 12, features, features)
    for r in range(2):
        rows = None if mask is None else mask[r:r + 1]
        dense = torch.autograd.functional.jacobian(
            lambda v, rows=rows: branch(v.view(1, 12, features), rows).view(-1), x[r].reshape(-1))
        expected = dense.view(12, features, 12, features).permute(0, 2, 1, 3)
        torch.testing.assert_close(blocks[r], expected, atol=1e-12, rtol=0)
    if causal:  # block lower triangular
        assert torch.equal(blocks.abs().sum((-1, -2)).triu(1), torch.zeros_like(blocks[..., 0, 0]))


def test_frame_jacobian_needs_the_branch_layout(device):
    w = [torch.randn(4, 1, 3, dtype=F64), torch.randn(1, 4, 3, dtype=F64)]
    two_layers = ConvStackLinearization(w, [None, None], [torch.tensor(1.0, dtype=F64)])
    with pytest.raises(ValueError, match="three layers"):
        two_layers.frame_jacobian(torch.randn(1, 5, 1, dtype=F64))
    with pytest.raises(NotImplementedError, match="forms no frame Jacobian"):
        LipschitzMLP((1, 8, 1), coeff=0.9).linearize().frame_jacobian(torch.randn(1, 5, 1))


def causal_map(device, length=30, lipschitz=0.9):
    """g(x)_t = L tanh(sum_{s <= t} A_ts x_s) on one feature, A lower triangular of norm 1."""
    a = torch.randn(length, length, device=device, dtype=F64).tril()
    a = a / torch.linalg.matrix_norm(a, 2)

    def g(x: torch.Tensor) -> torch.Tensor:
        return lipschitz * torch.tanh(x[..., 0] @ a.T).unsqueeze(-1)

    def jacobian(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        slope = lipschitz * (1 - torch.tanh(x[..., 0] @ a.T) ** 2)
        return g(x), torch.eye(length, device=device, dtype=F64) + slope[..., None] * a

    return g, jacobian


def test_chord_steps_solve_a_causal_map_in_fewer_evaluations(device):
    g, jacobian = causal_map(device)
    y = 3 * torch.randn(8, 30, 1, device=device, dtype=F64)
    plain, plain_stats = fixed_point_inverse(g, y, solver="anderson")
    chord, stats = fixed_point_inverse(g, y, solver="anderson", jacobian=jacobian)
    assert bool(stats.converged.all())
    assert float((chord + g(chord) - y).abs().max()) < 1e-10
    torch.testing.assert_close(chord, plain, atol=1e-9, rtol=0)
    assert int(stats.iterations.max()) < int(plain_stats.iterations.max())


def test_rows_whose_residual_rises_leave_the_chord_steps(device):
    """A matrix far from I + J (ten times too small) overshoots: the residual rises on the
    first chord step and those rows take plain steps, which converge."""
    g, jacobian = causal_map(device)

    def poor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        value, matrix = jacobian(x)
        return value, matrix / 10

    y = torch.randn(4, 30, 1, device=device, dtype=F64)
    x, stats = fixed_point_inverse(g, y, jacobian=poor)
    assert bool(stats.converged.all())
    assert float((x + g(x) - y).abs().max()) < 1e-10


def test_chord_steps_state():
    steps = ChordSteps(torch.eye(2, dtype=F64).expand(3, 2, 2))
    x, image = torch.zeros(3, 2, dtype=F64), torch.ones(3, 2, dtype=F64)
    assert torch.equal(steps.step(x, image, torch.ones(3, dtype=F64)), image)  # M = I: plain
    steps.keep(torch.tensor([True, False, True]))
    assert steps.matrix.shape == (2, 2, 2) and bool(steps.engaged.all())
    # a residual that did not fall: the row takes the plain step from now on
    nxt = steps.step(x[:2], 2 * image[:2], torch.tensor([0.5, 2.0], dtype=F64))
    assert steps.chord.tolist() == [True, False]
    assert torch.equal(nxt, 2 * image[:2])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_matrices_are_solved_in_float32(dtype):
    steps = ChordSteps(2 * torch.eye(3, dtype=dtype).expand(2, 3, 3))
    nxt = steps.step(torch.zeros(2, 3, dtype=dtype), torch.ones(2, 3, dtype=dtype),
                     torch.ones(2, dtype=dtype))
    assert nxt.dtype == dtype and torch.equal(nxt, torch.full((2, 3), 0.5, dtype=dtype))


def test_chord_steps_reject_bad_matrices():
    with pytest.raises(ValueError, match=r"matrix must have shape \(b, n, n\)"):
        ChordSteps(torch.eye(3, dtype=F64))
    with pytest.raises(ValueError, match=r"matrix must have shape \(b, n, n\)"):
        ChordSteps(torch.ones(2, 3, 4, dtype=F64))
    with pytest.raises(TypeError, match="matrix must be a floating-point tensor"):
        ChordSteps(torch.ones(2, 3, 3, dtype=torch.int64))


def test_jacobian_arguments_are_checked(device):
    g, jacobian = causal_map(device)
    y = torch.randn(2, 30, 1, device=device, dtype=F64)
    with pytest.raises(ValueError, match="jacobian must be callable"):
        fixed_point_inverse(g, y, jacobian=jacobian, position_wise=True)
    with pytest.raises(ValueError, match="jacobian must be callable"):
        fixed_point_inverse(g, y, jacobian="exact")
    with pytest.raises(ValueError, match="jacobian must return"):
        fixed_point_inverse(g, y, jacobian=lambda x: (g(x), torch.ones(x.shape[0], 3, 3)))


def test_a_causal_convolution_step_on_one_feature_inverts_with_chord_steps(device):
    """The residual step passes its branch's frame Jacobian to the solver: the same inverse in
    fewer iterations than Anderson steps, padding untouched."""
    block = ResidualTransform(conv_branch(device, length=40, std=0.3), logdet="exact",
                              inverse_solver="anderson")
    x = 2 * torch.randn(5, 40, 1, device=device, dtype=F64)
    mask = torch.arange(40, device=device) < torch.tensor([40, 33, 40, 20, 38],
                                                          device=device)[:, None]
    y, _, stats = round_trip(block, x, mask)
    _, anderson = fixed_point_inverse(block.branch.solve_map(), torch.where(mask[..., None], y, 0),
                                      args=(mask,), solver="anderson")
    assert int(stats.iterations.max()) < int(anderson.iterations.max())


def test_other_branches_take_no_chord_steps(device):
    """Not causal, position-wise, or several features: no Jacobian is formed; a causal
    convolution on one feature forms one, from the linearization its solve map evaluates (the
    branch linearizes once per solve)."""
    for branch, jacobians in ((conv_branch(device), 1), (conv_branch(device, causal=False), 0),
                              (conv_branch(device, features=2), 0),
                              (LipschitzMLP((1, 8, 1), coeff=0.9).to(device=device, dtype=F64),
                               0)):
        block = ResidualTransform(branch, logdet="exact", inverse_solver="anderson").eval()
        y = torch.randn(3, 12, branch.features, device=device, dtype=F64)
        calls: dict[str, int] = {"linearize": 0, "frame_jacobian": 0}

        def counting(name, original, calls=calls):
            def call(self, *args, **kwargs):
                calls[name] += 1
                return original(self, *args, **kwargs)
            return call

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(type(branch), "linearize",
                          counting("linearize", type(branch).linearize))
            patch.setattr(ConvStackLinearization, "frame_jacobian",
                          counting("frame_jacobian", ConvStackLinearization.frame_jacobian))
            block.inverse(y)
        assert calls == {"linearize": 1, "frame_jacobian": jacobians}
