"""The staging pool's rules, where a single process can reach them: reuse by ``(dtype, numel)``, the
least-recently-used eviction within ``max_bytes``, and refusals that change nothing."""

from __future__ import annotations

import re

import pytest
import torch

from ascend_eplb.movement import StagingPool, StagingPoolError
from ascend_eplb.movement.staging import StagingKey

F32, I8 = torch.float32, torch.int8


def _state(pool: StagingPool) -> tuple[dict[StagingKey, int], int, int]:
    return pool.buffer_counts(), pool.size_bytes, pool.num_allocations


def test_the_ith_request_of_a_key_gets_the_same_buffer_every_time():
    pool = StagingPool(max_bytes=4096, pin_memory=False)
    first = pool.take([(F32, 16), (I8, 8), (F32, 16)])
    assert [(b.dtype, b.shape, b.is_pinned()) for b in first] == [
        (F32, (16,), False),
        (I8, (8,), False),
        (F32, (16,), False),
    ]
    assert len({b.data_ptr() for b in first}) == 3  # distinct requests never share storage
    assert _state(pool) == ({StagingKey("float32", 16): 2, StagingKey("int8", 8): 1}, 136, 3)
    again = pool.take([(I8, 8), (F32, 16), (F32, 16)])
    assert [b.data_ptr() for b in again] == [first[1].data_ptr(), first[0].data_ptr(), first[2].data_ptr()]
    assert pool.num_allocations == 3  # the same shapes again allocate nothing
    pool.take([(F32, 16)])
    assert _state(pool) == ({StagingKey("float32", 16): 2, StagingKey("int8", 8): 1}, 136, 3)


def test_keys_a_take_does_not_use_are_evicted_least_recently_used_first():
    pool = StagingPool(max_bytes=256, pin_memory=False)
    pool.take([(F32, 16)])  # 64 bytes
    pool.take([(I8, 64)])  # 64 bytes
    pool.take([(F32, 16)])  # float32 is now the most recently used key
    pool.take([(F32, 32)])  # 128 bytes: 256 held, at the bound
    assert pool.size_bytes == 256
    pool.take([(I8, 32)])  # 32 more bytes: the least recently used key, int8 x 64, goes
    assert _state(pool) == (
        {StagingKey("float32", 16): 1, StagingKey("float32", 32): 1, StagingKey("int8", 32): 1},
        224,
        4,
    )


def test_surplus_buffers_of_a_used_key_are_evicted_when_a_new_key_needs_the_room():
    pool = StagingPool(max_bytes=100, pin_memory=False)
    first = pool.take([(I8, 30)] * 3)  # 90 bytes held
    # 30 + 20 bytes needed: the last int8 x 30 buffer (the surplus one of the highest index) makes room
    kept, _ = pool.take([(I8, 30), (torch.int16, 10)])
    assert kept.data_ptr() == first[0].data_ptr()
    assert _state(pool) == ({StagingKey("int16", 10): 1, StagingKey("int8", 30): 2}, 80, 4)
    # the i-th request of a key still gets that key's i-th buffer after a trim
    again = pool.take([(I8, 30), (I8, 30)])
    assert [b.data_ptr() for b in again] == [first[0].data_ptr(), first[1].data_ptr()]
    assert _state(pool) == ({StagingKey("int16", 10): 1, StagingKey("int8", 30): 2}, 80, 4)


def test_a_take_over_the_bound_raises_before_anything_is_allocated_or_evicted():
    pool = StagingPool(max_bytes=256, pin_memory=False)
    held = pool.take([(F32, 16), (I8, 64)])
    before = _state(pool)
    with pytest.raises(StagingPoolError, match=r"^one transfer needs 320 bytes of staging .* max_bytes=256;"):
        pool.take([(F32, 16), (F32, 16), (F32, 16), (F32, 16), (F32, 16)])
    assert _state(pool) == before
    assert [b.data_ptr() for b in pool.take([(F32, 16), (I8, 64)])] == [b.data_ptr() for b in held]


def test_discarded_buffers_are_never_handed_out_again():
    pool = StagingPool(max_bytes=4096, pin_memory=False)
    a, b = pool.take([(F32, 16), (F32, 16)])
    pool.discard([a])
    assert _state(pool) == ({StagingKey("float32", 16): 1}, 64, 2)
    c, d = pool.take([(F32, 16), (F32, 16)])
    assert c.data_ptr() == b.data_ptr()
    assert d.data_ptr() not in (a.data_ptr(), b.data_ptr())
    assert pool.num_allocations == 3


@pytest.mark.parametrize(
    "request_",
    [(F32, -1), (F32, 2.0), (F32, True), ("float32", 4), (F32,), (F32, 4, 0), F32, None],
    ids=["negative", "float", "bool", "dtype-name", "short", "long", "bare-dtype", "none"],
)
def test_a_bad_request_is_refused_naming_it_before_anything_changes(request_):
    pool = StagingPool(max_bytes=4096, pin_memory=False)
    pool.take([(I8, 8)])
    before = _state(pool)
    message = f"requests[1]={request_!r} must be a (torch.dtype, numel) pair with numel an int >= 0"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        pool.take([(F32, 4), request_])
    assert _state(pool) == before


@pytest.mark.parametrize("pin_memory", ["no", 1, 0.0])
def test_pin_memory_is_a_bool_or_none(pin_memory):
    message = f"pin_memory={pin_memory!r} must be True, False or None (vLLM's PIN_MEMORY)"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        StagingPool(max_bytes=4096, pin_memory=pin_memory)


@pytest.mark.parametrize("stream", ["cuda", 0, torch.device("cpu")], ids=["str", "int", "device"])
def test_fence_takes_a_stream_or_none(stream):
    pool = StagingPool(max_bytes=4096, pin_memory=False)
    message = f"stream={stream!r} must be a stream (with device and synchronize()) or None"
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        pool.fence(stream)
    pool.fence(None)
    pool.fence(torch.Stream("cpu"))  # a CPU stream: nothing to wait for
    assert pool.take([(F32, 4)])[0].shape == (4,)
