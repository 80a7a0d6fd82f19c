"""``AscendGlooEplbCommunicator``: upstream's EPLB communicator contract over Gloo, with CPU staging.

vLLM's async EPLB worker moves one MoE layer at a time (``transfer_layer`` -> ``move_to_buffer``):
it queues one ``add_send`` per (expert, destination rank) and one ``add_recv`` per expert it needs,
then calls ``execute`` once (once per batch with migration batching), on every rank of the EPLB
group. The worker must not issue device collectives next to the foreground MoE communication, so
this communicator moves expert tensors through CPU memory over the EPLB group's Gloo (CPU) process
group:

1. device-to-host copies of every distinct send tensor into :class:`StagingPool` buffers, on the
   worker's stream, then one wait for them;
2. a handshake with every peer of the batch, before any payload moves: each side sends a fixed
   48-byte header (its local status and digests of what it will send to and expects from that
   peer: expert ids, tensor counts, dtypes, element counts); the two sides of a pair reach the same
   verdict from the same two headers, and only a pair that disagrees exchanges its full
   descriptions (so every Gloo operation on the group stays paired even when the plans differ);
3. one Gloo batch of all staged sends and all receives, posted like ``batch_isend_irecv`` (peers
   translated from EPLB-group ranks to global ranks; tags per ``execute`` keep a failed layer's
   stragglers from matching a later layer's operations), only with peers whose plans agreed;
4. a wait on every request, bounded by ``timeout_s`` for the whole batch;
5. host-to-device copies from staging into the destination rows, on the worker's stream.

On a host without an accelerator (CPU tensors) every copy is synchronous and no stream or
``torch.accelerator`` call is made, so it runs on CPU-only CI without any adaptation of torch.
"""

from __future__ import annotations

import hashlib
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

# Gloo slots are 64-bit (prefix, tag); keep tags well inside int32 for c10d's ``int tag``. Each
# ``execute`` uses ``_TAGS_PER_EXECUTE`` consecutive tags: payload, header, full descriptions.
_TAG_MODULUS = 1 << 28
_TAGS_PER_EXECUTE = 4
_PAYLOAD, _HEADER, _DETAIL = 0, 1, 2
# Handshake header, int64 words: status, description length, send digest (2), receive digest (2).
_HEADER_WORDS = 6
_STATUS_OK, _STATUS_FAILED = 0, 1
# A stable code per torch dtype, equal on every rank running the same torch.
_DTYPES: tuple[torch.dtype, ...] = tuple(
    sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
)
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}
# Gloo's error for requests on a context whose wait timed out (it closes every pair of the context).
_OWN_TIMEOUT_CLOSURE = "Application timeout caused pair closure"


class EplbTransferError(RuntimeError):
    """An ``execute`` failed; the communicator's queue was cleared and the next ``execute`` starts clean.

    Attributes:
        layer_idx: MoE layer given to ``set_transfer_context`` for this batch, or None.
        sequence: number of this ``execute`` call on this communicator (1-based; equal on all ranks of
            the group, it is the Gloo tag of the batch).
        phase: ``"staging"`` (this rank failed before the handshake: staging or its copies),
            ``"handshake"`` (a peer's plan disagreed with this rank's, a peer reported its own
            failure, or a header did not arrive: no payload moved with those peers and no
            destination row was written), ``"gloo"`` (a payload request failed) or ``"h2d"``.
        sends: global peer rank -> logical expert ids this rank was sending it.
        recvs: global peer rank -> logical expert ids this rank was receiving from it.
        unanswered_ranks: global ranks whose requests did not complete (timed out or connection lost),
            sorted; empty when the failure was local.
        rank_errors: global rank -> the Gloo error of its first failed request.
        timeout_s: the bound that applied to the wait.
        mismatches: global peer rank -> descriptions of how the two plans disagree (one per
            direction that disagrees; the same text on both ranks of the pair).
        failed_peers: global ranks that reported, in the handshake, that they failed before it.
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
        mismatches: dict[int, list[str]] | None = None,
        failed_peers: list[int] | None = None,
    ):
        super().__init__(message)
        self.mismatches = dict(mismatches or {})
        self.failed_peers = list(failed_peers or [])
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
    # Per slot: True when Gloo reads or writes the caller's tensor itself (no staging).
    direct: list[bool] = field(default_factory=list)
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
        self.direct.append(direct)
        if not direct:
            self.staged_slots.append(len(self.slots) - 1)
            self.requests.append((tensor.dtype, tensor.numel()))
        return len(self.slots) - 1


@dataclass(slots=True)
class _Handshake:
    """Outcome of one ``execute``'s handshake, the same on both ranks of every pair that completed it."""

    # Global peer -> the Gloo error of a header (or description) request that failed.
    rank_errors: dict[int, str] = field(default_factory=dict)
    # Global peer -> how the two plans disagree, one text per disagreeing direction.
    mismatches: dict[int, list[str]] = field(default_factory=dict)
    # Global peers that announced their own failure before the handshake.
    failed_peers: list[int] = field(default_factory=list)


def _plan_words(queue: Sequence[_Queued]) -> dict[int, tuple[list[int], list[int]]]:
    """Per global peer, both directions of the pair's plan (sends to it, receives from it) as int64
    words: the number of experts, then per expert its id, its number of tensors and per tensor
    (dtype code, element count), in queue order. One pass over the queue."""
    words: dict[int, tuple[list[int], list[int]]] = {}
    for q in queue:
        direction = words.setdefault(q.global_peer, ([0], [0]))[0 if q.is_send else 1]
        direction[0] += 1
        direction += (q.expert_id, len(q.tensors))
        for t in q.tensors:
            direction += (_DTYPE_CODE.get(t.dtype, -1), t.numel())
    return words


def _digest(words: Sequence[int]) -> tuple[int, int]:
    raw = hashlib.blake2b(np.asarray(words, dtype=np.int64).tobytes(), digest_size=16).digest()
    return int.from_bytes(raw[:8], "little", signed=True), int.from_bytes(raw[8:], "little", signed=True)


def _parse_words(words: Sequence[int]) -> list[tuple[int, list[tuple[int, int]]]]:
    """Inverse of :func:`_plan_words`: ``[(expert_id, [(dtype code, numel), ...]), ...]``."""
    items = []
    pos = 1
    for _ in range(int(words[0])):
        expert, count = int(words[pos]), int(words[pos + 1])
        pos += 2
        items.append((expert, [(int(words[pos + 2 * j]), int(words[pos + 2 * j + 1])) for j in range(count)]))
        pos += 2 * count
    return items


def _dtype_name(code: int) -> str:
    return str(_DTYPES[code]).removeprefix("torch.") if 0 <= code < len(_DTYPES) else f"dtype#{code}"


def _format_tensors(tensors: Sequence[tuple[int, int]]) -> str:
    return "[" + ", ".join(f"{_dtype_name(code)}[{numel}]" for code, numel in tensors) + "]"


def _describe_mismatch(
    sender: int, receiver: int, sent: Sequence[int], expected: Sequence[int]
) -> str | None:
    """How the sender's plan towards the receiver and the receiver's plan from the sender differ
    (global ranks), or None if they agree. The same text on both ranks."""
    s_items, r_items = _parse_words(sent), _parse_words(expected)
    for i, ((s_expert, s_tensors), (r_expert, r_tensors)) in enumerate(zip(s_items, r_items, strict=False)):
        if (s_expert, s_tensors) == (r_expert, r_tensors):
            continue
        if s_expert != r_expert:
            why = "expert ids differ"
        elif len(s_tensors) != len(r_tensors):
            why = f"{len(s_tensors)} tensor(s) sent, {len(r_tensors)} expected"
        else:
            j = next(j for j, (a, b) in enumerate(zip(s_tensors, r_tensors, strict=True)) if a != b)
            (s_code, s_numel), (r_code, r_numel) = s_tensors[j], r_tensors[j]
            if s_code != r_code:
                why = f"tensor {j}: {_dtype_name(s_code)} sent, {_dtype_name(r_code)} expected"
            else:
                size = _DTYPES[s_code].itemsize if 0 <= s_code < len(_DTYPES) else 0
                why = (
                    f"tensor {j}: {s_numel} elements ({s_numel * size} bytes) sent, "
                    f"{r_numel} elements ({r_numel * size} bytes) expected"
                )
        return (
            f"global rank {sender} sends expert {s_expert} to global rank {receiver} as "
            f"{_format_tensors(s_tensors)}, but global rank {receiver} receives expert {r_expert} from "
            f"global rank {sender} into {_format_tensors(r_tensors)} (transfer {i} between them: {why})"
        )
    if len(s_items) != len(r_items):
        return (
            f"global rank {sender} sends {len(s_items)} expert(s) {[e for e, _ in s_items]} to global "
            f"rank {receiver}, but global rank {receiver} receives {len(r_items)} expert(s) "
            f"{[e for e, _ in r_items]} from global rank {sender}"
        )
    return None


def _words_length(words: Sequence[int]) -> int:
    """Length of the first direction in a full description (``_plan_words`` of sends, then receives)."""
    pos = 1
    for _ in range(int(words[0])):
        pos += 2 + 2 * int(words[pos + 1])
    return pos


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}={value!r} must be an int, got a {type(value).__name__}")
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
        self._waiting_on: int | None = None
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
            tensors: a list (or tuple) of the expert's row of every weight view of the layer, one
                ``torch.Tensor`` per view (any device, dtype, shape and strides); read during
                ``execute``. The receiver's tensors for this expert must match them in count, order,
                dtype and element count (checked in ``execute``'s handshake).
            dst_rank: EPLB-group rank, in ``[0, group_size)`` and not this rank.
            expert_id: logical expert id; the receiver must queue the same id at the same position
                of its receives from this rank.

        Raises:
            TypeError: ``tensors`` is not a list/tuple (a bare tensor included: it is never split
                into its rows), an element is not a ``torch.Tensor``, or ``dst_rank``/``expert_id``
                is not an int (``bool`` rejected).
            ValueError: ``dst_rank`` outside the group or this rank itself, or ``tensors`` empty.

        Nothing is queued when it raises.
        """
        self._queue.append(self._validated(True, tensors, dst_rank, expert_id))

    def add_recv(self, tensors: list[torch.Tensor], src_rank: int, expert_id: int) -> None:
        """Queue receiving one expert's tensors from EPLB-group rank ``src_rank``.

        Args:
            tensors: a list (or tuple) of destination rows (rows of upstream's ``expert_buffer``),
                written by ``execute`` only if every peer's plan agrees with this rank's; same count,
                dtypes and element counts as the sender's tensors, in the same order (shapes may
                differ: elements land in row-major order).
            src_rank: EPLB-group rank, in ``[0, group_size)`` and not this rank.
            expert_id: logical expert id; must equal the sender's at the same position.

        Raises:
            TypeError, ValueError: as :meth:`add_send`. Nothing is queued when it raises.
        """
        self._queue.append(self._validated(False, tensors, src_rank, expert_id))

    def execute(self) -> None:
        """Move every queued tensor; on return all received data is in the destination rows (on an
        accelerator: enqueued on the transfer stream, ordered before later work on it).

        Every rank of the group must call it the same number of times (upstream calls it once per
        layer, or once per migration batch, on every rank), since its call count makes the Gloo tags.

        Before any payload moves, this rank and each peer it has queued transfers with exchange a
        header (the handshake). Per pair and direction, the sender's ``add_send`` calls to the receiver
        and the receiver's ``add_recv`` calls from the sender, in queue order, must agree: the same
        number of experts, the same expert ids, and per expert the same number of tensors with equal
        dtypes and element counts. Where they disagree, both ranks of the pair raise
        :class:`EplbTransferError` with the same description of the difference; where a rank failed
        before the handshake (staging), its peers raise at once naming it. Either way no payload
        moves between the ranks concerned and *no destination row of this rank is written* (payload
        from peers whose plans agreed is still exchanged, so they complete, and is dropped here).
        Peers with no queued transfer are not contacted: a peer that queued nothing for this rank
        while this rank expects data from it is reported after ``timeout_s``.

        Raises:
            EplbTransferError: staging failed, a peer's plan disagreed or it failed, a Gloo request
                failed or did not complete within ``timeout_s``, or a copy failed. It names the
                peers (global ranks), the expert ids of the batch, the disagreements and the ranks
                that did not answer. The queue is empty afterwards, and staging buffers a posted
                request may still touch are dropped from the pool.
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
        base_tag = (sequence % _TAG_MODULUS) * _TAGS_PER_EXECUTE
        staging: list[torch.Tensor] = []
        slots = plan.slots
        stream: torch.Stream | None = None
        non_blocking = False
        local_error: Exception | None = None
        t0 = time.perf_counter()
        # 1. Device-to-host copies into staging, then one wait for all of them. A failure here is
        #    announced to the peers in the handshake instead of leaving them waiting.
        try:
            staging = self._pool.take(plan.requests)
            for slot, buffer in zip(plan.staged_slots, staging, strict=True):
                slots[slot] = buffer
            stream = self._transfer_stream(queue)
            non_blocking = self._pool.pinned and stream is not None
            with device_stream(stream):
                for slot, src in plan.sources:
                    slots[slot].view(src.shape).copy_(src, non_blocking=non_blocking)
            if stream is not None:
                with gpu_sync_allowed():
                    stream.synchronize()
        except Exception as exc:
            local_error = exc
        t1 = time.perf_counter()

        # 2. Handshake with every peer of the batch: agree on the plan before any payload moves.
        shake = self._handshake(queue, base_tag, failed=local_error is not None)
        rank_errors = dict(shake.rank_errors)
        bad = set(rank_errors) | set(shake.mismatches) | set(shake.failed_peers)
        t2 = t3 = time.perf_counter()

        phase = "staging" if local_error is not None else "handshake" if bad else "gloo"
        cause: Exception | None = local_error
        posted = incomplete = False
        if local_error is None:
            # 3./4. One Gloo batch with every peer whose plan agreed, then a bounded wait on each
            # request. Posted op by op, exactly as batch_isend_irecv does for Gloo (no coalescing
            # support), so a failure to post is attributed to its peer and the others still go. If
            # any peer disagreed, receives from the others land in scratch, never in a destination.
            tag = base_tag + _PAYLOAD
            requests: list[tuple[dist.Work, int]] = []
            for is_send, slot, peer, _ in plan.ops:
                if peer in bad or peer in rank_errors:
                    continue
                buffer = slots[slot]
                if bad and not is_send and plan.direct[slot]:
                    buffer = torch.empty_like(buffer)
                try:
                    posted = True
                    if is_send:
                        request = dist.isend(buffer, dst=peer, group=self._cpu_group, tag=tag)
                    else:
                        request = dist.irecv(buffer, src=peer, group=self._cpu_group, tag=tag)
                    requests.append((request, peer))
                except Exception as exc:  # Gloo raises RuntimeError on a closed connection
                    rank_errors[peer] = f"{type(exc).__name__}: {exc}"
            deadline = time.monotonic() + self.timeout_s
            for request, peer in requests:
                if peer in rank_errors:
                    incomplete = True
                    continue
                try:
                    self._waiting_on = peer
                    request.wait(timeout=timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
                except Exception as exc:  # Gloo raises RuntimeError (timeout, closed connection)
                    rank_errors[peer] = f"{type(exc).__name__}: {exc}"
                    incomplete = True
                finally:
                    self._waiting_on = None
            t3 = time.perf_counter()

            # 5. Host-to-device copies into the destination rows, only if everything agreed.
            if not bad and not rank_errors:
                phase = "h2d"
                try:
                    with device_stream(stream):
                        for dst, slot in plan.dests:
                            dst.copy_(slots[slot].view(dst.shape), non_blocking=non_blocking)
                    self._pool.fence(stream)
                    phase = "done"
                except Exception as exc:
                    cause = exc
                    incomplete = True
        t4 = time.perf_counter()
        if phase == "done":
            self._record(
                TransferStats(**stats, d2h_s=t1 - t0, handshake_s=t2 - t1, gloo_s=t3 - t2, h2d_s=t4 - t3)
            )
            return

        if posted and incomplete:
            # A request that did not complete may still read or write its buffer later.
            self._pool.discard(staging)
        self._record(
            TransferStats(
                **{**stats, "bytes_sent": 0, "bytes_received": 0},
                num_failed=1,
                d2h_s=t1 - t0,
                handshake_s=t2 - t1,
                gloo_s=t3 - t2,
                h2d_s=t4 - t3,
            )
        )
        error = self._error(
            queue, layer_idx, sequence, phase, rank_errors, cause, shake.mismatches, shake.failed_peers
        )
        if cause is not None:
            raise error from cause
        raise error

    # -- statistics ------------------------------------------------------------------------------
    @property
    def last_stats(self) -> TransferStats:
        """Statistics of the latest ``execute`` (all zeros before the first)."""
        return self._last

    @property
    def waiting_on(self) -> int | None:
        """The global rank whose Gloo request :meth:`execute` is blocked on now (read from another
        thread: the worker watchdog names a stalled transfer's peer), None when it is not waiting."""
        return self._waiting_on

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
    def _validated(self, is_send: bool, tensors: object, peer: object, expert_id: object) -> _Queued:
        what = "dst_rank" if is_send else "src_rank"
        call = "add_send" if is_send else "add_recv"
        # Types first (TypeError), then values (ValueError); nothing is queued when either raises.
        group_peer = _check_int(what, peer)
        expert_id = _check_int("expert_id", expert_id)
        if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
            got = (
                f"a bare Tensor of shape {tuple(tensors.shape)}"
                if isinstance(tensors, torch.Tensor)
                else f"a {type(tensors).__name__}"
            )
            raise TypeError(
                f"{call} of expert {expert_id}: tensors must be a list of torch.Tensor (one per weight "
                f"view), got {got}"
            )
        tensors = list(tensors)
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(
                    f"{call} of expert {expert_id}: tensors[{i}] is a {type(t).__name__}, not a torch.Tensor"
                )
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
        if not tensors:
            raise ValueError(f"{call} of expert {expert_id} got no tensors")
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

    def _exchange(
        self, outgoing: dict[int, torch.Tensor], incoming: dict[int, torch.Tensor], tag: int
    ) -> dict[int, str]:
        """Send ``outgoing[peer]`` to and receive ``incoming[peer]`` from every peer (same keys),
        then wait for all of it within ``timeout_s``. Returns global peer -> error of a failed one."""
        errors: dict[int, str] = {}
        requests: list[tuple[dist.Work, int]] = []
        for peer in outgoing:
            try:
                requests.append((dist.isend(outgoing[peer], dst=peer, group=self._cpu_group, tag=tag), peer))
                requests.append((dist.irecv(incoming[peer], src=peer, group=self._cpu_group, tag=tag), peer))
            except Exception as exc:  # Gloo raises RuntimeError on a closed connection
                errors.setdefault(peer, f"{type(exc).__name__}: {exc}")
        deadline = time.monotonic() + self.timeout_s
        for request, peer in requests:
            if peer in errors:
                continue
            try:
                self._waiting_on = peer
                request.wait(timeout=timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
            except Exception as exc:  # Gloo raises RuntimeError (timeout, closed connection)
                errors[peer] = f"{type(exc).__name__}: {exc}"
            finally:
                self._waiting_on = None
        return errors

    def _handshake(self, queue: list[_Queued], base_tag: int, failed: bool) -> _Handshake:
        """Agree with every peer of ``queue`` on what moves between the two ranks.

        Round 1, with every peer: a fixed header (this rank's status, the length of its full
        description, a digest of what it sends to the peer and of what it expects from it). Both
        ranks of a pair then hold both headers and decide alike whether the plans agree. Round 2,
        only with peers whose digests disagree: the full descriptions, to name the difference.
        Each rank of a pair posts exactly the same operations as the other whatever the plans say.
        """
        me = self.global_ranks[self.group_rank]
        words = _plan_words(queue)
        peers = sorted(words)
        status = _STATUS_FAILED if failed else _STATUS_OK
        outgoing = {
            p: torch.tensor([status, len(sw) + len(rw), *_digest(sw), *_digest(rw)], dtype=torch.int64)
            for p, (sw, rw) in sorted(words.items())
        }
        incoming = {p: torch.zeros(_HEADER_WORDS, dtype=torch.int64) for p in peers}
        out = _Handshake(rank_errors=self._exchange(outgoing, incoming, base_tag + _HEADER))
        detail_peers = []
        for p in peers:
            if p in out.rank_errors:
                continue
            peer_status, _, *digests = incoming[p].tolist()
            if peer_status != _STATUS_OK:
                out.failed_peers.append(p)
            elif failed:
                continue  # the peer learns of this rank's failure from its header
            elif digests[2:] != outgoing[p].tolist()[2:4] or digests[:2] != outgoing[p].tolist()[4:6]:
                detail_peers.append(p)
        if not detail_peers:
            return out
        full_out = {p: torch.tensor(words[p][0] + words[p][1], dtype=torch.int64) for p in detail_peers}
        full_in = {p: torch.zeros(int(incoming[p][1]), dtype=torch.int64) for p in detail_peers}
        errors = self._exchange(full_out, full_in, base_tag + _DETAIL)
        for p in detail_peers:
            if p in errors:
                out.mismatches[p] = [
                    f"the transfer plans of global ranks {min(me, p)} and {max(me, p)} disagree, and "
                    f"their descriptions could not be exchanged ({errors[p].splitlines()[0]})"
                ]
                continue
            theirs = full_in[p].tolist()
            their_sends = theirs[: _words_length(theirs)]
            their_recvs = theirs[len(their_sends) :]
            my_sends, my_recvs = words[p]
            texts = [
                _describe_mismatch(sender, receiver, sent, expected)
                for sender, receiver, sent, expected in sorted(
                    [(me, p, my_sends, their_recvs), (p, me, their_sends, my_recvs)]
                )
            ]
            out.mismatches[p] = [t for t in texts if t is not None] or [
                f"the transfer plans of global ranks {min(me, p)} and {max(me, p)} disagree (digests differ)"
            ]
        return out

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
        cause: BaseException | None,
        mismatches: dict[int, list[str]],
        failed_peers: list[int],
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
        if mismatches:
            parts.append(
                "the transfer plans disagree: "
                + "; ".join(t for _, texts in sorted(mismatches.items()) for t in texts)
            )
        if failed_peers:
            parts.append(
                f"global rank(s) {sorted(failed_peers)} failed before the handshake and sent nothing"
            )
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
        if cause is not None:
            parts.append(f"cause: {type(cause).__name__}: {cause}")
        if phase == "staging":
            parts.append("nothing was sent or received and no destination row was written")
        elif phase == "handshake":
            excluded = sorted(set(mismatches) | set(failed_peers) | set(rank_errors))
            parts.append(
                f"no payload moved with global rank(s) {excluded} and no destination row of this "
                "execute was written"
            )
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
            mismatches=mismatches,
            failed_peers=sorted(failed_peers),
        )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
