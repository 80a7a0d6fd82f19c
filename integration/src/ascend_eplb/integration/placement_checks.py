"""The rules a placement and its file's ``layer_list`` meet, each broken one a problem line.

Each function returns problems (``list[str]``), each naming the field, the value and the rule, at most
five of a kind listed and the rest counted; :mod:`ascend_eplb.integration.placement_file` raises them as
one ``PlacementFileError``. A map is upstream's ``physical_to_logical_map``, ``(L, P)`` logical ids.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ascend_eplb.control.values import is_int

__all__ = ["fact_problems", "layer_list_entry", "layer_list_rows", "map_problems", "short", "unknown_keys"]

#: Problems of one kind listed in a message before the rest are counted ("and 12 more").
_LISTED = 5
#: The keys of a ``layer_list`` entry and of a ``device_list`` entry.
_LAYER_KEYS = ("layer_id", "device_count", "device_list")
_DEVICE_KEYS = ("device_id", "device_expert")


def _listed(kind: str, found: list[str]) -> list[str]:
    """``found`` (problems of one kind) with at most :data:`_LISTED` named, the rest counted."""
    if len(found) <= _LISTED:
        return found
    return [*found[:_LISTED], f"and {len(found) - _LISTED} more {kind}"]


def fact_problems(facts: Mapping[str, Any]) -> list[str]:
    """Problems of the four facts themselves (integers >= 1, P divisible by N, P >= E); ``facts``: by
    name, in the order problems are reported (``placement_file.FACTS``)."""
    out = [
        f"{name}={value!r}: must be an integer >= 1"
        for name, value in facts.items()
        if not (is_int(value) and value >= 1)
    ]
    if out:
        return out
    e, p, n = facts["num_logical_experts"], facts["num_physical_experts"], facts["num_ranks"]
    if p < e:
        out.append(
            f"num_physical_experts={p}: must be at least num_logical_experts={e} (every logical expert "
            "needs a slot)"
        )
    if p % n:
        out.append(f"num_physical_experts={p}: must be divisible by num_ranks={n} (P / N slots per rank)")
    return out


def map_problems(rows: Sequence[Any], facts: Mapping[str, int], where: Any) -> list[str]:
    """Problems of an ``(L, P)`` map against its facts: its shape, each id (an integer in ``[0, E)``),
    each layer holding every logical expert. ``where(layer, slot)`` names an entry in the messages."""
    e, p_total, layers = facts["num_logical_experts"], facts["num_physical_experts"], facts["num_moe_layers"]
    if len(rows) != layers:
        return [f"{len(rows)} layers of placement: must be num_moe_layers={layers}"]
    shape, ids, missing = [], [], []
    for layer, row in enumerate(rows):
        if len(row) != p_total:
            shape.append(f"layer {layer}: {len(row)} slots, must be num_physical_experts={p_total}")
            continue
        seen: set[int] = set()
        for slot, value in enumerate(row):
            if is_int(value) and 0 <= value < e:
                seen.add(value)
            else:
                ids.append(
                    f"{where(layer, slot)}={value!r}: a logical expert id must be an integer in [0, {e}) "
                    f"(num_logical_experts={e})"
                )
        absent = sorted(set(range(e)) - seen)
        if absent:
            shown = absent if len(absent) <= 8 else [*absent[:8], "..."]
            missing.append(
                f"layer {layer}: logical expert(s) {shown} hold no slot ({len(absent)} of {e}); every "
                "logical expert needs at least one"
            )
    return (
        _listed("slot-count problems", shape)
        + _listed("ids out of range", ids)
        + _listed("layers missing experts", missing)
    )


def unknown_keys(at: str, data: Mapping[str, Any], known: Sequence[str]) -> list[str]:
    """The keys of ``data`` outside ``known``, as one problem prefixed by ``at`` (none: empty)."""
    extra = [key for key in data if key not in known]
    if not extra:
        return []
    return [f"{at}unknown key(s) {', '.join(map(repr, extra))}: the keys are {', '.join(known)}"]


def layer_list_entry(layer: int, slot: int, facts: Mapping[str, int]) -> str:
    p = facts["num_physical_experts"] // facts["num_ranks"]
    return f"layer_list[{layer}].device_list[{slot // p}].device_expert[{slot % p}]"


def layer_list_rows(data: Mapping[str, Any], facts: Mapping[str, int]) -> tuple[list[list[Any]], list[str]]:
    """The ``(L, P)`` rows of ``layer_list`` (devices concatenated in order), or the structure's problems."""
    layers, n = facts["num_moe_layers"], facts["num_ranks"]
    p = facts["num_physical_experts"] // n
    out: list[str] = []
    if not _equal(data.get("moe_layer_count"), layers):
        out.append(f"moe_layer_count={data.get('moe_layer_count')!r}: must equal num_moe_layers={layers}")
    layer_list = data.get("layer_list")
    if not isinstance(layer_list, list):
        return [], [*out, f"layer_list={short(layer_list)}: must be a list of {layers} layers"]
    if len(layer_list) != layers:
        out.append(f"layer_list has {len(layer_list)} layers: must be num_moe_layers={layers}")
    rows: list[list[Any]] = []
    for li, layer in enumerate(layer_list):
        at = f"layer_list[{li}]"
        if not isinstance(layer, dict):
            out.append(f"{at}: must be an object with layer_id, device_count and device_list")
            continue
        out += unknown_keys(f"{at}: ", layer, _LAYER_KEYS)
        if not _equal(layer.get("layer_id"), li):
            out.append(f"{at}.layer_id={layer.get('layer_id')!r}: must be {li} (layers in order)")
        if not _equal(layer.get("device_count"), n):
            out.append(f"{at}.device_count={layer.get('device_count')!r}: must equal num_ranks={n}")
        devices = layer.get("device_list")
        if not isinstance(devices, list) or len(devices) != n:
            count = len(devices) if isinstance(devices, list) else short(devices)
            out.append(f"{at}.device_list: {count} devices, must be a list of num_ranks={n}")
            continue
        row: list[Any] = []
        for ri, device in enumerate(devices):
            dat = f"{at}.device_list[{ri}]"
            if not isinstance(device, dict) or not isinstance(device.get("device_expert"), list):
                out.append(f"{dat}: must be an object with device_id and a device_expert list")
                continue
            out += unknown_keys(f"{dat}: ", device, _DEVICE_KEYS)
            if not _equal(device.get("device_id"), ri):
                out.append(f"{dat}.device_id={device.get('device_id')!r}: must be {ri} (devices in order)")
            experts = device["device_expert"]
            if len(experts) != p:
                out.append(
                    f"{dat}.device_expert has {len(experts)} slots: must be num_physical_experts / num_ranks "
                    f"= {p}"
                )
            row.extend(experts)
        rows.append(row)
    return rows, _listed("layer_list problems", out)


def _equal(value: Any, want: int) -> bool:
    """Whether ``value`` is the integer ``want`` (``False``, ``0.0`` and ``1.0`` are not integers)."""
    return is_int(value) and value == want


def short(value: Any) -> str:
    """``repr(value)``, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."
