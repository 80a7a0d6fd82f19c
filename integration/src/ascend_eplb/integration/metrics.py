"""The bytes of a rearrangement, read from a serving model: one expert's weights, what a rank received.

Two facts a placement alone does not give (the placement measures are
:mod:`ascend_eplb.control.measures`'):

- :func:`expert_bytes`: per MoE layer, the bytes of one expert's weights (every tensor a rearrangement
  moves); experts moved x this is the *estimated* ``bytes_moved`` of the events file, ``plan`` and
  ``simulate``;
- :func:`bytes_received`: what this rank's communicator *measured* receiving over all its transfers so far
  (``bytes_received`` of the events file and ``simulate``'s report).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["bytes_moved", "bytes_received", "expert_bytes"]


def expert_bytes(expert_weights) -> list[int]:
    """Per MoE layer, the bytes one expert's weights occupy: what moving one expert transfers.

    Args:
        expert_weights: upstream's ``MixtureOfExperts.expert_weights``, per layer a sequence of weight
            views ``(p, ...)`` (stacked tensors, or quant_views' per-expert ``ExpertTensorList`` s): the
            tensors upstream's transaction moves, scales included.

    Returns:
        ``[sum over the layer's views of view[0].numel() * view[0].element_size()]`` per layer.
    """
    return [sum(int(view[0].numel()) * view[0].element_size() for view in layer) for layer in expert_weights]


def bytes_moved(experts_moved: Any, expert_nbytes: Any) -> int:
    """The bytes a rearrangement moves, estimated: experts moved x one expert's bytes.

    Args:
        experts_moved: per MoE layer ``(L,)`` (a tensor or a sequence), or one total.
        expert_nbytes: per MoE layer (:func:`expert_bytes`), or one size for every layer.

    Returns:
        ``sum over layers of experts_moved[l] * expert_nbytes[l]`` (a scalar broadcast over the layers).
    """
    moved = torch.as_tensor(experts_moved, dtype=torch.int64)
    nbytes = torch.as_tensor(expert_nbytes, dtype=torch.int64)
    return int((moved * nbytes).sum())


def bytes_received(model_state) -> int | None:
    """Bytes this rank has received over all the model's transfers so far, or None when not counted.

    Args:
        model_state: upstream's ``EplbModelState``; its ``communicator``'s ``cumulative_stats``
            (movement's :class:`~ascend_eplb.movement.stats.TransferStats`) is read.

    Returns:
        ``cumulative_stats.bytes_received``; None when the communicator keeps no statistics (one of
        upstream's own communicators).
    """
    stats = getattr(model_state.communicator, "cumulative_stats", None)
    return None if stats is None else int(stats.bytes_received)
