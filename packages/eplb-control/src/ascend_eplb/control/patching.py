"""The row types of the upstream surface, their introspection, and the one applier of patches.

Each owning package declares its rows in one :class:`~ascend_eplb.control.surface.Surface` (its tables,
and each module-level patch on its factory with ``Surface.replaces``, read by :func:`patches_of`). Kinds:
:class:`Signature` (an upstream callable's parameters, checked by :func:`check_signature`, the one checker
every row uses); :class:`Patch` (one module-level binding that upstream does not expose as an extension
point; installed only by integration's single :class:`PatchSet`, or by a package outside serving for its
own rows); :class:`InstanceBinding` (an upstream method replaced on single instances by their owner);
:class:`Override` (a subclass method that stays call-compatible, :func:`extends`); :class:`Attribute`
(written or read: must exist upstream; added: must not); :class:`Body` (an upstream body we copy or
restate, pinned by :func:`source_digest`). :mod:`ascend_eplb.control.markdown` renders them.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib
import inspect
import textwrap
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "DECLARED_ATTR",
    "PATCH_MARKER",
    "Attribute",
    "Body",
    "InstanceBinding",
    "Override",
    "Patch",
    "PatchSet",
    "Signature",
    "check_signature",
    "check_signatures",
    "declares_attribute",
    "extends",
    "parameter_names",
    "parameter_spec",
    "patch_owner",
    "patches_of",
    "source_digest",
]

#: Attribute set on every replacement a :class:`PatchSet` installs (its value: the patch's name).
PATCH_MARKER = "_ascend_eplb_patch"

_SUPPORTED = "vLLM 0.33.0"
_MARKERS = ("/", "*")


def _target(fn: Any) -> Any:
    """What a check reads: ``fn`` unwrapped through ``__wrapped__`` (an installed wrapper of ours is
    checked as the function it wraps), a property's getter, a class's ``__init__``, a classmethod as
    bound (without ``cls``: as upstream's is read from its class)."""
    if isinstance(fn, classmethod | staticmethod):
        fn = fn.__get__(None, object)
    target = inspect.unwrap(fn)
    if isinstance(target, property):
        target = target.fget
    if isinstance(target, type):
        target = target.__init__
    return target


def parameter_spec(fn: Callable[..., Any]) -> tuple[str, ...]:
    """The parameters of ``fn`` as written in Python, annotations left out: one string per parameter
    (``"name"``, ``"name=<repr of the default>"``, ``"*args"``, ``"**kwargs"``), with ``"/"`` after the
    positional-only ones and ``"*"`` before the keyword-only ones (when there is no ``*args``).

    ``EplbState.step`` reads ``("self", "is_dummy=False", "is_profile=False", "log_stats=False")``;
    ``torch.accelerator.current_stream`` reads ``("device=None", "/")``. ``self`` is included for a
    function taken from a class.
    """
    params = list(inspect.signature(fn).parameters.values())
    out: list[str] = []
    star = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    for index, p in enumerate(params):
        if p.kind is inspect.Parameter.KEYWORD_ONLY and not star:
            out.append("*")
            star = True
        text = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}.get(p.kind, "")
        text += p.name
        if p.default is not inspect.Parameter.empty:
            text += f"={p.default!r}"
        out.append(text)
        if p.kind is inspect.Parameter.POSITIONAL_ONLY and (
            index + 1 == len(params) or params[index + 1].kind is not inspect.Parameter.POSITIONAL_ONLY
        ):
            out.append("/")
    return tuple(out)


def _names(spec: Sequence[str]) -> tuple[str, ...]:
    return tuple(p.lstrip("*").split("=", 1)[0] for p in spec if p not in _MARKERS)


def parameter_names(fn: Callable[..., Any]) -> tuple[str, ...]:
    """Parameter names of ``fn`` in order (``self`` included for functions taken from a class)."""
    return tuple(inspect.signature(fn).parameters)


def check_signature(fn: Callable[..., Any], name: str, expected: Sequence[str]) -> None:
    """Raise unless ``fn``'s parameters are exactly ``expected``: names, kinds and defaults, in order.

    Args:
        fn: the upstream callable as it is bound now (unwrapped through ``__wrapped__`` first, so an
            installed wrapper of ours is checked against the function it wraps). A class is checked by
            its ``__init__``, a property by its getter.
        name: the qualified name used in the error, e.g. ``"EplbState.rearrange"``.
        expected: its parameters in vLLM 0.33.0, as :func:`parameter_spec` writes them (a plain name
            for a parameter without a default: a tuple of names is the spec of such a function).

    Raises:
        RuntimeError: the parameters differ or the signature cannot be read. When the names differ the
            message names the callable and both name lists; when only a kind or a default differs, both
            full specs.
    """
    try:
        actual = parameter_spec(_target(fn))
    except (TypeError, ValueError) as exc:
        raise RuntimeError(f"cannot read the signature of upstream {name}: {exc}") from exc
    expected = tuple(expected)
    if _names(actual) != _names(expected):
        raise RuntimeError(
            f"upstream {name} changed signature: expected parameters {_names(expected)} ({_SUPPORTED}), "
            f"found {_names(actual)}; ascend_eplb must be updated for this version"
        )
    if actual != expected:
        raise RuntimeError(
            f"upstream {name} changed signature: expected ({', '.join(expected)}) ({_SUPPORTED}), found "
            f"({', '.join(actual)}) (a parameter's kind or default changed); ascend_eplb must be updated "
            "for this version"
        )


def extends(ours: Sequence[str], upstream: Sequence[str]) -> bool:
    """Whether a subclass method with parameters ``ours`` can be called wherever upstream's method with
    ``upstream`` is (both as :func:`parameter_spec` writes them): upstream's parameters come first,
    unchanged (names, kinds, defaults), and every parameter added after them has a default or is
    keyword-only with a default."""
    ours, upstream = tuple(ours), tuple(upstream)
    if ours[: len(upstream)] != upstream:
        return False
    return all(p in _MARKERS or "=" in p or p.startswith("*") for p in ours[len(upstream) :])


def source_digest(fn: Callable[..., Any]) -> str:
    """The first 16 hex digits of the SHA-256 of ``fn``'s source, normalised: parsed and written back
    by :func:`ast.unparse` (formatting and comments do not count), its docstring left out, decorators
    kept. ``fn`` is unwrapped as by :func:`check_signature`.

    Raises:
        RuntimeError: the source cannot be read or parsed.
    """
    target = _target(fn)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(target)))
    except (OSError, TypeError, SyntaxError) as exc:
        raise RuntimeError(
            f"cannot read the source of {getattr(target, '__qualname__', target)!r}: {exc}"
        ) from exc
    node = tree.body[0]
    body = getattr(node, "body", None)
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        node.body = body[1:] or [ast.Pass()]
    return hashlib.sha256(ast.unparse(node).encode()).hexdigest()[:16]


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


def _split(dotted: str) -> tuple[str, str]:
    """``"pkg.mod.Class"`` -> ``("pkg.mod", "Class")``: the longest importable module prefix."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:cut])
        try:
            importlib.import_module(module)
        except ImportError:
            continue
        return module, ".".join(parts[cut:])
    raise RuntimeError(f"{dotted} is missing (no module of that path imports)")


@dataclass(frozen=True)
class Signature:
    """An upstream callable ascend_eplb relies on, and its parameters in the supported version.

    Attributes:
        module: import path of the module that defines it (or the class that holds it).
        qualname: attribute path inside ``module``: ``"_move_to_workspace"``, ``"EplbState.rearrange"``.
        params: its parameters in vLLM 0.33.0 / torch 2.13.0 as :func:`parameter_spec` writes them
            (``self`` included for a method; a class is checked by its ``__init__``, a property by its
            getter).
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

    @property
    def names(self) -> tuple[str, ...]:
        """The parameter names alone."""
        return _names(self.params)

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
class Body:
    """An upstream function whose body ascend_eplb copies or restates, pinned by its source digest.

    Attributes:
        signature: the function (its entry of the signature table).
        digest: :func:`source_digest` of it in vLLM 0.33.0.
        users: the ascend_eplb modules whose code depends on that body.
        reason: what depends on it (for the table and the error).
    """

    signature: Signature
    digest: str
    users: tuple[str, ...]
    reason: str

    @property
    def name(self) -> str:
        return self.signature.name

    def check(self) -> None:
        """Raise ``RuntimeError`` naming the function, both digests and what depends on the body when
        upstream's body changed (or its source cannot be read)."""
        found = source_digest(self.signature.resolve())
        if found != self.digest:
            raise RuntimeError(
                f"upstream {self.signature.label} changed its body: source digest {found}, {_SUPPORTED}'s "
                f"is {self.digest}; {self.reason}: review it against the new body, then update the digest "
                f"{self.digest} in its row"
            )


def declares_attribute(cls: type, attr: str) -> bool:
    """Whether instances of ``cls`` have ``attr`` by ``cls``'s own code: a class attribute, a class
    annotation, a dataclass field, or an assignment ``self.<attr> = ...`` in an ``__init__`` of its MRO
    (read from the source), ``object`` excluded."""
    for klass in cls.__mro__[:-1]:
        if attr in vars(klass) or attr in vars(klass).get("__annotations__", {}):
            return True
        init = vars(klass).get("__init__")
        if init is None:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(init))))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign | ast.AugAssign)
                else []
            )
            for target in targets:
                if (
                    isinstance(target, ast.Attribute)
                    and target.attr == attr
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "self"
                ):
                    return True
    return False


AttributeAccess = Literal["writes", "reads", "adds"]


@dataclass(frozen=True)
class Attribute:
    """An attribute of instances of an upstream class that ascend_eplb writes, reads or adds.

    Attributes:
        module: import path of the module defining the upstream class.
        cls: the class's qualified name in ``module``.
        attr: the attribute.
        access: ``"writes"``/``"reads"`` (upstream declares it: :func:`declares_attribute`) or
            ``"adds"`` (ascend_eplb sets an attribute of its own on upstream's instances: upstream
            must not declare it).
        users: the ascend_eplb modules that access it.
        how: what they do with it (for the table).
    """

    module: str
    cls: str
    attr: str
    access: AttributeAccess
    users: tuple[str, ...]
    how: str

    @property
    def name(self) -> str:
        return f"{self.module}.{self.cls}.{self.attr}"

    def check(self) -> None:
        """Raise ``RuntimeError`` naming the attribute when upstream's class lost one we read or write,
        or now declares one we add (or the class is missing)."""
        klass = _resolve(self.module, self.cls)
        declared = declares_attribute(klass, self.attr)
        if self.access == "adds" and declared:
            raise RuntimeError(
                f"upstream {self.cls} now declares {self.attr!r}, the attribute "
                f"{', '.join(self.users)} sets on its instances; ascend_eplb must be updated for this version"
            )
        if self.access != "adds" and not declared:
            raise RuntimeError(
                f"upstream {self.cls}.{self.attr} is missing ({', '.join(self.users)} {self.access} it); "
                "ascend_eplb must be updated for this version"
            )


@dataclass(frozen=True)
class Override:
    """A method of an upstream class that a class of ascend_eplb overrides.

    Attributes:
        subclass: ``module.Class`` of ours (resolved when checked: this module imports nothing).
        signature: the upstream method overridden (its entry of the signature table).
        users: the ascend_eplb module that defines the override.
        how: what the override does beside upstream's (for the table).
    """

    subclass: str
    signature: Signature
    users: tuple[str, ...]
    how: str

    @property
    def method(self) -> str:
        return self.signature.qualname.rsplit(".", 1)[-1]

    @property
    def name(self) -> str:
        return f"{self.subclass}.{self.method}"

    def check(self) -> None:
        """Raise ``RuntimeError`` when our class does not define the method itself, or its parameters do
        not extend upstream's (:func:`extends`); upstream's own signature is the table entry's check."""
        module, qualname = _split(self.subclass)
        ours = vars(_resolve(module, qualname)).get(self.method)
        if ours is None:
            raise RuntimeError(f"{self.name} is declared as an override of upstream but is not defined there")
        spec = parameter_spec(_target(ours))
        if not extends(spec, self.signature.params):
            raise RuntimeError(
                f"{self.name}({', '.join(spec)}) does not extend upstream {self.signature.label}"
                f"({', '.join(self.signature.params)}): upstream's parameters must come first, unchanged, "
                "and any added one needs a default"
            )


@dataclass(frozen=True)
class Patch:
    """The replacement of one binding ``module.qualname``.

    Attributes:
        module: import path of the module holding the binding (or the class that holds it).
        qualname: attribute path inside ``module``: ``"current_platform"``, ``"EplbState.__init__"``.
        params: the original's parameters in the version this project supports (as
            :func:`parameter_spec` writes them), checked with
            :func:`check_signature` before anything is changed; None for a binding that is not a
            function (then ``check`` must validate it).
        replace: ``original -> replacement``; called once at installation.
        owner: the module that owns the behaviour (for logs and errors).
        when: whether the patch applies in this process (e.g. only on a host without an accelerator);
            asked at installation, before the checks.
        check: an extra drift check of the original (e.g. of a module's source), raising
            ``RuntimeError``.
        does: what the replacement does (for the table).
        applies: ``when`` in words (for the table).
    """

    module: str
    qualname: str
    params: tuple[str, ...] | None
    replace: Callable[[Any], Any]
    owner: str
    when: Callable[[], bool] = field(default=_always)
    check: Callable[[Any], None] | None = None
    does: str = ""
    applies: str = "always"

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


#: Attribute of a replacement factory holding the :class:`Patch` es declared on it by
#: :meth:`ascend_eplb.control.surface.Surface.replaces`.
DECLARED_ATTR = "_ascend_eplb_replaces"


def patches_of(*factories: Any) -> tuple[Patch, ...]:
    """The :class:`Patch` es declared (``Surface.replaces``) on ``factories``, in order.

    Raises:
        TypeError: a factory declares no replacement (the message names it).
    """
    out: list[Patch] = []
    for factory in factories:
        declared = vars(factory).get(DECLARED_ATTR)
        if not declared:
            raise TypeError(
                f"{factory.__module__}.{factory.__qualname__} declares no replacement of upstream "
                "(decorate it with its row: replaces(...))"
            )
        out += declared
    return tuple(out)


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
