"""Soak: at least 100 consecutive completed rearrangements per row layout, 4 ranks, the verifier on.

Each layout is one ``ascend-eplb simulate`` run (:func:`soak_args` are its options; the run is the main
job's path, :func:`ascend_eplb.tools.simulate.driver.run_simulation`, with every check on every rank
every step and the serving verifier on) with back-to-back rearrangements: window = interval = the MoE
layers, so upstream starts the next rearrangement at the step its last layer commits. A run passes when
every check passed (no failure between two rearrangements: they are consecutive) and at least
``--rearrangements`` completed.

Layouts (which rows each rank routes, ``ascend_eplb.control.layout``):

* ``replicated``: vLLM 0.33.0's own ``DeepseekV3ForCausalLM`` (the ``deepseek-v3`` preset, 4 MoE
  layers, 64 experts, top-6) at TP = EP = the ranks: every rank routes the same TP-replicated rows.
* ``gathered``: the same model at DP = the ranks x TP = 1 (``simulate --dp N``): each DP rank's batch,
  gathered before routing by vLLM's dispatch (every rank routes the whole gathered batch).
* ``gathered-sp``: the same model at DP = 2 x TP = the ranks / 2: vLLM's sequence-parallel MoE, each
  rank's chunk of its DP batch gathered over the EP group.
* ``split``: the trace-replay world (``--model replay``: the repository's toy MoE model on upstream's
  ``CustomRoutingRouter``, ``w8a8_dynamic`` kernel storage, the embedded ESFT trace's first 4 MoE
  layers): every rank routes rows of its own (vLLM Ascend's MC2 dispatch). Not a real model class.

Execution modes (``--compile``, one run per layout and mode, one after another in this process):
``none`` (eager, ``enforce_eager``: the default), and the real model compiled as vLLM's CPU platform
compiles it (``simulate --compile``: ``DYNAMO_TRACE_ONCE`` with the ``eager`` or the ``inductor``
backend). The replay world (``split``) runs eagerly only.

Usage (from the repository root)::

    hatch run python packages/eplb-tools/benchmarks/soak.py [--rearrangements 100] [--ranks 4]
        [--layouts replicated gathered gathered-sp split] [--compile none eager inductor] [--out eplb-soak]

Prints one row per layout and mode (steps, wall time, step time p50, rearrangements completed, max
output error against the EPLB-off model, bytes received (measured), verdict), so the modes' step times
stand side by side, measured in one run, and writes each run's ``report.json`` and summary under
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
    "replicated": ["--model", "deepseek-v3"],
    "gathered": ["--model", "deepseek-v3"],  # --dp N: the ranks (soak_args)
    "gathered-sp": ["--model", "deepseek-v3", "--dp", "2"],
    "split": ["--model", "replay", "--layers", "4"],
}
#: ``--compile`` values: eager execution, or ``simulate --compile``'s backends.
MODES = ("none", "eager", "inductor")
#: Steps granted beyond upstream's fastest pace (one layer per step): a layer may take a second step
#: on a busy host, and the soak must still reach its count.
SLACK = 1.5


def _num_moe_layers(layout: str) -> int:
    if layout == "split":
        return 4
    from ascend_eplb.tools.simulate.models import resolve_model

    return resolve_model(LAYOUTS[layout][1]).num_moe_layers


def soak_args(layout: str, rearrangements: int, num_ranks: int = 4, mode: str = "none") -> list[str]:
    """``ascend-eplb simulate`` options of one soak run: ``rearrangements`` back-to-back rearrangements
    of ``layout`` on ``num_ranks`` ranks (redundant experts: one per rank), with steps for them at
    upstream's fastest pace times :data:`SLACK`, in execution ``mode`` (:data:`MODES`).

    Raises:
        ValueError: ``layout`` is not one of :data:`LAYOUTS`, ``rearrangements`` < 1, or ``mode`` is not
            one of :data:`MODES` or compiles the replay world (``split``).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: must be one of {', '.join(LAYOUTS)}")
    if rearrangements < 1:
        raise ValueError(f"rearrangements={rearrangements}: must be >= 1")
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: must be one of {', '.join(MODES)}")
    if mode != "none" and layout == "split":
        raise ValueError(f"mode={mode!r} with layout split: the replay world (a toy model) runs eagerly only")
    layers = _num_moe_layers(layout)
    # Window = interval = L: upstream's first rearrangement starts at step max(L // 4, 1), each takes L
    # steps, and the next starts at the step the last layer commits.
    steps = math.ceil((max(layers // 4, 1) + rearrangements * layers) * SLACK)
    data_parallel = ["--dp", str(num_ranks)] if layout == "gathered" else []
    compiled = [] if mode == "none" else ["--compile", mode]
    return [
        *LAYOUTS[layout], *data_parallel, "--ranks", str(num_ranks), "--redundant-experts", str(num_ranks),
        "--window-size", str(layers), "--step-interval", str(layers), "--steps", str(steps), "--no-progress",
        *compiled,
    ]  # fmt: skip


def run_layout(layout: str, rearrangements: int, num_ranks: int, out: Path, mode: str = "none") -> dict:
    """One soak run through ``simulate``'s own parser and driver; returns its report (its summary is in
    ``out/summary.txt``)."""
    from ascend_eplb.tools.cli import build_parser
    from ascend_eplb.tools.simulate.config import config_from_args
    from ascend_eplb.tools.simulate.driver import run_simulation

    args = [*soak_args(layout, rearrangements, num_ranks, mode), "--out", str(out), "--timeout", "3600"]
    config = config_from_args(build_parser().parse_args(["simulate", *args]))
    summary = io.StringIO()
    report = run_simulation(config, stream=summary).to_json()
    (out / "summary.txt").write_text(f"ascend-eplb simulate {' '.join(args)}\n{summary.getvalue()}")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rearrangements", type=int, default=100, help="completed per layout, default 100")
    parser.add_argument("--ranks", type=int, default=4, help="EP ranks, default 4")
    parser.add_argument("--layouts", nargs="+", choices=tuple(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument(
        "--compile", nargs="+", choices=MODES, default=["none"], dest="modes",
        help="execution modes, each layout once per mode: none (eager), or simulate --compile eager|inductor",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("eplb-soak"))
    args = parser.parse_args(argv)
    runs = [(layout, mode) for layout in args.layouts for mode in args.modes]
    for layout, mode in runs:
        try:
            soak_args(layout, args.rearrangements, args.ranks, mode)  # every run refused before the first
        except ValueError as error:
            parser.error(str(error))
    rows, ok = [], True
    for layout, mode in runs:
        out = args.out / (layout if mode == "none" else f"{layout}-{mode}")
        report = run_layout(layout, args.rearrangements, args.ranks, out, mode)
        enough = report["rearrangements_completed"] >= args.rearrangements
        ok &= report["passed"] and enough
        served = report["model"] if layout != "split" else f"replay ({report['format']}, toy MoE)"
        rows.append(
            f"{layout:<11} {mode:<8} {served:<30} {report['ranks']:>5} {report['steps']:>6} "
            f"{report['wall_seconds']:>8.1f} {report['step_seconds_p50'] * 1000:>11.1f} "
            f"{report['rearrangements_completed']:>9} {report['max_output_error']:>10.3g} "
            f"{report['bytes_received']:>12} {report['verdict']}"
            + ("" if enough else f" (fewer than {args.rearrangements} completed)")
        )
        print(f"{layout} {mode}: {report['verdict']}, report in {out}", file=sys.stderr)
    print(
        f"{'layout':<11} {'compile':<8} {'model':<30} {'ranks':>5} {'steps':>6} {'wall s':>8} "
        f"{'step p50 ms':>11} {'completed':>9} {'max error':>10} {'bytes recv':>12} verdict"
    )
    print("\n".join(rows))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
