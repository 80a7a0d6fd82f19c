"""The Markdown of an ``UPSTREAM.md``: one table writer per row kind of :mod:`ascend_eplb.control.patching`,
and the document that holds them (:meth:`ascend_eplb.control.surface.Surface.render`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ascend_eplb.control.patching import Attribute, Body, InstanceBinding, Override, Patch, Signature

__all__ = [
    "attribute_table",
    "body_table",
    "instance_binding_table",
    "markdown_table",
    "override_table",
    "patch_table",
    "signature_table",
    "surface_document",
]


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """The lines of a Markdown table of ``header`` and ``rows`` (a ``|`` inside a cell escaped)."""
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return lines


def surface_document(title: str, intro: str, sections: Sequence[tuple[str, list[str]]]) -> str:
    """An ``UPSTREAM.md`` document: ``# title``, the ``intro`` paragraph, then each ``(heading, table
    lines)`` of ``sections`` as a ``##`` section, in order."""
    lines = [f"# {title}", "", intro]
    for heading, table in sections:
        lines += ["", f"## {heading}", "", *table]
    return "\n".join(lines) + "\n"


def _code(text: str) -> str:
    return f"`{text}`"


def _users(users: Iterable[str]) -> str:
    return ", ".join(_code(u) for u in users)


def patch_table(patches: Iterable[Patch]) -> list[str]:
    """The Markdown table of module-level replacements: binding, replacement, owner, when it applies."""
    return markdown_table(
        ("binding", "replacement", "owner", "applies"),
        ((_code(p.name), p.does, _code(p.owner.removeprefix("ascend_eplb.")), p.applies) for p in patches),
    )


def instance_binding_table(bindings: Iterable[InstanceBinding]) -> list[str]:
    """The Markdown table of per-instance replacements: method, owner, who binds it on what."""
    return markdown_table(
        ("method", "owner", "bound by, on"),
        ((_code(b.name), _code(b.owner.removeprefix("ascend_eplb.")), b.installed_by) for b in bindings),
    )


def override_table(overrides: Iterable[Override]) -> list[str]:
    """The Markdown table of overrides: upstream method, our class, what it adds."""
    return markdown_table(
        ("upstream method", "overridden by", "what it adds"),
        ((_code(o.signature.label), _code(o.name.removeprefix("ascend_eplb.")), o.how) for o in overrides),
    )


def attribute_table(attributes: Iterable[Attribute]) -> list[str]:
    """The Markdown table of attributes: ``Class.attr``, access, users, what for."""
    return markdown_table(
        ("attribute", "access", "by", "what"),
        ((_code(f"{a.cls}.{a.attr}"), a.access, _users(a.users), a.how) for a in attributes),
    )


def body_table(bodies: Iterable[Body]) -> list[str]:
    """The Markdown table of pinned bodies: function, digest, users, why."""
    return markdown_table(
        ("function", "digest", "by", "why"),
        ((_code(b.signature.label), _code(b.digest), _users(b.users), b.reason) for b in bodies),
    )


def signature_table(signatures: Iterable[Signature]) -> list[str]:
    """The Markdown table of signatures: callable, parameters, users."""
    return markdown_table(
        ("callable", "parameters", "relied on by"),
        ((_code(e.name), _code(f"({', '.join(e.params)})"), _users(e.users)) for e in signatures),
    )
