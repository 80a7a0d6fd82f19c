"""Serving starts on ``eplb_config.initial_placement``: the start-up install of a placement file.

:func:`attach_startup_install` is what ``serving.build_serving_controller`` subscribes (after the
guardrails) when start-up validation read a placement file (``placement_file.read_placements``, each
served model's placement assigned by ``placement_file.assign_placements`` and judged by the rule
``initial-placement``): at each model's registration (the target's, and an MoE draft's upstream registers
beside it), the facts of upstream's state are compared with its placement's (the MoE layers are first
known there), then
``ascend_eplb.control.initial_placement.install_initial_placement`` moves every slot's weights and commits
the maps through upstream's transaction, before the async worker starts. See ``integration/README.md``,
"Serving from a placement file". Imports control, torch and vLLM only when a model registers.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from ascend_eplb.integration.placement_file import describe_mismatch
from ascend_eplb.integration.rules import Violation
from ascend_eplb.integration.validation import EplbConfigError

__all__ = ["attach_startup_install"]


def attach_startup_install(bus: Any, placements: Mapping[str, Any]) -> None:
    """Install each model's placement when it registers: subscribe to ``bus`` (a controller's
    :class:`~ascend_eplb.control.bus.EventBus`; subscribe it after the guardrails, so that the verifier
    has fingerprinted the loaded slots and checks the install's commit, and the events recorder writes
    its ``initial_placement`` record).

    At each :class:`~ascend_eplb.control.bus.RegistrationEvent` (every rank, same order: an MoE draft
    upstream registers beside the target first, then the target), before anything moves: the model's
    placement is ``placements[name]`` (``name``: upstream's ``EplbModelState.model_name``; start-up's rule
    ``initial-placement`` refused a file that leaves a served model without one or names a model not
    served); every EP rank must have read the same placement (each reads its own copy of the file:
    ``check_ranks_agree``, one collective); the facts of upstream's state (L and P of
    ``physical_to_logical_map``, E, the EP size) are compared with the placement's; then
    :func:`ascend_eplb.control.initial_placement.install_initial_placement` moves the weights and commits
    the maps through upstream's transaction.

    Args:
        bus: the controller's event bus.
        placements: ``{model name: placement_file.Placement}`` (``placement_file.assign_placements``).

    Raises (from the registration, on every rank alike):
        EplbConfigError: no placement for the registering model, the EP ranks read different placements,
            or the placement was made for another model or layout (every differing fact with the file's
            value and the model's); rule ``initial-placement``.
    """
    from ascend_eplb.control.bus import RegistrationEvent

    installed: set[str] = set()

    def on_registered(event: RegistrationEvent) -> None:
        from vllm.distributed.parallel_state import get_ep_group

        from ascend_eplb.control.initial_placement import check_ranks_agree, install_initial_placement

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
    from vllm.logger import init_logger

    from ascend_eplb.control import measures
    from ascend_eplb.integration import metrics

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
