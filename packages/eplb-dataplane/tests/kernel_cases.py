"""Inputs shared by the torch-form tests and the Triton interpreter worker (not a test module).

Imported by file path (``load_module``) from the tests and from ``triton_worker.py``, which runs in a
subprocess with ``TRITON_INTERPRET=1``. Everything here is deterministic, so both processes build the
same tensors.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch

HERE = Path(__file__).resolve().parent

# E and P not powers of two; a 16-row table so that T = rows - 1, rows, rows + 1 stay small.
NUM_LOGICAL, NUM_PHYSICAL, ROWS, TOP_K = 13, 21, 16, 5
TOKEN_COUNTS = (0, 1, ROWS - 1, ROWS, ROWS + 1, 2500)
#: (rows, E, P, K) of the cases on a real ReplicaLookup (the serving sizes of DeepSeek-V3 with 32
#: redundant experts).
DEFAULT_LOOKUP = (1024, 256, 288, 8)
ID_DTYPES = (torch.int32, torch.int64)


def load_module(name: str) -> ModuleType:
    """Import ``tests/<name>.py`` by path (the tests are not a package)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def placement() -> tuple[torch.Tensor, torch.Tensor]:
    """``(l2p (E, 3), count (E,))``: 13 logical experts over 21 slots, some with 2 or 3 replicas."""
    gen = torch.Generator().manual_seed(5)
    slots = torch.randperm(NUM_PHYSICAL, generator=gen)
    counts = [3, 3, 2, 2, 2, 2] + [1] * (NUM_LOGICAL - 6)
    l2p = torch.full((NUM_LOGICAL, 3), -1, dtype=torch.int64)
    start = 0
    for e, c in enumerate(counts):
        l2p[e, :c] = slots[start : start + c]
        start += c
    assert start == NUM_PHYSICAL
    return l2p, torch.tensor(counts)


def table(strided: bool = False) -> torch.Tensor:
    """The ``(ROWS, E)`` replica table of :func:`placement` for rank 2; optionally a strided view."""
    from ascend_eplb.dataplane import build_replica_table

    base = build_replica_table(*placement(), 2, rows=ROWS)
    if not strided:
        return base
    wide = torch.full((ROWS, 2 * NUM_LOGICAL), 99, dtype=torch.int32)[:, ::2]
    wide.copy_(base)
    return wide


def big_lookup(seed: int = 3):
    """A :class:`ReplicaLookup` of :data:`DEFAULT_LOOKUP` sizes: 32 hot experts with a second replica."""
    from ascend_eplb.dataplane import ReplicaLookup

    rows, num_logical, num_physical, _ = DEFAULT_LOOKUP
    gen = torch.Generator().manual_seed(seed)
    hot = torch.randperm(num_logical, generator=gen)[: num_physical - num_logical]
    l2p = torch.full((num_logical, 2), -1, dtype=torch.int64)
    l2p[:, 0] = torch.randperm(num_logical, generator=gen)
    l2p[hot, 1] = torch.arange(num_logical, num_physical)
    lookup = ReplicaLookup(num_logical, "cpu", rows=rows, num_physical_experts=num_physical)
    lookup.refresh_(l2p, 1 + (l2p[:, 1] >= 0).to(torch.int64))
    return lookup


def equality_cases() -> list[dict]:
    """Cases of the kernel-equals-torch-form tests: every T, both id dtypes, both load dtypes, flag
    on and off, unpadded counts below, at and beyond T (and negative), out-of-range ids both sides,
    strided ids, tables and load views."""
    cases = []
    unpadded_choices = ("half", "all", "zero", "negative", "beyond")
    index = 0
    for num_tokens in TOKEN_COUNTS:
        for ids_dtype in ID_DTYPES:
            for load_dtype in ID_DTYPES:
                for record in (True, False):
                    choice = unpadded_choices[index % len(unpadded_choices)]
                    unpadded = {
                        "half": num_tokens // 2,
                        "all": num_tokens,
                        "zero": 0,
                        "negative": -3,
                        "beyond": num_tokens + 4,
                    }[choice]
                    cases.append(
                        {
                            "name": f"T{num_tokens}-{str(ids_dtype)[6:]}-load{str(load_dtype)[6:]}-"
                            f"{'on' if record else 'off'}-n{unpadded}",
                            "num_tokens": num_tokens,
                            "ids_dtype": ids_dtype,
                            "load_dtype": load_dtype,
                            "record": record,
                            "unpadded": unpadded,
                            "unpadded_dtype": torch.int32 if index % 2 else torch.int64,
                            "strided": index % 3 == 0,
                            "seed": index,
                        }
                    )
                    index += 1
    # A view with E <= len < P (the table's ids in [len, P) are mapped, never counted) and a table
    # that no ReplicaLookup would hold (entries below 0 and beyond P): identical on every path.
    for load_len, foreign in ((15, False), (NUM_PHYSICAL, True)):
        for ids_dtype in ID_DTYPES:
            cases.append(
                {
                    "name": f"T300-{str(ids_dtype)[6:]}-len{load_len}-{'foreign' if foreign else 'replica'}",
                    "num_tokens": 300,
                    "ids_dtype": ids_dtype,
                    "load_dtype": torch.int32,
                    "record": True,
                    "unpadded": 250,
                    "unpadded_dtype": torch.int64,
                    "strided": False,
                    "seed": index,
                    "load_len": load_len,
                    "foreign_table": foreign,
                }
            )
            index += 1
    # Row layouts (replica_offset, num_slices, recording_slice): offsets past and before the table's
    # rows, a gathered batch of 2 and 3 slices recording each slice (unpadded counts inside and beyond
    # the slice), and a rank that records no slice.
    # A sequence-parallel slice is chunk local_chunk of the rank's own batch.
    layouts = (
        (0, 1, 0, 0),
        (5, 1, 0, 0),
        (ROWS + 3, 1, 0, 0),
        (-2, 1, 0, 0),
        (1, 2, 0, 0),
        (0, 2, 1, 0),
        (2, 3, 2, 0),
        (0, 3, 1, 0),
        (7, 2, -1, 0),
        (0, 4, 3, 1),
        (1, 2, 1, 1),
    )
    for layout_index, layout in enumerate(layouts):
        for num_tokens in (1, 37, 300):
            unpadded = (num_tokens // max(layout[1], 1)) // 2 + layout_index % 3 * num_tokens
            cases.append(
                {
                    "name": f"T{num_tokens}-layout{'_'.join(str(v) for v in layout)}-n{unpadded}",
                    "num_tokens": num_tokens,
                    "ids_dtype": torch.int64 if layout_index % 2 else torch.int32,
                    "load_dtype": torch.int32,
                    "record": True,
                    "unpadded": unpadded,
                    "unpadded_dtype": torch.int64,
                    "strided": layout_index % 3 == 0,
                    "seed": index,
                    "layout": layout,
                }
            )
            index += 1
    # A real ReplicaLookup (1024 rows, E = 256, P = 288, K = 8) at T = rows - 1, rows, rows + 1.
    for num_tokens in (DEFAULT_LOOKUP[0] - 1, DEFAULT_LOOKUP[0], DEFAULT_LOOKUP[0] + 1):
        cases.append(
            {
                "name": f"lookup1024-T{num_tokens}",
                "num_tokens": num_tokens,
                "ids_dtype": torch.int32,
                "load_dtype": torch.int32,
                "record": True,
                "unpadded": num_tokens - 100,
                "unpadded_dtype": torch.int32,
                "strided": False,
                "seed": index,
                "lookup": True,
            }
        )
        index += 1
    return cases


def case_inputs(case: dict) -> dict[str, torch.Tensor]:
    """The tensors of one case (a fresh load view each call)."""
    gen = torch.Generator().manual_seed(case["seed"])
    num_tokens, strided = case["num_tokens"], case["strided"]
    if case.get("lookup"):
        _, num_logical, num_physical, top_k = DEFAULT_LOOKUP
        return {
            "ids": torch.randint(-1, num_logical + 1, (num_tokens, top_k), generator=gen, dtype=torch.int32),
            "table": big_lookup().table,
            "load": torch.zeros(num_physical, dtype=torch.int32),
            "record": torch.tensor(True),
            "unpadded": torch.tensor(case["unpadded"], dtype=torch.int32),
            "layout": None,
        }
    ids = torch.randint(-4, NUM_LOGICAL + 4, (num_tokens, TOP_K), generator=gen)
    ids = ids.to(case["ids_dtype"])
    if strided:  # a (T, K) view with strides (1, T): topk ids transposed
        ids = ids.t().contiguous().t()
    load_len = case.get("load_len", NUM_PHYSICAL)
    start = torch.arange(2 * load_len, dtype=case["load_dtype"]) * 3
    load = start[::2].clone() if not strided else start.clone()[::2]
    if case.get("foreign_table"):
        table_ = torch.randint(-5, NUM_PHYSICAL + 5, (ROWS, NUM_LOGICAL), generator=gen, dtype=torch.int32)
    else:
        table_ = table(strided=strided)
    return {
        "ids": ids,
        "table": table_,
        "load": load,
        "record": torch.tensor(case["record"]),
        "unpadded": torch.tensor(case["unpadded"], dtype=case["unpadded_dtype"]),
        "layout": torch.tensor(case["layout"]) if "layout" in case else None,
    }


def reference(
    ids: torch.Tensor,
    table_: torch.Tensor,
    num_counters: int,
    num_unpadded: int,
    layout: tuple[int, int, int, int] | None = None,
):
    """Loop reference: mapped ids (token ``t`` reads row ``(t + offset) % rows``) and the counts of the
    first ``num_unpadded`` rows of the recording slice (``layout`` None: offset 0, one slice)."""
    offset, num_slices, recording_slice, local_chunk = layout if layout is not None else (0, 1, 0, 0)
    rows, num_experts = table_.shape
    size = ids.shape[0] // max(num_slices, 1)
    first = recording_slice * size
    real = min(max(num_unpadded - local_chunk * size, 0), size)
    recorded = range(first, first + real) if recording_slice >= 0 else range(0)
    rows_of_table, id_rows = table_.tolist(), ids.tolist()
    out = [[-1] * ids.shape[1] for _ in id_rows]
    load = [0] * num_counters
    for t, row in enumerate(id_rows):
        for k, e in enumerate(row):
            if 0 <= e < num_experts:
                out[t][k] = rows_of_table[(t + offset) % rows][e]
                if t in recorded and 0 <= out[t][k] < num_counters:
                    load[out[t][k]] += 1
    return torch.tensor(out, dtype=ids.dtype).view(ids.shape), torch.tensor(load, dtype=torch.int64)


def _good_args() -> dict[str, torch.Tensor]:
    return {
        "ids": torch.zeros((4, 2), dtype=torch.int64),
        "table": table(),
        "load": torch.zeros(NUM_PHYSICAL, dtype=torch.int32),
        "record": torch.tensor(True),
        "unpadded": torch.tensor(4),
        "layout": torch.tensor([0, 1, 0, 0]),
    }


#: Metadata rules: (name, replaced arguments (builders), regex the message must match). Every path
#: (torch form, Triton, fake) must raise ValueError with one and the same message.
BAD_ARGUMENTS: list[tuple[str, dict, str]] = [
    (
        "ids-1d",
        {"ids": lambda: torch.zeros(4, dtype=torch.int64)},
        r"topk_ids must be int32 or int64 \(T, K\)",
    ),
    (
        "ids-3d",
        {"ids": lambda: torch.zeros((2, 2, 2), dtype=torch.int32)},
        r"topk_ids must be .* \(2, 2, 2\)",
    ),
    (
        "ids-float",
        {"ids": lambda: torch.zeros((4, 2))},
        r"topk_ids must be int32 or int64 \(T, K\), got torch.float32",
    ),
    ("ids-int16", {"ids": lambda: torch.zeros((4, 2), dtype=torch.int16)}, r"got torch.int16 \(4, 2\)"),
    (
        "table-int64",
        {"table": lambda: torch.zeros((8, 16), dtype=torch.int64)},
        r"table must be int32 \(rows, E\)",
    ),
    (
        "table-1d",
        {"table": lambda: torch.zeros(16, dtype=torch.int32)},
        r"table must be int32 \(rows, E\), got .* \(16,\)",
    ),
    (
        "table-no-rows",
        {"table": lambda: torch.zeros((0, 13), dtype=torch.int32)},
        r"table must be non-empty .* \(0, 13\)",
    ),
    (
        "table-no-experts",
        {"table": lambda: torch.zeros((8, 0), dtype=torch.int32)},
        r"table must be non-empty .* \(8, 0\)",
    ),
    (
        "table-device",
        {"table": lambda: torch.zeros((8, 13), dtype=torch.int32, device="meta")},
        r"table is on meta, topk_ids on cpu",
    ),
    (
        "load-float",
        {"load": lambda: torch.zeros(NUM_PHYSICAL)},
        r"expert_load_view must be int32 or int64 \(P,\)",
    ),
    (
        "load-2d",
        {"load": lambda: torch.zeros((3, NUM_PHYSICAL), dtype=torch.int32)},
        r"expert_load_view must be .* \(3, 21\)",
    ),
    (
        "load-shorter-than-E",
        {"load": lambda: torch.zeros(NUM_LOGICAL - 1, dtype=torch.int32)},
        r"expert_load_view has 12 counters, fewer than the table's E = 13",
    ),
    (
        "load-stride-0",
        {"load": lambda: torch.zeros(1, dtype=torch.int32).expand(NUM_PHYSICAL)},
        r"stride-0 \(expanded\) view, got shape \(21,\) stride \(0,\)",
    ),
    (
        "load-device",
        {"load": lambda: torch.zeros(NUM_PHYSICAL, dtype=torch.int32, device="meta")},
        r"expert_load_view is on meta, topk_ids on cpu",
    ),
    (
        "record-int",
        {"record": lambda: torch.tensor(1)},
        r"record_enabled must be a 0-d bool tensor, got torch.int64 \(\)",
    ),
    (
        "record-1d",
        {"record": lambda: torch.tensor([True])},
        r"record_enabled must be a 0-d bool tensor, got torch.bool \(1,\)",
    ),
    (
        "record-device",
        {"record": lambda: torch.tensor(True, device="meta")},
        r"record_enabled is on meta, topk_ids on cpu",
    ),
    (
        "unpadded-1d",
        {"unpadded": lambda: torch.tensor([4])},
        r"num_unpadded_tokens must be a 0-d int32 or int64 tensor",
    ),
    (
        "unpadded-float",
        {"unpadded": lambda: torch.tensor(4.0)},
        r"num_unpadded_tokens must be .* got torch.float32",
    ),
    (
        "unpadded-device",
        {"unpadded": lambda: torch.tensor(4, device="meta")},
        r"num_unpadded_tokens is on meta, topk_ids on cpu",
    ),
    (
        "layout-short",
        {"layout": lambda: torch.tensor([0, 1, 0])},
        r"row_layout must be int32 or int64 \(4,\) .* got torch.int64 \(3,\)",
    ),
    (
        "layout-float",
        {"layout": lambda: torch.tensor([0.0, 1.0, 0.0, 0.0])},
        r"row_layout must be .* got torch.float32 \(4,\)",
    ),
    (
        "layout-device",
        {"layout": lambda: torch.tensor([0, 1, 0, 0], device="meta")},
        r"row_layout is on meta, topk_ids on cpu",
    ),
]

#: The rules that concern map_to_physical too (only ids and table).
MAP_RULES = tuple(name for name, change, _ in BAD_ARGUMENTS if set(change) <= {"ids", "table"})


def bad_arguments(name: str) -> dict[str, torch.Tensor]:
    """The arguments of rule ``name``: valid ones with that rule's replacement."""
    args = _good_args()
    change = next(change for rule, change, _ in BAD_ARGUMENTS if rule == name)
    args.update({key: build() for key, build in change.items()})
    return args


# ---------------------------------------------------------------------------------------------------
# The batch split (ascend_eplb.dataplane.split): cases run by the torch form and the Triton worker.

#: Ranks of the split cases: P = 21 slots of :func:`placement` on 7 ranks of 3.
SPLIT_RANKS = 7


def split_lookup(big: bool = False):
    """A lookup with split inputs: :func:`placement` on :data:`SPLIT_RANKS` ranks, or (``big``) the
    :data:`DEFAULT_LOOKUP` sizes on 8 ranks (M = 33, X = 32)."""
    from ascend_eplb.dataplane import ReplicaLookup

    if not big:
        lookup = ReplicaLookup(
            NUM_LOGICAL, "cpu", rows=ROWS, num_physical_experts=NUM_PHYSICAL, num_ranks=SPLIT_RANKS
        )
        lookup.refresh_(*placement())
        return lookup
    rows, num_logical, num_physical, _ = DEFAULT_LOOKUP
    kept = big_lookup()
    lookup = ReplicaLookup(num_logical, "cpu", rows=rows, num_physical_experts=num_physical, num_ranks=8)
    gen = torch.Generator().manual_seed(3)
    hot = torch.randperm(num_logical, generator=gen)[: num_physical - num_logical]
    l2p = torch.full((num_logical, 2), -1, dtype=torch.int64)
    l2p[:, 0] = torch.randperm(num_logical, generator=gen)
    l2p[hot, 1] = torch.arange(num_logical, num_physical)
    lookup.refresh_(l2p, 1 + (l2p[:, 1] >= 0).to(torch.int64))
    assert torch.equal(lookup.table, kept.table)  # big_lookup's placement
    return lookup


def split_cases() -> list[dict]:
    """Split cases: token counts, id and load dtypes, padding, layouts, global counts, steps, stats."""
    cases = []
    for num_tokens in (0, 1, ROWS + 1, 300, 2500):
        for ids_dtype in ID_DTYPES:
            cases.append(
                {"num_tokens": num_tokens, "ids_dtype": ids_dtype, "unpadded": num_tokens - num_tokens // 5}
            )
    cases += [
        {"num_tokens": 300, "layout": (3, 1, 0, 0), "unpadded": 290},
        {"num_tokens": 300, "layout": (2, 1, -1, 0), "unpadded": 290},
        {"num_tokens": 300, "layout": (0, 3, 1, 0), "unpadded": 70},
        {"num_tokens": 300, "layout": (0, 4, 3, 2), "unpadded": 200},
        {"num_tokens": 300, "unpadded": 250, "global": True},
        {"num_tokens": 300, "unpadded": 300, "steps": 0},
        {"num_tokens": 300, "unpadded": 300, "steps": 3, "record": False},
        {"num_tokens": 300, "unpadded": 999, "load_dtype": torch.int64},
        {"num_tokens": 1025, "unpadded": 1000, "big": True},
    ]
    for i, case in enumerate(cases):
        case.setdefault("ids_dtype", torch.int32)
        case.setdefault("load_dtype", torch.int32)
        case.setdefault("steps", 8)
        case.setdefault("record", True)
        case["seed"] = 100 + i
        case["name"] = (
            "split-"
            + "-".join(
                f"{k}={v}" for k, v in case.items() if k not in ("seed",) and not isinstance(v, torch.dtype)
            )
            + f"-{str(case['ids_dtype'])[6:]}-{str(case['load_dtype'])[6:]}"
        )
    return cases


def split_case_inputs(case: dict) -> dict:
    """The op's arguments of one split case (fresh load view and stats each call): hot experts 0 and 1
    (3 replicas each) take a third of the selections; ids outside ``[0, E)`` appear."""
    gen = torch.Generator().manual_seed(case["seed"])
    big = case.get("big", False)
    lookup = split_lookup(big)
    num_logical = lookup.num_logical_experts
    top_k = DEFAULT_LOOKUP[3] if big else TOP_K
    num_physical = lookup.physical_id_bound
    ids = torch.randint(-1, num_logical + 1, (case["num_tokens"], top_k), generator=gen)
    hot = torch.rand(ids.shape, generator=gen) < 0.35
    ids = torch.where(hot, torch.randint(0, 2, ids.shape, generator=gen), ids).to(case["ids_dtype"])
    unpadded = torch.tensor(case["unpadded"])
    layout = torch.tensor(case["layout"]) if "layout" in case else None
    counts = prefix = None
    if case.get("global"):
        from ascend_eplb.dataplane import split_counts

        mine = split_counts(ids, num_logical, unpadded, layout)
        prefix = (mine * 2 + 1) * (mine > 0)  # two lower ranks' counts, as an all-gather would give
        counts = prefix + mine + mine // 3
    return {
        "ids": ids,
        "table": lookup.table,
        "split": lookup.split_inputs,
        "load": torch.zeros(num_physical, dtype=case["load_dtype"]),
        "record": torch.tensor(case["record"]),
        "unpadded": unpadded,
        "layout": layout,
        "counts": counts,
        "prefix": prefix,
        "stats": torch.zeros(3),
        "steps": case["steps"],
    }


def call_split(args: dict) -> torch.Tensor:
    from ascend_eplb.dataplane import map_to_physical_split_and_record

    return map_to_physical_split_and_record(
        args["ids"],
        args["table"],
        *args["split"],
        args["load"],
        args["record"],
        args["unpadded"],
        args["layout"],
        args["counts"],
        args["prefix"],
        args["stats"],
        args["steps"],
    )


def split_reference(args: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Loop reference of the assignment: the selections that take shares, in row order, go to the replica
    whose boundaries (``split_boundaries`` of the counts) hold their occurrence rank (plus the prefix);
    the others read the table (row ``(t + offset) % rows``); then the recorded rows' counts."""
    from ascend_eplb.dataplane import split_boundaries, split_counts

    ids, table_ = args["ids"], args["table"]
    slots = args["split"][0]
    num_experts = table_.shape[1]
    layout = tuple(args["layout"].tolist()) if args["layout"] is not None else (0, 1, 0, 0)
    offset, num_slices = layout[0], layout[1]
    unpadded = int(args["unpadded"])
    counts = args["counts"]
    if counts is None:
        counts = split_counts(ids, num_experts, args["unpadded"], args["layout"])
    bounds = split_boundaries(counts, *args["split"], steps=args["steps"]).tolist()
    prefix = [0] * num_experts if args["prefix"] is None else args["prefix"].tolist()
    limit = ids.shape[0] if num_slices > 1 else unpadded
    seen = [0] * num_experts
    out = [[-1] * ids.shape[1] for _ in range(ids.shape[0])]
    for t, row in enumerate(ids.tolist()):
        for k, e in enumerate(row):
            if not 0 <= e < num_experts:
                continue
            if t < limit:
                q = seen[e] + prefix[e]
                seen[e] += 1
                used = int((slots[e] >= 0).sum())
                replica = min(sum(1 for b in bounds[e] if b <= q), used - 1)
                out[t][k] = int(slots[e, replica])
            else:
                out[t][k] = int(table_[(t + offset) % table_.shape[0], e])
    _, _, recording_slice, local_chunk = layout
    size = ids.shape[0] // max(num_slices, 1)
    real = min(max(unpadded - local_chunk * size, 0), size) if bool(args["record"]) else 0
    recorded = range(recording_slice * size, recording_slice * size + real) if recording_slice >= 0 else []
    load = [0] * len(args["load"])
    for t in recorded:
        for p in out[t]:
            if 0 <= p < len(load):
                load[p] += 1
    return torch.tensor(out, dtype=ids.dtype).view(ids.shape), torch.tensor(load, dtype=torch.int64)
