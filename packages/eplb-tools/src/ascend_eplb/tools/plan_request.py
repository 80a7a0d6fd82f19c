"""One ``ascend-eplb plan`` call: its input read once into a typed request, then run.

:func:`plan_request` reads the load file once (an events file's windows, configuration and grouping
of each model one server balanced, the target and its MoE draft; a routing trace's windows; a load
matrix) and judges every option of every model before anything is planned: a :class:`SweepRequest`
(the level sweep of :func:`ascend_eplb.tools.plan.plan`, one per model, with costs and the export of
one placement file of every model), a :class:`ComparisonRequest`
(:func:`ascend_eplb.tools.plan_compare.compare_policies` on the target's windows) or a
:class:`BatchSplitRequest` (:func:`ascend_eplb.tools.plan_batch_split.batch_split_figures`).
:func:`run_plan` plans and prints (:mod:`ascend_eplb.tools.plan_text`). Errors are ``ValueError``
naming the value and the rule (the command's exit status 2).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from ascend_eplb.integration.events.reader import RecordedLoad
from ascend_eplb.integration.placement_file import write_placements
from ascend_eplb.integration.regular_files import writable_file_problem
from ascend_eplb.quant_views import get_format
from ascend_eplb.tools.costs import ModelSize, estimate_costs, format_bytes, read_model_size
from ascend_eplb.tools.plan import (
    DEFAULT_MARGIN,
    PlanResult,
    export_placement,
    plan,
    planned_grouping,
    recorded_configuration,
    sweep_levels,
    validate_plan_args,
)
from ascend_eplb.tools.plan_batch_split import batch_split_figures
from ascend_eplb.tools.plan_compare import (
    DEFAULT_WINDOW_SEQUENCES,
    Candidates,
    Deployment,
    ExpertBytes,
    Windows,
    compare_policies,
    load_windows,
)
from ascend_eplb.tools.plan_text import format_batch_split, format_comparison, format_plan
from ascend_eplb.tools.trace import (
    RoutingTrace,
    convert,
    load_load_matrix,
    load_recorded,
    load_recorded_models,
    load_trace,
)

__all__ = ["BatchSplitRequest", "ComparisonRequest", "ModelSweep", "SweepRequest", "plan_request", "run_plan"]


@dataclass(frozen=True)
class ModelSweep:
    """The level sweep of one model.

    Attributes:
        model: as the events file names it (upstream's ``EplbModelState.model_name``: the target, or
            ``'<target> (draft)'``); None: the load file is not an events file.
        load: float64 ``[L, E]``, the load planned on (its windows of an events file summed, or the
            ``last``; another load file's matrix).
        num_nodes, num_expert_groups: planned for (the nodes and groups its events record unless
            given: :func:`ascend_eplb.tools.plan.planned_grouping`).
        levels: the redundancy levels (None: :func:`ascend_eplb.tools.plan.sweep_levels`).
        export_level: the level an export writes, its recorded configuration's (None: the recommended).
    """

    model: str | None
    load: np.ndarray
    num_nodes: int
    num_expert_groups: int
    levels: tuple[int, ...] | None
    export_level: int | None


@dataclass(frozen=True)
class SweepRequest:
    """The level sweep of each model of one load.

    Attributes:
        source: the load file; ``models``: one sweep per model it records (an events file of a server
            balancing an MoE draft beside the target: both, in the file's order; else one).
        last: the events file's last windows planned on (None: all).
        num_ranks: planned for; ``margin``: of the recommendation.
        size: the model's sizes for the costs (None: no costs); quant_format, link_gbps: of the costs.
        export: the placement file to write, of every model (None: none); json: print JSON.
        inputs: ``(option, path)`` of the files the command reads, which the export never writes.
    """

    source: Path
    models: tuple[ModelSweep, ...]
    last: int | None
    num_ranks: int
    margin: float
    size: ModelSize | None
    quant_format: str
    link_gbps: float
    export: Path | None
    json: bool
    inputs: tuple[tuple[str, Path | None], ...] = ()

    @property
    def named(self) -> bool:
        """Whether the output names each model (one of several)."""
        return len(self.models) > 1


@dataclass(frozen=True)
class ComparisonRequest:
    """The policy comparison on one sequence of windows (the arguments of
    :func:`ascend_eplb.tools.plan_compare.compare_policies`); ``json``: print JSON."""

    windows: Windows
    deployment: Deployment
    candidates: Candidates
    expert_bytes: ExpertBytes
    json: bool


@dataclass(frozen=True)
class BatchSplitRequest:
    """``--batch-split``: a routing trace's batches (the arguments of
    :func:`ascend_eplb.tools.plan_batch_split.batch_split_figures`); ``json``: print JSON."""

    routing: RoutingTrace
    source: str
    num_ranks: int
    num_redundant_experts: int
    window_sequences: int
    json: bool


def _batch_split_request(args: argparse.Namespace) -> BatchSplitRequest:
    path = Path(args.load)
    if not (path.suffix.lower() == ".npz" or path.is_dir()):
        raise ValueError(
            f"batch split: {args.load} is not a routing trace (.npz or a folder of ESFT "
            "expert_weights_<layer>.txt); the split routes each token, a load matrix has none"
        )
    others = [
        name
        for name, given in (
            ("--policies", args.policies is not None),
            ("--load-estimates", args.load_estimates is not None),
            ("--min-balancedness-gain", args.min_balancedness_gain > 0),
            ("--target-balancedness", args.target_balancedness is not None),
            ("--export-expert-map", args.export_expert_map is not None),
            ("--last", args.last is not None),
        )
        if given
    ]
    if others:
        raise ValueError(f"batch split: not with {', '.join(others)} (another plan of the same command)")
    if args.redundant_experts is None or len(args.redundant_experts) != 1:
        raise ValueError("batch split: runs one redundancy level; give --redundant-experts R")
    if path.suffix.lower() == ".npz":
        routing = load_trace(path)
    else:
        with tempfile.TemporaryDirectory() as scratch:
            routing = load_trace(convert(path, Path(scratch) / "trace.npz"))
    level = args.redundant_experts[0]
    shape = (routing.num_moe_layers, routing.num_logical_experts)
    validate_plan_args(shape, args.ranks, 1, 1, [level])
    window = DEFAULT_WINDOW_SEQUENCES if args.window_sequences is None else args.window_sequences
    return BatchSplitRequest(routing, str(args.load), args.ranks, level, window, args.json)


def _compares_policies(args: argparse.Namespace) -> bool:
    return (
        args.policies is not None
        or args.load_estimates is not None
        or args.min_balancedness_gain > 0
        or args.target_balancedness is not None
        or args.window_sequences is not None
    )


def plan_request(args: argparse.Namespace) -> SweepRequest | ComparisonRequest | BatchSplitRequest:
    """The request of parsed ``plan`` options (``args`` is only read), its load file read once.

    Raises:
        ValueError: a bad option value or combination, or a load file that cannot be read (naming it
            and the rule), before anything is planned.
    """
    # Judged without --model-config too: a misspelt --format (w8a8) was silently accepted there.
    get_format(args.quant_format)
    if args.batch_split:
        return _batch_split_request(args)
    if _compares_policies(args):
        return _comparison_request(args)
    return _sweep_request(args)


def _comparison_request(args: argparse.Namespace) -> ComparisonRequest:
    if args.export_expert_map is not None:
        raise ValueError(
            f"export expert map={args.export_expert_map}: writes one level's placement from the level sweep; "
            "not with the policy comparison (--policies, --load-estimates, --min-balancedness-gain, "
            "--target-balancedness, --window-sequences)"
        )
    events = load_recorded(args.load)  # an events file, read once (None: another load file)
    args = _with_ranks(args, [events])
    windows = load_windows(args.load, window_sequences=args.window_sequences, last=args.last, recorded=events)
    groups, nodes = planned_grouping(
        events, num_ranks=args.ranks, num_expert_groups=args.expert_groups, num_nodes=args.nodes
    )
    num_experts = int(windows.loads[0].shape[1])
    if args.redundant_experts is not None:
        if len(args.redundant_experts) != 1:
            raise ValueError(
                f"redundant experts={','.join(map(str, args.redundant_experts))}: the policy comparison "
                "runs one redundancy level; give one"
            )
        level = args.redundant_experts[0]
    else:
        recorded = recorded_configuration(events)
        if recorded is None:
            raise ValueError(
                f"{args.load}: states no redundancy level (an events file that records its configuration "
                "does); the policy comparison runs one: give --redundant-experts R"
            )
        level = recorded[0] - num_experts
        if recorded[1] != args.ranks:
            warnings.warn(
                f"{args.load} records {recorded[1]} EP ranks; the policies are compared for --ranks "
                f"{args.ranks}",
                stacklevel=1,
            )
    validate_plan_args(windows.loads[0].shape, args.ranks, nodes, groups, [level])
    expert_bytes = ExpertBytes(
        None,
        "not computed (no --model-config: give the model's config.json, and --format, for bytes at its "
        "expert size)",
    )
    if args.model_config is not None:
        model = read_model_size(args.model_config)
        _same_model(args, model, windows.loads[0])
        fmt = get_format(args.quant_format)
        fmt.check_sizes(model.hidden_size, model.moe_intermediate_size)
        nbytes = fmt.expert_nbytes(model.hidden_size, model.moe_intermediate_size)
        expert_bytes = ExpertBytes(
            nbytes,
            f"{format_bytes(nbytes)}, one expert of {model.source} (H={model.hidden_size}, "
            f"I={model.moe_intermediate_size}) in {args.quant_format}",
        )
    return ComparisonRequest(
        windows=windows,
        deployment=Deployment(args.ranks, level, nodes, groups),
        candidates=Candidates(
            tuple(args.policies or ("default", "migration_aware")),
            args.min_balancedness_gain,
            args.target_balancedness,
            tuple(args.load_estimates or ("window", "pooled")),
        ),
        expert_bytes=expert_bytes,
        json=args.json,
    )


def _sweep_request(args: argparse.Namespace) -> SweepRequest:
    # An events file, read once: each model one server balanced (the target and its MoE draft), each
    # planned on its own windows and configuration; () for another load file.
    recorded_models = load_recorded_models(args.load)
    args = _with_ranks(args, recorded_models)
    named = len(recorded_models) > 1
    models = []
    for events in recorded_models or (None,):
        try:
            models.append(_model_sweep(args, events))
        except ValueError as e:
            raise ValueError(f"model {events.model}: {e}" if named else str(e)) from e
    margin = DEFAULT_MARGIN if args.margin is None else args.margin
    if not 0 <= margin < 1:
        raise ValueError(f"margin={margin}: must be in [0, 1)")
    size = None
    if args.model_config is not None:
        size = read_model_size(args.model_config)
        for sweep in models:
            _same_model(args, size, sweep.load)
        get_format(args.quant_format).check_sizes(size.hidden_size, size.moe_intermediate_size)
    if args.export_expert_map is not None:
        # Judged now, by the one writer's rules, before anything is planned; judged again as it writes.
        problem = writable_file_problem(args.export_expert_map, _inputs(args))
        if problem is not None:
            raise ValueError(f"export expert map={problem.path}: {problem.reason}")
    return SweepRequest(
        source=args.load, models=tuple(models), last=args.last, num_ranks=args.ranks, margin=margin,
        size=size, quant_format=args.quant_format, link_gbps=args.link_gbps, export=args.export_expert_map,
        json=args.json, inputs=_inputs(args),
    )  # fmt: skip


def _model_sweep(args: argparse.Namespace, events: RecordedLoad | None) -> ModelSweep:
    """One model's sweep (``events``: its windows of an events file; None: the load file itself)."""
    load = load_load_matrix(args.load, last=args.last, recorded=events)
    groups, nodes = planned_grouping(
        events, num_ranks=args.ranks, num_expert_groups=args.expert_groups, num_nodes=args.nodes
    )
    # The level an export writes: the events file's recorded configuration, unless levels are given.
    recorded = recorded_configuration(events) if args.export_expert_map is not None else None
    export_level = None
    levels = None if args.redundant_experts is None else tuple(args.redundant_experts)
    if recorded is not None and args.redundant_experts is None:
        export_level = recorded[0] - load.shape[1]
        if recorded[1] != args.ranks:
            warnings.warn(
                f"{args.load} records {recorded[1]} EP ranks; the placement is exported for --ranks "
                f"{args.ranks} (a server of the recorded layout refuses it)",
                stacklevel=1,
            )
        levels = tuple(sorted({*sweep_levels(load.shape[1], args.ranks), export_level}))
    validate_plan_args(load.shape, args.ranks, nodes, groups, levels)
    model = None if events is None else events.model
    return ModelSweep(model, load, nodes, groups, levels, export_level)


def _same_model(args: argparse.Namespace, size: ModelSize, load: np.ndarray) -> None:
    """``ValueError`` unless ``size`` (``--model-config``) can be the model that made ``load`` (``[L, E]``):
    its routed experts are E, and the layers that carry load are at most its MoE layers (a load file may
    list dense layers too, without load). A config of another model was costed silently."""
    loaded = int((np.asarray(load).sum(axis=1) > 0).sum())
    experts = int(load.shape[1])
    if size.num_logical_experts != experts or loaded > size.num_moe_layers:
        raise ValueError(
            f"model config={args.model_config}: {size.source} is a model of {size.num_logical_experts} "
            f"routed experts in {size.num_moe_layers} MoE layers, the load {args.load} one of {experts} in "
            f"{loaded} loaded layers: a config of another model (its costs would be another model's); fix: "
            "give the config.json of the model that served the load"
        )


def _with_ranks(args: argparse.Namespace, recorded: Sequence[RecordedLoad | None]) -> argparse.Namespace:
    """``args`` with ``ranks``: as given, else the EP ranks the events file records (``recorded``: its
    models' windows, read once).

    Raises:
        ValueError: no ``--ranks`` and the load file records none (naming the file).
    """
    if args.ranks is not None:
        return args
    stated = [r.num_ranks for r in recorded if r is not None and r.num_ranks is not None]
    if not stated:
        raise ValueError(
            f"ranks: give --ranks N, the EP ranks to plan for ({args.load} records none: a serving events "
            "file records the ranks it was served on)"
        )
    return argparse.Namespace(**{**vars(args), "ranks": stated[0]})


def _inputs(args: argparse.Namespace) -> tuple[tuple[str, Path | None], ...]:
    """``(option, path)`` of the files ``plan`` reads (a folder stands for its ``config.json``):
    ``plan events.jsonl --export-expert-map events.jsonl`` overwrote the recorded events."""
    return (("the load", args.load), ("--model-config", args.model_config))


def run_plan(request: SweepRequest | ComparisonRequest | BatchSplitRequest) -> int:
    """Plan and print what ``request`` asks (stdout; an export's line on stderr under ``json``).

    Returns:
        The exit status: 0, or 2 when a requested redundancy level is invalid (each named on stderr).
    """
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # the policies' module imports vLLM
    # The plan's tensors are a few KiB: one thread (upstream's worker also shares the GIL with serving).
    # With torch's pool on a loaded 2-core host, the metrics' small reductions took 1.5 s of the ESFT
    # summary task's sweep, against 0.22 s.
    torch.set_num_threads(1)
    if isinstance(request, BatchSplitRequest):
        r = request
        report = batch_split_figures(
            r.routing,
            r.source,
            num_ranks=r.num_ranks,
            num_redundant_experts=r.num_redundant_experts,
            window_sequences=r.window_sequences,
        )
        print(json.dumps(report.to_json()) if r.json else format_batch_split(report))
        return 0
    if isinstance(request, ComparisonRequest):
        r = request
        result = compare_policies(r.windows, r.deployment, r.candidates, r.expert_bytes)
        print(json.dumps(result.to_json()) if request.json else format_comparison(result))
        return 0
    return _run_sweep(request)


def _run_sweep(request: SweepRequest) -> int:
    """Each model's sweep, printed in turn (each under its name when several), then the export of every
    model's placement in one file (written only when each model has one to write)."""
    code, exports = 0, []
    for sweep in request.models:
        if request.named:
            print(f"model {sweep.model}:", file=sys.stderr if request.json else sys.stdout)
        model_code, export = _sweep_model(request, sweep)
        code = max(code, model_code)
        exports.append(export)
    if request.export is not None and None not in exports:
        _export(request, exports)
    return code


def _sweep_model(request: SweepRequest, sweep: ModelSweep) -> tuple[int, tuple[PlanResult, int] | None]:
    """One model's sweep, printed; returns the exit status and, with an export, its result and the
    level to write (None when nothing is to be written)."""
    result = plan(
        sweep.load,
        num_ranks=request.num_ranks,
        redundancy=sweep.levels,
        num_nodes=sweep.num_nodes,
        num_expert_groups=sweep.num_expert_groups,
        margin=request.margin,
    )
    if request.size is not None:
        costs: dict = {}
        for lv in result.levels:
            costs.setdefault(str(lv.num_redundant_experts), {})[lv.policy] = estimate_costs(
                request.size,
                request.quant_format,
                num_ranks=request.num_ranks,
                num_redundant_experts=lv.num_redundant_experts,
                link_gbps=request.link_gbps,
                busiest_rank_experts_per_layer=lv.busiest_rank_experts_received / result.num_moe_layers,
            ).to_json()
        result = replace(result, costs=costs)
    if request.json:
        print(json.dumps({"model": sweep.model, **result.to_json()} if request.named else result.to_json()))
    else:
        print(format_plan(result))
    export = None
    if request.export is not None and result.invalid_levels:
        print(
            f"ascend-eplb plan: {request.export} not written: {len(result.invalid_levels)} of the requested "
            "redundancy levels are invalid (below); fix or drop them",
            file=sys.stderr,
        )
    elif request.export is not None and result.recommended is not None:
        export = (result, result.recommended if sweep.export_level is None else sweep.export_level)
    if result.invalid_levels:
        for d in result.invalid_levels:
            print(f"ascend-eplb plan: error: {d['error']}", file=sys.stderr)
        return 2, export
    return 0, export


def _export(request: SweepRequest, exports: list[tuple[PlanResult, int]]) -> None:
    """Write each model's placement of its chosen level (the configured policy's; its recorded
    configuration's when the events file records one, else the recommended) to ``request.export``:
    one model's as version 1, several models' (each as the events file names it) as version 2."""
    assert request.export is not None
    named = request.named
    placements, lines, chosen = [], [], []
    for sweep, (result, level_r) in zip(request.models, exports, strict=True):
        recorded = sweep.export_level is not None
        level = result.level(level_r)
        placement = export_placement(result, level, source=str(request.export))
        if named:
            placement = replace(placement, model=sweep.model)
        placements.append(placement)
        chosen.append(
            {
                **({"model": sweep.model} if named else {}),
                "num_redundant_experts": level_r,
                "balancedness_before": level.balancedness_before,
                "balancedness_after": level.balancedness_after,
            }
        )
        why = "the recorded configuration, " if recorded else ""
        if recorded and result.recommended is not None and result.recommended != level_r:
            # The recommendation printed just above names another level: say why this one was written.
            why = (
                f"the recorded configuration's level, not the recommended {result.recommended}: a server "
                "refuses a placement of another num_redundant_experts; --redundant-experts "
                f"{result.recommended} writes that level's for a server restarted with it; "
            )
        kept = (
            f"; layers {result.layers_excluded} had no load and keep upstream's initial placement"
            if result.layers_excluded
            else ""
        )
        of = f" of model {sweep.model}" if named else ""
        lines.append(
            f"num_redundant_experts={level_r}{of} ({why}{result.policy} policy), {placement.num_moe_layers} "
            f"MoE layers x {request.num_ranks} devices; balancedness on its load "
            f"{level.balancedness_after:.4f} (upstream's initial placement: {level.balancedness_before:.4f})"
            f"{kept}"
        )
    provenance = {
        "tool": "ascend-eplb plan",
        "load": str(request.source),
        "windows": "all" if request.last is None else f"last {request.last}",
        "policy": exports[0][0].policy,
        **(chosen[0] if not named else {"models": chosen}),
    }
    try:
        write_placements(request.export, placements, provenance, request.inputs)
    except ValueError as e:
        raise ValueError(f"export expert map={e}") from None
    out = sys.stderr if request.json else sys.stdout
    if named:
        print(f"wrote {request.export}: the placements of {len(placements)} models:", file=out)
        for line in lines:
            print(f"  {line}", file=out)
    else:
        print(f"wrote {request.export}: {lines[0]}", file=out)
