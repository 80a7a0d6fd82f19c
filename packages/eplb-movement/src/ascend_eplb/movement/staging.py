"""CPU staging buffers for expert transfers over Gloo, reused by ``(dtype, numel)``.

Gloo moves host memory only, so every expert tensor that crosses ranks is copied into a CPU staging
buffer first (device-to-host) and out of one afterwards (host-to-device). Allocating those buffers per
transfer (what upstream ``TorchDistGlooStagedEplbCommunicator`` does) costs a pinned allocation per
expert tensor per layer; this pool keeps them instead. Buffers are flat (1-D), keyed by
``(dtype, numel)``, and handed out all at once for one ``execute`` (:meth:`StagingPool.take`): the
``i``-th request of a key always gets the ``i``-th buffer of that key, so a rearrangement whose layers
have the same shapes allocates nothing after its first layer.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ascend_eplb.movement._values import is_int

__all__ = ["DEFAULT_STAGING_MAX_BYTES", "StagingKey", "StagingPool", "StagingPoolError"]

#: Default bound of a pool, in bytes (2 GiB). One ``execute`` needs staging for every expert tensor
#: this rank sends (once per distinct source tensor) plus every one it receives, in that layer:
#: ``(experts sent + experts received) x bytes per expert``. A DeepSeek-V3 W8A8 expert is about 44 MB
#: (3 x 7168 x 2048 int8 plus scales), so 2 GiB covers about 48 moved experts per layer per rank.
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


def _default_pin_memory() -> bool:
    # The same decision as upstream (vllm.utils.torch_utils.PIN_MEMORY, i.e. the platform's
    # is_pin_memory_available()): False on CpuPlatform, True on CUDA and on vLLM Ascend's NPU platform.
    from vllm.utils.torch_utils import PIN_MEMORY

    return bool(PIN_MEMORY)


class StagingPool:
    """Bounded pool of flat CPU staging buffers, pinned where the platform supports pinned memory.

    Args:
        max_bytes: upper bound of :attr:`size_bytes`, in bytes (default
            :data:`DEFAULT_STAGING_MAX_BYTES`). Must be positive.
        pin_memory: allocate page-locked buffers (needed for asynchronous device-to-host and
            host-to-device copies). ``None`` follows vLLM's platform decision
            (``vllm.utils.torch_utils.PIN_MEMORY``: False on CPU-only hosts).

    Raises:
        ValueError: ``max_bytes`` is not a positive integer, or ``pin_memory`` is not a bool or None.

    The pool is used by one thread at a time (the EPLB worker that owns the communicator, or the main
    thread in synchronous mode); a lock guards it against accidental sharing anyway. Buffers handed out
    by :meth:`take` stay valid until the next :meth:`take` or :meth:`discard`; asynchronous
    host-to-device copies out of them must be registered with :meth:`fence` so the next :meth:`take`
    waits for them before the buffers are written again.
    """

    def __init__(self, max_bytes: int = DEFAULT_STAGING_MAX_BYTES, *, pin_memory: bool | None = None):
        if not is_int(max_bytes) or max_bytes <= 0:
            raise ValueError(f"max_bytes={max_bytes!r} must be a positive integer number of bytes")
        if pin_memory is not None and not isinstance(pin_memory, bool):
            raise ValueError(f"pin_memory={pin_memory!r} must be True, False or None (vLLM's PIN_MEMORY)")
        self.max_bytes = int(max_bytes)
        self.pinned = _default_pin_memory() if pin_memory is None else bool(pin_memory)
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

        Args:
            requests: ``(dtype, numel)`` per staging buffer needed. The ``i``-th request of a key
                gets that key's ``i``-th buffer; missing buffers are allocated.

        Returns:
            One 1-D CPU tensor per request, of that dtype and exactly ``numel`` elements, pinned if
            :attr:`pinned`; distinct requests never share storage. Contents are undefined.

        Raises:
            ValueError: a request that is not a ``(torch.dtype, numel)`` pair with ``numel`` an int
                ``>= 0`` (not a bool); nothing is waited for, allocated or evicted.
            StagingPoolError: the buffers these requests need exceed ``max_bytes`` (the pool evicts
                every other buffer before it refuses: keys these requests do not use, least recently
                used first, then the surplus buffers of the keys they use). Nothing is allocated or
                evicted in that case.

        Waits first for the host-to-device copies registered with :meth:`fence`.
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
