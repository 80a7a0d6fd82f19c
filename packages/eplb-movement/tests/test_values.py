"""The package's one "an int but not a bool" rule, where a single process can reach it."""

from __future__ import annotations

import numpy as np
import pytest

from ascend_eplb.movement import StagingPool
from ascend_eplb.movement._values import is_int


def test_is_int_takes_integers_and_refuses_bools():
    assert [is_int(v) for v in (3, 0, -1, np.int64(5))] == [True] * 4
    assert [is_int(v) for v in (True, False, np.bool_(True), 3.0, "3", None)] == [False] * 6


@pytest.mark.parametrize("max_bytes", [True, 0, -1, 4096.0, "4096"])
def test_staging_pool_refuses_a_size_that_is_not_a_positive_int(max_bytes):
    with pytest.raises(
        ValueError, match=rf"max_bytes={max_bytes!r} must be a positive integer number of bytes"
    ):
        StagingPool(max_bytes=max_bytes)


def test_staging_pool_keeps_its_size_as_an_int():
    pool = StagingPool(max_bytes=np.int64(4096), pin_memory=False)
    assert pool.max_bytes == 4096
    assert type(pool.max_bytes) is int
