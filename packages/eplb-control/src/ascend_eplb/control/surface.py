"""One owner's upstream surface: its rows, the patch decorator, the drift check and the Markdown.

Each package that owns rows holds one :class:`Surface` (control's serving product rows in
:mod:`ascend_eplb.control.upstream`, the CPU world's in ``ascend_eplb.world.upstream``, the tools' in
``ascend_eplb.tools.upstream``). Its signatures are keyed by ``module.qualname``; its module-level
replacements are declared on their factories (:meth:`Surface.replaces`) beside the code they replace.
Nothing here imports vLLM: a row resolves when it is checked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ascend_eplb.control import markdown
from ascend_eplb.control.patching import (
    DECLARED_ATTR,
    Attribute,
    Body,
    InstanceBinding,
    Override,
    Patch,
    Signature,
    check_signatures,
)

__all__ = ["Surface", "table"]


def table(*entries: Signature) -> Mapping[str, Signature]:
    """``entries`` keyed by ``module.qualname``, in order.

    Raises:
        ValueError: an entry is listed twice (the message names it).
    """
    out: dict[str, Signature] = {}
    for entry in entries:
        if entry.name in out:
            raise ValueError(f"upstream signature {entry.name} is listed twice")
        out[entry.name] = entry
    return out


class Surface:
    """The rows of one owner: what it relies on of upstream, and what it replaces.

    Args:
        module: the module that holds this surface (named by errors: ``"ascend_eplb.control.upstream"``).
        what: the surface in words, for errors (``"the upstream table"``).
        users: every user id a row may name (``"control.state"``: a module of ascend_eplb without
            its ``ascend_eplb.`` prefix).
        signatures: :func:`table` of every upstream callable relied on.
        instance_bindings, overrides, attributes, bodies: the rows of each other kind, in table order.

    Raises:
        ValueError: a row names a user not in ``users``.
    """

    def __init__(
        self,
        module: str,
        what: str,
        users: Sequence[str],
        signatures: Mapping[str, Signature],
        *,
        instance_bindings: Sequence[InstanceBinding] = (),
        overrides: Sequence[Override] = (),
        attributes: Sequence[Attribute] = (),
        bodies: Sequence[Body] = (),
    ) -> None:
        self.module = module
        self.what = what
        self.users = tuple(users)
        self.signatures = signatures
        self.instance_bindings = tuple(instance_bindings)
        self.overrides = tuple(overrides)
        self.attributes = tuple(attributes)
        self.bodies = tuple(bodies)
        for row in (*signatures.values(), *overrides, *attributes, *bodies):
            self._known(row.users)

    def __add__(self, other: Surface) -> Surface:
        """The rows of both, ``self``'s first in each kind (what a process relying on both checks and
        renders), named as ``self``; ``ValueError`` for a signature both list."""
        return Surface(
            self.module,
            self.what,
            (*self.users, *other.users),
            table(*self.signatures.values(), *other.signatures.values()),
            instance_bindings=(*self.instance_bindings, *other.instance_bindings),
            overrides=(*self.overrides, *other.overrides),
            attributes=(*self.attributes, *other.attributes),
            bodies=(*self.bodies, *other.bodies),
        )

    def _known(self, users: Iterable[object]) -> set[str]:
        users = tuple(users)
        unknown = [u for u in users if u not in self.users]
        if unknown:
            raise ValueError(f"unknown user(s) {unknown!r} of {self.what}; the users are {self.users!r}")
        return set(users)  # type: ignore[arg-type]

    def signature(self, name: str) -> Signature:
        """The entry ``module.qualname`` of the signatures.

        Raises:
            KeyError: ``name`` is not in the table (the message says where to add it).
        """
        try:
            return self.signatures[name]
        except KeyError:
            raise KeyError(f"{name} is not in {self.module}.SIGNATURES; list it there") from None

    def instance_binding(self, name: str) -> InstanceBinding:
        """The instance binding replacing the upstream method ``module.qualname``.

        Raises:
            KeyError: no row replaces it.
        """
        for binding in self.instance_bindings:
            if binding.name == name:
                return binding
        raise KeyError(f"{name} is not in {self.module}.INSTANCE_BINDINGS; list it there")

    def used_by(self, user: str) -> tuple[Signature, ...]:
        """The signatures ``user`` relies on, in table order.

        Raises:
            ValueError: ``user`` is not one of :attr:`users` (a typo would otherwise select nothing).
        """
        self._known((user,))
        return tuple(entry for entry in self.signatures.values() if user in entry.users)

    def replaces(
        self,
        target: str | tuple[str, str],
        does: str,
        *,
        when: Callable[[], bool] | None = None,
        applies: str = "always",
        check: Callable[[Any], None] | None = None,
    ) -> Callable[[Any], Any]:
        """Declare the decorated ``original -> replacement`` factory (a function, or a class called with
        the original) as the replacement of ``target``; the factory is returned unchanged.

        Args:
            target: ``module.qualname`` of a function of the signatures (binding and parameters from its
                entry), or ``(module, qualname)`` of a binding that is not a function (a module global, a
                class), which ``check`` must then validate.
            does: what the replacement does (for the table).
            when: ``() -> bool``, whether the patch applies in this process; None: always.
            applies: ``when`` in words (for the table).
            check: an extra drift check ``original -> None`` raising ``RuntimeError``; None: none.

        The row is a :class:`~ascend_eplb.control.patching.Patch` owned by the factory's module. Stacked
        decorators declare one row each, in the order they are written;
        :func:`~ascend_eplb.control.patching.patches_of` reads them.

        Raises:
            KeyError: a function ``target`` is not in the signatures.
            ValueError: the factory's module is not one of :attr:`users`.
        """
        if isinstance(target, str):
            entry = self.signature(target)
            module, qualname, params = entry.module, entry.qualname, entry.params
        else:
            (module, qualname), params = target, None
        optional = {} if when is None else {"when": when}

        def declare(factory: Any) -> Any:
            self._known((factory.__module__.removeprefix("ascend_eplb."),))
            patch = Patch(
                module,
                qualname,
                params,
                factory,
                factory.__module__,
                check=check,
                does=does,
                applies=applies,
                **optional,
            )
            setattr(factory, DECLARED_ATTR, (patch, *vars(factory).get(DECLARED_ATTR, ())))
            return factory

        return declare

    def check(self, *users: str) -> None:
        """Check every row the ``users`` rely on (none given: every user's): their signatures in table
        order, the signatures of their bodies held by another surface, then :meth:`check_rows`.

        Raises:
            ValueError: a user is not one of :attr:`users` (a typo would otherwise check nothing).
            RuntimeError: the first row that is missing, changed signature or body, lost an attribute we
                use or declares one we add, since vLLM 0.33.0 / torch 2.13.0; the message names it.
        """
        wanted = self._known(users or self.users)
        check_signatures(entry for entry in self.signatures.values() if set(entry.users) & wanted)
        check_signatures(
            body.signature
            for body in self.bodies
            if set(body.users) & wanted and body.signature.name not in self.signatures
        )
        self.check_rows(wanted)

    def check_rows(self, users: Iterable[str] | None = None) -> None:
        """Check the bodies, attributes and overrides of ``users`` (None: all), in that order.

        Raises:
            ValueError: a user is not one of :attr:`users`.
            RuntimeError: the first row that drifted, named.
        """
        wanted = set(self.users) if users is None else self._known(users)
        for row in (*self.bodies, *self.attributes, *self.overrides):
            if set(row.users) & wanted:
                row.check()

    def render(
        self,
        title: str,
        intro: str,
        first: Sequence[tuple[str, list[str]]] = (),
        *,
        bodies: str = "Upstream bodies our code depends on",
    ) -> str:
        """The ``UPSTREAM.md`` of this surface: ``# title``, the ``intro`` paragraph, the ``first``
        sections (``(heading, table lines)``: the owner's patches), then one section per kind that has
        rows: instance bindings, overrides, attributes, bodies (headed ``bodies``), signatures."""
        sections = list(first)
        for rows, heading, write in (
            (
                self.instance_bindings,
                "Methods replaced on single instances (`INSTANCE_BINDINGS`)",
                markdown.instance_binding_table,
            ),
            (self.overrides, "Methods our subclasses override (`OVERRIDES`)", markdown.override_table),
            (self.attributes, "Attributes of upstream objects (`ATTRIBUTES`)", markdown.attribute_table),
            (self.bodies, f"{bodies} (`BODIES`, source digests)", markdown.body_table),
            (
                tuple(self.signatures.values()),
                "Signatures relied on (`SIGNATURES`: names, kinds, defaults)",
                markdown.signature_table,
            ),
        ):
            if rows:
                sections.append((heading, write(rows)))
        return markdown.surface_document(title, intro, sections)
