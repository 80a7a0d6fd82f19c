"""What ``ascend-eplb check`` prints: :class:`CheckResult` and its report (the resolved settings, or every
violated rule; then one ``cannot judge`` line per unjudged rule)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ascend_eplb.integration.model_facts import shown
from ascend_eplb.integration.rules import Violation, split_line
from ascend_eplb.integration.settings import EplbSettings
from ascend_eplb.integration.validation import EplbConfigError

__all__ = ["CheckResult", "refused", "result", "short"]


@dataclass(frozen=True)
class CheckResult:
    """Outcome of :func:`check_config_file` / :func:`check_serve_command`: ``ok`` (no violation) and the
    text to print (resolved settings or rules); ``unjudged`` lists the rules that could not be judged."""

    ok: bool
    report: str
    violations: tuple[Violation, ...] = ()
    resolved: dict[str, Any] | None = None
    unjudged: tuple[Violation, ...] = ()

    def __iter__(self):
        """Unpack as ``ok, report = check_config_file(path)``."""
        return iter((self.ok, self.report))

    @property
    def exit_code(self) -> int:
        """0 when no rule is violated (some may be unjudged), 2 otherwise (``ascend-eplb check``'s)."""
        return 0 if self.ok else 2

    @property
    def verdict(self) -> str:
        """``OK``, ``OK (N rule(s) could not be judged)`` or ``INVALID``."""
        if not self.ok:
            return "INVALID"
        n = len(self.unjudged)
        if not n:
            return "OK"
        return f"OK ({n} rule{'' if n == 1 else 's'} could not be judged)"


def _resolved(s: EplbSettings) -> dict[str, Any]:
    d = asdict(s)
    d["communicator"] = s.communicator or "torch_gloo"
    d["load_collection_phase"] = s.load_collection_phase
    # The Ascend keys of the placement policy and the gain gate (upstream's own `policy` is beside them).
    d["placement_policy"] = s.placement_policy
    d["min_balancedness_gain"] = s.min_balancedness_gain
    d["target_balancedness"] = s.target_balancedness
    # The batch split in force on the configuration's rows, and what it costs (rule replica-split).
    d["replica_split"] = split_line(s)
    d["num_ranks"] = s.num_ranks
    if s.num_logical_experts is not None:
        d["num_physical_experts"] = s.num_logical_experts + s.num_redundant_experts
        d["num_local_physical_experts"] = d["num_physical_experts"] // s.num_ranks
    for k in (
        "ascend_eplb_config",
        "legacy_top_level_keys",
        "environment",
        "unknown_facts",
        "moe_facts",
        "inductor_compile_config",
    ):
        d.pop(k)
    return d


def result(settings: EplbSettings | None, violations: list[Violation]) -> CheckResult:
    """The outcome of judging ``settings``: ``violations`` (with their ``.unjudged``, if any) or OK."""
    unjudged = tuple(getattr(violations, "unjudged", ()))
    tail = [str(u) for u in unjudged]
    if violations:
        text = "\n".join([str(EplbConfigError(violations)), *tail])
        return CheckResult(False, text, tuple(violations), None, unjudged)
    assert settings is not None
    resolved = _resolved(settings)
    lines = ["ok"] + [f"  {k}: {resolved[k]}" for k in sorted(resolved)] + tail
    return CheckResult(True, "\n".join(lines), (), resolved, unjudged)


def refused(rule: str, message: str) -> CheckResult:
    """The outcome of an input refused before any rule ran: one ``rule`` violation (``schema``, ...)."""
    v = Violation(rule, message)
    return CheckResult(False, str(EplbConfigError([v])), (v,))


#: ``repr(value)``, shortened for the message when it is very long (a 400-digit integer): the rules' own.
short = shown
