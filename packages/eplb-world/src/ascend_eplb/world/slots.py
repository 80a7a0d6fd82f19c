"""What each physical slot of a rank must hold, and the slots that do not.

A slot ``p`` of rank ``r`` (``p // p_local == r``) must hold its logical expert under the committed
placement ``physical_to_logical_map`` ``(L, P)``: for float experts the very weights of the checkpoint
(:func:`local_slot_mismatches`), for a quant_views format the kernel storage the checkpoint's own tensors
lay out to, compared by fingerprint over every kernel tensor (:func:`checkpoint_expert_storage`,
:func:`slot_fingerprint_mismatches`). :func:`initial_physical_to_logical` is upstream's initial
placement, the one vLLM's loader fills the slots under. Shape letters (DESIGN.md section 2): L MoE
layers, E logical experts, P physical experts, p local physical experts.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from ascend_eplb.control import measures
from ascend_eplb.quant_views import expert_fingerprint, get_format, layer_storage
from ascend_eplb.world.checkpoints import (
    EXPERT_KEYS,
    CheckpointInfo,
    checkpoint_info,
    checkpoint_tensors,
    format_switch,
)

__all__ = [
    "checkpoint_expert_storage",
    "initial_physical_to_logical",
    "local_slot_mismatches",
    "slot_fingerprint_mismatches",
]


def _routed_experts(model: torch.nn.Module) -> list[Any]:
    return [layer.routed_experts for layer in model.moe_layers]


def initial_physical_to_logical(info: CheckpointInfo, num_redundant_experts: int) -> torch.Tensor:
    """Upstream's initial placement of the checkpoint, int64 ``(L, P)``
    (:func:`ascend_eplb.control.measures.upstream_initial_placement` at its E and L)."""
    return measures.upstream_initial_placement(
        info.num_logical_experts, num_redundant_experts, info.num_moe_layers
    )


def local_slot_mismatches(
    model: torch.nn.Module,
    experts: Sequence[tuple[torch.Tensor, torch.Tensor]],
    physical_to_logical: torch.Tensor,
    ep_rank: int,
) -> list[str]:
    """Local slots whose weights differ from the checkpoint's expert under a placement.

    Args:
        model: a rank's model.
        experts: ``checkpoints.checkpoint_experts`` of its checkpoint.
        physical_to_logical: int ``(L, P)``: the logical expert of each physical slot.
        ep_rank: this rank's EP rank (its slots are ``[ep_rank * p, (ep_rank + 1) * p)``).

    Returns:
        one line per mismatching ``(layer, slot)`` (empty when every local slot holds its expert
        exactly).
    """
    out = []
    for layer, (moe, (w13, w2)) in enumerate(zip(_routed_experts(model), experts, strict=True)):
        p = moe.w13_weight.shape[0]
        for row in range(p):
            slot = ep_rank * p + row
            logical = int(physical_to_logical[layer, slot])
            if not (
                torch.equal(moe.w13_weight[row], w13[logical])
                and torch.equal(moe.w2_weight[row], w2[logical])
            ):
                out.append(f"layer {layer} slot {slot} (row {row}) != logical expert {logical}")
    return out


def checkpoint_expert_storage(folder: str | os.PathLike[str], fmt: str) -> list[Any]:
    """Every logical expert of each MoE layer laid out as the kernel reads it: the truth a slot's
    fingerprint is compared with.

    Per MoE layer (L entries) a quant_views ``ExpertStorage`` with E rows (row e: logical expert e),
    made by ``storage_from_checkpoint`` from the checkpoint's own tensors (so any difference from a
    slot is a movement error, never a requantization), with the runtime options the method uses
    (W8A8 fused scales when ``VLLM_ASCEND_ENABLE_FUSED_MC2`` is on); stacked.
    """
    info = checkpoint_info(folder)
    tensors = checkpoint_tensors(folder)
    gate_t, up_t, down_t = EXPERT_KEYS[info.arch]
    fmt_ = get_format(fmt)
    options = {"fused_scales": True} if fmt == "w8a8_dynamic" and format_switch("fused_scales") else {}
    # One pass over the keys: module -> [(position, suffix)] of the tensors under it, for the gate and
    # down modules of every expert (O(keys), not O(E x keys)).
    wanted = {
        f"model.layers.{layer}." + t.format(e=e)
        for layer in info.moe_layer_indices
        for e in range(info.num_logical_experts)
        for t in (gate_t, down_t)
    }
    under: dict[str, list[tuple[int, str]]] = {}
    for position, key in enumerate(tensors):
        for dot in (i for i, c in enumerate(key) if c == "."):
            if key[:dot] in wanted:
                under.setdefault(key[:dot], []).append((position, key[dot + 1 :]))
    out = []
    for layer in info.moe_layer_indices:
        prefix = f"model.layers.{layer}."
        down = tensors[prefix + down_t.format(e=0) + ".weight"]
        hidden = down.shape[0]
        per_name: dict[str, list[torch.Tensor]] = {}
        for e in range(info.num_logical_experts):
            gate, up, down = (prefix + t.format(e=e) for t in (gate_t, up_t, down_t))
            found = sorted(
                [(pos, "w13", (gate, up), suffix) for pos, suffix in under.get(gate, [])]
                + [(pos, "w2", (down,), suffix) for pos, suffix in under.get(down, [])]
            )
            for _, stem, parts, suffix in found:  # in the checkpoint's key order, as each key is found
                rows = [tensors[f"{k}.{suffix}"] for k in parts]
                per_name.setdefault(f"{stem}_{suffix}", []).append(torch.cat(rows))
        stacked = {n: torch.stack(v) for n, v in per_name.items()}
        inter = stacked["w13_weight"].shape[1] // 2
        out.append(fmt_.storage_from_checkpoint(stacked, hidden, inter, **options))
    return out


def slot_fingerprint_mismatches(
    model: torch.nn.Module, truth: list[Any], physical_to_logical: torch.Tensor, ep_rank: int, fmt: str
) -> list[str]:
    """Local slots whose kernel storage differs from their logical expert's under a placement.

    Args:
        model: a rank's model with quant_views-laid-out experts.
        truth: :func:`checkpoint_expert_storage` of its checkpoint.
        physical_to_logical: int ``(L, P)``.
        ep_rank: this rank's EP rank (its slots are ``[ep_rank * p, (ep_rank + 1) * p)``).
        fmt: the format name.

    Returns:
        one line per mismatching ``(layer, slot)``: quant_views ``expert_fingerprint`` over every kernel
        tensor of the layer (read from the layer's own parameters) against the truth's.
    """
    out = []
    layers = [layer.routed_experts for layer in model.moe_layers]
    for index, (experts, reference) in enumerate(zip(layers, truth, strict=True)):
        storage = layer_storage(experts, fmt)
        for row in range(storage.num_local_experts):
            slot = ep_rank * storage.num_local_experts + row
            logical = int(physical_to_logical[index, slot])
            if expert_fingerprint(storage, row) != expert_fingerprint(reference, logical):
                out.append(f"layer {index} slot {slot} (row {row}) != logical expert {logical} (fingerprint)")
    return out
