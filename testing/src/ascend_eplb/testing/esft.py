"""The real routing of the tests: the ESFT DeepSeek-V2-Lite top-6 trace in the project's shared data.

``shared/data/expert-load/esft-deepseek-v2-lite-expert-scores`` (MIT) is checked out beside the
repository (as CI has it); ``ASCEND_EPLB_SHARED_DIR`` points elsewhere. Each
``expert_weights_<layer>.txt`` line is one sequence: its tokens' top-6 expert ids, tab-separated, then
two tabs and their routing weights.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

__all__ = ["ESFT_NUM_LOGICAL_EXPERTS", "ESFT_TOP_K", "esft_data_dir", "esft_sequences", "esft_trace_dir"]

#: DeepSeek-V2-Lite's routed experts and top-k, as in the trace.
ESFT_NUM_LOGICAL_EXPERTS = 64
ESFT_TOP_K = 6
_DATA = "data/expert-load/esft-deepseek-v2-lite-expert-scores"


def esft_data_dir() -> Path:
    """The ESFT dataset's folder (``results/expert_scores/<task>/...``).

    Raises:
        FileNotFoundError: the shared data is not beside the checkout (nor at ``ASCEND_EPLB_SHARED_DIR``).
    """
    shared = os.environ.get("ASCEND_EPLB_SHARED_DIR")
    root = Path(shared) if shared else Path(__file__).resolve().parents[4].parent / "shared"
    folder = root / _DATA
    if not folder.is_dir():
        raise FileNotFoundError(
            f"{folder}: the ESFT trace of the shared data is missing; check shared/ out beside the "
            "repository or set ASCEND_EPLB_SHARED_DIR"
        )
    return folder


def esft_trace_dir() -> Path:
    """The folder of the translation task's ``expert_weights_*.txt`` files (see :func:`esft_data_dir`)."""
    return esft_data_dir() / "results/expert_scores/translation"


def esft_sequences(moe_layer: int, num_sequences: int) -> list[torch.Tensor]:
    """The first ``num_sequences`` sequences' expert ids of MoE layer ``moe_layer`` (trace layer
    ``moe_layer + 1``; the trace's layer 0 is dense), each int64 ``(tokens, 6)``."""
    path = esft_trace_dir() / f"expert_weights_{moe_layer + 1}.txt"
    out = []
    with open(path) as f:
        for _, line in zip(range(num_sequences), f, strict=False):
            ids = [int(v) for v in line.split("\t\t")[0].split("\t")]
            out.append(torch.tensor(ids, dtype=torch.int64).view(-1, ESFT_TOP_K))
    return out
