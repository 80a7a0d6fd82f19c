"""``AscendGlooEplbCommunicator``: upstream's EPLB communicator contract over Gloo, with CPU staging.

vLLM's async EPLB worker moves one MoE layer at a time (``transfer_layer`` -> ``move_to_buffer``):
it queues one ``add_send`` per (expert, destination rank) and one ``add_recv`` per expert it needs,
then calls ``execute`` once (once per batch with migration batching), on every rank of the EPLB
group. The worker must not issue device collectives next to the foreground MoE communication, so
this communicator moves expert tensors through CPU memory over the EPLB group's Gloo (CPU) process
group:

1. device-to-host copies of every distinct send tensor into :class:`StagingPool` buffers, on the
   worker's stream, then one wait for them;
2. one Gloo batch of all staged sends and all receives, posted like ``batch_isend_irecv`` (peers
   translated from EPLB-group ranks to global ranks; a tag per ``execute`` keeps a failed layer's
   stragglers from matching a later layer's operations);
3. a wait on every request, bounded by ``timeout_s`` for the whole batch;
4. host-to-device copies from staging into the destination rows, on the worker's stream.

On a host without an accelerator (CPU tensors) every copy is synchronous and no stream or
``torch.accelerator`` call is made, so it runs on CPU-only CI without any adaptation of torch.
"""

from __future__ import annotations

import logging
import numbers
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from vllm.distributed.eplb.eplb_communicator import EplbCommunicator
from vllm.distributed.eplb.eplb_utils import device_stream
from vllm.utils.gpu_sync_debug import gpu_sync_allowed

from ascend_eplb.movement.staging import StagingPool
from ascend_eplb.movement.stats import TransferStats

__all__ = ["DEFAULT_TRANSFER_TIMEOUT_S", "AscendGlooEplbCommunicator", "EplbTransferError"]

logger = logging.getLogger(__name__)

#: Default bound on waiting for one ``execute``'s Gloo requests, in seconds.
DEFAULT_TRANSFER_TIMEOUT_S = 300.0

# Gloo slots are 64-bit (prefix, tag); keep tags well inside int32 for c10d's ``int tag``.
_TAG_MODULUS = 1 << 30
# Gloo's error for requests on a context whose wait timed out (it closes every pair of the context).
_OWN_TIMEOUT_CLOSURE = "Application timeout caused pair closure"


class EplbTransferError(RuntimeError):
    """An ``execute`` failed; the communicator's queue was cleared and the next ``execute`` starts clean.

    Attributes:
        layer_idx: MoE layer given to ``set_transfer_context`` for this batch, or None.
        sequence: number of this ``execute`` call on this communicator (1-based; equal on all ranks of
            the group, it is the Gloo tag of the batch).
        phase: ``"staging"`` (before anything was posted to Gloo), ``"gloo"`` or ``"h2d"``.
        sends: global peer rank -> logical expert ids this rank was sending it.
        recvs: global peer rank -> logical expert ids this rank was receiving from it.
        unanswered_ranks: global ranks whose requests did not complete (timed out or connection lost),
            sorted; empty when the failure was local.
        rank_errors: global rank -> the Gloo error of its first failed request.
        timeout_s: the bound that applied to the wait.
    """

    def __init__(
        self,
        message: str,
        *,
        layer_idx: int | None,
        sequence: int,
        phase: str,
        sends: dict[int, list[int]],
        recvs: dict[int, list[int]],
        unanswered_ranks: list[int],
        rank_errors: dict[int, str],
        timeout_s: float,
    ):
        super().__init__(message)
        self.layer_idx = layer_idx
        self.sequence = sequence
        self.phase = phase
        self.sends = sends
        self.recvs = recvs
        self.unanswered_ranks = unanswered_ranks
        self.rank_errors = rank_errors
        self.timeout_s = timeout_s

    @property
    def peers(self) -> list[int]:
        """Global ranks this rank was exchanging with in the failed batch, sorted."""
        return sorted(set(self.sends) | set(self.recvs))

    @property
    def expert_ids(self) -> list[int]:
        """Logical expert ids of the failed batch (sent or received), sorted."""
        return sorted({e for ids in (*self.sends.values(), *self.recvs.values()) for e in ids})


@dataclass(slots=True)
class _Queued:
    is_send: bool
    tensors: list[torch.Tensor]
    group_peer: int
    global_peer: int
    expert_id: int


@dataclass(slots=True)
class _Plan:
    """One execute's layout: the tensor Gloo reads or writes per slot, staged or direct."""

    # Per slot: the tensor Gloo uses directly (contiguous host tensor), or None until a staging
    # buffer is taken from the pool.
    slots: list[torch.Tensor | None] = field(default_factory=list)
    # Staged slots, aligned with ``requests`` ((dtype, numel) asked of the pool).
    staged_slots: list[int] = field(default_factory=list)
    requests: list[tuple[torch.dtype, int]] = field(default_factory=list)
    # Distinct staged send tensors: (slot, source), copied in before Gloo.
    sources: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    # Staged received tensors: (destination, slot), copied out after Gloo.
    dests: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    # Per tensor operation, in posting order: (is_send, slot, global peer, expert id).
    ops: list[tuple[bool, int, int, int]] = field(default_factory=list)

    def add_slot(self, tensor: torch.Tensor, direct: bool) -> int:
        self.slots.append(tensor if direct else None)
        if not direct:
            self.staged_slots.append(len(self.slots) - 1)
            self.requests.append((tensor.dtype, tensor.numel()))
        return len(self.slots) - 1


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}={value!r} must be an int")
    return int(value)


class AscendGlooEplbCommunicator(EplbCommunicator):
    """Upstream ``EplbCommunicator`` that moves expert tensors over a Gloo group through CPU staging.

    Args:
        cpu_group: the EPLB group's CPU (Gloo) process group, ``GroupCoordinator.cpu_group`` of
            ``vllm.distributed.parallel_state.get_eplb_group()``. This process must be a member.
        stream: stream the staging copies run on (the async worker's stream, normally set later with
            :meth:`set_stream`). ``None``: the device's current stream. Ignored for CPU tensors.
        staging_pool: where staging buffers come from; default a new :class:`StagingPool` (2 GiB
            bound, pinned if the platform supports it). May be shared by communicators that are
            used one after another (main and draft model).
        timeout_s: bound, in seconds, on waiting for all Gloo requests of one ``execute``. A rank that
            never posts its side makes the others raise :class:`EplbTransferError` naming it after this
            long. Gloo then closes every connection of this rank in the group (measured with torch
            2.13: later requests raise "Application timeout caused pair closure", and the peers see
            "Connection closed by peer"), so later transfers over the group fail at once, naming the
            ranks, instead of hanging.
        stage_host_tensors: also stage tensors that are already contiguous host (CPU) memory. By
            default Gloo reads and writes those directly, as upstream's Gloo communicator does
            (staging them is a pure extra copy); device tensors and non-contiguous host views are
            always staged. Tests set it to run the device path's staging on CPU.

    Raises:
        TypeError: ``cpu_group`` is not a ``ProcessGroup`` of which this process is a member.
        ValueError: ``timeout_s`` is not positive.

    Peer ranks given to :meth:`add_send` / :meth:`add_recv` are EPLB-group ranks (what upstream
    passes); they are translated to global ranks with ``torch.distributed.get_global_rank``, so a
    group that is not ranks ``0..N-1`` of the world (a later pipeline stage, say) works.
    """

    def __init__(
        self,
        cpu_group: ProcessGroup,
        stream: torch.Stream | None = None,
        staging_pool: StagingPool | None = None,
        *,
        timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S,
        stage_host_tensors: bool = False,
    ) -> None:
        if not isinstance(cpu_group, ProcessGroup):
            raise TypeError(
                f"cpu_group={cpu_group!r} must be a torch.distributed ProcessGroup this process belongs "
                "to (GroupCoordinator.cpu_group of the EPLB group)"
            )
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be a positive number of seconds")
        self._cpu_group = cpu_group
        self._stream = stream
        self._pool = staging_pool if staging_pool is not None else StagingPool()
        self.timeout_s = float(timeout_s)
        self.stage_host_tensors = bool(stage_host_tensors)
        self.group_rank = cpu_group.rank()
        self.group_size = cpu_group.size()
        #: ``global_ranks[g]`` is the global rank of EPLB-group rank ``g``.
        self.global_ranks: tuple[int, ...] = tuple(
            dist.get_global_rank(cpu_group, g) for g in range(self.group_size)
        )
        self._queue: list[_Queued] = []
        self._layer_idx: int | None = None
        self._sequence = 0
        self._last = TransferStats()
        self._cumulative = TransferStats()
        self._log_initialized()

    # -- upstream contract -------------------------------------------------------------------------
    @property
    def needs_profile_buffer_reservation(self) -> bool:
        """False: Gloo needs no device communication buffers reserved by the profile run."""
        return False

    def set_stream(self, stream: torch.Stream | None) -> None:
        """Run staging copies on ``stream`` (the async worker's); ``None``: the current stream."""
        self._stream = stream

    def set_transfer_context(self, old_indices: np.ndarray, layer_idx: int) -> None:
        """Remember the MoE layer of the next ``execute`` (for statistics and error messages)."""
        self._layer_idx = int(layer_idx)

    def add_send(self, tensors: list[torch.Tensor], dst_rank: int, expert_id: int) -> None:
        """Queue sending one expert's tensors to EPLB-group rank ``dst_rank``.

        Args:
            tensors: the expert's row of every weight view of the layer (any device, any strides);
                read during ``execute``.
            dst_rank: EPLB-group rank, in ``[0, group_size)`` and not this rank.
            expert_id: logical expert id (for statistics and error messages).

        Raises:
            ValueError: ``dst_rank`` outside the group or this rank itself, or ``tensors`` empty.
            TypeError: a tensor is not a ``torch.Tensor`` or a rank/id is not an int.

        Nothing is queued when it raises.
        """
        self._queue.append(self._validated(True, tensors, dst_rank, expert_id))

    def add_recv(self, tensors: list[torch.Tensor], src_rank: int, expert_id: int) -> None:
        """Queue receiving one expert's tensors from EPLB-group rank ``src_rank``.

        Args:
            tensors: destination rows (rows of upstream's ``expert_buffer``), written by ``execute``;
                same count, dtypes and element counts as the sender's tensors, in the same order.
            src_rank: EPLB-group rank, in ``[0, group_size)`` and not this rank.
            expert_id: logical expert id (for statistics and error messages).

        Raises:
            ValueError, TypeError: as :meth:`add_send`. Nothing is queued when it raises.
        """
        self._queue.append(self._validated(False, tensors, src_rank, expert_id))

    def execute(self) -> None:
        """Move every queued tensor; on return all received data is in the destination rows (on an
        accelerator: enqueued on the transfer stream, ordered before later work on it).

        Every rank of the group must call it the same number of times (upstream calls it once per
        layer, or once per migration batch, on every rank), since its call count is the Gloo tag.

        Raises:
            EplbTransferError: staging failed, a Gloo request failed or did not complete within
                ``timeout_s``, or a copy failed. It names the peers (global ranks), the expert ids
                of the batch and the ranks that did not answer. The queue is empty afterwards, and
                staging buffers a posted request may still touch are dropped from the pool.
        """
        queue, self._queue = self._queue, []
        layer_idx, self._layer_idx = self._layer_idx, None
        self._sequence += 1
        sequence = self._sequence
        if not queue:
            self._record(TransferStats(num_executes=1))
            return

        plan = self._plan(queue)
        stats = dict(
            num_executes=1,
            num_send_experts=sum(q.is_send for q in queue),
            num_recv_experts=sum(not q.is_send for q in queue),
            num_send_tensors=sum(is_send for is_send, *_ in plan.ops),
            num_recv_tensors=sum(not is_send for is_send, *_ in plan.ops),
            bytes_sent=sum(_nbytes(t) for q in queue if q.is_send for t in q.tensors),
            bytes_received=sum(_nbytes(t) for q in queue if not q.is_send for t in q.tensors),
            staging_bytes=sum(dtype.itemsize * numel for dtype, numel in plan.requests),
        )
        phase = "staging"
        staging: list[torch.Tensor] = []
        posted = False
        rank_errors: dict[int, str] = {}
        t0 = time.perf_counter()
        t1 = t2 = t0
        try:
            staging = self._pool.take(plan.requests)
            slots = plan.slots
            for slot, buffer in zip(plan.staged_slots, staging, strict=True):
                slots[slot] = buffer
            stream = self._transfer_stream(queue)
            non_blocking = self._pool.pinned and stream is not None
            # 1. Device-to-host copies into staging, then one wait for all of them.
            with device_stream(stream):
                for slot, src in plan.sources:
                    slots[slot].view(src.shape).copy_(src, non_blocking=non_blocking)
            if stream is not None:
                with gpu_sync_allowed():
                    stream.synchronize()
            t1 = time.perf_counter()

            # 2./3. One Gloo batch for every send and receive, then a bounded wait on each request.
            # Posted op by op, exactly as batch_isend_irecv does for Gloo (no coalescing support), so
            # a failure to post is attributed to its peer and the other peers' operations still go.
            phase = "gloo"
            tag = sequence % _TAG_MODULUS
            posted = True
            requests: list[dist.Work | None] = []
            for is_send, slot, peer, _ in plan.ops:
                request = None
                if peer not in rank_errors:
                    try:
                        if is_send:
                            request = dist.isend(slots[slot], dst=peer, group=self._cpu_group, tag=tag)
                        else:
                            request = dist.irecv(slots[slot], src=peer, group=self._cpu_group, tag=tag)
                    except Exception as exc:  # Gloo raises RuntimeError on a closed connection
                        rank_errors[peer] = f"{type(exc).__name__}: {exc}"
                requests.append(request)
            deadline = time.monotonic() + self.timeout_s
            for request, (_, _, peer, _) in zip(requests, plan.ops, strict=True):
                if request is None or peer in rank_errors:
                    continue
                remaining = max(deadline - time.monotonic(), 1e-3)
                try:
                    request.wait(timeout=timedelta(seconds=remaining))
                except Exception as exc:  # Gloo raises RuntimeError (timeout, closed connection)
                    rank_errors[peer] = f"{type(exc).__name__}: {exc}"
            if rank_errors:
                raise RuntimeError(f"Gloo requests failed for global ranks {sorted(rank_errors)}")
            t2 = time.perf_counter()

            # 4. Host-to-device copies into the destination rows.
            phase = "h2d"
            with device_stream(stream):
                for dst, slot in plan.dests:
                    dst.copy_(slots[slot].view(dst.shape), non_blocking=non_blocking)
            self._pool.fence(stream)
        except Exception as exc:
            if posted:
                # A request that did not complete may still read or write its buffer later.
                self._pool.discard(staging)
            now = time.perf_counter()
            self._record(
                TransferStats(
                    **{**stats, "bytes_sent": 0, "bytes_received": 0},
                    num_failed=1,
                    d2h_s=(t1 if phase != "staging" else now) - t0,
                    gloo_s=(now - t1) if phase == "gloo" else (t2 - t1),
                    h2d_s=(now - t2) if phase == "h2d" else 0.0,
                )
            )
            raise self._error(queue, layer_idx, sequence, phase, rank_errors, exc) from exc
        t3 = time.perf_counter()
        self._record(TransferStats(**stats, d2h_s=t1 - t0, gloo_s=t2 - t1, h2d_s=t3 - t2))

    # -- statistics ------------------------------------------------------------------------------
    @property
    def last_stats(self) -> TransferStats:
        """Statistics of the latest ``execute`` (all zeros before the first)."""
        return self._last

    @property
    def cumulative_stats(self) -> TransferStats:
        """Sum of the statistics of every ``execute`` so far."""
        return self._cumulative

    @property
    def staging_pool(self) -> StagingPool:
        """The pool staging buffers come from (its ``size_bytes`` is the staging held now)."""
        return self._pool

    @property
    def num_queued(self) -> int:
        """``add_send``/``add_recv`` calls waiting for the next ``execute``."""
        return len(self._queue)

    # -- internals -------------------------------------------------------------------------------
    def _validated(
        self, is_send: bool, tensors: Sequence[torch.Tensor], peer: int, expert_id: int
    ) -> _Queued:
        what = "dst_rank" if is_send else "src_rank"
        group_peer = _check_int(what, peer)
        expert_id = _check_int("expert_id", expert_id)
        if not 0 <= group_peer < self.group_size:
            raise ValueError(
                f"{what}={group_peer} is outside the EPLB group's ranks [0, {self.group_size}) "
                f"(group-local ranks; global ranks {list(self.global_ranks)}) for expert {expert_id}"
            )
        if group_peer == self.group_rank:
            raise ValueError(
                f"{what}={group_peer} is this rank itself (global rank {self.global_ranks[group_peer]}); "
                f"local copies of expert {expert_id} are not transfers"
            )
        tensors = list(tensors)
        if not tensors:
            raise ValueError(f"add_{'send' if is_send else 'recv'} of expert {expert_id} got no tensors")
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"tensors[{i}] of expert {expert_id} is a {type(t).__name__}, not a Tensor")
        return _Queued(is_send, tensors, group_peer, self.global_ranks[group_peer], expert_id)

    def _plan(self, queue: list[_Queued]) -> _Plan:
        plan = _Plan()
        source_slot: dict[tuple, int] = {}
        for q in queue:
            for t in q.tensors:
                direct = not self.stage_host_tensors and t.device.type == "cpu" and t.is_contiguous()
                if q.is_send:
                    # A source sent to several peers is staged (and copied) once.
                    key = (t.device, t.dtype, t.data_ptr(), tuple(t.shape), tuple(t.stride()))
                    slot = source_slot.get(key)
                    if slot is None:
                        slot = source_slot[key] = plan.add_slot(t, direct)
                        if not direct:
                            plan.sources.append((slot, t))
                else:
                    slot = plan.add_slot(t, direct)
                    if not direct:
                        plan.dests.append((t, slot))
                plan.ops.append((q.is_send, slot, q.global_peer, q.expert_id))
        return plan

    def _transfer_stream(self, queue: list[_Queued]) -> torch.Stream | None:
        """The stream for staging copies, or None when every tensor is on CPU (synchronous copies;
        no ``torch.accelerator`` call, which raises on a host without an accelerator)."""
        device = next((t.device for q in queue for t in q.tensors if t.device.type != "cpu"), None)
        if device is None:
            return None
        if self._stream is not None and self._stream.device.type == device.type:
            return self._stream
        return torch.accelerator.current_stream(device)

    def _record(self, stats: TransferStats) -> None:
        self._last = stats
        self._cumulative = self._cumulative + stats
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("EPLB transfer (layer %s): %s", self._layer_idx, stats.as_dict())

    def _error(
        self,
        queue: list[_Queued],
        layer_idx: int | None,
        sequence: int,
        phase: str,
        rank_errors: dict[int, str],
        cause: BaseException,
    ) -> EplbTransferError:
        sends: dict[int, list[int]] = {}
        recvs: dict[int, list[int]] = {}
        for q in queue:
            (sends if q.is_send else recvs).setdefault(q.global_peer, []).append(q.expert_id)
        sends = {r: sorted(set(ids)) for r, ids in sorted(sends.items())}
        recvs = {r: sorted(set(ids)) for r, ids in sorted(recvs.items())}
        unanswered = sorted(rank_errors)
        where = f"layer {layer_idx}" if layer_idx is not None else "a layer"
        parts = [
            f"EPLB expert transfer of {where} (execute #{sequence}, "
            f"rank {self.global_ranks[self.group_rank]}) failed in the {phase} phase",
            f"sending experts to global ranks {sends or '{}'}",
            f"receiving experts from global ranks {recvs or '{}'}",
        ]
        if unanswered:
            timed_out = [r for r in unanswered if "Timed out" in rank_errors[r]]
            closed = [r for r in unanswered if _OWN_TIMEOUT_CLOSURE in rank_errors[r]]
            lost = [r for r in unanswered if r not in timed_out and r not in closed]
            if timed_out:
                parts.append(
                    f"global rank(s) {timed_out} did not answer within {self.timeout_s:g} s (Gloo then "
                    "closes this rank's connections in the group, so later transfers over it fail at once)"
                )
            if closed:
                parts.append(
                    f"requests with global rank(s) {closed} were aborted: this rank's Gloo connections "
                    "in the group were closed by a timeout"
                )
            if lost:
                parts.append(
                    "connection to global rank(s) "
                    + ", ".join(f"{r} failed ({rank_errors[r].splitlines()[0]})" for r in lost)
                )
        else:
            parts.append(f"cause: {type(cause).__name__}: {cause}")
        return EplbTransferError(
            "; ".join(parts),
            layer_idx=layer_idx,
            sequence=sequence,
            phase=phase,
            sends=sends,
            recvs=recvs,
            unanswered_ranks=unanswered,
            rank_errors=dict(rank_errors),
            timeout_s=self.timeout_s,
        )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
