"""Benchmark map_to_physical_and_record against its floor and the naive two-step form.

For T in {256, 4096, 32768} tokens, K = 8, E = 256 logical and P = 288 physical experts (32 hot
experts with a second replica), times, side by side in one run:

* ``fused``: ``map_to_physical_and_record`` as dispatched (map + masked recording, device scalars, no
  host sync): the Triton kernel on cuda (with triton installed), the torch form on cpu;
* ``gather floor``: the single gather of the same ids through the replica table (no validity
  handling, no recording) - nothing cheaper can map;
* ``naive``: the same gather, then the unpadded rows sliced on the host (``int(num_unpadded)``,
  a device-to-host sync) and counted with ``bincount``.

Usage (from the repository root)::

    python packages/eplb-dataplane/benchmarks/bench_map_and_record.py [--device cpu|cuda|npu]

On ``cuda`` it also runs the fused op once under ``torch.cuda.set_sync_debug_mode("error")``,
which raises on any host synchronisation. ``device_check.py`` beside it is the complete GPU check.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch.utils import benchmark

from ascend_eplb.dataplane import ReplicaLookup, map_to_physical_and_record
from ascend_eplb.dataplane._npu import default_device
from ascend_eplb.dataplane.ops import _gather_rows

NUM_LOGICAL, NUM_PHYSICAL, TOP_K = 256, 288, 8
TOKENS = (256, 4096, 32768)


def _lookup(device: str) -> ReplicaLookup:
    gen = torch.Generator().manual_seed(0)
    hot = torch.randperm(NUM_LOGICAL, generator=gen)[: NUM_PHYSICAL - NUM_LOGICAL]
    l2p = torch.full((NUM_LOGICAL, 2), -1, dtype=torch.int64)
    l2p[:, 0] = torch.randperm(NUM_LOGICAL, generator=gen)
    l2p[hot, 1] = torch.arange(NUM_LOGICAL, NUM_PHYSICAL)
    count = 1 + (l2p[:, 1] >= 0).to(torch.int64)
    lookup = ReplicaLookup(NUM_LOGICAL, device, num_physical_experts=NUM_PHYSICAL)
    lookup.refresh_(l2p, count)
    return lookup


def _naive(ids: torch.Tensor, table: torch.Tensor, load: torch.Tensor, num_unpadded: torch.Tensor) -> None:
    physical = _gather_rows(table, ids)
    counted = physical[: int(num_unpadded)].reshape(-1)  # host sync
    load.add_(torch.bincount(counted, minlength=load.numel()).to(load.dtype))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=default_device())
    parser.add_argument("--dtype", choices=("int32", "int64"), default="int32", help="topk_ids dtype")
    parser.add_argument("--min-run-time", type=float, default=0.5, help="seconds per measurement")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians reported)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument(
        "--clock",
        choices=("wall", "thread"),
        default="wall",
        help="wall: perf_counter; thread: this thread's CPU time (cpu, 1 thread only), which leaves "
        "out the time other processes hold the core on a loaded host",
    )
    args = parser.parse_args()
    if args.clock == "thread" and (torch.device(args.device).type != "cpu" or args.threads != 1):
        parser.error("--clock thread measures only the calling thread: use it with --device cpu --threads 1")
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    torch.set_num_threads(args.threads)
    device = args.device
    lookup = _lookup(device)
    table = lookup.table
    load = torch.zeros(NUM_PHYSICAL, dtype=torch.int32, device=device)
    record = torch.tensor(True, device=device)
    print(
        f"device={device} torch={torch.__version__} threads={torch.get_num_threads()} "
        f"rounds={args.rounds} K={TOP_K} E={NUM_LOGICAL} P={NUM_PHYSICAL} topk_ids={args.dtype} "
        f"clock={args.clock} "
        f"load average={' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print("| T | fused (us) | gather floor (us) | naive (us) | fused / floor | fused / naive |")
    print("|---:|---:|---:|---:|---:|---:|")
    for num_tokens in TOKENS:
        gen = torch.Generator().manual_seed(num_tokens)
        ids = torch.randint(0, NUM_LOGICAL, (num_tokens, TOP_K), generator=gen)
        ids = ids.to(device=device, dtype=getattr(torch, args.dtype))
        num_unpadded = torch.tensor(num_tokens - num_tokens // 8, device=device)
        env = {
            "fused": map_to_physical_and_record,
            "floor": _gather_rows,
            "naive": _naive,
            "ids": ids,
            "table": table,
            "load": load,
            "record": record,
            "n": num_unpadded,
        }
        statements = {
            "fused": "fused(ids, table, load, record, n)",
            "floor": "floor(table, ids)",
            "naive": "naive(ids, table, load, n)",
        }
        # Rounds interleave the three forms, so a burst of load on the host hits all of them; the
        # table gives the median over rounds of each time and of each round's ratios.
        rounds = {name: [] for name in statements}
        for _ in range(args.rounds):
            for name, stmt in statements.items():
                timer = benchmark.Timer(stmt, globals=env, num_threads=args.threads, timer=clock)
                rounds[name].append(timer.blocked_autorange(min_run_time=args.min_run_time).median * 1e6)
        fused, floor, naive = (torch.tensor(rounds[name]) for name in ("fused", "floor", "naive"))
        print(
            f"| {num_tokens} | {fused.median():.1f} | {floor.median():.1f} | {naive.median():.1f} "
            f"| {(fused / floor).median():.2f} | {(fused / naive).median():.2f} |"
        )
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                map_to_physical_and_record(ids, table, load, record, num_unpadded)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
            print(f"  T={num_tokens}: no host synchronisation under set_sync_debug_mode('error')")


if __name__ == "__main__":
    main()
