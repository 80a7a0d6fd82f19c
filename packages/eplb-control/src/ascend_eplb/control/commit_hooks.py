"""Narrow hooks on upstream's placement commit, so each layer's replica lookup refreshes with it.

vLLM 0.33.0 commits in two module functions of ``vllm.distributed.eplb.eplb_state``, looked up as module
globals at call time (the smallest point that sees every commit): ``_commit_eplb_maps_for_layer``, the
async per-layer commit that ``_move_to_workspace`` calls after ``move_from_buffer`` and before
``result.consumed_event.record()`` acknowledges the staging buffer, and ``_commit_eplb_maps``, the sync
whole-model commit after ``rearrange_expert_weights_inplace``. Each wrapper (its row declared with
``@upstream.SURFACE.replaces``; :data:`PATCHES`, installed by integration's ``apply_patches()``) runs
upstream's commit unchanged and tells the :class:`CommitObserver` attached to the model state
(:func:`attach_observer`) before and after; a model state without one passes through. Imports nothing of
the state module.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from ascend_eplb.control import upstream
from ascend_eplb.control.patching import Patch, patch_owner, patches_of

__all__ = [
    "PATCHES",
    "CommitObserver",
    "attach_observer",
    "check_hooked_signatures",
    "commit_hooks_installed",
]

_OWNER = "ascend_eplb.control.commit_hooks"
#: Attribute of an upstream ``EplbModelState`` holding a weak reference to its observer (a row of the
#: upstream surface's ``ATTRIBUTES``).
_OBSERVER_ATTR = upstream.COMMIT_OBSERVER_ATTR


class CommitObserver(Protocol):
    """What the hooks call around upstream's commit of ``layers`` of one model state."""

    def before_commit(
        self, model_state: Any, layers: tuple[int, ...], new_physical_to_logical_map: Any
    ) -> None:
        """The layers' weights already hold the new placement; upstream has not committed it yet."""

    def after_commit(self, model_state: Any, layers: tuple[int, ...], acknowledged_by: Any | None) -> None:
        """Upstream committed ``layers``; ``acknowledged_by`` is the async layer result being consumed."""


def attach_observer(model_state: Any, observer: CommitObserver) -> None:
    """Make ``observer`` (held weakly) see every commit of the upstream ``EplbModelState`` ``model_state``."""
    setattr(model_state, _OBSERVER_ATTR, weakref.ref(observer))


def _observer_of(model_state: Any) -> CommitObserver | None:
    ref = getattr(model_state, _OBSERVER_ATTR, None)
    return ref() if ref is not None else None


def check_hooked_signatures() -> None:
    """Raise ``RuntimeError`` naming the first upstream function the hooks wrap or whose order they rely
    on (``_move_to_workspace``, its body pinned; ``CpuGpuEvent.record``) that is missing or drifted from
    vLLM 0.33.0, or the observer attribute upstream now declares (this module's rows of
    :mod:`ascend_eplb.control.upstream`)."""
    upstream.SURFACE.check(upstream.COMMIT_HOOKS)


def _check_order(_original: Any) -> None:
    check_hooked_signatures()


@upstream.SURFACE.replaces(
    "vllm.distributed.eplb.eplb_state._commit_eplb_maps_for_layer",
    "the per-layer commit hook: the observer's move, upstream's commit, the observer's refresh (before "
    "`_move_to_workspace` acknowledges)",
    check=_check_order,
)
def _wrap_commit_for_layer(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def _commit_eplb_maps_for_layer(model_state: Any, new_physical_to_logical_map: Any, layer: int) -> None:
        observer = _observer_of(model_state)
        if observer is None:
            original(model_state, new_physical_to_logical_map, layer)
            return
        observer.before_commit(model_state, (layer,), new_physical_to_logical_map.unsqueeze(0))
        original(model_state, new_physical_to_logical_map, layer)
        observer.after_commit(model_state, (layer,), acknowledged_by=model_state.pending_result)

    return _commit_eplb_maps_for_layer


# Serving refuses synchronous EPLB (start-up rule ``async-only``); this hook stays so that control used
# alone (upstream's default is ``use_async=False``) never routes on a stale lookup. See the README.
@upstream.SURFACE.replaces(
    "vllm.distributed.eplb.eplb_state._commit_eplb_maps",
    "the synchronous whole-model commit hook (move, commit, refresh of every layer)",
)
def _wrap_commit(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def _commit_eplb_maps(model_state: Any, new_physical_to_logical_map: Any) -> None:
        observer = _observer_of(model_state)
        if observer is None:
            original(model_state, new_physical_to_logical_map)
            return
        layers = tuple(range(new_physical_to_logical_map.shape[0]))
        observer.before_commit(model_state, layers, new_physical_to_logical_map)
        original(model_state, new_physical_to_logical_map)
        observer.after_commit(model_state, layers, acknowledged_by=None)

    return _commit_eplb_maps


#: The two commit hooks, in installation order (installed by integration's ``apply_patches()``).
PATCHES: tuple[Patch, ...] = patches_of(_wrap_commit_for_layer, _wrap_commit)


def commit_hooks_installed() -> bool:
    """Whether both commit hooks are bound in ``vllm.distributed.eplb.eplb_state`` now."""
    # local: integration's ``patches`` imports us without vLLM
    from vllm.distributed.eplb import eplb_state

    return all(
        patch_owner(getattr(eplb_state, name, None)) == _OWNER
        for name in (patch.qualname for patch in PATCHES)
    )
