"""Serving starts on ``eplb_config.initial_placement``: the start-up install of a placement file.

:func:`attach_startup_install` is what ``serving.build_serving_controller`` subscribes (after the
guardrails) when start-up validation read a placement file: at each model's registration it compares
upstream's state with the model's placement and installs it through upstream's transaction
(:func:`ascend_eplb.control.initial_placement.install_initial_placement`), before the async worker
starts. README "Serving from a placement file".
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from vllm.distributed.parallel_state import get_ep_group
from vllm.logger import init_logger

from ascend_eplb.control import measures
from ascend_eplb.control.bus import RegistrationEvent
from ascend_eplb.control.initial_placement import check_ranks_agree, install_initial_placement
from ascend_eplb.integration import metrics
from ascend_eplb.integration.placement_file import describe_mismatch
from ascend_eplb.integration.rules import Violation
from ascend_eplb.integration.validation import EplbConfigError

__all__ = ["attach_startup_install"]


def attach_startup_install(bus: Any, placements: Mapping[str, Any]) -> None:
    """Install each model's placement when it registers: subscribe to ``bus``, a controller's
    :class:`~ascend_eplb.control.bus.EventBus`, after the guardrails (the verifier then checks the
    install's commit and the events recorder writes its ``initial_placement`` record).

    At each ``RegistrationEvent`` (every rank, same order; an MoE draft before its target), before
    anything moves: the placement is ``placements[model_name]``; every EP rank must hold the same one
    (``check_ranks_agree``, one collective); L, P, E and the EP size of upstream's state must equal the
    placement's; then the install moves the weights and commits the maps. ``placements`` is
    ``{model name: placement_file.Placement}`` (``placement_file.assign_placements``).

    Raises (from the registration, on every rank alike):
        EplbConfigError: rule ``initial-placement``: no placement for the model, the EP ranks read
            different ones, or it was made for another model or layout (every differing fact named).
    """
    installed: set[str] = set()

    def on_registered(event: RegistrationEvent) -> None:
        state = event.controller.state
        model_state = state.model_states[event.model_config.compute_hash()]
        name = model_state.model_name
        if name in installed:
            return
        placement = placements.get(name)
        if placement is None:
            raise EplbConfigError(
                [
                    Violation(
                        "initial-placement",
                        f"eplb_config.initial_placement: no placement for model {name} (the file's are for "
                        f"{sorted(placements)}); fix: export a placement of every model the server balances "
                        "(ascend-eplb plan --export-expert-map on an events file that recorded them)",
                    )
                ]
            )
        try:  # before any rank-local refusal: every rank takes part in the one collective
            check_ranks_agree(placement.physical_to_logical_map)
        except ValueError as e:
            raise EplbConfigError([Violation("initial-placement", f"{placement.source}: {e}")]) from None
        num_layers, num_physical = (int(d) for d in model_state.physical_to_logical_map.shape)
        differ = placement.mismatches(
            num_moe_layers=num_layers,
            num_logical_experts=int(model_state.logical_to_physical_map.shape[1]),
            num_physical_experts=num_physical,
            num_ranks=get_ep_group().world_size,
        )
        if differ:
            raise EplbConfigError([Violation("initial-placement", describe_mismatch(placement, differ))])
        started = time.monotonic()
        done = install_initial_placement(
            state, event.model_config, placement.physical_to_logical_map, source=placement.source
        )
        installed.add(name)
        group = get_ep_group()
        if group.rank_in_group == 0:
            _log_install(done, model_state, group.world_size, time.monotonic() - started)

    bus.subscribe(RegistrationEvent, on_registered)


def _log_install(event: Any, model_state: Any, num_ranks: int, seconds: float) -> None:
    """EP rank 0's one INFO line of the start-up install: what changed, what rank 0 received, how long."""
    new = model_state.physical_to_logical_map.detach().cpu()
    nbytes = metrics.bytes_received(model_state)
    received = "" if nbytes is None else f", {nbytes} bytes"
    per_rank = measures.received_experts(event.previous, new, num_ranks)  # (L, N)
    init_logger(__name__).info(
        "EPLB: serving starts on the placement of %s: %d of %d MoE layers changed, %d experts crossed ranks "
        "(%d received by EP rank 0%s), in %.2f s",
        event.source, int((event.previous != new).any(dim=1).sum()), int(new.shape[0]), int(per_rank.sum()),
        int(per_rank[:, 0].sum()), received, seconds,
    )  # fmt: skip
