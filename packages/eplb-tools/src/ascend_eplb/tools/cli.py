"""The ``ascend-eplb`` command: ``simulate`` (the main job), ``plan`` and ``check``.

Every option is validated before anything heavy is imported or any process starts; a bad value exits
with status 2 and names the value and the rule. ``simulate`` prints what each check saw and exits 0 when
every check passed, 1 when one failed or a rank crashed, raised or missed the deadline (each rank's
state is printed), and 3 when none failed but one could not be judged (it says why); ``check`` exits 0
for a valid config and 2 otherwise. A command stopped by SIGTERM, SIGHUP or Ctrl-C prints one line and
exits ``128 + signal`` (143, 129, 130). This module imports only the standard library and modules that
import no numpy, torch or vLLM (``check``, the command's scope, the launcher's error); what imports more
(the parser imports ``simulate``'s options, and torch with them; ``plan``; ``simulate``) is imported
inside the function that needs it, after the signal handlers are set, so ``plan`` and ``check`` import no
vLLM (``check -- serve ...`` reads vLLM's own serve parser); each such import says ``# local:``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import threading
import warnings
from collections.abc import Sequence
from typing import Any

from ascend_eplb.integration.regular_files import input_limit
from ascend_eplb.launch import LauncherInterruptedError
from ascend_eplb.tools import quiet
from ascend_eplb.tools.check import check_config_file, check_serve_command
from ascend_eplb.tools.options import (
    MAX_INPUT_MIB_HELP,
    file_path,
    int_list,
    load_estimate_list,
    min_balancedness_gain,
    path,
    policy_list,
    positive_float,
    positive_int,
    target_balancedness,
)
from ascend_eplb.tools.simulate.lifecycle import command_scope, exit_code_of, signal_name_of

__all__ = ["Parser", "build_parser", "main"]


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose error is its one line and a pointer to ``--help`` (exit status 2), not
    the usage block of every option before it (20 lines for ``simulate``). Subcommands' parsers are of
    this class too (``add_subparsers`` makes them of the parent's); :func:`build_parser`'s
    ``subcommands`` maps each subcommand to its parser."""

    subcommands: dict[str, argparse.ArgumentParser]

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n{self.prog} --help lists the options\n")


def build_parser() -> argparse.ArgumentParser:
    # local: the parser imports simulate's options (and torch) after the signal handlers
    from ascend_eplb.tools.simulate.config import LINK_GBPS_DEFAULT, LINK_GBPS_HELP, add_simulate_arguments

    parser = Parser(prog="ascend-eplb", description="Ascend EPLB for vLLM Model Runner V2.")
    sub = parser.add_subparsers(dest="command", required=True)

    sim = sub.add_parser(
        "simulate",
        help="the main job: vLLM's DeepSeek-V3 model class on EP ranks with async EPLB, every invariant "
        "checked every step (CPU, Gloo)",
        description="The main job: serve vLLM's real DeepseekV3ForCausalLM (a tiny checkpoint whose "
        "routing is skewed like the embedded ESFT trace; --model takes another preset or a model folder) "
        "through vLLM's own engine on CPU (Model Runner V2, TP x EP ranks as vLLM's workers), EPLB off then "
        "on, with upstream vLLM's async EPLB through the Ascend integration, and check every invariant at "
        "every step (the outputs against the EPLB-off engine, the recorded load, the serving verifier and "
        "watchdog). --model replay replays routing traces on the quantized formats' kernel storage "
        "instead; the options marked '--model replay only' apply to that world alone.",
    )
    add_simulate_arguments(sim)

    pl = sub.add_parser("plan", help="offline what-if of upstream's default EPLB policy on recorded load")
    pl.add_argument(
        "load",
        type=path,
        help="[L, E] load: a serving events file (.jsonl, ASCEND_EPLB_EVENTS), a routing trace (.npz), a "
        ".json/.npy/.csv matrix, "
        "an ESFT summary.json, ESFT expert_weights_*.txt (a folder of them or one file) or an SGLang "
        "{'logical_count': ...}",
    )
    pl.add_argument(
        "--ranks",
        type=positive_int,
        default=None,
        help="EP ranks; default: the ranks a serving events file records (another load file: required)",
    )
    pl.add_argument(
        "--redundant-experts",
        type=int_list,
        default=None,
        help="comma-separated levels, e.g. 0,8,16; default a sweep: every level in [0, E] with E + level "
        "divisible by the ranks (0 and the multiples of the ranks when they divide E)",
    )
    pl.add_argument(
        "--last",
        type=positive_int,
        default=None,
        help="with an events file (.jsonl): plan on the sum of its last N windows (default all)",
    )
    pl.add_argument(
        "--nodes", type=positive_int, default=None, help="default: an events file's recorded count, else 1"
    )
    pl.add_argument(
        "--expert-groups",
        type=positive_int,
        default=None,
        help="the model's (n_group); default: an events file's recorded count, else 1 (one that differs "
        "from the recorded count is refused)",
    )
    pl.add_argument(
        "--margin",
        type=float,
        default=None,
        help="recommend the smallest level within this balancedness of the best; default 0.01",
    )
    pl.add_argument(
        "--model-config",
        type=path,
        default=None,
        help="the model's config.json (or its folder): report memory and rearrangement costs at its size",
    )
    pl.add_argument(
        "--format",
        dest="quant_format",
        default="bf16",
        help="expert weight format for costs, default %(default)s",
    )
    pl.add_argument("--link-gbps", type=positive_float, default=LINK_GBPS_DEFAULT, help=LINK_GBPS_HELP)
    pl.add_argument(
        "--export-expert-map",
        type=file_path,
        default=None,
        metavar="FILE",
        help="write a placement file (additional_config.eplb_config.initial_placement; also vLLM Ascend's "
        "expert_map_path JSON): from an events file that records its configuration, its "
        "num_redundant_experts; otherwise the recommended level (or the one --redundant-experts level)",
    )
    pl.add_argument("--json", action="store_true", help="machine-readable output")
    pl.add_argument("--max-input-mib", type=positive_int, default=None, metavar="N", help=MAX_INPUT_MIB_HELP)

    compare = pl.add_argument_group(
        "policies and load estimates compared per rearrangement (any of these options; one redundancy "
        "level: --redundant-experts R, or an events file's recorded one)"
    )
    compare.add_argument(
        "--policies",
        type=policy_list,
        default=None,
        help="compare these placement policies (additional_config.eplb_config.policy: default, "
        "migration_aware; default both) window by window: balancedness after and realised on the next "
        "window, experts and bytes moved, the gate's skips, recommended gate values, the run to choose",
    )
    compare.add_argument(
        "--load-estimates",
        type=load_estimate_list,
        default=None,
        help="on these loads (additional_config.eplb_config.load_estimate: window, pooled; default both)",
    )
    compare.add_argument(
        "--min-balancedness-gain",
        type=min_balancedness_gain,
        default=0.0,
        help="also run the gate with this eplb_config.min_balancedness_gain, in [0, 1)",
    )
    compare.add_argument(
        "--target-balancedness",
        type=target_balancedness,
        default=None,
        help="also run the gate with this eplb_config.target_balancedness, in (0, 1]",
    )
    pl.add_argument(
        "--batch-split",
        action="store_true",
        help="a routing trace (.npz, an ESFT expert_weights folder) and one --redundant-experts level: each "
        "batch of --window-sequences sequences routed by today's rule and by the batch split "
        "(additional_config.eplb_config.replica_split=batch) under upstream's placement of the whole trace: "
        "the balancedness each executes beside the equal split and the bound",
    )
    compare.add_argument(
        "--window-sequences",
        type=positive_int,
        default=None,
        help="a routing trace (.npz, an ESFT expert_weights folder): sequences per window, default 4",
    )

    ck = sub.add_parser(
        "check",
        help="validate an EPLB configuration: a config file or a vllm serve command line after --",
        usage="ascend-eplb check [--num-experts N] [--quantization FORMAT] [--max-input-mib N] (CONFIG | -- "
        "serve MODEL [vllm serve options])",
        description="Judge a configuration by start-up validation's rules: this package's JSON schema, a "
        "vllm serve --config YAML/JSON of engine arguments, or a vllm serve command line after -- (parsed "
        "by vLLM's own parser). A local model folder (MODEL, or model: of the YAML) gives the routed-expert "
        "count and the msModelSlim format; a rule that lacks its fact is reported as 'cannot judge'.",
    )
    ck.add_argument(
        "config", type=path, nargs="?", help="config file (see the integration README); or -- serve ..."
    )
    ck.add_argument(
        "--num-experts", type=positive_int, default=None, help="routed (logical) experts of the model"
    )
    ck.add_argument(
        "--quantization",
        default=None,
        metavar="FORMAT",
        help="routed experts' format (quant_views name, e.g. w8a8_dynamic, or an msModelSlim quant type)",
    )
    ck.add_argument("--max-input-mib", type=positive_int, default=None, metavar="N", help=MAX_INPUT_MIB_HELP)
    parser.subcommands = {"simulate": sim, "plan": pl, "check": ck}
    return parser


def _run_plan(args: argparse.Namespace) -> int:
    """``plan``: its input read once into one request (:mod:`ascend_eplb.tools.plan_request`), run."""
    # local: a subcommand's modules load when it runs, after the signal handlers (module docstring)
    from ascend_eplb.tools.plan_request import plan_request, run_plan

    return run_plan(plan_request(args))


def _run_check(args: argparse.Namespace) -> int:
    serve_argv = getattr(args, "serve_argv", None)
    if (args.config is None) == (serve_argv is None):
        raise ValueError(
            "give either a config file or a vllm serve command line after -- (ascend-eplb check -- serve "
            "MODEL ...), " + ("not both" if args.config is not None else "got neither")
        )
    if serve_argv is not None:
        if serve_argv[:1] == ["vllm"]:  # the whole command pasted: `check -- vllm serve MODEL ...`
            serve_argv = serve_argv[1:]
        if serve_argv[:1] != ["serve"]:
            raise ValueError(
                "after -- comes a vllm serve command line (serve MODEL [options], as after 'vllm'), got "
                + (shlex.join(serve_argv) if serve_argv else "nothing")
            )
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    facts = {"num_experts": args.num_experts, "quantization": args.quantization}
    if serve_argv is not None:
        label = "vllm " + shlex.join(serve_argv)
        result = check_serve_command(serve_argv, **facts)
    else:
        label = str(args.config)
        result = check_config_file(args.config, **facts)
    # One report on stdout, ok or not, so `ascend-eplb check CONFIG > report.txt` keeps the reasons;
    # the exit code (0 or 2) tells the outcome.
    print(f"ascend-eplb check: {label}: {result.verdict}")
    print(result.report)
    return result.exit_code


#: ``simulate``'s exit status per verdict: 0 every check passed, 1 a check failed, 3 none failed but one
#: could not be judged (2 is a refusal before start, 128 + N a signal).
EXIT_CODES = {"passed": 0, "failed": 1, "not judged": 3}


def _run_simulate(args: argparse.Namespace) -> int:
    # local: a subcommand's modules load when it runs, after the signal handlers (module docstring)
    from ascend_eplb.tools.simulate.config import config_from_args
    from ascend_eplb.tools.simulate.driver import run_simulation

    report = run_simulation(config_from_args(args))
    return EXIT_CODES[report.verdict]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    word = (
        f"ascend-eplb {argv[0]}" if argv[:1] and argv[0] in ("simulate", "plan", "check") else "ascend-eplb"
    )
    previous = _exit_on_signals(word)
    try:
        return _main(argv, previous)
    except BrokenPipeError:
        # The reader of stdout went away (`ascend-eplb plan ... | head -1`): stop as a writer killed by
        # SIGPIPE would (141), without a traceback, and with nothing more written to the closed pipe.
        _stdout_to_devnull()
        return 128 + int(signal.SIGPIPE)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


#: The signals that stop a command: 128 + the number is its exit status.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def _exit_on_signals(word: str) -> dict[int, Any]:
    """From the command's first line until its own handling, SIGTERM, SIGHUP and Ctrl-C print
    ``WORD: stopped by SIG...`` and end the process at once with ``128 + signal``: building the parser
    imports torch, where nothing has started or been written, so nothing is left to clean, and no
    exception is raised into an import (a C extension that clears errors could swallow it and leave a
    half-imported library behind: numpy without ``matrix``). Ctrl-C is given back
    just before ``command_scope``, which takes SIGTERM and SIGHUP inside and gives them back after. A
    signal the caller ignores (``nohup``: SIGHUP) stays ignored. Returns the handlers replaced (none off
    the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def stop(signum: int, _frame: object) -> None:
        try:
            sys.stdout.flush()
            sys.stderr.write(f"{word}: stopped by {signal.Signals(signum).name}\n")
            sys.stderr.flush()
        finally:
            os._exit(128 + signum)

    return {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS if signal.getsignal(sig) != signal.SIG_IGN}


def _stdout_to_devnull() -> None:
    """Point stdout at ``os.devnull``, so that the interpreter's last flush finds no closed pipe."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # not a file descriptor (a test's captured stdout)
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (the process's stdout from now on)
    finally:
        os.close(devnull)


def _main(argv: list[str], previous: dict[int, Any]) -> int:
    """The command; ``previous``: the handlers :func:`_exit_on_signals` replaced."""
    parser = build_parser()
    serve_argv = None
    if argv[:1] == ["check"] and "--" in argv:
        # `ascend-eplb check -- serve MODEL ...`: what follows -- is vLLM's, for vLLM's own parser.
        cut = argv.index("--")
        argv, serve_argv = argv[:cut], argv[cut + 1 :]
    args, extra = parser.parse_known_args(argv)
    if extra:  # named by the subcommand's parser, as its other errors are
        parser.subcommands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "check":
        args.serve_argv = serve_argv
    quiet.install()

    # local: tools.files imports numpy, which loads after the signal handlers (module docstring)
    from ascend_eplb.tools.files import InputFileWarning

    formatwarning = warnings.formatwarning

    def one_line(message, category, filename, lineno, line=None) -> str:
        if args.command == "simulate" and not issubclass(category, InputFileWarning):
            return formatwarning(message, category, filename, lineno, line)
        return f"ascend-eplb {args.command}: warning: {message}\n"

    # One line per warning of plan and check, and per warning of a file simulate reads (a skipped
    # truncated line of an events file), as their errors are; simulate leaves vLLM's and torch's
    # warnings as they are.
    warnings.formatwarning = one_line
    # SIGTERM/SIGHUP stop the command anywhere, as Ctrl-C does; for simulate the scope also stops the
    # fork server and the resource tracker and removes the command's scratch on the way out, after the
    # error below was handled (so what the failed run held is released first).
    # Ctrl-C is KeyboardInterrupt again, which the command handles (simulate stops its ranks first);
    # SIGTERM and SIGHUP are command_scope's inside it.
    if signal.SIGINT in previous:
        signal.signal(signal.SIGINT, previous[signal.SIGINT])
    try:
        with command_scope(args.command), input_limit(args.max_input_mib):
            return _dispatch(args)
    finally:
        warnings.formatwarning = formatwarning


def _dispatch(args: argparse.Namespace) -> int:
    try:
        if args.command == "plan":
            return _run_plan(args)
        if args.command == "check":
            return _run_check(args)
        return _run_simulate(args)
    except ValueError as e:
        print(f"ascend-eplb {args.command}: error: {e}", file=sys.stderr)
        return 2
    except (LauncherInterruptedError, KeyboardInterrupt) as e:  # KeyboardInterrupt: StoppedBySignal too
        print(
            f"ascend-eplb {args.command}: stopped by {signal_name_of(e)}"
            + ("; every rank was stopped, nothing left behind" if args.command == "simulate" else ""),
            file=sys.stderr,
        )
        return exit_code_of(e)
    except RuntimeError as e:
        # local: a subcommand's modules load when it runs, after the signal handlers (module docstring)
        from ascend_eplb.tools.simulate.driver import SimulationError

        if not isinstance(e, SimulationError):
            raise
        # A rank crashed, raised or missed the deadline: the message names each rank (with its
        # traceback); the launcher's own stack says nothing more.
        print(f"ascend-eplb {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
