"""Time `ExpertWeightFormat.apply` against the per-expert reference loop, side by side in one run.

The baseline is `ascend_eplb.quant_views.per_expert.per_expert_apply`: for each local row, ``nonzero``
its selections, dequantize that row, run the two GEMMs, ``index_add_`` the weighted result (the loop
``apply`` ran before it was batched, revision 79138c9). Every timed case also checks that the two give
bit-identical outputs (``torch.equal``).

Sizes: the simulator's (`ascend-eplb simulate` defaults: p=17 local experts, H=64, I=32, T=32 tokens,
K=6) and a larger one (p=8, H=1024, I=512, T=256, K=8). Routing: each (token, k) picks a uniformly random
local row or -1 (not on this rank) with probability 1/4; one torch thread; median of interleaved rounds.

Run (repository root):
``hatch run python packages/eplb-quant-views/benchmarks/bench_apply.py [--rounds ROUNDS]``,
or inside ``packages/eplb-quant-views``: ``hatch run python benchmarks/bench_apply.py [--rounds ROUNDS]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ascend_eplb.quant_views import build_expert_storage, get_format, supported_formats
from ascend_eplb.quant_views.per_expert import per_expert_apply

SIZES = {
    "simulator (p=17, H=64, I=32, T=32, K=6)": dict(p=17, H=64, I=32, T=32, K=6),
    "large (p=8, H=1024, I=512, T=256, K=8)": dict(p=8, H=1024, I=512, T=256, K=8),
}


# ------------------------------------------------------------------ benchmark


def _inputs(size, seed=0):
    g = torch.Generator().manual_seed(seed)
    t, k, p = size["T"], size["K"], size["p"]
    x = torch.randn(t, size["H"], generator=g).to(torch.bfloat16)
    weights = torch.softmax(torch.randn(t, k, generator=g), dim=1)
    ids = torch.randint(0, p, (t, k), generator=g)
    ids = torch.where(torch.rand(t, k, generator=g) < 0.25, torch.full_like(ids, -1), ids)
    return x, weights, ids


def _time(fn, args, repeats):
    start = time.perf_counter()
    for _ in range(repeats):
        fn(*args)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per case (default 5)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    header = ["size", "format", "mode", "per-expert loop (ms)", "apply (ms)", "speed-up", "bit-identical"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for label, size in SIZES.items():
        repeats = 20 if size["H"] <= 128 else 1
        inputs = _inputs(size)
        for name in supported_formats():
            fmt = get_format(name)
            inter = size["I"]
            if name.startswith("mx") and inter % 64:
                inter = 64  # MX scales come in pairs of 32-blocks: I must be a multiple of 64
            for lists in (False, True):
                storage = build_expert_storage(
                    fmt, list(range(size["p"])), size["H"], inter, seed=1, per_expert_lists=lists
                )
                new = fmt.apply(storage, *inputs)
                same = torch.equal(new, per_expert_apply(fmt, storage, *inputs))
                old_t, new_t = [], []
                for _ in range(args.rounds):
                    old_t.append(_time(per_expert_apply, (fmt, storage, *inputs), repeats))
                    new_t.append(_time(fmt.apply, (storage, *inputs), repeats))
                old_ms, new_ms = statistics.median(old_t) * 1e3, statistics.median(new_t) * 1e3
                shown = label if inter == size["I"] else label.replace(f"I={size['I']}", f"I={inter}")
                cells = [shown, name, "lists" if lists else "stacked", f"{old_ms:.2f}", f"{new_ms:.2f}"]
                cells += [f"{old_ms / new_ms:.1f}x", "yes" if same else "NO"]
                print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
