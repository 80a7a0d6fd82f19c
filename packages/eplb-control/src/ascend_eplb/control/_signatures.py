"""Signature checks of the upstream vLLM 0.33.0 callables this package overrides or hooks.

Every subclass override and every wrapped module function of :mod:`ascend_eplb.control` relies on the
parameters upstream had in vLLM 0.33.0. A drifted upstream fails loudly, naming the callable, instead of
silently calling it with the wrong arguments.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["check_signature", "parameter_names"]


def parameter_names(fn: Callable[..., Any]) -> tuple[str, ...]:
    """Parameter names of ``fn`` in order (``self`` included for functions taken from a class)."""
    return tuple(inspect.signature(fn).parameters)


def check_signature(fn: Callable[..., Any], name: str, expected: Sequence[str]) -> None:
    """Raise unless ``fn``'s parameters are exactly ``expected``, in order.

    Args:
        fn: the upstream callable as it is installed now (unwrapped through ``__wrapped__`` first, so an
            already installed wrapper of ours is checked against the function it wraps).
        name: the qualified name used in the error, e.g. ``"EplbState.rearrange"``.
        expected: the parameter names it had in vLLM 0.33.0.

    Raises:
        RuntimeError: the parameters differ or the signature cannot be read; the message names the
            callable and both parameter lists.
    """
    target = inspect.unwrap(fn)
    try:
        actual = parameter_names(target)
    except (TypeError, ValueError) as exc:
        raise RuntimeError(f"cannot read the signature of upstream {name}: {exc}") from exc
    if actual != tuple(expected):
        raise RuntimeError(
            f"upstream {name} changed signature: expected parameters {tuple(expected)} (vLLM 0.33.0), "
            f"found {actual}; ascend_eplb.control must be updated for this vLLM version"
        )
