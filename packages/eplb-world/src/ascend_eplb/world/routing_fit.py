"""A tiny DeepSeek-V3 checkpoint's routing fitted to a recorded load, through HF transformers.

:func:`fit_routing_bias` moves each MoE layer's ``e_score_correction_bias`` of a checkpoint of
:func:`~ascend_eplb.world.checkpoints.write_checkpoint` until its selections follow a popularity ``(L, E)``
(the ESFT trace's, for ``ascend-eplb simulate``'s DeepSeek-V3 presets). The MTP layer's own fit is
:func:`~ascend_eplb.world.checkpoints.add_mtp_layer`'s. transformers is imported inside the function; no
vLLM.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ascend_eplb.world.checkpoints import checkpoint_info

__all__ = ["fit_routing_bias"]


def fit_routing_bias(
    folder: str | os.PathLike[str],
    popularity: Any,
    *,
    iterations: int = 60,
    step: float = 0.02,
    seed: int = 0,
) -> torch.Tensor:
    """Fit a DeepSeek-V3 checkpoint's ``e_score_correction_bias`` so its routing follows ``popularity``.

    The bias shifts selection only (upstream's ``noaux_tc`` adds it to the scores for the top-k choice, not
    to the weights). Each of ``iterations`` runs HF transformers on 16 random sequences of 64 tokens (seed
    ``seed``), counts each MoE layer's selections and moves its bias by ``step * log(target share / observed
    share)``; the fitted bias is written back. 60 iterations fit the ESFT trace's first 4 MoE layers to an
    L1 distance of 0.14-0.17 (64-expert preset; balancedness without EPLB within 0.01 of the trace's).

    Args:
        folder: a ``"deepseek-v3"`` checkpoint of :func:`~ascend_eplb.world.checkpoints.write_checkpoint`.
        popularity: ``(L, E)`` non-negative load per logical expert; each layer normalised to shares.

    Returns:
        float64 ``(L, E)``: the selection shares of the last iteration.

    Raises:
        ValueError: not a DeepSeek-V3 checkpoint, or ``popularity`` not ``(L, E)`` with positive rows.
    """
    # local: transformers (5 s, Triton with it) when writing: simulate's option parser imports this module
    from transformers import AutoModelForCausalLM

    info = checkpoint_info(folder)
    if info.arch != "deepseek-v3":
        raise ValueError(f"{folder}: only a deepseek-v3 checkpoint has a routing bias, got {info.arch}")
    target = torch.as_tensor(popularity, dtype=torch.float64)
    if target.shape != (info.num_moe_layers, info.num_logical_experts) or bool((target.sum(1) <= 0).any()):
        raise ValueError(
            f"popularity must be (L, E) = ({info.num_moe_layers}, {info.num_logical_experts}) with a "
            f"positive total per layer, got {tuple(target.shape)}"
        )
    target = target / target.sum(1, keepdim=True)
    model = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    gates = [model.model.layers[i].mlp.gate for i in info.moe_layer_indices]
    counts: list[torch.Tensor | None] = [None] * len(gates)

    def counter(layer: int) -> Any:
        def hook(module: Any, inputs: Any, output: Any) -> None:
            counts[layer] = torch.bincount(output[2].reshape(-1), minlength=info.num_logical_experts)

        return hook

    handles = [gate.register_forward_hook(counter(i)) for i, gate in enumerate(gates)]
    ids = torch.randint(0, info.vocab_size, (16, 64), generator=torch.Generator().manual_seed(seed))
    shares = target
    try:
        for _ in range(iterations):
            with torch.inference_mode():
                model(ids)
            observed = torch.stack([c.double() for c in counts])
            shares = observed / observed.sum(1, keepdim=True)
            with torch.no_grad():
                for layer, gate in enumerate(gates):
                    error = torch.log((target[layer] + 1e-4) / (shares[layer] + 1e-4))
                    gate.e_score_correction_bias += (step * error).float()
    finally:
        for handle in handles:
            handle.remove()
    model.save_pretrained(folder)
    return shares
