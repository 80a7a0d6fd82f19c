"""How evenly small decode batches spread over a hot expert's replicas, per row layout, new rule vs old.

Every token of every rank routes to one hot logical expert with ``R`` replicas (the worst case for
spread); each rank holds ``b`` decode tokens (1 to 4). For each row layout of
``ascend_eplb.control.layout`` the batch each rank routes is rebuilt (TP peers share rows; a gathered
batch concatenates the DP ranks' slices), mapped through the real ``map_to_physical_and_record`` with
the rank's row layout, and the tokens each replica computes are counted once per token (a row that
several ranks route is one token). Printed: the busiest replica's share over the ideal ``1 / R``
(1.00 = even), for the new rule and for vLLM Ascend's old rule (``(row + ep_rank + e)``, phase =
EP rank, offset 0). Under the old rule, ranks that share rows may choose different replicas: those
rows are counted as "disagreements" (the token's expert computed twice or not at all), and its spread
figure is then not meaningful.

    python packages/eplb-dataplane/benchmarks/bench_replica_spread.py

Shape letters (GLOSSARY.md): E logical experts, P physical experts, N ranks, K top-k (1 here).
"""

from __future__ import annotations

import torch

from ascend_eplb.dataplane import build_replica_table, map_to_physical_and_record

E = 8
HOT = 3


def _table(replicas: int, phase: int) -> torch.Tensor:
    # Logical expert e in slot e; the hot expert's extra replicas in slots E .. E + R - 2.
    l2p = torch.full((E, replicas), -1, dtype=torch.int64)
    l2p[:, 0] = torch.arange(E)
    l2p[HOT, 1:] = torch.arange(E, E + replicas - 1)
    count = torch.ones(E, dtype=torch.int64)
    count[HOT] = replicas
    # phase 0 is the serving table (ReplicaLookup's); vLLM Ascend's old rule puts the EP rank there.
    return build_replica_table(l2p, count, phase, rows=1024, num_physical_experts=E + replicas - 1)


def _layout(rows: str, dp: int, tp: int, d: int, t: int) -> list[int]:
    ep = d * tp + t
    return {
        "replicated": [d, 1, 0 if t == 0 else -1, 0],
        "split": [ep, 1, 0, 0],
        "gathered": [0, dp, d if t == 0 else -1, 0],
    }[rows]


def spread(rows: str, dp: int, tp: int, replicas: int, b: int, *, old: bool) -> tuple[float, int]:
    """(busiest replica share / ideal, disagreeing rows) for one layout and batch size."""
    chosen: dict[tuple[int, int], set[int]] = {}  # (dp rank, token) -> replicas chosen by its routers
    for d in range(dp):
        for t in range(tp):
            ep = d * tp + t
            table = _table(replicas, ep if old else 0)
            if rows == "replicated":
                tokens = [(d, i) for i in range(b)]
            elif rows == "split":  # each rank routes its own b tokens (TP ranks hold distinct rows)
                tokens = [(ep, i) for i in range(b)]
            else:  # gathered: every rank routes every DP rank's b tokens, in DP order
                tokens = [(x, i) for x in range(dp) for i in range(b)]
            ids = torch.full((len(tokens), 1), HOT, dtype=torch.int64)
            layout = None if old else torch.tensor(_layout(rows, dp, tp, d, t))
            load = torch.zeros(E + replicas - 1, dtype=torch.int64)
            physical = map_to_physical_and_record(
                ids, table, load, torch.tensor(False), torch.tensor(0), layout
            )
            for token, p in zip(tokens, physical[:, 0].tolist(), strict=True):
                chosen.setdefault(token, set()).add(p)
    per_replica = torch.zeros(E + replicas - 1)
    disagreements = 0
    for replica_set in chosen.values():
        if len(replica_set) > 1:
            disagreements += 1
        per_replica[min(replica_set)] += 1
    hot = torch.cat([per_replica[HOT : HOT + 1], per_replica[E:]])
    return float(hot.max() / (hot.sum() / replicas)), disagreements


def main() -> None:
    layouts = (
        ("replicated", 1, 4),
        ("replicated", 2, 2),
        ("split", 4, 1),
        ("gathered", 4, 1),
        ("gathered", 2, 2),
    )
    print("| rows | DP x TP | R | b=1 | b=2 | b=3 | b=4 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for rows, dp, tp in layouts:
        for replicas in (2, 3, 4):
            cells = []
            for b in range(1, 5):
                new, new_bad = spread(rows, dp, tp, replicas, b, old=False)
                assert new_bad == 0, (rows, dp, tp, replicas, b)
                old, old_bad = spread(rows, dp, tp, replicas, b, old=True)
                old_text = f"{old:.2f}" if old_bad == 0 else f"{old_bad} rows disagree"
                cells.append(f"{new:.2f} (old {old_text})")
            print(f"| {rows} | {dp} x {tp} | {replicas} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
