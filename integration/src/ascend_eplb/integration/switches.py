"""The one truthy parsing of an environment switch (standard library only).

Every module that reads a switch uses it: the ``vllm.general_plugins`` entry point
(:mod:`~ascend_eplb.integration.plugin`, which must import nothing but the standard library and this
module while EPLB is off), start-up validation's V1 switches and the tools. It sits below all of them,
so none imports another for it.
"""

from __future__ import annotations

__all__ = ["TRUE_VALUES", "is_true"]

#: The values that switch an environment variable (or a ``--flag=value``) on, compared lower-cased
#: without surrounding spaces.
TRUE_VALUES = ("1", "true", "yes", "on")


def is_true(value: str | None) -> bool:
    """Whether ``value`` (an environment variable's value, None when unset) is one of :data:`TRUE_VALUES`,
    ignoring case and surrounding spaces; anything else, None included, is False."""
    return value is not None and value.strip().lower() in TRUE_VALUES
