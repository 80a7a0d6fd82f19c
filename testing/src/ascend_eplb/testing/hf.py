"""The HF transformers oracle: logits of a checkpoint computed by transformers itself, never by vLLM.

The real-model tests compare vLLM's logits, EPLB on and off, with these on the same tiny checkpoint.
Needs the package's ``[vllm]`` extra (transformers); nothing else of the package imports this module.
"""

from __future__ import annotations

import os

import torch
from transformers import AutoModelForCausalLM

__all__ = ["hf_logits"]


def hf_logits(folder: str | os.PathLike[str], input_ids: torch.Tensor) -> torch.Tensor:
    """HF transformers' logits on the checkpoint in ``folder`` (eager attention, float32).

    ``input_ids``: int64 ``(T,)``, one sequence; returns float32 ``(T, V)``, V the vocabulary size.
    """
    model = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    with torch.inference_mode():
        return model(input_ids.view(1, -1)).logits[0].float()
