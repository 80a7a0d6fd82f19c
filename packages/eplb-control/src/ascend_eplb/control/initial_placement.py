"""Start serving on a given placement: one rearrangement through upstream's own transaction at start-up.

Upstream vLLM 0.33.0 starts every model on its initial placement (``EplbState.add_model``: slots ``0..E-1``
hold the logical experts in order, redundant slot ``E + i`` holds ``i % E``; vLLM's weight loader fills
the slots the same way, ``RoutedExperts.build_expert_params_mapping``). To start on another placement,
:func:`install_initial_placement` runs, once, after the model is registered and before the async worker
starts, exactly the two steps upstream's synchronous ``EplbState.rearrange`` runs after its policy:

1. ``rebalance_execute.rearrange_expert_weights_inplace(old, new, model.expert_weights, expert_buffer,
   ep_group, communicator)``: every rank's slots receive their new logical expert's weights through the
   model state's communicator (the Ascend Gloo-staged one), layer by layer, through the registered expert
   weight views (every kernel tensor of the format, scales included) and upstream's one-layer
   ``expert_buffer``; slots whose expert is already on the rank are local copies;
2. ``eplb_state._commit_eplb_maps(model_state, new)`` (looked up in upstream's module at call time, so
   control's commit hooks run around it): upstream's ``physical_to_logical_map``,
   ``logical_to_physical_map`` and ``logical_replica_count`` hold the placement, and every layer's
   replica lookup is refreshed from them (move, commit, refresh for each layer, as any commit).

Upstream's state stays the one placement state: nothing here keeps a copy. The policy, the load window
and the rearrangement counters are untouched, so the first rearrangement starts from this placement (its
``old_global_expert_indices``) and, with ``step_interval`` beyond the run, the placement stays.

Why not load each slot's expert at weight-load time instead: vLLM builds the expert-parameter mapping of
every MoE layer from one global initial map (``build_expert_params_mapping`` is a static method each
model's ``load_weights`` calls), so a per-layer placement would need a patch of every model's loader;
the rearrangement needs none and moves each expert the same way the first rearrangement would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ascend_eplb.control import upstream
from ascend_eplb.control.bus import Event

__all__ = ["InitialPlacementEvent", "check_upstream_install_signatures", "install_initial_placement"]


def check_upstream_install_signatures() -> None:
    """Raise ``RuntimeError`` naming the first upstream function :func:`install_initial_placement` calls
    that drifted from vLLM 0.33.0 (its entries of :data:`ascend_eplb.control.upstream.SIGNATURES`)."""
    upstream.check_used_by(upstream.INITIAL_PLACEMENT)


@dataclass(frozen=True)
class InitialPlacementEvent(Event):
    """A placement was installed at start-up (published on the state's bus, on every rank, after the
    commit; the events recorder writes it as an ``initial_placement`` record).

    Attributes:
        model_state: upstream's ``EplbModelState`` (its maps hold the placement now).
        model_name: upstream's ``model_state.model_name``.
        num_ranks: N, the EP size.
        source: where the placement came from (a path), as the caller named it.
        previous: int64 ``(L, P)`` on the host, the placement it replaced (upstream's initial one).
    """

    model_state: Any
    model_name: str
    num_ranks: int
    source: str
    previous: torch.Tensor


def install_initial_placement(
    state: Any,
    model_config: Any,
    physical_to_logical_map: Sequence[Sequence[int]] | torch.Tensor,
    *,
    source: str = "",
) -> InitialPlacementEvent:
    """Make ``physical_to_logical_map`` the placement of a registered model (module docstring).

    Call it on every EP rank alike, after ``add_model`` registered the model and before the async worker
    starts (``AscendEPLBController.maybe_start_async_loop``): the transfer runs collectives (Gloo P2P) on
    the EP group.

    Args:
        state: the ``AscendEplbState`` (or upstream ``EplbState``) the model is registered with.
        model_config: the model's ``ModelConfig`` (its ``compute_hash()`` keys the model state).
        physical_to_logical_map: int ``(L, P)``, the logical expert of each physical slot per MoE layer
            (host memory; every id in ``[0, E)``, every logical expert in every layer).
        source: where it came from, for the event and the log.

    Returns:
        the :class:`InitialPlacementEvent`, also published on ``state.bus`` when the state has one.

    Raises:
        ValueError: the map's shape is not upstream's ``(L, P)``, an id is outside ``[0, E)``, or a layer
            drops a logical expert (naming the layer and the values; checked before anything moves).
        RuntimeError: the async worker already started or a rearrangement is in flight (nothing moved);
            an upstream function called here changed signature.
    """
    check_upstream_install_signatures()
    from vllm.distributed.eplb import eplb_state as upstream_state
    from vllm.distributed.eplb import rebalance_execute
    from vllm.distributed.parallel_state import get_ep_group

    model_state = state.model_states[model_config.compute_hash()]
    old = model_state.physical_to_logical_map
    num_logical = int(model_state.logical_to_physical_map.shape[1])
    new = torch.as_tensor(physical_to_logical_map, dtype=old.dtype, device=torch.device("cpu"))
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
    event = InitialPlacementEvent(model_state, model_state.model_name, group.world_size, source, old_cpu)
    bus = getattr(state, "bus", None)
    if bus is not None:
        bus.publish(event)
    return event


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
