"""The world's real load: ESFT's DeepSeek-V2-Lite routing, shipped in this package (``data/``, MIT).

:func:`embedded_trace_path` (``data/esft_translation_top6.npz``): the per-token top-6 routing of the 40
sequences (8,251 tokens) of ESFT's "translation" task over 26 MoE layers, a lossless conversion of
ESFT's ``expert_weights_<layer>.txt`` (``data/ORIGIN.md``; ``ascend_eplb.tools.trace`` reads the format);
:func:`esft_sequences` gives one layer's sequences as the multi-rank tests route them.
:func:`task_shares_path`: the four tasks' per-(layer, expert) token shares (ESFT's
``results/expert_scores/<task>/summary.json``, byte-identical: ``{"token_scores": {layer: {expert:
share}}, ...}``, layers "1".."26", experts "0".."63"). Read with ``importlib.resources``. Shapes: E, K.
"""

from __future__ import annotations

import functools
from importlib import resources
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "EMBEDDED_TRACE",
    "ESFT_NUM_LOGICAL_EXPERTS",
    "ESFT_NUM_MOE_LAYERS",
    "ESFT_NUM_SEQUENCES",
    "ESFT_TASKS",
    "ESFT_TOP_K",
    "data_path",
    "embedded_trace_path",
    "esft_sequences",
    "task_shares_path",
]

#: DeepSeek-V2-Lite's routed experts E, top-k K and MoE layers, and the task's sequences, as in the trace.
ESFT_NUM_LOGICAL_EXPERTS = 64
ESFT_TOP_K = 6
ESFT_NUM_MOE_LAYERS = 26
ESFT_NUM_SEQUENCES = 40
#: ESFT's four tasks, each with its ``summary.json`` here.
ESFT_TASKS = ("intent", "law", "summary", "translation")
#: File name of the embedded trace in this package's ``data/``.
EMBEDDED_TRACE = "esft_translation_top6.npz"


def data_path(*parts: str) -> Path:
    """The path of a file shipped in this package's ``data/`` (``ORIGIN.md``, ``LICENSE-ESFT``, ...)."""
    return Path(str(resources.files("ascend_eplb.world").joinpath("data", *parts)))


def embedded_trace_path() -> Path:
    """The embedded ESFT trace (``data/esft_translation_top6.npz``)."""
    return data_path(EMBEDDED_TRACE)


def task_shares_path(task: str) -> Path:
    """ESFT's ``summary.json`` of ``task`` (one of :data:`ESFT_TASKS`).

    Raises:
        ValueError: ``task`` is not one of :data:`ESFT_TASKS`.
    """
    if task not in ESFT_TASKS:
        raise ValueError(f"task={task!r}: the ESFT tasks shipped are {list(ESFT_TASKS)}")
    return data_path("expert_scores", task, "summary.json")


@functools.cache
def _trace_ids() -> tuple[np.ndarray, np.ndarray]:
    """The embedded trace's ``topk_ids`` uint8 ``(L, tokens, K)`` and ``seq_offsets`` int64."""
    with np.load(embedded_trace_path(), allow_pickle=False) as z:
        return z["topk_ids"], z["seq_offsets"]


def esft_sequences(moe_layer: int, num_sequences: int) -> list[torch.Tensor]:
    """The first ``num_sequences`` sequences' expert ids of MoE layer ``moe_layer`` (ESFT's
    ``expert_weights_<moe_layer + 1>.txt``: the trace's layer 0 is dense), each int64 ``(tokens, K)``.

    Raises:
        ValueError: ``moe_layer`` is not in ``[0, 26)`` or ``num_sequences`` not in ``[0, 40]``.
    """
    ids, offsets = _trace_ids()
    if not 0 <= moe_layer < ESFT_NUM_MOE_LAYERS:
        raise ValueError(f"moe_layer={moe_layer}: the ESFT trace has MoE layers 0..{ESFT_NUM_MOE_LAYERS - 1}")
    if not 0 <= num_sequences <= ESFT_NUM_SEQUENCES:
        raise ValueError(f"num_sequences={num_sequences}: the ESFT trace has {ESFT_NUM_SEQUENCES} sequences")
    layer = torch.from_numpy(ids[moe_layer].astype(np.int64))
    return [layer[offsets[s] : offsets[s + 1]] for s in range(num_sequences)]
