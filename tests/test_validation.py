"""The validation gate: structural checks, one fused value check, and the value-check switch."""

from __future__ import annotations

import math

import pytest
import torch
from oracles import count_host_reads

from iresflow._validation import (
    check_finite,
    check_inputs,
    check_mask,
    check_sequence,
    value_checks,
    values_checked,
)


def _mask(lengths: list[int], n: int) -> torch.Tensor:
    return torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]


def test_check_inputs_reads_the_host_once():
    x = torch.randn(3, 4, 2)
    mask = _mask([4, 1, 2], 4)
    reads = count_host_reads(lambda: check_inputs(x, mask, "x", features=2))
    assert sum(reads.values()) == 1
    # The separate checks read once each.
    assert sum(count_host_reads(lambda: check_mask(mask, check_sequence(x))).values()) == 2


@pytest.mark.parametrize(("kind", "error", "pattern"), [
    ("nan", ValueError, r"\bx\b contains NaN"),
    ("inf", ValueError, r"\bx\b contains NaN or Inf"),
    ("padding", ValueError, r"\bmask\b has a sequence with no real token"),
    ("mask_dtype", TypeError, r"\bmask\b must have dtype torch.bool"),
    ("mask_shape", ValueError, r"\bmask\b must have shape"),
    ("features", ValueError, r"\bx\b must have 2 features"),
    ("rank", ValueError, r"\bx\b must have shape \(B, N, D\)"),
    ("like", TypeError, r"\bx\b must have the dtype and device"),
])
def test_check_inputs_names_the_problem(kind, error, pattern):
    x, mask = torch.randn(3, 4, 2), _mask([4, 1, 2], 4)
    like = None
    if kind in ("nan", "inf"):
        x[1, 0, 1] = math.nan if kind == "nan" else math.inf
    elif kind == "padding":
        mask = _mask([4, 0, 2], 4)
    elif kind == "mask_dtype":
        mask = mask.float()
    elif kind == "mask_shape":
        mask = mask[:, :3]
    elif kind == "features":
        x = torch.randn(3, 4, 3)
    elif kind == "rank":
        x, mask = x[:, 0], None
    else:
        like = torch.zeros(1, dtype=torch.float64)
    with pytest.raises(error, match=pattern):
        check_inputs(x, mask, "x", features=2, allow_2d=kind != "rank", like=like)


def test_value_checks_switch_off_value_checks_only():
    x = torch.full((2, 3, 2), math.nan)
    mask = _mask([3, 0], 3)
    with value_checks(False):
        assert not values_checked(x)
        assert check_inputs(x, mask)[0] is x and check_finite(x, "x") is x
        assert not count_host_reads(lambda: check_inputs(x, mask))
        with pytest.raises(ValueError, match="features"):  # shapes are still checked
            check_inputs(x, mask, features=3)
        with value_checks(True):
            with pytest.raises(ValueError, match="NaN"):
                check_inputs(x, mask)
        assert not values_checked(x)
    assert values_checked(x)
    with pytest.raises(ValueError, match="NaN"):
        check_finite(x, "x")
    with pytest.raises(TypeError, match="enabled"):
        with value_checks(0):  # type: ignore[arg-type]
            pass


def test_values_are_not_read_under_torch_func_or_on_meta_tensors():
    x = torch.randn(3, 4, 2)
    seen = torch.func.vmap(lambda t: torch.tensor(values_checked(t)))(x)
    assert not bool(seen.any())
    assert not values_checked(torch.empty(2, 3, 2, device="meta"))
    jac = torch.func.jacrev(lambda t: check_inputs(t, _mask([4, 2, 1], 4))[0].sin())(x)
    assert jac.shape == (3, 4, 2, 3, 4, 2)
