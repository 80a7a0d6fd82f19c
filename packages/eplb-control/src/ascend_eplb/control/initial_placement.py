"""Start serving on a given placement: one rearrangement through upstream's own transaction at start-up.

Upstream starts every model on its initial placement (slot ``i < E`` holds expert ``i``, redundant slot
``E + i`` holds ``i % E``). :func:`install_initial_placement` runs, once, after registration and before
the async worker starts, the two steps upstream's synchronous ``EplbState.rearrange`` runs after its
policy: ``rebalance_execute.rearrange_expert_weights_inplace`` (through the model state's communicator
and expert weight views) and ``eplb_state._commit_eplb_maps`` (looked up at call time, so the commit
hooks refresh each layer's lookup). Upstream's state stays the one holder of the placement; policy,
window and counters are untouched. Why not at weight-load time: integration README "Serving from a
placement file".
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed import all_gather
from vllm.distributed.eplb import eplb_state as upstream_state
from vllm.distributed.eplb import rebalance_execute
from vllm.distributed.parallel_state import get_ep_group

from ascend_eplb.control import measures, upstream
from ascend_eplb.control.bus import Event

__all__ = [
    "InitialPlacementEvent",
    "check_ranks_agree",
    "check_upstream_install_signatures",
    "install_initial_placement",
]


def check_upstream_install_signatures() -> None:
    """Raise ``RuntimeError`` naming the first upstream function :func:`install_initial_placement` calls
    that drifted from vLLM 0.33.0 (its entries of :data:`ascend_eplb.control.upstream.SIGNATURES`)."""
    upstream.SURFACE.check(upstream.INITIAL_PLACEMENT)


@dataclass(frozen=True)
class InitialPlacementEvent(Event):
    """A placement was installed at start-up (published on the state's bus, on every rank, after the
    commit; the events recorder writes it as an ``initial_placement`` record).

    Attributes:
        model_state: upstream's ``EplbModelState`` (its maps hold the placement now).
        model_name: upstream's ``model_state.model_name``.
        num_ranks: N, the EP size.
        source: where the placement came from (a path), as the caller named it.
        previous: int64 ``(L, P)`` on the host, the placement it replaced (upstream's initial one);
            ``placement``: the one committed.
        moved: int64 ``(L,)``, experts that crossed ranks per layer (``measures.moved_experts``).
    """

    model_state: Any
    model_name: str
    num_ranks: int
    source: str
    previous: torch.Tensor
    placement: torch.Tensor = field(compare=False)
    moved: torch.Tensor = field(compare=False)


def install_initial_placement(
    state: Any,
    model_config: Any,
    physical_to_logical_map: Sequence[Sequence[int]] | torch.Tensor,
    *,
    source: str = "",
) -> InitialPlacementEvent:
    """Make ``physical_to_logical_map`` the placement of a registered model (module docstring).

    Call it on every EP rank alike, after ``add_model`` and before the async worker starts: the transfer
    runs collectives (Gloo P2P) on the EP group. ``state`` is the ``AscendEplbState`` (or upstream
    ``EplbState``), ``model_config`` keys the model state (``compute_hash()``), the map is int ``(L, P)``
    in host memory, ``source`` names its origin for the event and the log.

    Returns:
        the :class:`InitialPlacementEvent`, also published on ``state.bus`` when the state has one.

    Raises:
        ValueError: the ranks were given different maps (:func:`check_ranks_agree`); the map is not of
            integers, not upstream's ``(L, P)``, has an id outside ``[0, E)`` or a layer missing a logical
            expert (naming layer and values; checked before anything moves).
        RuntimeError: the async worker started or a rearrangement is in flight (nothing moved); an
            upstream function called here changed signature.
    """
    check_upstream_install_signatures()
    check_ranks_agree(physical_to_logical_map)
    model_state = state.model_states[model_config.compute_hash()]
    old = model_state.physical_to_logical_map
    num_logical = int(model_state.logical_to_physical_map.shape[1])
    new = _integer_map(physical_to_logical_map).to(old.dtype)
    _check_map(new, tuple(old.shape), num_logical)
    if getattr(state, "async_worker", None) is not None or model_state.rebalanced:
        raise RuntimeError(
            "install_initial_placement: the async EPLB worker has started or a rearrangement is in flight; "
            "install the initial placement after registration and before maybe_start_async_loop"
        )
    group = get_ep_group()
    old_cpu = old.detach().cpu().clone()
    rebalance_execute.rearrange_expert_weights_inplace(
        old,
        new,
        model_state.model.expert_weights,
        model_state.expert_buffer,
        group.device_group,
        model_state.communicator,
        is_profile=False,
    )
    upstream_state._commit_eplb_maps(model_state, new)
    new_cpu = model_state.physical_to_logical_map.detach().cpu()
    moved = measures.moved_experts(old_cpu, new_cpu, group.world_size)
    event = InitialPlacementEvent(
        model_state, model_state.model_name, group.world_size, source, old_cpu, new_cpu, moved
    )
    bus = getattr(state, "bus", None)
    if bus is not None:
        bus.publish(event)
    return event


def check_ranks_agree(physical_to_logical_map: Sequence[Sequence[int]] | torch.Tensor) -> None:
    """Raise on every EP rank alike unless every EP rank holds the same placement (each rank reads its own
    copy of the file; a stale copy would hang the transfer or serve different maps).

    One ``all_gather`` over the EP CPU group of an int64 ``(4,)`` digest per rank: the map's two
    dimensions and a CRC-32 of its int64 values, or ``(-1, -1, -1, kind)`` for a malformed map (that rank
    still takes part). Nothing with one EP rank. Call it on every EP rank before any rank-local refusal.

    Raises:
        ValueError: the digests differ, naming which EP ranks hold which shape.
    """

    group = get_ep_group()
    if group.world_size == 1:
        return
    try:
        values = _integer_map(physical_to_logical_map)
        digest = [*values.shape, zlib.crc32(values.to(torch.int64).numpy().tobytes()), 0]
        digest = digest if values.dim() == 2 else [-1, -1, -1, 1]
    except ValueError:
        digest = [-1, -1, -1, 2]
    mine = torch.tensor(digest, dtype=torch.int64)
    gathered = [torch.empty_like(mine) for _ in range(group.world_size)]
    all_gather(gathered, mine, group=group.cpu_group)
    holders: dict[tuple[int, ...], list[int]] = {}
    for rank, theirs in enumerate(gathered):
        holders.setdefault(tuple(theirs.tolist()), []).append(rank)
    if len(holders) > 1:
        described = "; ".join(
            f"EP ranks {ranks}: " + ("not a 2-D integer map" if d[0] < 0 else f"a ({d[0]}, {d[1]}) map")
            for d, ranks in holders.items()
        )
        raise ValueError(
            f"initial placement differs between EP ranks ({described}, the values differing where the shapes "
            "agree): every rank must install the same placement (the same file on every node)"
        )


def _integer_map(physical_to_logical_map: Sequence[Sequence[int]] | torch.Tensor) -> torch.Tensor:
    """The map as a host tensor of its own integer dtype; ``ValueError`` for floats, bools, complex numbers
    or ragged rows (``torch.as_tensor(..., dtype=int64)`` would truncate 0.9 to expert 0)."""
    try:
        values = torch.as_tensor(physical_to_logical_map, device=torch.device("cpu"))
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"initial placement is not a rectangular integer map: {e}") from None
    if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
        raise ValueError(
            f"initial placement has dtype {values.dtype}: every slot must hold an integer expert id"
        )
    return values


def _check_map(new: torch.Tensor, shape: tuple[int, ...], num_logical: int) -> None:
    if tuple(new.shape) != shape:
        raise ValueError(
            f"initial placement of shape {tuple(new.shape)}: must be upstream's physical_to_logical_map "
            f"shape {shape} (MoE layers, physical experts)"
        )
    bad = ((new < 0) | (new >= num_logical)).nonzero()
    if len(bad):
        layer, slot = (int(v) for v in bad[0])
        raise ValueError(
            f"initial placement layer {layer} slot {slot} holds {int(new[layer, slot])}: a logical expert id "
            f"must be in [0, {num_logical})"
        )
    counts = torch.zeros((shape[0], num_logical), dtype=torch.int64).scatter_add_(
        1, new.long(), torch.ones_like(new, dtype=torch.int64)
    )
    dropped = (counts == 0).nonzero()
    if len(dropped):
        layer, expert = (int(v) for v in dropped[0])
        raise ValueError(
            f"initial placement layer {layer} holds no slot of logical expert {expert}: every logical expert "
            "needs at least one"
        )
