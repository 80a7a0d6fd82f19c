"""Device replica lookup: which physical replica serves a (token row, logical expert) pair.

A fixed-shape ``int32`` table ``(rows, E)`` on the routing device, built from one MoE layer's committed
placement (upstream's ``logical_to_physical_map (E, M)``, -1 padded, and ``logical_replica_count (E,)``)::

    table[row, e] = logical_to_physical_map[e, (row + phase + e) % logical_replica_count[e]]

vLLM Ascend's ``build_expert_replica_routing_table`` without its ``ep_rank`` term: the table is the same
on every rank (``phase`` 0) and token ``t`` reads row ``(t + replica_offset) % rows``, the offset being
the forward's row layout, so ranks routing the same rows choose the same replica (replica agreement,
README). Refreshed in place (``copy_``): graphs holding the table stay valid across placements.
"""

from __future__ import annotations

import ctypes
import hashlib
import numbers

import torch

__all__ = [
    "DEFAULT_ROWS",
    "ReplicaLookup",
    "build_replica_table",
    "replica_maps",
    "split_inputs",
    "table_checksum",
    "validate_placement",
]

#: Rows of the lookup table (vLLM Ascend ``EXPERT_REPLICA_ROUTING_TABLE_NUM_ROWS``).
DEFAULT_ROWS = 1024

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def is_int(value: object) -> bool:
    """Whether ``value`` is a ``numbers.Integral`` (numpy integers included) and not a ``bool``.

    Each of quant_views, dataplane, movement and control keeps one copy (no package all four may
    import); ``tests/test_one_home.py`` checks that they agree.
    """
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_load_view_metadata(expert_load_view: object) -> torch.Tensor:
    """Check a load view's metadata: a dense 1-D int32 or int64 ``(P,)``, not stride-0; return it.

    Used by the lookup and both ops; the counter count and device are each caller's rule.
    Raises ``ValueError`` naming the view's dtype and shape (or type), layout or stride.
    """
    if (
        not isinstance(expert_load_view, torch.Tensor)
        or expert_load_view.dim() != 1
        or expert_load_view.dtype not in (torch.int32, torch.int64)
    ):
        got = (
            f"{expert_load_view.dtype} {tuple(expert_load_view.shape)}"
            if isinstance(expert_load_view, torch.Tensor)
            else type(expert_load_view).__name__
        )
        raise ValueError(f"expert_load_view must be int32 or int64 (P,), got {got}")
    if expert_load_view.layout != torch.strided:
        raise ValueError(f"expert_load_view must be a dense tensor, got layout {expert_load_view.layout}")
    if expert_load_view.shape[0] > 1 and expert_load_view.stride(0) == 0:
        raise ValueError(
            f"expert_load_view must not be a stride-0 (expanded) view, got shape "
            f"{tuple(expert_load_view.shape)} stride {tuple(expert_load_view.stride())}: its P "
            "counters would share one element"
        )
    return expert_load_view


def _check_int(name: str, value: object, minimum: int) -> int:
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def validate_placement(
    logical_to_physical_map: torch.Tensor,
    logical_replica_count: torch.Tensor,
    *,
    num_logical_experts: int | None = None,
    num_physical_experts: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Check one layer's committed placement and return host copies (reads the maps: commit time only).

    Args:
        logical_to_physical_map: integer ``(E, M)``; row ``e`` holds expert ``e``'s physical ids in
            its first ``logical_replica_count[e]`` entries, then ``-1`` (upstream's layout).
        logical_replica_count: integer ``(E,)``.
        num_logical_experts: expected ``E``; ``None`` accepts the map's row count.
        num_physical_experts: ``P``, ids lie in ``[0, P)``; ``None`` infers ``sum(logical_replica_count)``
            (pass ``P`` where slots may be empty: elastic-EP scale-up).

    Returns ``(logical_to_physical_map, logical_replica_count, P)``, the maps as ``int64`` CPU tensors.

    Raises:
        TypeError: a map is not an integer tensor.
        ValueError: wrong shapes, ``E`` mismatch, an expert with no replica, a count above ``M``,
            a replica id outside ``[0, P)``, padding that is not ``-1``, or one physical id serving
            two replicas; the message names the expert and value.
    """
    for name, t in (
        ("logical_to_physical_map", logical_to_physical_map),
        ("logical_replica_count", logical_replica_count),
    ):
        if not isinstance(t, torch.Tensor) or t.dtype not in _INT_DTYPES:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{name} must be an integer torch.Tensor, got {got}")
    if logical_to_physical_map.dim() != 2:
        raise ValueError(
            f"logical_to_physical_map must be 2-D (E, M), got shape {tuple(logical_to_physical_map.shape)}"
        )
    num_experts, max_replicas = logical_to_physical_map.shape
    if logical_replica_count.shape != (num_experts,):
        raise ValueError(
            f"logical_replica_count must have shape ({num_experts},) to match logical_to_physical_map "
            f"{tuple(logical_to_physical_map.shape)}, got {tuple(logical_replica_count.shape)}"
        )
    if num_logical_experts is not None and num_experts != num_logical_experts:
        raise ValueError(
            f"logical_to_physical_map has {num_experts} logical experts, "
            f"this lookup has {num_logical_experts}"
        )
    if num_experts == 0 or max_replicas == 0:
        raise ValueError(
            f"logical_to_physical_map must be non-empty, got shape {tuple(logical_to_physical_map.shape)}"
        )
    l2p = logical_to_physical_map.detach().to("cpu", torch.int64)
    count = logical_replica_count.detach().to("cpu", torch.int64)

    bad = torch.nonzero(count < 1).flatten()
    if bad.numel():
        e = int(bad[0])
        raise ValueError(
            f"logical expert {e} has no replica (logical_replica_count[{e}] = {int(count[e])}); "
            "every logical expert needs at least one physical replica"
        )
    bad = torch.nonzero(count > max_replicas).flatten()
    if bad.numel():
        e = int(bad[0])
        raise ValueError(
            f"logical_replica_count[{e}] = {int(count[e])} exceeds M = {max_replicas}, the replica "
            "columns of logical_to_physical_map"
        )
    if num_physical_experts is None:
        num_physical_experts = int(count.sum())
    else:
        _check_int("num_physical_experts", num_physical_experts, 1)
    used = torch.arange(max_replicas).unsqueeze(0) < count.unsqueeze(1)  # (E, M)
    bad = torch.nonzero(used & ((l2p < 0) | (l2p >= num_physical_experts)))
    if bad.numel():
        e, r = (int(v) for v in bad[0])
        raise ValueError(
            f"logical_to_physical_map[{e}, {r}] = {int(l2p[e, r])} is outside [0, {num_physical_experts}), "
            f"the physical expert ids (num_physical_experts = {num_physical_experts})"
        )
    bad = torch.nonzero(~used & (l2p != -1))
    if bad.numel():
        e, r = (int(v) for v in bad[0])
        raise ValueError(
            f"logical_to_physical_map[{e}, {r}] = {int(l2p[e, r])} lies beyond logical_replica_count[{e}] = "
            f"{int(count[e])}; padding must be -1"
        )
    hits = torch.bincount(l2p[used], minlength=num_physical_experts)
    bad = torch.nonzero(hits > 1).flatten()
    if bad.numel():
        p = int(bad[0])
        owners = torch.nonzero((l2p == p) & used)[:, 0].tolist()
        raise ValueError(
            f"physical expert {p} is listed {int(hits[p])} times (logical experts {owners}); "
            "each physical slot holds exactly one replica"
        )
    return l2p, count, num_physical_experts


def _replica_table(l2p: torch.Tensor, count: torch.Tensor, phase: int, rows: int) -> torch.Tensor:
    num_experts = l2p.shape[0]
    row = torch.arange(rows, device=l2p.device).unsqueeze(1)  # (rows, 1)
    expert = torch.arange(num_experts, device=l2p.device).unsqueeze(0)  # (1, E)
    replica = (row + phase + expert) % count.unsqueeze(0)  # (rows, E)
    return torch.gather(l2p.t(), 0, replica).to(torch.int32)


def build_replica_table(
    logical_to_physical_map: torch.Tensor,
    logical_replica_count: torch.Tensor,
    phase: int = 0,
    rows: int = DEFAULT_ROWS,
    *,
    num_physical_experts: int | None = None,
) -> torch.Tensor:
    """The replica table of one placement, as a new tensor (pure function, no lookup object).

    Args:
        logical_to_physical_map: integer ``(E, M)``, -1 padded (see :func:`validate_placement`).
        logical_replica_count: integer ``(E,)``.
        phase: a constant replica shift, ``>= 0``; 0 is a :class:`ReplicaLookup`'s table, another
            phase a shifted rule's (vLLM Ascend's puts the EP rank there), for comparisons.
        rows: table rows, ``>= 1``.
        num_physical_experts: ``P`` for the id range check; ``None`` infers ``sum(count)``.

    Returns:
        ``int32 (rows, E)`` on the CPU (module docstring's rule).

    Raises:
        TypeError, ValueError: as :func:`validate_placement`; ``phase < 0`` or ``rows < 1``.
    """
    _check_int("phase", phase, 0)
    _check_int("rows", rows, 1)
    l2p, count, _ = validate_placement(
        logical_to_physical_map, logical_replica_count, num_physical_experts=num_physical_experts
    )
    return _replica_table(l2p, count, phase, rows)


def replica_maps(
    physical_to_logical: torch.Tensor, num_logical_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's placement ``(P,)`` (each slot's logical expert) as upstream's maps: int64 CPU
    ``(logical_to_physical_map (E, P - E + 1), logical_replica_count (E,))``, each expert's slots
    ascending, -1 padded (what :meth:`ReplicaLookup.refresh_` takes).

    Raises:
        ValueError: ``P < E``, or an id outside ``[0, E)`` (naming it).
    """
    row = physical_to_logical.detach().to("cpu", torch.int64).flatten()
    num_physical = row.numel()
    _check_int("num_logical_experts", num_logical_experts, 1)
    if num_physical < num_logical_experts:
        raise ValueError(f"a placement of {num_physical} slots cannot hold E = {num_logical_experts} experts")
    bad = (row < 0) | (row >= num_logical_experts)
    if bool(bad.any()):
        slot = int(torch.nonzero(bad)[0])
        raise ValueError(f"slot {slot} holds expert {int(row[slot])}, outside [0, {num_logical_experts})")
    count = torch.bincount(row, minlength=num_logical_experts)
    order = torch.argsort(row, stable=True)  # slots grouped by expert, ascending within
    column = torch.arange(num_physical) - (count.cumsum(0) - count)[row[order]]
    l2p = torch.full((num_logical_experts, num_physical - num_logical_experts + 1), -1, dtype=torch.int64)
    l2p[row[order], column] = order
    return l2p, count


def split_inputs(
    logical_to_physical_map: torch.Tensor,
    logical_replica_count: torch.Tensor,
    num_physical_experts: int,
    num_ranks: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The solve's inputs of one validated placement: ``(replica_slots, slot_rank, split_experts)``.

    Args:
        logical_to_physical_map: int64 ``(E, M')`` CPU, -1 padded (``lookup.validate_placement``'s).
        logical_replica_count: int64 ``(E,)`` CPU.
        num_physical_experts: ``P``, a multiple of ``num_ranks``; ``num_ranks``: ``N``.

    Returns int32 CPU tensors ``(E, P - E + 1)``, ``(P,)`` (``slot // (P // N)``) and
    ``(max(P - E, 1),)`` (the experts with two or more replicas, ascending, then -1).
    """
    num_experts = logical_to_physical_map.shape[0]
    width = num_physical_experts - num_experts + 1
    slots = torch.full((num_experts, width), -1, dtype=torch.int32)
    used = min(width, logical_to_physical_map.shape[1])
    slots[:, :used] = logical_to_physical_map[:, :used].to(torch.int32)
    slot_rank = (torch.arange(num_physical_experts) // (num_physical_experts // num_ranks)).to(torch.int32)
    replicated = torch.nonzero(logical_replica_count > 1).flatten().to(torch.int32)
    experts = torch.full((max(num_physical_experts - num_experts, 1),), -1, dtype=torch.int32)
    experts[: replicated.numel()] = replicated
    return slots, slot_rank, experts


def table_checksum(table: torch.Tensor) -> int:
    """A 64-bit BLAKE2b digest of a 2-D table's shape and values (as int64), as a signed int64.

    Equal tables give equal digests; tables that differ in any entry or in shape differ but with
    probability about ``2**-64`` (a linear checksum such as ``sum_i (i + 1) * table.flat[i]`` does not:
    two rank-dependent replica choices can cancel in it). One device-to-host copy of the table. Raises
    ``ValueError`` for a non-2-D table.
    """
    if not isinstance(table, torch.Tensor) or table.dim() != 2:
        raise ValueError(f"table must be a 2-D tensor (rows, E), got {table!r}")
    values = table.detach().to("cpu", torch.int64).contiguous()
    digest = hashlib.blake2b(digest_size=8)
    digest.update(repr(tuple(values.shape)).encode())
    digest.update(ctypes.string_at(values.data_ptr(), values.numel() * values.element_size()))
    return int.from_bytes(digest.digest(), "little", signed=True)


class ReplicaLookup:
    """One MoE layer's device replica table, fixed in shape and storage, refreshed in place.

    Args: ``num_logical_experts`` ``E >= 1``; ``device`` the routing device; ``rows >= 1``
    (:data:`DEFAULT_ROWS`); ``num_physical_experts`` ``P`` checked at each refresh, ``None`` infers it;
    ``num_ranks`` ``N`` (dividing ``P``, which it needs): the batch split's inputs are kept too.

    Attributes:
        table: ``int32 (rows, E)`` on ``device``, one storage for the lookup's life; the identity
            placement (``table[row, e] = e``) until the first :meth:`refresh_`, then
            :func:`build_replica_table` of the placement (``phase`` 0).
        physical_id_bound: every entry is below it: the given ``P``, else the last refresh's (``E``
            before the first); a load view needs that many counters.
        split_inputs: with ``num_ranks``, the batch split's ``(replica_slots (E, P - E + 1),
            slot_rank (P,), split_experts (max(P - E, 1),))`` int32 on ``device``
            (:func:`ascend_eplb.dataplane.split.split_inputs`), fixed in storage and refreshed in place
            with the table; None without it.

    Raises ``TypeError`` / ``ValueError`` for an argument of the wrong type or out of range.
    """

    def __init__(
        self,
        num_logical_experts: int,
        device: torch.device | str,
        rows: int = DEFAULT_ROWS,
        *,
        num_physical_experts: int | None = None,
        num_ranks: int | None = None,
    ) -> None:
        self.num_logical_experts = _check_int("num_logical_experts", num_logical_experts, 1)
        self.rows = _check_int("rows", rows, 1)
        if num_physical_experts is not None:
            _check_int("num_physical_experts", num_physical_experts, num_logical_experts)
        self.num_physical_experts = num_physical_experts
        self.physical_id_bound = num_logical_experts if num_physical_experts is None else num_physical_experts
        self.device = torch.device(device)
        identity = torch.arange(num_logical_experts, dtype=torch.int32, device=self.device)
        self.table = identity.unsqueeze(0).repeat(rows, 1)
        self.num_ranks = num_ranks
        self.split_inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        if num_ranks is not None:
            _check_int("num_ranks", num_ranks, 1)
            if num_physical_experts is None or num_physical_experts % num_ranks:
                raise ValueError(
                    f"num_ranks={num_ranks} needs num_physical_experts (P) given and divisible by it, got "
                    f"{num_physical_experts!r}: the batch split places each slot on rank slot // (P / N)"
                )
            count = torch.ones(num_logical_experts, dtype=torch.int64)
            identity_map = torch.arange(num_logical_experts).unsqueeze(1)
            built = split_inputs(identity_map, count, num_physical_experts, num_ranks)
            self.split_inputs = tuple(t.to(self.device) for t in built)

    def refresh_(
        self,
        logical_to_physical_map: torch.Tensor,
        logical_replica_count: torch.Tensor,
        *,
        expert_load_view: torch.Tensor | None = None,
    ) -> None:
        """Validate a committed placement, then copy its replica table into :attr:`table` in place.

        Args:
            logical_to_physical_map: integer ``(E, M)``, any ``M >= 1``, -1 padded, any device.
            logical_replica_count: integer ``(E,)``.
            expert_load_view: optional, keyword-only: the layer's load view ``(P,)`` the table will
                be recorded into; checked (as :meth:`check_load_view`) against the new placement's
                ``P`` before the table is touched.

        Raises:
            TypeError, ValueError: as :func:`validate_placement` or :meth:`check_load_view`, before
            the table is touched. Reads the maps on the host: call at commit time, outside a graph.
        """
        l2p, count, num_physical = validate_placement(
            logical_to_physical_map,
            logical_replica_count,
            num_logical_experts=self.num_logical_experts,
            num_physical_experts=self.num_physical_experts,
        )
        if expert_load_view is not None:
            self._check_load_view(expert_load_view, num_physical)
        self.table.copy_(_replica_table(l2p, count, 0, self.rows))
        if self.split_inputs is not None:
            fresh = split_inputs(l2p, count, num_physical, self.num_ranks)
            for kept, new in zip(self.split_inputs, fresh, strict=True):
                kept.copy_(new)
        self.physical_id_bound = num_physical

    def check_load_view(self, expert_load_view: torch.Tensor) -> None:
        """Check that ``expert_load_view`` can count every id of :attr:`table` (metadata only).

        Args:
            expert_load_view: the layer's load counters, int32 or int64 ``(P,)`` on :attr:`device`.

        Raises:
            ValueError: not a dense 1-D int32/int64 tensor, on another device, stride-0, or with fewer
                than :attr:`physical_id_bound` counters (ids beyond the view would go uncounted).
        """
        self._check_load_view(expert_load_view, self.physical_id_bound)

    def _check_load_view(self, expert_load_view: torch.Tensor, num_physical: int) -> None:
        check_load_view_metadata(expert_load_view)
        if expert_load_view.device != self.device:
            raise ValueError(
                f"expert_load_view is on {expert_load_view.device}, the lookup's table on {self.device}; "
                "they must match"
            )
        if expert_load_view.shape[0] < num_physical:
            raise ValueError(
                f"expert_load_view has {expert_load_view.shape[0]} counters, fewer than the lookup's "
                f"P = {num_physical} physical experts; the table's ids in "
                f"[{expert_load_view.shape[0]}, {num_physical}) would never be counted"
            )

    def checksum(self) -> int:
        """:func:`table_checksum` of :attr:`table` (one device-to-host read)."""
        return table_checksum(self.table)

    def __repr__(self) -> str:
        return (
            f"ReplicaLookup(num_logical_experts={self.num_logical_experts}, device={self.device}, "
            f"rows={self.rows}, num_physical_experts={self.num_physical_experts}, num_ranks={self.num_ranks})"
        )
