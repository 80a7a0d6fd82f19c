"""Which placement policy upstream's EPLB runs, and when the gain gate skips a rearrangement.

Standard library only, so start-up validation and ``ascend-eplb check`` judge these settings without
importing torch or vLLM; :mod:`ascend_eplb.control.gate` runs them.

Four Ascend keys of ``additional_config.eplb_config`` (validated by integration's rules, one rule id
each) make one :class:`PolicySettings`:

* ``policy``: ``"default"`` (upstream vLLM's ``DefaultEplbPolicy``, the default) or
  ``"migration_aware"`` (:class:`ascend_eplb.control.policy.MigrationAwarePolicy`, which starts from the
  placement in force and moves the fewest experts). Upstream's own ``eplb_config.policy`` stays
  ``"default"`` (its asynchronous mode requires it); the Ascend state selects the policy.
* ``min_balancedness_gain``: a float in ``[0, 1)``, default ``0.0`` (off). A rearrangement whose planned
  placement improves the balancedness of its window by less than this is skipped (reason
  ``"min_gain"``).
* ``target_balancedness``: a float in ``(0, 1]`` or None, default None (off). A rearrangement whose
  window is already at least this balanced under the committed placement is skipped before the policy
  runs (reason ``"balanced"``); ``1.0`` skips only a perfectly balanced window.
* ``load_estimate``: the load the policy plans on and the gate judges: ``"window"`` (the closed window,
  upstream's behaviour, the default) or ``"pooled"`` (:class:`ascend_eplb.control.estimate.
  LoadEstimate`: per layer, every window since the last shift the data shows).

Balancedness (``notes/placement-cost.md``; :func:`ascend_eplb.control.policy.balancedness`): per MoE
layer, mean rank load / max rank load, each logical expert's load split evenly over its replicas; a
layer without load counts 1.0; averaged over the layers. It lies in ``(0, 1]``, so a gain lies in
``(-1, 1)``: a ``min_balancedness_gain`` of 1 or more would skip every rearrangement and is refused.

The third skip reason, ``"no_load"``, needs no setting: a window in which no EP rank recorded load is
never handed to the policy (``AscendEplbState.rearrange``).

With ``policy="default"``, both gate keys off and ``load_estimate="window"``
(:attr:`PolicySettings.is_upstream_default`), nothing of this runs: upstream's ``EplbState.policy``
stays upstream's ``DefaultEplbPolicy`` itself.
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

PolicyName = Literal["default", "migration_aware"]
"""The placement policies the Ascend state can select."""
POLICY_NAMES: tuple[str, ...] = get_args(PolicyName)
"""``("default", "migration_aware")``; ``ascend_eplb.control.gate.POLICIES`` maps each to its class
(checked equal at import)."""

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

    The figures are means over the layers of a global logical load ``(L, E)`` (equal on every EP rank,
    so every rank decides alike): the load the policy planned on and the gate judged (``load_estimate``:
    the window itself, or the estimate of the load to come), and the closed window upstream handed over.

    Attributes:
        policy: the policy name (:data:`POLICY_NAMES`).
        skipped: None (the placement the policy planned is returned and moved), or a reason of
            :data:`SKIP_REASONS` (the committed placement is returned unchanged: no expert moves).
        balancedness_before: of the planned-on load under the committed placement (None for
            ``"no_load"``).
        balancedness_planned: of the planned-on load under the policy's placement (None when the policy
            did not run: ``"balanced"``, ``"no_load"``); minus ``balancedness_before``, the expected gain
            the gate judges.
        experts_moved: experts the returned placement moves (``moved_experts`` summed over layers; 0
            when skipped; None when no placement was in force to move from).
        load_estimate: the load planned on (:data:`LOAD_ESTIMATES`).
        window_balancedness_before, window_balancedness_planned: the same two figures on the closed
            window (equal to the first two under ``"window"``; None where those are).
    """

    policy: str
    skipped: str | None
    balancedness_before: float | None
    balancedness_planned: float | None
    experts_moved: int | None
    load_estimate: str = "window"
    window_balancedness_before: float | None = None
    window_balancedness_planned: float | None = None
