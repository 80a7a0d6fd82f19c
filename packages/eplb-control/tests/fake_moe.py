"""A small MoE model for the control plane's multi-rank tests (loaded by path beside ranks.py).

``FakeMoEModel`` satisfies upstream's ``MixtureOfExperts`` protocol: ``num_moe_layers`` layers, each
with ``p`` local physical experts on this rank. Expert weights are tagged: every row of layer ``l``
that holds logical expert ``e`` is filled with ``tag(l, e)`` (the caller's function; values must be
exact in bf16), in two tensors of different dtypes, as upstream's movement moves a list
of per-expert tensors. Each layer carries an ``AscendEplbLayerState``, like the routers the integration
binds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from vllm.model_executor.models.interfaces import MixtureOfExperts

from ascend_eplb.control import AscendEplbLayerState


class FakeModelConfig:
    """What ``EplbState`` reads from a ``ModelConfig``: ``.model`` and ``.compute_hash()``."""

    def __init__(self, name: str = "fake/tiny-moe") -> None:
        self.model = name

    def compute_hash(self) -> str:
        return "fake-moe-hash-" + self.model


class FakeMoELayer(torch.nn.Module):
    def __init__(self, layer: int, local_logical: Sequence[int], tag: Callable[[int, int], float]) -> None:
        super().__init__()
        p = len(local_logical)
        tags = torch.tensor([tag(layer, e) for e in local_logical], dtype=torch.float32)
        self.w13 = torch.nn.Parameter(tags.view(p, 1, 1).expand(p, 2, 4).contiguous(), requires_grad=False)
        self.w2 = torch.nn.Parameter(
            tags.to(torch.bfloat16).view(p, 1, 1).expand(p, 4, 2).contiguous(), requires_grad=False
        )
        self.eplb_state = AscendEplbLayerState()

    def get_expert_weights(self) -> list[torch.Tensor]:
        p = self.w13.shape[0]
        return [self.w13.data.view(p, -1), self.w2.data.view(p, -1)]

    def set_eplb_state(
        self,
        moe_layer_idx: int,
        expert_load_view: torch.Tensor,
        logical_to_physical_map: torch.Tensor,
        logical_replica_count: torch.Tensor,
    ) -> None:
        self.eplb_state.set_layer_state(
            moe_layer_idx, expert_load_view, logical_to_physical_map, logical_replica_count
        )

    def local_tags(self) -> list[list[float]]:
        """Per local slot: the distinct values of each weight tensor's row (one each when intact)."""
        return [
            sorted({float(v) for v in self.w13.data[i].flatten().tolist()})
            + sorted({float(v) for v in self.w2.data[i].float().flatten().tolist()})
            for i in range(self.w13.shape[0])
        ]


class FakeMoEModel(torch.nn.Module, MixtureOfExperts):
    def __init__(
        self,
        num_moe_layers: int,
        num_logical_experts: int,
        num_redundant_experts: int,
        ep_rank: int,
        num_ranks: int,
        tag: Callable[[int, int], float],
    ):
        super().__init__()
        num_physical = num_logical_experts + num_redundant_experts
        assert num_physical % num_ranks == 0
        p = num_physical // num_ranks
        initial = list(range(num_logical_experts)) + [
            i % num_logical_experts for i in range(num_redundant_experts)
        ]
        local = initial[ep_rank * p : (ep_rank + 1) * p]
        self.layers = torch.nn.ModuleList(FakeMoELayer(layer, local, tag) for layer in range(num_moe_layers))
        self.moe_layers = list(self.layers)
        self.expert_weights = []
        self.num_moe_layers = num_moe_layers
        self.num_expert_groups = 1
        self.num_logical_experts = num_logical_experts
        self.num_physical_experts = num_physical
        self.num_local_physical_experts = p
        self.num_routed_experts = num_logical_experts
        self.num_shared_experts = 0
        self.num_redundant_experts = num_redundant_experts

    def update_physical_experts_metadata(
        self, num_physical_experts: int, num_local_physical_experts: int
    ) -> None:
        self.num_physical_experts = num_physical_experts
        self.num_local_physical_experts = num_local_physical_experts
