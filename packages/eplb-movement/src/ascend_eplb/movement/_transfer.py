"""One ``execute`` of :class:`~ascend_eplb.movement.AscendGlooEplbCommunicator`, start to finish.

1. Staging: every device-to-host copy issued at once on the transfer stream, an event per expert; a
   failure is announced to the peers in the header.
2. Headers to and from every peer posted together.
3. Per peer, by ascending global rank: its header decided as the peer decides it; an agreeing pair
   starts its payload at once (each send once its expert's copy landed, staged receives), a
   disagreeing pair exchanges full descriptions.
4. After every verdict: receives straight into destination rows (host tensors), into scratch if any
   pair failed; staged receives copied into their rows as they land when all agreed.
5. Sends, headers and descriptions waited for; every wait bounded by one deadline ``timeout_s``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from vllm.distributed.eplb.eplb_utils import device_stream
from vllm.utils.gpu_sync_debug import gpu_sync_allowed

from ascend_eplb.movement import _wire
from ascend_eplb.movement._plan import Queued, TransferPlan
from ascend_eplb.movement.staging import StagingPool
from ascend_eplb.movement.stats import TransferStats

__all__: list[str] = []


class Requests:
    """The Gloo requests of one ``execute``: posting them, and the one bounded wait on each."""

    def __init__(self, group: ProcessGroup, timeout_s: float):
        self._group = group
        self.deadline = time.monotonic() + timeout_s
        #: Global peer -> the error of its first failed request.
        self.errors: dict[int, str] = {}
        #: The global rank whose request :meth:`wait` is blocked on now, else None.
        self.waiting_on: int | None = None

    def post(self, is_send: bool, tensor: torch.Tensor, peer: int, tag: int) -> dist.Work | None:
        """Post one isend/irecv with global rank ``peer``; None (nothing posted) when the peer has
        failed already or posting fails (Gloo raises on a closed connection; recorded)."""
        if peer in self.errors:
            return None
        try:
            if is_send:
                return dist.isend(tensor, dst=peer, group=self._group, tag=tag)
            return dist.irecv(tensor, src=peer, group=self._group, tag=tag)
        except Exception as exc:
            self.errors.setdefault(peer, f"{type(exc).__name__}: {exc}")
            return None

    def wait(self, request: dist.Work | None, peer: int) -> bool:
        """Wait for ``request`` until the deadline. False when it was never posted, its peer had
        failed before (it is then not waited for), or it fails now (timed out, connection lost)."""
        if request is None or peer in self.errors:
            return False
        try:
            self.waiting_on = peer
            request.wait(timeout=timedelta(seconds=max(self.deadline - time.monotonic(), 1e-3)))
        except Exception as exc:  # Gloo raises RuntimeError (timeout, closed connection)
            self.errors.setdefault(peer, f"{type(exc).__name__}: {exc}")
            return False
        finally:
            self.waiting_on = None
        return True


class Transfer:
    """The state of one ``execute`` (see the module docstring); :meth:`run` moves everything."""

    def __init__(
        self,
        queue: list[Queued],
        plan: TransferPlan,
        *,
        group: ProcessGroup,
        me: int,
        sequence: int,
        timeout_s: float,
        pool: StagingPool,
        stream_of: Callable[[list[Queued]], torch.Stream | None],
    ):
        self.queue = queue
        self.plan = plan
        self.me = me
        self.requests = Requests(group, timeout_s)
        self._tag = _wire.base_tag(sequence)
        self._pool = pool
        self._stream_of = stream_of
        self.stream: torch.Stream | None = None
        self._non_blocking = False
        self.staging: list[torch.Tensor] = []
        # Accelerator only: queue index -> event after that expert's device-to-host copies.
        self._copied: dict[int, torch.Event] = {}
        self._landed_upto = -1  # the copies of every expert up to this queue index have landed
        #: Why this rank failed: in staging (``phase == "staging"``) or in a copy out.
        self.cause: Exception | None = None
        self.phase = "staging"
        self.copy_fault = False  # a device-to-host copy failed after the handshake
        self.mismatches: dict[int, list[str]] = {}
        self.failed_peers: list[int] = []
        # The handshake: this rank's plan words and headers, the peers' headers, their requests.
        self._words: dict[int, tuple[list[int], list[int]]] = {}
        self._mine: dict[int, torch.Tensor] = {}
        self._theirs: dict[int, torch.Tensor] = {}
        self._header_recvs: dict[int, dist.Work | None] = {}
        self._unheard: list[int] = []  # peers whose header did not arrive
        self._details: dict[int, torch.Tensor] = {}  # disagreeing peer -> its full description
        self._late: list[tuple[dist.Work | None, int]] = []  # header sends, descriptions: waited last
        self._sends: list[tuple[dist.Work | None, int]] = []
        self._recvs: list[tuple[dist.Work | None, int, int]] = []  # (request, peer, slot)
        self.posted = False  # a payload request was posted
        self.incomplete = False  # ... and one of them was not seen to complete
        self._d2h_s = self._handshake_s = self._h2d_s = 0.0
        self._start = time.perf_counter()
        self._end = self._start

    # -- the execute -------------------------------------------------------------------------------
    def run(self) -> None:
        """Move every queued tensor; :attr:`phase` is ``"done"`` afterwards, or where it failed."""
        failed = not self._stage()
        self._post_headers(failed)
        agreed = []
        for p, ops in self.plan.peers.items():
            if self._pair_agrees(p, failed):
                agreed.append(p)
                if ops.recvs_staged:  # into staging: safe before the other pairs' verdicts
                    self._post_recvs(p, scratch=False)
                self._post_sends(p)
        bad = set(self._unheard) | set(self._details) | set(self.failed_peers)
        if not failed:
            # A copy that failed after the handshake (an accelerator fault) stays a staging failure.
            if self.cause is None:
                self.phase = "handshake" if bad else "gloo"
            for p in agreed:
                if not self.plan.peers[p].recvs_staged:
                    self._post_recvs(p, scratch=bool(bad) or self.cause is not None)
        self._wait_payload(copy_out=self.phase == "gloo")
        for request, p in self._late:
            self.requests.wait(request, p)
        for p, received in self._details.items():
            self.mismatches[p] = self._disagreement(p, received)
        self._end = time.perf_counter()

    def stats(self, counts: dict[str, int]) -> TransferStats:
        """This execute's statistics from its ``counts`` (experts, tensors, bytes; no bytes moved when
        it failed). ``gloo_s`` is the wall time of the execute not spent in the other phases."""
        if self.phase != "done":
            counts = {**counts, "bytes_sent": 0, "bytes_received": 0, "num_failed": 1}
        wall = self._end - self._start
        return TransferStats(
            **counts,
            d2h_s=self._d2h_s,
            handshake_s=self._handshake_s,
            gloo_s=max(wall - self._d2h_s - self._handshake_s - self._h2d_s, 0.0),
            h2d_s=self._h2d_s,
        )

    # -- steps -------------------------------------------------------------------------------------
    def _post_headers(self, failed: bool) -> None:
        """Post the header exchange with every peer (received into ``_theirs``)."""
        self._words = _wire.plan_words(self.queue)
        self._mine = {p: _wire.header(failed, *self._words[p]) for p in self.plan.peers}
        self._theirs = {p: torch.zeros(_wire.HEADER_WORDS, dtype=torch.int64) for p in self.plan.peers}
        for p in self.plan.peers:
            self._header_recvs[p] = self.requests.post(False, self._theirs[p], p, self._tag + _wire.HEADER)
            self._late.append((self.requests.post(True, self._mine[p], p, self._tag + _wire.HEADER), p))

    def _pair_agrees(self, peer: int, failed: bool) -> bool:
        """Wait for ``peer``'s header and judge the pair as the peer does: True when both ranks are
        ok and their plans agree. A disagreeing pair posts the exchange of its full descriptions."""
        start = time.perf_counter()
        try:
            if not self.requests.wait(self._header_recvs[peer], peer):
                self._unheard.append(peer)
                return False
            theirs = self._theirs[peer].tolist()
            if _wire.peer_failed(theirs):
                self.failed_peers.append(peer)
                return False
            if failed:
                return False  # the peer learns of this rank's failure from its header
            if _wire.plans_agree(self._mine[peer].tolist(), theirs):
                return True
            self._details[peer] = torch.zeros(theirs[1], dtype=torch.int64)
            full = torch.tensor(self._words[peer][0] + self._words[peer][1], dtype=torch.int64)
            self._late.append((self.requests.post(True, full, peer, self._tag + _wire.DETAIL), peer))
            self._late.append(
                (self.requests.post(False, self._details[peer], peer, self._tag + _wire.DETAIL), peer)
            )
            return False
        finally:
            self._handshake_s += time.perf_counter() - start

    def _stage(self) -> bool:
        """Take the staging buffers and issue every device-to-host copy; False when that failed."""
        start = time.perf_counter()
        plan = self.plan
        try:
            self.staging = self._pool.take(plan.requests)
            for slot, buffer in zip(plan.staged_slots, self.staging, strict=True):
                plan.slots[slot] = buffer
            self.stream = self._stream_of(self.queue)
            self._non_blocking = self._pool.pinned and self.stream is not None
            with device_stream(self.stream):
                for i, (item, slot, src) in enumerate(plan.copies):
                    plan.slots[slot].view(src.shape).copy_(src, non_blocking=self._non_blocking)
                    last_of_expert = i + 1 == len(plan.copies) or plan.copies[i + 1][0] != item
                    if self.stream is not None and last_of_expert:
                        self._copied[item] = self.stream.record_event()
        except Exception as exc:
            self.cause = exc
            return False
        finally:
            self._d2h_s += time.perf_counter() - start
        return True

    def _post_sends(self, peer: int) -> None:
        for slot in self.plan.peers[peer].sends:
            if self.cause is not None:
                return
            if not self.plan.direct[slot]:
                self._await_copy(self.plan.copied_by[slot])
                if self.cause is not None:
                    self.incomplete = True  # this rank's later sends are never posted
                    return
            self.posted = True
            request = self.requests.post(True, self.plan.slots[slot], peer, self._tag + _wire.PAYLOAD)
            self._sends.append((request, peer))

    def _post_recvs(self, peer: int, *, scratch: bool) -> None:
        """Post every receive from ``peer``; a direct one into scratch when ``scratch``."""
        for slot in self.plan.peers[peer].recvs:
            buffer = self.plan.slots[slot]
            if scratch and self.plan.direct[slot]:
                buffer = torch.empty_like(buffer)
            self.posted = True
            request = self.requests.post(False, buffer, peer, self._tag + _wire.PAYLOAD)
            self._recvs.append((request, peer, slot))

    def _wait_payload(self, *, copy_out: bool) -> None:
        """Wait for every receive, then every send. With ``copy_out``, each staged receive is
        copied into its destination row as soon as it landed; ``phase`` becomes ``"done"`` when
        everything completed."""
        for request, peer, slot in self._recvs:
            if not self.requests.wait(request, peer):
                self.incomplete = True
                copy_out = False
            elif copy_out and slot in self.plan.dests:
                copy_out = self._copy_out(slot)
        for request, peer in self._sends:
            if not self.requests.wait(request, peer):
                self.incomplete = True
        if copy_out and not self.incomplete and self.phase == "gloo":
            start = time.perf_counter()
            self._pool.fence(self.stream)
            self._h2d_s += time.perf_counter() - start
            self.phase = "done"

    def _copy_out(self, slot: int) -> bool:
        """Issue the host-to-device copy of a landed staged receive; False (and phase ``h2d``) if it
        raised."""
        start = time.perf_counter()
        dst = self.plan.dests[slot]
        try:
            with device_stream(self.stream):
                dst.copy_(self.plan.slots[slot].view(dst.shape), non_blocking=self._non_blocking)
        except Exception as exc:
            self.cause = exc
            self.phase = "h2d"
            self.incomplete = True
            return False
        finally:
            self._h2d_s += time.perf_counter() - start
        return True

    def _await_copy(self, item: int) -> None:
        """Block until the device-to-host copies of queue items up to ``item`` landed (accelerator;
        on CPU they completed when issued)."""
        if self.stream is None or item <= self._landed_upto:
            return
        start = time.perf_counter()
        try:
            with gpu_sync_allowed():
                self._copied[item].synchronize()
            self._landed_upto = item
        except Exception as exc:  # an asynchronous accelerator fault, seen only now
            self.cause = exc
            self.copy_fault = True
        finally:
            self._d2h_s += time.perf_counter() - start

    def _disagreement(self, peer: int, received: torch.Tensor) -> list[str]:
        error = self.requests.errors.get(peer)
        if error is not None:
            return [
                f"the transfer plans of global ranks {min(self.me, peer)} and {max(self.me, peer)} "
                f"disagree, and their descriptions could not be exchanged ({error.splitlines()[0]})"
            ]
        return _wire.describe_disagreement(self.me, peer, self._words[peer], received.tolist())
