"""Give each MoE layer's router an :class:`AscendEplbLayerState` and bind dataplane's mapping on it.

vLLM 0.33.0 builds every ``MoERunner`` with an upstream ``EplbLayerState`` on its router and maps ids
with a CUDA-only kernel (``BaseRouter._apply_eplb_mapping``). Before the model is registered, each
router's layer state is converted (same tensors, by reference) and :func:`ascend_eplb.dataplane.bind_router`
binds the graph-safe map-and-record op on that instance (rows of :mod:`.upstream`: ``ATTRIBUTES``,
``INSTANCE_BINDINGS``). It must precede the first forward: under vLLM's ``DYNAMO_TRACE_ONCE`` that
forward is the one trace, guards dropped, and a router bound later never maps or records (measured), so
a model already compiled is refused (:func:`traced_modules`).
"""

from __future__ import annotations

from typing import Any

from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper
from vllm.model_executor.models.interfaces import get_mixture_of_experts_model
from vllm.v1.worker.ubatching import dbo_current_ubatch_id

from ascend_eplb.control.state import AscendEplbLayerState
from ascend_eplb.dataplane import bind_router

__all__ = ["adapt_layer_routers", "traced_modules"]


def traced_modules(model: Any) -> list[str]:
    """The modules of ``model`` that vLLM's compile wrapper has traced already (its first forward ran
    compiled: ``TorchCompileWithNoGuardsWrapper.compiled``, or an AOT-compiled function in place), by
    their names in ``model``; [] for a model that has not run a compiled forward (or runs eagerly)."""
    return [
        name or type(module).__name__
        for name, module in model.named_modules()
        if isinstance(module, TorchCompileWithNoGuardsWrapper)
        and (
            getattr(module, "compiled", False) is True or getattr(module, "aot_compiled_fn", None) is not None
        )
    ]


def adapt_layer_routers(model: Any, *, lookup_ranks: int | None = None) -> int:
    """Convert and bind the router of every MoE layer of ``model``; idempotent.

    Args:
        model: a vLLM model; its ``MixtureOfExperts`` part (upstream ``get_mixture_of_experts_model``)
            is adapted. A model without one is left alone.
        lookup_ranks: the EP size when the batch split is on: each converted layer state's lookup keeps
            the split's inputs (``AscendEplbLayerState.lookup_ranks``); None: off.

    Returns:
        the number of routers bound (layers whose router carries no ``eplb_state`` are skipped).

    Raises:
        RuntimeError: vLLM has traced the model already (:func:`traced_modules`: its compiled code
            froze the routers it read, so a binding now would never run), a MoE layer has no ``router``
            with an ``eplb_state`` attribute (both raised before any layer is changed), or dataplane's
            ``bind_router`` found an upstream signature drift.
    """
    moe_model = get_mixture_of_experts_model(model)
    if moe_model is None:
        return 0
    traced = traced_modules(model)
    if traced:
        raise RuntimeError(
            f"adapt_layer_routers: {type(model).__name__} ran a compiled forward already "
            f"({', '.join(traced)} traced by vLLM's DYNAMO_TRACE_ONCE): the trace froze its routers, so a "
            "binding now would never map or record. Register the model with EPLB before its first forward "
            "(Model Runner V2 does, in load_model)"
        )
    routers = []
    for index, layer in enumerate(moe_model.moe_layers):
        router = getattr(layer, "router", None)
        if router is None or not hasattr(router, "eplb_state"):
            raise RuntimeError(
                f"adapt_layer_routers: MoE layer {index} ({type(layer).__name__}) has no router with an "
                "'eplb_state' (vLLM 0.33.0 MoERunner.router); cannot bind the Ascend EPLB mapping"
            )
        routers.append(router)
    adapted = 0
    for router in routers:
        layer_state = router.eplb_state
        if layer_state is None:
            continue
        if not isinstance(layer_state, AscendEplbLayerState):
            layer_state = AscendEplbLayerState.from_upstream(layer_state, lookup_ranks=lookup_ranks)
            router.eplb_state = layer_state
        bind_router(router, layer_state, ubatch_id=dbo_current_ubatch_id)
        adapted += 1
    return adapted
