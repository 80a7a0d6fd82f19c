"""The tools' upstream surface: what ``simulate``'s ranks read of upstream's state and the body ``plan``
restates are rows of the tools' own table (``ascend_eplb.tools.upstream``), rendered in ``UPSTREAM.md``,
checked by the tools (never by serving)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ascend_eplb.control import upstream as serving_surface
from ascend_eplb.integration import patches
from ascend_eplb.tools import upstream


def test_the_tools_rows_resolve_and_serving_has_none_of_them():
    upstream.SURFACE.check(*upstream.USERS)  # vLLM 0.33.0 as installed: nothing drifted
    assert [f"{a.cls}.{a.attr}" for a in upstream.ATTRIBUTES] == [
        "EplbState.model_states",
        "EplbModelState.physical_to_logical_map",
        "EplbModelState.communicator",
        "EplbModelState.expert_load_pass",
        "EplbModelState.rebalanced",
        "EplbModelState.model",
    ]
    assert {u for row in (*upstream.ATTRIBUTES, *upstream.BODIES) for u in row.users} == set(upstream.USERS)
    assert set(upstream.USERS).isdisjoint(serving_surface.USERS)
    # plan's body row pins the serving surface's own signature row (one spelling of its parameters).
    (body,) = upstream.BODIES
    assert body.signature is serving_surface.SURFACE.signature(body.name)
    with pytest.raises(ValueError, match=r"unknown user\(s\) \['tools.plans'\]"):
        upstream.SURFACE.check("tools.plans")


def test_a_drifted_row_of_the_tools_does_not_stop_serving_but_is_named(monkeypatch):
    """plan's restatement of upstream's initial placement: a changed body (same signature) is plan's row,
    checked by plan's tests, not by serving; a lost attribute simulate's steps read is named before its
    world starts."""
    from vllm.distributed.eplb.eplb_state import EplbState

    def build_initial_global_physical_to_logical_map(num_routed_experts, num_redundant_experts):
        return list(range(num_routed_experts)) + [0] * num_redundant_experts

    monkeypatch.setattr(
        EplbState,
        "build_initial_global_physical_to_logical_map",
        staticmethod(build_initial_global_physical_to_logical_map),
    )
    patches.check_upstream()
    upstream.SURFACE.check(upstream.SIMULATE)
    with pytest.raises(RuntimeError) as info:
        upstream.SURFACE.check(upstream.PLAN)
    assert str(info.value).startswith(
        "upstream EplbState.build_initial_global_physical_to_logical_map changed its body: source digest "
    )
    assert (
        "vLLM 0.33.0's is b552b55acd62a5b2; ascend_eplb.control.measures.upstream_initial_placement "
        "restates it" in str(info.value)
    )
    monkeypatch.undo()

    lost = dataclasses.replace(upstream.SURFACE.attributes[-1], attr="model_lost")
    monkeypatch.setattr(upstream.SURFACE, "attributes", (*upstream.SURFACE.attributes[:-1], lost))
    upstream.SURFACE.check(upstream.PLAN)
    with pytest.raises(RuntimeError) as info:
        upstream.SURFACE.check(upstream.SIMULATE)
    assert str(info.value) == (
        "upstream EplbModelState.model_lost is missing (tools.simulate reads it); ascend_eplb must be "
        "updated for this version"
    )


def test_the_tools_tables_are_rendered_from_the_rows():
    """Issue 39: the tools' rows are rendered in this package's ``UPSTREAM.md`` (they were rows of
    control's)."""
    doc = Path(__file__).resolve().parents[1] / "UPSTREAM.md"
    text = upstream.render()
    assert doc.read_text() == text, (
        "run: python -m ascend_eplb.tools.upstream > packages/eplb-tools/UPSTREAM.md"
    )
    assert [
        a for a in upstream.ATTRIBUTES if f"| `{a.cls}.{a.attr}` | reads | `tools.simulate` |" not in text
    ] == []
    assert (
        "| `EplbState.build_initial_global_physical_to_logical_map` | `b552b55acd62a5b2` | `tools.plan` |"
        in text
    )
