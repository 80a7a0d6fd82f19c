"""argparse value types shared by the ``ascend-eplb`` subcommands (standard library only, so the parser
builds before anything heavy is imported). Each raises ``argparse.ArgumentTypeError`` naming the value
and the rule (argparse turns it into exit status 2)."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["int_list", "non_negative_int", "path", "path_text", "positive_float", "positive_int"]


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


def int_list(value: str) -> list[int]:
    """Comma-separated integers (each checked by the command's own rules, so that one bad level is
    reported beside the valid ones)."""
    try:
        out = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r}: must be comma-separated integers, e.g. 0,8,16"
        ) from None
    if not out:
        raise argparse.ArgumentTypeError(f"{value!r}: must list at least one integer")
    return out


def path_text(value: str) -> str:
    """A file or folder path as given (a str), refused when empty or blank: ``Path("")`` is the current
    folder, so ``--out=`` wrote into (and cleared the outputs of) wherever the command ran."""
    if not value.strip():
        raise argparse.ArgumentTypeError(f"{value!r}: an empty path; name the file or folder")
    return value


def path(value: str) -> Path:
    """:func:`path_text` as a ``Path``."""
    return Path(path_text(value))
