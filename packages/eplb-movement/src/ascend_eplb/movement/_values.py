"""Value checks of the movement plane; standard library only.

The one "an integer but not a bool" check of this package; not a public name of it. The same check is
written once in each of quant_views, dataplane, movement and control: no package all four may import
exists (quant_views and dataplane import torch only, and neither the other: DESIGN.md section 3), so
each keeps its copy and ``tests/test_one_home.py`` checks that the four agree on every kind of value.
"""

from __future__ import annotations

import numbers

__all__ = ["is_int"]


def is_int(value: object) -> bool:
    """Whether ``value`` is an integer and not a ``bool``: a rank, expert id or byte count. Any
    ``numbers.Integral`` counts (numpy integers included, as upstream may hand them); ``True`` is an
    ``int`` to Python, never a rank or a size here."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
