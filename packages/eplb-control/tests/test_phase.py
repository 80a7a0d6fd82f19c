from __future__ import annotations

import pytest

from ascend_eplb.control.phase import LOAD_COLLECTION_PHASES, is_phase_matched, validate_phase


@pytest.mark.parametrize(
    ("phase", "batch_has_prefill", "matched"),
    [
        ("all", True, True),
        ("all", False, True),
        ("prefill", True, True),  # a mixed batch has prefill work: it is a prefill batch
        ("prefill", False, False),
        ("decode", True, False),
        ("decode", False, True),
    ],
)
def test_phase_truth_table(phase, batch_has_prefill, matched):
    assert is_phase_matched(phase, batch_has_prefill) is matched


def test_allowed_phases_in_order():
    assert LOAD_COLLECTION_PHASES == ("all", "prefill", "decode")


@pytest.mark.parametrize("bad", ["mixed", "Decode", "", None, 1])
def test_unknown_phase_lists_the_allowed_ones(bad):
    with pytest.raises(ValueError, match=r"allowed phases: 'all', 'prefill', 'decode'") as info:
        is_phase_matched(bad, True)
    assert repr(bad) in str(info.value)
    with pytest.raises(ValueError, match="allowed phases"):
        validate_phase(bad)


def test_batch_phase_must_be_a_bool():
    with pytest.raises(ValueError, match=r"batch_has_prefill=1 must be a bool"):
        is_phase_matched("decode", 1)
