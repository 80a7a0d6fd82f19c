"""Rank functions of the real-model tests (loaded by path in each rank process).

``real_model_checks`` builds vLLM 0.33.0's real model class of a tiny checkpoint twice on one world
(TP = EP = world size over Gloo, ``ascend_eplb.world.own_loop``): with EPLB off it runs one
prefill forward per prompt and returns the logits (the test compares them with HF transformers); with
EPLB on (redundant experts, vLLM's loader) it returns which local slots differ from the checkpoint's
expert under upstream's initial placement, and the EPLB state's initial map.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Any

import torch

from ascend_eplb.testing import RankContext
from ascend_eplb.world import own_loop
from ascend_eplb.world.checkpoints import checkpoint_experts, checkpoint_info
from ascend_eplb.world.kernel_logs import kernel_log
from ascend_eplb.world.own_loop import ServingWorker, real_model_world
from ascend_eplb.world.rank_model import build_model, forward, prompt, routed_experts
from ascend_eplb.world.slots import initial_physical_to_logical, local_slot_mismatches
from ascend_eplb.world.stand_ins import install_attention_stand_ins, register_torch_moe_method


def real_model_checks(
    ctx: RankContext, folder: str, prompts: list[torch.Tensor], num_redundant_experts: int
) -> dict[str, Any]:
    report: dict[str, Any] = {"rank": ctx.rank}
    info = checkpoint_info(folder)
    experts = checkpoint_experts(folder)
    t0 = time.monotonic()
    model, vc = build_model(ctx, folder, enable_eplb=False)
    report["build_off_s"] = time.monotonic() - t0
    report["attention_stand_ins"] = install_attention_stand_ins(model)
    method = register_torch_moe_method()
    report["moe_methods"] = sorted({type(m.quant_method).__name__ for m in routed_experts(model)})
    report["moe_methods_are_stand_in"] = all(
        isinstance(m.quant_method, method) for m in routed_experts(model)
    )
    report["expert_map_off"] = [m.expert_map.tolist() for m in routed_experts(model)]
    positions = [torch.arange(p.shape[0]) for p in prompts]
    logs = [kernel_log(layer) for layer in routed_experts(model)]
    t1 = time.monotonic()
    # The router's selections, per MoE layer call: int64 (T, K) ids in [0, E) (EPLB off: P = E).
    report["logits_off"], report["selections"] = [], []
    for p, pos in zip(prompts, positions, strict=True):
        report["logits_off"].append(forward(model, vc, p, pos))
        report["selections"] += [log.last_ids() for log in logs]
    report["forward_off_s"] = (time.monotonic() - t1) / len(prompts)
    report["moe_calls_per_forward"] = [int(log.calls) / len(prompts) for log in logs]
    # TorchDynamo graphs compiled by the forwards (vLLM's torch.compile'd helpers, stand-in 6: none).
    from torch._dynamo.utils import counters

    report["graphs_compiled"] = counters["stats"]["unique_graphs"]
    report["slot_mismatches_off"] = local_slot_mismatches(
        model, experts, initial_physical_to_logical(info, 0), ctx.rank
    )
    del model

    t2 = time.monotonic()
    model_on, _ = build_model(
        ctx, folder, enable_eplb=True, eplb={"num_redundant_experts": num_redundant_experts}
    )
    report["build_on_s"] = time.monotonic() - t2
    layers = routed_experts(model_on)
    report["local_slots_on"] = [int(m.w13_weight.shape[0]) for m in layers]
    report["expert_map_on"] = [m.expert_map.tolist() for m in layers]
    report["slot_mismatches_on"] = local_slot_mismatches(
        model_on, experts, initial_physical_to_logical(info, num_redundant_experts), ctx.rank
    )
    # The slots hold distinct experts (not one repeated tensor): the check above can fail.
    report["distinct_local_rows"] = [
        len({tuple(m.w2_weight[row].flatten()[:4].tolist()) for row in range(m.w2_weight.shape[0])})
        for m in layers
    ]
    return report


def rank_dependent_replicas_world(
    ctx: RankContext, folder: str, num_redundant_experts: int, data_parallel_size: int = 1
) -> dict[str, Any]:
    """The bug of issue 19 put back: the serving path (verifier on) on rows several ranks route (the
    TP-replicated rows of D = 1, the gathered rows of D > 1), with each rank's replica offset forced to
    its EP rank (vLLM Ascend's ``row + ep_rank + e``) after start-up.

    Returns ``error`` (the ``EplbVerificationError`` text, None if none was raised), ``step`` (the step
    whose boundary raised it), ``rows`` (the row layout of the forwards) and ``max_rel_err`` (the worst
    logits error against the EPLB-off model before that: the wrong outputs the verifier is there to
    catch). Each DP rank feeds its own prompts. Then ``dense_registration``: the live controller asked
    to register a model without MoE layers (a ``torch.nn.Linear``): ``(error class, message)``.
    """
    os.environ["ASCEND_EPLB_VERIFY"] = "1"
    from ascend_eplb.integration.verify import EplbVerificationError

    worker = ServingWorker(
        ctx, folder, num_redundant_experts=num_redundant_experts, window_size=1, step_interval=2,
        data_parallel_size=data_parallel_size,
    )  # fmt: skip
    info = worker.info
    worker.profile_run(prompt(0, 12, info.vocab_size))
    for layout in worker.state.row_layouts.values():
        layout[0] = worker.ep_rank  # stays: the controller rewrites the tensor only when the layout changes
    report: dict[str, Any] = {"rank": ctx.rank, "error": None, "step": None, "max_rel_err": 0.0}
    for step in range(20):
        ids = prompt(step * data_parallel_size + worker.dp_rank, 12, info.vocab_size)
        seen = worker.forward_step(ids, num_unpadded_tokens=12, batch_has_prefill=True)
        report["rows"] = worker.wiring.controller.last_row_layout.rows
        err = float((seen.logits_on - seen.logits_off).abs().max() / seen.logits_off.abs().max())
        report["max_rel_err"] = max(report["max_rel_err"], err)
        try:
            worker.end_step()
        except EplbVerificationError as e:
            report.update(error=str(e), step=step, check=e.check)
            break
    try:
        worker.wiring.controller.maybe_register_model(torch.nn.Linear(2, 2), worker.model_config)
    except ValueError as e:
        report["dense_registration"] = (type(e).__name__, str(e))
    else:
        report["dense_registration"] = (None, "registered")
    return report


def serving_world(ctx: RankContext, spec: Any) -> Any:
    """``real_model_world(ctx, spec)``: this rank's ``RealModelRun`` (a float or a quantized checkpoint;
    the environment of ``spec`` chooses the quantized layout)."""
    return real_model_world(ctx, spec)


def layout_world(
    ctx: RankContext, spec: Any, refused_folder: str, fault: bool, split: bool
) -> dict[str, Any]:
    """One DP x TP world (``spec.data_parallel_size``) that checks, in order, on every rank:

    * ``refused``: a ``ServingWorker`` on ``refused_folder`` (a model class without a MixtureOfExperts
      part) fails at start-up: ``(error class, message, model loaded)``;
    * ``serving``: the serving world ``real_model_world(ctx, spec)`` (a ``RealModelRun``);
    * ``collectives``: the harness's ``all_gatherv`` / ``reduce_scatterv`` stand-ins on vLLM's EP group
      with unequal sizes (rank r holds ``2 + 3 r`` rows): the gathered float and int tensors, and the
      reduce-scatter of ``(sum(sizes), 2)`` ones scaled by ``r + 1``;
    * ``split`` (when asked): ``real_model_world`` of ``spec`` with the route-first ``all-to-all``
      dispatch (each rank routes its own rows: the ``split`` layout), the same prompts;
    * ``fault`` (when asked): :func:`rank_dependent_replicas_world` on ``spec.folder`` in this layout
      (last: its run ends at the verifier's error, possibly with a layer in flight).
    """
    from vllm.distributed.parallel_state import get_ep_group

    from ascend_eplb.integration.validation import EplbConfigError

    report: dict[str, Any] = {}
    loads: list[str] = []
    original = own_loop.load_model  # what ServingWorker calls
    own_loop.load_model = lambda vc: loads.append(vc.model_config.model) or original(vc)
    try:
        ServingWorker(
            ctx, refused_folder, num_redundant_experts=spec.num_redundant_experts, window_size=2,
            step_interval=4, eplb_off=False, data_parallel_size=spec.data_parallel_size,
        )  # fmt: skip
    except EplbConfigError as exc:
        report["refused"] = (type(exc).__name__, str(exc), bool(loads))
    else:
        report["refused"] = (None, "started", bool(loads))
    finally:
        own_loop.load_model = original
    report["serving"] = real_model_world(ctx, spec)

    group = get_ep_group()
    rank = group.rank_in_group
    sizes = [2 + 3 * r for r in range(group.world_size)]
    rows = torch.arange(sizes[rank] * 3, dtype=torch.float32).view(-1, 3) + 100 * rank
    ids = torch.arange(sizes[rank], dtype=torch.int32) + 10 * rank
    gathered = group.all_gatherv([rows, ids], dim=0, sizes=sizes)
    scattered = group.reduce_scatterv(torch.ones(sum(sizes), 2) * (rank + 1), dim=0, sizes=sizes)
    report["collectives"] = {"sizes": sizes, "gathered": gathered, "scattered": scattered}
    if split:
        report["split"] = real_model_world(ctx, replace(spec, dispatch="all-to-all"))
    if fault:
        report["fault"] = rank_dependent_replicas_world(
            ctx, spec.folder, spec.num_redundant_experts, spec.data_parallel_size
        )
    return report


def start_up_errors(ctx: RankContext, folders: dict[str, str]) -> dict[str, Any]:
    """Start a ``ServingWorker`` on each folder; per format: ``(error class, message, model loaded)``."""
    loads: list[str] = []
    original = own_loop.load_model  # what ServingWorker calls
    errors = {}
    for fmt, folder in folders.items():
        own_loop.load_model = lambda vc, _f=folder: loads.append(_f) or original(vc)
        try:
            ServingWorker(
                ctx, folder, num_redundant_experts=2, window_size=2, step_interval=4, eplb_off=False
            )
        except Exception as exc:
            errors[fmt] = (type(exc).__name__, str(exc), folder in loads)
        else:
            errors[fmt] = (None, "started", folder in loads)
        finally:
            own_loop.load_model = original
    return {"rank": ctx.rank, "errors": errors}


def metrics_world(
    ctx: RankContext, folder: str, num_redundant_experts: int, events_file: str, steps: int
) -> dict[str, Any]:
    """The serving path with the events file, the Prometheus metrics and the verifier on
    (``PROMETHEUS_MULTIPROC_DIR`` comes from the launcher's environment), upstream's policy planning on
    the load estimate (``load_estimate="pooled"``), through every kind of record.

    Phase ``decode``, window 2, interval 4: steps 0-3 are declared prefill batches, so the first window
    holds no load and is skipped; decode batches follow, and rearrangements complete. From step 12 on,
    layer 0's lookup is refreshed from the placement of start-up (the simulator's
    ``wrong-lookup-refresh``), so its next commit to another placement is a ``lookups`` violation, raised
    on both ranks at that step boundary (the run ends there).

    Returns ``model`` (the model's name), ``records`` (every record this rank's events recorder made,
    in order), ``bytes_received`` (this rank's communicator total), ``skipped`` (upstream state's
    skipped rearrangements), ``violation`` (the check raised, or None) and ``step`` (where).
    """
    os.environ["ASCEND_EPLB_VERIFY"] = "1"
    os.environ["ASCEND_EPLB_EVENTS"] = events_file
    os.environ["ASCEND_EPLB_METRICS"] = "1"
    from ascend_eplb.integration.events.recorder import EventsRecord, EventsRecorder
    from ascend_eplb.integration.serving import guardrails_of
    from ascend_eplb.integration.verify import EplbVerificationError

    worker = ServingWorker(
        ctx, folder, num_redundant_experts=num_redundant_experts, window_size=2, step_interval=4,
        phase="decode", eplb_off=False, ascend_keys={"load_estimate": "pooled"},
    )  # fmt: skip
    controller = worker.wiring.controller
    assert isinstance(guardrails_of(controller).recorder, EventsRecorder)
    records: list[dict[str, Any]] = []
    controller.bus.subscribe(EventsRecord, lambda published: records.append(published.record.to_json()))
    layer_state = worker.model.moe_layers[0].eplb_state
    stale = (layer_state.logical_to_physical_map.clone(), layer_state.logical_replica_count.clone())
    info = worker.info
    worker.profile_run(prompt(0, 12, info.vocab_size))
    report: dict[str, Any] = {"model": worker.model_state.model_name, "violation": None, "step": None}
    for step in range(steps):
        if step == 12:
            layer_state.refresh_replica_lookup = lambda: layer_state.replica_lookup.refresh_(*stale)
        worker.wait_for_transfer(20.0)
        worker.forward_step(prompt(step, 12, info.vocab_size), num_unpadded_tokens=12,
                            batch_has_prefill=step < 4)  # fmt: skip
        try:
            worker.end_step()
        except EplbVerificationError as e:
            report.update(violation=e.check, step=step)
            break
    report.update(
        records=records,
        bytes_received=int(worker.model_state.communicator.cumulative_stats.bytes_received),
        skipped=worker.state.num_skipped_rearrangements,
    )
    return report
