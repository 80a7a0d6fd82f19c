"""argparse value types shared by the ``ascend-eplb`` subcommands (the standard library and control's
``policy_config`` only, no torch: control's ``test_public_api.py`` holds it; so the parser builds before
anything heavy is imported). Each raises ``argparse.ArgumentTypeError`` naming the value
and the rule (argparse turns it into exit status 2)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ascend_eplb.control.policy_config import (
    load_estimate_error,
    min_balancedness_gain_error,
    policy_error,
    target_balancedness_error,
)

__all__ = [
    "MAX_INPUT_MIB_HELP",
    "file_path",
    "int_list",
    "load_estimate_list",
    "load_estimate_name",
    "min_balancedness_gain",
    "non_negative_int",
    "path",
    "path_text",
    "policy_list",
    "policy_name",
    "positive_float",
    "positive_int",
    "target_balancedness",
]


#: ``--max-input-mib``'s help (``plan``, ``check``, ``simulate``).
MAX_INPUT_MIB_HELP = (
    "read input files of up to N MiB (default: each kind's own cap: config files 16, placement files 64, "
    "events files and load matrices 256, routing traces 1024; a soak's events file may need more); sets "
    "ASCEND_EPLB_MAX_INPUT_MIB for the processes the command starts"
)


def _int_at_least(minimum: int, value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: must be an integer >= {minimum}") from None
    if n < minimum:
        raise argparse.ArgumentTypeError(f"{n}: must be >= {minimum}")
    return n


def positive_int(value: str) -> int:
    """An integer >= 1."""
    return _int_at_least(1, value)


def non_negative_int(value: str) -> int:
    """An integer >= 0."""
    return _int_at_least(0, value)


def positive_float(value: str) -> float:
    """A finite number > 0."""
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: must be a number > 0") from None
    if not 0 < x < float("inf"):
        raise argparse.ArgumentTypeError(f"{value!r}: must be a finite number > 0")
    return x


def _entries(value: str, example: str) -> list[str]:
    """The comma-separated entries of ``value``, stripped; an empty one (``,default``, ``0,,8``, a
    trailing comma) is refused naming its position, not dropped: a list the operator did not write; so
    is an entry given twice (``2,2,2`` printed its row three times)."""
    entries = [v.strip() for v in value.split(",")]
    if not any(entries):
        raise argparse.ArgumentTypeError(f"{value!r}: lists nothing; give e.g. {example}")
    empty = [str(i + 1) for i, v in enumerate(entries) if not v]
    if empty:
        which = f"entry {empty[0]} of {len(entries)} is" if len(empty) == 1 else (
            f"entries {', '.join(empty[:-1])} and {empty[-1]} of {len(entries)} are"
        )  # fmt: skip
        raise argparse.ArgumentTypeError(f"{value!r}: {which} empty (a stray comma); give e.g. {example}")
    return _once(value, entries, entries)


def _once(value: str, entries: list[str], keys: list) -> list[str]:
    """``entries`` when each of ``keys`` (their values) is given once; else refused naming the first
    repeated one and how often it is given."""
    repeated = next((e for e, k in zip(entries, keys, strict=True) if keys.count(k) > 1), None)
    if repeated is not None:
        times = keys.count(keys[entries.index(repeated)])
        raise argparse.ArgumentTypeError(f"{value!r}: lists {repeated} {times} times; give each once")
    return entries


def int_list(value: str) -> list[int]:
    """Comma-separated integers (each checked by the command's own rules, so that one bad level is
    reported beside the valid ones); an empty entry is refused (:func:`_entries`)."""
    entries = [v.strip() for v in value.split(",")]
    try:
        numbers = [int(v) for v in entries]
    except ValueError:
        _entries(value, "0,8,16")  # an empty entry is named as such
        raise argparse.ArgumentTypeError(
            f"{value!r}: must be comma-separated integers, e.g. 0,8,16"
        ) from None
    _once(value, entries, numbers)  # 8,08 is 8 twice
    return numbers


def path_text(value: str) -> str:
    """A file or folder path as given (a str), refused when empty or blank: ``Path("")`` is the current
    folder, so ``--out=`` wrote into (and cleared the outputs of) wherever the command ran."""
    if not value.strip():
        raise argparse.ArgumentTypeError(f"{value!r}: an empty path; name the file or folder")
    return value


def path(value: str) -> Path:
    """:func:`path_text` as a ``Path``."""
    return Path(path_text(value))


def file_path(value: str) -> Path:
    """:func:`path` of a file to write, refused when it ends with a path separator: ``Path`` drops the
    trailing ``/``, so ``--export-expert-map out/`` wrote a file called ``out`` where a folder was meant."""
    if path_text(value).endswith(("/", os.sep)):
        raise argparse.ArgumentTypeError(f"{value!r}: ends with '/', a folder; name the file to write")
    return Path(value)


# The placement policy and the gain gate: judged by start-up's own rules, the functions of
# ascend_eplb.control.policy_config that integration's rules call.


def policy_name(value: str) -> str:
    """A placement policy name (``additional_config.eplb_config.policy``: ``default``,
    ``migration_aware``)."""
    if (reason := policy_error(value)) is not None:
        raise argparse.ArgumentTypeError(f"{value!r}: {reason}")
    return value


def policy_list(value: str) -> list[str]:
    """Comma-separated placement policy names (each :func:`policy_name`), at least one; an empty entry is
    refused (:func:`_entries`)."""
    return [policy_name(v) for v in _entries(value, "default,migration_aware")]


def load_estimate_name(value: str) -> str:
    """A load estimate name (``additional_config.eplb_config.load_estimate``: ``window``, ``pooled``)."""
    if (reason := load_estimate_error(value)) is not None:
        raise argparse.ArgumentTypeError(f"{value!r}: {reason}")
    return value


def load_estimate_list(value: str) -> list[str]:
    """Comma-separated load estimate names (each :func:`load_estimate_name`), at least one; an empty entry
    is refused (:func:`_entries`)."""
    return [load_estimate_name(v) for v in _entries(value, "window,pooled")]


def number(value: str) -> float:
    """Any float (range rules are the option's own, judged with the others)."""
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: must be a number") from None


def min_balancedness_gain(value: str) -> float:
    """``additional_config.eplb_config.min_balancedness_gain``: a number in ``[0, 1)``."""
    x = number(value)
    if (reason := min_balancedness_gain_error(x)) is not None:
        raise argparse.ArgumentTypeError(f"{value!r}: {reason}")
    return x


def target_balancedness(value: str) -> float:
    """``additional_config.eplb_config.target_balancedness``: a number in ``(0, 1]``."""
    x = number(value)
    if (reason := target_balancedness_error(x)) is not None:
        raise argparse.ArgumentTypeError(f"{value!r}: {reason}")
    return x
