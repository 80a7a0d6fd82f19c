"""Patches of upstream vLLM and torch bindings: one spec type, one applier, one signature checker.

A :class:`Patch` describes the replacement of one binding that upstream does not expose as an
extension point (a module global, a class attribute, a torch function), with the parameters the
original had in vLLM 0.33.0 / torch 2.13.0. The plane that owns the behaviour declares its patches as
specs (``ascend_eplb.control.host_adaptation.PATCHES``, ``ascend_eplb.control.commit_hooks.PATCHES``);
nothing in this package installs them. The integration's ``apply_patches()`` owns the single
:class:`PatchSet` of the process and installs every spec at once.

:func:`check_signature` is the one checker of upstream signatures: patches and the subclass overrides
of :mod:`ascend_eplb.control` (checked when their classes are constructed) both use it.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PATCH_MARKER", "Patch", "PatchSet", "check_signature", "parameter_names", "patch_owner"]

#: Attribute set on every replacement a :class:`PatchSet` installs (its value: the patch's name).
PATCH_MARKER = "_ascend_eplb_patch"


def parameter_names(fn: Callable[..., Any]) -> tuple[str, ...]:
    """Parameter names of ``fn`` in order (``self`` included for functions taken from a class)."""
    return tuple(inspect.signature(fn).parameters)


def check_signature(fn: Callable[..., Any], name: str, expected: Sequence[str]) -> None:
    """Raise unless ``fn``'s parameters are exactly ``expected``, in order.

    Args:
        fn: the upstream callable as it is bound now (unwrapped through ``__wrapped__`` first, so an
            installed wrapper of ours is checked against the function it wraps). A class is checked by
            its ``__init__``.
        name: the qualified name used in the error, e.g. ``"EplbState.rearrange"``.
        expected: the parameter names it had in vLLM 0.33.0.

    Raises:
        RuntimeError: the parameters differ or the signature cannot be read; the message names the
            callable and both parameter lists.
    """
    target = inspect.unwrap(fn)
    if isinstance(target, type):
        target = target.__init__
    try:
        actual = parameter_names(target)
    except (TypeError, ValueError) as exc:
        raise RuntimeError(f"cannot read the signature of upstream {name}: {exc}") from exc
    if actual != tuple(expected):
        raise RuntimeError(
            f"upstream {name} changed signature: expected parameters {tuple(expected)} (vLLM 0.33.0), "
            f"found {actual}; ascend_eplb must be updated for this version"
        )


def patch_owner(value: Any) -> str | None:
    """The owner recorded on ``value`` by the :class:`PatchSet` that installed it, or None.

    Read with ``inspect.getattr_static`` so that objects with a ``__getattr__`` (vLLM's platforms log
    a warning for unknown attributes) are not asked.
    """
    return inspect.getattr_static(value, PATCH_MARKER, None)


def _always() -> bool:
    return True


@dataclass(frozen=True)
class Patch:
    """The replacement of one binding ``module.qualname``.

    Attributes:
        module: import path of the module holding the binding (or the class that holds it).
        qualname: attribute path inside ``module``: ``"current_platform"``, ``"EplbState.__init__"``.
        params: the original's parameter names in the version this project supports, checked with
            :func:`check_signature` before anything is changed; None for a binding that is not a
            function (then ``check`` must validate it).
        replace: ``original -> replacement``; called once at installation.
        owner: the module that owns the behaviour (for logs and errors).
        when: whether the patch applies in this process (e.g. only on a host without an accelerator);
            asked at installation, before the checks.
        check: an extra drift check of the original (e.g. of a module's source), raising
            ``RuntimeError``.
    """

    module: str
    qualname: str
    params: tuple[str, ...] | None
    replace: Callable[[Any], Any]
    owner: str
    when: Callable[[], bool] = field(default=_always)
    check: Callable[[Any], None] | None = None

    @property
    def name(self) -> str:
        return f"{self.module}.{self.qualname}"

    def owner_and_attr(self) -> tuple[Any, str]:
        """The object that holds the binding and the attribute name.

        Raises:
            RuntimeError: the module or an attribute of the path is missing (upstream drift).
        """
        try:
            holder: Any = importlib.import_module(self.module)
            *path, attr = self.qualname.split(".")
            for part in path:
                holder = getattr(holder, part)
        except (ImportError, AttributeError) as exc:
            raise RuntimeError(f"upstream {self.name} is missing ({exc})") from exc
        return holder, attr

    def current(self) -> Any:
        """The value bound now (a class attribute is read from the class ``__dict__``).

        Raises:
            RuntimeError: the binding is missing.
        """
        holder, attr = self.owner_and_attr()
        try:
            return holder.__dict__[attr] if isinstance(holder, type) else getattr(holder, attr)
        except (KeyError, AttributeError) as exc:
            raise RuntimeError(f"upstream {self.name} is missing ({exc!r})") from exc

    def verify(self) -> None:
        """Check the binding against the supported version; ``RuntimeError`` naming it on drift."""
        original = self.current()
        owner = patch_owner(original)
        if owner is not None:
            raise RuntimeError(f"{self.name} is already patched by {owner}")
        if self.params is not None:
            check_signature(original, self.name, self.params)
        if self.check is not None:
            self.check(original)


class PatchSet:
    """Installs a list of :class:`Patch` es atomically, idempotently, and removes them again.

    Args:
        patches: the specs, in installation order (removal runs in reverse).
    """

    def __init__(self, patches: Sequence[Patch]) -> None:
        names = [p.name for p in patches]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"a binding may be patched once; listed more than once: {duplicates}")
        self.patches: tuple[Patch, ...] = tuple(patches)
        self._lock = threading.Lock()
        self._applied: list[tuple[Patch, Any, str, Any]] = []  # (patch, holder, attr, original)
        self._installed = False
        self._replacements: dict[str, Any] = {}

    def apply(self) -> bool:
        """Install every patch whose ``when`` holds; idempotent.

        Every applicable patch is verified (signature, extra check, not patched already) before the
        first binding changes, so a drifted upstream leaves the process untouched.

        Returns:
            True if this call installed the set, False if it was installed already.

        Raises:
            RuntimeError: a binding drifted from the supported version (the message names it).
        """
        with self._lock:
            if self._installed:
                return False
            applicable = [p for p in self.patches if p.when()]
            for patch in applicable:
                patch.verify()
            try:
                for patch in applicable:
                    holder, attr = patch.owner_and_attr()
                    original = patch.current()
                    replacement = patch.replace(original)
                    # An object that takes no attribute (__slots__, a builtin) goes unmarked.
                    with contextlib.suppress(AttributeError, TypeError):
                        setattr(replacement, PATCH_MARKER, patch.owner)
                    setattr(holder, attr, replacement)
                    self._applied.append((patch, holder, attr, original))
                    self._replacements[patch.name] = replacement
            except BaseException:
                self._restore()
                raise
            self._installed = True
            return True

    def remove(self) -> bool:
        """Restore every original this set replaced, in reverse order; idempotent.

        Returns:
            True if something was restored.

        Raises:
            RuntimeError: a binding this set replaced was replaced again by someone else since
                (restoring it would drop that replacement); nothing is restored then.
        """
        with self._lock:
            for patch, holder, attr, _ in self._applied:
                now = holder.__dict__.get(attr) if isinstance(holder, type) else getattr(holder, attr, None)
                if now is not self._replacements[patch.name]:
                    raise RuntimeError(
                        f"{patch.name} was replaced again after {patch.owner} patched it; remove that "
                        "replacement first (nothing was restored)"
                    )
            was = self._installed
            self._restore()
            return was

    def _restore(self) -> None:
        for _, holder, attr, original in reversed(self._applied):
            setattr(holder, attr, original)
        self._applied.clear()
        self._replacements.clear()
        self._installed = False

    @property
    def installed(self) -> bool:
        """Whether :meth:`apply` is in effect."""
        return self._installed

    def applied_names(self) -> list[str]:
        """Names of the bindings replaced now, in installation order."""
        return [patch.name for patch, _, _, _ in self._applied]
