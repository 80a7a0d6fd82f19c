"""The serving guardrails' facts that processes without vLLM read: their switches, their checks' names, the
watchdog's shutdown report.

Standard library, :mod:`.switches` and :mod:`.regular_files` only (prometheus_client inside
:func:`metrics_requested`, for a serving process), so that ``ascend-eplb check`` (judging another process's
environment, without torch or vLLM), the simulator's options and report (before vLLM) and start-up
(:func:`read_serving_switches`, which ``serving.read_serving_setup`` runs) read one definition: each
``ASCEND_EPLB_*`` guardrail switch's name and reader (the verifier's, the events file's, the watchdog's two,
the metrics'), the names of the verifier's and the watchdog's checks, and :class:`InFlightAtShutdown`. The
guardrails themselves (``verify``, ``watchdog``, ``events.recorder``, ``prometheus``) import vLLM.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ascend_eplb.integration.regular_files import max_input_mib, regular_file_problem
from ascend_eplb.integration.switches import PLUGIN_SWITCH, env_flag

__all__ = [
    "DEFAULT_WORKER_TIMEOUT_S",
    "ENV_EVENTS",
    "ENV_METRICS",
    "ENV_MULTIPROC_DIR",
    "ENV_ON_WORKER_FAILURE",
    "ENV_VERIFY",
    "ENV_WORKER_TIMEOUT",
    "ON_FAILURE_POLICIES",
    "VERIFIER_CHECKS",
    "WATCHDOG_CHECK",
    "InFlightAtShutdown",
    "events_path",
    "metrics_requested",
    "read_serving_switches",
    "serving_switch_errors",
    "verify_requested",
    "watchdog_settings",
]

#: The environment switch of the verifier.
ENV_VERIFY = "ASCEND_EPLB_VERIFY"
#: What the verifier checks, by name (used in errors, the metrics' ``check`` label and the simulator's
#: report).
VERIFIER_CHECKS = ("fingerprints", "lookups")
#: The environment switch of the events file (its path).
ENV_EVENTS = "ASCEND_EPLB_EVENTS"
#: The name of the watchdog's check (in errors, logs and the simulator's report).
WATCHDOG_CHECK = "worker"
#: The watchdog's stall limit: seconds a started cycle may go without progress before its worker is
#: declared stalled.
ENV_WORKER_TIMEOUT = "ASCEND_EPLB_WORKER_TIMEOUT_S"
#: What the watchdog does on a failure: one of :data:`ON_FAILURE_POLICIES`.
ENV_ON_WORKER_FAILURE = "ASCEND_EPLB_ON_WORKER_FAILURE"
#: The watchdog's stall limit when :data:`ENV_WORKER_TIMEOUT` is unset (seconds).
DEFAULT_WORKER_TIMEOUT_S = 600.0
#: The values of :data:`ENV_ON_WORKER_FAILURE`: stop rearranging and serve on, or raise.
ON_FAILURE_POLICIES = ("stop", "raise")
#: The environment switch of the metrics.
ENV_METRICS = "ASCEND_EPLB_METRICS"
#: prometheus_client's multiprocess folder (read by vLLM's API server).
ENV_MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"


def verify_requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``ASCEND_EPLB_VERIFY`` asks for the verifier (``1``/``true``/``yes``/``on``; unset or
    ``0``/``false``/``no``/``off``: no; :func:`ascend_eplb.integration.switches.env_flag`).

    Raises:
        ValueError: any other value (a typo must not silently leave the verifier off).
    """
    return env_flag(ENV_VERIFY, environ)


def events_path(environ: Mapping[str, str] | None = None) -> str | None:
    """The path ``ASCEND_EPLB_EVENTS`` names (a leading ``~`` expanded), or None (unset or empty).

    Checked on every rank at start-up, though only EP rank 0 writes: a path that is a folder, a FIFO or
    another non-regular file, or where no file can be created or appended to, is refused everywhere
    alike. Whether it can be is judged by doing it (:func:`_creatable`): permission bits say nothing of
    ``/proc`` or ``/sys``, where root may "write" but nothing can be created.

    Raises:
        ValueError: the path cannot be appended to (the message names it and why).
    """
    env = os.environ if environ is None else environ
    raw = env.get(ENV_EVENTS, "").strip()
    if not raw:
        return None
    # `~` is a shell's: a value set where no shell expands it (a container's environment, a unit file)
    # made a folder called `~` wherever vLLM ran. Expanded here, as vLLM expands its own paths.
    raw = os.path.expanduser(raw)
    path = Path(raw)
    if path.is_dir() or raw.endswith(("/", os.sep)):  # Path("out/") is "out": a file where a folder was meant
        raise ValueError(f"{ENV_EVENTS}={raw}: is a folder; name the events file (e.g. events.jsonl)")
    problem = regular_file_problem(path, missing_ok=True, verb="append to")
    if problem is not None:
        raise ValueError(f"{ENV_EVENTS}={raw}: {problem.problem}; name an events file (e.g. events.jsonl)")
    if (why := _creatable(path)) is not None:
        raise ValueError(f"{ENV_EVENTS}={raw}: {why}; name an events file in a writable folder")
    return raw


def _creatable(path: Path) -> str | None:
    """Why the events file ``path`` cannot be appended to, or None. An existing file is opened for
    appending (nothing written); a missing one is judged by creating and removing a file beside it (a
    folder, in the nearest folder that exists, when its own is still to be made)."""
    if path.exists():
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK | os.O_NOCTTY))
        except OSError as e:
            return f"the file cannot be appended to ({e.strerror or e})"
        return None
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        return f"{folder} is a file, not a folder"
    try:
        if folder == path.parent:
            fd, probe = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".probe")
            os.close(fd)
            os.unlink(probe)
        else:
            os.rmdir(tempfile.mkdtemp(dir=folder, prefix=".ascend-eplb-probe-"))
    except OSError as e:
        return f"nothing can be created in {folder} ({e.strerror or e})"
    return None


def watchdog_settings(environ: Mapping[str, str] | None = None) -> tuple[float, str]:
    """``(timeout_s, on_failure)`` from ``ASCEND_EPLB_WORKER_TIMEOUT_S`` and
    ``ASCEND_EPLB_ON_WORKER_FAILURE``.

    Raises:
        ValueError: the timeout is not a finite number > 0, or the policy is not ``stop``/``raise``
            (the message names the variable and the value).
    """
    env = os.environ if environ is None else environ
    raw = env.get(ENV_WORKER_TIMEOUT, "").strip()
    timeout = DEFAULT_WORKER_TIMEOUT_S
    if raw:
        try:
            timeout = float(raw)
        except ValueError:
            timeout = math.nan
        if not (timeout > 0 and math.isfinite(timeout)):
            raise ValueError(f"{ENV_WORKER_TIMEOUT}={raw!r}: must be a finite number of seconds > 0")
    policy = env.get(ENV_ON_WORKER_FAILURE, "").strip().lower() or "stop"
    if policy not in ON_FAILURE_POLICIES:
        raise ValueError(
            f"{ENV_ON_WORKER_FAILURE}={env.get(ENV_ON_WORKER_FAILURE)!r}: must be one of "
            f"{', '.join(ON_FAILURE_POLICIES)}"
        )
    return timeout, policy


def metrics_requested(environ: Mapping[str, str] | None = None, *, serving_process: bool = True) -> bool:
    """Whether ``ASCEND_EPLB_METRICS`` asks for the metrics, checked for what they need.

    ``serving_process=False`` (``ascend-eplb check``, judging another process's environment) checks the
    switch and the folder only, not this process's prometheus_client import.

    Raises:
        ValueError: the switch is not one of the accepted words; or it is on and ``PROMETHEUS_MULTIPROC_DIR``
            is unset, missing, not a folder or not writable, or was set after this process imported
            prometheus_client (its values would never reach the API server). Names the variable and rule.
    """
    env = os.environ if environ is None else environ
    if not env_flag(ENV_METRICS, env):
        return False
    folder = env.get(ENV_MULTIPROC_DIR, "").strip()
    if not folder:
        raise ValueError(
            f"{ENV_METRICS}={env.get(ENV_METRICS)}: needs {ENV_MULTIPROC_DIR}, the folder where every vLLM "
            "process writes its metrics and vLLM's API server reads them (set it in the environment vLLM "
            "starts with)"
        )
    if not os.path.exists(folder):
        raise ValueError(
            f"{ENV_MULTIPROC_DIR}={folder}: no such folder ({ENV_METRICS} is on); create it, empty, before "
            "vLLM starts"
        )
    if not os.path.isdir(folder):
        raise ValueError(f"{ENV_MULTIPROC_DIR}={folder}: not a folder ({ENV_METRICS} is on)")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{ENV_MULTIPROC_DIR}={folder}: the folder is not writable ({ENV_METRICS} is on)")
    if not serving_process:
        return True
    # local: prometheus_client picks its value class when imported, so only when asked for
    from prometheus_client import values

    if values.ValueClass is values.MutexValue:
        raise ValueError(
            f"{ENV_MULTIPROC_DIR}={folder}: this process imported prometheus_client before the variable was "
            f"set, so its metrics would stay in this process ({ENV_METRICS} is on); set it in the "
            "environment vLLM starts with"
        )
    return True


def serving_switch_errors(environ: Mapping[str, str] | None = None) -> list[str]:
    """What ``serving.read_serving_setup`` would refuse in the serving switches of ``environ`` (default
    ``os.environ``): one message per bad switch, naming it and the rule (``ascend-eplb check`` reports
    them). The metrics' check that the serving process had ``PROMETHEUS_MULTIPROC_DIR`` before it imported
    prometheus_client is about that process, so it is not made here."""
    return read_serving_switches(environ, serving_process=False)[1]


def read_serving_switches(
    environ: Mapping[str, str] | None, *, serving_process: bool
) -> tuple[dict[str, Any], list[str]]:
    """Every serving switch of ``environ`` (default ``os.environ``) read by its own reader, in a fixed order;
    each refusal collected (the watchdog's two switches each alone: ``ASCEND_EPLB_WORKER_TIMEOUT_S=-5``
    with ``ASCEND_EPLB_ON_WORKER_FAILURE=explode`` names both). ``serving_process``: as
    :func:`metrics_requested`'s.

    Returns:
        The values read, by reader (``plugin``, ``worker timeout``, ``on worker failure``, ``verify``,
        ``events``, ``metrics``, ``max input``; a refused one absent), and the refusals, one line each.
    """
    env = os.environ if environ is None else environ

    def alone(name: str) -> dict[str, str]:
        return {name: env[name]} if name in env else {}

    def plugin_switch() -> bool:
        # EPLB is on here (through --enable-eplb); a typo of the switch leaves the integration off in a
        # process that reads only it (another node's, one whose --enable-eplb is in a --config YAML).
        try:
            return env_flag(PLUGIN_SWITCH, environ)
        except ValueError as e:
            raise ValueError(
                f"{e} (a process started without --enable-eplb on its command line reads only this switch "
                "and would leave the Ascend integration off)"
            ) from None

    readers = {
        "plugin": plugin_switch,
        "worker timeout": lambda: watchdog_settings(alone(ENV_WORKER_TIMEOUT))[0],
        "on worker failure": lambda: watchdog_settings(alone(ENV_ON_WORKER_FAILURE))[1],
        "verify": lambda: verify_requested(environ),
        "events": lambda: events_path(environ),
        "metrics": lambda: metrics_requested(environ, serving_process=serving_process),
        "max input": lambda: max_input_mib(environ),
    }
    values: dict[str, Any] = {}
    errors: list[str] = []
    for name, read in readers.items():
        try:
            values[name] = read()
        except ValueError as e:
            errors.append(str(e))
    return values, errors


@dataclass(frozen=True)
class InFlightAtShutdown:
    """A rearrangement cycle still in flight on this rank when the runner shut down.

    Attributes:
        model: the model of the cycle.
        rearrangement: upstream's rearrangement count (the cycle's number).
        layer: the MoE layer in flight (the next to commit).
        published: whether this rank's worker had published that layer (waiting to be consumed).
        seconds_without_progress: since the cycle's last progress on this rank (a layer published or
            committed, or its start), seconds of the watchdog's clock.
        steps_without_progress: EPLB steps since then.
        timeout_s: the watchdog's timeout (``ASCEND_EPLB_WORKER_TIMEOUT_S``).
        rank: this rank in the EP group (None when no step was seen).
    """

    model: str
    rearrangement: int
    layer: int
    published: bool
    seconds_without_progress: float
    steps_without_progress: int
    timeout_s: float
    rank: int | None

    def message(self) -> str:
        judged = (
            "below the watchdog's timeout, so it was never judged stalled"
            if self.seconds_without_progress <= self.timeout_s
            else "past the watchdog's timeout"
        )
        layer = f"layer {self.layer} {'published, not yet committed' if self.published else 'not published'}"
        return (
            f"EPLB worker watchdog at shutdown: rank {self.rank if self.rank is not None else '?'}: "
            f"rearrangement {self.rearrangement} of model {self.model} in flight ({layer}), no progress for "
            f"{self.seconds_without_progress:.1f} s ({self.steps_without_progress} steps), {judged} "
            f"({ENV_WORKER_TIMEOUT}={self.timeout_s:g} s); the cycle is dropped with the runner"
        )
