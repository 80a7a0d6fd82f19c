"""Soak: consecutive completed rearrangements per row layout, the verifier on (1,000: ``--rearrangements``).

Each layout is one ``ascend-eplb simulate`` run (:func:`soak_args` are its options; the run is the main
job's path, :func:`ascend_eplb.tools.simulate.driver.run_simulation`: a real model on vLLM's own engine,
EPLB off then on, every check on every step) with back-to-back rearrangements: window = interval = the
MoE layers (the MTP draft's included), so upstream starts the next rearrangement at the step its last
layer commits. A run passes when every check passed (no failure between two rearrangements: they are
consecutive) and at least ``--rearrangements`` completed.

Layouts (the parallel configuration; the rows each rank routes, ``ascend_eplb.control.layout``, are
vLLM's dispatch's, printed from ``report.json``'s ``moe_rows``):

* ``tp``: vLLM's engine serving vLLM 0.33.0's own ``DeepseekV3ForCausalLM`` (the ``deepseek-v3``
  preset, 4 MoE layers, 64 experts, top-6; ``--mtp``: its ``DeepSeekMTP`` draft beside it) at TP = EP =
  the ranks: every rank routes the same TP-replicated rows (``replicated``).
* ``dp``: the same model at DP = the ranks x TP = 1 (``simulate --dp N``, vLLM's data-parallel engine).
* ``dp-tp``: the same model at DP = 2 x TP = the ranks / 2.
* ``replay``: the trace-replay world (``--model replay``: the repository's toy MoE model on upstream's
  ``CustomRoutingRouter``, ``w8a8_dynamic`` kernel storage, the embedded ESFT trace's first 4 MoE
  layers): every rank routes rows of its own (``split``, vLLM Ascend's MC2 dispatch). Not a real model
  class.

Execution modes (``--compile``, one run per layout and mode, one after another in this process):
``none`` (eager, ``enforce_eager``: the default), and the real model compiled as vLLM's CPU platform
compiles it (``simulate --compile``: ``DYNAMO_TRACE_ONCE`` with the ``eager`` or the ``inductor``
backend). The replay world runs eagerly only.

Usage (from the repository root)::

    hatch run python packages/eplb-tools/benchmarks/soak.py [--rearrangements 100] [--ranks 2]
        [--layouts tp dp dp-tp replay] [--compile none eager inductor] [--mtp]
        [--policy migration_aware] [--batch-size 8] [--out eplb-soak]

Prints one row per layout and mode (the rows routed, steps, wall time, step time p50, rearrangements
completed, max output error against the EPLB-off model, bytes received (measured), verdict), so the
modes' step times stand side by side, measured in one run, and writes each run's ``report.json`` and
summary under
``--out/<layout>[-<mode>]``. Exit status 0 when every run passed with enough rearrangements, 1
otherwise.
"""

from __future__ import annotations

import argparse
import io
import math
import sys
from pathlib import Path

LAYOUTS = {
    "tp": ["--model", "deepseek-v3"],
    "dp": ["--model", "deepseek-v3"],  # --dp N: the ranks (soak_args)
    "dp-tp": ["--model", "deepseek-v3", "--dp", "2"],
    "replay": ["--model", "replay", "--layers", "4"],
}
#: ``--compile`` values: eager execution, or ``simulate --compile``'s backends.
MODES = ("none", "eager", "inductor")
#: Steps granted beyond upstream's fastest pace (one layer per step): a layer may take a second step
#: on a busy host, and the soak must still reach its count.
SLACK = 1.5


def _num_moe_layers(layout: str) -> int:
    if layout == "replay":
        return 4
    from ascend_eplb.tools.simulate.models import resolve_model

    return resolve_model(LAYOUTS[layout][1]).num_moe_layers


def soak_args(
    layout: str,
    rearrangements: int,
    num_ranks: int = 2,
    mode: str = "none",
    *,
    mtp: bool = False,
    policy: tuple[str, ...] = (),
    batch_size: int = 8,
) -> list[str]:
    """``ascend-eplb simulate`` options of one soak run: ``rearrangements`` back-to-back rearrangements
    of ``layout`` on ``num_ranks`` ranks (redundant experts: one per rank), with steps for them at
    upstream's fastest pace times :data:`SLACK`, in execution ``mode`` (:data:`MODES`); ``mtp``: the
    real model's MTP draft beside it (its one MoE layer commits in the same cycle); ``policy``: more
    simulate options (the placement policy, the load estimate); ``batch_size`` requests served together.

    Raises:
        ValueError: ``layout`` is not one of :data:`LAYOUTS`, ``rearrangements`` < 1, or ``mode`` is not
            one of :data:`MODES` or compiles the replay world.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: must be one of {', '.join(LAYOUTS)}")
    if rearrangements < 1:
        raise ValueError(f"rearrangements={rearrangements}: must be >= 1")
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: must be one of {', '.join(MODES)}")
    if mode != "none" and layout == "replay":
        raise ValueError(f"mode={mode!r} with layout replay: the replay world (a toy model) runs eagerly")
    if mtp and layout == "replay":
        raise ValueError("mtp with layout replay: the replay world (a toy model) has no MTP draft")
    layers = _num_moe_layers(layout) + int(mtp)
    # Window = interval = L: upstream's first rearrangement starts at step max(L // 4, 1), each takes L
    # steps (the draft's layer after the target's), and the next starts at the step the last layer commits.
    steps = math.ceil((max(layers // 4, 1) + rearrangements * layers) * SLACK)
    data_parallel = ["--dp", str(num_ranks)] if layout == "dp" else []
    compiled = [] if mode == "none" else ["--compile", mode]
    return [
        *LAYOUTS[layout], *data_parallel, "--ranks", str(num_ranks), "--redundant-experts", str(num_ranks),
        "--window-size", str(layers), "--step-interval", str(layers), "--steps", str(steps), "--no-progress",
        "--batch-size", str(batch_size), *compiled, *(["--speculative-tokens", "1"] if mtp else []), *policy,
    ]  # fmt: skip


def run_layout(args: list[str], out: Path) -> dict:
    """One soak run of :func:`soak_args`' ``args`` through ``simulate``'s own parser and driver; returns its
    report (its summary is in ``out/summary.txt``)."""
    from ascend_eplb.tools.cli import build_parser
    from ascend_eplb.tools.simulate.config import config_from_args
    from ascend_eplb.tools.simulate.driver import run_simulation
    from ascend_eplb.tools.simulate.lifecycle import command_scope

    args = [*args, "--out", str(out), "--timeout", "14400"]
    config = config_from_args(build_parser().parse_args(["simulate", *args]))
    summary = io.StringIO()
    with command_scope("simulate"):  # as the command: a signal stops vLLM's engines and leaves nothing
        report = run_simulation(config, stream=summary).to_json()
    (out / "summary.txt").write_text(f"ascend-eplb simulate {' '.join(args)}\n{summary.getvalue()}")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rearrangements", type=int, default=100, help="completed per layout, default 100")
    parser.add_argument("--ranks", type=int, default=2, help="EP ranks, default 2")
    parser.add_argument("--batch-size", type=int, default=8, help="requests served together, default 8")
    parser.add_argument(
        "--mtp",
        action="store_true",
        help="the real model's MTP draft beside it (simulate --speculative-tokens 1)",
    )
    parser.add_argument(
        "--policy", default="default", choices=("default", "migration_aware"),
        help="placement policy; migration_aware plans on the pooled load estimate",
    )  # fmt: skip
    parser.add_argument("--layouts", nargs="+", choices=tuple(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument(
        "--compile", nargs="+", choices=MODES, default=["none"], dest="modes",
        help="execution modes, each layout once per mode: none (eager), or simulate --compile eager|inductor",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("eplb-soak"))
    args = parser.parse_args(argv)
    policy = () if args.policy == "default" else ("--policy", args.policy, "--load-estimate", "pooled")
    runs = {}
    for layout in args.layouts:
        for mode in args.modes:
            try:  # every run refused before the first starts
                runs[layout, mode] = soak_args(
                    layout, args.rearrangements, args.ranks, mode, mtp=args.mtp and layout != "replay",
                    policy=policy, batch_size=args.batch_size,
                )  # fmt: skip
            except ValueError as error:
                parser.error(str(error))
    rows, ok = [], True
    for (layout, mode), options in runs.items():
        out = args.out / (layout if mode == "none" else f"{layout}-{mode}")
        report = run_layout(options, out)
        enough = report["rearrangements_completed"] >= args.rearrangements
        ok &= report["passed"] and enough
        served = report["model"] if layout != "replay" else f"replay ({report['format']}, toy MoE)"
        rows.append(
            f"{layout:<7} {mode:<8} {served:<30} {report['moe_rows']:<10} {report['ranks']:>5} "
            f"{report['steps']:>6} "
            f"{report['wall_seconds']:>8.1f} {(report['step_seconds_p50'] or 0) * 1000:>11.1f} "
            f"{report['rearrangements_completed']:>9} {report['max_output_error']:>10.3g} "
            f"{report['bytes_received']:>12} {report['verdict']}"
            + ("" if enough else f" (fewer than {args.rearrangements} completed)")
        )
        print(f"{layout} {mode}: {report['verdict']}, report in {out}", file=sys.stderr)
    print(
        f"{'layout':<7} {'compile':<8} {'model':<30} {'rows':<10} {'ranks':>5} {'steps':>6} {'wall s':>8} "
        f"{'step p50 ms':>11} {'completed':>9} {'max error':>10} {'bytes recv':>12} verdict"
    )
    print("\n".join(rows))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
