"""One ``execute``'s transfer plan: the queued experts and the layout Gloo reads and writes.

Built once per ``execute`` from the queue, before anything moves: one slot per Gloo operation's
buffer (the caller's tensor itself for a contiguous host tensor, else a staging buffer from the
pool), the staging copies in queue order, and every peer's operations in the order both ranks of
the pair post them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__: list[str] = []


@dataclass(slots=True)
class Queued:
    """One ``add_send`` / ``add_recv`` call: an expert's tensors to or from one peer."""

    is_send: bool
    tensors: list[torch.Tensor]
    group_peer: int
    global_peer: int
    expert_id: int


@dataclass(slots=True)
class PeerOps:
    """A peer's tensor operations, as slots, in queue order (the order the peer posts its side in, so
    Gloo pairs them one to one)."""

    sends: list[int] = field(default_factory=list)
    recvs: list[int] = field(default_factory=list)
    # True when every receive from the peer lands in staging (none directly in a destination row).
    recvs_staged: bool = True


@dataclass(slots=True)
class TransferPlan:
    """The layout of one ``execute`` (see the module docstring)."""

    # Per slot: the tensor Gloo uses directly (a contiguous host tensor), or None until a staging
    # buffer is taken from the pool.
    slots: list[torch.Tensor | None] = field(default_factory=list)
    # Per slot: True when Gloo reads or writes the caller's tensor itself (no staging).
    direct: list[bool] = field(default_factory=list)
    # Staged slots, aligned with ``requests`` ((dtype, numel) asked of the pool).
    staged_slots: list[int] = field(default_factory=list)
    requests: list[tuple[torch.dtype, int]] = field(default_factory=list)
    # Distinct staged send tensors, in queue order: (expert index in the queue, slot, source).
    copies: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)
    # Staged send slot -> expert index (in the queue) whose copies fill it.
    copied_by: dict[int, int] = field(default_factory=dict)
    # Staged receive slot -> its destination row, copied out once the slot's receive landed.
    dests: dict[int, torch.Tensor] = field(default_factory=dict)
    # Global peer -> its operations, peers in ascending order.
    peers: dict[int, PeerOps] = field(default_factory=dict)

    @classmethod
    def build(cls, queue: list[Queued], *, stage_host_tensors: bool) -> TransferPlan:
        plan = cls()
        source_slot: dict[tuple, int] = {}
        for q in sorted({q.global_peer for q in queue}):
            plan.peers[q] = PeerOps()
        for item, q in enumerate(queue):
            ops = plan.peers[q.global_peer]
            for t in q.tensors:
                direct = not stage_host_tensors and t.device.type == "cpu" and t.is_contiguous()
                if q.is_send:
                    # A source sent to several peers is staged (and copied) once.
                    key = (t.device, t.dtype, t.data_ptr(), tuple(t.shape), tuple(t.stride()))
                    slot = source_slot.get(key)
                    if slot is None:
                        slot = source_slot[key] = plan._add_slot(t, direct)
                        if not direct:
                            plan.copies.append((item, slot, t))
                            plan.copied_by[slot] = item
                    ops.sends.append(slot)
                else:
                    slot = plan._add_slot(t, direct)
                    if direct:
                        ops.recvs_staged = False
                    else:
                        plan.dests[slot] = t
                    ops.recvs.append(slot)
        return plan

    def _add_slot(self, tensor: torch.Tensor, direct: bool) -> int:
        self.slots.append(tensor if direct else None)
        self.direct.append(direct)
        if not direct:
            self.staged_slots.append(len(self.slots) - 1)
            self.requests.append((tensor.dtype, tensor.numel()))
        return len(self.slots) - 1

    @property
    def num_send_tensors(self) -> int:
        return sum(len(ops.sends) for ops in self.peers.values())

    @property
    def num_recv_tensors(self) -> int:
        return sum(len(ops.recvs) for ops in self.peers.values())
