"""The tools' upstream surface: what ``simulate`` and ``plan`` rely on of vLLM 0.33.0 beyond the serving
product's and the CPU world's rows, declared once, with :mod:`ascend_eplb.control.patching`'s row types.

* :data:`ATTRIBUTES`: what ``simulate``'s ranks read of the world's EPLB state (the steps' checks and
  accounting); each rank checks them (:func:`check` of :data:`SIMULATE`) before its world starts.
* :data:`BODIES`: the upstream function ``plan`` relies on restated without vLLM (upstream's initial
  placement, ``control.measures.upstream_initial_placement``), pinned by a source digest; ``plan`` runs
  without vLLM, so its tests hold the row (:func:`check` of :data:`PLAN`).

Serving never checks these rows. :func:`render` writes their tables (``UPSTREAM.md`` of this package; a
test keeps them equal: ``python -m ascend_eplb.tools.upstream`` prints it). Nothing here imports vLLM.
"""

from __future__ import annotations

from ascend_eplb.control import upstream as serving_surface
from ascend_eplb.control.patching import (
    Attribute,
    Body,
    attribute_table,
    body_table,
    check_signatures,
    surface_document,
)

__all__ = ["ATTRIBUTES", "BODIES", "PLAN", "SIMULATE", "USERS", "check", "render"]

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
        serving_surface.signature(f"{_STATE}.EplbState.build_initial_global_physical_to_logical_map"),
        "b552b55acd62a5b2",
        (PLAN,),
        "ascend_eplb.control.measures.upstream_initial_placement restates it without vLLM (the EPLB-off "
        "placement plan, simulate and the events file's balancedness_eplb_off compare with)",
    ),
)


def check(*users: str) -> None:
    """Check every row the ``users`` rely on: the signatures of their bodies, then their bodies and
    attributes.

    Raises:
        ValueError: a user is not one of :data:`USERS` (a typo would otherwise check nothing).
        RuntimeError: one is missing, changed signature or body, or lost an attribute we read, since
            vLLM 0.33.0; the message names it.
    """
    unknown = [u for u in users if u not in USERS]
    if unknown:
        raise ValueError(f"unknown user(s) {unknown!r} of the tools' upstream rows; the users are {USERS!r}")
    wanted = set(users)
    bodies = [b for b in BODIES if wanted & set(b.users)]
    check_signatures(b.signature for b in bodies)
    for row in (*bodies, *(a for a in ATTRIBUTES if wanted & set(a.users))):
        row.check()


def render() -> str:
    """The tables of every row, as Markdown (what ``UPSTREAM.md`` of this package holds)."""
    return surface_document(
        "The tools' upstream surface",
        "What `ascend-eplb simulate` and `plan` rely on of upstream vLLM 0.33.0 beyond the serving "
        "product's rows (`integration/UPSTREAM.md`) and the CPU world's "
        "(`packages/eplb-world/UPSTREAM.md`). Generated from the rows of `ascend_eplb.tools.upstream` "
        "(`python -m ascend_eplb.tools.upstream > packages/eplb-tools/UPSTREAM.md`); a test keeps this file "
        "equal to them. Never checked by serving: each `simulate` rank checks the rows of "
        f"`{SIMULATE}` before its world starts; `plan` runs without vLLM, its tests check the rows of "
        f"`{PLAN}`.",
        [
            ("Attributes of upstream objects (`ATTRIBUTES`)", attribute_table(ATTRIBUTES)),
            ("Upstream bodies the tools depend on (`BODIES`, source digests)", body_table(BODIES)),
        ],
    )


if __name__ == "__main__":
    print(render(), end="")
