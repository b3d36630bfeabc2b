"""The closed-form AR(p) Gaussian reference and the per-sequence NLL summary, against oracles."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from iresflow.data.datasets import SequenceSplit
from iresflow.models.reference import AutoregressiveGaussian, history_lags
from iresflow.models.worst_cases import summarize_sequence_nll
from iresflow.transforms.temporal import AutoregressiveLinear

GAPPY = torch.tensor([
    [1, 1, 1, 1, 1, 1, 1],
    [1, 1, 0, 1, 1, 1, 0],
    [0, 1, 1, 1, 0, 0, 0],
    [1, 0, 1, 0, 1, 1, 1],
    [1, 1, 1, 1, 1, 0, 0],
    [1, 1, 1, 0, 1, 1, 1],
], dtype=torch.bool)


def _data(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Correlated random walks ``(batch, 7, 2)`` with the gap pattern of GAPPY repeated."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 7, 2, generator=g, dtype=torch.float64).cumsum(1)
    x = x @ torch.tensor([[1.0, 0.4], [0.0, 0.8]], dtype=torch.float64)
    return x, GAPPY.repeat(batch // len(GAPPY) + 1, 1)[:batch]


def _histories(mask_row: torch.Tensor, order: int) -> list[int]:
    """h(t) of every position by counting real frames backwards (an independent loop)."""
    out = []
    for t in range(len(mask_row)):
        h = 0
        while h < order and t - h - 1 >= 0 and bool(mask_row[t - h - 1]):
            h += 1
        out.append(h)
    return out


def _dense_log_prob(model: AutoregressiveGaussian, x: torch.Tensor, mask: torch.Tensor) -> float:
    """The joint Gaussian of a sequence's real frames built from the AR coefficients.

    Every real frame satisfies x_t - sum_k A_{h,k} x_{t-k} = b_h + e_t, e_t ~ N(0, S_h): with
    F the block lower-triangular matrix of these equations over the real frames,
    vec(x) ~ N(F^{-1} c, F^{-1} diag(S) F^{-T}).
    """
    p, d = model.order, model.features
    positions = [t for t in range(len(mask)) if bool(mask[t])]
    where = {t: i for i, t in enumerate(positions)}
    hist = _histories(mask, p)
    n = len(positions)
    f = torch.eye(n * d, dtype=torch.float64)
    c = torch.zeros(n * d, dtype=torch.float64)
    blocks = []
    for i, t in enumerate(positions):
        h = hist[t]
        for k in range(1, h + 1):
            a_hk = model.weight[h, (k - 1) * d : k * d].T  # (D_out, D_in)
            j = where[t - k]
            f[i * d : (i + 1) * d, j * d : (j + 1) * d] = -a_hk
        c[i * d : (i + 1) * d] = model.bias[h]
        blocks.append(model.scale_tril[h] @ model.scale_tril[h].T)
    f_inv = torch.linalg.inv(f)
    cov = f_inv @ torch.block_diag(*blocks) @ f_inv.T
    dist = torch.distributions.MultivariateNormal(f_inv @ c, covariance_matrix=cov)
    return float(dist.log_prob(x[mask].reshape(-1)))


def test_history_lags_match_a_backward_count() -> None:
    x, mask = _data(6, 0)
    for order in (0, 1, 2, 3):
        lags, h = history_lags(x, mask, order)
        assert lags.shape == (6, 7, 2 * order)
        for b in range(6):
            expected = _histories(mask[b], order)
            assert h[b].tolist() == expected
            for t in range(7):
                for k in range(1, order + 1):
                    block = lags[b, t, (k - 1) * 2 : k * 2]
                    want = x[b, t - k] if k <= expected[t] else torch.zeros(2, dtype=x.dtype)
                    assert torch.equal(block, want)


@pytest.mark.parametrize("order", [0, 1, 2])
def test_log_prob_is_the_dense_gaussian_of_the_real_frames(order: int) -> None:
    x, mask = _data(60, 1)
    model = AutoregressiveGaussian(2, max_len=7).fit(x, mask, order)
    test, test_mask = _data(6, 2)
    garbage = torch.where(test_mask[..., None], test, 1e4)  # padded values must not matter
    got = model.log_prob(garbage, test_mask)
    assert got.dtype == torch.float64
    expected = [_dense_log_prob(model, test[b], test_mask[b]) for b in range(6)]
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-10, atol=1e-10)


def test_fit_is_least_squares_on_the_frames_of_each_history_length() -> None:
    x, mask = _data(30, 3)
    model = AutoregressiveGaussian(2, max_len=7, ridge=0.0).fit(x, mask, order=2)
    for h in range(3):
        rows, targets = [], []
        for b in range(30):
            hist = _histories(mask[b], 2)
            for t in range(7):
                if bool(mask[b, t]) and hist[t] == h:
                    past = [x[b, t - k].numpy() for k in range(1, h + 1)]
                    rows.append(np.concatenate(past + [np.ones(1)]))
                    targets.append(x[b, t].numpy())
        design = np.array(rows)
        target = np.array(targets)
        solution = np.linalg.lstsq(design, target, rcond=None)[0]
        residual = target - design @ solution
        np.testing.assert_allclose(model.weight[h, : 2 * h].numpy(), solution[: 2 * h],
                                   rtol=1e-8, atol=1e-10)
        np.testing.assert_allclose(model.bias[h].numpy(), solution[2 * h], rtol=1e-8, atol=1e-10)
        np.testing.assert_allclose((model.scale_tril[h] @ model.scale_tril[h].T).numpy(),
                                   residual.T @ residual / len(target), rtol=1e-8)


def test_the_flows_ar_layer_initialised_on_the_same_data_is_the_same_density() -> None:
    """AutoregressiveLinear + standard normal, fitted at initialisation, is this model."""
    x, mask = _data(120, 4)
    model = AutoregressiveGaussian(2, max_len=7, ridge=0.0).fit(x, mask, order=2)
    layer = AutoregressiveLinear(2, order=2).double()
    layer.initialize(x, mask)
    layer.eval()
    test, test_mask = _data(12, 5)
    z, logdet = layer(test, mask=test_mask)
    base = torch.distributions.Normal(0.0, 1.0).log_prob(z).sum(-1)
    flow = (base * test_mask).sum(-1) + logdet
    torch.testing.assert_close(model.log_prob(test, test_mask), flow, rtol=1e-9, atol=1e-9)


def test_noise_is_the_standardised_innovation_and_samples_refit() -> None:
    x, mask = _data(40, 6)
    model = AutoregressiveGaussian(2, max_len=7).fit(x, mask, order=1)
    z = model.transform_to_noise(x, mask)
    assert torch.equal(z[~mask], x[~mask])
    log_det = model.scale_tril.diagonal(dim1=1, dim2=2).log().sum(-1)
    hist = torch.stack([torch.tensor(_histories(m, 1)) for m in mask])
    per_frame = torch.distributions.Normal(0.0, 1.0).log_prob(z).sum(-1) - log_det[hist]
    torch.testing.assert_close(model.log_prob(x, mask), (per_frame * mask).sum(-1))
    samples, sample_mask = model.sample(4000, seq_len=7,
                                        generator=torch.Generator().manual_seed(7))
    refit = AutoregressiveGaussian(2, max_len=7).fit(samples, sample_mask, order=1)
    torch.testing.assert_close(refit.weight, model.weight, atol=0.05, rtol=0)
    torch.testing.assert_close(refit.scale_tril, model.scale_tril, atol=0.05, rtol=0)


def test_order_selection_caps_the_order_at_the_longest_run_and_can_skip_the_refit() -> None:
    x = torch.randn(20, 6, 1, dtype=torch.float64).cumsum(1)
    short = (torch.arange(6) < 2).expand(10, 6)  # training runs of 2 frames: orders 0, 1 only
    train = SequenceSplit(x[:10] * short[..., None], short.clone(), torch.zeros(10))
    val = SequenceSplit(x[10:], torch.ones(10, 6, dtype=torch.bool), torch.zeros(10))
    model = AutoregressiveGaussian(1, max_len=6)
    val_nll = model.fit_selected_order(train, val, max_order=3, refit=False)
    assert len(val_nll) == 2
    best = min(range(2), key=val_nll.__getitem__)
    fitted_on_train = AutoregressiveGaussian(1, max_len=6).fit(train.x, train.mask, best)
    torch.testing.assert_close(model.weight, fitted_on_train.weight)
    torch.testing.assert_close(model.scale_tril, fitted_on_train.scale_tril)
    empty = SimpleNamespace(x=x[10:], mask=torch.zeros(10, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="val must hold"):
        model.fit_selected_order(train, empty)
    with pytest.raises(ValueError, match="share"):
        model.fit_selected_order(train, SequenceSplit(x[10:, :5], val.mask[:, :5],
                                                      torch.zeros(10)))


def test_bad_arguments_name_themselves() -> None:
    with pytest.raises(ValueError, match="ridge"):
        AutoregressiveGaussian(2, 5, ridge=-1.0)
    with pytest.raises(ValueError, match="features"):
        AutoregressiveGaussian(0, 5)
    model = AutoregressiveGaussian(2, 5)
    with pytest.raises(TypeError, match="order"):
        model.fit(torch.zeros(3, 5, 2), order=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="features|shape|D"):
        model.log_prob(torch.zeros(3, 5, 3))


def test_summary_quantiles_match_numpy_and_negative_nlls_work() -> None:
    g = torch.Generator().manual_seed(0)
    nll = -3.0 + 0.2 * torch.randn(200, generator=g, dtype=torch.float64)
    nll[17], nll[150] = 40.0, 2.0  # 2.0 is 5 nats above the median: far above (IQR ~ 0.27)
    summary = summarize_sequence_nll(nll)
    q1, median, q3 = np.percentile(nll.numpy(), [25, 50, 75])
    assert summary.median == pytest.approx(median, abs=1e-12)
    assert summary.iqr == pytest.approx(q3 - q1, abs=1e-12)
    assert summary.threshold == pytest.approx(median + max(10 * (q3 - q1), 1.0), abs=1e-12)
    assert (summary.worst, summary.worst_index) == (40.0, 17)
    assert summary.far_above == 2 and summary.far_above_indices == (17, 150)
    assert summary.sequences == 200 and summary.to_dict()["far_above_indices"] == [17, 150]


def test_summary_min_gap_protects_tight_distributions() -> None:
    nll = torch.tensor([1.0] * 9 + [1.5])  # IQR 0: only the absolute gap decides
    assert summarize_sequence_nll(nll).far_above == 0
    assert summarize_sequence_nll(nll, min_gap=0.25).far_above_indices == (9,)
    assert summarize_sequence_nll(torch.tensor([2.0])).far_above == 0


def test_summary_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="shape"):
        summarize_sequence_nll(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="shape"):
        summarize_sequence_nll(torch.zeros(0))
    with pytest.raises(ValueError, match="finite"):
        summarize_sequence_nll(torch.tensor([1.0, float("nan")]))
    with pytest.raises(TypeError, match="nll"):
        summarize_sequence_nll([1.0, 2.0])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="min_gap"):
        summarize_sequence_nll(torch.ones(3), min_gap=-1.0)
