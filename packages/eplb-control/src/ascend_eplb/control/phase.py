"""Batch load-collection phase: which batches feed the EPLB load window.

Ascend deployments often balance experts for one phase only (decode-heavy serving balances the decode
routing; a prefill node balances prefill). The phase of a batch is decided by the model runner once per
batch; a batch that contains any prefill work (a mixed batch included) is a prefill batch. This rule is
the one of vLLM Ascend's MRv2 integration (``is_eplb_load_collection_phase_matched``, PR #12804).
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["LOAD_COLLECTION_PHASES", "LoadCollectionPhase", "is_phase_matched", "validate_phase"]

LoadCollectionPhase = Literal["all", "prefill", "decode"]
"""Which batches record expert load: every batch, prefill (and mixed) batches only, or pure decode batches."""

LOAD_COLLECTION_PHASES: tuple[str, ...] = get_args(LoadCollectionPhase)
"""The allowed phases, in documentation order: ``("all", "prefill", "decode")``."""


def validate_phase(load_collection_phase: object) -> LoadCollectionPhase:
    """Return ``load_collection_phase`` if it is an allowed phase.

    Raises:
        ValueError: the value is not one of :data:`LOAD_COLLECTION_PHASES` (the message names the value
            and lists the allowed phases).
    """
    if not isinstance(load_collection_phase, str) or load_collection_phase not in LOAD_COLLECTION_PHASES:
        raise ValueError(
            f"load_collection_phase={load_collection_phase!r} is not allowed; "
            f"allowed phases: {', '.join(repr(p) for p in LOAD_COLLECTION_PHASES)}"
        )
    return load_collection_phase  # type: ignore[return-value]


def is_phase_matched(load_collection_phase: LoadCollectionPhase, batch_has_prefill: bool) -> bool:
    """Whether a batch's expert load belongs to the collected phase.

    Args:
        load_collection_phase: ``"all"`` (every batch matches), ``"prefill"`` (batches with any prefill
            work, mixed batches included) or ``"decode"`` (batches with no prefill work).
        batch_has_prefill: True when at least one request of the batch is in prefill (or chunked
            prefill); a host bool decided by the model runner.

    Returns:
        True when the batch's load should be recorded.

    Raises:
        ValueError: ``load_collection_phase`` is not an allowed phase (the message lists them), or
            ``batch_has_prefill`` is not a bool.
    """
    phase = validate_phase(load_collection_phase)
    if not isinstance(batch_has_prefill, bool):
        raise ValueError(f"batch_has_prefill={batch_has_prefill!r} must be a bool")
    if phase == "all":
        return True
    return (phase == "prefill") == batch_has_prefill
