"""Which placement policy upstream's EPLB runs, and when the gain gate skips a rearrangement.

Standard library only, so start-up validation and ``ascend-eplb check`` judge these settings without
torch or vLLM; :mod:`ascend_eplb.control.gate` runs them. Four keys of ``eplb_config`` make one
:class:`PolicySettings`: ``policy`` (``"default"``, upstream's ``DefaultEplbPolicy``,
``"migration_aware"``, or ``"split_aware"``, the migration-aware policy placing for the batch split;
upstream's own ``eplb_config.policy`` stays ``"default"``, as its asynchronous mode requires),
``min_balancedness_gain`` in ``[0, 1)`` (skip reason ``"min_gain"``; a gain lies in ``(-1, 1)``, so 1 or
more would skip everything), ``target_balancedness`` in ``(0, 1]`` or None (skip
reason ``"balanced"``; 1.0 skips only an even window) and ``load_estimate`` (``"window"``, upstream's,
or ``"pooled"``). The third reason, ``"no_load"``, needs no setting. With every key at its default
(:attr:`PolicySettings.is_upstream_default`) upstream's ``DefaultEplbPolicy`` runs itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

from ascend_eplb.control.values import is_int

__all__ = [
    "LOAD_ESTIMATES",
    "POLICY_NAMES",
    "SKIP_REASONS",
    "LoadEstimateName",
    "PlacementDecision",
    "PolicyName",
    "PolicySettings",
    "SkipReason",
    "load_estimate_error",
    "min_balancedness_gain_error",
    "policy_error",
    "target_balancedness_error",
]

PolicyName = Literal["default", "migration_aware", "split_aware"]
"""The placement policies the Ascend state can select."""
POLICY_NAMES: tuple[str, ...] = get_args(PolicyName)
"""``("default", "migration_aware", "split_aware")``; ``ascend_eplb.control.gate.POLICIES`` maps each to
its class (checked equal at import)."""

LoadEstimateName = Literal["window", "pooled"]
"""The loads a policy may plan on: the closed window (upstream's) or the pooled estimate."""
LOAD_ESTIMATES: tuple[str, ...] = get_args(LoadEstimateName)
"""``("window", "pooled")``."""

SkipReason = Literal["balanced", "min_gain", "no_load"]
"""Why a closed window did not change the placement: already balanced enough (``target_balancedness``),
the planned placement gains too little (``min_balancedness_gain``), or no EP rank recorded load."""
SKIP_REASONS: tuple[str, ...] = get_args(SkipReason)
"""``("balanced", "min_gain", "no_load")``."""


def _number(value: object) -> bool:
    return is_int(value) or (isinstance(value, float) and math.isfinite(value))


def _quoted(value: object) -> str:
    """What to add when ``value`` is a number written as a string (``"0.01"``, or YAML 1.1's ``1e-2``,
    which PyYAML and so vLLM's ``--config`` read as a string): the rule alone read as if 0.01 were out of
    range."""
    if not isinstance(value, str):
        return ""
    try:
        float(value)
    except ValueError:
        return ""
    return (
        f"; {value!r} is a string, not a number: write it unquoted (YAML 1.1 reads an exponent without "
        "a dot, 1e-2, as a string: write 0.01 or 1.0e-2)"
    )


def policy_error(value: object) -> str | None:
    """Why ``value`` is not a ``policy`` key value (None: it is one of :data:`POLICY_NAMES`)."""
    if isinstance(value, str) and value in POLICY_NAMES:
        return None
    return f"additional_config.eplb_config.policy={value!r} is not one of {list(POLICY_NAMES)}"


def load_estimate_error(value: object) -> str | None:
    """Why ``value`` is not a ``load_estimate`` key value (None: it is one of :data:`LOAD_ESTIMATES`)."""
    if isinstance(value, str) and value in LOAD_ESTIMATES:
        return None
    return f"additional_config.eplb_config.load_estimate={value!r} is not one of {list(LOAD_ESTIMATES)}"


def min_balancedness_gain_error(value: object) -> str | None:
    """Why ``value`` is not a ``min_balancedness_gain`` (None: a finite number in ``[0, 1)``)."""
    if _number(value) and 0 <= value < 1:  # type: ignore[operator]
        return None
    return (
        f"additional_config.eplb_config.min_balancedness_gain={value!r} must be a number in [0, 1) "
        f"(a gain of balancedness, which lies in (0, 1]; 0 turns the check off){_quoted(value)}"
    )


def target_balancedness_error(value: object) -> str | None:
    """Why ``value`` is not a ``target_balancedness`` (None: None, or a finite number in ``(0, 1]``)."""
    if value is None or (_number(value) and 0 < value <= 1):  # type: ignore[operator]
        return None
    return (
        f"additional_config.eplb_config.target_balancedness={value!r} must be a number in (0, 1] "
        f"(a balancedness; leave it unset to turn the check off){_quoted(value)}"
    )


@dataclass(frozen=True)
class PolicySettings:
    """The placement policy, the gain gate and the load they work on, of one
    :class:`~ascend_eplb.control.state.AscendEplbState`.

    Attributes:
        policy: a name of :data:`POLICY_NAMES`.
        min_balancedness_gain: skip when the planned gain is below this; 0.0 is off.
        target_balancedness: skip when the committed placement is at least this balanced; None is off.
        load_estimate: a name of :data:`LOAD_ESTIMATES`: what the policy plans on and the gate judges.

    Raises:
        ValueError: every invalid field at once, each message naming the value and the rule (nothing is
            built).
    """

    policy: str = "default"
    min_balancedness_gain: float = 0.0
    target_balancedness: float | None = None
    load_estimate: str = "window"

    def __post_init__(self) -> None:
        errors = [
            e
            for e in (
                policy_error(self.policy),
                min_balancedness_gain_error(self.min_balancedness_gain),
                target_balancedness_error(self.target_balancedness),
                load_estimate_error(self.load_estimate),
            )
            if e is not None
        ]
        if errors:
            raise ValueError("; ".join(errors))

    @classmethod
    def of(cls, value: object) -> PolicySettings:
        """``value`` itself, or the defaults (upstream's policy, gate off) for None.

        Raises:
            TypeError: ``value`` is neither a :class:`PolicySettings` nor None (naming it).
        """
        if value is None:
            return cls()
        if not isinstance(value, cls):
            raise TypeError(
                f"policy_settings={value!r} must be an ascend_eplb.control.policy_config.PolicySettings "
                "or None"
            )
        return value

    @property
    def gate_on(self) -> bool:
        """Whether either gate check is on."""
        return self.min_balancedness_gain > 0 or self.target_balancedness is not None

    @property
    def estimating(self) -> bool:
        """Whether the policy plans on a load estimate rather than the closed window."""
        return self.load_estimate != "window"

    @property
    def is_upstream_default(self) -> bool:
        """``policy="default"`` with the gate off, on the window: upstream's policy object runs, nothing
        is wrapped."""
        return self.policy == "default" and not self.gate_on and not self.estimating

    def describe(self) -> str:
        """``policy=NAME, gate off`` or ``policy=NAME, gate min_balancedness_gain=X target_balancedness=Y``,
        then ``, load_estimate=NAME`` unless it is the window (the serving log's wording)."""
        estimate = f", load_estimate={self.load_estimate}" if self.estimating else ""
        if not self.gate_on:
            return f"policy={self.policy}, gate off{estimate}"
        target = "off" if self.target_balancedness is None else f"{self.target_balancedness:g}"
        return (
            f"policy={self.policy}, gate min_balancedness_gain={self.min_balancedness_gain:g} "
            f"target_balancedness={target}{estimate}"
        )


@dataclass(frozen=True)
class PlacementDecision:
    """What the policy (and the gate around it) decided for one model's closed window.

    Figures are means over the layers of a global load ``(L, E)``: first on the load planned on
    (``load_estimate``: the window or the estimate), then, ``window_``, on the closed window.

    Attributes:
        policy: a name of :data:`POLICY_NAMES`.
        skipped: None (the policy's placement is moved) or a reason of :data:`SKIP_REASONS` (none moves).
        balancedness_before: the committed placement's (None for ``"no_load"``).
        balancedness_planned: the policy's placement's (None when it did not run); the gain the gate
            judges is this minus ``balancedness_before``.
        experts_moved: ``moved_experts`` summed over layers (0 when skipped; None with no placement in force).
        load_estimate: a name of :data:`LOAD_ESTIMATES`.
        window_balancedness_before, window_balancedness_planned: the same on the closed window.
    """

    policy: str
    skipped: str | None
    balancedness_before: float | None
    balancedness_planned: float | None
    experts_moved: int | None
    load_estimate: str = "window"
    window_balancedness_before: float | None = None
    window_balancedness_planned: float | None = None
