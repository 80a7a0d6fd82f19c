"""The HF transformers oracle: logits of a checkpoint computed by transformers itself, never by vLLM.

The real-model tests compare vLLM's logits (``ascend_eplb.world.serving.forward``, EPLB on and off)
with these on the same tiny checkpoint (``ascend_eplb.world.checkpoints.write_checkpoint``).
Imports torch; transformers inside :func:`hf_logits`. Shape letters: T tokens; V is the vocabulary size.
"""

from __future__ import annotations

import os

import torch

__all__ = ["hf_logits"]


def hf_logits(folder: str | os.PathLike[str], input_ids: torch.Tensor) -> torch.Tensor:
    """HF transformers' logits on the checkpoint in ``folder`` (eager attention, float32).

    Args:
        input_ids: int64 ``(T,)``, one sequence.

    Returns:
        float32 ``(T, vocab_size)``.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    with torch.inference_mode():
        return model(input_ids.view(1, -1)).logits[0].float()
