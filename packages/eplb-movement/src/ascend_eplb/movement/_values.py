"""Value checks of the movement plane; standard library only."""

from __future__ import annotations

import numbers

__all__ = ["is_int"]


def is_int(value: object) -> bool:
    """Whether ``value`` is a ``numbers.Integral`` (numpy integers included) and not a ``bool``.

    Each of quant_views, dataplane, movement and control keeps one copy (no package all four may
    import); ``tests/test_one_home.py`` checks that they agree.
    """
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
