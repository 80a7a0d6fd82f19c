"""The one event bus of EPLB control: what happened, typed, delivered to whoever subscribed.

Each ``AscendEPLBController`` owns one :class:`EventBus` (``controller.bus``), its ``AscendEplbState``
publishes to it, and integration's guardrails (watchdog, verifier, events file, metrics; their events
``WorkerFailure``, ``VerifierViolation``, ``EventsRecord``) subscribe once, when the controller is built.
Events are frozen dataclasses: :class:`RegistrationEvent`, :class:`StepEvent`, :class:`ShutdownEvent`
(controller), :class:`RearrangementEvent`, :class:`DecisionEvent`, :class:`CommitEvent` (state).
:meth:`EventBus.publish` is synchronous, on the publishing (runner) thread, to the subscribers of the
exact type in order; a subscriber's exception propagates at once (later subscribers are not called, the
publisher stops there: upstream's commit, or the step). Registration, step and the guardrails' events are
published on every EP rank at the same point (a subscriber may run collectives on the EP CPU group);
shutdown is rank-local.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

__all__ = [
    "CommitEvent",
    "CommitEventKind",
    "ControllerEvent",
    "DecisionEvent",
    "Event",
    "EventBus",
    "RearrangementEvent",
    "RegistrationEvent",
    "ShutdownEvent",
    "StepEvent",
]


@dataclass(frozen=True)
class Event:
    """The base of every event type the bus delivers (subscribe to a subclass, never to this)."""


EventT = TypeVar("EventT", bound=Event)


@dataclass(frozen=True)
class ControllerEvent(Event):
    """The base of the events the controller publishes (subscribe to a subclass).

    Attributes:
        controller: the ``AscendEPLBController`` that published it.
    """

    controller: Any


@dataclass(frozen=True)
class RegistrationEvent(ControllerEvent):
    """A model (or draft) was registered with the controller's state (every rank, same order); also
    ``model`` (the registered model, a draft's ``speculator.model``) and ``model_config`` (its model
    config: ``compute_hash()`` keys ``state.model_states``)."""

    model: Any
    model_config: Any


@dataclass(frozen=True)
class StepEvent(ControllerEvent):
    """Upstream's step ran (EPLB on, not suppressed, a model registered): same condition on every rank;
    also upstream's ``is_dummy`` and ``is_profile``, and ``step``, the step's number (the controller's
    ``steps_run`` while its boundary is published: a profile run shares the next step's number)."""

    is_dummy: bool
    is_profile: bool
    step: int


@dataclass(frozen=True)
class ShutdownEvent(ControllerEvent):
    """The runner's end of life (``AscendEPLBController.shutdown``), once; rank-local."""


@dataclass(frozen=True)
class RearrangementEvent(Event):
    """A rearrangement started: upstream's ``rearrange`` handed a closed window to the policy (not for
    profile or skipped ones); each model state's ``last_expert_load`` is that window's global logical load.

    Attributes:
        state: the ``AscendEplbState`` (its ``num_rearrangements`` is this rearrangement's 1-based index).
        new_selections: per model with the load estimate on (``state.model_states`` key), int64 ``(L, E)``
            CPU: the global logical selections recorded since the previous regular rearrangement, the
            estimate's evidence this time (``AscendEplbState.new_selections``); empty when it is off.
    """

    state: Any
    new_selections: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DecisionEvent(Event):
    """What the placement policy and the gain gate decided for one model's closed window, on every EP rank.

    Published by the state, when the policy is wrapped (not upstream's default, or the gate on), just before
    the first commit event of that model's rearrangement; and for every model at once, whatever the
    settings, for a window in which no EP rank recorded load (reason ``"no_load"``). A skipped decision is
    still followed by upstream's per-layer commits of the unchanged placement (nothing moves).

    Attributes:
        state: the ``AscendEplbState``.
        model_name: upstream ``EplbModelState.model_name``.
        rearrangement: 1-based index (``state.num_rearrangements``); None for ``"no_load"``.
        decision: the ``ascend_eplb.control.policy_config.PlacementDecision``.
        model_state: upstream's ``EplbModelState`` (not compared, not in the repr).
    """

    state: Any = field(compare=False, repr=False)
    model_name: str
    rearrangement: int | None
    decision: Any
    model_state: Any = field(default=None, compare=False, repr=False)


CommitEventKind = Literal["move", "commit", "refresh", "acknowledge"]


@dataclass(frozen=True)
class CommitEvent(Event):
    """One observed step of a layer's placement change (kept in ``AscendEplbState.commit_log``, published).

    Attributes:
        kind: ``"move"`` (upstream's commit starts; the weights hold the new placement), ``"commit"``
            (upstream's commit returned), ``"refresh"`` (the layer's lookups refreshed in place),
            ``"acknowledge"`` (``consumed_event.record()`` released the async worker's staging buffer).
        model_name: upstream ``EplbModelState.model_name``.
        layer: MoE layer index.
        rearrangement: 1-based index of its rearrangement (0: ``update_mapping`` before any).
        evidence: empty unless ``AscendEplbState.collect_commit_evidence``; ``move``: ``map_before`` (the
            old committed row, P ints) and ``probe`` (``commit_probe``'s return); ``commit``: ``map``;
            ``refresh``: the lookups' ``checksums`` and ``data_ptrs``; ``acknowledge``:
            ``pending_result_cleared`` and ``checksums``.
        model_state: upstream's ``EplbModelState`` of the layer (not compared, not in the repr).
        publish_to_acknowledge_s: ``acknowledge`` only: seconds from the layer's publication by the async
            worker to this acknowledgement (``AscendEplbState.publish_times``); None otherwise or unseen.
    """

    kind: CommitEventKind
    model_name: str
    layer: int
    rearrangement: int
    evidence: Mapping[str, Any] = field(default_factory=dict)
    model_state: Any = field(default=None, compare=False, repr=False)
    publish_to_acknowledge_s: float | None = None


#: Bases no event is published as (a subscription to one would never be called).
_BASES = (Event, ControllerEvent)


def _check_event_type(event_type: Any) -> None:
    if not (isinstance(event_type, type) and issubclass(event_type, Event)) or event_type in _BASES:
        raise TypeError(
            f"{event_type!r} is not an event type: subscribe to a subclass of "
            "ascend_eplb.control.bus.Event (e.g. StepEvent, CommitEvent)"
        )


class EventBus:
    """Subscribers per event type, called in subscription order on the publishing thread (module
    docstring)."""

    def __init__(self) -> None:
        self._subscribers: dict[type[Event], list[Callable[[Any], None]]] = {}

    def subscribe(self, event_type: type[EventT], fn: Callable[[EventT], None]) -> None:
        """Call ``fn(event)`` for every published event of exactly ``event_type``, after the subscribers
        already there.

        Raises:
            TypeError: ``event_type`` is not a subclass of :class:`Event` (or is a base:
                :class:`Event`, :class:`ControllerEvent`),
                or ``fn`` is not callable (nothing is subscribed then).
        """
        _check_event_type(event_type)
        if not callable(fn):
            raise TypeError(f"subscriber {fn!r} of {event_type.__name__} is not callable")
        self._subscribers.setdefault(event_type, []).append(fn)

    def publish(self, event: Event) -> None:
        """Deliver ``event`` to the subscribers of its type, in order; a subscriber's exception
        propagates at once (the later ones are not called). A subscriber added during the delivery hears
        the next event on.

        Raises:
            TypeError: ``event`` is not an :class:`Event`.
        """
        if not isinstance(event, Event):
            raise TypeError(f"{event!r} is not an event (an ascend_eplb.control.bus.Event)")
        for fn in tuple(self._subscribers.get(type(event), ())):
            fn(event)

    def subscribers(self, event_type: type[Event]) -> tuple[Callable[[Any], None], ...]:
        """The subscribers of ``event_type``, in delivery order.

        Raises:
            TypeError: ``event_type`` is not an event type.
        """
        _check_event_type(event_type)
        return tuple(self._subscribers.get(event_type, ()))

    def wrap(self, fn: Callable[[Any], None], wrapper: Callable[[Callable[[Any], None]], Any]) -> None:
        """Replace each subscription of ``fn`` by ``wrapper(fn)``, in place (same event type, same
        position): for tools that time or gate a subscriber (the simulator, the verifier benchmark).

        ``fn`` is matched by ``==`` (a bound method is a new object at each attribute access, equal to
        the one subscribed). Every ``wrapper(fn)`` is made before the first subscription changes.

        Raises:
            ValueError: ``fn`` is not subscribed to any event type (nothing changes).
            TypeError: ``wrapper(fn)`` is not callable (nothing changes); an exception ``wrapper``
                raises propagates, and nothing changes either.
        """
        found = [(fns, i) for fns in self._subscribers.values() for i, f in enumerate(fns) if f == fn]
        if not found:
            raise ValueError(f"{fn!r} is not subscribed to this bus")
        wrapped = [wrapper(fn) for _ in found]
        for w in wrapped:
            if not callable(w):
                raise TypeError(f"wrapper({fn!r}) returned {w!r}, which is not callable")
        for (fns, i), w in zip(found, wrapped, strict=True):
            fns[i] = w
