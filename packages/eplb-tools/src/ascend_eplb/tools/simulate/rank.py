"""One EP rank of ``ascend-eplb simulate --model replay``: a Model Runner V2 worker built the way a serving
worker is (a real model runs on vLLM's engine instead: :mod:`~ascend_eplb.tools.simulate.engine_run`).

:func:`simulate_rank` (under the launcher or ``torchrun``) sets the serving switches, runs vLLM's plugin
loading (the integration's entry point must apply its patches), checks the tools' upstream rows
(:mod:`ascend_eplb.tools.upstream`), then runs the trace replay
(:mod:`~ascend_eplb.tools.simulate.replay_world`). ``fingerprints`` and ``lookups`` are the
serving verifier's and ``worker`` the serving watchdog's (a dead async worker stops EPLB on every rank
and serving goes on); each rank returns what its checks saw (:mod:`~ascend_eplb.tools.simulate.steps`)
for the driver's verdicts. EP rank 0 writes the events file (``ASCEND_EPLB_EVENTS``).
"""

from __future__ import annotations

from ascend_eplb.tools.simulate import cpu_platform as _cpu_platform  # noqa: F401  (before vLLM)

# isort: split

import os
from typing import Any

import torch
import torch.distributed as dist
from vllm.distributed.parallel_state import (
    destroy_distributed_environment,
    destroy_model_parallel,
    get_ep_group,
)
from vllm.plugins import load_general_plugins

from ascend_eplb.integration.patches import patches_applied
from ascend_eplb.integration.placement_file import PlacementFileError
from ascend_eplb.integration.validation import EplbConfigError
from ascend_eplb.launch import RankContext
from ascend_eplb.tools import upstream
from ascend_eplb.tools.simulate.lifecycle import record_rank_resources, record_refusal
from ascend_eplb.tools.simulate.replay_world import QuantExperts, run_replay
from ascend_eplb.tools.simulate.stats import RankConfig, RankStats

__all__ = ["STARTUP_REFUSALS", "QuantExperts", "simulate_rank"]


def _load_plugins() -> None:
    """vLLM's plugin loading, as every vLLM process does it; the integration's entry point must apply."""
    os.environ["ASCEND_EPLB"] = "1"
    load_general_plugins()
    if not patches_applied():
        raise RuntimeError(
            "vLLM's plugin loader did not run the ascend_eplb entry point (vllm.general_plugins): "
            "is ascend-eplb-integration installed, and VLLM_PLUGINS unset or naming ascend_eplb?"
        )


def simulate_rank(ctx: RankContext, cfg: RankConfig, routing: dict, gather: bool = False) -> Any:
    """Rank entry point (``run_ranks`` or torchrun): the simulation of this rank.

    Args:
        ctx: the rank's context (rendezvous, rank, world size).
        cfg: the run's options and what the driver decided for them.
        routing: ``topk_ids (L, trace_tokens, K)``, ``topk_weights``, ``seq_offsets``,
            ``num_logical_experts``.
        gather: gather every rank's statistics to each rank at the end (torchrun, where there is no
            launcher to collect them).

    Returns:
        this rank's statistics (``gather``: the list of every rank's).
    """
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    os.environ["ASCEND_EPLB_VERIFY"] = "1"  # every check of the run is the serving verifier's
    os.environ["ASCEND_EPLB_WORKER_TIMEOUT_S"] = str(cfg.options.worker_timeout_s)
    os.environ["ASCEND_EPLB_ON_WORKER_FAILURE"] = cfg.options.on_worker_failure
    if cfg.events_file:
        os.environ["ASCEND_EPLB_EVENTS"] = cfg.events_file
    # PROMETHEUS_MULTIPROC_DIR comes with the fork server's environment (the driver's).
    os.environ["ASCEND_EPLB_METRICS"] = "1" if cfg.options.metrics else "0"
    torch.set_num_threads(1)
    _load_plugins()
    upstream.check(upstream.SIMULATE)  # what the steps read of upstream's state, before a world starts
    try:
        stats = run_replay(ctx, cfg, routing)
    except BaseException as e:
        _on_failure(ctx, cfg, e)
        raise
    if gather:
        stats = _gather(ctx, stats)
    # Release vLLM's groups (and the shared-memory message queue of its TP group) so nothing is left
    # for the resource tracker; after a failure the launcher ends the process at once instead.
    destroy_model_parallel()
    destroy_distributed_environment()
    return stats


#: The start-up refusals of the serving path (a configuration or a placement file its rules refuse):
#: the command prints their message once, as a refusal (exit 2), not each rank's traceback.
STARTUP_REFUSALS = (EplbConfigError, PlacementFileError)


def _on_failure(ctx: RankContext, cfg: RankConfig, error: BaseException) -> None:
    """Under the launcher (``record_resources``), before the rank's error goes to it: record the vLLM
    resources the rank's groups hold (shared memory and socket files created before the error, e.g.
    before start-up validation refused; the launcher removes them once the rank ended, as a killed
    rank's), and, for a start-up refusal (:data:`STARTUP_REFUSALS`), write its message into the world's
    folder, where the launcher reads it (a message queue is not flushed before a failed rank exits).
    Under torchrun the error itself reaches the command (a refusal is a ``ValueError``: exit 2)."""
    if not cfg.record_resources:
        return
    record_rank_resources(ctx.tmp_dir, ctx.rank)
    if isinstance(error, STARTUP_REFUSALS):
        record_refusal(ctx.tmp_dir, ctx.rank, str(error))


def _gather(ctx: RankContext, stats: RankStats) -> list[RankStats]:
    everyone: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(everyone, stats, group=get_ep_group().cpu_group)
    return everyone
