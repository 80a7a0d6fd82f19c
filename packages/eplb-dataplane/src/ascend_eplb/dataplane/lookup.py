"""Device replica lookup: which physical replica serves a (token row, logical expert) pair.

The lookup is a fixed-shape ``int32`` table ``(rows, E)`` on the routing device, derived from one MoE
layer's committed placement (upstream vLLM's ``logical_to_physical_map (E, M)``, -1 padded, and
``logical_replica_count (E,)``). A token in batch row ``t`` routed to logical expert ``e`` goes to
physical expert ``table[t % rows, e]``.

Replica rule (the table of vLLM Ascend ``ops/fused_moe/eplb.py``, ``build_expert_replica_routing_table``,
with its ``ep_rank`` term taken out of the table)::

    replica(row, e) = (row + phase + e) % logical_replica_count[e]
    table[row, e]   = logical_to_physical_map[e, replica(row, e)]

and token ``t`` of a forward reads row ``(t + replica_offset) % rows``, where ``replica_offset`` is a
device scalar of the forward's row layout (:func:`~ascend_eplb.dataplane.map_to_physical_and_record`).

* Agreement (the invariant): every rank that computes a token's expert output must choose the same
  physical replica for it. In vLLM's TP+EP layout, and in every dispatch that gathers tokens before
  routing, several ranks route the same rows and each computes only the replicas it holds; a choice
  that differs between them computes a token's expert twice or not at all. The choice is therefore a
  pure function of (token row, placement, offset), the table is the same on every rank (a
  :class:`ReplicaLookup` always builds it with ``phase`` 0), and the offset is equal on every rank that
  routes the same rows: the control plane chooses it per forward from the parallel layout
  (``ascend_eplb.control.layout``). vLLM Ascend's rule
  ``(row + ep_rank + e)`` breaks this wherever EP ranks share rows.
* Even spread: consecutive token rows walk the replicas of ``e`` round-robin, so ``n`` consecutive
  tokens routed to ``e`` give each of its ``count`` replicas (``logical_replica_count[e]``)
  ``floor(n / count)`` or ``ceil(n / count)`` of them (with ``rows`` a multiple of ``count``, exactly;
  otherwise the wrap at ``rows`` shifts the phase by ``rows % count``, at most one token per ``rows``
  tokens).
* Rank spread where it is safe: where each rank routes rows of its own (all-to-all dispatch), the
  offset is the rank, so small decode batches of different ranks do not all start at replica 0.
* Expert offset: ``e`` shifts the phase, so the replicas of different experts chosen by one row are
  spread over ranks too.

Upstream vLLM's CUDA kernel (``router/base_router.py``) hashes the token index instead (also
rank-independent); this table keeps the hot path a single gather.

The table is refreshed in place (``Tensor.copy_``): its storage, and so every compiled graph or
long-lived router holding it, stays valid across placements of any shape ``M``.
"""

from __future__ import annotations

import numbers

import torch

__all__ = [
    "DEFAULT_ROWS",
    "ReplicaLookup",
    "build_replica_table",
    "table_checksum",
    "validate_placement",
]

#: Rows of the lookup table (vLLM Ascend ``EXPERT_REPLICA_ROUTING_TABLE_NUM_ROWS``).
DEFAULT_ROWS = 1024

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def is_int(value: object) -> bool:
    """Whether ``value`` is an integer and not a ``bool``: any ``numbers.Integral`` (numpy integers
    included); ``True`` is an ``int`` to Python, never a count, rank or row here. The one such check of
    this package (not a public name of it).

    The same check is written once in each of quant_views, dataplane, movement and control: no package
    all four may import exists (quant_views and dataplane import torch only, and neither the other:
    DESIGN.md section 3), so each keeps its copy and ``tests/test_one_home.py`` checks that the four
    agree on every kind of value.
    """
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_load_view_metadata(expert_load_view: object) -> torch.Tensor:
    """The rules every load view obeys wherever one is passed (the lookup and both ops): a 1-D int32
    or int64 dense tensor ``(P,)``, not a stride-0 (expanded) view. Metadata only (no device data is read);
    the number of counters and the device are each caller's own rule. The one such check of this
    package (not a public name of it).

    Returns:
        ``expert_load_view``, checked.

    Raises:
        ValueError: naming the view's dtype and shape (or its type), or its stride.
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
    """Check one layer's committed placement and return host copies of it.

    Args:
        logical_to_physical_map: integer ``(E, M)``, any device; row ``e`` lists the physical ids
            of logical expert ``e``'s replicas in its first ``logical_replica_count[e]`` entries,
            the rest ``-1`` (upstream ``compute_logical_maps`` layout).
        logical_replica_count: integer ``(E,)``, any device.
        num_logical_experts: expected ``E``; ``None`` accepts the map's row count.
        num_physical_experts: ``P``; replica ids must lie in ``[0, P)``. ``None`` infers
            ``P = sum(logical_replica_count)``, right whenever every physical slot holds a replica
            (upstream placements always do, except elastic-EP scale-up; pass ``P`` there).

    Returns:
        ``(logical_to_physical_map, logical_replica_count, P)`` as ``int64`` CPU tensors.

    Raises:
        TypeError: a map is not an integer tensor.
        ValueError: wrong shapes, ``E`` mismatch, an expert with no replica, a count above ``M``,
            a replica id outside ``[0, P)``, padding that is not ``-1``, or one physical id serving
            two replicas. The message names the offending expert and value.

    Reads the maps on the host, so it synchronises with their device: a commit-time check, never
    part of a forward.
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
        phase: a constant replica shift, ``>= 0``. A :class:`ReplicaLookup`'s table is this with
            ``phase`` 0 (the same on every rank; the per-forward offset is the row layout's); another
            phase gives the table of a shifted rule (vLLM Ascend's puts the EP rank there), for
            comparisons.
        rows: table rows (token rows before the rule repeats), ``>= 1``.
        num_physical_experts: ``P`` for the id range check; ``None`` infers ``sum(count)``.

    Returns:
        ``int32 (rows, E)`` on the CPU, ``table[row, e] = map[e, (row + phase + e) % count[e]]``
        (module docstring). Equal to ``ReplicaLookup.table`` after ``refresh_`` with the same maps.

    Raises:
        TypeError, ValueError: as :func:`validate_placement`; ``phase < 0`` or ``rows < 1``.
    """
    _check_int("phase", phase, 0)
    _check_int("rows", rows, 1)
    l2p, count, _ = validate_placement(
        logical_to_physical_map, logical_replica_count, num_physical_experts=num_physical_experts
    )
    return _replica_table(l2p, count, phase, rows)


def table_checksum(table: torch.Tensor) -> int:
    """Deterministic position-weighted checksum of a replica table.

    ``sum_i (i + 1) * (table.flatten()[i] + 1)`` in ``int64``, computed on the table's device
    (one host read of the result). Equal tables give equal checksums; a change of entries is
    detected unless it happens to preserve the weighted sum. The checksum of
    ``build_replica_table(...)`` is what every rank's forward must observe after a commit.
    Exact for ``rows * E <= 2**20`` and ids below ``2**20`` (no ``int64`` overflow).
    """
    if not isinstance(table, torch.Tensor) or table.dim() != 2:
        raise ValueError(f"table must be a 2-D tensor (rows, E), got {table!r}")
    flat = table.detach().reshape(-1).to(torch.int64)
    weight = torch.arange(1, flat.numel() + 1, dtype=torch.int64, device=flat.device)
    return int(((flat + 1) * weight).sum())


class ReplicaLookup:
    """One MoE layer's device replica table, fixed in shape and storage, refreshed in place.

    The table of a placement is :func:`build_replica_table` of it (``phase`` 0): the same on every rank.
    The replica a token starts on is shifted per forward by the row layout's ``replica_offset``, never by
    the table (module docstring).

    Args:
        num_logical_experts: ``E``, ``>= 1``.
        device: the routing device (``npu``, ``cuda`` or ``cpu``).
        rows: table rows, ``>= 1`` (default :data:`DEFAULT_ROWS` = 1024, as vLLM Ascend).
        num_physical_experts: ``P``, keyword-only. When given, every refresh checks replica ids
            against ``[0, P)``; ``None`` infers ``P = sum(logical_replica_count)`` at each refresh.

    Attributes:
        table: ``int32 (rows, E)`` on ``device``. The same tensor object and storage (``data_ptr``)
            for the lookup's whole life. Until the first :meth:`refresh_` it is the identity
            placement (``table[row, e] = e``, upstream's initial placement before redundant slots),
            so every entry is always a valid physical id.
        physical_id_bound: every entry of :attr:`table` is ``< physical_id_bound``: the given ``P``,
            else the ``P`` inferred by the last refresh (``E`` before the first). A load view for
            this lookup needs at least that many counters (:meth:`check_load_view`).

    Raises:
        TypeError, ValueError: an argument of the wrong type or out of range.
    """

    def __init__(
        self,
        num_logical_experts: int,
        device: torch.device | str,
        rows: int = DEFAULT_ROWS,
        *,
        num_physical_experts: int | None = None,
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
            TypeError, ValueError: as :func:`validate_placement` or :meth:`check_load_view`, raised
            before the table is touched (a rejected placement leaves the previous one in force).

        Synchronises with the maps' device (validation reads them on the host): call it at commit
        time, outside any captured graph.
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
        self.physical_id_bound = num_physical

    def check_load_view(self, expert_load_view: torch.Tensor) -> None:
        """Check that ``expert_load_view`` can count every id of :attr:`table` (metadata only).

        Args:
            expert_load_view: the layer's load counters, int32 or int64 ``(P,)`` on :attr:`device`.

        Raises:
            ValueError: not a 1-D int32/int64 tensor, on another device, stride-0, or with fewer
                than :attr:`physical_id_bound` counters (the ops would map table entries beyond the
                view and never count them: a silently partial record).

        No device data is read. ``bind_router`` calls it when it binds a layer state whose lookup
        and load view are set; pass the view to :meth:`refresh_` to check it at every commit.
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
            f"rows={self.rows}, num_physical_experts={self.num_physical_experts})"
        )
