"""The one parser of the serving guardrails' on/off environment switches (standard library only).

``ASCEND_EPLB_VERIFY`` and ``ASCEND_EPLB_METRICS`` read their values through :func:`env_flag`, so
both accept the same words and refuse the same typos.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["FALSE", "TRUE", "env_flag"]

#: Values that switch a guardrail on (compared after ``strip().lower()``).
TRUE = ("1", "true", "yes", "on")
#: Values that leave it off; unset is off too.
FALSE = ("", "0", "false", "no", "off")


def env_flag(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the environment variable ``name`` switches its guardrail on.

    Args:
        name: the variable.
        environ: the environment to read (default ``os.environ``).

    Returns:
        True for ``1``/``true``/``yes``/``on`` (any case, surrounding blanks ignored); False when unset
        or ``0``/``false``/``no``/``off``/empty.

    Raises:
        ValueError: any other value (a typo must not silently leave a guardrail off); the message
            names the variable, the value and the accepted words.
    """
    env = os.environ if environ is None else environ
    value = env.get(name, "").strip().lower()
    if value not in TRUE + FALSE:
        raise ValueError(f"{name}={env.get(name)!r}: must be one of 1, true, yes, on, 0, false, no, off")
    return value in TRUE
