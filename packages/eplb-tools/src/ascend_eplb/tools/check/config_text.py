"""A config file's YAML, read strictly: a key given twice in one mapping is refused (YAML's loader keeps the
last value), and so is a document whose aliases expand past :data:`MAX_VALUES` values or refer to
themselves (an alias bomb: nine aliases of nine make a billion values, which took the tools minutes to
refuse). Judged on the composed node graph, before anything is constructed: in time linear in the file.
"""

from __future__ import annotations

from typing import Any

import yaml

from ascend_eplb.integration.json_text import DuplicateKeyError

__all__ = ["MAX_VALUES", "load_yaml"]

#: The most values a config document may expand to, its aliases counted each time they are used (a real
#: config file has a few hundred).
MAX_VALUES = 100_000

_MERGE = "tag:yaml.org,2002:merge"


class _StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` refusing a key given twice in one mapping (a ``<<`` merge may still override)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: list[Any] = []
        for key_node, _ in node.value:
            if key_node.tag == _MERGE:
                continue
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise DuplicateKeyError(str(key))
            seen.append(key)
        return super().construct_mapping(node, deep=deep)


def _expanded(node: yaml.Node, sizes: dict[int, int], open_: set[int]) -> int:
    """The values ``node`` expands to, each alias counted where it is used (memoised by node)."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_:
        raise ValueError("an alias refers to a value that holds it (a document without end)")
    open_.add(key)
    children: list[yaml.Node] = []
    if isinstance(node, yaml.SequenceNode):
        children = list(node.value)
    elif isinstance(node, yaml.MappingNode):
        children = [n for pair in node.value for n in pair]
    total = 1
    for child in children:
        total += _expanded(child, sizes, open_)
        if total > MAX_VALUES:
            break
    open_.discard(key)
    sizes[key] = total
    return total


def load_yaml(text: str) -> Any:
    """The one YAML document of ``text`` (None: empty or ``null``), read as ``yaml.safe_load`` reads it.

    Raises:
        DuplicateKeyError: a key given twice in one mapping.
        ValueError: the document expands past :data:`MAX_VALUES` values or refers to itself.
        yaml.YAMLError: not YAML (or several documents).
    """
    loader = _StrictLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        values = _expanded(node, {}, set())
        if values > MAX_VALUES:
            raise ValueError(
                f"its aliases expand it to more than {MAX_VALUES} values (an alias bomb?); a config file "
                "holds a few hundred: write the values out"
            )
        return loader.construct_document(node)
    finally:
        loader.dispose()
