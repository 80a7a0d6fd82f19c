"""``AscendGlooEplbCommunicator``: upstream's EPLB communicator contract over Gloo, with CPU staging.

vLLM's async EPLB worker queues one ``add_send`` per (expert, destination rank) and one ``add_recv`` per
expert it needs, then calls ``execute`` on every rank of the EPLB group, once per layer or migration
batch. Expert tensors move through CPU staging over the group's Gloo process group, never by device
collectives next to the foreground MoE traffic, pipelined (``_transfer.py``): D2H copies, a per-pair plan
handshake (``_wire.py``), each pair's payload once it agrees, H2D copies as receives land, all under one
deadline (README "Behaviour worth knowing"). CPU tensors take no stream, event or ``torch.accelerator``
call. The overridden methods are rows of ``ascend_eplb.control.upstream`` (``OVERRIDES``, ``SIGNATURES``),
checked against vLLM 0.33.0 before the first patch.
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
        stream: stream of the staging copies (the async worker's, usually via :meth:`set_stream`);
            ``None``: the current stream.
        staging_pool: default a new :class:`StagingPool`; may be shared by communicators used one
            after another (main and draft model).
        timeout_s: one deadline, in seconds after ``execute``'s start, on all its Gloo requests; a
            rank that never posts its side is named in :class:`EplbTransferError` (Gloo then closes
            its connections, so later transfers fail at once instead of hanging: README).
        stage_host_tensors: also stage contiguous host tensors (Gloo reads them directly by default,
            as upstream's); tests set it to run the device path's staging on CPU.

    Peer ranks are EPLB-group ranks, translated with ``torch.distributed.get_global_rank``.
    Raises ``TypeError`` for a ``cpu_group`` that is not a ``ProcessGroup`` this process belongs to,
    ``ValueError`` for a ``timeout_s`` that is not positive.
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
            tensors: list (or tuple) of the expert's row of every weight view, any device, dtype and
                strides, read during ``execute``; the receiver's must match in count, order, dtype
                and element count (the handshake checks).
            dst_rank: EPLB-group rank in ``[0, group_size)``, not this rank.
            expert_id: logical expert id, queued by the receiver at the same position.

        Raises (nothing queued):
            TypeError: ``tensors`` not a list/tuple (a bare tensor included), a non-tensor element,
                or a ``dst_rank``/``expert_id`` that is not an int (``bool`` rejected).
            ValueError: ``dst_rank`` outside the group or this rank, or ``tensors`` empty.
        """
        self._queue.append(self._validated(True, tensors, dst_rank, expert_id))

    def add_recv(self, tensors: list[torch.Tensor], src_rank: int, expert_id: int) -> None:
        """Queue receiving one expert's tensors from EPLB-group rank ``src_rank``.

        ``tensors``: destination rows (of upstream's ``expert_buffer``), written only if every peer's plan
        agrees; the sender's count, order, dtypes and element counts (shapes may differ: row-major).
        ``src_rank``, ``expert_id`` and errors as :meth:`add_send`.
        """
        self._queue.append(self._validated(False, tensors, src_rank, expert_id))

    def execute(self) -> None:
        """Move every queued tensor; on return the received data is in the destination rows (on an
        accelerator: enqueued on the transfer stream). Every rank calls it equally often (the call
        count makes the Gloo tags).

        Per pair and direction the sender's ``add_send`` and the receiver's ``add_recv`` calls, in
        queue order, must agree in expert ids and, per expert, tensor count, dtypes and element
        counts. A pair that disagrees, or a peer that failed before the handshake, raises on both
        sides with the same description, and no destination row of this rank is written; payload of
        agreeing peers still moves (and is dropped here). A peer lost mid-payload leaves rows partly
        written (upstream never commits a layer whose transfer raised). Peers with nothing queued
        are not contacted.

        Raises:
            EplbTransferError: staging, a plan, a peer, a Gloo request (or ``timeout_s``) or a copy
                failed; it names the global peer ranks, expert ids, disagreements and silent ranks.
                The queue is empty afterwards; buffers a posted request may still touch leave the pool.
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
