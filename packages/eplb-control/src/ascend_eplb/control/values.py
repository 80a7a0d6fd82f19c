"""Value checks shared by control and the packages above it (integration, tools); standard library only.

Imports nothing but the standard library, so start-up validation and ``ascend-eplb check`` use it
without importing torch or vLLM.
"""

from __future__ import annotations

__all__ = ["is_int"]


def is_int(value: object) -> bool:
    """Whether ``value`` is an ``int`` and not a ``bool``: a count, size, rank or id (``True`` is an
    ``int`` to Python, never a count here)."""
    return isinstance(value, int) and not isinstance(value, bool)
