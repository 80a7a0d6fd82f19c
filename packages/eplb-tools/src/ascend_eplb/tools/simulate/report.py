"""``report.json``: what a run saw, from every rank's statistics, with the checks' verdicts and costs.

Shape letters (DESIGN.md section 2): L MoE layers, N EP ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ascend_eplb.tools.simulate.config import SimulateConfig
from ascend_eplb.tools.simulate.verdicts import JUDGED, PASSED, check_verdicts, run_verdict

__all__ = ["build_report", "rearrangement_records"]


def build_report(config: SimulateConfig, routing: Any, results: list[dict], wall_s: float) -> dict:
    from ascend_eplb.tools.simulate.config import CHECKS

    r0 = results[0]
    bal = r0["balancedness_per_step"]
    commit_steps = [i for i, c in enumerate(r0["commits_per_step"]) if c]
    rearr = r0["rearrangements_per_step"]
    first_rearr = next((i for i, n in enumerate(rearr) if n > 0), None)
    # A rearrangement is complete when its last MoE layer commits (upstream commits layers in order).
    completed = [i for i, c in enumerate(r0["commits_per_step"]) if routing.num_moe_layers - 1 in c]
    bal_off = r0["balancedness_off_per_step"]
    before = bal[: first_rearr + 1] if first_rearr is not None else bal
    # From the first completed rearrangement on, routing runs on placements EPLB chose.
    after = bal[completed[0] + 1 :] if completed else []
    off_after = bal_off[completed[0] + 1 :] if completed else []
    received = [int(res["bytes_moved"]) for res in results]  # per rank, toy sizes
    busiest_experts = max(received) // r0["expert_nbytes"] if r0["expert_nbytes"] else 0
    violations = [res["violation"] for res in results if res["violation"] is not None]
    verdicts = check_verdicts(config, routing, results, violations)
    verdict = run_verdict(verdicts)
    secs = np.array(r0["step_seconds"])
    in_flight = np.array(r0["step_in_flight"], dtype=bool)
    layers_committed = sum(len(c) for c in r0["commits_per_step"])
    return {
        "ranks": config.num_ranks,
        # The parallel layout served: DP x TP ranks (EP over all), and the MoE row layout the controller
        # used (``ascend_eplb.control.layout``: replicated, gathered, gathered-sp; the replay world split).
        "data_parallel_size": config.data_parallel_size,
        "tensor_parallel_size": config.tp_size,
        "moe_rows": r0.get("moe_rows"),
        "model": routing.architecture if not config.replays else "replay",
        "format": config.quant_format,
        "trace": routing.name,
        "layers": routing.num_moe_layers,
        "num_logical_experts": routing.num_logical_experts,
        "num_redundant_experts": config.num_redundant_experts,
        "top_k": routing.top_k,
        "batch_size": config.batch_size,
        "padded_size": config.effective_padded_size,
        "window_size": config.window_size,
        "step_interval": config.step_interval,
        "load_collection_phase": config.load_collection_phase,
        "steps": r0["steps_run"],
        "rearrangements": r0["num_rearrangements"],
        "rearrangements_completed": len(completed),
        "layers_committed": layers_committed,
        "balancedness_before": float(np.mean(before)) if before else None,
        "balancedness_after": float(np.mean(after)) if after else None,
        "balancedness_off_after": float(np.mean(off_after)) if off_after else None,
        "balancedness_off_mean": float(np.mean(bal_off)) if bal_off else None,
        "balancedness_per_step": bal,
        "balancedness_off_per_step": bal_off,
        "rank_load_share_per_step": r0["rank_load_share_per_step"],
        "commit_completed_steps": completed,
        "initial_placement": _initial_placement(config, results, bal, bal_off),
        "bytes_moved": int(sum(received)),
        "bytes_received_per_rank": received,
        # The placement policy and the gain gate the serving config set, and what each rearrangement
        # did with them: the serving events file's records (EP rank 0's events.jsonl).
        "policy": config.policy,
        "min_balancedness_gain": config.min_balancedness_gain,
        "target_balancedness": config.target_balancedness,
        **rearrangement_records(Path(config.out_dir) / "events.jsonl"),
        "busiest_rank_experts_received": int(busiest_experts),
        "costs": _costs(config, routing, int(busiest_experts), len(completed) or r0["num_rearrangements"]),
        "out_dir": str(Path(config.out_dir).resolve()),
        "commit_seconds": [float(secs[i]) for i in commit_steps],
        "step_seconds_p50": float(np.percentile(secs, 50)),
        "step_seconds_p99": float(np.percentile(secs, 99)),
        "step_seconds_p50_in_flight": float(np.percentile(secs[in_flight], 50)) if in_flight.any() else None,
        "step_seconds_p50_idle": float(np.percentile(secs[~in_flight], 50)) if (~in_flight).any() else None,
        # CPU seconds one step costs the whole world (sum over ranks of each rank's median): what the
        # step needs from the machine whatever else runs on it; wall / this = cores the world got.
        "world_cpu_seconds_per_step_p50": float(
            sum(np.percentile(res["step_cpu_seconds"], 50) for res in results)
        ),
        # The serving verifier's own time per step (its checks at each commit and its collective at the
        # step boundary after one), measured inside the same steps: the cost of ASCEND_EPLB_VERIFY=1.
        "verifier_seconds_per_step_p50": float(np.percentile(r0["verifier_seconds"], 50)),
        "verifier_seconds_per_step_mean": float(np.mean(r0["verifier_seconds"])),
        "step_seconds_p50_without_verifier": float(
            np.percentile(secs - np.array(r0["verifier_seconds"]), 50)
        ),
        "max_output_error": max(res["max_output_error"] for res in results),
        "output_tolerance": r0["output_tolerance"],  # what the world's outputs check compared with
        # True passed, False failed, None not judged; ``check_evidence``: what each check saw, or why not.
        "checks": {name: JUDGED[verdicts[name][0]] for name in CHECKS},
        "check_evidence": {name: verdicts[name][1] for name in CHECKS},
        "first_violation": violations[0][1] if violations else None,
        "worker_failure": r0["worker_failure"],
        "in_flight_at_end": [cycle for res in results for cycle in res["in_flight_at_end"]],
        "verdict": verdict,
        "passed": verdict == PASSED,
        "wall_seconds": wall_s,
        "config": config.to_json(),
    }


def _initial_placement(config: SimulateConfig, results: list[dict], bal: list, bal_off: list) -> dict | None:
    """With ``--initial-placement``: the file, the first step's balancedness measured (the ranks' routed
    selections) beside the one ``plan`` computes for the installed placement on that step's load and
    EPLB off's, ``plan``'s own prediction on the load the file was made from (its ``source``, when it
    says), and whether every rank's slots held their logical experts right after start-up (None: the
    world's only evidence is the verifier's check of the install)."""
    if config.initial_placement is None:
        return None
    import json

    held = [res.get("initial_placement", {}).get("slot_mismatches") for res in results]
    predicted = None
    try:
        provenance = json.loads(Path(config.initial_placement).read_text(encoding="utf-8")).get("source")
        predicted = provenance.get("balancedness_after") if isinstance(provenance, dict) else None
    except (OSError, ValueError, AttributeError):
        pass  # an events file (JSON lines), or a file without provenance
    return {
        "source": config.initial_placement,
        "first_step_balancedness": bal[0] if bal else None,
        "first_step_planned": results[0].get("initial_placement", {}).get("first_step_planned"),
        "first_step_off": bal_off[0] if bal_off else None,
        "plan_predicted_on_its_load": predicted,
        "slots_hold_their_experts": None if None in held else all(m == [] for m in held),
        "slot_mismatches": [m for m in held if m],
    }


def rearrangement_records(events_file: Path) -> dict:
    """What each closed window became, from the serving events file's ``rearrangement`` records (and the
    ``rearrangement_realised`` ones: the next window's balancedness under the placement), oldest first.

    Returns ``report.json``'s ``rearrangement_records`` (per record: ``rearrangement``, the 1-based
    window index, None for a window without load; ``step``, the step the record was made in;
    ``policy``; ``skipped``: None or the gate's reason; ``balancedness_before`` (the window under the
    placement committed when it closed), ``balancedness_planned`` (under the policy's placement; None
    when the policy did not run), ``balancedness_realised`` (the next window with load under the placement
    in force after it; None until one closed); ``experts_moved``, ``bytes_moved`` (what the ranks received
    together, at the run's expert size), ``layers_changed``), ``rearrangements_skipped`` (count per reason
    of ``ascend_eplb.control.policy_config.SKIP_REASONS``, each listed) and ``experts_moved`` (the sum).
    A rearrangement still moving when the run ended has no record yet. No events file (a rank on
    another host wrote it): no records.
    """
    from ascend_eplb.control.policy_config import SKIP_REASONS

    records: list[dict] = []
    if events_file.is_file():
        from ascend_eplb.integration.events import read_records

        events = [record for _, record in read_records(events_file)]
        realised = {
            e["rearrangement"]: e["balancedness_realised"]
            for e in events
            if e["event"] == "rearrangement_realised"
        }
        keys = ("policy", "skipped", "balancedness_before", "balancedness_planned")
        for e in events:
            if e["event"] != "rearrangement":
                continue
            index = e["rearrangement"]
            records.append({
                "rearrangement": index, "step": e["step"], **{k: e[k] for k in keys},
                "balancedness_realised": None if index is None else realised.get(index),
                "experts_moved": e["experts_moved"], "bytes_moved": e["bytes_moved"],
                "layers_changed": e["layers_changed"],
            })  # fmt: skip
    return {
        "rearrangement_records": records,
        "rearrangements_skipped": {r: sum(x["skipped"] == r for x in records) for r in SKIP_REASONS},
        "experts_moved": sum(x["experts_moved"] for x in records),
    }


def _costs(config: SimulateConfig, routing: Any, busiest_experts: int, rearrangements: int) -> dict | None:
    """With ``--model-config``: the costs at the model's size (:mod:`ascend_eplb.tools.costs`); the
    busiest rank's experts received per rearrangement are the simulated ones per simulated layer,
    scaled to the model's MoE layers."""
    if config.model_config is None:
        return None
    from ascend_eplb.tools.costs import estimate_costs, read_model_size

    model = read_model_size(config.model_config)
    per_layer = busiest_experts / max(rearrangements, 1) / routing.num_moe_layers if busiest_experts else None
    c = estimate_costs(
        model,
        config.quant_format,
        num_ranks=config.num_ranks,
        num_redundant_experts=config.num_redundant_experts,
        link_gbps=config.link_gbps,
        busiest_rank_experts_per_layer=per_layer,
    )
    return {"model": model.source, "num_moe_layers": model.num_moe_layers, **c.to_json()}
