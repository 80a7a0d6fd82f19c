"""One MoE layer's expert transfer between 2 ranks: ``AscendGlooEplbCommunicator.execute`` against raw
Gloo ``batch_isend_irecv`` of the very same tensors, in the same run, interleaved.

Default: 16 experts of 4 MiB (bf16) cross between the ranks, 8 each way (64 MiB per repetition).
The raw baseline sends the weight rows and receives straight into the destination rows (possible
only because they are CPU tensors here). ``execute`` reads and writes them directly too (the default
host path); "staged" forces staging of host tensors (``stage_host_tensors=True``): it copies each
send row into its pool buffer and each received buffer into its destination row, the copies a
device transfer makes (device-to-host, host-to-device), pipelined with the Gloo transfer as on a
device. Ratio = raw time / execute time (1.0 = no overhead), printed beside its target (>= 0.9).
``execute`` includes its plan handshake with the peer (one round trip of 48-byte headers before
the payload); its median is reported per rank. ``--expert-kib 64`` shows it on small experts, where
it weighs most.

On a host without an accelerator the staging copies are ``memcpy`` on the same cores Gloo's threads
use, so they cannot hide behind the transfer the way a device's DMA copies can: "copies alone" times
the same copies without any transfer, and the CPU columns give the process CPU time (all threads)
per repetition, so the two can be read side by side.

    hatch run python benchmarks/bench_execute_vs_raw_gloo.py [--expert-kib 64]   # in packages/eplb-movement
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import resource
import statistics
import tempfile
import time
from queue import Empty

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

TARGET = 0.9


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process, Gloo's included
    return usage.ru_utime + usage.ru_stime


def _rank(rank: int, args: argparse.Namespace, init: str, queue: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    from ascend_eplb.movement import AscendGlooEplbCommunicator, StagingPool

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=300)
    )
    group = dist.group.WORLD
    peer = 1 - rank
    numel = args.expert_kib * (1 << 10) // 2  # bf16
    half = args.experts // 2
    weights = torch.randn(args.experts, numel).to(torch.bfloat16)  # this rank's expert rows
    dest_raw = torch.empty(half, numel, dtype=torch.bfloat16)
    dest_ours = torch.empty(half, numel, dtype=torch.bfloat16)
    dest_staged = torch.empty(half, numel, dtype=torch.bfloat16)
    comm = AscendGlooEplbCommunicator(group, staging_pool=StagingPool(1 << 31), timeout_s=300)
    staged = AscendGlooEplbCommunicator(
        group, staging_pool=StagingPool(1 << 31), timeout_s=300, stage_host_tensors=True
    )

    def raw() -> None:
        ops = [dist.P2POp(dist.isend, weights[i], peer, group) for i in range(half)]
        ops += [dist.P2POp(dist.irecv, dest_raw[i], peer, group) for i in range(half)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()

    staging_in = torch.empty(half, numel, dtype=torch.bfloat16)
    staging_out = torch.empty(half, numel, dtype=torch.bfloat16)
    dest_copies = torch.empty(half, numel, dtype=torch.bfloat16)

    def copies() -> None:  # what staging adds on this host, without any transfer
        staging_in.copy_(weights[:half])
        dest_copies.copy_(staging_out)

    def execute(c: AscendGlooEplbCommunicator, dest: torch.Tensor) -> None:
        for i in range(half):
            c.add_send([weights[i]], peer, expert_id=rank * args.experts + i)
        for i in range(half):
            c.add_recv([dest[i]], peer, expert_id=peer * args.experts + i)
        c.execute()

    runs = (
        ("raw", raw),
        ("execute", lambda: execute(comm, dest_ours)),
        ("staged", lambda: execute(staged, dest_staged)),
        ("copies", copies),
    )
    times: dict[str, list[float]] = {name: [] for name, _ in runs}
    cpu: dict[str, list[float]] = {name: [] for name, _ in runs}
    phases = []
    handshakes = []
    for rep in range(args.warmup + args.reps):
        for name, fn in runs:
            dist.barrier(group)
            c0, t0 = _cpu_s(), time.perf_counter()
            fn()
            dt, dc = time.perf_counter() - t0, _cpu_s() - c0
            if rep >= args.warmup:
                times[name].append(dt)
                cpu[name].append(dc)
                if name == "staged":
                    phases.append(staged.last_stats)
                if name == "execute":
                    handshakes.append(comm.last_stats.handshake_s)
    assert torch.equal(dest_raw, dest_ours), "execute and raw Gloo received different bytes"
    assert torch.equal(dest_raw, dest_staged), "staged execute and raw Gloo received different bytes"
    queue.put(
        {
            "rank": rank,
            "raw": statistics.median(times["raw"]),
            "execute": statistics.median(times["execute"]),
            "staged": statistics.median(times["staged"]),
            "copies": statistics.median(times["copies"]),
            "cpu": {name: statistics.median(values) for name, values in cpu.items()},
            "handshake": statistics.median(handshakes),
            "staged_handshake": statistics.median(s.handshake_s for s in phases),
            "d2h": statistics.median(s.d2h_s for s in phases),
            "gloo": statistics.median(s.gloo_s for s in phases),
            "h2d": statistics.median(s.h2d_s for s in phases),
            "pool_bytes": staged.staging_pool.size_bytes,
        }
    )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--experts", type=int, default=16, help="experts crossing per layer (half each way)")
    parser.add_argument("--expert-kib", type=int, default=4096, help="KiB per expert (default 4 MiB)")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()

    import ascend_eplb.movement  # noqa: F401  (import vLLM once, before forking the ranks)

    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/rendezvous"
        procs = [ctx.Process(target=_rank, args=(r, args, init, queue)) for r in range(2)]
        for proc in procs:
            proc.start()
        results = []
        while len(results) < len(procs):
            try:
                results.append(queue.get(timeout=1))
            except Empty:
                if any(proc.exitcode not in (None, 0) for proc in procs):
                    raise SystemExit(
                        f"a rank failed: exit codes {[proc.exitcode for proc in procs]}"
                    ) from None
        results.sort(key=lambda r: r["rank"])
        for proc in procs:
            proc.join()
    moved_mib = args.experts * args.expert_kib / 1024
    print(
        f"{args.experts} experts x {args.expert_kib} KiB between 2 ranks ({moved_mib:g} MiB per layer), "
        f"median of {args.reps} interleaved repetitions"
    )
    header = (
        f"| rank | raw Gloo ms | execute ms | ratio (target >= {TARGET:g}) | handshake ms "
        f"| staged execute ms | staged ratio (target >= {TARGET:g}) | staged D2H ms | staged handshake ms "
        "| staged Gloo ms | staged H2D ms | copies alone ms | CPU ms raw / execute / staged | staging MiB |"
    )
    print(header)
    print("|---" * (header.count("|") - 1) + "|")

    def ratio(value: float) -> str:
        return f"{value:.2f} ({'met' if value >= TARGET else 'missed'})"

    for r in results:
        c = r["cpu"]
        print(
            f"| {r['rank']} | {r['raw'] * 1e3:.1f} | {r['execute'] * 1e3:.1f} | "
            f"{ratio(r['raw'] / r['execute'])} | {r['handshake'] * 1e3:.2f} | "
            f"{r['staged'] * 1e3:.1f} | {ratio(r['raw'] / r['staged'])} | {r['d2h'] * 1e3:.1f} | "
            f"{r['staged_handshake'] * 1e3:.2f} | {r['gloo'] * 1e3:.1f} | {r['h2d'] * 1e3:.1f} | "
            f"{r['copies'] * 1e3:.1f} | {c['raw'] * 1e3:.0f} / {c['execute'] * 1e3:.0f} / "
            f"{c['staged'] * 1e3:.0f} | {r['pool_bytes'] / (1 << 20):.1f} |"
        )
    print(
        f"load average (1 min) at the end: {os.getloadavg()[0]:.1f} on {len(os.sched_getaffinity(0))} cores"
    )
    print(
        f"throughput (MiB/s, rank 0): raw {moved_mib / results[0]['raw']:.0f}, "
        f"execute {moved_mib / results[0]['execute']:.0f}, staged {moved_mib / results[0]['staged']:.0f}"
    )


if __name__ == "__main__":
    main()
