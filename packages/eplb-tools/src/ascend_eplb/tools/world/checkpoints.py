"""Reading the tiny checkpoints of :mod:`ascend_eplb.tools.world.serving`: their sizes and routed experts.

What both :mod:`~ascend_eplb.tools.world.serving` (which writes and runs the checkpoints) and
:mod:`~ascend_eplb.tools.world.quant_method` (which quantizes their experts) read, so neither imports the
other for it. Imports torch and the standard library (safetensors when experts are read); no vLLM.
Shape letters (DESIGN.md section 2): E logical experts, H hidden size, I MoE intermediate size, L MoE
layers, K top-k; V is the vocabulary size.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "ARCHITECTURES",
    "EXPERT_KEYS",
    "CheckpointInfo",
    "checkpoint_experts",
    "checkpoint_info",
    "checkpoint_tensors",
]

#: The architectures :func:`~ascend_eplb.tools.world.serving.write_checkpoint` writes, with their HF
#: ``architectures`` entry.
ARCHITECTURES = {
    "qwen3-moe": "Qwen3MoeForCausalLM",
    "deepseek-v3": "DeepseekV3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
_ARCH_BY_CLASS = {v: k for k, v in ARCHITECTURES.items()}
#: Checkpoint key templates of one routed expert's (gate, up, down) weights per architecture.
EXPERT_KEYS = {
    "qwen3-moe": ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj"),
    "deepseek-v3": ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj"),
    "mixtral": (
        "block_sparse_moe.experts.{e}.w1",
        "block_sparse_moe.experts.{e}.w3",
        "block_sparse_moe.experts.{e}.w2",
    ),
}


@dataclass(frozen=True)
class CheckpointInfo:
    """The sizes of a checkpoint :func:`~ascend_eplb.tools.world.serving.write_checkpoint` wrote (read
    back from its ``config.json``).

    Attributes:
        arch: ``"qwen3-moe"``, ``"deepseek-v3"`` or ``"mixtral"``.
        folder: the checkpoint folder.
        num_logical_experts: E (routed experts per MoE layer).
        top_k: K.
        moe_layer_indices: the decoder-layer index of each MoE layer, in order (L entries).
        vocab_size: V.
        hidden_size: H.
    """

    arch: str
    folder: Path
    num_logical_experts: int
    top_k: int
    moe_layer_indices: tuple[int, ...]
    vocab_size: int
    hidden_size: int

    @property
    def num_moe_layers(self) -> int:
        """L."""
        return len(self.moe_layer_indices)

    def redundant_experts_for(self, num_ranks: int, at_least: int = 1) -> int:
        """The smallest ``R >= at_least`` with ``(E + R) % num_ranks == 0``."""
        r = at_least
        while (self.num_logical_experts + r) % num_ranks:
            r += 1
        return r


def checkpoint_info(folder: str | os.PathLike[str]) -> CheckpointInfo:
    """The sizes of the checkpoint in ``folder`` (its ``config.json``).

    Raises:
        ValueError: the checkpoint's architecture is none of :data:`ARCHITECTURES`.
    """
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    (cls,) = config["architectures"]
    if cls not in _ARCH_BY_CLASS:
        raise ValueError(f"{folder}: architecture {cls} is none of {sorted(ARCHITECTURES.values())}")
    arch = _ARCH_BY_CLASS[cls]
    layers = config["num_hidden_layers"]
    if arch == "deepseek-v3":
        experts = config["n_routed_experts"]
        moe = tuple(range(config["first_k_dense_replace"], layers))
    elif arch == "qwen3-moe":
        experts = config.get(
            "num_experts", config.get("num_local_experts")
        )  # transformers 5 writes the latter
        moe = tuple(i for i in range(layers) if i not in config.get("mlp_only_layers", []))
    else:
        experts = config["num_local_experts"]
        moe = tuple(range(layers))
    return CheckpointInfo(
        arch=arch,
        folder=folder,
        num_logical_experts=experts,
        top_k=config["num_experts_per_tok"],
        moe_layer_indices=moe,
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
    )


def checkpoint_tensors(folder: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's ``*.safetensors`` files (in file-name order), by checkpoint key."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def checkpoint_experts(folder: str | os.PathLike[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every MoE layer's routed experts as the checkpoint holds them, in vLLM's layout.

    Returns:
        per MoE layer (L entries): ``(w13 (E, 2I, H), w2 (E, H, I))`` in the checkpoint's dtype, gate
        rows then up rows, as vLLM's ``w13_weight`` / ``w2_weight`` hold a logical expert.

    Raises:
        KeyError: the experts are quantized (their float weights are not in the checkpoint; see
            ``ascend_quant.checkpoint_expert_storage``).
    """
    info = checkpoint_info(folder)
    tensors = checkpoint_tensors(folder)
    gate_t, up_t, down_t = EXPERT_KEYS[info.arch]
    out = []
    for layer in info.moe_layer_indices:
        prefix = f"model.layers.{layer}."
        w13, w2 = [], []
        for e in range(info.num_logical_experts):
            gate = tensors[prefix + gate_t.format(e=e) + ".weight"]
            up = tensors[prefix + up_t.format(e=e) + ".weight"]
            w13.append(torch.cat([gate, up]))
            w2.append(tensors[prefix + down_t.format(e=e) + ".weight"])
        out.append((torch.stack(w13), torch.stack(w2)))
    return out
