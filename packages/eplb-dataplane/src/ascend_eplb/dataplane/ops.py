"""Graph-safe logical-to-physical mapping, fused with load recording, and post-compute recording.

Both mapping functions are ops of the ``torch.library`` namespace ``ascend_eplb`` (defined with
``Library.define``, one schema each), with

* a Triton kernel (:mod:`ascend_eplb.dataplane._triton`) for the devices Triton serves, registered for
  the ``CUDA`` dispatch key when ``triton`` imports (the optional extra
  ``ascend-eplb-dataplane[triton]``) and for ``PrivateUse1`` (``npu``) when ``torch_npu`` and
  triton-ascend are installed: one launch that range-checks, gathers, fills ``-1`` and counts, reading
  the record flag and the unpadded token count on the device;
* a device-neutral torch form (``CompositeExplicitAutograd``): the fallback on every other device
  (``cpu`` included) and the reference the kernel is tested against: a fixed sequence of kernels whose
  shapes depend only on ``T``, ``K``, ``E`` and the load view's length, the counts scattered into a
  scratch whose last bin takes every selection that is not counted;
* a fake implementation for tracing and ``torch.compile``.

Every implementation runs the same metadata checks first (:func:`_check_map_args`,
:func:`_check_record_args`), so a bad argument raises the same ``ValueError`` on each path before
anything is written, without reading device data. No implementation synchronises with the host,
branches on device values in Python, or produces a data-dependent shape; the record flag and the
unpadded token count are device scalars, so one captured or compiled graph serves recording and
non-recording steps and padded batches (the design of vLLM Ascend's ``map_to_physical_and_record``
in ``ops/fused_moe/eplb.py``, whose NPU path is a Triton kernel of the same schema).
"""

from __future__ import annotations

import importlib.metadata

import torch

from ascend_eplb.dataplane import _npu, _triton
from ascend_eplb.dataplane.lookup import check_load_view_metadata, is_int

__all__ = [
    "GROUP_LIST_COUNTS",
    "GROUP_LIST_CUMSUM",
    "ROW_LAYOUT_SIZE",
    "map_to_physical",
    "map_to_physical_and_record",
    "record_expert_tokens",
]


#: ``group_list_type`` of Ascend ``npu_grouped_matmul``: ``group_list`` holds cumulative sums.
GROUP_LIST_CUMSUM = 0
#: ``group_list_type`` of Ascend ``npu_grouped_matmul``: ``group_list`` holds per-group counts.
GROUP_LIST_COUNTS = 1

_ID_DTYPES = (torch.int32, torch.int64)

#: Entries of a row layout (``row_layout`` argument of :func:`map_to_physical_and_record`):
#: ``(replica_offset, num_slices, recording_slice, local_chunk)``.
ROW_LAYOUT_SIZE = 4


def _check_map_args(topk_ids: torch.Tensor, table: torch.Tensor) -> None:
    """The metadata rules of both ops' ``topk_ids`` and ``table``; ``ValueError`` naming value and rule.

    Reads only dtypes, shapes, strides and devices (no device data): the torch form, the Triton path
    and the fake implementation call it first, so each rejects the same input with the same message.
    """
    if topk_ids.dim() != 2 or topk_ids.dtype not in _ID_DTYPES:
        raise ValueError(
            f"topk_ids must be int32 or int64 (T, K), got {topk_ids.dtype} {tuple(topk_ids.shape)}"
        )
    if table.dim() != 2 or table.dtype != torch.int32:
        raise ValueError(f"table must be int32 (rows, E), got {table.dtype} {tuple(table.shape)}")
    if table.shape[0] < 1 or table.shape[1] < 1:
        raise ValueError(f"table must be non-empty (rows >= 1, E >= 1), got shape {tuple(table.shape)}")
    if table.device != topk_ids.device:
        raise ValueError(f"table is on {table.device}, topk_ids on {topk_ids.device}; they must match")


def _check_record_args(
    topk_ids: torch.Tensor,
    table: torch.Tensor,
    expert_load_view: torch.Tensor,
    record_enabled: torch.Tensor,
    num_unpadded_tokens: torch.Tensor,
    row_layout: torch.Tensor | None,
) -> None:
    """The metadata rules of the recording arguments (after :func:`_check_map_args`); ``ValueError``.

    ``expert_load_view`` needs one counter per physical expert, ``P`` of them, and ``P >= E`` for any
    placement (each logical expert has a replica in a slot of its own), so a view shorter than the
    table's ``E`` is rejected here. ``P`` itself is not visible in metadata (the table holds physical
    ids as data): :meth:`ReplicaLookup.check_load_view` checks the view against the lookup's ``P``
    where both are known (``bind_router``, ``refresh_``); inside the op a table entry outside
    ``[0, len(expert_load_view))`` is mapped but never counted, on every path.
    """
    check_load_view_metadata(expert_load_view)
    num_experts = table.shape[1]
    if expert_load_view.shape[0] < num_experts:
        raise ValueError(
            f"expert_load_view has {expert_load_view.shape[0]} counters, fewer than the table's "
            f"E = {num_experts} logical experts; it must hold one counter per physical expert "
            "(global P >= E), not a rank's local slots"
        )
    if record_enabled.dim() != 0 or record_enabled.dtype != torch.bool:
        raise ValueError(
            f"record_enabled must be a 0-d bool tensor, got {record_enabled.dtype} "
            f"{tuple(record_enabled.shape)}"
        )
    if num_unpadded_tokens.dim() != 0 or num_unpadded_tokens.dtype not in _ID_DTYPES:
        raise ValueError(
            "num_unpadded_tokens must be a 0-d int32 or int64 tensor, got "
            f"{num_unpadded_tokens.dtype} {tuple(num_unpadded_tokens.shape)}"
        )
    if row_layout is not None and (
        row_layout.dim() != 1 or row_layout.shape[0] != ROW_LAYOUT_SIZE or row_layout.dtype not in _ID_DTYPES
    ):
        raise ValueError(
            f"row_layout must be int32 or int64 ({ROW_LAYOUT_SIZE},) (replica_offset, num_slices, "
            f"recording_slice, local_chunk), got {row_layout.dtype} {tuple(row_layout.shape)}"
        )
    for name, t in (
        ("expert_load_view", expert_load_view),
        ("record_enabled", record_enabled),
        ("num_unpadded_tokens", num_unpadded_tokens),
        ("row_layout", row_layout),
    ):
        if t is not None and t.device != topk_ids.device:
            raise ValueError(f"{name} is on {t.device}, topk_ids on {topk_ids.device}; they must match")


def _gather_rows(table: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """``table[t % rows, expert_ids[t, k]]`` as int32 (T, K); ``expert_ids`` must be in ``[0, E)``.

    Whole blocks of ``rows`` tokens gather from the table broadcast over blocks (a stride-0 view,
    no copy), the tail from its first rows: one or two gathers, no index arithmetic per element.
    """
    num_tokens, top_k = expert_ids.shape
    rows, num_experts = table.shape
    blocks, tail = divmod(num_tokens, rows)
    if blocks == 0:
        return torch.gather(table[:tail], 1, expert_ids)
    head = blocks * rows
    if tail == 0:
        return torch.gather(
            table.expand(blocks, rows, num_experts), 2, expert_ids.view(blocks, rows, top_k)
        ).view(num_tokens, top_k)
    out = torch.empty((num_tokens, top_k), dtype=table.dtype, device=table.device)
    torch.gather(
        table.expand(blocks, rows, num_experts),
        2,
        expert_ids[:head].view(blocks, rows, top_k),
        out=out[:head].view(blocks, rows, top_k),
    )
    torch.gather(table[:tail], 1, expert_ids[head:], out=out[head:])
    return out


# Integer ops: no autograd formula; the fake implementations below serve tracing and compile.
_LIB = torch.library.Library("ascend_eplb", "DEF")
_LIB.define("map_to_physical(Tensor topk_ids, Tensor table) -> Tensor")
_LIB.define(
    "map_to_physical_and_record(Tensor topk_ids, Tensor table, Tensor(a!) expert_load_view, "
    "Tensor record_enabled, Tensor num_unpadded_tokens, Tensor? row_layout=None) -> Tensor"
)


def _map_generic(
    topk_ids: torch.Tensor, table: torch.Tensor, replica_offset: torch.Tensor | None = None
) -> torch.Tensor:
    """Physical ids in ``topk_ids``' dtype, ``-1`` for ids outside ``[0, E)``: four kernels.

    With ``replica_offset`` (a 0-d device integer) token ``t`` reads table row
    ``(t + replica_offset) % rows``; without it row ``t % rows``.
    """
    ids = topk_ids.contiguous()
    safe = ids.clamp(0, table.shape[1] - 1)
    invalid = safe != ids
    if replica_offset is None:
        gathered = _gather_rows(table, safe)
    else:
        token = torch.arange(ids.shape[0], device=ids.device)
        row = torch.remainder(token + replica_offset, table.shape[0])
        gathered = table[row.unsqueeze(1), safe]
    physical = gathered.masked_fill_(invalid, -1)
    return physical if physical.dtype == topk_ids.dtype else physical.to(topk_ids.dtype)


def _recorded_rows(
    token: torch.Tensor, num_tokens: int, row_layout: torch.Tensor, num_unpadded_tokens: torch.Tensor
) -> torch.Tensor:
    """Bool ``(T,)``: the rows a rank records under ``row_layout`` (see :func:`map_to_physical_and_record`).

    Slice ``s`` of ``n`` spans rows ``[s * (T // n), (s + 1) * (T // n))``; it is chunk ``c`` of this
    rank's own batch, whose first ``num_unpadded_tokens`` rows are real, so its first
    ``clamp(num_unpadded_tokens - c * (T // n), 0, T // n)`` rows are. A negative ``recording_slice``
    records no row; ``n`` below 1 counts as 1. Device arithmetic only (no host read).
    """
    num_slices = row_layout[1].clamp_min(1)
    recording_slice = row_layout[2]
    size = num_tokens // num_slices  # Tensor.__rfloordiv__: a device scalar
    first = recording_slice * size
    real = (num_unpadded_tokens - row_layout[3] * size).clamp_min(0)
    limit = first + torch.minimum(real, size)
    return (token >= first) & (token < limit) & (recording_slice >= 0)


def _map_to_physical_generic(topk_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    _check_map_args(topk_ids, table)
    return _map_generic(topk_ids, table)


def _map_to_physical_and_record_generic(
    topk_ids: torch.Tensor,
    table: torch.Tensor,
    expert_load_view: torch.Tensor,
    record_enabled: torch.Tensor,
    num_unpadded_tokens: torch.Tensor,
    row_layout: torch.Tensor | None = None,
) -> torch.Tensor:
    _check_map_args(topk_ids, table)
    _check_record_args(topk_ids, table, expert_load_view, record_enabled, num_unpadded_tokens, row_layout)
    num_tokens = topk_ids.shape[0]
    token = torch.arange(num_tokens, device=topk_ids.device)
    if row_layout is None:
        out = _map_generic(topk_ids, table)
        counted_row = token < num_unpadded_tokens
    else:
        out = _map_generic(topk_ids, table, replica_offset=row_layout[0])
        counted_row = _recorded_rows(token, num_tokens, row_layout, num_unpadded_tokens)
    num_counters = expert_load_view.shape[0]
    # A (len + 1) scratch: bins 0..len-1 take the counted selections; bin len every other one
    # (invalid id, a table entry outside [0, len), a padded row, another slice's row, a non-recording
    # step). One scatter, no branch on device values.
    skipped = ~counted_row | ~record_enabled
    uncounted = (out < 0) | (out >= num_counters) | skipped.unsqueeze(1)
    bins = out.masked_fill(uncounted, num_counters)
    scratch = expert_load_view.new_zeros(num_counters + 1)
    ones = scratch.new_ones(1).expand(bins.numel())
    scratch.index_add_(0, bins.view(-1), ones)
    expert_load_view.add_(scratch[:num_counters])
    return out


def _map_to_physical_triton(topk_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    _check_map_args(topk_ids, table)
    return _triton.launch(topk_ids, table, None, None, None, None)


def _map_to_physical_and_record_triton(
    topk_ids: torch.Tensor,
    table: torch.Tensor,
    expert_load_view: torch.Tensor,
    record_enabled: torch.Tensor,
    num_unpadded_tokens: torch.Tensor,
    row_layout: torch.Tensor | None = None,
) -> torch.Tensor:
    _check_map_args(topk_ids, table)
    _check_record_args(topk_ids, table, expert_load_view, record_enabled, num_unpadded_tokens, row_layout)
    return _triton.launch(topk_ids, table, expert_load_view, record_enabled, num_unpadded_tokens, row_layout)


def _map_to_physical_fake(topk_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    _check_map_args(topk_ids, table)
    return torch.empty_like(topk_ids, memory_format=torch.contiguous_format)


def _map_to_physical_and_record_fake(
    topk_ids: torch.Tensor,
    table: torch.Tensor,
    expert_load_view: torch.Tensor,
    record_enabled: torch.Tensor,
    num_unpadded_tokens: torch.Tensor,
    row_layout: torch.Tensor | None = None,
) -> torch.Tensor:
    _check_map_args(topk_ids, table)
    _check_record_args(topk_ids, table, expert_load_view, record_enabled, num_unpadded_tokens, row_layout)
    return torch.empty_like(topk_ids, memory_format=torch.contiguous_format)


def _has_triton_ascend() -> bool:
    try:
        importlib.metadata.version("triton-ascend")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _triton_dispatch_keys() -> tuple[str, ...]:
    if not _triton.HAS_TRITON:
        return ()
    keys = ["CUDA"]
    if _npu.HAS_TORCH_NPU and _has_triton_ascend():  # pragma: no cover - needs an Ascend host
        keys.append("PrivateUse1")
    return tuple(keys)


def _register_triton(lib: torch.library.Library, dispatch_key: str) -> None:
    """Register the Triton path of both ops for ``dispatch_key`` in ``lib`` (``DEF`` or ``IMPL``)."""
    lib.impl("map_to_physical", _map_to_physical_triton, dispatch_key)
    lib.impl("map_to_physical_and_record", _map_to_physical_and_record_triton, dispatch_key)


#: Dispatch keys whose tensors run the Triton kernel: ``("CUDA",)`` with triton, plus
#: ``"PrivateUse1"`` with torch_npu and triton-ascend; ``()`` without triton (torch form everywhere).
TRITON_DISPATCH_KEYS = _triton_dispatch_keys()

_LIB.impl("map_to_physical", _map_to_physical_generic, "CompositeExplicitAutograd")
_LIB.impl("map_to_physical_and_record", _map_to_physical_and_record_generic, "CompositeExplicitAutograd")
for _key in TRITON_DISPATCH_KEYS:
    _register_triton(_LIB, _key)
torch.library.register_fake("ascend_eplb::map_to_physical", _map_to_physical_fake, lib=_LIB)
torch.library.register_fake(
    "ascend_eplb::map_to_physical_and_record", _map_to_physical_and_record_fake, lib=_LIB
)


def map_to_physical(topk_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Map logical expert ids to physical ids through a replica table (op ``ascend_eplb::map_to_physical``).

    Args:
        topk_ids: int32 or int64 ``(T, K)`` logical expert ids, on the table's device (any strides).
        table: int32 ``(rows, E)`` replica table (``ReplicaLookup.table``; any strides); entries are
            physical ids.

    Returns:
        A new contiguous ``(T, K)`` tensor of ``topk_ids``'s dtype on the same device:
        ``table[t % rows, id]`` for ids in ``[0, E)``, ``-1`` for any other id.

    Raises:
        ValueError: ``topk_ids`` not int32/int64 2-D, ``table`` not int32 2-D or empty, or the two on
            different devices. Checked from metadata only (no device read), with the same message on
            the Triton path, the torch form and the fake implementation.

    Runs the Triton kernel on ``cuda`` (and ``npu`` with triton-ascend) when triton is installed,
    the torch form elsewhere; both give the same ids.
    """
    return torch.ops.ascend_eplb.map_to_physical(topk_ids, table)


def map_to_physical_and_record(
    topk_ids: torch.Tensor,
    table: torch.Tensor,
    expert_load_view: torch.Tensor,
    record_enabled: torch.Tensor,
    num_unpadded_tokens: torch.Tensor,
    row_layout: torch.Tensor | None = None,
) -> torch.Tensor:
    """Map logical ids to physical ids and count the selections of unpadded tokens, in one op.

    Op ``ascend_eplb::map_to_physical_and_record`` (mutates ``expert_load_view``). The design of
    vLLM Ascend's ``map_to_physical_and_record`` (``ops/fused_moe/eplb.py``): the record flag and the
    unpadded count are device scalars, so nothing is read on the host.

    Args:
        topk_ids: int32 or int64 ``(T, K)`` logical expert ids; rows ``>= num_unpadded_tokens``
            are padding.
        table: int32 ``(rows, E)`` replica table whose entries lie in ``[0, P)``
            (``ReplicaLookup`` guarantees it).
        expert_load_view: int32 or int64 ``(P,)``, this layer's load counters in global physical
            id space (upstream ``EplbLayerState.expert_load_view``); updated in place; any nonzero
            stride.
        record_enabled: 0-d bool tensor on the device (upstream ``should_record_tensor``).
        num_unpadded_tokens: 0-d int32/int64 tensor on the device: the count of real rows (of this
            rank's slice, with ``row_layout``; negative counts nothing, above the slice counts all of it).
        row_layout: optional int32/int64 ``(4,)`` tensor on the device,
            ``(replica_offset, num_slices, recording_slice, local_chunk)``, written once per forward by
            the control plane from the parallel layout (``ascend_eplb.control.layout``), read only on
            the device:

            * ``replica_offset``: token ``t`` reads table row ``(t + replica_offset) % rows``. Ranks that
              route the same rows must hold the same offset (GLOSSARY.md "replica agreement");
            * ``num_slices``, ``recording_slice``: the batch is ``num_slices`` equal slices of
              ``T // num_slices`` rows (a gathered batch: one slice per contributing rank); this rank
              records slice ``recording_slice`` only, and no row when it is negative (another rank
              that routes the same rows records them);
            * ``local_chunk``: the recorded slice is chunk ``local_chunk`` of this rank's own batch of
              which the first ``num_unpadded_tokens`` rows are real (sequence-parallel MoE splits a
              batch into equal chunks over the TP ranks; 0 otherwise), so the slice's real rows are its
              first ``clamp(num_unpadded_tokens - local_chunk * (T // num_slices), 0, T // num_slices)``.

            ``None`` is ``(0, 1, 0, 0)``: rows ``t % rows``, the first ``num_unpadded_tokens`` rows
            recorded.

    Returns:
        The physical ids, as :func:`map_to_physical` (with the offset). When ``record_enabled`` is
        true, adds 1 to ``expert_load_view[physical]`` for every selection with a valid id (in
        ``[0, E)``) in the recorded rows; when false, adds nothing. A table entry outside
        ``[0, len(expert_load_view))`` (impossible for a ``ReplicaLookup`` table whose ``P`` the view
        matches, see :meth:`ReplicaLookup.check_load_view`) is mapped but not counted, on every path.

    Raises:
        ValueError: as :func:`map_to_physical`; ``expert_load_view`` not int32/int64 1-D, shorter than
            ``E`` (``P >= E`` always) or stride-0; ``record_enabled`` not a 0-d bool tensor;
            ``num_unpadded_tokens`` not a 0-d int32/int64 tensor; ``row_layout`` not int32/int64
            ``(4,)``; any of them on another device than ``topk_ids``. Checked from metadata only,
            before anything is written, with the same message on every path (Triton, torch form, fake).
    """
    return torch.ops.ascend_eplb.map_to_physical_and_record(
        topk_ids, table, expert_load_view, record_enabled, num_unpadded_tokens, row_layout
    )


def record_expert_tokens(
    expert_tokens: torch.Tensor,
    group_list_type: int,
    expert_load_view: torch.Tensor,
    ep_rank: int,
    num_ranks: int,
    *,
    record_enabled: torch.Tensor | None = None,
) -> None:
    """Add a grouped matmul's per-local-expert token counts to the global load, after compute.

    The Ascend fused MoE path reports how many tokens each of this rank's ``p`` physical experts
    executed as the ``group_list`` of ``npu_grouped_matmul``; this records them at this rank's
    slots ``[ep_rank * p, (ep_rank + 1) * p)`` of the global physical id space (vLLM Ascend
    ``record_local_expert_load``).

    Args:
        expert_tokens: integer ``(p,)`` on the device. With ``group_list_type ==
            GROUP_LIST_COUNTS`` (1) entry ``i`` is the token count of local expert ``i``; with
            ``GROUP_LIST_CUMSUM`` (0) it is the running total up to and including ``i``.
        group_list_type: ``0`` (cumulative sums) or ``1`` (counts), as ``npu_grouped_matmul``.
        expert_load_view: int32 or int64 ``(P,)`` with ``P = p * num_ranks``; updated in place.
        ep_rank: this rank, ``0 <= ep_rank < num_ranks``.
        num_ranks: EP group size ``N``.
        record_enabled: optional 0-d bool device tensor; when false nothing is added (no host read).

    Raises:
        ValueError: unknown ``group_list_type``, ranks out of range, shapes/dtypes that do not
            satisfy ``P == p * num_ranks``, or a stride-0 ``expert_load_view`` (the load-view rules of
            :func:`~ascend_eplb.dataplane.lookup.check_load_view_metadata`; all checked before anything
            is written).
    """
    if isinstance(group_list_type, bool) or group_list_type not in (GROUP_LIST_CUMSUM, GROUP_LIST_COUNTS):
        raise ValueError(
            f"group_list_type must be {GROUP_LIST_CUMSUM} (cumulative sums) or {GROUP_LIST_COUNTS} "
            f"(counts), got {group_list_type!r}"
        )
    if not is_int(num_ranks) or num_ranks < 1:
        raise ValueError(f"num_ranks must be an int >= 1, got {num_ranks!r}")
    if not is_int(ep_rank) or not 0 <= ep_rank < num_ranks:
        raise ValueError(f"ep_rank must be an int in [0, {num_ranks}), got {ep_rank!r}")
    if not isinstance(expert_tokens, torch.Tensor):
        raise ValueError(f"expert_tokens must be int32 or int64 (p,), got {type(expert_tokens).__name__}")
    if expert_tokens.dim() != 1 or expert_tokens.dtype not in _ID_DTYPES:
        raise ValueError(
            f"expert_tokens must be int32 or int64 (p,), got {expert_tokens.dtype} "
            f"{tuple(expert_tokens.shape)}"
        )
    check_load_view_metadata(expert_load_view)
    num_local = expert_tokens.shape[0]
    if expert_load_view.shape[0] != num_local * num_ranks:
        raise ValueError(
            f"expert_load_view has P = {expert_load_view.shape[0]} slots, expected p * num_ranks = "
            f"{num_local} * {num_ranks} = {num_local * num_ranks}"
        )
    if record_enabled is not None and not isinstance(record_enabled, torch.Tensor):
        raise ValueError(f"record_enabled must be a 0-d bool tensor, got {type(record_enabled).__name__}")
    if record_enabled is not None and (record_enabled.dim() != 0 or record_enabled.dtype != torch.bool):
        raise ValueError(
            f"record_enabled must be a 0-d bool tensor, got {record_enabled.dtype} "
            f"{tuple(record_enabled.shape)}"
        )
    counts = expert_tokens
    if group_list_type == GROUP_LIST_CUMSUM:
        counts = torch.diff(expert_tokens, prepend=expert_tokens.new_zeros(1))
    if record_enabled is not None:
        counts = counts * record_enabled
    expert_load_view.narrow(0, ep_rank * num_local, num_local).add_(counts.to(expert_load_view.dtype))
