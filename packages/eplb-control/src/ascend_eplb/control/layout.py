"""Which rows each rank routes, per forward: the replica offset and the recorded rows of a parallel layout.

Every rank that computes a token's expert output must choose the same physical replica for it
(GLOSSARY.md "replica agreement"), and every real token's selection must be counted once in the global
load window. Both depend on which ranks route the same rows, which the MoE dispatch decides. This
module names the four row layouts of vLLM 0.33.0 and vLLM Ascend and turns one, with the rank's
coordinates, into the dataplane's row layout ``(replica_offset, num_slices, recording_slice,
local_chunk)`` (:func:`ascend_eplb.dataplane.map_to_physical_and_record`):

============  =================================================  ===============  =====================
rows          who routes what (examples)                         replica offset   recorded rows
============  =================================================  ===============  =====================
replicated    each DP rank's batch, TP-replicated: every TP      DP rank (equal   TP rank 0 of each DP
              rank routes the same rows (vLLM TP+EP without DP;  on TP peers)     rank: its unpadded
              route-first all-to-all kernels without sequence                     rows
              parallel, e.g. DeepEP without SP)
split         every EP rank routes rows of its own (vLLM Ascend  EP rank          every rank: its
              MC2, FUSED_MC2, ALLTOALL; all-to-all kernels with                   unpadded rows
              sequence-parallel MoE; TP = 1 with all-to-all)
gathered      the DP ranks' batches gathered before routing;     0 (every EP      slice ``dp_rank`` of
              every EP rank routes the whole gathered batch      rank routes      ``dp_size`` equal
              (vLLM's naive / allgather-reducescatter dispatch   the same rows)   slices, on TP rank 0
              with DP > 1; vLLM Ascend ALLGATHER without SP)
gathered-sp   each rank's chunk of its DP batch gathered over    0                slice ``ep_rank`` of
              the EP group before routing (vLLM's naive                           ``ep_size``: chunk
              dispatch with sequence-parallel MoE; vLLM Ascend                    ``tp_rank`` of the
              ALLGATHER with sequence parallel)                                   rank's own batch
============  =================================================  ===============  =====================

A gathered batch is assumed to consist of equal slices, one per contributing rank: Model Runner V2
pads every DP rank to the same token count (``dp_utils``: ``num_tokens_across_dp[:] = synced``) and
sequence-parallel MoE splits each into ``ceil(T / tp)`` chunks (``forward_context._compute_sp_num_tokens``).

The layout a forward takes is the configuration's (:func:`default_moe_rows`, vLLM 0.33.0's FusedMoE
rule) unless the runner names it for that forward (vLLM Ascend chooses its communication method per
batch): ``AscendEPLBController.prepare_forward(..., moe_rows=...)``. Layouts this module cannot place
(prefill context parallel > 1) are refused at start-up by :func:`unplaceable_layout`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

from ascend_eplb.control.values import is_int

__all__ = [
    "MOE_ROWS",
    "MoeRows",
    "RankCoordinates",
    "RowLayout",
    "current_rank_coordinates",
    "default_moe_rows",
    "row_layout",
    "unplaceable_layout",
]

MoeRows = Literal["replicated", "split", "gathered", "gathered-sp"]
#: The row layouts, in the order of the module table.
MOE_ROWS: tuple[str, ...] = get_args(MoeRows)

#: vLLM 0.33.0 all-to-all backends whose kernels dispatch after routing (``FusedMoEModularKernel``
#: prepare/finalize: ``supports_internal_mk``); the others (``allgather_reducescatter``, ``naive``)
#: gather hidden states and router logits first (``MoERunner._maybe_dispatch``).
ROUTE_FIRST_BACKENDS = frozenset(
    {
        "deepep_high_throughput",
        "deepep_low_latency",
        "deepep_v2",
        "flashinfer_nvlink_one_sided",
        "flashinfer_nvlink_two_sided",
        "mori_high_throughput",
        "mori_low_latency",
        "nixl_ep",
        "moonep",
    }
)


@dataclass(frozen=True)
class RankCoordinates:
    """A rank's place in the EP group (vLLM orders EP ranks DP-major: ``ep = dp * tp_size + tp``)."""

    ep_rank: int
    ep_size: int
    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int

    def __post_init__(self) -> None:
        for name in ("ep", "tp", "dp"):
            rank, size = getattr(self, f"{name}_rank"), getattr(self, f"{name}_size")
            if not is_int(size) or size < 1:
                raise ValueError(f"{name}_size must be an int >= 1, got {size!r}")
            if not is_int(rank) or not 0 <= rank < size:
                raise ValueError(f"{name}_rank must be an int in [0, {size}), got {rank!r}")
        if self.ep_size != self.dp_size * self.tp_size:
            raise ValueError(
                f"ep_size={self.ep_size} must equal dp_size * tp_size = {self.dp_size} * {self.tp_size} "
                "(vLLM's EP group spans DP x TP; prefill context parallel is not placed)"
            )
        if self.ep_rank != self.dp_rank * self.tp_size + self.tp_rank:
            raise ValueError(
                f"ep_rank={self.ep_rank} must equal dp_rank * tp_size + tp_rank = "
                f"{self.dp_rank} * {self.tp_size} + {self.tp_rank} (vLLM's EP group order)"
            )


@dataclass(frozen=True)
class RowLayout:
    """One rank's row layout for a forward: the dataplane's ``row_layout`` entries.

    Attributes:
        rows: the layout name (:data:`MOE_ROWS`).
        replica_offset: added to the token row before the table lookup; equal on every rank that
            routes the same rows.
        num_slices: equal slices of the routed batch (1 unless gathered).
        recording_slice: the slice this rank records, ``-1`` for none (a peer records those rows).
        local_chunk: which chunk of the rank's own batch the recorded slice is (sequence parallel).
        sharing_group: ranks of the same ``rows`` with equal values route the same rows (so must choose
            the same replicas): the DP rank for ``replicated``, 0 for the gathered layouts, the EP rank
            for ``split`` (no other rank). Host-only; not a device entry.
    """

    rows: MoeRows
    replica_offset: int
    num_slices: int
    recording_slice: int
    local_chunk: int
    sharing_group: int = 0

    def values(self) -> list[int]:
        """``[replica_offset, num_slices, recording_slice, local_chunk]`` for the device tensor."""
        return [self.replica_offset, self.num_slices, self.recording_slice, self.local_chunk]


def row_layout(rows: str, ranks: RankCoordinates) -> RowLayout:
    """The row layout of ``rows`` for the rank at ``ranks`` (module table).

    Raises:
        ValueError: ``rows`` is not one of :data:`MOE_ROWS`.
    """
    tp_leader = ranks.tp_rank == 0
    if rows == "replicated":
        return RowLayout("replicated", ranks.dp_rank, 1, 0 if tp_leader else -1, 0, ranks.dp_rank)
    if rows == "split":
        return RowLayout("split", ranks.ep_rank, 1, 0, 0, ranks.ep_rank)
    if rows == "gathered":
        return RowLayout("gathered", 0, ranks.dp_size, ranks.dp_rank if tp_leader else -1, 0, 0)
    if rows == "gathered-sp":
        return RowLayout("gathered-sp", 0, ranks.ep_size, ranks.ep_rank, ranks.tp_rank, 0)
    raise ValueError(f"moe rows {rows!r} is not one of {list(MOE_ROWS)}")


def unplaceable_layout(parallel_config: Any) -> str | None:
    """Why this parallel configuration's rows cannot be placed, or None (a start-up rule).

    Prefill context parallel (PCP > 1) gathers over the PCP group as well, in an order this module
    does not model: refused rather than guessed.
    """
    pcp = int(getattr(parallel_config, "prefill_context_parallel_size", 1) or 1)
    if pcp > 1:
        return (
            f"prefill_context_parallel_size={pcp}: the MoE rows gathered over the PCP group are not "
            "placed by the replica rule (which ranks route the same rows is not modelled); use 1"
        )
    return None


def default_moe_rows(parallel_config: Any) -> MoeRows:
    """The row layout vLLM 0.33.0's ``FusedMoE`` takes on this configuration.

    ``MoERunner.do_naive_dispatch_combine``: with ``data_parallel_size > 1`` or sequence-parallel MoE
    (``ParallelConfig.use_sequence_parallel_moe``) and a backend that gathers first, the rows are
    gathered (``gathered-sp`` with sequence parallel); with a route-first all-to-all backend
    (:data:`ROUTE_FIRST_BACKENDS`) each DP rank routes its own rows (``split`` when sequence parallel
    splits them over TP, else ``replicated``); without DP the TP group shares its rows
    (``replicated``). vLLM Ascend decides per batch and names the rows to ``prepare_forward``.
    """
    dp = int(parallel_config.data_parallel_size)
    tp = int(parallel_config.tensor_parallel_size)
    sequence_parallel = bool(getattr(parallel_config, "use_sequence_parallel_moe", False))
    if dp == 1 and not sequence_parallel:
        return "replicated"
    if parallel_config.all2all_backend in ROUTE_FIRST_BACKENDS:
        return "split" if sequence_parallel or tp == 1 else "replicated"
    return "gathered-sp" if sequence_parallel else "gathered"


def current_rank_coordinates() -> RankCoordinates:
    """This process's :class:`RankCoordinates` from vLLM's initialised EP, TP and DP groups.

    Raises:
        ValueError: the groups do not form vLLM's DP x TP EP group (see :class:`RankCoordinates`).
    """
    from vllm.distributed.parallel_state import get_dp_group, get_ep_group, get_tp_group

    ep, tp, dp = get_ep_group(), get_tp_group(), get_dp_group()
    return RankCoordinates(
        ep.rank_in_group, ep.world_size, tp.rank_in_group, tp.world_size, dp.rank_in_group, dp.world_size
    )
