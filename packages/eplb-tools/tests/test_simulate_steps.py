"""The simulator's per-step accounting, in the test process (no ranks)."""

from collections import deque
from types import SimpleNamespace

import torch

from ascend_eplb.control.bus import EventBus
from ascend_eplb.control.outcome import Outcomes
from ascend_eplb.control.state import COMMIT_LOG_MAXLEN, AscendEplbState
from ascend_eplb.tools.simulate import steps
from ascend_eplb.tools.simulate.stats import OutputTolerance, StepLog


def test_every_layer_commit_is_counted_past_the_commit_logs_length():
    """The bug (issue 30): a step's commits were read by slicing ``AscendEplbState.commit_log`` at its
    previous length; once the deque was full (``COMMIT_LOG_MAXLEN`` events, 4 per layer commit) its
    length stopped growing and no later commit was seen. The commits now come from the bus: here the
    state's own ``_log`` (which appends to the deque and publishes on the bus, as every commit does)
    runs for twice the deque's length, one layer commit per step, and every step reports its layer."""
    num_layers, num_ranks = 4, 2
    bus = EventBus()
    state = SimpleNamespace(
        commit_log=deque(maxlen=COMMIT_LOG_MAXLEN), bus=bus, num_rearrangements=0, outcomes=Outcomes(bus)
    )
    model_state = SimpleNamespace(model_name="m")
    watch = steps.CommitWatch(state.bus)
    stats = StepLog(OutputTolerance(rtol=1e-5, atol=1e-6))
    rank_load = torch.tensor([[3.0, 1.0]] * num_layers)  # (L, N)
    logical_load = torch.tensor([[1, 1, 1, 1]] * num_layers)  # (L, E)
    initial = torch.tensor([[0, 1, 2, 3]] * num_layers)  # (L, P)
    num_steps = 2 * COMMIT_LOG_MAXLEN // 4
    for step in range(num_steps):
        state.num_rearrangements = step // num_layers + 1
        for kind in ("move", "commit", "refresh", "acknowledge"):
            AscendEplbState._log(state, kind, model_state, step % num_layers)
        steps.end_of_step(stats, state, watch.drain(), rank_load, logical_load, initial, num_ranks)
    assert len(state.commit_log) == COMMIT_LOG_MAXLEN  # full since step COMMIT_LOG_MAXLEN // 4
    assert stats.commits_per_step == [[step % num_layers] for step in range(num_steps)]
    assert stats.rearrangements_per_step[-1] == num_steps // num_layers
    assert watch.drain() == []  # drained at every step's end


def test_balancedness_counts_a_layer_without_load_as_even_with_and_without_eplb():
    """One definition (issue 30): mean rank load / max rank load per layer, averaged over layers, a
    layer without load 1.0, as control.measures counts it for every reader (simulate counted 0.0)."""
    state = SimpleNamespace(num_rearrangements=0)
    stats = StepLog(OutputTolerance(rtol=1e-5, atol=1e-6))
    rank_load = torch.tensor([[3.0, 1.0], [0.0, 0.0]])  # (L=2, N=2): layer 1 routed nothing
    logical_load = torch.tensor([[3, 0, 1, 0], [0, 0, 0, 0]])  # (L, E)
    initial = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]])  # (L, P): ranks hold experts {0, 1} and {2, 3}
    steps.end_of_step(stats, state, [], rank_load, logical_load, initial, 2)
    assert stats.balancedness_per_step == [(2 / 3 + 1.0) / 2]
    assert stats.balancedness_off_per_step == [(2 / 3 + 1.0) / 2]
    assert stats.rank_load_share_per_step == [[(0.75 + 0.0) / 2, (0.25 + 0.0) / 2]]


def test_the_outputs_bound_uses_the_tolerance_the_rank_reports():
    """Issue 30 item 5: the replay world compared its outputs with the driver's tolerance while the report
    stated the rank's copy; both worlds now bound with the rank's own (frozen) tolerance, the one it
    reports."""
    stats = StepLog(OutputTolerance(rtol=0.25, atol=0.5))
    assert stats.output_tolerance.bound(4.0) == 1.5
    per_layer = stats.output_tolerance.bound(torch.tensor([0.0, 2.0, 8.0]))
    assert torch.equal(per_layer, torch.tensor([0.5, 1.0, 2.5]))


def test_with_the_batch_split_the_equal_splits_balancedness_is_recorded_beside_the_executed_one():
    """Issue 44: with ``--replica-split`` on, each step records the equal split's balancedness of its
    logical load on the placement it routed with (each replica ``c[e] / count[e]``), beside the executed
    one; with the split off (no placement given) nothing more is recorded."""
    state = SimpleNamespace(num_rearrangements=0)
    rank_load = torch.tensor([[5.0, 3.0]])  # (L=1, N=2): what the ranks executed
    logical_load = torch.tensor([[4, 2, 2]])  # (L, E)
    placement = torch.tensor([[0, 1, 2, 0]])  # (L, P): expert 0 on both ranks, 2 selections each
    initial = torch.tensor([[0, 1, 2, 1]])  # EPLB off: rank 0 {0, 1} 4 + 1, rank 1 {2, 1} 2 + 1
    split, off = (StepLog(OutputTolerance(rtol=1e-5, atol=1e-6)) for _ in range(2))
    steps.end_of_step(split, state, [], rank_load, logical_load, initial, 2, split_placement=placement)
    steps.end_of_step(off, state, [], rank_load, logical_load, initial, 2)
    assert split.balancedness_per_step == off.balancedness_per_step == [4 / 5]
    assert split.balancedness_off_per_step == off.balancedness_off_per_step == [4 / 5]
    assert split.balancedness_equal_split_per_step == [1.0]  # ranks 4 and 4
    assert off.balancedness_equal_split_per_step == []
