"""The one parsing of an environment switch (standard library only).

Every module that reads a switch uses it: the ``vllm.general_plugins`` entry point
(:mod:`~ascend_eplb.integration.plugin`, which must import nothing but the standard library and this
module while EPLB is off), start-up validation's V1 switches, the serving guardrails
(``ASCEND_EPLB_VERIFY``, ``ASCEND_EPLB_METRICS``: :func:`env_flag`, which refuses a typo) and the tools.
It sits below all of them, so none imports another for it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["FALSE_VALUES", "PLUGIN_SWITCH", "TRUE_VALUES", "env_flag", "is_true"]

#: The switch that turns the integration on in every vLLM process (``plugin.ENV_SWITCH``, tested equal;
#: here too so that the serving start-up, which the plugin's patches import, reads it without a cycle).
PLUGIN_SWITCH = "ASCEND_EPLB"

#: The values that switch an environment variable (or a ``--flag=value``) on, compared lower-cased
#: without surrounding spaces.
TRUE_VALUES = ("1", "true", "yes", "on")
#: The values that leave a guardrail off (:func:`env_flag`); unset is off too.
FALSE_VALUES = ("", "0", "false", "no", "off")


def is_true(value: str | None) -> bool:
    """Whether ``value`` (an environment variable's value, None when unset) is one of :data:`TRUE_VALUES`,
    ignoring case and surrounding spaces; anything else, None included, is False."""
    return value is not None and value.strip().lower() in TRUE_VALUES


def env_flag(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the environment variable ``name`` switches its guardrail on.

    Args:
        name: the variable.
        environ: the environment to read (default ``os.environ``).

    Returns:
        True for :data:`TRUE_VALUES` (any case, surrounding blanks ignored); False when unset or one of
        :data:`FALSE_VALUES`.

    Raises:
        ValueError: any other value (a typo must not silently leave a guardrail off); the message
            names the variable, the value and the accepted words.
    """
    env = os.environ if environ is None else environ
    value = env.get(name, "").strip().lower()
    if value not in TRUE_VALUES + FALSE_VALUES:
        raise ValueError(f"{name}={env.get(name)!r}: must be one of 1, true, yes, on, 0, false, no, off")
    return is_true(value)
