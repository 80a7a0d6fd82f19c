"""What the serving verifier (``ASCEND_EPLB_VERIFY=1``) costs a serving step: steps served with the
verifier off and on, side by side in one world.

The world is the serving worker of the main job (``ascend_eplb.world.own_loop.ServingWorker``:
the plugin, vLLM's loader and real model class, ``Mrv2EplbWiring`` with the watchdog and the verifier,
asynchronous Gloo-staged rearrangement), by default vLLM's ``DeepseekV3ForCausalLM`` at the main job's
shape (64 routed experts, top-6, 4 MoE layers, 4 redundant, TP=4 x EP=4, 48-token batches of which 32
are real, window 8, interval 16), without the EPLB-off oracle model: a step is what a serving worker
runs, runner points 7-9 and the forward. Before each step every rank waits (untimed) for its async
worker to publish the layer in flight, then a barrier, so that each rearrangement commits its layers on
consecutive steps.

The run is cut into blocks, each from the step after one rearrangement completed to the step its next
one completed (the same work: one whole cycle, its commits included). Blocks alternate off, on, on,
off, off, on, ... (pairs in ABBA order, so a steady drift of the machine's load cancels): in an off
block the verifier's step hook and commit listener are taken out of the controller, exactly what
``ASCEND_EPLB_VERIFY=0`` leaves (its registration-time fingerprints are not per step); on every rank at
the same step, since every rank sees a rearrangement complete at the same step. The block before the
first completed rearrangement (warm-up) is not counted. Adjacent blocks run seconds apart, so the load
other processes put on the machine hits both alike, which separate worlds minutes apart do not.

Printed, each the median over the pairs of ``on / off - 1`` (rank 0's steps): the step p50 beside the
target (``<= 5 %`` of step p50, issue 22) and each pair's ratio, the step mean, the mean of the commit
steps; then the verifier's own time in the on blocks (its step hook and commit listener, timed around
each call).

    hatch run python integration/benchmarks/bench_verifier.py [--layers 26] [--steps 480] [--repeats 3]
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


def _block_is_on(block: int) -> bool:
    """Blocks 1, 2, 3, 4, ... are off, on, on, off, off, on, on, off, ... (block 0: warm-up, on)."""
    return block == 0 or (block - 1) % 4 in (1, 2)


def bench_rank(ctx: Any, folder: str, args: dict) -> dict:
    """One rank: ``args["steps"]`` timed serving steps, the verifier switched per block; returns per
    step the wall seconds, the block, whether the verifier was on, the layers committed and the
    verifier's own seconds."""
    os.environ["ASCEND_EPLB_VERIFY"] = "1"
    import torch
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_ep_group

    from ascend_eplb.integration.serving import guardrails_of
    from ascend_eplb.integration.verify import EplbVerifier
    from ascend_eplb.world.own_loop import ServingWorker

    worker = ServingWorker(
        ctx, folder, num_redundant_experts=args["redundant"], window_size=args["window"],
        step_interval=args["interval"], eplb_off=False,
    )  # fmt: skip
    controller, state = worker.wiring.controller, worker.state
    spent = [0.0]
    on = [True]

    def timed(fn: Any) -> Any:
        def run(*a: Any) -> None:
            if not on[0]:  # switched off: the verifier does not run at all
                return
            t = time.perf_counter()
            try:
                fn(*a)
            finally:
                spent[0] += time.perf_counter() - t

        return run

    # The verifier's step and commit subscribers, timed and switchable, in their place on the bus.
    verifier = guardrails_of(controller).verifier
    assert isinstance(verifier, EplbVerifier)
    controller.bus.wrap(verifier.on_step, timed)
    controller.bus.wrap(verifier.on_commit, timed)

    def switch(turn_on: bool) -> None:
        on[0] = turn_on

    group = get_ep_group().cpu_group
    g = torch.Generator().manual_seed(args["seed"])
    vocab, last_layer = worker.info.vocab_size, worker.info.num_moe_layers - 1
    switch(True)
    worker.profile_run(torch.randint(0, vocab, (args["tokens"],), generator=g))
    out: dict[str, list] = {"step_s": [], "block": [], "on": [], "commits": [], "verifier_s": []}
    block = 0
    for step in range(args["steps"]):
        ids = torch.randint(0, vocab, (args["tokens"],), generator=g)
        worker.wait_for_transfer(60.0)
        dist.barrier(group=group)
        log_len = len(state.commit_log)
        spent[0] = 0.0
        t0 = time.perf_counter()
        worker.forward_step(ids, num_unpadded_tokens=args["batch"], batch_has_prefill=step % 2 == 0)
        worker.end_step()
        out["step_s"].append(time.perf_counter() - t0)
        refreshed = [e.layer for e in list(state.commit_log)[log_len:] if e.kind == "refresh"]
        out["block"].append(block)
        out["on"].append(_block_is_on(block))
        out["commits"].append(len(refreshed))
        out["verifier_s"].append(spent[0])
        if last_layer in refreshed:  # a rearrangement completed (at this step on every rank)
            block += 1
            switch(_block_is_on(block))
    return out


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
    parser.add_argument("--steps", type=int, default=240, help="timed steps per world")
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--interval", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48, help="padded batch (token ids per step)")
    parser.add_argument("--batch", type=int, default=32, help="real (unpadded) tokens of the batch")
    parser.add_argument("--repeats", type=int, default=2, help="worlds")
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args(argv)

    from ascend_eplb.testing import load_module, run_ranks, stop_fork_server
    from ascend_eplb.world.checkpoints import ARCHITECTURES, write_checkpoint

    bench = load_module(__file__)  # the rank function under a name every rank can import
    keys = ("redundant", "window", "interval", "steps", "tokens", "batch", "seed")
    args = {k: getattr(opts, k) for k in keys}
    worlds = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench-verifier-") as tmp:
            folder = write_checkpoint(
                opts.arch, Path(tmp) / opts.arch, seed=opts.seed, num_experts=opts.experts,
                top_k=opts.top_k, num_moe_layers=opts.layers,
            )  # fmt: skip
            for repeat in range(opts.repeats):
                t = time.monotonic()
                reports = run_ranks(
                    bench.bench_rank, world_size=opts.ranks, tmp_path=Path(tmp), args=(str(folder), args),
                    timeout_s=900, preload=("vllm", "ascend_eplb.world.own_loop"),
                )  # fmt: skip
                worlds.append(reports[0])
                print(f"  world {repeat + 1}/{opts.repeats}: {time.monotonic() - t:.1f} s", file=sys.stderr)
    finally:
        stop_fork_server()

    # Pairs of adjacent blocks (1, 2), (3, 4), ...: one off and one on each, both whole cycles.
    pairs = []
    for w in worlds:
        blocks: dict[int, list[int]] = {}
        for i, b in enumerate(w["block"]):
            blocks.setdefault(b, []).append(i)
        last = max(blocks) - 1  # the block still open at the end is not a whole cycle
        for first in range(1, last, 2):
            on, off = (first, first + 1) if _block_is_on(first) else (first + 1, first)
            pairs.append((w, blocks[off], blocks[on]))
    if not pairs:
        print("no pair of whole rearrangement cycles: run more --steps")
        return 1

    def ratio(fn: Any) -> list[float]:
        return [fn(w, on) / fn(w, off) - 1 for w, off, on in pairs]

    def p50(w: dict, steps: list[int]) -> float:
        return _p50([w["step_s"][i] for i in steps])

    def mean(w: dict, steps: list[int]) -> float:
        return statistics.fmean(w["step_s"][i] for i in steps)

    def commit_mean(w: dict, steps: list[int]) -> float:
        return statistics.fmean(w["step_s"][i] for i in steps if w["commits"][i])

    def all_of(kind: bool, fn: Any) -> float:
        return statistics.median(fn(w, on if kind else off) for w, off, on in pairs)

    steps_per_block = statistics.median(len(off) for _, off, _ in pairs)
    commits_per_block = statistics.median(sum(1 for i in off if w["commits"][i]) for w, off, _ in pairs)
    print(
        f"serving verifier benchmark: {ARCHITECTURES[opts.arch]} ({opts.arch}), {opts.ranks} ranks "
        f"TP={opts.ranks} x EP={opts.ranks}, {opts.layers} MoE layers x {opts.experts} experts "
        f"(+{opts.redundant}), top-{opts.top_k}; {len(worlds)} world(s) of {opts.steps} steps, "
        f"{len(pairs)} off/on pairs of whole rearrangement cycles ({steps_per_block:g} steps, "
        f"{commits_per_block:g} with a commit)"
    )
    headline = statistics.median(ratio(p50))
    verdict = "met" if headline <= TARGET else "NOT met"
    print(
        f"  step p50            off {all_of(False, p50) * 1e3:7.1f} ms  on "
        f"{all_of(True, p50) * 1e3:7.1f} ms  verifier {headline:+.1%} of step p50 (target <= {TARGET:.0%}: "
        f"{verdict})"
    )
    print(f"  {'':<19} each pair: {', '.join(f'{r:+.1%}' for r in ratio(p50))}")
    for label, fn in (("step mean", mean), ("commit steps, mean", commit_mean)):
        print(
            f"  {label:<19} off {all_of(False, fn) * 1e3:7.1f} ms  on {all_of(True, fn) * 1e3:7.1f} ms  "
            f"verifier {statistics.median(ratio(fn)):+.1%}"
        )
    own = [[w["verifier_s"][i] for i in on] for w, _, on in pairs]
    own_commit = [[w["verifier_s"][i] for i in on if w["commits"][i]] for w, _, on in pairs]
    print(
        f"  the verifier's own time in the on blocks (its hooks, timed; rank 0): per step p50 "
        f"{statistics.median(_p50(v) for v in own) * 1e3:.2f} ms, mean "
        f"{statistics.median(statistics.fmean(v) for v in own) * 1e3:.2f} ms, per commit step "
        f"{statistics.median(statistics.fmean(v) for v in own_commit) * 1e3:.2f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
