"""The declaration types of the upstream surface, one applier, and the one signature checker.

* :class:`Signature`: an upstream callable ascend_eplb relies on, with its parameters in vLLM 0.33.0 /
  torch 2.13.0. Every one is listed once, in :data:`ascend_eplb.control.upstream.SIGNATURES`.
* :class:`Patch`: the replacement of one module-level binding that upstream does not expose as an
  extension point (a module global, a class attribute, a torch function). The plane that owns the
  behaviour declares its patches as specs (``ascend_eplb.control.host_adaptation.PATCHES``,
  ``ascend_eplb.control.commit_hooks.PATCHES``); nothing in this package installs them. The
  integration's ``apply_patches()`` owns the single :class:`PatchSet` of the process and installs every
  spec at once.
* :class:`InstanceBinding`: the replacement of an upstream method on single instances (the class keeps
  its method), installed by the code that owns those instances.

The registry that lists every :class:`Patch` and :class:`InstanceBinding` of the process, the answer to
"where is upstream touched?", is ``ascend_eplb.integration.patches``. :func:`check_signature` is the one
checker of upstream signatures: patches, instance bindings and the subclass overrides of
:mod:`ascend_eplb.control` (checked when their classes are constructed) all use it.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "PATCH_MARKER",
    "InstanceBinding",
    "Patch",
    "PatchSet",
    "Signature",
    "check_signature",
    "check_signatures",
    "parameter_names",
    "patch_owner",
]

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


def _resolve(module: str, qualname: str) -> Any:
    """The object ``module.qualname`` (attributes read with ``getattr``: inherited ones included).

    Raises:
        RuntimeError: the module or an attribute of the path is missing (upstream drift).
    """
    try:
        value: Any = importlib.import_module(module)
        for part in qualname.split("."):
            value = getattr(value, part)
    except (ImportError, AttributeError) as exc:
        raise RuntimeError(f"upstream {module}.{qualname} is missing ({exc})") from exc
    return value


@dataclass(frozen=True)
class Signature:
    """An upstream callable ascend_eplb relies on, and its parameters in the supported version.

    Attributes:
        module: import path of the module that defines it (or the class that holds it).
        qualname: attribute path inside ``module``: ``"_move_to_workspace"``, ``"EplbState.rearrange"``.
        params: its parameter names in vLLM 0.33.0 / torch 2.13.0 (``self`` included for a method; a
            class is checked by its ``__init__``).
        users: the ascend_eplb modules that rely on it (``"control.state"``, ...); each checks the
            entries it relies on with :func:`check_signatures`.
    """

    module: str
    qualname: str
    params: tuple[str, ...]
    users: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """``module.qualname``, the key of the table."""
        return f"{self.module}.{self.qualname}"

    @property
    def label(self) -> str:
        """The name errors use: ``Class.method`` for a class attribute, ``module.function`` otherwise."""
        return self.qualname if "." in self.qualname else self.name

    def resolve(self) -> Any:
        """The callable bound now; ``RuntimeError`` naming it when it is missing."""
        return _resolve(self.module, self.qualname)

    def check(self) -> None:
        """:func:`check_signature` of the callable bound now; ``RuntimeError`` naming it on drift."""
        check_signature(self.resolve(), self.label, self.params)


def check_signatures(signatures: Iterable[Signature]) -> None:
    """Check each signature in order; the first drifted or missing one raises ``RuntimeError``."""
    for signature in signatures:
        signature.check()


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

    @classmethod
    def on(
        cls,
        signature: Signature,
        replace: Callable[[Any], Any],
        owner: str,
        *,
        when: Callable[[], bool] = _always,
        check: Callable[[Any], None] | None = None,
    ) -> Patch:
        """The patch of the function ``signature`` declares (binding and parameters from the table)."""
        return cls(signature.module, signature.qualname, signature.params, replace, owner, when, check)

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


@dataclass(frozen=True)
class InstanceBinding:
    """An upstream method replaced on single instances (an instance attribute; the class is untouched).

    Attributes:
        signature: the upstream method replaced, with its parameters (an entry of the one table).
        owner: the module whose function is bound in its place.
        installed_by: the function that binds it, and on which instances (for readers and errors).
    """

    signature: Signature
    owner: str
    installed_by: str

    @property
    def name(self) -> str:
        """``module.Class.method`` of the upstream method replaced."""
        return self.signature.name

    @property
    def attr(self) -> str:
        """The instance attribute that holds the replacement."""
        return self.signature.qualname.rsplit(".", 1)[-1]


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
