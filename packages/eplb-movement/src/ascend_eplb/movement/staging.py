"""CPU staging buffers for expert transfers over Gloo, reused by ``(dtype, numel)``.

Gloo moves host memory only, so every expert tensor crossing ranks passes through a flat CPU buffer.
Upstream's ``TorchDistGlooStagedEplbCommunicator`` allocates them per transfer; this pool keeps them:
the ``i``-th request of a key in one :meth:`StagingPool.take` always gets that key's ``i``-th buffer, so
a rearrangement whose layers share shapes allocates nothing after its first layer.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from vllm.utils.torch_utils import PIN_MEMORY

from ascend_eplb.movement._values import is_int

__all__ = ["DEFAULT_STAGING_MAX_BYTES", "StagingKey", "StagingPool", "StagingPoolError"]

#: Default bound of a pool, in bytes (2 GiB): one ``execute`` stages ``(experts sent + received) x
#: bytes per expert``; a DeepSeek-V3 W8A8 expert is ~44 MB, so ~48 moved experts per layer per rank.
DEFAULT_STAGING_MAX_BYTES = 2 << 30


class StagingPoolError(RuntimeError):
    """One ``execute`` needs more staging than the pool's bound allows, even after evicting every
    buffer it does not need."""


@dataclass(frozen=True, order=True)
class StagingKey:
    """Key of a staging buffer: ``dtype`` (as its string, for ordering) and element count."""

    dtype: str
    numel: int


def _key(dtype: torch.dtype, numel: int) -> StagingKey:
    return StagingKey(str(dtype).removeprefix("torch."), int(numel))


class StagingPool:
    """Bounded pool of flat CPU staging buffers, pinned where the platform supports pinned memory.

    Args:
        max_bytes: upper bound of :attr:`size_bytes`, in bytes (default
            :data:`DEFAULT_STAGING_MAX_BYTES`). Must be positive.
        pin_memory: page-locked buffers (for asynchronous copies); ``None`` follows vLLM's
            ``PIN_MEMORY`` (False on CPU-only hosts).

    Raises ``ValueError`` for a ``max_bytes`` that is not a positive int or a ``pin_memory`` that is
    not a bool or None. Buffers from :meth:`take` stay valid until the next :meth:`take` or
    :meth:`discard`; asynchronous copies out of them are registered with :meth:`fence`, which the
    next :meth:`take` waits for. One user thread at a time; a lock guards against sharing anyway.
    """

    def __init__(self, max_bytes: int = DEFAULT_STAGING_MAX_BYTES, *, pin_memory: bool | None = None):
        if not is_int(max_bytes) or max_bytes <= 0:
            raise ValueError(f"max_bytes={max_bytes!r} must be a positive integer number of bytes")
        if pin_memory is not None and not isinstance(pin_memory, bool):
            raise ValueError(f"pin_memory={pin_memory!r} must be True, False or None (vLLM's PIN_MEMORY)")
        self.max_bytes = int(max_bytes)
        self.pinned = bool(PIN_MEMORY) if pin_memory is None else bool(pin_memory)
        # key -> buffers, least recently used key first.
        self._buffers: OrderedDict[StagingKey, list[torch.Tensor]] = OrderedDict()
        self._size_bytes = 0
        self._num_allocations = 0
        self._pending: list[torch.Stream] = []
        self._lock = threading.Lock()

    # -- reporting -----------------------------------------------------------------------------
    @property
    def size_bytes(self) -> int:
        """Bytes held by the pool's buffers now (always ``<= max_bytes``)."""
        return self._size_bytes

    @property
    def num_buffers(self) -> int:
        """Number of buffers held now."""
        return sum(len(v) for v in self._buffers.values())

    @property
    def num_allocations(self) -> int:
        """Buffers allocated since the pool was created (never decreases; constant once the
        rearrangement shapes have all been seen)."""
        return self._num_allocations

    def buffer_counts(self) -> dict[StagingKey, int]:
        """Buffers held per ``(dtype, numel)`` key."""
        return {k: len(v) for k, v in sorted(self._buffers.items())}

    # -- use -----------------------------------------------------------------------------------
    def take(self, requests: Sequence[tuple[torch.dtype, int]]) -> list[torch.Tensor]:
        """Hand out one flat CPU buffer per request, for one ``execute``.

        ``requests``: ``(dtype, numel)`` per buffer; the ``i``-th request of a key gets its ``i``-th
        buffer, allocated if missing. Returns one 1-D CPU tensor of exactly ``numel`` elements per
        request (pinned if :attr:`pinned`, none sharing storage, contents undefined), after waiting
        for the copies registered with :meth:`fence`.

        Raises:
            ValueError: a request that is not a ``(torch.dtype, numel)`` pair with ``numel`` an int
                ``>= 0``; nothing waited for, allocated or evicted.
            StagingPoolError: the buffers needed exceed ``max_bytes`` even after evicting every other
                buffer (unused keys least recently used first, then surplus buffers of used keys);
                nothing allocated or evicted then.
        """
        requests = list(requests)
        for i, request in enumerate(requests):
            if not (
                isinstance(request, (tuple, list))
                and len(request) == 2
                and isinstance(request[0], torch.dtype)
                and is_int(request[1])
                and request[1] >= 0
            ):
                raise ValueError(
                    f"requests[{i}]={request!r} must be a (torch.dtype, numel) pair with numel an int >= 0"
                )
        with self._lock:
            self._wait_pending()
            need = Counter(_key(dtype, numel) for dtype, numel in requests)
            nbytes = {_key(dtype, numel): int(numel) * dtype.itemsize for dtype, numel in requests}
            needed_total = sum(count * nbytes[key] for key, count in need.items())
            if needed_total > self.max_bytes:
                raise StagingPoolError(
                    f"one transfer needs {needed_total} bytes of staging ({dict(sorted(need.items()))} "
                    f"buffers by (dtype, numel)), more than the pool's max_bytes={self.max_bytes}; "
                    "raise max_bytes or move fewer experts per layer"
                )
            new_bytes = sum(
                max(0, count - len(self._buffers.get(key, ()))) * nbytes[key] for key, count in need.items()
            )
            # Until the new buffers fit: evict the keys this transfer does not use, least recently used
            # first, then the surplus buffers of the keys it uses (highest index first, so the i-th
            # request of a key still gets that key's i-th buffer).
            for key in list(self._buffers):
                if self._size_bytes + new_bytes <= self.max_bytes:
                    break
                if key not in need:
                    self._drop_key(key)
            for key in list(self._buffers):
                buffers = self._buffers[key]
                while self._size_bytes + new_bytes > self.max_bytes and len(buffers) > need[key]:
                    dropped = buffers.pop()
                    self._size_bytes -= dropped.numel() * dropped.element_size()
            out: list[torch.Tensor] = []
            used = Counter[StagingKey]()
            for dtype, numel in requests:
                key = _key(dtype, numel)
                buffers = self._buffers.setdefault(key, [])
                index = used[key]
                used[key] += 1
                if index == len(buffers):
                    buffers.append(torch.empty(int(numel), dtype=dtype, pin_memory=self.pinned))
                    self._size_bytes += int(numel) * dtype.itemsize
                    self._num_allocations += 1
                out.append(buffers[index])
            for key in need:
                self._buffers.move_to_end(key)
            return out

    def fence(self, stream: torch.Stream | None) -> None:
        """Register ``stream`` as holding asynchronous copies out of (or into) buffers handed out by
        the last :meth:`take`; the next :meth:`take` synchronizes it first. ``None`` or a CPU stream
        is ignored (CPU copies are synchronous).

        Raises:
            TypeError: ``stream`` is not None and not a stream (an object with ``device`` and
                ``synchronize()``: ``torch.Stream``, ``torch.cuda.Stream``, ``torch.npu.Stream``, which
                do not share a base class); nothing is registered.
        """
        if stream is not None and not (
            callable(getattr(stream, "synchronize", None)) and hasattr(stream, "device")
        ):
            raise TypeError(f"stream={stream!r} must be a stream (with device and synchronize()) or None")
        if stream is None or stream.device.type == "cpu":
            return
        with self._lock:
            self._pending.append(stream)

    def discard(self, buffers: Sequence[torch.Tensor]) -> None:
        """Forget ``buffers`` (by identity) so they are never handed out again.

        Used after a failed transfer: a Gloo receive that was posted but never completed may still
        write into its buffer later. The memory is freed once nothing else references it.
        """
        ids = {id(b) for b in buffers}
        with self._lock:
            for key in list(self._buffers):
                kept = [b for b in self._buffers[key] if id(b) not in ids]
                for b in self._buffers[key]:
                    if id(b) in ids:
                        self._size_bytes -= b.numel() * b.element_size()
                if kept:
                    self._buffers[key] = kept
                else:
                    del self._buffers[key]

    def clear(self) -> None:
        """Drop every buffer (after waiting for registered copies)."""
        with self._lock:
            self._wait_pending()
            self._buffers.clear()
            self._size_bytes = 0

    # -- internals -----------------------------------------------------------------------------
    def _wait_pending(self) -> None:
        pending, self._pending = self._pending, []
        for stream in pending:
            stream.synchronize()

    def _drop_key(self, key: StagingKey) -> None:
        for b in self._buffers.pop(key):
            self._size_bytes -= b.numel() * b.element_size()

    def __repr__(self) -> str:
        return (
            f"StagingPool(size_bytes={self._size_bytes}, max_bytes={self.max_bytes}, "
            f"buffers={self.num_buffers}, pinned={self.pinned})"
        )
