"""The one toy MoE model of the repository: ``simulate --model replay`` and multi-rank tests run it.

Exactly what upstream vLLM 0.33.0's EPLB reads from a model, none of a real model's compute: a
``MixtureOfExperts`` model whose MoE layers are shaped like upstream's ``MoERunner`` (``router``,
``eplb_state`` read through it, ``get_expert_weights``, ``set_eplb_state``). Each router is upstream's
real ``CustomRoutingRouter`` with a plain ``EplbLayerState``, as ``FusedMoE`` builds it with EPLB on;
its routing function returns the top-k the caller replays, so selection runs once per layer per forward
through upstream's ``select_experts`` and whatever the integration bound on the router maps the ids.
Expert weights are pluggable (:class:`ExpertWeights`): the simulator's quantized storage or the test
support's ``TaggedExperts``. Imports vLLM. Shapes (GLOSSARY.md): E, P, p, N ranks, T, K.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from vllm.distributed.eplb.eplb_state import EplbLayerState
from vllm.model_executor.layers.fused_moe.router.custom_routing_router import CustomRoutingRouter
from vllm.model_executor.models.interfaces import MixtureOfExperts

from ascend_eplb.control import measures

__all__ = [
    "ExpertWeights",
    "ToyMoELayer",
    "ToyMoEModel",
    "ToyModelConfig",
    "initial_local_experts",
]


def initial_local_experts(
    ep_rank: int, num_ranks: int, num_logical_experts: int, num_redundant_experts: int
) -> list[int]:
    """The logical expert of each of ``ep_rank``'s ``p`` slots under upstream's initial placement.

    Upstream's initial placement (:func:`ascend_eplb.control.measures.upstream_initial_placement`: physical
    slot ``i`` holds logical ``i`` for ``i < E``, then redundant slot ``E + j`` holds ``j % E``); rank ``r``
    owns slots ``[r * p, (r + 1) * p)``.

    Raises:
        ValueError: ``E + num_redundant_experts`` does not divide over ``num_ranks``.
    """
    num_physical = num_logical_experts + num_redundant_experts
    if num_ranks < 1 or num_physical % num_ranks:
        raise ValueError(
            f"E + num_redundant_experts = {num_physical} physical experts must divide evenly over "
            f"num_ranks={num_ranks}"
        )
    p = num_physical // num_ranks
    initial = measures.upstream_initial_placement(num_logical_experts, num_redundant_experts, 1)[0]
    return initial[ep_rank * p : (ep_rank + 1) * p].tolist()


class ToyModelConfig:
    """What ``EplbState`` reads from a ``ModelConfig``: ``.model`` and ``.compute_hash()``."""

    def __init__(self, name: str = "toy/moe") -> None:
        self.model = name

    def compute_hash(self) -> str:
        return "toy-moe:" + self.model


class ExpertWeights(Protocol):
    """A layer's local expert storage as EPLB moves it."""

    def weight_views(self) -> list[Any]:
        """Every per-expert tensor the kernel reads, each ``(p, -1)`` over the very storage."""


class ToyMoELayer(torch.nn.Module):
    """One MoE layer shaped like upstream's ``MoERunner``: a real upstream router and local experts.

    Args:
        experts: the layer's local expert storage (:class:`ExpertWeights`).
        num_logical_experts: E.
        top_k: K.

    Attributes:
        routing_calls: how many times upstream's router ran this layer's routing function.
    """

    def __init__(self, experts: ExpertWeights, num_logical_experts: int, top_k: int) -> None:
        super().__init__()
        self.experts = experts
        self.routing_calls = 0
        self._replay: tuple[torch.Tensor, torch.Tensor] | None = None
        self.router = CustomRoutingRouter(
            top_k=top_k,
            global_num_experts=num_logical_experts,
            custom_routing_function=self._replayed_routing,
            eplb_state=EplbLayerState(),
            renormalize=False,
        )

    def _replayed_routing(self, hidden_states, gating_output, topk, renormalize):
        self.routing_calls += 1
        if self._replay is None:
            raise RuntimeError("ToyMoELayer: the router ran without a replayed selection (call route())")
        weights, ids = self._replay
        self._replay = None
        return weights, ids

    @property
    def eplb_state(self) -> Any:
        return self.router.eplb_state

    @property
    def expert_storage(self) -> Any:
        """The quant_views storage behind the weight views, when the experts have one (else None)."""
        return getattr(self.experts, "storage", None)

    def get_expert_weights(self) -> list[Any]:
        return list(self.experts.weight_views())

    def set_eplb_state(self, moe_layer_idx, expert_load_view, logical_to_physical_map, logical_replica_count):
        # As upstream MoERunner.set_eplb_state: the state is the router's.
        if self.router.eplb_state is not None:
            self.router.eplb_state.set_layer_state(
                moe_layer_idx, expert_load_view, logical_to_physical_map, logical_replica_count
            )

    def route(self, topk_ids: torch.Tensor, topk_weights: torch.Tensor | None = None):
        """Upstream's ``select_experts`` on the replayed selection.

        Args:
            topk_ids: int64 ``(T, K)`` logical expert ids (padding rows included).
            topk_weights: float32 ``(T, K)``; ones when None.

        Returns:
            ``(topk_weights (T, K) float32, physical ids (T, K))``: whatever the router instance maps to
            (physical ids once the integration bound dataplane's op; int32 from upstream's router).
        """
        if topk_weights is None:
            topk_weights = torch.ones(topk_ids.shape, dtype=torch.float32)
        self._replay = (topk_weights, topk_ids)
        num_tokens = topk_ids.shape[0]
        hidden = torch.zeros(num_tokens, 1)
        logits = torch.zeros(num_tokens, self.router.global_num_experts)
        return self.router.select_experts(hidden, logits)


class ToyMoEModel(torch.nn.Module, MixtureOfExperts):
    """The upstream ``MixtureOfExperts`` contract over :class:`ToyMoELayer` s.

    Args:
        experts: one :class:`ExpertWeights` per MoE layer (this rank's ``p`` slots each).
        num_logical_experts: E.
        num_redundant_experts: P - E.
        num_ranks: N (EP ranks).
        top_k: K.
    """

    def __init__(
        self,
        experts: Sequence[ExpertWeights],
        num_logical_experts: int,
        num_redundant_experts: int,
        num_ranks: int,
        top_k: int,
    ) -> None:
        super().__init__()
        num_physical = num_logical_experts + num_redundant_experts
        if num_physical % num_ranks:
            raise ValueError(f"P={num_physical} physical experts must divide evenly over {num_ranks} ranks")
        self.layers = torch.nn.ModuleList(ToyMoELayer(e, num_logical_experts, top_k) for e in experts)
        self.moe_layers = list(self.layers)
        self.expert_weights = []
        self.num_moe_layers = len(self.layers)
        self.num_expert_groups = 1
        self.num_logical_experts = num_logical_experts
        self.num_routed_experts = num_logical_experts
        self.num_redundant_experts = num_redundant_experts
        self.num_physical_experts = num_physical
        self.num_local_physical_experts = num_physical // num_ranks
        self.num_shared_experts = 0
        self.top_k = top_k

    def update_physical_experts_metadata(self, num_physical_experts, num_local_physical_experts):
        self.num_physical_experts = num_physical_experts
        self.num_local_physical_experts = num_local_physical_experts

    def route(
        self,
        topk_ids_per_layer: Sequence[torch.Tensor],
        topk_weights_per_layer: Sequence[torch.Tensor] | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`ToyMoELayer.route` of every layer, in order; returns ``[(weights, physical ids)]``."""
        weights = topk_weights_per_layer or [None] * len(self.layers)
        return [
            layer.route(ids, w)
            for layer, ids, w in zip(self.layers, topk_ids_per_layer, weights, strict=True)
        ]
