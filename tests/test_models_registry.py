"""Registries of the residual layer kinds and the base densities: a kind defined outside the
package is one class and one registration (docs/math.md#change-of-variables for the oracle)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats
from torch import Tensor
from torch.nn import functional as F

from iresflow.cli import build_parser
from iresflow.models.config import LAYER_KINDS, ConfigError, ModelConfig
from iresflow.models.distributions import (
    BASES,
    SequenceBase,
    StandardNormalSequence,
    make_base,
    register_base,
)
from iresflow.models.registry import LAYERS, Registry, register_branch, register_step
from iresflow.models.residual_flow import ResidualSequenceFlow
from iresflow.nn.conditional import ConditionalBranch
from tests.oracles import MixingBranch, jacobian_logdet

F64 = torch.float64


# -- a new branch kind and a new base, as a user would write them ----------------------------


class SoftMixingBranch(MixingBranch):
    """The position-mixing reference branch, with the feature size a conditional wrapper needs."""

    @property
    def features(self) -> int:
        return self.w.shape[0]


def soft_mixing(config: ModelConfig, encoding: torch.nn.Module | None) -> SoftMixingBranch:
    return SoftMixingBranch(config.features, config.coeff, max_len=config.max_len)


class LogisticSequence(SequenceBase):
    """Independent standard logistic coordinates on the real frames."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.features = features

    def log_prob(self, z: Tensor, mask: Tensor | None = None, context: Tensor | None = None
                 ) -> Tensor:
        per_frame = (-z - 2 * F.softplus(-z)).sum(-1)
        return (per_frame if mask is None else torch.where(mask, per_frame, 0.0)).sum(-1)

    def sample(self, mask: Tensor, generator: torch.Generator | None = None,
               temperature: float = 1.0, *, context: Tensor | None = None,
               dtype: torch.dtype | None = None) -> Tensor:
        u = torch.rand(*mask.shape, self.features, generator=generator, device=mask.device,
                       dtype=dtype)
        return torch.where(mask.unsqueeze(-1), temperature * (u.log() - (-u).log1p()), 0.0)


@pytest.fixture
def registered() -> Iterator[None]:
    register_branch("soft-mixing", soft_mixing, "a learned softmax average of the frames")
    register_base("logistic", LogisticSequence, "independent logistic coordinates")
    try:
        yield
    finally:
        LAYERS.unregister("soft-mixing")
        BASES.unregister("logistic")


def _logistic_log_prob(z: Tensor, mask: Tensor) -> np.ndarray:
    per_frame = stats.logistic.logpdf(z.detach().cpu().numpy()).sum(-1)
    return (per_frame * mask.cpu().numpy()).sum(-1)


@pytest.mark.parametrize("conditional", [False, True])
def test_a_registered_kind_and_base_build_an_exact_invertible_flow(registered, conditional,
                                                                   device):
    config = ModelConfig(features=3, max_len=5, n_blocks=2, hidden=8, ar_order=1,
                         layers=("soft-mixing", "mix", "mlp"), base="logistic",
                         num_classes=2 if conditional else 0)
    model = ResidualSequenceFlow(config).to(device=device, dtype=F64)
    steps = dict(model.residual_steps())
    assert set(steps) == {"block0.soft-mixing", "block0.mlp", "block1.soft-mixing", "block1.mlp"}
    branch = steps["block1.soft-mixing"].branch
    if conditional:  # the wrapping is the model's, not the builder's
        assert isinstance(branch, ConditionalBranch)
        branch = branch.branch
    assert type(branch) is SoftMixingBranch and isinstance(model.base, LogisticSequence)

    x = 1.5 * torch.randn(4, 5, 3, device=device, dtype=F64) + 0.2
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2, [True, False, True, True, True],
                         [True] * 4 + [False]], device=device)
    context = {"context": torch.tensor([0, 1, 1, 0], device=device)} if conditional else {}
    model.initialize(x, mask, **context)
    model.eval()
    if conditional:
        with torch.no_grad():  # a non-trivial context shift in every step
            for name, p in model.named_parameters():
                if "context_net" in name or "embedding" in name:
                    p.copy_(0.3 * torch.randn_like(p))

    def chain(t: Tensor, m: Tensor | None, b: int) -> Tensor:
        c = {"context": context["context"][b : b + 1]} if conditional else {}
        return model.transform_to_noise(t, m, **c)

    log_prob = model.log_prob(x, mask, method="exact", **context)
    z = model.transform_to_noise(x, mask, **context)
    logdet = torch.cat([jacobian_logdet(lambda t, m, b=b: chain(t, m, b), x[b : b + 1],
                                        mask[b : b + 1]) for b in range(4)])
    expected = logdet.cpu().numpy() + _logistic_log_prob(z, mask)
    np.testing.assert_allclose(log_prob.detach().cpu().numpy(), expected, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(model.inverse(z, mask, **context), x, atol=1e-8, rtol=0)
    sample_context = {"context": context["context"][:2]} if conditional else {}
    sample, sample_mask = model.sample(2, seq_len=4, generator=torch.Generator(device)
                                       .manual_seed(0), **sample_context)
    assert sample.shape == (2, 4, 3) and bool(torch.isfinite(sample).all())


def test_registered_names_validate_and_reach_the_command_line(registered, capsys):
    assert "soft-mixing" in LAYER_KINDS and "logistic" in BASES.choices
    assert ModelConfig(layers=("soft-mixing", "mix"), base="logistic").base == "logistic"
    assert isinstance(make_base("logistic", 2), LogisticSequence)
    assert build_parser().parse_args(["train", "--base", "logistic"]).base == "logistic"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    assert "logistic" in capsys.readouterr().out


def test_an_unregistered_name_is_refused_again():
    register_branch("soft-mixing", soft_mixing, "a learned softmax average of the frames")
    register_base("logistic", LogisticSequence, "independent logistic coordinates")
    LAYERS.unregister("soft-mixing")
    BASES.unregister("logistic")
    assert "soft-mixing" not in LAYER_KINDS and "logistic" not in BASES.choices
    with pytest.raises(ConfigError, match="layers must be one of attention, relative, conv, mlp"):
        ModelConfig(layers=("soft-mixing",))
    with pytest.raises(ConfigError, match="base must be one of normal, student-t"):
        ModelConfig(base="logistic")
    with pytest.raises(ValueError, match="base must be one of"):
        make_base("logistic", 2)
    with pytest.raises(ValueError, match="no layer kind 'soft-mixing'"):
        LAYERS.unregister("soft-mixing")


def test_the_built_in_kinds_are_registered_entries():
    assert tuple(LAYER_KINDS) == ("attention", "relative", "conv", "mlp", "mix", "autoregressive",
                                  "maf")
    assert tuple(BASES.choices) == ("normal", "student-t", "multivariate-t", "sequence-t")
    assert all(LAYERS[kind].help for kind in LAYERS)
    assert all(BASES[name].help for name in BASES)
    assert [kind for kind in LAYERS if LAYERS[kind].positional] == ["attention"]
    assert [kind for kind in LAYERS if not LAYERS[kind].residual] == ["mix", "autoregressive",
                                                                        "maf"]
    assert [kind for kind in LAYERS if LAYERS[kind].per_block] == ["conv", "maf"]
    assert BASES["normal"].build is StandardNormalSequence
    assert [make_base(name, 2).group for name in ("student-t", "multivariate-t", "sequence-t")
            ] == ["feature", "frame", "sequence"]
    with pytest.raises(ValueError, match="layer kind 'mix' is already registered"):
        register_step("mix", soft_mixing, "a second mixing")


def test_the_built_in_kinds_are_there_whichever_module_is_imported_first():
    # The built-in layer kinds register when iresflow.models.branches is imported, which the
    # package does before any of its modules can be used.
    code = ("from iresflow.models.config import ModelConfig, LAYER_KINDS; "
            "ModelConfig(layers=('attention', 'relative', 'conv', 'mlp', 'mix')); "
            "print(','.join(LAYER_KINDS))")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": str(root)})
    assert out.stdout.strip() == "attention,relative,conv,mlp,mix,autoregressive,maf"


@pytest.mark.parametrize(
    "register,name,error,match",
    [
        (register_branch, "mlp", ValueError, "already registered"),
        (register_branch, "mix", ValueError, "already registered"),
        (register_base, "normal", ValueError, "already registered"),
        (register_branch, "Soft", ValueError, "lower-case"),
        (register_branch, "a,b", ValueError, "lower-case"),
        (register_branch, "a.b", ValueError, "lower-case"),
        (register_base, "", ValueError, "lower-case"),
        (register_base, "2t", ValueError, "lower-case"),
        (register_base, "t base", ValueError, "lower-case"),
        (register_branch, 3, TypeError, "name must be a str"),
    ],
)
def test_register_rejects_duplicate_and_malformed_names(register, name, error, match):
    before = (tuple(LAYER_KINDS), tuple(BASES.choices))
    build = soft_mixing if register is register_branch else LogisticSequence
    with pytest.raises(error, match=match):
        register(name, build, "a kind")
    assert (tuple(LAYER_KINDS), tuple(BASES.choices)) == before


@pytest.mark.parametrize("register", [register_branch, register_base])
def test_register_rejects_bad_builders_and_help(register):
    with pytest.raises(TypeError, match="build must be callable"):
        register("fresh", "not callable", "a kind")
    with pytest.raises(TypeError, match="help must be a str"):
        register("fresh", LogisticSequence, None)
    with pytest.raises(ValueError, match="help must say"):
        register("fresh", LogisticSequence, "  ")
    assert "fresh" not in LAYER_KINDS and "fresh" not in BASES.choices


def test_registry_choices_are_a_live_sequence():
    colours = Registry("colour")
    choices = colours.choices
    assert tuple(choices) == () and len(choices) == 0
    colours.register("red", 1)
    colours.register("blue", 2)
    assert tuple(choices) == ("red", "blue") and choices[1] == "blue"
    assert choices[-1:] == ("blue",) and "red" in choices and "green" not in choices
    assert dict(colours) == {"red": 1, "blue": 2} and repr(choices) == "('red', 'blue')"
    with pytest.raises(ValueError, match="colour 'red' is already registered"):
        colours.register("red", 3)


def test_a_kind_registered_per_block_is_told_its_block():
    """``per_block=True``: ``build`` receives ``block=i``, 0 nearest the data; other kinds
    are built as ``build(config, encoding)``."""
    seen: list[int] = []

    def by_block(config: ModelConfig, encoding: torch.nn.Module | None, *, block: int
                 ) -> SoftMixingBranch:
        seen.append(block)
        return soft_mixing(config, encoding)

    register_branch("by-block", by_block, "soft mixing, told its block", per_block=True)
    register_branch("soft-mixing", soft_mixing, "a learned softmax average of the frames")
    try:
        ResidualSequenceFlow(features=2, max_len=4, n_blocks=3,
                             layers=("by-block", "soft-mixing", "by-block"))
    finally:
        LAYERS.unregister("by-block")
        LAYERS.unregister("soft-mixing")
    assert seen == [0, 0, 1, 1, 2, 2]
