"""Graph-safe logical-to-physical mapping, fused with load recording, and post-compute recording.

The two mapping functions are ops of the ``torch.library`` namespace ``ascend_eplb``, each with a Triton
kernel (``CUDA`` with the ``[triton]`` extra; ``PrivateUse1`` with torch_npu and triton-ascend), a
device-neutral torch form (``CompositeExplicitAutograd``: every other device, and the reference) and a
fake for tracing. Every path runs the same metadata checks first (same ``ValueError``, nothing
written, no device read); none syncs with the host or has a data-dependent shape: the record flag and
unpadded token count are device scalars, so one captured graph serves every step (the design of vLLM
Ascend's ``map_to_physical_and_record``, ``ops/fused_moe/eplb.py``).
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
    """The metadata rules of both ops' ``topk_ids`` and ``table``; ``ValueError`` naming value and rule."""
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

    A view shorter than ``E`` is rejected (``P >= E``); ``P`` itself is data of the table, checked by
    :meth:`ReplicaLookup.check_load_view` where it is known.
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

    One or two gathers: whole blocks of ``rows`` tokens from the table broadcast (stride 0), the tail.
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
    """Bool ``(T,)``: the rows a rank records under ``row_layout`` (:func:`map_to_physical_and_record`).

    ``num_slices`` below 1 counts as 1. Device arithmetic only (no host read).
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
    # Bin len of the scratch takes every selection not counted: one scatter, no branch on device values.
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
        table: int32 ``(rows, E)`` replica table of physical ids (``ReplicaLookup.table``).

    Returns:
        A new contiguous ``(T, K)`` tensor of ``topk_ids``' dtype: ``table[t % rows, id]`` for ids in
        ``[0, E)``, ``-1`` for any other id.

    Raises:
        ValueError: ``topk_ids`` not int32/int64 2-D, ``table`` not int32 2-D or empty, or the two on
            different devices (metadata only, the same message on every path).
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
    """Map logical ids to physical ids and count the recorded selections (mutates ``expert_load_view``).

    Args:
        topk_ids, table: as :func:`map_to_physical`; the table's ids lie in ``[0, P)``.
        expert_load_view: int32/int64 ``(P,)``, the layer's counters in global physical id space
            (upstream ``EplbLayerState.expert_load_view``), not stride-0.
        record_enabled: 0-d bool device tensor (upstream ``should_record_tensor``).
        num_unpadded_tokens: 0-d int32/int64 device tensor: the real rows (of the recorded slice).
        row_layout: optional int32/int64 ``(4,)`` device tensor ``(replica_offset, num_slices,
            recording_slice, local_chunk)`` from ``ascend_eplb.control.layout``: token ``t`` reads row
            ``(t + replica_offset) % rows``; of ``num_slices`` equal slices only ``recording_slice`` is
            recorded (none when negative), its real rows being its first ``clamp(num_unpadded_tokens -
            local_chunk * (T // num_slices), 0, T // num_slices)``. ``None`` is ``(0, 1, 0, 0)``.

    Returns the physical ids and, when ``record_enabled``, adds 1 at each recorded selection with an id
    in ``[0, E)`` (a table entry beyond the view is mapped, never counted). Raises ``ValueError`` as
    :func:`map_to_physical`, or for a recording argument of the wrong dtype, shape, stride or device
    (a view shorter than ``E``), before anything is written.
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
    """Add a grouped matmul's per-local-expert token counts at this rank's slots of the global load.

    Records ``npu_grouped_matmul``'s ``group_list`` at slots ``[ep_rank * p, (ep_rank + 1) * p)``
    (vLLM Ascend ``record_local_expert_load``).

    Args:
        expert_tokens: int32/int64 ``(p,)`` device tensor: counts (``group_list_type`` 1,
            ``GROUP_LIST_COUNTS``) or running totals (0, ``GROUP_LIST_CUMSUM``).
        expert_load_view: int32/int64 ``(P,)``, ``P = p * num_ranks``; updated in place.
        ep_rank, num_ranks: this rank in the EP group of ``N = num_ranks``.
        record_enabled: optional 0-d bool device tensor; false adds nothing (no host read).

    Raises:
        ValueError: a ``group_list_type`` other than 0 or 1, a rank out of range, a non-tensor or
            wrong-shaped argument, ``P != p * num_ranks`` or a stride-0 view, before any write.
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
