"""The ``ascend-eplb`` command: ``simulate`` (the main job), ``plan`` and ``check``.

Every option is validated before anything heavy is imported or any process starts; a bad value exits
with status 2 and names the value and the rule. ``simulate`` exits 0 when every check passed and 1 when
one failed (the first violation is printed) or a rank crashed, raised or missed the deadline (each
rank's state is printed); ``check`` exits 0 for a valid config and 2 otherwise. A command stopped by
SIGTERM, SIGHUP or Ctrl-C prints one line and exits ``128 + signal`` (143, 129, 130).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["build_parser", "main"]


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n}: must be >= 1")
    return n


def _non_negative(value: str) -> int:
    n = int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"{n}: must be >= 0")
    return n


def _int_list(value: str) -> list[int]:
    try:
        out = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r}: must be comma-separated integers, e.g. 0,8,16"
        ) from None
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"{value!r}: must list integers >= 0")
    return out


def build_parser() -> argparse.ArgumentParser:
    from ascend_eplb.tools.simulate.config import FAULTS, SimulateConfig

    parser = argparse.ArgumentParser(prog="ascend-eplb", description="Ascend EPLB for vLLM Model Runner V2.")
    sub = parser.add_subparsers(dest="command", required=True)

    d = SimulateConfig()
    sim = sub.add_parser(
        "simulate",
        help="replay real routing across EP ranks over Gloo on CPU, checking every invariant",
        description="Replay real MoE routing across EP rank processes (Gloo, CPU) through the Ascend EPLB "
        "planes and upstream vLLM's async EPLB, checking every invariant at every step.",
    )
    sim.add_argument(
        "--ranks", type=_positive, default=d.num_ranks, help="EP ranks (processes), default %(default)s"
    )
    sim.add_argument(
        "--redundant-experts", type=_non_negative, default=d.num_redundant_experts, help="default %(default)s"
    )
    sim.add_argument(
        "--format",
        dest="quant_format",
        default=d.quant_format,
        help="expert weight format, default %(default)s",
    )
    sim.add_argument(
        "--layers", type=_positive, default=None, help="MoE layers (a prefix of the trace), default all"
    )
    sim.add_argument(
        "--batch-size", type=_positive, default=d.batch_size, help="real tokens per step, default %(default)s"
    )
    sim.add_argument(
        "--padded-size",
        type=_positive,
        default=None,
        help="padded batch size (graph size), default the next multiple of 16 above the batch size",
    )
    sim.add_argument("--steps", type=_positive, default=d.steps, help="default %(default)s")
    sim.add_argument(
        "--window-size", type=_positive, default=d.window_size, help="EPLB load window, default %(default)s"
    )
    sim.add_argument(
        "--step-interval",
        type=_positive,
        default=d.step_interval,
        help="EPLB step interval, default %(default)s",
    )
    sim.add_argument(
        "--phase",
        choices=("all", "prefill", "decode"),
        default=d.load_collection_phase,
        help="load collection phase, default %(default)s",
    )
    sim.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="routing: a compact trace (.npz), or load to sample from: a serving events file (.jsonl) or "
        "a [L, E] load matrix (.json/.npy/.csv); default the embedded ESFT trace",
    )
    sim.add_argument("--hidden-size", type=_positive, default=d.hidden_size, help="H, default %(default)s")
    sim.add_argument(
        "--intermediate-size", type=_positive, default=d.intermediate_size, help="I, default %(default)s"
    )
    sim.add_argument("--seed", type=int, default=d.seed, help="default %(default)s")
    sim.add_argument("--out", type=Path, default=Path(d.out_dir), help="output folder, default %(default)s")
    sim.add_argument(
        "--timeout",
        type=float,
        default=d.timeout_s,
        help="deadline of the whole run in seconds, default %(default)s",
    )
    sim.add_argument("--no-progress", action="store_true", help="no progress bar")
    sim.add_argument(
        "--worker-timeout",
        type=float,
        default=d.worker_timeout_s,
        help="seconds a rearrangement may go without progress before the watchdog stops EPLB "
        "(ASCEND_EPLB_WORKER_TIMEOUT_S), default %(default)s",
    )
    sim.add_argument(
        "--on-worker-failure",
        choices=("stop", "raise"),
        default=d.on_worker_failure,
        help="what the watchdog does on a dead or stalled worker (ASCEND_EPLB_ON_WORKER_FAILURE): stop "
        "EPLB and keep serving, or raise; default %(default)s",
    )
    sim.add_argument(
        "--fault",
        choices=FAULTS,
        default=None,
        help="inject a fault to see the check that catches it: " + ", ".join(FAULTS),
    )

    pl = sub.add_parser("plan", help="offline what-if of upstream's default EPLB policy on recorded load")
    pl.add_argument(
        "load",
        type=Path,
        help="[L, E] load: a serving events file (.jsonl, ASCEND_EPLB_EVENTS), a .json/.npy/.csv matrix, "
        "an ESFT summary.json or an SGLang {'logical_count': ...}",
    )
    pl.add_argument("--ranks", type=_positive, required=True, help="EP ranks")
    pl.add_argument(
        "--redundant-experts",
        type=_int_list,
        default=[0],
        help="comma-separated levels, e.g. 0,8,16 (default 0)",
    )
    pl.add_argument(
        "--last",
        type=_positive,
        default=None,
        help="with an events file (.jsonl): plan on the sum of its last N windows (default all)",
    )
    pl.add_argument("--nodes", type=_positive, default=1, help="default %(default)s")
    pl.add_argument("--expert-groups", type=_positive, default=1, help="default %(default)s")
    pl.add_argument("--json", action="store_true", help="machine-readable output")

    ck = sub.add_parser("check", help="validate an EPLB configuration file")
    ck.add_argument("config", type=Path, help="config file (see the integration README)")
    return parser


def _run_plan(args: argparse.Namespace) -> int:
    from ascend_eplb.tools.plan import format_plan, validate_plan_args
    from ascend_eplb.tools.trace import load_load_matrix

    load = load_load_matrix(args.load, last=args.last)
    validate_plan_args(load.shape, args.ranks, args.nodes, args.expert_groups, args.redundant_experts)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from ascend_eplb.tools.plan import plan

    result = plan(
        load,
        num_ranks=args.ranks,
        redundancy=args.redundant_experts,
        num_nodes=args.nodes,
        num_expert_groups=args.expert_groups,
    )
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        print(format_plan(result))
    return 0


def _run_check(args: argparse.Namespace) -> int:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from ascend_eplb.integration.validation import check_config_file

    result = check_config_file(args.config)
    # One report on stdout, ok or not, so `ascend-eplb check CONFIG > report.txt` keeps the reasons;
    # the exit code (0 or 2) tells the outcome.
    print(f"ascend-eplb check: {args.config}: {'OK' if result.ok else 'INVALID'}")
    print(result.report)
    return result.exit_code


def _run_simulate(args: argparse.Namespace) -> int:
    from ascend_eplb.tools.simulate.config import SimulateConfig
    from ascend_eplb.tools.simulate.driver import run_simulation

    config = SimulateConfig(
        num_ranks=args.ranks,
        num_redundant_experts=args.redundant_experts,
        quant_format=args.quant_format,
        num_layers=args.layers,
        batch_size=args.batch_size,
        padded_size=args.padded_size,
        steps=args.steps,
        window_size=args.window_size,
        step_interval=args.step_interval,
        load_collection_phase=args.phase,
        trace=str(args.trace) if args.trace else None,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        seed=args.seed,
        out_dir=str(args.out),
        timeout_s=args.timeout,
        progress=not args.no_progress,
        fault=args.fault,
        worker_timeout_s=args.worker_timeout,
        on_worker_failure=args.on_worker_failure,
    )
    report = run_simulation(config)
    return 0 if report["passed"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from ascend_eplb.tools.simulate.lifecycle import command_scope

    # SIGTERM/SIGHUP stop the command anywhere, as Ctrl-C does; for simulate the scope also stops the
    # fork server and the resource tracker and removes the command's scratch on the way out, after the
    # error below was handled (so what the failed run held is released first).
    with command_scope(args.command):
        return _dispatch(args)


def _dispatch(args: argparse.Namespace) -> int:
    from ascend_eplb.testing import LauncherInterruptedError
    from ascend_eplb.tools.simulate.lifecycle import exit_code_of

    try:
        if args.command == "plan":
            return _run_plan(args)
        if args.command == "check":
            return _run_check(args)
        return _run_simulate(args)
    except ValueError as e:
        print(f"ascend-eplb {args.command}: error: {e}", file=sys.stderr)
        return 2
    except (LauncherInterruptedError, KeyboardInterrupt) as e:
        name = e.signal_name if isinstance(e, LauncherInterruptedError) else "SIGINT"
        print(
            f"ascend-eplb {args.command}: stopped by {name}"
            + ("; every rank was stopped, nothing left behind" if args.command == "simulate" else ""),
            file=sys.stderr,
        )
        return exit_code_of(e)
    except RuntimeError as e:
        from ascend_eplb.tools.simulate.driver import SimulationError

        if not isinstance(e, SimulationError):
            raise
        # A rank crashed, raised or missed the deadline: the message names each rank (with its
        # traceback); the launcher's own stack says nothing more.
        print(f"ascend-eplb {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
