"""The tools' upstream surface: what ``simulate`` and ``plan`` rely on of vLLM 0.33.0 beyond the serving
product's and the CPU world's rows, declared once in :data:`SURFACE`
(:class:`~ascend_eplb.control.surface.Surface`).

* :data:`ATTRIBUTES`: what ``simulate``'s ranks read of the world's EPLB state (the steps' checks and
  accounting); each rank checks them (``SURFACE.check(SIMULATE)``) before its world starts.
* :data:`BODIES`: the upstream function ``plan`` relies on restated without vLLM (upstream's initial
  placement, ``control.measures.upstream_initial_placement``), pinned by a source digest; ``plan`` runs
  without vLLM, so its tests hold the row (``SURFACE.check(PLAN)``).

Serving never checks these rows. :func:`render` writes their tables (``UPSTREAM.md`` of this package; a
test keeps them equal: ``python -m ascend_eplb.tools.upstream`` prints it). Nothing here imports vLLM.
"""

from __future__ import annotations

from ascend_eplb.control import upstream as serving_surface
from ascend_eplb.control.patching import Attribute, Body
from ascend_eplb.control.surface import Surface

__all__ = ["ATTRIBUTES", "BODIES", "PLAN", "SIMULATE", "SURFACE", "USERS", "check", "render"]

#: ``simulate``'s ranks (:mod:`ascend_eplb.tools.simulate`).
SIMULATE = "tools.simulate"
#: ``plan`` (:mod:`ascend_eplb.tools.plan`).
PLAN = "tools.plan"
#: Every user id a row of this surface names.
USERS = (SIMULATE, PLAN)

_STATE = "vllm.distributed.eplb.eplb_state"
_MODEL_STATE = "EplbModelState"

#: What ``simulate``'s ranks read of the world's state (the steps' checks and accounting).
ATTRIBUTES: tuple[Attribute, ...] = (
    Attribute(_STATE, "EplbState", "model_states", "reads", (SIMULATE,), "the replay world's model"),
    *(
        Attribute(_STATE, _MODEL_STATE, attr, "reads", (SIMULATE,), why)
        for attr, why in (
            ("physical_to_logical_map", "the placement in force for a forward (the outputs check)"),
            ("communicator", "`--fault`: the communicator a worker fault is injected into"),
            ("expert_load_pass", "the replay world's `load` check: the load a forward recorded"),
            ("rebalanced", "whether a cycle is in flight (the worker verdict)"),
            ("model", "`expert_weights`: the bytes of one expert (`metrics.expert_bytes`)"),
        )
    ),
)

#: The upstream functions whose body the tools restate, pinned by
#: :func:`~ascend_eplb.control.patching.source_digest` (the signature is the serving surface's row).
BODIES: tuple[Body, ...] = (
    Body(
        serving_surface.SURFACE.signature(f"{_STATE}.EplbState.build_initial_global_physical_to_logical_map"),
        "b552b55acd62a5b2",
        (PLAN,),
        "ascend_eplb.control.measures.upstream_initial_placement restates it without vLLM (the EPLB-off "
        "placement plan, simulate and the events file's balancedness_eplb_off compare with)",
    ),
)


#: The tools' surface: what ``simulate`` and ``plan`` rely on, checked per user (``SURFACE.check(user)``).
SURFACE = Surface(__name__, "the tools' upstream rows", USERS, {}, attributes=ATTRIBUTES, bodies=BODIES)
#: ``SURFACE.check``, under the name ``simulate``'s ranks call (``upstream.check(upstream.SIMULATE)``).
check = SURFACE.check


def render() -> str:
    """The tables of every row, as Markdown (what ``UPSTREAM.md`` of this package holds)."""
    return SURFACE.render(
        "The tools' upstream surface",
        "What `ascend-eplb simulate` and `plan` rely on of upstream vLLM 0.33.0 beyond the serving "
        "product's rows (`integration/UPSTREAM.md`) and the CPU world's "
        "(`packages/eplb-world/UPSTREAM.md`). Generated from the rows of `ascend_eplb.tools.upstream` "
        "(`python -m ascend_eplb.tools.upstream > packages/eplb-tools/UPSTREAM.md`); a test keeps this file "
        "equal to them. Never checked by serving: each `simulate` rank checks the rows of "
        f"`{SIMULATE}` before its world starts; `plan` runs without vLLM, its tests check the rows of "
        f"`{PLAN}`.",
        bodies="Upstream bodies the tools depend on",
    )


if __name__ == "__main__":
    print(render(), end="")
