"""The load estimate on hand-made window sequences: a steady load pools, a shift is followed within one
window, the test's level and dispersion, and the same evidence gives the same estimate bit for bit."""

from __future__ import annotations

import pytest
import torch

from ascend_eplb.control.estimate import DISPERSION_HISTORY, FALSE_ALARM, LoadEstimate

#: Two layers of 4 experts: layer 0 steady around shares 1:2:3:4, layer 1 around 4:3:2:1.
STEADY = [
    [[10, 20, 30, 40], [40, 30, 20, 10]],
    [[12, 18, 33, 37], [38, 31, 22, 9]],
    [[9, 21, 29, 41], [41, 29, 19, 11]],
    [[11, 19, 31, 39], [39, 30, 21, 10]],
]


def _fed(windows) -> LoadEstimate:
    estimate = LoadEstimate()
    for window in windows:
        estimate.update(torch.tensor(window))
    return estimate


def test_a_steady_load_pools_every_window_token_weighted():
    estimate = _fed(STEADY)
    assert estimate.windows == 4
    assert estimate.restarted.tolist() == [False, False]
    pooled = torch.tensor(STEADY, dtype=torch.float64).sum(dim=0)  # (2, 4): 42 88 123 157 / 158 120 82 40
    # The expected load of a window as large as the latest (100 selections per layer): the pooled shares.
    assert torch.equal(estimate.load, pooled / pooled.sum(dim=1, keepdim=True) * 100)
    # It converges: the pooled shares are within 0.01 of 1:2:3:4 where one window is 0.03 off.
    truth = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]], dtype=torch.float64)
    assert (estimate.load / 100 - truth).abs().max() < 0.01
    assert (torch.tensor(STEADY[1]) / 100 - truth).abs().max() == pytest.approx(0.03)


def test_a_shift_is_followed_within_one_window_and_only_where_it_happened():
    # Layer 0's routing turns around (4:3:2:1), layer 1's stays: layer 0 restarts from the new window.
    shifted = [[40, 30, 20, 10], [40, 30, 20, 10]]
    estimate = _fed([*STEADY, shifted])
    assert estimate.restarted.tolist() == [True, False]
    assert estimate.load[0].tolist() == [40.0, 30.0, 20.0, 10.0]
    pooled = torch.tensor([*[w[1] for w in STEADY], shifted[1]], dtype=torch.float64).sum(dim=0)
    assert torch.equal(estimate.load[1], pooled / pooled.sum() * 100)
    # The next steady window of the new routing pools with it.
    estimate.update(torch.tensor([[42, 29, 19, 10], [40, 30, 20, 10]]))
    assert estimate.restarted.tolist() == [False, False]
    assert estimate.load[0].tolist() == [41.0, 29.5, 19.5, 10.0]


def test_the_test_restarts_exactly_where_the_p_value_falls_below_the_level_over_the_layers():
    # One layer of two experts, first comparison (dispersion 1): pooled 500/500 against a new window of
    # 100; Pearson's X^2 of the 2 x 2 table against chi-square(1) at 1e-3: restart above 10.83.
    assert FALSE_ALARM == 1e-3

    def restarted(heads: int) -> bool:
        estimate = _fed([[[500, 500]], [[heads, 100 - heads]]])
        return bool(estimate.restarted[0])

    # heads = 67: X^2 = 10.52 (p = 1.18e-3) is noise; heads = 68: X^2 = 11.79 (p = 5.9e-4) is a shift.
    assert (restarted(67), restarted(68)) == (False, True)
    # Two layers split the level: 5e-4 each, so 68 heads is noise there, 69 (p = 2.9e-4) a shift.
    estimate = _fed([[[500, 500], [500, 500]], [[68, 32], [69, 31]]])
    assert estimate.restarted.tolist() == [False, True]


def test_the_dispersion_is_the_median_of_the_last_comparisons_and_a_noisier_layer_restarts_less():
    # A layer whose windows scatter three times as much as a multinomial's: X^2 / df of each comparison.
    windows = [[[300, 300]], [[330, 270]], [[285, 315]], [[330, 270]], [[270, 330]]]
    estimate = LoadEstimate()
    ratios = []
    for window in windows:
        if estimate.load is not None:
            pooled = estimate._pooled[0]
            new = torch.tensor(window[0], dtype=torch.float64).numpy()
            total = pooled + new
            share = total / total.sum()
            expected_pooled, expected_new = pooled.sum() * share, new.sum() * share
            ratios.append(
                float(((pooled - expected_pooled) ** 2 / expected_pooled).sum())
                + float(((new - expected_new) ** 2 / expected_new).sum())
            )
        estimate.update(torch.tensor(window))
    assert estimate.restarted.tolist() == [False]
    # The last comparison was judged with the median of the three before it (X^2 / 1 degree of freedom).
    assert estimate.dispersion.tolist() == [sorted(ratios[:3])[1]]
    assert estimate.dispersion[0] > 1
    assert len(estimate._ratios) == len(ratios) <= DISPERSION_HISTORY


def test_a_layer_without_new_selections_keeps_its_estimate_and_the_same_evidence_gives_the_same_bits():
    estimate = _fed(STEADY)
    before = estimate.load.clone()
    estimate.update(torch.tensor([[0, 0, 0, 0], [40, 30, 20, 10]]))
    assert estimate.restarted.tolist() == [False, False]
    assert torch.equal(estimate.load[0], before[0])
    # Bit-identical from the same evidence, whatever its integer dtype (every rank's is all-reduced).
    other = _fed([torch.tensor(w, dtype=torch.int32).tolist() for w in STEADY])
    assert torch.equal(_fed(STEADY).load, other.load)
    assert _fed([]).load is None


@pytest.mark.parametrize(
    ("selections", "message"),
    [
        (torch.ones(4), r"must be a 2-D \(L, E\) tensor of counts"),
        ([[1, 2]], r"must be a 2-D \(L, E\) tensor of counts"),
        (torch.tensor([[1.0, float("nan")]]), r"every count must be finite and >= 0"),
        (torch.tensor([[1, -1]]), r"every count must be finite and >= 0"),
        (torch.ones(3, 4), r"selections has shape \(3, 4\): this estimate is of shape \(2, 4\)"),
    ],
)
def test_bad_evidence_is_refused_before_anything_changes(selections, message):
    estimate = _fed(STEADY)
    before = estimate.load.clone()
    with pytest.raises(ValueError, match=message):
        estimate.update(selections)
    assert torch.equal(estimate.load, before)
    assert estimate.windows == 4
