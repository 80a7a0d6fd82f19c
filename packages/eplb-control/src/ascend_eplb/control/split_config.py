"""Which replica a replicated expert's selection goes to: today's equal split, or the batch split.

Standard library only, so start-up validation and ``ascend-eplb check`` judge the key without torch or
vLLM. ``additional_config.eplb_config.replica_split``:

- ``"equal"`` (default): today's rule, each replica an equal share whatever the batch holds;
- ``"batch"``: the data plane's batch split (``ascend_eplb.dataplane.split``), the shares of each
  replicated expert solved from the batch's own counts. Where ranks share the rows they route
  (``replicated``, ``gathered`` and ``gathered-sp`` rows, :mod:`.layout`) every rank sees the batch and
  computes the same split without communication; on ``split`` rows (each rank routes its own, an
  all-to-all dispatch) each MoE layer all-gathers the ranks' ``E`` counts per forward so the split is the
  global batch's (:func:`split_scope` ``"global"``);
- ``"batch_local"``: the same, but on ``split`` rows each rank splits its own rows by their counts, no
  communication (scope ``"local"``); on other rows it is ``"batch"``.
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = [
    "REPLICA_SPLITS",
    "ReplicaSplit",
    "SplitScope",
    "describe_split",
    "replica_split_error",
    "split_scope",
]

ReplicaSplit = Literal["equal", "batch", "batch_local"]
#: ``("equal", "batch", "batch_local")``.
REPLICA_SPLITS: tuple[str, ...] = get_args(ReplicaSplit)

SplitScope = Literal["off", "rows", "global", "local"]
"""What a rank's split covers: nothing (``"equal"``), the rows every sharing rank sees (no
communication), the global batch of ``split`` rows (one all-gather per MoE layer), or the rank's own
``split`` rows."""


def replica_split_error(value: object) -> str | None:
    """Why ``value`` is not a ``replica_split`` (None: it is one of :data:`REPLICA_SPLITS`)."""
    if isinstance(value, str) and value in REPLICA_SPLITS:
        return None
    return f"additional_config.eplb_config.replica_split={value!r} is not one of {list(REPLICA_SPLITS)}"


def split_scope(replica_split: str, moe_rows: str) -> SplitScope:
    """The scope of ``replica_split`` on ``moe_rows`` (module docstring; ``moe_rows`` a
    :data:`~.layout.MOE_ROWS` name)."""
    if replica_split == "equal":
        return "off"
    if moe_rows != "split":
        return "rows"
    return "global" if replica_split == "batch" else "local"


def describe_split(replica_split: str, moe_rows: str) -> str:
    """One line: the split in force on these rows and what it costs (the serving log's and ``check``'s)."""
    scope = split_scope(replica_split, moe_rows)
    if scope == "off":
        return "replica_split=equal (each replica an equal share, today's rule)"
    if scope == "rows":
        return (
            f"replica_split={replica_split} on {moe_rows} rows: every rank routing the rows splits the batch "
            "alike, no communication"
        )
    if scope == "global":
        return (
            "replica_split=batch on split rows: the global batch's counts, one all-gather of E int64 counts "
            "per MoE layer per forward (replica_split=batch_local: each rank's own rows, none)"
        )
    return "replica_split=batch_local on split rows: each rank splits its own rows, no communication"
