"""Value checks of the movement plane; standard library only.

The one "an int but not a bool" check of this package (movement imports neither control nor the other
planes, so it keeps its own, as each plane does); not a public name of it.
"""

from __future__ import annotations

import numbers

__all__ = ["is_int"]


def is_int(value: object) -> bool:
    """Whether ``value`` is an integer and not a ``bool``: a rank, expert id or byte count. Any
    ``numbers.Integral`` counts (numpy integers included, as upstream may hand them); ``True`` is an
    ``int`` to Python, never a rank or a size here."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
