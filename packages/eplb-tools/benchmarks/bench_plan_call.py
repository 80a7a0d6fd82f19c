"""Wall time of one ``ascend-eplb plan`` call, each in a fresh interpreter, beside its target (< 5 s).

Three commands, interleaved, ``--rounds`` times each, median reported:

- ``plan``: ``python -m ascend_eplb.tools plan LOAD --ranks 4`` (the call an operator makes);
- ``plan, vLLM imported by name``: the same call after ``import vllm.distributed.eplb.policy.default,
  vllm.distributed.eplb.eplb_state`` (the modules the call imported before it ran upstream's policy
  files alone, ``ascend_eplb.tools.plan.upstream_policy``);
- ``import torch``: the floor, what any call that runs the policy (a torch program) pays.

The two plan commands must print the same bytes (checked). LOAD defaults to the ESFT summary task's
``summary.json`` the world ships (``ascend_eplb.world.esft.task_shares_path``). Run (repository root):
``hatch run python packages/eplb-tools/benchmarks/bench_plan_call.py [--rounds N] [LOAD]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

TARGET_S = 5.0

_BY_NAME = (
    "import sys\n"
    "import vllm.distributed.eplb.eplb_state, vllm.distributed.eplb.policy.default\n"
    "from ascend_eplb.tools.cli import main\n"
    "raise SystemExit(main(sys.argv[1:]))\n"
)


def _timed(argv: list[str]) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, check=True, env=os.environ)
    return time.perf_counter() - start, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("load", nargs="?", type=Path, default=None, help="default: the ESFT summary task")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=4)
    args = parser.parse_args()
    if args.load is None:
        from ascend_eplb.world.esft import task_shares_path

        args.load = task_shares_path("summary")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    plan_argv = ["plan", str(args.load), "--ranks", str(args.ranks)]
    commands = {
        "plan": [sys.executable, "-m", "ascend_eplb.tools", *plan_argv],
        "plan, vLLM imported by name": [sys.executable, "-c", _BY_NAME, *plan_argv],
        "import torch": [sys.executable, "-c", "import torch"],
    }
    times: dict[str, list[float]] = {name: [] for name in commands}
    outputs: dict[str, set[str]] = {name: set() for name in commands}
    for _ in range(args.rounds):
        for name, argv in commands.items():
            seconds, out = _timed(argv)
            times[name].append(seconds)
            outputs[name].add(out)
    same = outputs["plan"] == outputs["plan, vLLM imported by name"] and len(outputs["plan"]) == 1
    load = os.getloadavg()[0]  # the 1-minute average: the cores are shared
    print(
        f"ascend-eplb {' '.join(plan_argv)}: median of {args.rounds} fresh interpreters, "
        f"load average {load:.1f} at the end"
    )
    print("| command | median s | min s | max s | target |")
    print("|---|---|---|---|---|")
    for name, values in times.items():
        target = f"< {TARGET_S:g} s: {'met' if statistics.median(values) < TARGET_S else 'MISSED'}"
        print(
            f"| {name} | {statistics.median(values):.2f} | {min(values):.2f} | {max(values):.2f} | "
            f"{target if name == 'plan' else ''} |"
        )
    ratio = statistics.median(times["plan, vLLM imported by name"]) / statistics.median(times["plan"])
    print(f"plan is {ratio:.1f}x faster than with vLLM imported by name; outputs identical: {same}")
    if not same:
        raise SystemExit("the two plan commands printed different outputs")


if __name__ == "__main__":
    main()
