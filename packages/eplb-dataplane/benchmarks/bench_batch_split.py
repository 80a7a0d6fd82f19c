"""Issue 44's targets on real load: the batch split's executed balancedness beside the bound, and its cost.

Load: the ESFT translation trace embedded in the world package (``ascend_eplb.world.esft``: DeepSeek-V2-
Lite's routing, 26 MoE layers x 64 experts, top-6, 40 sequences, MIT). 8 ranks, 72 and 80 slots.
A batch is every token of ``b`` consecutive sequences (b = 1, 2, 4, 8; rows in token order, no
padding). Placements: upstream's ``DefaultEplbPolicy`` planned on the whole trace (judged on every
batch) and on the first batch (judged on the batches after it), as in the issue's table.

Per batch and layer, the balancedness (mean rank load / max rank load; mean over layers and batches):

* ``equal``: each replica ``c[e] / count[e]`` (the issue's "equal split");
* ``today``: what today's rule executes (``map_to_physical_and_record``, replica
  ``((t % rows) + e) % count[e]``), read from the recorded load;
* ``split``: what the batch split executes (``map_to_physical_split_and_record``, ``--steps``), read
  from the recorded load;
* ``bound``: the exact fractional bound (``ascend_eplb.control.measures.split_bound``: the rank sets
  enumerated, 255 at 8 ranks), checked against a min cut (networkx) on the first batch's layers.

Targets (issue 44): ``split`` within 0.02 of ``bound`` at 1 sequence and within 0.01 at 2, 4 and 8, on
both placements (72 slots; 80 printed beside). Then the bound each policy's placement allows (upstream's
default, the migration-aware policy, and the migration-aware policy placing for the split). Then the
CPU cost: the split op against today's map-and-record op as dispatched, T = 256, 4096, 32768, K = 8,
E = 256, P = 288, N = 8 (interleaved rounds, medians; aim: at most 2x at the first two); and the split
rows' all-gather of ``E`` counts per MoE layer on 2 and 4 real rank processes over Gloo (the launcher).

Run (repository root): ``hatch run python packages/eplb-dataplane/benchmarks/bench_batch_split.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import numpy as np
import torch
from vllm.distributed.eplb.eplb_state import EplbState
from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

from ascend_eplb.control import measures
from ascend_eplb.control.policy import MigrationAwarePolicy, SplitAwarePolicy
from ascend_eplb.dataplane import (
    DEFAULT_SPLIT_STEPS,
    ReplicaLookup,
    executed_rank_loads,
    map_to_physical_and_record,
    map_to_physical_split_and_record,
    replica_maps,
)
from ascend_eplb.world.esft import (
    ESFT_NUM_LOGICAL_EXPERTS,
    ESFT_NUM_MOE_LAYERS,
    ESFT_NUM_SEQUENCES,
    esft_sequences,
)

RANKS = 8
SLOTS = (72, 80)
BATCHES = (1, 2, 4, 8)
E, L = ESFT_NUM_LOGICAL_EXPERTS, ESFT_NUM_MOE_LAYERS


def trace() -> list[list[torch.Tensor]]:
    """``[layer][sequence]`` int32 ``(tokens, K)`` expert ids."""
    return [[s.to(torch.int32) for s in esft_sequences(layer, ESFT_NUM_SEQUENCES)] for layer in range(L)]


def batches(ids: list[list[torch.Tensor]], size: int) -> list[list[torch.Tensor]]:
    """``[batch][layer]`` ids of ``size`` consecutive sequences."""
    return [
        [torch.cat(ids[layer][i : i + size]) for layer in range(L)]
        for i in range(0, ESFT_NUM_SEQUENCES, size)
    ]


def counts(batch: list[torch.Tensor]) -> torch.Tensor:
    """int64 ``(L, E)`` selections per logical expert."""
    return torch.stack([torch.bincount(ids.flatten().long(), minlength=E) for ids in batch])


def upstream_placement(load: torch.Tensor, slots: int) -> torch.Tensor:
    initial = EplbState.build_initial_global_physical_to_logical_map(E, slots - E)
    old = torch.tensor([list(initial)] * L)
    return DefaultEplbPolicy.rebalance_experts(load.float(), slots, 1, 1, RANKS, old)


def lookups(placement: torch.Tensor) -> list[ReplicaLookup]:
    """One lookup per layer of ``placement`` (int64 ``(L, P)``), with the split's inputs."""
    out = []
    for layer in range(L):
        lookup = ReplicaLookup(E, "cpu", num_physical_experts=placement.shape[1], num_ranks=RANKS)
        lookup.refresh_(*replica_maps(placement[layer], E))
        out.append(lookup)
    return out


def executed(ids: torch.Tensor, lookup: ReplicaLookup, split: bool, steps: int) -> float:
    """Balancedness of the rank loads recorded by today's op or the split op on one batch's layer."""
    ranks = executed_rank_loads(ids, lookup, split=split, steps=steps).double()
    return float(ranks.mean() / ranks.max())


def judge(placement: torch.Tensor, judged: list[list[torch.Tensor]], steps: int) -> dict[str, float]:
    layer_lookups = lookups(placement)
    rows = {"equal": [], "today": [], "split": [], "bound": []}
    for batch in judged:
        load = counts(batch)
        rows["equal"].append(measures.balancedness(load, placement, RANKS).mean().item())
        rows["bound"].append(measures.split_bound(load, placement, RANKS).mean().item())
        rows["today"].append(
            np.mean([executed(ids, lk, False, steps) for ids, lk in zip(batch, layer_lookups, strict=True)])
        )
        rows["split"].append(
            np.mean([executed(ids, lk, True, steps) for ids, lk in zip(batch, layer_lookups, strict=True)])
        )
    return {k: float(np.mean(v)) for k, v in rows.items()}


def check_bound(load: torch.Tensor, placement: torch.Tensor) -> float:
    """The largest difference between the enumerated bound and the min-cut one on these layers."""
    held = measures._holdings(placement.numpy(), RANKS, E) > 0
    enumerated = measures.split_bound(load, placement, RANKS).numpy()
    cut = [
        float(load[i].sum()) / RANKS / measures._closure_peak(load[i].double().numpy(), held[i])
        for i in range(L)
    ]
    return float(np.abs(enumerated - np.array(cut)).max())


def targets(ids: list[list[torch.Tensor]], steps: int) -> bool:
    whole = counts([torch.cat(layer) for layer in ids])
    print(
        "\n== balancedness per batch (mean over layers and batches): equal split (fractional) / today's rule "
        "executed / the split executed / the bound; gap = bound - split"
    )
    header = f"{'slots':>5} {'b':>2} {'placement':>12} {'equal':>7} {'today':>7} {'split':>7} {'bound':>7}"
    print(f"{header} {'gap':>7} {'target':>7}")
    ok = True
    for slots in SLOTS:
        for size in BATCHES:
            judged_batches = batches(ids, size)
            for name, plan_on, judged in (
                ("whole trace", whole, judged_batches),
                ("first batch", counts(judged_batches[0]), judged_batches[1:]),
            ):
                placement = upstream_placement(plan_on, slots)
                if size == 1 and name == "whole trace":
                    worst = check_bound(counts(judged_batches[0]), placement)
                    assert worst < 1e-9, f"enumerated bound differs from the min cut by {worst}"
                got = judge(placement, judged, steps)
                gap = got["bound"] - got["split"]
                target = 0.02 if size == 1 else 0.01
                passed = gap <= target
                if slots == 72:
                    ok &= passed
                verdict = ("PASS" if passed else "FAIL") if slots == 72 else ("(ok)" if passed else "(over)")
                print(
                    f"{slots:>5} {size:>2} {name:>12} {got['equal']:>7.4f} {got['today']:>7.4f} "
                    f"{got['split']:>7.4f} {got['bound']:>7.4f} {gap:>7.4f} {target:>7.2f} {verdict}",
                    flush=True,
                )
    return ok


def policies(ids: list[list[torch.Tensor]]) -> None:
    """The bound each policy's placement allows (item 4), planned on the whole trace from upstream's
    initial placement, judged on every batch."""
    whole = counts([torch.cat(layer) for layer in ids])
    print("\n== the bound each policy's placement allows (planned on the whole trace), mean over batches")
    print(
        f"{'slots':>5} {'policy':>34} " + " ".join(f"{'b=' + str(b):>7}" for b in BATCHES) + f" {'moves':>6}"
    )
    for slots in SLOTS:
        initial = torch.tensor(
            [list(EplbState.build_initial_global_physical_to_logical_map(E, slots - E))] * L
        )
        rows = {
            "upstream default": upstream_placement(whole, slots),
            "migration-aware": MigrationAwarePolicy.rebalance_experts(whole, slots, 1, 1, RANKS, initial),
        }
        rows["split-aware"] = SplitAwarePolicy.rebalance_experts(whole, slots, 1, 1, RANKS, initial)
        # Without a placement in force both return upstream's; the split-aware one linked.
        rows["split-aware, no placement in force"] = SplitAwarePolicy.rebalance_experts(
            whole, slots, 1, 1, RANKS
        )
        for name, placement in rows.items():
            bounds = []
            for size in BATCHES:
                judged = batches(ids, size)
                bounds.append(
                    np.mean([measures.split_bound(counts(b), placement, RANKS).mean().item() for b in judged])
                )
            moves = int(measures.moved_experts(initial, placement, RANKS).sum())
            print(f"{slots:>5} {name:>34} " + " ".join(f"{b:>7.4f}" for b in bounds) + f" {moves:>6}")


def cost(rounds: int) -> None:
    num_logical, num_physical, top_k = 256, 288, 8
    gen = torch.Generator().manual_seed(0)
    hot = torch.randperm(num_logical, generator=gen)[: num_physical - num_logical]
    l2p = torch.full((num_logical, 2), -1, dtype=torch.int64)
    l2p[:, 0] = torch.randperm(num_logical, generator=gen)
    l2p[hot, 1] = torch.arange(num_logical, num_physical)
    lookup = ReplicaLookup(num_logical, "cpu", num_physical_experts=num_physical, num_ranks=RANKS)
    lookup.refresh_(l2p, 1 + (l2p[:, 1] >= 0).to(torch.int64))
    print(
        f"\n== CPU cost (torch form, {torch.get_num_threads()} thread(s), thread CPU time): the split op "
        "against today's op, "
        f"K={top_k} E={num_logical} P={num_physical} N={RANKS}, 1/8 of the rows padding, median of {rounds} "
        "interleaved rounds"
    )
    print(f"{'T':>6} {'today (us)':>11} {'split (us)':>11} {'ratio':>6}  aim")
    for num_tokens in (256, 4096, 32768):
        ids = torch.randint(0, num_logical, (num_tokens, top_k), generator=gen, dtype=torch.int32)
        load = torch.zeros(num_physical, dtype=torch.int32)
        flag, real = torch.tensor(True), torch.tensor(num_tokens - num_tokens // 8)
        calls = {
            "today": (map_to_physical_and_record, (ids, lookup.table, load, flag, real)),
            "split": (
                map_to_physical_split_and_record,
                (ids, lookup.table, *lookup.split_inputs, load, flag, real),
            ),
        }
        times = {"today": [], "split": [], "ratio": []}
        repeat = max(3, 8192 // num_tokens)
        for _ in range(rounds):
            for name, (fn, fn_args) in calls.items():
                # This thread's CPU time (torch runs on it alone): the shared host's other jobs do not count.
                start = time.thread_time()
                for _ in range(repeat):
                    fn(*fn_args)
                times[name].append((time.thread_time() - start) / repeat * 1e6)
            times["ratio"].append(times["split"][-1] / times["today"][-1])
        med = {k: statistics.median(v) for k, v in times.items()}
        aim = "2x" if num_tokens <= 4096 else "-"
        print(f"{num_tokens:>6} {med['today']:>11.1f} {med['split']:>11.1f} {med['ratio']:>6.2f}  {aim}")


def gather_world(ctx, num_experts: int, iterations: int) -> dict[str, float]:
    """One rank of the split rows' all-gather: this rank's ``(1, E)`` int64 counts gathered into
    ``(N, E)`` over Gloo, as vLLM's ``GroupCoordinator.all_gather(dim=0)`` on its CPU communicator does;
    the median microseconds of ``iterations`` calls after 10 warm-up calls."""
    import warnings

    import torch.distributed as dist

    # torch names all_gather_into_tensor deprecated; vLLM's CPU communicator calls it, as here.
    warnings.filterwarnings("ignore", "`torch.distributed.all_gather_into_tensor` is deprecated")
    ctx.init_gloo()
    local = torch.arange(num_experts, dtype=torch.int64).unsqueeze(0) + ctx.rank
    every = local.new_empty(ctx.world_size, num_experts)
    times = []
    for i in range(10 + iterations):
        dist.barrier()
        start = time.perf_counter()
        dist.all_gather_into_tensor(every, local)
        if i >= 10:
            times.append((time.perf_counter() - start) * 1e6)
    assert every[:, 0].tolist() == list(range(ctx.world_size))
    dist.destroy_process_group()
    return {"median_us": statistics.median(times)}


def gather_cost(iterations: int) -> None:
    """Split rows with global counts: the all-gather per MoE layer per forward, on real rank processes."""
    from ascend_eplb.launch import load_module, run_ranks

    me = load_module(Path(__file__))
    print(
        f"\n== split rows, replica_split=batch: the all-gather of E = 256 int64 counts per MoE layer per "
        f"forward over Gloo on this host (median of {iterations} calls, the slowest rank)"
    )
    for world in (2, 4):
        with tempfile.TemporaryDirectory() as tmp:
            results = run_ranks(
                me.gather_world, world_size=world, tmp_path=Path(tmp), args=(256, iterations), timeout_s=600
            )
        print(f"  {world} ranks: {max(r['median_us'] for r in results):.1f} us per layer")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=DEFAULT_SPLIT_STEPS, help="the solve's steps")
    parser.add_argument("--rounds", type=int, default=7, help="rounds of the cost measurement")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--gather-iterations", type=int, default=50, help="all-gathers timed per world")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ids = trace()
    print(
        f"ESFT translation trace: {ESFT_NUM_SEQUENCES} sequences, {L} MoE layers, {E} experts, top-6; "
        f"{RANKS} ranks; the split's solve: {args.steps} steps"
    )
    ok = targets(ids, args.steps)
    policies(ids)
    cost(args.rounds)
    gather_cost(args.gather_iterations)
    print(f"\n{'every target PASS' if ok else 'some target FAIL'} (72 slots; 80 slots shown beside)")


if __name__ == "__main__":
    main()
