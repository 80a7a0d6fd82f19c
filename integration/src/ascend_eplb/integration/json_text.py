"""JSON text read strictly: a key given twice in one object is refused, not the last taken.

``json.loads`` keeps the last value of a repeated key, so a file that sets a key twice is served with one of
its two values and says nothing; the placement file and the config files ``ascend-eplb check`` reads refuse
it. Standard library only.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["DuplicateKeyError", "loads"]


class DuplicateKeyError(ValueError):
    """A key given twice in one JSON object (``key``)."""

    def __init__(self, key: str) -> None:
        super().__init__(f"the key {key!r} is given twice in one object (which value is meant?)")
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``' object hook: the object, refusing a key given twice."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(key)
        out[key] = value
    return out


def loads(text: str | bytes) -> Any:
    """``json.loads(text)`` with every object's keys unique.

    Raises:
        DuplicateKeyError: a key is given twice in one object.
        json.JSONDecodeError: not JSON; RecursionError: nested too deeply.
    """
    return json.loads(text, object_pairs_hook=_unique_keys)
