"""Expert weights tagged with their logical expert, for exact movement checks on the toy MoE model.

Every weight element of a slot of :class:`TaggedExperts` (an ``ExpertWeights`` of
:mod:`ascend_eplb.world.toy_moe`) is the :func:`~ascend_eplb.testing.oracles.tag` of the logical expert
it holds, so after a rearrangement each slot reads back exactly its new expert's tag. Plain torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ascend_eplb.testing.oracles import tag as default_tag

__all__ = ["TaggedExperts"]


class TaggedExperts:
    """``p`` local experts whose every weight element is the tag of the logical expert they hold.

    Two tensors of two dtypes, float32 ``(p, 2, 4)`` and bfloat16 ``(p, 4, 2)`` (tags exact in bf16);
    ``local_logical``: each local slot's logical expert; ``tag(layer, logical_expert) -> float``.
    """

    def __init__(
        self, layer: int, local_logical: Sequence[int], tag: Callable[[int, int], float] = default_tag
    ) -> None:
        p = len(local_logical)
        tags = torch.tensor([tag(layer, e) for e in local_logical], dtype=torch.float32)
        self.w13 = tags.view(p, 1, 1).expand(p, 2, 4).contiguous()
        self.w2 = tags.to(torch.bfloat16).view(p, 1, 1).expand(p, 4, 2).contiguous()

    def weight_views(self) -> list[torch.Tensor]:
        p = self.w13.shape[0]
        return [self.w13.view(p, -1), self.w2.view(p, -1)]

    def local_tags(self) -> list[list[float]]:
        """Per local slot: the distinct values of each tensor's row (one each when the row is intact)."""
        return [
            sorted({float(v) for v in self.w13[i].flatten().tolist()})
            + sorted({float(v) for v in self.w2[i].float().flatten().tolist()})
            for i in range(self.w13.shape[0])
        ]
