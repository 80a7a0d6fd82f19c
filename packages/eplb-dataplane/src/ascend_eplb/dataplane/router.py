"""Per-instance router adapter: route a vLLM router's EPLB mapping through the replica lookup.

vLLM 0.33.0's ``BaseRouter._apply_eplb_mapping(self, topk_ids)`` (``fused_moe/router/base_router.py``)
maps logical to physical ids once per ``_select_experts``; off CUDA it is the identity.
:func:`bind_router` replaces it on one instance (``types.MethodType``, the class untouched) with
:func:`~ascend_eplb.dataplane.ops.map_to_physical_and_record` over the layer's ``ReplicaLookup``.
vLLM is never imported: router and layer state are duck-typed, the method's signature checked against
:data:`UPSTREAM_MAPPING_SIGNATURE` (listed by ``ascend_eplb.control.upstream.SIGNATURES``).
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import Any

import torch

from ascend_eplb.dataplane.ops import map_to_physical_and_record
from ascend_eplb.dataplane.split import map_to_physical_split_and_record, split_counts

__all__ = [
    "LAYER_STATE_FIELDS",
    "UPSTREAM_MAPPING_METHOD",
    "UPSTREAM_MAPPING_SIGNATURE",
    "bind_router",
    "is_bound",
    "unbind_router",
]

#: ``(module, qualname, parameters)`` in vLLM 0.33.0 of the upstream router method this adapter
#: replaces on an instance (the fields of ``ascend_eplb.control.patching.Signature``).
UPSTREAM_MAPPING_SIGNATURE: tuple[str, str, tuple[str, ...]] = (
    "vllm.model_executor.layers.fused_moe.router.base_router",
    "BaseRouter._apply_eplb_mapping",
    ("self", "topk_ids"),
)
#: The name of that method (the instance attribute :func:`bind_router` sets).
UPSTREAM_MAPPING_METHOD = UPSTREAM_MAPPING_SIGNATURE[1].rsplit(".", 1)[-1]
_UPSTREAM_PARAMETERS = UPSTREAM_MAPPING_SIGNATURE[2]
#: Attributes the layer state must provide (``AscendEplbLayerState`` of the control plane).
LAYER_STATE_FIELDS = (
    "replica_lookup",
    "expert_load_view",
    "should_record_tensor",
    "num_unpadded_tokens_tensors",
    "row_layout",
)
_MARKER = "__ascend_eplb_mapping__"


def _first_ubatch() -> int:
    return 0


def _make_mapping(ubatch_id: Callable[[], int]) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    def _ascend_apply_eplb_mapping(self: Any, topk_ids: torch.Tensor) -> torch.Tensor:
        """Logical -> physical ids via the layer's replica lookup, recording load (bound by bind_router)."""
        state = self.eplb_state
        if state is None:
            return topk_ids
        lookup = state.replica_lookup
        if lookup is None or state.expert_load_view is None or state.should_record_tensor is None:
            raise RuntimeError(
                "EPLB layer state is not initialised: replica_lookup, expert_load_view and "
                "should_record_tensor must be set before the first forward"
            )
        if state.num_unpadded_tokens_tensors is None:
            raise RuntimeError("EPLB layer state is not initialised: num_unpadded_tokens_tensors is None")
        unpadded = state.num_unpadded_tokens_tensors[ubatch_id()]
        split = getattr(state, "batch_split", None)
        if split is None:
            return map_to_physical_and_record(
                topk_ids,
                lookup.table,
                state.expert_load_view,
                state.should_record_tensor,
                unpadded,
                state.row_layout,
            )
        if lookup.split_inputs is None:
            raise RuntimeError(
                "EPLB layer state has a batch_split but its replica_lookup keeps no split inputs: build the "
                "ReplicaLookup with num_ranks"
            )
        counts, prefix = split.global_counts(
            split_counts(topk_ids, lookup.num_logical_experts, unpadded, state.row_layout)
        )
        return map_to_physical_split_and_record(
            topk_ids,
            lookup.table,
            *lookup.split_inputs,
            state.expert_load_view,
            state.should_record_tensor,
            unpadded,
            state.row_layout,
            counts,
            prefix,
            split.stats,
            split.steps,
        )

    setattr(_ascend_apply_eplb_mapping, _MARKER, True)
    return _ascend_apply_eplb_mapping


def _class_method(router: object) -> Callable[..., Any]:
    cls = type(router)
    method = inspect.getattr_static(cls, UPSTREAM_MAPPING_METHOD, None)
    if method is None or not inspect.isfunction(method):
        raise RuntimeError(
            f"{cls.__qualname__}.{UPSTREAM_MAPPING_METHOD} is missing or not a plain method; the EPLB "
            "router adapter was written for vLLM 0.33.0 BaseRouter._apply_eplb_mapping(self, topk_ids)"
        )
    parameters = tuple(inspect.signature(method).parameters)
    if parameters != _UPSTREAM_PARAMETERS:
        raise RuntimeError(
            f"{method.__qualname__} has parameters {parameters}, expected {_UPSTREAM_PARAMETERS} "
            "(vLLM 0.33.0); upstream changed the EPLB mapping method, update the router adapter"
        )
    return method


def is_bound(router: object) -> bool:
    """Whether :func:`bind_router` installed the mapping on this router instance."""
    bound = vars(router).get(UPSTREAM_MAPPING_METHOD) if hasattr(router, "__dict__") else None
    return bound is not None and getattr(getattr(bound, "__func__", None), _MARKER, False)


def bind_router(
    router: object,
    layer_state: object,
    *,
    ubatch_id: Callable[[], int] | None = None,
) -> None:
    """Set ``router.eplb_state = layer_state`` and bind the replica-lookup mapping on the instance.

    The bound ``_apply_eplb_mapping`` reads ``self.eplb_state`` at each call: ``None`` returns the ids
    unchanged, else ``map_to_physical_and_record(topk_ids, state.replica_lookup.table,
    state.expert_load_view, state.should_record_tensor, state.num_unpadded_tokens_tensors[ubatch_id()],
    state.row_layout)``; with an optional ``state.batch_split`` (a :class:`~ascend_eplb.dataplane.split.
    BatchSplit`; absent or None: the equal split) ``map_to_physical_split_and_record`` with the lookup's
    ``split_inputs`` (global counts gathered first when it says so). ``layer_state`` has
    :data:`LAYER_STATE_FIELDS` (set before the first forward); ``ubatch_id`` is vLLM's
    ``dbo_current_ubatch_id`` (default: always 0). Idempotent.

    Raises (before anything changes):
        RuntimeError: the class's ``_apply_eplb_mapping`` is missing or its parameters are not
            ``(self, topk_ids)`` (upstream drift), or the instance carries a foreign override.
        TypeError: ``layer_state`` lacks a field, ``ubatch_id`` is not callable, or no ``__dict__``.
        ValueError: the state's load view fails ``replica_lookup.check_load_view``.
    """
    _class_method(router)
    if not hasattr(router, "__dict__"):
        raise TypeError(f"cannot bind an instance method on {type(router).__qualname__}: no __dict__")
    missing = [name for name in LAYER_STATE_FIELDS if not hasattr(layer_state, name)]
    if missing:
        raise TypeError(
            f"layer_state {type(layer_state).__qualname__} lacks {missing}; bind_router needs "
            f"{list(LAYER_STATE_FIELDS)} (the control plane's AscendEplbLayerState provides them)"
        )
    lookup, load_view = layer_state.replica_lookup, layer_state.expert_load_view
    if lookup is not None and load_view is not None:
        lookup.check_load_view(load_view)
    if ubatch_id is not None and not callable(ubatch_id):
        raise TypeError(f"ubatch_id must be callable returning the micro-batch index, got {ubatch_id!r}")
    existing = vars(router).get(UPSTREAM_MAPPING_METHOD)
    if existing is not None and not is_bound(router):
        raise RuntimeError(
            f"{type(router).__qualname__} instance already overrides {UPSTREAM_MAPPING_METHOD} with "
            f"{existing!r}; refusing to replace a binding this adapter did not install"
        )
    mapping = _make_mapping(ubatch_id if ubatch_id is not None else _first_ubatch)
    router.eplb_state = layer_state  # type: ignore[attr-defined]
    setattr(router, UPSTREAM_MAPPING_METHOD, types.MethodType(mapping, router))


def unbind_router(router: object) -> bool:
    """Remove the instance binding installed by :func:`bind_router`, if any.

    Upstream's class method applies again; ``router.eplb_state`` is left as it is.
    Returns whether a binding was removed.
    """
    if not is_bound(router):
        return False
    delattr(router, UPSTREAM_MAPPING_METHOD)
    return True
