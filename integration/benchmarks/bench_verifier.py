"""What the serving verifier (``ASCEND_EPLB_VERIFY=1``) costs a serving step: the same world served with
the verifier off and on, in one run, side by side.

Each world is the serving worker of the main job (``ascend_eplb.testing.real_models.ServingWorker``:
the plugin, vLLM's loader and real model class, ``Mrv2EplbWiring`` with the watchdog, asynchronous
Gloo-staged rearrangement), by default vLLM's ``DeepseekV3ForCausalLM`` at the main job's shape
(64 routed experts, top-6, 4 MoE layers, 4 redundant, TP=4 x EP=4, 48-token batches of which 32 are
real, window 8, interval 16, 96 steps), without the EPLB-off oracle model: a step is what a serving
worker runs, runner points 7-9 and the forward. Worlds alternate off, on, off, on, ... (``--repeats``
pairs) so that a change of the machine's load hits both. Before each step every rank waits (untimed)
for its async worker to publish the layer in flight, then a barrier: layers commit at the same steps in
every world, so step ``i`` of an off world and of an on world do the same work but the verifier's.

Printed, each as the median over the pairs of ``on / off - 1`` (rank 0's steps): the step p50 beside
the target (``<= 5 %`` of step p50, issue 22) with each pair's ratio, the step mean, the CPU seconds of
a step summed over the ranks (p50), the p50 of the steps without a commit and the mean of the commit
steps; then the verifier's own time inside the on worlds (its step hook and its commit listener, timed
around each call): what the side-by-side ratios measure, without the noise between worlds.

    hatch run python integration/benchmarks/bench_verifier.py [--layers 26] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

TARGET = 0.05


def bench_rank(ctx: Any, folder: str, verify: bool, args: dict) -> dict:
    """One rank of one world: ``args["steps"]`` timed serving steps; returns per step the wall and CPU
    seconds, the layers committed and (verifier on) the verifier's own seconds."""
    os.environ["ASCEND_EPLB_VERIFY"] = "1" if verify else "0"
    import torch
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_ep_group

    from ascend_eplb.integration.verify import EplbVerifier
    from ascend_eplb.testing.real_models import ServingWorker

    worker = ServingWorker(
        ctx, folder, num_redundant_experts=args["redundant"], window_size=args["window"],
        step_interval=args["interval"], eplb_off=False,
    )  # fmt: skip
    controller, state = worker.wiring.controller, worker.state
    spent = [0.0]

    def timed(fn: Any) -> Any:
        def run(*a: Any) -> None:
            t = time.perf_counter()
            try:
                fn(*a)
            finally:
                spent[0] += time.perf_counter() - t

        return run

    def ours(fn: Any) -> bool:
        return isinstance(getattr(fn, "__self__", None), EplbVerifier)

    assert any(ours(h) for h in state.commit_listeners) == verify
    controller.step_hooks[:] = [timed(h) if ours(h) else h for h in controller.step_hooks]
    state.commit_listeners[:] = [timed(h) if ours(h) else h for h in state.commit_listeners]
    group = get_ep_group().cpu_group
    g = torch.Generator().manual_seed(args["seed"])
    vocab = worker.info.vocab_size
    worker.profile_run(torch.randint(0, vocab, (args["tokens"],), generator=g))
    step_s, cpu_s, verifier_s, commits = [], [], [], []
    for step in range(args["steps"]):
        ids = torch.randint(0, vocab, (args["tokens"],), generator=g)
        worker.wait_for_transfer(60.0)
        dist.barrier(group=group)
        log_len = len(state.commit_log)
        spent[0] = 0.0
        t0, c0 = time.perf_counter(), time.process_time()
        worker.forward_step(ids, num_unpadded_tokens=args["batch"], batch_has_prefill=step % 2 == 0)
        worker.end_step()
        step_s.append(time.perf_counter() - t0)
        cpu_s.append(time.process_time() - c0)  # this process, all its threads
        verifier_s.append(spent[0])
        commits.append(sum(e.kind == "refresh" for e in list(state.commit_log)[log_len:]))
    return {"step_s": step_s, "cpu_s": cpu_s, "verifier_s": verifier_s, "commits": commits}


def _p50(values: list[float]) -> float:
    return statistics.median(values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="deepseek-v3", choices=("deepseek-v3", "qwen3-moe", "mixtral"))
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--layers", type=int, default=4, help="MoE layers")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--redundant", type=int, default=4)
    parser.add_argument("--steps", type=int, default=96)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--interval", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48, help="padded batch (token ids per step)")
    parser.add_argument("--batch", type=int, default=32, help="real (unpadded) tokens of the batch")
    parser.add_argument("--repeats", type=int, default=4, help="off/on world pairs")
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args(argv)

    from ascend_eplb.testing import load_module, run_ranks, stop_fork_server
    from ascend_eplb.testing import real_models as rm

    bench = load_module(__file__)  # the rank function under a name every rank can import
    keys = ("redundant", "window", "interval", "steps", "tokens", "batch", "seed")
    args = {k: getattr(opts, k) for k in keys}
    pairs: list[dict[bool, list[dict]]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench-verifier-") as tmp:
            folder = rm.write_checkpoint(
                opts.arch, Path(tmp) / opts.arch, seed=opts.seed, num_experts=opts.experts,
                top_k=opts.top_k, num_moe_layers=opts.layers,
            )  # fmt: skip
            for repeat in range(opts.repeats):
                pair: dict[bool, list[dict]] = {}
                # Off first in even pairs, on first in odd ones: a drift of the machine's load cancels.
                for verify in (False, True) if repeat % 2 == 0 else (True, False):
                    t = time.monotonic()
                    pair[verify] = run_ranks(
                        bench.bench_rank, world_size=opts.ranks, tmp_path=Path(tmp),
                        args=(str(folder), verify, args), timeout_s=600,
                        preload=("vllm", "ascend_eplb.testing.real_models"),
                    )  # fmt: skip
                    print(
                        f"  pair {repeat + 1}/{opts.repeats}, verifier {'on' if verify else 'off'}: "
                        f"{time.monotonic() - t:.1f} s, step p50 "
                        f"{_p50(pair[verify][0]['step_s']) * 1e3:.1f} ms",
                        file=sys.stderr,
                    )
                pairs.append(pair)
    finally:
        stop_fork_server()

    commits = pairs[0][True][0]["commits"]
    same_commits = all(w[0]["commits"] == commits for pair in pairs for w in pair.values())
    commit_steps = [i for i, c in enumerate(commits) if c]

    def per_pair(fn: Any) -> float:
        """The median over the pairs of ``fn(on world) / fn(off world) - 1``."""
        return statistics.median(fn(pair[True]) / fn(pair[False]) - 1 for pair in pairs)

    def median_of(kind: bool, fn: Any) -> float:
        return statistics.median(fn(pair[kind]) for pair in pairs)

    def wall_p50(world: list[dict]) -> float:
        return _p50(world[0]["step_s"])

    def wall_mean(world: list[dict]) -> float:
        return statistics.fmean(world[0]["step_s"])

    def cpu_p50(world: list[dict]) -> float:  # all ranks' CPU seconds of a step, p50 over the steps
        return _p50([sum(per_rank) for per_rank in zip(*(r["cpu_s"] for r in world), strict=True)])

    def commit_mean(world: list[dict]) -> float:
        return statistics.fmean(world[0]["step_s"][i] for i in commit_steps)

    def idle_p50(world: list[dict]) -> float:
        return _p50([t for t, c in zip(world[0]["step_s"], commits, strict=True) if not c])

    print(
        f"serving verifier benchmark: {rm.ARCHITECTURES[opts.arch]} ({opts.arch}), {opts.ranks} ranks "
        f"TP={opts.ranks} x EP={opts.ranks}, {opts.layers} MoE layers x {opts.experts} experts "
        f"(+{opts.redundant}), top-{opts.top_k}, {opts.steps} steps; {opts.repeats} off/on world pairs; "
        f"layers committed at {len(commit_steps)} of {opts.steps} steps"
        + ("" if same_commits else " (NOTE: the worlds committed at different steps)")
    )
    rows = [
        ("step p50 (wall)", wall_p50, True),
        ("step mean (wall)", wall_mean, False),
        ("CPU per step, all ranks, p50", cpu_p50, False),
    ]
    if commit_steps:
        rows.append(("steps without a commit, p50", idle_p50, False))
        rows.append(("commit steps, mean (wall)", commit_mean, False))
    for label, fn, headline in rows:
        ratio = per_pair(fn)
        verdict = f"  (target <= {TARGET:.0%}: {'met' if ratio <= TARGET else 'NOT met'})" if headline else ""
        print(
            f"  {label:<30} off {median_of(False, fn) * 1e3:7.1f} ms  on "
            f"{median_of(True, fn) * 1e3:7.1f} ms  verifier {ratio:+.1%}{verdict}"
        )
        if headline:
            spread = ", ".join(f"{fn(pair[True]) / fn(pair[False]) - 1:+.1%}" for pair in pairs)
            print(f"  {'':<30} (each pair: {spread}; the spread is the machine's noise between worlds)")
    own = [pair[True][0]["verifier_s"] for pair in pairs]
    own_commit = [statistics.fmean(v[i] for i in commit_steps) for v in own] if commit_steps else [0.0]
    print(
        f"  the verifier's own time in the on worlds (timed around its hooks, rank 0): per step p50 "
        f"{statistics.median(_p50(v) for v in own) * 1e3:.2f} ms, mean "
        f"{statistics.median(statistics.fmean(v) for v in own) * 1e3:.2f} ms, per commit step "
        f"{statistics.median(own_commit) * 1e3:.2f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
