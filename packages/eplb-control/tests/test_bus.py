"""The controller's event bus: typed subscription, delivery order and thread, a subscriber's exception."""

import threading
from dataclasses import FrozenInstanceError

import pytest

from ascend_eplb.control.bus import (
    CommitEvent,
    ControllerEvent,
    Event,
    EventBus,
    RegistrationEvent,
    ShutdownEvent,
    StepEvent,
)


def test_subscribers_hear_their_event_type_in_subscription_order_on_the_publishing_thread():
    bus = EventBus()
    heard = []
    bus.subscribe(StepEvent, lambda e: heard.append(("first", e, threading.get_ident())))
    bus.subscribe(CommitEvent, lambda e: heard.append(("commit", e, threading.get_ident())))
    bus.subscribe(StepEvent, lambda e: heard.append(("second", e, threading.get_ident())))
    step = StepEvent("controller", False, True, 0)
    result = []
    publisher = threading.Thread(target=lambda: result.append((bus.publish(step), threading.get_ident())))
    publisher.start()
    publisher.join()
    ((returned, publisher_id),) = result
    assert returned is None
    assert heard == [("first", step, publisher_id), ("second", step, publisher_id)]
    commit = CommitEvent("move", "m", 2, 1, model_state="ms")
    bus.publish(commit)
    assert heard[2][:2] == ("commit", commit)
    assert commit.model_state == "ms"
    assert commit == CommitEvent("move", "m", 2, 1)  # the model state is not part of the event's value
    assert "model_state" not in repr(commit)
    bus.publish(ShutdownEvent("controller"))  # no subscriber: nothing happens
    assert len(heard) == 3
    with pytest.raises(FrozenInstanceError):
        step.is_dummy = True


def test_subscribe_refuses_what_is_not_an_event_type_before_anything_changes():
    bus = EventBus()
    for bad in (int, dict, "StepEvent", StepEvent("c", False, False, 0), Event, ControllerEvent, None):
        with pytest.raises(TypeError, match=r"is not an event type: subscribe to a subclass of "):
            bus.subscribe(bad, print)
        with pytest.raises(TypeError, match="is not an event type"):
            bus.subscribers(bad)
    with pytest.raises(TypeError, match=r"^<class 'int'> is not an event type"):
        bus.subscribe(int, print)
    with pytest.raises(TypeError, match=r"subscriber 3 of StepEvent is not callable"):
        bus.subscribe(StepEvent, 3)
    with pytest.raises(TypeError, match=r"^\{'event': 'commit'\} is not an event"):
        bus.publish({"event": "commit"})
    assert bus.subscribers(StepEvent) == ()
    assert bus._subscribers == {}


def test_a_subscribers_exception_propagates_at_once_like_the_hook_lists_before_it():
    """As a hook of the former lists did: the exception leaves the publisher, the later subscribers of
    that event are not called, and the bus keeps delivering afterwards."""
    bus = EventBus()
    heard = []

    def failing(event):
        heard.append("failing")
        raise RuntimeError("subscriber failed")

    bus.subscribe(StepEvent, lambda e: heard.append("before"))
    bus.subscribe(StepEvent, failing)
    bus.subscribe(StepEvent, lambda e: heard.append("after"))
    with pytest.raises(RuntimeError, match="subscriber failed"):
        bus.publish(StepEvent("c", False, False, 0))
    assert heard == ["before", "failing"]
    with pytest.raises(RuntimeError, match="subscriber failed"):
        bus.publish(StepEvent("c", False, False, 0))
    assert heard == ["before", "failing", "before", "failing"]


def test_a_subscriber_added_while_publishing_hears_the_next_event_only():
    bus = EventBus()
    heard = []

    def late(event):
        heard.append(("late", event.is_dummy))

    def subscribing(event):
        heard.append(("subscribing", event.is_dummy))
        if not event.is_dummy:
            bus.subscribe(StepEvent, late)

    bus.subscribe(StepEvent, subscribing)
    bus.publish(StepEvent("c", False, False, 0))
    assert heard == [("subscribing", False)]
    bus.publish(StepEvent("c", True, False, 0))
    assert heard == [("subscribing", False), ("subscribing", True), ("late", True)]


def test_wrap_replaces_a_subscriber_in_its_place():
    bus = EventBus()
    heard = []

    class Owner:
        def on_step(self, event):
            heard.append("owner")

    owner = Owner()
    first = lambda e: heard.append("first")  # noqa: E731
    bus.subscribe(StepEvent, first)
    bus.subscribe(StepEvent, owner.on_step)
    bus.subscribe(StepEvent, lambda e: heard.append("last"))

    def timed(fn):
        def run(event):
            heard.append("timed")
            fn(event)

        return run

    bus.wrap(owner.on_step, timed)  # a new bound method object: found by equality
    bus.publish(StepEvent("c", False, False, 0))
    assert heard == ["first", "timed", "owner", "last"]
    assert bus.subscribers(StepEvent)[0] is first
    with pytest.raises(ValueError, match="is not subscribed to this bus"):
        bus.wrap(owner.on_step, timed)  # already replaced
    assert len(bus.subscribers(StepEvent)) == 3


def test_a_wrap_that_cannot_be_applied_everywhere_changes_nothing():
    """A review found a wrapper returning None accepted (the next publish failed far from the cause),
    and a wrapper raising on a second subscription left the first one wrapped."""
    bus = EventBus()
    fn = lambda e: None  # noqa: E731
    bus.subscribe(StepEvent, fn)
    bus.subscribe(RegistrationEvent, fn)
    with pytest.raises(TypeError) as info:
        bus.wrap(fn, lambda f: None)
    assert str(info.value) == f"wrapper({fn!r}) returned None, which is not callable"
    assert bus.subscribers(StepEvent) == (fn,)
    assert bus.subscribers(RegistrationEvent) == (fn,)
    calls = []

    def fails_second(f):
        calls.append(f)
        if len(calls) == 2:
            raise RuntimeError("second")
        return lambda e: None

    with pytest.raises(RuntimeError, match="second"):
        bus.wrap(fn, fails_second)
    assert bus.subscribers(StepEvent) == (fn,)
    assert bus.subscribers(RegistrationEvent) == (fn,)
