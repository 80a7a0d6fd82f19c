"""The names upstream gives the models EPLB balances in one server (``EplbModelState.model_name``): the
target's is its ``model_config.model``; an MoE draft upstream registers beside it (DeepSeek-V3/R1's MTP
draft) is ``"<target> (draft)"`` (vLLM 0.33.0's ``eplb_draft_model_name``; ``tests/test_placement_file.py``
checks the suffix equal). The placement file and the events reader tell a draft's placement and records
from the target's by it. Standard library only (start-up's rules read placement files before anything is
built).
"""

from __future__ import annotations

__all__ = ["DRAFT_SUFFIX", "is_draft"]

#: What upstream appends to the target's name to name its draft: a model's role in a server.
DRAFT_SUFFIX = " (draft)"


def is_draft(name: str | None) -> bool:
    """Whether ``name`` (a model's, None: unnamed, a target's) is a draft's."""
    return name is not None and name.endswith(DRAFT_SUFFIX)
