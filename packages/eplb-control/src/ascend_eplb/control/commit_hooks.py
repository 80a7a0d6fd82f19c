"""Narrow hooks on upstream's placement commit, so each layer's replica lookup refreshes with it.

Upstream vLLM 0.33.0 commits a new placement in two module functions of
``vllm.distributed.eplb.eplb_state``:

* ``_commit_eplb_maps_for_layer(model_state, new_physical_to_logical_map, layer)``: the asynchronous
  per-layer commit, called by ``_move_to_workspace`` after ``move_from_buffer`` copied the staging
  buffer into the layer's weights and before ``result.consumed_event.record()`` acknowledges the
  staging buffer to the async worker (which then overwrites it with the next layer);
* ``_commit_eplb_maps(model_state, new_physical_to_logical_map)``: the synchronous whole-model commit,
  called by ``EplbState.rearrange`` after ``rearrange_expert_weights_inplace``.

Both are looked up as module globals at call time, so replacing the module attributes is the smallest
point that sees every commit. The wrappers run upstream's commit unchanged, then hand the committed
layers to the :class:`~ascend_eplb.control.state.AscendEplbState` that owns the model state, which
refreshes those layers' lookups in place. Hence, per layer: move, commit, refresh, acknowledge. A model
state owned by a plain upstream ``EplbState`` passes through untouched.

:func:`install_commit_hooks` is idempotent, checks the signatures of the functions it wraps (and of
``_move_to_workspace`` and ``CpuGpuEvent.record``, whose order it relies on) and raises
``RuntimeError`` naming the function on drift; :func:`uninstall_commit_hooks` restores upstream.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ascend_eplb.control._signatures import check_signature

if TYPE_CHECKING:
    from ascend_eplb.control.state import AscendEplbState

__all__ = ["commit_hooks_installed", "install_commit_hooks", "uninstall_commit_hooks"]

#: vLLM 0.33.0 parameters of the module functions the hooks wrap or rely on.
HOOKED_SIGNATURES: dict[str, tuple[str, ...]] = {
    "_commit_eplb_maps_for_layer": ("model_state", "new_physical_to_logical_map", "layer"),
    "_commit_eplb_maps": ("model_state", "new_physical_to_logical_map"),
    "_move_to_workspace": ("model_state", "ep_rank"),
}
_CPU_GPU_EVENT_RECORD = ("self", "stream")

_LOCK = threading.Lock()
_ORIGINALS: dict[str, Callable[..., Any]] = {}
_OWNERS: weakref.WeakSet[AscendEplbState] = weakref.WeakSet()


def register_owner(state: AscendEplbState) -> None:
    """Make ``state``'s model states visible to the hooks (held weakly)."""
    _OWNERS.add(state)


def _owner_of(model_state: Any) -> AscendEplbState | None:
    for owner in list(_OWNERS):
        if owner.owns_model_state(model_state):
            return owner
    return None


def check_hooked_signatures() -> None:
    """Raise ``RuntimeError`` naming the first upstream function whose signature drifted from 0.33.0."""
    from vllm.distributed.eplb import eplb_state
    from vllm.distributed.eplb.eplb_utils import CpuGpuEvent

    for name, params in HOOKED_SIGNATURES.items():
        check_signature(getattr(eplb_state, name), f"vllm.distributed.eplb.eplb_state.{name}", params)
    check_signature(CpuGpuEvent.record, "CpuGpuEvent.record", _CPU_GPU_EVENT_RECORD)


def _wrap_commit_for_layer(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def _commit_eplb_maps_for_layer(model_state: Any, new_physical_to_logical_map: Any, layer: int) -> None:
        owner = _owner_of(model_state)
        if owner is None:
            original(model_state, new_physical_to_logical_map, layer)
            return
        owner._before_commit(model_state, (layer,), new_physical_to_logical_map.unsqueeze(0))
        original(model_state, new_physical_to_logical_map, layer)
        owner._after_commit(model_state, (layer,), acknowledged_by=model_state.pending_result)

    return _commit_eplb_maps_for_layer


def _wrap_commit(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def _commit_eplb_maps(model_state: Any, new_physical_to_logical_map: Any) -> None:
        owner = _owner_of(model_state)
        if owner is None:
            original(model_state, new_physical_to_logical_map)
            return
        layers = tuple(range(new_physical_to_logical_map.shape[0]))
        owner._before_commit(model_state, layers, new_physical_to_logical_map)
        original(model_state, new_physical_to_logical_map)
        owner._after_commit(model_state, layers, acknowledged_by=None)

    return _commit_eplb_maps


def install_commit_hooks() -> bool:
    """Wrap upstream's two commit functions; idempotent.

    Returns:
        True if this call installed the hooks, False if they were already installed.

    Raises:
        RuntimeError: a wrapped or relied-on upstream function changed signature since vLLM 0.33.0
            (the message names it); nothing is changed then.
    """
    from vllm.distributed.eplb import eplb_state

    with _LOCK:
        if _ORIGINALS:
            return False
        check_hooked_signatures()
        for name, wrap in (
            ("_commit_eplb_maps_for_layer", _wrap_commit_for_layer),
            ("_commit_eplb_maps", _wrap_commit),
        ):
            original = getattr(eplb_state, name)
            _ORIGINALS[name] = original
            setattr(eplb_state, name, wrap(original))
        return True


def uninstall_commit_hooks() -> bool:
    """Restore upstream's commit functions; idempotent. Returns True if something was restored."""
    from vllm.distributed.eplb import eplb_state

    with _LOCK:
        if not _ORIGINALS:
            return False
        for name, original in _ORIGINALS.items():
            setattr(eplb_state, name, original)
        _ORIGINALS.clear()
        return True


def commit_hooks_installed() -> bool:
    """Whether the commit hooks are in effect in this process."""
    return bool(_ORIGINALS)
