"""Value checks shared by control and the packages above it (integration, tools); standard library only.

Imports nothing but the standard library, so start-up validation and ``ascend-eplb check`` use it
without importing torch or vLLM.
"""

from __future__ import annotations

import numbers

__all__ = ["INT32_MAX", "is_int"]

#: Largest integer a setting may hold (``2**31 - 1``): the sizes and counts feed int32 device tables
#: (the dataplane's replica lookup) and upstream's int32 load counters. The one statement of the
#: limit, read by the start-up rules and the tools' integer checks.
INT32_MAX = 2**31 - 1


def is_int(value: object) -> bool:
    """Whether ``value`` is an integer and not a ``bool``: a count, size, rank or id. Any
    ``numbers.Integral`` counts (numpy integers included); ``True`` is an ``int`` to Python, never a
    count here.

    The same check is written once in each of quant_views, dataplane, movement and control: no package
    all four may import exists (quant_views and dataplane import torch only, and neither the other:
    DESIGN.md section 3), so each keeps its copy and ``tests/test_one_home.py`` checks that the four
    agree on every kind of value.
    """
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
