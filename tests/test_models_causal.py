"""A causal flow (model setting ``causal``): every step causal over frames
(docs/math.md#causal-steps)."""

from __future__ import annotations

import pytest
import torch

from iresflow.models.config import ModelConfig
from iresflow.models.residual_flow import ResidualSequenceFlow
from tests.oracles import jacobian, jacobian_logdet

LENGTH, FEATURES = 6, 2


def _causal_model(device, dtype, **settings) -> ResidualSequenceFlow:
    """The default recipe (AR(3) input layer, blocks of conv and mlp, sequence-t base) with
    ``causal = true``, initialised on data and moved away from its initial identity steps."""
    options = {"n_blocks": 2, "hidden": 8, "max_len": LENGTH, "causal": True} | settings
    model = ResidualSequenceFlow(features=FEATURES, **options).to(device=device, dtype=dtype)
    data = torch.randn(8, LENGTH, FEATURES, device=device, dtype=dtype) * 1.7 + 0.3
    context = {"context": torch.arange(8, device=device) % 2} if model.config.num_classes else {}
    model.initialize(data, **context)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def _batch(device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(3, LENGTH, FEATURES, device=device, dtype=dtype) * 1.5 + 0.2
    mask = torch.ones(3, LENGTH, dtype=torch.bool, device=device)
    mask[1, 4:] = False  # end padding
    mask[2, 2] = False  # a gap
    return x, mask


def test_causal_is_off_by_default_and_builds_causal_convolutions():
    assert ModelConfig().causal is False
    model = ResidualSequenceFlow(features=FEATURES, max_len=LENGTH, n_blocks=1, causal=True)
    steps = dict(model.transform.named_steps())
    assert steps["block0.conv"].branch.causal and not steps["block0.mlp"].branch.causal
    plain = ResidualSequenceFlow(features=FEATURES, max_len=LENGTH, n_blocks=1)
    assert not dict(plain.transform.named_steps())["block0.conv"].branch.causal


@pytest.mark.parametrize("layers", [("conv", "mlp"), ("attention", "relative", "mlp")])
@pytest.mark.parametrize("conditional", [False, True])
def test_whole_flow_jacobian_is_block_lower_triangular_and_exact(device, dtype, conditional,
                                                                 layers):
    """The exact log-density (diagonal blocks) equals the base density plus the dense-Jacobian
    log-det of the whole flow, with padding and a gap; the Jacobian is zero above its diagonal
    blocks."""
    model = _causal_model(device, dtype, num_classes=2 if conditional else 0, layers=layers,
                          relative_window=3)
    x, mask = _batch(device, dtype)
    context = torch.tensor([0, 1, 1], device=device)

    def chain(b: int):
        c = {"context": context[b : b + 1]} if conditional else {}
        return lambda t, m: model.transform_to_noise(t, m, **c)

    c = {"context": context} if conditional else {}
    tol = 1e-10 if dtype == torch.float64 else 1e-3
    for m in (mask, None):
        z = model.transform_to_noise(x, m, **c)
        logdet = []
        for b in range(3):
            mb = None if m is None else m[b : b + 1]
            full = jacobian(chain(b), x[b : b + 1], mb).reshape(LENGTH, FEATURES, LENGTH, FEATURES)
            for t in range(LENGTH - 1):
                assert (full[t, :, t + 1 :] == 0).all()
            logdet.append(jacobian_logdet(chain(b), x[b : b + 1], mb))
        base = model.base.log_prob(z, m, model.context_encoder(context) if conditional else None)
        torch.testing.assert_close(model.log_prob(x, m, method="exact", **c),
                                   base + torch.cat(logdet), atol=tol, rtol=tol)


@pytest.mark.parametrize("layers", [("conv", "mlp"), ("attention", "relative", "mlp")])
def test_a_prefix_of_the_noise_depends_on_the_prefix_of_the_data_only(device, dtype, layers):
    model = _causal_model(device, dtype, layers=layers, relative_window=3)
    x, mask = _batch(device, dtype)
    z = model.transform_to_noise(x, mask)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for t in range(1, LENGTH + 1):
        prefix = model.transform_to_noise(x[:, :t], mask[:, :t])
        torch.testing.assert_close(prefix, z[:, :t], atol=tol, rtol=0)
    later = x.clone()
    later[:, 3:] = 100 * torch.randn_like(later[:, 3:])  # the future does not move the past
    torch.testing.assert_close(model.transform_to_noise(later, mask)[:, :3], z[:, :3],
                               atol=tol, rtol=0)
