"""control.outcome: every balancedness figure of a rearrangement, figured once, on hand-made windows.

Two layers, four logical experts on six slots of two ranks (L=2, E=4, P=6, N=2). Upstream's initial
placement ``[0, 1, 2, 3, 0, 1]`` serves ``[6, 2, 2, 2]`` as ranks 6 | 6 (balancedness 1) and
``[2, 2, 2, 6]`` as 4 | 8 (0.75); the policy's layer 1 ``[3, 0, 1, 3, 2, 1]`` serves it 6 | 6 and moves
expert 3 to rank 0 and expert 2 to rank 1 (2 experts, 1 layer changed).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ascend_eplb.control.bus import EventBus
from ascend_eplb.control.outcome import Outcomes, PublishTimes, RearrangementOutcome, WindowClosed
from ascend_eplb.control.policy_config import PlacementDecision, PolicySettings

INITIAL = [[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 0, 1]]
PLANNED = [[0, 1, 2, 3, 0, 1], [3, 0, 1, 3, 2, 1]]
SETTINGS = PolicySettings(policy="migration_aware", load_estimate="pooled")


def _model_state(load, placement, name="m", groups=1, nodes=1):
    return SimpleNamespace(
        model_name=name,
        last_expert_load=None if load is None else torch.tensor(load, dtype=torch.int64),
        physical_to_logical_map=torch.tensor(placement, dtype=torch.int64),
        eplb_stats=SimpleNamespace(num_groups=groups, num_nodes=nodes),
    )


def _heard():
    bus = EventBus()
    heard: list = []
    bus.subscribe(WindowClosed, heard.append)
    bus.subscribe(RearrangementOutcome, heard.append)
    return Outcomes(bus), heard


def test_a_done_then_a_skipped_rearrangement_have_their_figures_and_the_next_windows_realise_them():
    outcomes, heard = _heard()
    ms = _model_state([[6, 2, 2, 2], [2, 2, 2, 6]], INITIAL)
    idle = _model_state([[0, 0, 0, 0], [0, 0, 0, 0]], INITIAL, name="idle")
    selections = torch.tensor([[1, 0, 0, 0], [0, 0, 0, 1]])
    outcomes.windows_closed({"k": ms, "i": idle}, 1, 2, SETTINGS, {"k": selections})
    (w1,) = heard  # the model without load closes no window
    assert (w1.model_name, w1.rearrangement, w1.num_ranks) == ("m", 1, 2)
    assert (w1.balancedness, w1.balancedness_eplb_off) == (0.875, 0.875)
    assert (w1.num_expert_groups, w1.num_nodes, w1.realised) == (1, 1, None)
    assert w1.load.tolist() == [[6, 2, 2, 2], [2, 2, 2, 6]]
    assert w1.placement.tolist() == INITIAL
    assert w1.new_selections is selections

    # Done: the decision's estimate figures, the window's figured here, after the last layer only.
    decision = PlacementDecision("migration_aware", None, 0.8, 0.95, 2, "pooled", 0.875, 1.0)
    outcomes.decided("m", 1, decision)
    ms.physical_to_logical_map = torch.tensor(PLANNED)
    outcomes.acknowledged(ms, 0)
    assert len(heard) == 1
    outcomes.acknowledged(ms, 1)
    done = heard[1]
    assert done == RearrangementOutcome(
        "m", 1, "migration_aware", None, "pooled", 0.875, 1.0, 0.8, 0.95, None, None, None, 2, 1
    )
    assert done.moved.tolist() == [0, 2]
    assert done.placement_before.tolist() == INITIAL
    assert done.placement_after.tolist() == PLANNED

    # The next window realises it under the planned placement: layer 0 [4, 4, 4, 4] 8 | 8, layer 1 6 | 6;
    # under the initial one layer 1 is 4 | 8 again.
    ms.last_expert_load = torch.tensor([[4, 4, 4, 4], [2, 2, 2, 6]])
    outcomes.windows_closed({"k": ms}, 2, 2, SETTINGS, {})
    w2 = heard[2]
    assert (w2.balancedness, w2.balancedness_eplb_off, w2.new_selections) == (1.0, 0.875, None)
    assert (w2.realised.outcome, w2.realised.balancedness) == (done, 1.0)
    assert (w2.realised.placed_by, w2.realised.windows, w2.realised.mean) == (1, 1, 1.0)

    # Skipped by the gate: before is the window's under the placement in force, planned the decision's.
    outcomes.decided(
        "m", 2, PlacementDecision("migration_aware", "balanced", 0.9, None, 0, "pooled", 1.0, None)
    )
    skipped = heard[3]
    assert skipped == RearrangementOutcome(
        "m", 2, "migration_aware", "balanced", "pooled", 1.0, None, 0.9, None, None, None, None, 0, 0
    )
    assert skipped.placement_before.tolist() == PLANNED == skipped.placement_after.tolist()
    outcomes.acknowledged(ms, 1)  # upstream commits the unchanged layers: no outcome
    assert len(heard) == 4

    # The third window realises the skipped one; the placement in force is still rearrangement 1's, now
    # over two windows: layer 0 [2, 2, 2, 6] 4 | 8 (0.75), layer 1 [6, 2, 2, 2] 8 | 4 (0.75).
    ms.last_expert_load = torch.tensor([[2, 2, 2, 6], [6, 2, 2, 2]])
    outcomes.windows_closed({"k": ms}, 3, 2, SETTINGS, {})
    w3 = heard[4]
    assert (w3.balancedness, w3.balancedness_eplb_off) == (0.75, 0.875)
    assert (w3.realised.outcome, w3.realised.balancedness) == (skipped, 0.75)
    assert (w3.realised.placed_by, w3.realised.windows, w3.realised.mean) == (1, 2, 0.875)


def test_a_window_without_load_and_a_decision_on_the_window_have_no_figures_of_their_own():
    outcomes, heard = _heard()
    no_load = PlacementDecision("default", "no_load", None, None, 0, "window")
    outcomes.decided("m", None, no_load)
    assert heard == [RearrangementOutcome(
        "m", None, "default", "no_load", "window", None, None, None, None, None, None, None, 0, 0
    )]  # fmt: skip
    assert heard[0].placement_before is None
    assert heard[0].moved is None
    # No decision (upstream's policy unwrapped): the figures on the window, none on an estimate.
    ms = _model_state([[2, 2, 2, 6], [2, 2, 2, 6]], INITIAL)
    outcomes.windows_closed({"k": ms}, 1, 2, PolicySettings(), {})
    ms.physical_to_logical_map = torch.tensor([PLANNED[1], PLANNED[1]])
    outcomes.acknowledged(ms, 1)
    assert heard[2] == RearrangementOutcome(
        "m", 1, "default", None, "window", 0.75, 1.0, None, None, None, None, None, 4, 2
    )


def test_nothing_is_figured_or_kept_while_no_one_listens():
    bus = EventBus()
    outcomes = Outcomes(bus)
    ms = _model_state([[6, 2, 2, 2], [2, 2, 2, 6]], INITIAL)
    outcomes.windows_closed({"k": ms}, 1, 2, SETTINGS, {})
    outcomes.decided("m", 1, PlacementDecision("migration_aware", "balanced", 0.9, None, 0, "pooled"))
    heard: list = []
    bus.subscribe(WindowClosed, heard.append)
    bus.subscribe(RearrangementOutcome, heard.append)
    ms.physical_to_logical_map = torch.tensor(PLANNED)
    outcomes.acknowledged(ms, 1)  # no rearrangement in flight was kept: no outcome
    outcomes.windows_closed({"k": ms}, 2, 2, SETTINGS, {})
    assert len(heard) == 1
    assert heard[0].realised is None  # nor an outcome left to realise


def test_publish_times_count_from_the_first_sight_of_each_layer_to_its_acknowledgement():
    now = [10.0]
    times = PublishTimes(clock=lambda: now[0])
    pending = [SimpleNamespace(model_name="m", pending_result=SimpleNamespace(layer_idx=0))]
    times.seen_pending([*pending, SimpleNamespace(model_name="d", pending_result=None)])
    now[0] = 10.5
    times.seen_pending(pending)  # still pending at the next step boundary: first sight kept
    times.seen("m", (0, 1))  # its commit's move: layer 0 already seen, layer 1 published and moved at once
    now[0] = 11.25
    assert times.acknowledged("m", 0) == 1.25
    assert times.acknowledged("m", 0) is None  # its mark went with the acknowledgement
    assert times.acknowledged("m", 1) == 0.75
    assert times.acknowledged("d", 0) is None  # never published
    times.seen("m", (0, 1, 2))  # a synchronous commit (the start-up install): never acknowledged
    times.drop("m", (0, 1, 2))
    now[0] = 20.0
    times.seen("m", (2,))
    now[0] = 20.5
    assert times.acknowledged("m", 2) == 0.5  # from its own publication, not the install's move
