"""Hostile inputs to every public entry point: a clear error or a correct result, never a silent
wrong answer.

Every entry point of the zoo below receives NaN/Inf, integer, complex and non-tensor inputs,
wrong ranks and feature sizes, empty batches and zero-length sequences, masks of the wrong dtype,
shape or device, all-padding sequences, sequences longer than a learned positional table,
low-precision and mismatched dtypes, and non-contiguous views. Bad input must raise
``ValueError``/``TypeError`` naming the argument; good input in an unusual layout must give the
result of its contiguous copy. Hand-edited weights that violate a Lipschitz constraint must not
break the certificate: the normalisation is structural (docs/math.md#contractive-attention,
#spectral-norm).

Dtype decisions (one per entry point, enforced below):

* modules (linear layers, branches, ActNorm, transforms, the model) compute in the dtype of
  their parameters: an input of any other dtype (float16/bfloat16 into a float32/float64
  module, or the reverse) raises ``TypeError``; a module converted to float16/bfloat16 gives
  the float64 result to low-precision accuracy, except where the log-determinant is needed;
* log-determinant estimators accept float32/float64 only (``TypeError`` otherwise);
* ``fixed_point_inverse`` solves in any floating dtype with a dtype-scaled tolerance.

The linear layers, like :class:`torch.nn.Linear`, do not inspect values (that would synchronise
the host in every layer); NaN/Inf propagate to the affected tokens only. Every other entry point
rejects them.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from iresflow.data.datasets import load_dataset
from iresflow.inverse.fixed_point import default_tolerance, fixed_point_inverse
from iresflow.logdet.exact import ExactLogDet
from iresflow.logdet.roulette import RouletteLogDet
from iresflow.logdet.series import SeriesLogDet
from iresflow.models.residual_flow import ResidualSequenceFlow
from iresflow.nn.attention import (
    ContractiveL2MultiheadAttention,
    ContractiveLipschitzNormAttention,
    DotProductMultiheadAttention,
    L2MultiheadAttention,
)
from iresflow.nn.linear import InfNormLinear, SpectralLinear
from iresflow.nn.mlp import LipschitzMLP
from iresflow.nn.positional import LearnedPositionalEncoding, PositionalBranch
from iresflow.transforms.actnorm import ActNorm
from iresflow.transforms.composite import SequenceCompositeTransform
from iresflow.transforms.residual import ResidualTransform
from tests.oracles import jacobian

FEATURES = 4
HEADS = 2
MAX_LEN = 4  # of the learned positional table of the model in the zoo
HYPOTHESIS = settings(max_examples=25, deadline=None)


# ------------------------------------------------------------------------------------------------
# the zoo of entry points


@dataclass(frozen=True)
class EntryPoint:
    """A public entry point called as ``call(x, mask)``.

    Attributes:
        call: The entry point; returns a tensor or a tuple holding tensors.
        arg: Name of the data argument, as error messages must spell it.
        shape_arg: Name in shape errors (``fixed_point_inverse`` leaves shapes to its ``g``).
        ranks: Accepted ranks of the data argument; ``None`` for any rank ``>= 1``.
        masks: Whether a padding mask is accepted.
        checks_values: Whether NaN/Inf and empty dimensions are rejected (not by linear layers).
        solves: Whether the result comes from a fixed-point solve (accurate to its tolerance).
        max_len: Longest accepted sequence, if bounded.
    """

    call: Callable[[Any, Any], Any]
    arg: str
    shape_arg: str
    ranks: tuple[int, ...] | None = (3,)
    masks: bool = True
    checks_values: bool = True
    solves: bool = False
    max_len: int | None = None


def _entry(call: Callable[[Any, Any], Any], arg: str = "x", **kwargs: Any) -> EntryPoint:
    return EntryPoint(call, arg, kwargs.pop("shape_arg", arg), **kwargs)


def _tiny_model(device: torch.device, dtype: torch.dtype, **kwargs: Any) -> ResidualSequenceFlow:
    """One-block model with a learned positional table of MAX_LEN rows and initialised ActNorm."""
    options = {"n_blocks": 1, "hidden": 4, "heads": HEADS, "max_len": MAX_LEN,
               "positional": "learned"} | kwargs
    model = ResidualSequenceFlow(features=FEATURES, **options).to(device=device, dtype=dtype)
    data = torch.randn(6, MAX_LEN, FEATURES, device=device, dtype=dtype) * 1.5 + 0.3
    model.train().log_prob(data, method="exact")
    return model.eval()


def _initialised_actnorm(device: torch.device, dtype: torch.dtype) -> ActNorm:
    actnorm = ActNorm(FEATURES).to(device=device, dtype=dtype)
    actnorm.initialize(torch.randn(6, 3, FEATURES, device=device, dtype=dtype) * 2.0 - 1.0)
    return actnorm.eval()


def _seeded(device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(0)


def build_zoo(device: torch.device, dtype: torch.dtype) -> dict[str, EntryPoint]:
    """Every public entry point, on tiny modules in evaluation mode."""
    torch.manual_seed(0)
    factory = {"device": device, "dtype": dtype}
    spectral = SpectralLinear(FEATURES, FEATURES, coeff=0.9).to(**factory).eval()
    infnorm = InfNormLinear(FEATURES, FEATURES, coeff=0.9).to(**factory)
    mlp = LipschitzMLP((FEATURES, 4, FEATURES), coeff=0.9).to(**factory).eval()
    attention = {
        "L2MultiheadAttention": L2MultiheadAttention(FEATURES, HEADS),
        "DotProductMultiheadAttention": DotProductMultiheadAttention(FEATURES, HEADS),
        "DotProductMultiheadAttention[lipschitznorm]": DotProductMultiheadAttention(
            FEATURES, HEADS, lipschitz_norm="transformer"
        ),
        "ContractiveL2MultiheadAttention": ContractiveL2MultiheadAttention(FEATURES, HEADS),
        "ContractiveLipschitzNormAttention": ContractiveLipschitzNormAttention(FEATURES, HEADS),
    }
    attention = {k: v.to(**factory).eval() for k, v in attention.items()}
    contractive_l2 = attention["ContractiveL2MultiheadAttention"]
    residual = ResidualTransform(mlp, logdet="exact").eval()
    actnorm = _initialised_actnorm(device, dtype)
    composite = SequenceCompositeTransform(
        [_initialised_actnorm(device, dtype), ResidualTransform(
            PositionalBranch(contractive_l2, LearnedPositionalEncoding(FEATURES, MAX_LEN)),
            logdet="exact",
        ).to(**factory).eval()]
    )
    model = _tiny_model(device, dtype)

    zoo = {
        "SpectralLinear": _entry(lambda x, m: spectral(x), ranks=None, masks=False,
                                 checks_values=False),
        "InfNormLinear": _entry(lambda x, m: infnorm(x), ranks=None, masks=False,
                                checks_values=False),
        "LipschitzMLP": _entry(lambda x, m: mlp(x, m), ranks=(2, 3)),
    }
    for name, module in attention.items():
        zoo[name] = _entry(lambda x, m, module=module: module(x, m))
    zoo |= {
        "ExactLogDet": _entry(lambda x, m: ExactLogDet()(mlp, x, m)),
        "SeriesLogDet": _entry(
            lambda x, m: SeriesLogDet(n_terms=3, generator=_seeded(device))(contractive_l2, x, m)
        ),
        "RouletteLogDet": _entry(
            lambda x, m: RouletteLogDet(generator=_seeded(device))(mlp, x, m)
        ),
        "fixed_point_inverse": _entry(
            lambda y, m: fixed_point_inverse(mlp, y, args=() if m is None else (m,)),
            "y", shape_arg="x", ranks=None, solves=True,
        ),
        "ResidualTransform.forward": _entry(lambda x, m: residual(x, mask=m), "inputs",
                                            ranks=(2, 3)),
        "ResidualTransform.inverse": _entry(lambda x, m: residual.inverse(x, mask=m), "inputs",
                                            ranks=(2, 3), solves=True),
        "ActNorm.forward": _entry(lambda x, m: actnorm(x, mask=m), "inputs", ranks=(2, 3)),
        "ActNorm.inverse": _entry(lambda x, m: actnorm.inverse(x, mask=m), "inputs",
                                  ranks=(2, 3)),
        "SequenceCompositeTransform.forward": _entry(
            lambda x, m: composite(x, mask=m), "inputs", ranks=(2, 3), max_len=MAX_LEN
        ),
        "SequenceCompositeTransform.inverse": _entry(
            lambda x, m: composite.inverse(x, mask=m), "inputs", ranks=(2, 3), solves=True,
            max_len=MAX_LEN,
        ),
        "ResidualSequenceFlow.log_prob": _entry(
            lambda x, m: model.log_prob(x, m, method="exact"), max_len=MAX_LEN
        ),
        "ResidualSequenceFlow.transform_to_noise": _entry(
            lambda x, m: model.transform_to_noise(x, m), max_len=MAX_LEN
        ),
        "ResidualSequenceFlow.inverse": _entry(
            lambda z, m: model.inverse(z, m), "z", solves=True, max_len=MAX_LEN
        ),
    }
    return zoo


ENTRY_POINTS = (
    "SpectralLinear", "InfNormLinear", "LipschitzMLP", "L2MultiheadAttention",
    "DotProductMultiheadAttention", "DotProductMultiheadAttention[lipschitznorm]",
    "ContractiveL2MultiheadAttention", "ContractiveLipschitzNormAttention", "ExactLogDet",
    "SeriesLogDet", "RouletteLogDet", "fixed_point_inverse", "ResidualTransform.forward",
    "ResidualTransform.inverse", "ActNorm.forward", "ActNorm.inverse",
    "SequenceCompositeTransform.forward", "SequenceCompositeTransform.inverse",
    "ResidualSequenceFlow.log_prob", "ResidualSequenceFlow.transform_to_noise",
    "ResidualSequenceFlow.inverse",
)
MASKED = tuple(name for name in ENTRY_POINTS if not name.endswith("Linear"))


@pytest.fixture(scope="module")
def zoo(device: torch.device, dtype: torch.dtype) -> dict[str, EntryPoint]:
    entries = build_zoo(device, dtype)
    assert tuple(entries) == ENTRY_POINTS
    return entries


@pytest.fixture(scope="module")
def model(device: torch.device, dtype: torch.dtype) -> ResidualSequenceFlow:
    torch.manual_seed(0)
    return _tiny_model(device, dtype)


def _tensors(result: Any) -> tuple[Tensor, ...]:
    """The tensors of an entry point's result (drops e.g. the ``InverseStats``)."""
    if isinstance(result, Tensor):
        return (result,)
    return tuple(r for r in result if isinstance(r, Tensor))


def _tolerance(dtype: torch.dtype, solves: bool) -> dict[str, float]:
    """Agreement expected between two evaluations of the same map on equal inputs."""
    if dtype == torch.float64:
        return {"atol": 1e-8 if solves else 1e-11, "rtol": 1e-8 if solves else 1e-11}
    return {"atol": 1e-4, "rtol": 1e-4}


def _assert_same(a: Any, b: Any, dtype: torch.dtype, solves: bool) -> None:
    for u, v in zip(_tensors(a), _tensors(b), strict=True):
        torch.testing.assert_close(u, v, **_tolerance(dtype, solves))


# ------------------------------------------------------------------------------------------------
# valid batches drawn by hypothesis


@st.composite
def batches(
    draw: st.DrawFn, entry: EntryPoint, device: torch.device, dtype: torch.dtype,
    masked: bool | None = None,
) -> tuple[Tensor, Tensor | None]:
    """A valid ``(B, N, D)`` batch for ``entry`` (B <= 3, N <= 4) and a mask or ``None``."""
    batch = draw(st.integers(1, 3))
    length = draw(st.integers(1, entry.max_len or 4))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, FEATURES, generator=gen, dtype=torch.float64)
    if masked is None:
        masked = entry.masks and draw(st.booleans())
    mask = None
    if masked:
        rows = [draw(st.lists(st.booleans(), min_size=length, max_size=length).filter(any))
                for _ in range(batch)]
        mask = torch.tensor(rows, dtype=torch.bool, device=device)
    return x.to(device=device, dtype=dtype), mask


# ------------------------------------------------------------------------------------------------
# bad inputs: a clear error naming the argument


def _other_float(dtype: torch.dtype) -> list[torch.dtype]:
    others = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
    return [d for d in others if d != dtype]


def _shape_pattern(x: Tensor) -> str:
    """Regex matching the shape of ``x`` as messages print it, e.g. ``(2, 3, 5)``."""
    return r"\(" + r", ".join(str(s) for s in x.shape) + r"\)"


def _corruptions(entry: EntryPoint) -> list[str]:
    kinds = ["non_tensor", "non_float", "features", "float_dtype"]
    if entry.ranks is not None:
        kinds.append("rank")
    if entry.checks_values:
        kinds += ["non_finite", "empty"]
    if entry.masks:
        kinds += ["mask_dtype", "mask_shape", "mask_all_padding", "mask_non_tensor"]
    if entry.max_len is not None:
        kinds.append("too_long")
    return kinds


@pytest.mark.parametrize("name", ENTRY_POINTS)
@HYPOTHESIS
@given(data=st.data())
def test_bad_input_raises_clear_error(zoo, device, dtype, name, data):
    entry = zoo[name]
    kind = data.draw(st.sampled_from(_corruptions(entry)), label="corruption")
    x, mask = data.draw(batches(entry, device, dtype, masked=kind.startswith("mask")))
    arg, shape_arg = entry.arg, entry.shape_arg
    if kind == "non_finite":
        index = tuple(data.draw(st.integers(0, s - 1)) for s in x.shape)
        x = x.clone()
        x[index] = data.draw(st.sampled_from([math.nan, math.inf, -math.inf]))
        error, pattern = ValueError, rf"\b{arg}\b contains NaN or Inf"
    elif kind == "non_tensor":
        x = data.draw(st.sampled_from([x.tolist(), x.cpu().numpy(), 1.0, None]))
        error, pattern = TypeError, rf"\b{arg}\b.*Tensor"
    elif kind == "non_float":
        target = data.draw(
            st.sampled_from([torch.int64, torch.int32, torch.bool, torch.complex128])
        )
        x = x.to(target)
        error, pattern = TypeError, rf"\b{arg}\b.*floating-point"
    elif kind == "rank":
        bad = [r for r in (1, 2, 4) if r not in entry.ranks]
        rank = data.draw(st.sampled_from(bad))
        x = {1: x[0, 0], 2: x[:, 0], 4: x[None]}[rank]
        mask = None
        error, pattern = ValueError, rf"\b{shape_arg}\b.*shape"
    elif kind == "features":
        size = data.draw(st.sampled_from([1, FEATURES - 1, FEATURES + 1]))
        x = x[..., :1].expand(*x.shape[:-1], size).contiguous()
        error, pattern = ValueError, rf"\b{shape_arg}\b.*{_shape_pattern(x)}"
    elif kind == "empty":
        x = data.draw(st.sampled_from([x[:0], x[:, :0]]))
        mask = None
        error, pattern = ValueError, rf"\b{arg}\b.*empty"
    elif kind == "float_dtype":
        x = x.to(data.draw(st.sampled_from(_other_float(dtype))))
        error, pattern = TypeError, r"dtype"
    elif kind == "mask_dtype":
        mask = mask.to(data.draw(st.sampled_from([torch.int64, torch.int32, torch.uint8,
                                                  torch.float32, dtype])))
        error, pattern = TypeError, r"\bmask\b.*torch\.bool"
    elif kind == "mask_shape":
        mask = data.draw(st.sampled_from([
            torch.cat([mask, mask[:, :1]], dim=1), mask[..., None], mask[0],
            torch.cat([mask, mask[:1]], dim=0),
        ]))
        error, pattern = ValueError, r"\bmask\b|\bargs\[0\]"
    elif kind == "mask_all_padding":
        mask = mask.clone()
        mask[data.draw(st.integers(0, mask.shape[0] - 1))] = False
        error, pattern = ValueError, r"\bmask\b.*padding"
    elif kind == "mask_non_tensor":
        mask = data.draw(st.sampled_from([mask.tolist(), mask.cpu().numpy()]))
        error, pattern = TypeError, r"\bmask\b|\bargs\b"
    else:  # too_long
        x = torch.cat([x, x[:, :1].expand(-1, entry.max_len + 1 - x.shape[1], -1)], dim=1)
        error, pattern = ValueError, rf"max_len={entry.max_len}\b"
    with pytest.raises(error, match=pattern):
        entry.call(x, mask)


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_mismatched_dtype_error_names_the_argument(zoo, device, dtype, name):
    entry = zoo[name]
    x = torch.randn(2, 3, FEATURES, device=device, dtype=dtype)
    for other in _other_float(dtype):
        with pytest.raises(TypeError, match=rf"\b{entry.shape_arg}\b.*dtype"):
            entry.call(x.to(other), None)


@pytest.mark.parametrize("direction", ["forward", "inverse"])
def test_feature_size_error_of_positional_block_names_the_argument(device, dtype, direction):
    branch = PositionalBranch(ContractiveL2MultiheadAttention(FEATURES, HEADS),
                              LearnedPositionalEncoding(FEATURES, MAX_LEN))
    block = ResidualTransform(branch.to(device=device, dtype=dtype), logdet="exact").eval()
    x = torch.randn(2, 3, FEATURES + 1, device=device, dtype=dtype)
    call = block if direction == "forward" else block.inverse
    with pytest.raises(ValueError, match=rf"\binputs\b.*{_shape_pattern(x)}"):
        call(x)


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_input_on_another_device_raises_type_error(zoo, device, dtype, name):
    # The meta device stands in for "another device" on every machine; see also the CUDA test.
    entry = zoo[name]
    x = torch.zeros(2, 3, FEATURES, device="meta", dtype=dtype)
    with pytest.raises(TypeError, match=r"device"):
        entry.call(x, None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second real device")
@pytest.mark.parametrize("name", MASKED)
def test_mask_on_another_device_is_moved_and_input_rejected(zoo, device, dtype, name):
    entry = zoo[name]
    other = torch.device("cpu") if device.type == "cuda" else torch.device("cuda")
    x = torch.randn(2, 3, FEATURES, device=device, dtype=dtype)
    mask = torch.tensor([[True, True, True], [True, False, True]], device=device)
    # documented conversion: the mask is moved to the device of the inputs
    _assert_same(entry.call(x, mask.to(other)), entry.call(x, mask), dtype, entry.solves)
    with pytest.raises(TypeError, match=r"device"):
        entry.call(x.to(other), mask.to(other))


@pytest.mark.parametrize("name", [n for n in ENTRY_POINTS if n.endswith("Linear")])
def test_linear_layers_propagate_non_finite_values_to_affected_tokens_only(zoo, device, dtype,
                                                                           name):
    x = torch.randn(2, 3, FEATURES, device=device, dtype=dtype)
    bad = x.clone()
    bad[1, 2, 0] = math.nan
    reference, out = zoo[name].call(x, None), zoo[name].call(bad, None)
    assert bool(out[1, 2].isnan().all())
    untouched = torch.ones(2, 3, dtype=torch.bool, device=device)
    untouched[1, 2] = False
    torch.testing.assert_close(out[untouched], reference[untouched], rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------
# good inputs in unusual layouts: the result of the contiguous copy


def _views(x: Tensor, layout: str) -> Tensor:
    """A non-contiguous tensor equal to ``x``."""
    if layout == "transposed":
        return x.transpose(0, 1).contiguous().transpose(0, 1)
    if layout == "strided":
        wide = torch.zeros(x.shape[0], 2 * x.shape[1], *x.shape[2:], dtype=x.dtype, device=x.device)
        wide[:, ::2] = x
        return wide[:, ::2]
    if layout == "feature_strided":
        wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype, device=x.device)
        wide[..., ::2] = x
        return wide[..., ::2]
    # "broadcast": a stride-0 batch dimension (every sequence equal to the first)
    return x[:1].expand_as(x)


@HYPOTHESIS
@given(data=st.data())
def test_non_contiguous_views_give_the_result_of_contiguous_copies(zoo, device, dtype, data):
    name = data.draw(st.sampled_from(ENTRY_POINTS), label="entry point")
    entry = zoo[name]
    x, mask = data.draw(batches(entry, device, dtype))
    layout = data.draw(st.sampled_from(["transposed", "strided", "feature_strided", "broadcast"]))
    view = _views(x, layout)
    mask_view = None
    if mask is not None:
        mask_view = _views(mask, "broadcast" if layout == "broadcast" else "transposed")
    result = entry.call(view, mask_view)
    expected = entry.call(view.contiguous(), None if mask_view is None else mask_view.contiguous())
    _assert_same(result, expected, dtype, entry.solves)


@HYPOTHESIS
@given(data=st.data())
def test_padded_values_never_change_real_outputs(zoo, device, dtype, data):
    name = data.draw(st.sampled_from(MASKED), label="entry point")
    entry = zoo[name]
    x, mask = data.draw(batches(entry, device, dtype, masked=True))
    # The bare solver gets unit-scale padding: its default tolerance scales with the largest
    # entry of a sample, padding included; the transforms solve with padding set to zero (see
    # test_inverse_accuracy_ignores_padded_values).
    bare = name == "fixed_point_inverse"
    scale = 3.0 if bare else data.draw(st.sampled_from([1.0, 1e3, 1e6]))
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(
        data.draw(st.integers(0, 2**16))), dtype=torch.float64).to(device=device, dtype=dtype)
    hostile = torch.where(mask.unsqueeze(-1), x, scale * noise)
    results, expected = _tensors(entry.call(hostile, mask)), _tensors(entry.call(x, mask))
    for got, want in zip(results, expected, strict=True):
        if got.shape == x.shape:  # sequences: compare the real tokens
            got, want = got[mask], want[mask]
        torch.testing.assert_close(got, want, **_tolerance(dtype, entry.solves))


@pytest.mark.parametrize("name", MASKED)
def test_all_true_mask_equals_no_mask(zoo, device, dtype, name):
    entry = zoo[name]
    x = torch.randn(2, 3, FEATURES, device=device, dtype=dtype)
    mask = torch.ones(2, 3, dtype=torch.bool, device=device)
    _assert_same(entry.call(x, mask), entry.call(x, None), dtype, entry.solves)


@pytest.mark.parametrize("name", ["ResidualTransform.inverse", "ResidualSequenceFlow.inverse"])
def test_inverse_accuracy_ignores_padded_values(zoo, device, dtype, name):
    entry = zoo[name]
    z = torch.randn(2, 3, FEATURES, device=device, dtype=dtype)
    mask = torch.tensor([[True, True, True], [True, True, False]], device=device)
    hostile = z.clone()
    hostile[1, 2] = 1e10 if dtype == torch.float64 else 1e6
    got, want = entry.call(hostile, mask), entry.call(z, mask)
    torch.testing.assert_close(_tensors(got)[0][mask], _tensors(want)[0][mask],
                               **_tolerance(dtype, solves=True))


# ------------------------------------------------------------------------------------------------
# low precision: correct to its accuracy, or a clear TypeError


LOW_PRECISION = {torch.float16: 2e-2, torch.bfloat16: 6e-2}  # relative accuracy expected


LOW_PRECISION_MODULES: dict[str, Callable[[], torch.nn.Module]] = {
    "SpectralLinear": lambda: SpectralLinear(FEATURES, FEATURES, coeff=0.9),
    "InfNormLinear": lambda: InfNormLinear(FEATURES, FEATURES, coeff=0.9),
    "LipschitzMLP": lambda: LipschitzMLP((FEATURES, 4, FEATURES), coeff=0.9),
    "L2MultiheadAttention": lambda: L2MultiheadAttention(FEATURES, HEADS),
    "DotProductMultiheadAttention": lambda: DotProductMultiheadAttention(FEATURES, HEADS),
    "DotProductMultiheadAttention[lipschitznorm]": lambda: DotProductMultiheadAttention(
        FEATURES, HEADS, lipschitz_norm="transformer"
    ),
    "ContractiveL2MultiheadAttention": lambda: ContractiveL2MultiheadAttention(FEATURES, HEADS),
    "ContractiveLipschitzNormAttention": lambda: ContractiveLipschitzNormAttention(
        FEATURES, HEADS
    ),
    "ActNorm": lambda: ActNorm(FEATURES),
}


@pytest.mark.parametrize("low", list(LOW_PRECISION), ids=str)
@pytest.mark.parametrize("name", list(LOW_PRECISION_MODULES))
def test_low_precision_module_matches_float64(device, name, low):
    torch.manual_seed(0)
    reference = LOW_PRECISION_MODULES[name]().to(device=device, dtype=torch.float64)
    x = torch.randn(3, 4, FEATURES, device=device, dtype=torch.float64) * 1.5 + 0.5
    if isinstance(reference, ActNorm):
        reference.initialize(x)  # data-dependent initialisation
    reference.eval()
    module = copy.deepcopy(reference).to(low)
    x = x.to(low)
    want = _tensors(reference(x.double()))[0]
    got = _tensors(module(x))[0]
    assert got.dtype == low
    error = (got.double() - want).abs().max() / want.abs().max()
    assert error <= LOW_PRECISION[low]


@pytest.mark.parametrize("low", list(LOW_PRECISION), ids=str)
@pytest.mark.parametrize("estimator", [ExactLogDet(), SeriesLogDet(), RouletteLogDet()],
                         ids=lambda e: type(e).__name__)
def test_estimators_reject_low_precision(device, estimator, low):
    branch = LipschitzMLP((FEATURES, 4, FEATURES)).to(device=device, dtype=low)
    with pytest.raises(TypeError, match=r"\bx\b.*float32 or torch\.float64"):
        estimator(branch, torch.zeros(2, 3, FEATURES, device=device, dtype=low))


@pytest.mark.parametrize("low", list(LOW_PRECISION), ids=str)
def test_fixed_point_inverse_solves_in_low_precision(device, low):
    y = torch.randn(3, 4, FEATURES, device=device, dtype=torch.float64)
    y_low = y.to(low)
    x, stats = fixed_point_inverse(lambda t: 0.5 * torch.sin(t), y_low)
    reference, _ = fixed_point_inverse(lambda t: 0.5 * torch.sin(t), y)
    assert x.dtype == low and bool(stats.converged.all())
    # Banach with L = 1/2: L / (1 - L) * tol from the stopping rule, plus 1 / (1 - L) times the
    # rounding of y and of one evaluation of y - g(x) (a few units in the last place of |y|).
    rounding = float((y_low.double() - y).abs().max()) + 3 * torch.finfo(low).eps * float(
        y.abs().max()
    )
    bound = float(default_tolerance(y_low).max()) + 2 * rounding
    assert float((x.double() - reference).abs().max()) <= bound


def test_low_precision_model_raises_type_error(device):
    model = _tiny_model(device, torch.float64).to(torch.bfloat16)
    x = torch.randn(2, 3, FEATURES, device=device, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"float32 or torch\.float64"):
        model.log_prob(x, method="exact")


def test_autocast_is_not_rejected_by_the_dtype_gate(device):
    if not torch.amp.is_autocast_available(device.type):
        pytest.skip(f"no autocast on {device.type}")
    mlp = LipschitzMLP((FEATURES, 8, FEATURES)).to(device).eval()
    x = torch.randn(2, 3, FEATURES, device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = mlp(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), mlp(x), atol=5e-2, rtol=5e-2)


# ------------------------------------------------------------------------------------------------
# hand-edited weights: the certificate is structural


def _edit_weights(model: ResidualSequenceFlow, how: str) -> None:
    """Make every raw weight violate its constraint by far (scaled or replaced, times 100)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, SpectralLinear | L2MultiheadAttention
                          | DotProductMultiheadAttention):
                for name, weight in module.named_parameters(recurse=False):
                    if name == "bias":
                        continue
                    if how == "replace":
                        fresh = torch.randn(weight.shape, generator=gen, dtype=torch.float64)
                        weight.copy_(fresh.to(weight))
                    weight.mul_(100.0)


@pytest.mark.parametrize(("how", "mode"), [("scale", "eval"), ("scale", "train"),
                                           ("replace", "eval")])
@pytest.mark.parametrize("attention", ["l2", "lipschitznorm"])
def test_hand_edited_weights_keep_every_branch_contractive(device, dtype, attention, how, mode):
    torch.manual_seed(0)
    model = _tiny_model(device, dtype, attention=attention)
    _edit_weights(model, how)
    model.train(mode == "train")
    seq_len = 3
    residual_steps = [m for m in model.modules() if isinstance(m, ResidualTransform)]
    spectral = [m for m in model.modules() if isinstance(m, SpectralLinear)]
    assert len(residual_steps) == 2 and spectral
    with torch.no_grad():  # the raw weights really violate the constraint (the test can fail)
        assert all(float(torch.linalg.matrix_norm(m.weight, 2)) > 1 for m in spectral)
        assert all(
            float(step.branch.branch.raw_bound(seq_len)) > 1
            for step in residual_steps if isinstance(step.branch, PositionalBranch)
        )

    slack = 1e-9 if dtype == torch.float64 else 1e-4
    for row in model.lipschitz_report(seq_len):
        assert row["certified"] < 1
        assert row["estimate"] <= row["certified"] + slack

    x = torch.randn(2, seq_len, FEATURES, device=device, dtype=dtype)
    mask = torch.tensor([[True] * seq_len, [True] * (seq_len - 1) + [False]], device=device)
    for step in residual_steps:
        branch = step.branch
        certified = float(branch.lipschitz_constant(seq_len).detach())
        for m in (None, mask):
            jac = jacobian(lambda t, mb, g=branch: g(t, mb), x, m)
            radius = torch.linalg.eigvals(jac).abs().amax(-1)
            assert bool((radius < 1).all())
            if branch.norm == "inf":
                norm = jac.abs().sum(-1).amax(-1)
            else:
                norm = torch.linalg.matrix_norm(jac, 2)
            assert bool((norm <= certified + slack).all())

    model.eval()
    z = model.transform_to_noise(x, mask)
    torch.testing.assert_close(model.inverse(z, mask), x, **_tolerance(dtype, solves=True))


# ------------------------------------------------------------------------------------------------
# sample: counts, lengths and temperatures


@HYPOTHESIS
@given(num=st.integers(-3, 0))
def test_sample_rejects_non_positive_num(model, num):
    with pytest.raises(ValueError, match=r"\bnum\b"):
        model.sample(num, seq_len=2)


@pytest.mark.parametrize("num", [2.0, True, "2", torch.tensor(2), np.int64(2)])
def test_sample_rejects_non_int_num(model, num):
    with pytest.raises(TypeError, match=r"\bnum\b"):
        model.sample(num, seq_len=2)


@HYPOTHESIS
@given(
    lengths=st.lists(st.integers(-3, MAX_LEN + 2), min_size=1, max_size=3),
    int_dtype=st.sampled_from([torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]),
)
def test_sample_lengths_are_honoured_or_rejected(model, device, lengths, int_dtype):
    if int_dtype == torch.uint8 and min(lengths) < 0:
        int_dtype = torch.int16
    tensor = torch.tensor(lengths, dtype=int_dtype)
    if all(1 <= n <= MAX_LEN for n in lengths):
        x, mask = model.sample(len(lengths), lengths=tensor,
                               generator=_seeded(device))
        assert mask.sum(1).tolist() == lengths
        assert x.shape == (len(lengths), max(lengths), FEATURES)
        assert bool(torch.isfinite(x).all()) and bool((x[~mask] == 0).all())
    else:
        with pytest.raises(ValueError, match=r"\blengths\b"):
            model.sample(len(lengths), lengths=tensor)


@pytest.mark.parametrize("lengths", [
    torch.tensor([1.0, 2.0]), torch.tensor([True, True]), [1, 2], np.array([1, 2]),
    torch.tensor([1 + 0j, 2 + 0j]),
], ids=["float", "bool", "list", "numpy", "complex"])
def test_sample_rejects_non_integer_lengths(model, lengths):
    with pytest.raises(TypeError, match=r"\blengths\b"):
        model.sample(2, lengths=lengths)


@pytest.mark.parametrize(("kwargs", "pattern"), [
    ({"seq_len": 0}, r"\bseq_len\b"), ({"seq_len": -1}, r"\bseq_len\b"),
    ({"seq_len": MAX_LEN + 1}, r"max_len"), ({}, r"seq_len and lengths"),
    ({"seq_len": 2, "lengths": torch.tensor([1, 2])}, r"seq_len and lengths"),
    ({"lengths": torch.tensor([[1, 2]])}, r"\blengths\b.*shape"),
    ({"seq_len": 2, "temperature": 0.0}, r"\btemperature\b"),
    ({"seq_len": 2, "temperature": -1.0}, r"\btemperature\b"),
    ({"seq_len": 2, "temperature": math.nan}, r"\btemperature\b"),
    ({"seq_len": 2, "temperature": math.inf}, r"\btemperature\b"),
])
def test_sample_rejects_bad_options(model, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        model.sample(2, **kwargs)


def test_sample_rejects_bad_generator(model):
    with pytest.raises(TypeError, match=r"\bgenerator\b"):
        model.sample(2, seq_len=2, generator=0)


def test_lengths_beyond_the_learned_table_are_rejected(model):
    calls = [
        lambda: model.lipschitz_report(MAX_LEN + 1),
        lambda: model.sample(1, seq_len=MAX_LEN + 1),
        lambda: model.sample(1, lengths=torch.tensor([MAX_LEN + 1])),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=rf"max_len={MAX_LEN}"):
            call()


def test_learned_positional_branch_rejects_long_sequences(device, dtype):
    branch = PositionalBranch(ContractiveL2MultiheadAttention(FEATURES, HEADS),
                              LearnedPositionalEncoding(FEATURES, max_len=2))
    block = ResidualTransform(branch.to(device=device, dtype=dtype), logdet="exact")
    x = torch.randn(1, 3, FEATURES, device=device, dtype=dtype)
    for call in (block, block.inverse):
        with pytest.raises(ValueError, match=r"max_len=2"):
            call(x)


# ------------------------------------------------------------------------------------------------
# other arguments of the entry points


@pytest.mark.parametrize("estimator", [ExactLogDet(), SeriesLogDet(), RouletteLogDet()],
                         ids=lambda e: type(e).__name__)
def test_estimators_reject_non_branches(estimator):
    with pytest.raises(TypeError, match=r"\bbranch\b"):
        estimator(lambda x, mask=None: 0.5 * x, torch.zeros(1, 2, FEATURES))


def test_transforms_reject_context(device, dtype):
    residual = ResidualTransform(LipschitzMLP((FEATURES, 4, FEATURES)), logdet="exact")
    residual = residual.to(device=device, dtype=dtype).eval()
    composite = SequenceCompositeTransform([residual])
    x = torch.randn(2, 3, FEATURES, device=device, dtype=dtype)
    context = torch.zeros(2, 1, device=device, dtype=dtype)
    for call in (residual, residual.inverse, composite, composite.inverse):
        with pytest.raises(ValueError, match=r"\bcontext\b"):
            call(x, context)


@pytest.mark.parametrize(("kwargs", "error", "pattern"), [
    ({"g": 3}, TypeError, r"\bg\b"),
    ({"args": [torch.ones(2, 3, dtype=torch.bool)]}, TypeError, r"\bargs\b"),
    ({"tol": -1.0}, ValueError, r"\btol\b"), ({"tol": math.nan}, ValueError, r"\btol\b"),
    ({"max_iter": 0}, ValueError, r"\bmax_iter\b"), ({"solver": "newton"}, ValueError, r"solver"),
    ({"x0": torch.zeros(1, 3, FEATURES)}, ValueError, r"\bx0\b"),
    ({"x0": torch.full((2, 3, FEATURES), math.nan)}, ValueError, r"\bx0\b"),
])
def test_fixed_point_inverse_rejects_bad_options(kwargs, error, pattern):
    options = {"g": lambda t: 0.5 * torch.sin(t), "y": torch.zeros(2, 3, FEATURES)} | kwargs
    with pytest.raises(error, match=pattern):
        fixed_point_inverse(options.pop("g"), options.pop("y"), **options)


# ------------------------------------------------------------------------------------------------
# load_dataset: user files and options


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory):
    return tmp_path_factory.mktemp("hostile_npz")


def _write(folder, name: str, **arrays: Any) -> str:
    path = folder / name
    np.savez(path, **arrays)
    return str(path)


@HYPOTHESIS
@given(
    lengths=st.lists(st.integers(-1, 4), min_size=6, max_size=8),
    nan_at=st.none() | st.tuples(st.integers(0, 7), st.integers(0, 2)),
    seed=st.integers(0, 2**16),
)
def test_load_dataset_honours_or_rejects_user_lengths(files, lengths, nan_at, seed):
    length = 3
    x = np.random.default_rng(seed).standard_normal((len(lengths), length, 2))
    nan_is_real = False
    if nan_at is not None and nan_at[0] < len(lengths):
        x[nan_at] = np.nan
        nan_is_real = nan_at[1] < lengths[nan_at[0]]
    path = _write(files, f"lengths_{seed}.npz", x=x, lengths=np.array(lengths))
    if not all(1 <= n <= length for n in lengths):
        with pytest.raises(ValueError, match=r"\blengths\b"):
            load_dataset(path)
    elif nan_is_real:
        with pytest.raises(ValueError, match=r"NaN or Inf"):
            load_dataset(path)
    else:  # NaN at padding is documented to be ignored
        ds = load_dataset(path)
        splits = (ds.train, ds.val, ds.test)
        got = torch.cat([s.mask.sum(1) for s in splits]).sort().values
        assert got.tolist() == sorted(lengths)
        for s in splits:
            assert bool(torch.isfinite(s.x).all()) and bool((s.x[~s.mask] == 0).all())


def test_load_dataset_reads_non_contiguous_arrays_like_contiguous_ones(files):
    x = np.random.default_rng(0).standard_normal((8, 3, 2))
    c_order = load_dataset(_write(files, "c.npz", x=np.ascontiguousarray(x)))
    f_order = load_dataset(_write(files, "f.npz", x=np.asfortranarray(x)))
    for a, b in zip((c_order.train, c_order.test), (f_order.train, f_order.test), strict=True):
        torch.testing.assert_close(a.x, b.x, rtol=0, atol=0)


@pytest.mark.parametrize(("arrays", "pattern"), [
    ({"x": np.zeros((8, 3))}, r"shape \(B, N, D\)"),
    ({"x": np.zeros((1, 8, 3, 2))}, r"shape \(B, N, D\)"),
    ({"x": np.zeros((0, 3, 2))}, r"empty"),
    ({"x": np.zeros((8, 0, 2))}, r"empty"),
    ({"x": np.zeros((8, 3, 2), dtype=bool)}, r"real numbers"),
    ({"x": np.zeros((8, 3, 2), dtype=complex)}, r"real numbers"),
    ({"x": np.full((8, 3, 2), np.inf)}, r"NaN or Inf"),
    ({"x": np.ones((8, 3, 2)), "lengths": np.full(8, 2.0)}, r"\blengths\b"),
    ({"x": np.ones((8, 3, 2)), "lengths": np.full(7, 2)}, r"\blengths\b"),
    ({"x": np.random.default_rng(0).standard_normal((3, 3, 2))}, r"too few"),
    ({"y": np.ones((8, 3, 2))}, r"missing array 'x'"),
], ids=["rank2", "rank4", "empty_batch", "zero_length", "bool", "complex", "inf",
        "float_lengths", "short_lengths", "too_few", "no_x"])
def test_load_dataset_rejects_malformed_files(files, arrays, pattern):
    path = _write(files, "bad.npz", **arrays)
    with pytest.raises(ValueError, match=pattern):
        load_dataset(path)


def test_load_dataset_rejects_files_that_are_not_archives(files):
    path = files / "text.npz"
    path.write_text("not an archive")
    with pytest.raises(ValueError, match=r"\.npz"):
        load_dataset(str(path))
    with pytest.raises(FileNotFoundError):
        load_dataset(str(files / "missing.npz"))


@pytest.mark.parametrize(("kwargs", "error", "pattern"), [
    ({"name": None}, TypeError, r"\bname\b"), ({"name": 3}, TypeError, r"\bname\b"),
    ({"name": "no_such_dataset"}, ValueError, r"unknown dataset"),
    ({"name": "npz"}, ValueError, r"\bpath\b"),
    ({"name": "japanese_vowels", "path": "x.npz"}, ValueError, r"\bpath\b"),
    ({"name": "japanese_vowels", "seed": 1.5}, TypeError, r"\bseed\b"),
    ({"name": "japanese_vowels", "val_fraction": True}, TypeError, r"\bval_fraction\b"),
    ({"name": "japanese_vowels", "val_fraction": "0.1"}, TypeError, r"\bval_fraction\b"),
    ({"name": "japanese_vowels", "val_fraction": 0.0}, ValueError, r"\bval_fraction\b"),
    ({"name": "japanese_vowels", "val_fraction": 1.0}, ValueError, r"\bval_fraction\b"),
    ({"name": "japanese_vowels", "val_fraction": math.nan}, ValueError, r"\bval_fraction\b"),
])
def test_load_dataset_rejects_bad_options(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        load_dataset(**kwargs)
