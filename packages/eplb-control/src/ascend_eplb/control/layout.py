"""Which rows each rank routes, per forward: the replica offset and the recorded rows of a parallel layout.

Ranks that compute a token's expert output must choose the same replica (GLOSSARY "replica agreement")
and each real selection must be recorded once; both depend on which ranks route the same rows. This
module names vLLM 0.33.0's and vLLM Ascend's four row layouts (``MOE_ROWS``; the table: README "Row
layouts") and turns one, with the rank's coordinates, into the dataplane's ``(replica_offset,
num_slices, recording_slice, local_chunk)``. The configuration's layout is :func:`default_moe_rows`
unless the runner names one per forward; :func:`unplaceable_layout` refuses PCP > 1 at start-up.
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


def default_moe_rows(parallel_config: Any, *, naive_dispatch: bool | None = None) -> MoeRows:
    """The row layout vLLM 0.33.0's ``FusedMoE`` takes on this configuration.

    ``MoERunner.do_naive_dispatch_combine``: with ``data_parallel_size > 1`` or sequence-parallel MoE
    (``ParallelConfig.use_sequence_parallel_moe``), a backend that gathers first and an expert method
    without an internal modular kernel, the rows are gathered before routing (``gathered-sp`` with
    sequence parallel); with a route-first all-to-all backend (:data:`ROUTE_FIRST_BACKENDS`), or a method
    whose modular kernel dispatches after routing (``naive_dispatch`` False: vLLM's unquantized CPU and
    GPU experts), each DP rank routes its own rows (``split`` when sequence parallel splits them over TP
    or TP = 1, else ``replicated``); without DP the TP group shares its rows (``replicated``).
    ``naive_dispatch``: the served model's runners' ``do_naive_dispatch_combine`` (None: not known, the
    backend decides). vLLM Ascend decides per batch and names the rows to ``prepare_forward``.
    """
    dp = int(parallel_config.data_parallel_size)
    tp = int(parallel_config.tensor_parallel_size)
    sequence_parallel = bool(getattr(parallel_config, "use_sequence_parallel_moe", False))
    if dp == 1 and not sequence_parallel:
        return "replicated"
    if parallel_config.all2all_backend in ROUTE_FIRST_BACKENDS or naive_dispatch is False:
        return "split" if sequence_parallel or tp == 1 else "replicated"
    return "gathered-sp" if sequence_parallel else "gathered"


def current_rank_coordinates() -> RankCoordinates:
    """This process's :class:`RankCoordinates` from vLLM's initialised EP, TP and DP groups.

    Raises:
        ValueError: the groups do not form vLLM's DP x TP EP group (see :class:`RankCoordinates`).
    """
    # local: integration's rules (``ascend-eplb check``) import this module without vLLM
    from vllm.distributed.parallel_state import get_dp_group, get_ep_group, get_tp_group

    ep, tp, dp = get_ep_group(), get_tp_group(), get_dp_group()
    return RankCoordinates(
        ep.rank_in_group, ep.world_size, tp.rank_in_group, tp.world_size, dp.rank_in_group, dp.world_size
    )
