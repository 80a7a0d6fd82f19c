"""What became of each closed load window, figured once where the state decides it, published typed.

For each model, a regular rearrangement's window closes (:class:`WindowClosed`: its balancedness under the
placement in force and under upstream's initial placement, and the realised balance of the last
rearrangement), then the rearrangement ends (:class:`RearrangementOutcome`): skipped when the gate or a
window without load decided so, done when its last layer is acknowledged. :class:`Outcomes` (one per
``AscendEplbState``, on its bus) figures them only while someone subscribes to either type; integration's
events recorder writes them. Every balancedness is :func:`~ascend_eplb.control.measures.mean_balancedness`
of the window as float64 ``(L, E)`` on N ranks. :class:`PublishTimes` times each layer of a rearrangement
from its publication to its acknowledgement (the ``acknowledge`` commit event carries it).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ascend_eplb.control import measures
from ascend_eplb.control.bus import Event, EventBus
from ascend_eplb.control.policy_config import PlacementDecision
from ascend_eplb.control.values import is_int

__all__ = ["Outcomes", "PublishTimes", "Realised", "RearrangementOutcome", "WindowClosed"]


@dataclass(frozen=True)
class RearrangementOutcome(Event):
    """What became of one model's closed window: done (its last layer acknowledged) or skipped.

    Attributes:
        model_name: upstream ``EplbModelState.model_name``.
        rearrangement: 1-based index (``state.num_rearrangements``); None for ``"no_load"``.
        policy, load_estimate: the settings' names; ``skipped``: None (done) or the reason.
        balancedness_before: the window's under the placement in force when it closed;
            ``balancedness_planned``: under the policy's placement (done: the committed one). Both None
            when no window of the model was figured (``"no_load"``), planned also when the policy did not run.
        estimate_balancedness_before, estimate_balancedness_planned: the decision's on the load estimate
            (None on the window, or with no decision: upstream's policy unwrapped).
        placement_before, placement_after: int64 ``(L, P)`` CPU, in force when the window closed and after
            (the same when skipped); None with no figured window.
        moved: int64 ``(L,)``, experts that crossed ranks per layer (``measures.moved_experts``); None when
            skipped. ``experts_moved`` is its sum, ``layers_changed`` the layers whose row changed.
        model_state: upstream's ``EplbModelState`` (not compared, not in the repr).
    """

    model_name: str
    rearrangement: int | None
    policy: str
    skipped: str | None
    load_estimate: str
    balancedness_before: float | None
    balancedness_planned: float | None
    estimate_balancedness_before: float | None
    estimate_balancedness_planned: float | None
    placement_before: torch.Tensor | None = field(compare=False)
    placement_after: torch.Tensor | None = field(compare=False)
    moved: torch.Tensor | None = field(compare=False)
    experts_moved: int
    layers_changed: int
    model_state: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Realised:
    """The balance the placement in force served, for the last rearrangement with an index.

    Attributes:
        outcome: that rearrangement's :class:`RearrangementOutcome` (done or skipped).
        balancedness: the closing window's under the placement in force.
        placed_by: the rearrangement that made that placement (None: serving's start placement).
        windows: windows with load closed under it, this one included; ``mean``: their mean balancedness
            (``math.fsum`` over ``windows``).
    """

    outcome: RearrangementOutcome
    balancedness: float
    placed_by: int | None
    windows: int
    mean: float


@dataclass(frozen=True)
class WindowClosed(Event):
    """A model's load window with load closed and upstream's policy receives it (regular rearrangements).

    Attributes:
        model_name: upstream ``EplbModelState.model_name``; ``rearrangement``: the 1-based index it starts.
        load: ``(L, E)`` CPU, upstream's ``last_expert_load`` (the window's global logical load).
        placement: int64 ``(L, P)`` CPU, the placement in force; ``num_ranks``: N.
        balancedness: the window's under ``placement``; ``balancedness_eplb_off``: under upstream's
            initial placement (what EPLB off served).
        num_expert_groups, num_nodes: what upstream handed its policy (``EplbStats``; None when it kept none).
        new_selections: int64 ``(L, E)``, the load estimate's evidence this time (None: the estimate is off).
        realised: the last rearrangement's realised balance, which this window adds to (None: none yet).
        model_state: upstream's ``EplbModelState`` (not compared, not in the repr).
    """

    model_name: str
    rearrangement: int
    load: torch.Tensor = field(compare=False)
    placement: torch.Tensor = field(compare=False)
    num_ranks: int
    balancedness: float
    balancedness_eplb_off: float
    num_expert_groups: int | None
    num_nodes: int | None
    new_selections: torch.Tensor | None = field(compare=False)
    realised: Realised | None
    model_state: Any = field(default=None, compare=False, repr=False)


@dataclass
class _Cycle:
    """A rearrangement in flight for one model: its window and the placement it started from."""

    window: WindowClosed
    policy: str
    load_estimate: str
    decision: PlacementDecision | None = None


class Outcomes:
    """Each model's rearrangement in flight and placement in force, turned into :class:`WindowClosed` and
    :class:`RearrangementOutcome` on ``bus``; the state calls it where it decides (every EP rank alike)."""

    def __init__(self, bus: EventBus) -> None:
        self.bus = bus
        self._cycles: dict[str, _Cycle] = {}
        # Per model: the last rearrangement with an index, until the next window realises it.
        self._unrealised: dict[str, RearrangementOutcome] = {}
        # Per model: the rearrangement whose placement is in force (None: the start placement) and the
        # balancedness of each window with load closed under it.
        self._in_force: dict[str, tuple[int | None, list[float]]] = {}

    @property
    def listening(self) -> bool:
        """Whether anyone subscribes to either event (else nothing is figured)."""
        return bool(self.bus.subscribers(WindowClosed) or self.bus.subscribers(RearrangementOutcome))

    def windows_closed(
        self,
        model_states: Mapping[str, Any],
        rearrangement: int,
        num_ranks: int,
        settings: Any,
        new_selections: Mapping[str, torch.Tensor],
    ) -> None:
        """A regular rearrangement started: each model state with load in its ``last_expert_load`` closes
        its window (one without load kept its placement: its ``"no_load"`` outcome came at its decision).
        ``settings``: the state's ``PolicySettings``; ``new_selections``: by ``model_states`` key."""
        if not self.listening:
            return
        for key, ms in model_states.items():
            load = ms.last_expert_load
            if load is None or not bool((load > 0).any()):
                continue
            stats = ms.eplb_stats  # what upstream's rearrange handed its policy for this window
            groups, nodes = (None, None) if stats is None else (stats.num_groups, stats.num_nodes)
            window = self.window_closed(
                ms.model_name, rearrangement, load.detach().cpu(),
                ms.physical_to_logical_map.detach().cpu().clone(), num_ranks,
                num_expert_groups=int(groups) if is_int(groups) else None,
                num_nodes=int(nodes) if is_int(nodes) else None,
                new_selections=new_selections.get(key), model_state=ms,
            )  # fmt: skip
            self._cycles[ms.model_name] = _Cycle(window, settings.policy, settings.load_estimate)

    def window_closed(
        self,
        model_name: str,
        rearrangement: int,
        load: torch.Tensor,
        placement: torch.Tensor,
        num_ranks: int,
        *,
        num_expert_groups: int | None = None,
        num_nodes: int | None = None,
        new_selections: torch.Tensor | None = None,
        model_state: Any = None,
    ) -> WindowClosed:
        """Figure and publish one model's closed window (``load`` ``(L, E)``, ``placement`` int64 ``(L, P)``
        in force, both CPU); it realises the model's last rearrangement with an index.

        Raises:
            ValueError: from :func:`~ascend_eplb.control.measures.rank_loads` (shapes, ids, N).
        """
        on = load.to(torch.float64)
        num_layers, num_physical = (int(d) for d in placement.shape)
        num_logical = int(load.shape[1])
        in_force = _mean(on, placement, num_ranks)
        # EPLB off: upstream's initial placement (its redundant slots replicate experts 0..R-1).
        initial = measures.upstream_initial_placement(num_logical, num_physical - num_logical, num_layers)
        placed_by, served = self._in_force.setdefault(model_name, (None, []))
        served.append(in_force)
        done = self._unrealised.pop(model_name, None)
        realised = None
        if done is not None:
            realised = Realised(done, in_force, placed_by, len(served), math.fsum(served) / len(served))
        window = WindowClosed(
            model_name, rearrangement, load, placement, num_ranks, in_force, _mean(on, initial, num_ranks),
            num_expert_groups, num_nodes, new_selections, realised, model_state,
        )  # fmt: skip
        self.bus.publish(window)
        return window

    def decided(
        self, model_name: str, rearrangement: int | None, decision: PlacementDecision, model_state: Any = None
    ) -> None:
        """The state published ``decision`` for ``model_name``: a skipped window's outcome at once; a
        planned one waits for its last layer (:meth:`acknowledged`)."""
        if not self.listening:
            return
        cycle = self._cycles.get(model_name) if rearrangement is not None else None
        if decision.skipped is None:
            if cycle is not None:
                cycle.decision = decision
            return
        if rearrangement is not None:
            self._cycles.pop(model_name, None)  # upstream still commits the unchanged layers: no outcome then
        kept = None if cycle is None else cycle.window.placement
        self._publish(RearrangementOutcome(
            model_name, rearrangement, decision.policy, decision.skipped, decision.load_estimate,
            None if cycle is None else cycle.window.balancedness,
            None if cycle is None else decision.window_balancedness_planned,
            *_on_estimate(decision if cycle is not None else None),
            kept, kept, None, 0, 0, model_state,
        ))  # fmt: skip

    def acknowledged(self, model_state: Any, layer: int) -> None:
        """``layer`` of ``model_state`` was acknowledged: after its last layer, the model's rearrangement
        in flight is done (its committed placement read from ``physical_to_logical_map``)."""
        cycle = self._cycles.get(model_state.model_name) if self.listening else None
        if cycle is None or layer != cycle.window.placement.shape[0] - 1:
            return
        del self._cycles[model_state.model_name]
        window = cycle.window
        old, new = window.placement, model_state.physical_to_logical_map.detach().cpu()
        moved = measures.moved_experts(old, new, window.num_ranks)
        self._publish(RearrangementOutcome(
            window.model_name, window.rearrangement, cycle.policy, None, cycle.load_estimate,
            window.balancedness, _mean(window.load.to(torch.float64), new, window.num_ranks),
            *_on_estimate(cycle.decision), old, new, moved, int(moved.sum()),
            int((old != new).any(dim=1).sum()), model_state,
        ))  # fmt: skip

    def _publish(self, outcome: RearrangementOutcome) -> None:
        if outcome.rearrangement is not None:
            self._unrealised[outcome.model_name] = outcome
            if outcome.skipped is None:
                self._in_force[outcome.model_name] = (outcome.rearrangement, [])
        self.bus.publish(outcome)


def _mean(load: torch.Tensor, placement: torch.Tensor, num_ranks: int) -> float:
    return measures.mean_balancedness(measures.rank_loads(load, placement, num_ranks))


def _on_estimate(decision: PlacementDecision | None) -> tuple[float | None, float | None]:
    """An outcome's figures on the load estimate from the policy's decision (its own figures are on the
    load it planned on): None where it planned on the window, or made no decision (upstream's policy
    unwrapped)."""
    if decision is None or decision.load_estimate == "window":
        return None, None
    return decision.balancedness_before, decision.balancedness_planned


class PublishTimes:
    """Each layer's async result from its publication to its acknowledgement, in seconds of ``clock``.

    Published is when the runner thread first saw it: upstream's ``pending_result`` at a step boundary
    (:meth:`seen_pending`), else at its commit's ``move`` (published and consumed within one step). A
    synchronous commit (the start-up install) is never acknowledged: its marks are dropped.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._seen: dict[tuple[str, int], float] = {}

    def seen(self, model_name: str, layers: Iterable[int]) -> None:
        for layer in layers:
            self._seen.setdefault((model_name, layer), self.clock())

    def seen_pending(self, model_states: Iterable[Any]) -> None:
        """Mark each model's ``pending_result`` (upstream ``EplbModelState``) seen now, if it has one."""
        for ms in model_states:
            if ms.pending_result is not None:
                self.seen(ms.model_name, (ms.pending_result.layer_idx,))

    def drop(self, model_name: str, layers: Iterable[int]) -> None:
        for layer in layers:
            self._seen.pop((model_name, layer), None)

    def acknowledged(self, model_name: str, layer: int) -> float | None:
        """Seconds since the layer was seen published (None if never seen); its mark is dropped."""
        seen = self._seen.pop((model_name, layer), None)
        return None if seen is None else self.clock() - seen
