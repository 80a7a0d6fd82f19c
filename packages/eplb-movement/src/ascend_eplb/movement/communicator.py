"""``AscendGlooEplbCommunicator``: upstream's EPLB communicator contract over Gloo, with CPU staging.

vLLM's async EPLB worker moves one MoE layer at a time (``transfer_layer`` -> ``move_to_buffer``):
it queues one ``add_send`` per (expert, destination rank) and one ``add_recv`` per expert it needs,
then calls ``execute`` once (once per batch with migration batching), on every rank of the EPLB
group. The worker must not issue device collectives next to the foreground MoE communication, so
this communicator moves expert tensors through CPU memory over the EPLB group's Gloo (CPU) process
group, pipelined (``_transfer.py``):

1. device-to-host copies of every distinct send tensor into :class:`StagingPool` buffers, all
   issued at once on the worker's stream, an event after each expert's;
2. a handshake with every peer of the batch, before any payload moves between the two: each side
   sends a fixed 48-byte header (its local status and digests of what it will send to and expects
   from that peer: expert ids, tensor counts, dtypes, element counts); the two sides of a pair
   reach the same verdict from the same two headers, and only a pair that disagrees exchanges its
   full descriptions (``_wire.py``), so every Gloo operation on the group stays paired even when
   the plans differ;
3. per pair, as soon as its verdict is in: the payload with that peer (peers translated from
   EPLB-group ranks to global ranks; tags per ``execute`` keep a failed layer's stragglers from
   matching a later layer's operations), each send posted once its expert's copy landed, so the
   copy of the next expert overlaps the Gloo transfer of the current one;
4. a wait on every request, all bounded by one deadline ``timeout_s`` after the start;
5. host-to-device copies from staging into the destination rows, each issued as soon as its
   receive landed (while later ones are still arriving), once every pair agreed.

On a host without an accelerator (CPU tensors) every copy is synchronous and no stream, event or
``torch.accelerator`` call is made, so it runs on CPU-only CI without any adaptation of torch.

Its overrides of upstream's ``EplbCommunicator`` (``add_send``, ``add_recv``, ``execute``,
``set_stream``, ``set_transfer_context``, ``needs_profile_buffer_reservation``) and the upstream
helper it calls (``_log_initialized``) are rows of the one upstream surface,
``ascend_eplb.control.upstream`` (``OVERRIDES``, ``SIGNATURES``; this plane cannot import control):
the integration's ``check_upstream()`` checks, before the first patch, that upstream's signatures are
still vLLM 0.33.0's and that each method here still extends upstream's parameters.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from vllm.distributed.eplb.eplb_communicator import EplbCommunicator

from ascend_eplb.movement._errors import EplbTransferError, transfer_error
from ascend_eplb.movement._plan import Queued, TransferPlan
from ascend_eplb.movement._transfer import Transfer
from ascend_eplb.movement._values import is_int
from ascend_eplb.movement.staging import StagingPool
from ascend_eplb.movement.stats import TransferStats

__all__ = ["DEFAULT_TRANSFER_TIMEOUT_S", "AscendGlooEplbCommunicator", "EplbTransferError"]

logger = logging.getLogger(__name__)

#: Default bound on waiting for one ``execute``'s Gloo requests, in seconds.
DEFAULT_TRANSFER_TIMEOUT_S = 300.0


def _check_int(name: str, value: object) -> int:
    if not is_int(value):
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
        timeout_s: bound, in seconds, on waiting for all Gloo requests of one ``execute`` (headers
            and payload: one deadline, this long after the start). A rank that never posts its side
            makes the others raise :class:`EplbTransferError` naming it after this long. Gloo then
            closes every connection of this rank in the group (measured with torch 2.13: later
            requests raise "Application timeout caused pair closure", and the peers see "Connection
            closed by peer"), so later transfers over the group fail at once, naming the ranks,
            instead of hanging.
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
        self._queue: list[Queued] = []
        self._layer_idx: int | None = None
        self._sequence = 0
        self._last = TransferStats()
        self._cumulative = TransferStats()
        self._transfer: Transfer | None = None  # the execute running now (see waiting_on)
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

        Before any payload moves between two ranks, they exchange a header (the handshake). Per pair
        and direction, the sender's ``add_send`` calls to the receiver and the receiver's ``add_recv``
        calls from the sender, in queue order, must agree: the same number of experts, the same
        expert ids, and per expert the same number of tensors with equal dtypes and element counts.
        Where they disagree, both ranks of the pair raise :class:`EplbTransferError` with the same
        description of the difference; where a rank failed before the handshake (staging), its peers
        raise at once naming it. Either way no payload moves between the ranks concerned and *no
        destination row of this rank is written* (payload from peers whose plans agreed is still
        exchanged, so they complete, and is dropped here). Peers with no queued transfer are not
        contacted: a peer that queued nothing for this rank while this rank expects data from it is
        reported after ``timeout_s``.

        The handshake is per pair: a pair that agrees starts its payload at once, without waiting
        for this rank's other pairs. Sends are posted as their expert's device-to-host copy lands and
        staged receives are copied into their destination rows as they land; receives into
        destination rows (host tensors read directly), and every copy into one, wait until every
        pair has agreed. A peer lost after that, mid-payload, leaves this execute's destination rows
        partly written (upstream never commits a layer whose transfer raised).

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
        if not queue:
            self._record(TransferStats(num_executes=1))
            return
        plan = TransferPlan.build(queue, stage_host_tensors=self.stage_host_tensors)
        counts = dict(
            num_executes=1,
            num_send_experts=sum(q.is_send for q in queue),
            num_recv_experts=sum(not q.is_send for q in queue),
            num_send_tensors=plan.num_send_tensors,
            num_recv_tensors=plan.num_recv_tensors,
            bytes_sent=sum(_nbytes(t) for q in queue if q.is_send for t in q.tensors),
            bytes_received=sum(_nbytes(t) for q in queue if not q.is_send for t in q.tensors),
            staging_bytes=sum(dtype.itemsize * numel for dtype, numel in plan.requests),
        )
        transfer = self._transfer = Transfer(
            queue,
            plan,
            group=self._cpu_group,
            me=self.global_ranks[self.group_rank],
            sequence=self._sequence,
            timeout_s=self.timeout_s,
            pool=self._pool,
            stream_of=self._transfer_stream,
        )
        try:
            transfer.run()
        finally:
            self._transfer = None  # holds the caller's tensors: only while the execute runs
        self._record(transfer.stats(counts))
        if transfer.phase == "done":
            return
        if transfer.posted and transfer.incomplete:
            # A request that did not complete may still read or write its buffer later.
            self._pool.discard(transfer.staging)
        error = transfer_error(
            queue,
            me=transfer.me,
            timeout_s=self.timeout_s,
            layer_idx=layer_idx,
            sequence=self._sequence,
            phase=transfer.phase,
            rank_errors=transfer.requests.errors,
            cause=transfer.cause,
            mismatches=transfer.mismatches,
            failed_peers=transfer.failed_peers,
            copy_fault=transfer.copy_fault,
        )
        if transfer.cause is not None:
            raise error from transfer.cause
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
        transfer = self._transfer
        return transfer.requests.waiting_on if transfer is not None else None

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
    def _validated(self, is_send: bool, tensors: object, peer: object, expert_id: object) -> Queued:
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
        return Queued(is_send, tensors, group_peer, self.global_ranks[group_peer], expert_id)

    def _transfer_stream(self, queue: list[Queued]) -> torch.Stream | None:
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


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
