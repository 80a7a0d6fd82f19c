"""The serving guardrails' rules without ranks: watchdog settings and decisions, the switches (the events
file's reader and writer: ``test_events.py``). (Their multi-rank behaviour runs in ``ascend-eplb
simulate``'s tests, with real ranks.)"""

from __future__ import annotations

import os
from types import SimpleNamespace

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import pytest
import torch

from ascend_eplb.control.bus import EventBus, ShutdownEvent, StepEvent
from ascend_eplb.integration.guardrail_facts import events_path, verify_requested, watchdog_settings
from ascend_eplb.integration.watchdog import WorkerWatchdog


def test_watchdog_settings_defaults_and_every_bad_value():
    assert watchdog_settings({}) == (600.0, "stop")
    assert watchdog_settings(
        {"ASCEND_EPLB_WORKER_TIMEOUT_S": "2.5", "ASCEND_EPLB_ON_WORKER_FAILURE": "RAISE"}
    ) == (
        2.5,
        "raise",
    )
    for raw in ("0", "-1", "inf", "nan", "ten"):
        with pytest.raises(ValueError, match="ASCEND_EPLB_WORKER_TIMEOUT_S=") as info:
            watchdog_settings({"ASCEND_EPLB_WORKER_TIMEOUT_S": raw})
        assert (
            str(info.value) == f"ASCEND_EPLB_WORKER_TIMEOUT_S={raw!r}: must be a finite number of seconds > 0"
        )
    with pytest.raises(
        ValueError, match=r"ASCEND_EPLB_ON_WORKER_FAILURE='ignore': must be one of stop, raise"
    ):
        watchdog_settings({"ASCEND_EPLB_ON_WORKER_FAILURE": "ignore"})


def _state(*names, steps_until=4):
    return SimpleNamespace(
        model_states={n: SimpleNamespace(model_name=n) for n in names},
        expert_rearrangement_step_interval=8,
        expert_rearrangement_step=8 - steps_until,
    )


def test_watchdog_decides_from_the_gathered_rows_alone():
    dog = WorkerWatchdog(timeout_s=5.0)
    state = _state("m")
    # Rows: [alive, in_cycle, has_pending, ms_without_progress, layer_in_flight] per rank (upstream's
    # step counter is read from the state: the same on every rank).
    assert dog._decide(state, [[1, 0, 0, 0, 0], [1, 0, 0, 0, 0]]) is None  # idle
    assert dog._decide(state, [[1, 1, 1, 4000, 3], [1, 1, 0, 4000, 3]]) is None  # within the timeout
    died = dog._decide(state, [[1, 1, 1, 100, 3], [0, 1, 0, 100, 3]])
    assert (died.kind, died.ranks, died.model, died.layer, died.cause) == ("died", (1,), "m", 3, "")
    stalled = dog._decide(state, [[1, 1, 0, 5001, 3], [1, 1, 0, 5001, 3]])
    assert (stalled.kind, stalled.ranks, stalled.model, stalled.layer) == ("stalled", (0, 1), "m", 3)
    assert stalled.cause == (
        "the rearrangement cycle made no progress for 5.0 s (> 5 s, ASCEND_EPLB_WORKER_TIMEOUT_S): "
        "layer 3 was not published by rank(s) 0, 1"
    )
    # A worker dead between cycles is named too, with no cycle in flight.
    idle_dead = dog._decide(state, [[0, 0, 0, 0, 0], [1, 0, 0, 0, 0]])
    assert (idle_dead.ranks, idle_dead.model, idle_dead.layer) == ((0,), None, None)
    assert "no cycle in flight" in idle_dead.message()
    with pytest.raises(ValueError, match="on_failure='ignore'"):
        WorkerWatchdog(on_failure="ignore")


def test_a_stall_past_the_interval_is_named_as_upstreams_silent_stop():
    """vllm-project/vllm#57883: rank 0's worker published layer 3 and waits for it to be consumed, rank 1's
    never publishes it; upstream's step counter runs past its interval (its log says "steps until the
    next rearrangement: -37")."""
    dog = WorkerWatchdog(timeout_s=5.0)
    state = _state("m", steps_until=-37)
    stalled = dog._decide(state, [[1, 1, 1, 5001, 3], [1, 1, 0, 5001, 3]])
    assert (stalled.kind, stalled.ranks, stalled.layer) == ("stalled", (1,), 3)
    assert stalled.cause == (
        "the rearrangement cycle made no progress for 5.0 s (> 5 s, ASCEND_EPLB_WORKER_TIMEOUT_S): "
        "layer 3 was not published by rank(s) 1 (rank(s) 0 published it: their workers wait for it to be "
        "consumed); upstream's silent stop (vllm-project/vllm#57883): EplbState.expert_rearrangement_step "
        "ran 37 steps past expert_rearrangement_step_interval ('steps until the next rearrangement: -37'), "
        "because EplbState.step returns before resetting it while a cycle is in flight, so upstream alone "
        "would never rearrange again"
    )
    # Within the timeout nothing is decided, whatever the counter says (a slow transfer is not a stall).
    assert dog._decide(state, [[1, 1, 1, 4000, 3], [1, 1, 0, 4000, 3]]) is None


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _model_state(rebalanced, pending_layer=None):
    pending = None if pending_layer is None else SimpleNamespace(layer_idx=pending_layer)
    return SimpleNamespace(model_name="m", rebalanced=rebalanced, pending_result=pending)


def test_at_shutdown_logs_a_cycle_in_flight_with_how_long_it_went_without_progress(caplog):
    import logging

    clock = _Clock()
    dog = WorkerWatchdog(timeout_s=2.0, clock=clock)
    ms = _model_state(False)
    state = SimpleNamespace(model_states={"k": ms}, num_rearrangements=0, commit_log=[])
    controller = SimpleNamespace(state=state)
    bus = EventBus()
    dog.attach(bus)
    assert bus.subscribers(ShutdownEvent) == (dog.at_shutdown,)
    assert bus.subscribers(StepEvent) == (dog.on_step,)
    dog._local_status(state)  # step boundary 0: nothing in flight
    assert dog.at_shutdown(ShutdownEvent(controller)) == []
    ms.rebalanced, state.num_rearrangements = True, 1  # the cycle starts at boundary 1
    dog.steps = 1
    dog._local_status(state)
    dog._rank = 3
    for step in range(2, 27):  # 25 boundaries, 0.5 s, without progress
        clock.now += 0.02
        dog.steps = step
        dog._local_status(state)
    caplog.set_level(logging.INFO)
    (cycle,) = dog.at_shutdown(ShutdownEvent(controller))
    assert (cycle.model, cycle.rearrangement, cycle.layer, cycle.published) == ("m", 1, 0, False)
    assert cycle.rank == 3
    assert cycle.steps_without_progress == 25
    assert cycle.seconds_without_progress == pytest.approx(0.5)
    assert dog.in_flight_at_shutdown == [cycle]
    assert cycle.message() == (
        "EPLB worker watchdog at shutdown: rank 3: rearrangement 1 of model m in flight (layer 0 not "
        "published), no progress for 0.5 s (25 steps), below the watchdog's timeout, so it was never judged "
        "stalled (ASCEND_EPLB_WORKER_TIMEOUT_S=2 s); the cycle is dropped with the runner"
    )
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [("WARNING", cycle.message())]
    # Layer 0 published since the last boundary: that is progress, logged at INFO.
    ms.pending_result = SimpleNamespace(layer_idx=0)
    caplog.clear()
    (cycle,) = dog.at_shutdown(ShutdownEvent(controller))
    assert (cycle.steps_without_progress, cycle.published, cycle.seconds_without_progress) == (0, True, 0.0)
    assert [r.levelname for r in caplog.records] == ["INFO"]
    assert "(layer 0 published, not yet committed), no progress for 0.0 s (0 steps)" in cycle.message()


def test_a_model_waiting_behind_the_draft_starts_its_clock_when_its_turn_comes():
    # Upstream's worker moves the registered models one after the other (the MTP draft, then the target);
    # both are `rebalanced` from the rearrangement's start. The target's clock starts when the draft's
    # cycle ends, not at the start: its wait behind the draft is not its stall.
    clock = _Clock()
    dog = WorkerWatchdog(timeout_s=2.0, clock=clock)
    draft, target = _model_state(True), _model_state(True)
    draft.model_name = "m (draft)"
    state = SimpleNamespace(model_states={"d": draft, "t": target}, num_rearrangements=1, commit_log=[])
    row = dog._local_status(state)
    assert row == [1, 1, 0, 0, 0, 0, 0, 0, 0]  # the draft in its cycle, the target waiting
    clock.now += 3.0  # the draft's layer takes 3 s, beyond the timeout
    draft.pending_result = SimpleNamespace(layer_idx=0)
    assert dog._local_status(state) == [1, 1, 1, 0, 0, 0, 0, 0, 0]
    draft.rebalanced, draft.pending_result = False, None  # its layer committed: the target's turn
    row = dog._local_status(state)
    assert row == [1, 0, 0, 0, 0, 1, 0, 0, 0]
    assert dog._decide(state, [row, row]) is None  # before the fix: the target 3 s without progress
    clock.now += 2.5  # now the target's first layer is not published for 2.5 s: stalled, and named
    row = dog._local_status(state)
    stalled = dog._decide(state, [row, row])
    assert (stalled.kind, stalled.model, stalled.layer) == ("stalled", "m", 0)
    # At shutdown only the model whose turn it is is in flight (a waiting one has no progress to judge).
    draft.rebalanced = True
    dog._local_status(state)
    (cycle,) = dog.at_shutdown(ShutdownEvent(SimpleNamespace(state=state)))
    assert cycle.model == "m (draft)"


def test_a_bad_verify_or_events_switch_is_refused_not_ignored(tmp_path):
    assert verify_requested({}) is False
    assert verify_requested({"ASCEND_EPLB_VERIFY": "On"}) is True
    assert verify_requested({"ASCEND_EPLB_VERIFY": "0"}) is False
    with pytest.raises(ValueError, match=r"ASCEND_EPLB_VERIFY='ture': must be one of 1, true, yes, on, 0"):
        verify_requested({"ASCEND_EPLB_VERIFY": "ture"})
    with pytest.raises(ValueError, match=r"is a folder; name the events file"):
        events_path({"ASCEND_EPLB_EVENTS": str(tmp_path)})
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=rf"{blocker} is a file, not a folder; name an events file in a "):
        events_path({"ASCEND_EPLB_EVENTS": str(blocker / "sub" / "events.jsonl")})
    assert events_path({"ASCEND_EPLB_EVENTS": str(tmp_path / "new" / "e.jsonl")}) == str(
        tmp_path / "new" / "e.jsonl"
    )
    assert events_path({"ASCEND_EPLB_EVENTS": str(blocker)}) == str(blocker)  # an existing file: appended to
    # Judged by creating (a probe beside it, removed): nothing was left, no folder made.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    # Issue 43 case 11: permission bits say nothing of /sys and /proc, where root "may write" but nothing
    # can be created; judged with os.access, both passed check as root.
    for path, folder in (("/sys/ev.jsonl", "/sys"), ("/proc/nope/ev.jsonl", "/proc")):
        with pytest.raises(ValueError, match="nothing can be created") as info:
            events_path({"ASCEND_EPLB_EVENTS": path})
        said = str(info.value)
        assert said.startswith(f"ASCEND_EPLB_EVENTS={path}: nothing can be created in {folder} ("), said
        assert said.endswith("); name an events file in a writable folder"), said
    # A FIFO would block the recorder of EP rank 0 when it opens it: refused on every rank at start-up.
    fifo = tmp_path / "events.fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="FIFO") as info:
        events_path({"ASCEND_EPLB_EVENTS": str(fifo)})
    assert str(info.value) == (
        f"ASCEND_EPLB_EVENTS={fifo}: is a FIFO, not a regular file (appending to it would block or never "
        "end); name an events file (e.g. events.jsonl)"
    )


def test_the_watchdog_hears_commits_on_the_bus_past_the_commit_logs_length():
    """Issue 30: the watchdog found the layer in flight by reading ``AscendEplbState.commit_log``, a deque
    of ``COMMIT_LOG_MAXLEN`` events. Model ``m``'s last acknowledgement (layer 2) is followed by more
    commit events of a draft than the deque holds: the log has lost it, the bus has not."""
    from vllm.config import ParallelConfig

    from ascend_eplb.control.bus import CommitEvent
    from ascend_eplb.control.state import COMMIT_LOG_MAXLEN, AscendEplbState
    from ascend_eplb.integration import patches

    installed = patches.apply_patches()
    try:
        bus = EventBus()
        state = AscendEplbState(ParallelConfig(), torch.device("cpu"), bus=bus)
        dog = WorkerWatchdog(timeout_s=5.0)
        dog.attach(bus)
        main = _model_state(True)
        draft = SimpleNamespace(model_name="draft", rebalanced=True, pending_result=None)
        state.model_states["k"] = main
        state.num_rearrangements = 1
        for layer in range(3):
            for kind in ("move", "commit", "refresh", "acknowledge"):
                state._log(kind, main, layer)
        draft_events = COMMIT_LOG_MAXLEN + 8
        for index in range(draft_events):
            state._log(("move", "commit", "refresh", "acknowledge")[index % 4], draft, index // 4)
        assert len(state.commit_log) == COMMIT_LOG_MAXLEN
        assert [e for e in state.commit_log if e.model_name == "m"] == []  # the log forgot m's commits
        # [alive, in_cycle, has_pending, ms_without_progress, layer_in_flight]: layer 3 is next.
        assert dog._local_status(state) == [1, 1, 0, 0, 3]
        (cycle,) = dog.at_shutdown(ShutdownEvent(SimpleNamespace(state=state)))
        assert (cycle.model, cycle.rearrangement, cycle.layer, cycle.published) == ("m", 1, 3, False)
        # A new rearrangement starts from layer 0 until its first acknowledgement.
        state.num_rearrangements = 2
        assert dog._local_status(state)[-1] == 0
        state._log("acknowledge", main, 0)
        assert dog._local_status(state)[-1] == 1
        assert len(bus.subscribers(CommitEvent)) == 1  # the watchdog's, and the state keeps no reader
    finally:
        if installed:
            patches.remove_patches()
