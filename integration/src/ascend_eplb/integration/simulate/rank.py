"""One EP rank of ``ascend-eplb simulate``: MoE layers on quant_views storage, driven in MRv2 order.

Per step, on every rank (upstream vLLM 0.33.0 Model Runner V2 order, ``vllm/v1/worker/gpu/model_runner.py``):

1. ``AscendEPLBController.set_batch_phase(batch_has_prefill)`` then ``prepare_forward(model_config, B)``
   (``B`` = real tokens; the batch itself is padded to ``T`` rows, as a graph-captured runner's is);
2. per MoE layer: the recorded top-k logical ids of this rank's tokens go through the dataplane op
   ``map_to_physical_and_record`` with the layer's ``ReplicaLookup`` (mapping + load recording,
   padding excluded); the hidden states, physical ids and weights are all-gathered over the EP group
   (all-gather dispatch), every rank computes its local physical experts with the format's reference
   kernel ``ExpertWeightFormat.apply`` and the partial outputs are summed with ``all_reduce``
   (combine); the rank keeps its own rows;
3. ``AscendEPLBController.step()`` (upstream's ``step_eplb_after``, after sampling).

Checks, every step, every rank (a violation stops every rank at the end of that step):

- ``outputs``: each layer's output for the real tokens equals the EPLB-off reference (the same
  token's logical experts computed with one storage holding all ``E`` logical experts in identity
  placement) within ``OUTPUT_ATOL + OUTPUT_RTOL * max|reference|``;
- ``fingerprints``: after a layer commits, every local slot's ``expert_fingerprint`` equals the one of
  the logical expert upstream's ``physical_to_logical_map`` assigns to it;
- ``lookups``: each layer's lookup table keeps its storage and equals ``build_replica_table`` of the
  committed upstream maps; the committed maps' checksums are equal on every rank (all_gather);
- ``load``: the recorded ``expert_load_pass`` equals the bincount of the real (unpadded) tokens' physical
  ids when recording was on, and is zero when it was off;
- ``worker``: upstream's async worker thread is alive.
"""

from __future__ import annotations

import os
import pickle
import time
import traceback
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import numpy as np
import torch
import torch.distributed as dist
from vllm.config import EPLBConfig, ParallelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed.parallel_state import (
    destroy_distributed_environment,
    destroy_model_parallel,
    get_ep_group,
    init_distributed_environment,
    initialize_model_parallel,
)
from vllm.model_executor.models.interfaces import MixtureOfExperts

from ascend_eplb.control import AscendEPLBController, AscendEplbLayerState
from ascend_eplb.dataplane import build_replica_table, table_checksum
from ascend_eplb.integration.patches import apply_patches
from ascend_eplb.integration.simulate.config import CHECKS, OUTPUT_ATOL, OUTPUT_RTOL
from ascend_eplb.quant_views import expert_fingerprint, get_format

__all__ = ["CHECKS", "OUTPUT_ATOL", "OUTPUT_RTOL", "rank_main"]

_HIDDEN_TABLE_ROWS = 4096


class _ModelConfig:
    """The two members of ``ModelConfig`` upstream EPLB reads (``model``, ``compute_hash``)."""

    def __init__(self, name: str) -> None:
        self.model = name

    def compute_hash(self) -> str:
        return "ascend-eplb-simulate:" + self.model


def _expert_weights(seed: int, layer: int, expert: int, hidden: int, inter: int) -> tuple[torch.Tensor, ...]:
    """Deterministic float32 checkpoint weights of one logical expert: ``w13 (2I, H)``, ``w2 (H, I)``."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + layer * 1009 + expert)
    w13 = torch.randn(2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(hidden, inter, generator=g) / inter**0.5
    return w13, w2


class ReplayRouter:
    """The layer's router: expert selection is the trace's recorded top-k (selected once, upstream of
    here); ``_apply_eplb_mapping`` has upstream ``BaseRouter``'s signature and off-CUDA behaviour
    (identity) until the integration binds dataplane's mapping onto this instance (``bind_router``)."""

    def __init__(self, eplb_state: AscendEplbLayerState) -> None:
        self.eplb_state = eplb_state

    def _apply_eplb_mapping(self, topk_ids: torch.Tensor) -> torch.Tensor:
        return topk_ids


class SimMoELayer(torch.nn.Module):
    """One MoE layer's local experts: quant_views storage, its ``AscendEplbLayerState`` and router."""

    def __init__(self, fmt: Any, storage: Any, rank: int, skip_scale_view: bool) -> None:
        super().__init__()
        self.fmt, self.storage = fmt, storage
        self.eplb_state = AscendEplbLayerState(ep_rank=rank)
        self.router = ReplayRouter(self.eplb_state)
        self.skip_scale_view = skip_scale_view

    def get_expert_weights(self) -> list[Any]:
        views = list(self.fmt.weight_views(self.storage))
        if self.skip_scale_view:  # fault injection: a weight view that forgets one scale tensor
            names = list(self.storage.kernel_tensors)
            drop = next(i for i, n in enumerate(names) if "scale" in n)
            del views[drop]
        return views

    def set_eplb_state(self, moe_layer_idx, expert_load_view, logical_to_physical_map, logical_replica_count):
        self.eplb_state.set_layer_state(
            moe_layer_idx, expert_load_view, logical_to_physical_map, logical_replica_count
        )


class SimMoEModel(torch.nn.Module, MixtureOfExperts):
    """The upstream ``MixtureOfExperts`` contract over :class:`SimMoELayer` s."""

    def __init__(self, layers: list[SimMoELayer], num_logical: int, num_redundant: int, num_ranks: int):
        super().__init__()
        self.moe_layers = layers
        self.num_moe_layers = len(layers)
        self.num_expert_groups = 1
        self.num_logical_experts = num_logical
        self.num_routed_experts = num_logical
        self.num_redundant_experts = num_redundant
        self.num_physical_experts = num_logical + num_redundant
        self.num_local_physical_experts = self.num_physical_experts // num_ranks
        self.num_shared_experts = 0
        self.expert_weights = []

    def update_physical_experts_metadata(self, num_physical_experts, num_local_physical_experts):
        self.num_physical_experts = num_physical_experts
        self.num_local_physical_experts = num_local_physical_experts


class _CheckViolationError(Exception):
    def __init__(self, check: str, message: str) -> None:
        super().__init__(f"{check}: {message}")
        self.check = check


def _vllm_config(cfg: dict, num_ranks: int) -> VllmConfig:
    vc = VllmConfig(
        parallel_config=ParallelConfig(tensor_parallel_size=num_ranks, enable_expert_parallel=True)
    )
    vc.parallel_config.enable_eplb = True
    vc.parallel_config.eplb_config = EPLBConfig(
        window_size=cfg["window_size"],
        step_interval=cfg["step_interval"],
        num_redundant_experts=cfg["num_redundant_experts"],
        use_async=True,
        communicator="torch_gloo",
    )
    return vc


def rank_main(
    rank: int, num_ranks: int, init_method: str, cfg: dict, trace_file: str, out_dir: str, queue
) -> None:
    """Process entry point: run the simulation on this rank; write ``rank<r>.pkl`` (result or error)."""
    result_path = os.path.join(out_dir, f"rank{rank}.pkl")
    try:
        payload = ("ok", _run(rank, num_ranks, init_method, cfg, trace_file, queue))
    except BaseException:
        payload = ("error", traceback.format_exc())
    with open(result_path, "wb") as f:
        pickle.dump(payload, f)
    if payload[0] == "ok":
        # Release vLLM's groups (and the shared-memory message queue of its TP group) so the
        # resource tracker has nothing to reclaim; after a failure, exit at once instead.
        destroy_model_parallel()
        destroy_distributed_environment()
    os._exit(0 if payload[0] == "ok" else 1)


def _run(rank: int, num_ranks: int, init_method: str, cfg: dict, trace_file: str, queue) -> dict:
    torch.set_num_threads(1)
    apply_patches()
    data = np.load(trace_file)
    ids_all, w_all, seq_offsets = data["topk_ids"], data["topk_weights"], data["seq_offsets"]
    num_layers, num_tokens, top_k = ids_all.shape
    num_logical = int(data["num_logical_experts"])
    num_redundant = cfg["num_redundant_experts"]
    num_physical = num_logical + num_redundant
    per_rank = num_physical // num_ranks
    hidden, inter, seed = cfg["hidden_size"], cfg["intermediate_size"], cfg["seed"]
    batch, padded = cfg["batch_size"], cfg["padded_size"]
    seq_starts = np.zeros(num_tokens, dtype=bool)
    seq_starts[seq_offsets[:-1]] = True

    vc = _vllm_config(cfg, num_ranks)
    with set_current_vllm_config(vc):
        init_distributed_environment(
            world_size=num_ranks,
            rank=rank,
            distributed_init_method=init_method,
            local_rank=rank,
            backend="gloo",
        )
        initialize_model_parallel(tensor_model_parallel_size=num_ranks)
        group = get_ep_group().cpu_group
        device = torch.device("cpu")
        fmt = get_format(cfg["quant_format"])

        # Storage: this rank's slots under upstream's initial placement. Reference (the EPLB-off world):
        # logical experts in identity placement, rank r holding the r-th contiguous share of the E,
        # built from the same checkpoint weights and never touched by EPLB.
        linear = list(range(num_logical)) + [i % num_logical for i in range(num_redundant)]
        mine = linear[rank * per_rank : (rank + 1) * per_rank]
        shares = np.array_split(np.arange(num_logical), num_ranks)
        ref_lo, ref_hi = int(shares[rank][0]), int(shares[rank][-1]) + 1
        layers, ref_storages, ref_fps = [], [], []
        for layer in range(num_layers):
            pairs = [_expert_weights(seed, layer, e, hidden, inter) for e in range(num_logical)]
            w13, w2 = torch.stack([w[0] for w in pairs]), torch.stack([w[1] for w in pairs])
            storage = fmt.create_storage(w13[mine], w2[mine])
            full = fmt.create_storage(w13, w2)  # only for every logical expert's fingerprint
            layers.append(SimMoELayer(fmt, storage, rank, cfg["fault"] == "view-skips-scale"))
            ref_storages.append(fmt.create_storage(w13[ref_lo:ref_hi], w2[ref_lo:ref_hi]))
            ref_fps.append([expert_fingerprint(full, e) for e in range(num_logical)])
        model = SimMoEModel(layers, num_logical, num_redundant, num_ranks)
        model_config = _ModelConfig(cfg["trace_name"])

        controller = AscendEPLBController(vc.parallel_config, device, cfg["load_collection_phase"])
        controller.prepare_load()
        added = controller.maybe_register_model(model, model_config)
        controller.maybe_start_async_loop(added)
        state = controller.state
        model_state = state.model_states[model_config.compute_hash()]
        unbound = [i for i, layer in enumerate(layers) if "_apply_eplb_mapping" not in vars(layer.router)]
        if unbound:
            raise RuntimeError(
                f"the integration did not bind dataplane's mapping on the routers of layers {unbound}"
            )
        lookups = [layer.eplb_state.replica_lookup for layer in layers]
        table_ptrs = [lk.table.data_ptr() for lk in lookups]

        if cfg["fault"] == "wrong-lookup-refresh":
            stale = [(lt.logical_to_physical_map.clone(), lt.logical_replica_count.clone()) for lt in
                     (layer.eplb_state for layer in layers)]  # fmt: skip

            def wrong_refresh(layer_state=layers[0].eplb_state, old=stale[0]):
                layer_state.replica_lookup.refresh_(*old)  # keeps serving the pre-commit placement

            layers[0].eplb_state.refresh_replica_lookup = wrong_refresh

        g = torch.Generator().manual_seed(seed)
        hidden_table = torch.randn(_HIDDEN_TABLE_ROWS, hidden, generator=g)
        ids_all = torch.from_numpy(ids_all.astype(np.int64))  # [L, T_trace, K]
        w_all = torch.from_numpy(w_all.astype(np.float32))
        world_rows = num_ranks * padded
        real = torch.cat([torch.arange(padded) < batch] * num_ranks)  # [N*T] real (unpadded) rows
        layer_offsets = torch.arange(num_layers).view(num_layers, 1, 1)
        lookup_cache = _LookupCache(num_layers)
        stats: dict[str, Any] = {
            "balancedness_per_step": [],
            "rank_load_per_step": [],
            "step_seconds": [],
            "step_cpu_seconds": [],
            "step_in_flight": [],
            "commits_per_step": [],
            "rearrangements_per_step": [],
            "max_output_error": 0.0,
        }
        violation: _CheckViolationError | None = None
        cursor = 0
        log_len = len(state.commit_log)
        for step in range(cfg["steps"]):
            t0, c0 = time.perf_counter(), time.process_time()
            # This rank's real tokens, in trace order (the world consumes N*B tokens per step).
            tok = torch.from_numpy((cursor + rank * batch + np.arange(batch)) % num_tokens)
            cursor += num_ranks * batch
            pad_ids = torch.randint(0, num_logical, (padded - batch, top_k), generator=g)
            controller.set_batch_phase(bool(seq_starts[tok.numpy()].any()))
            controller.prepare_forward(model_config, batch)
            recording = bool(controller.last_record_decision)
            hid = torch.zeros(padded, hidden)
            hid[:batch] = hidden_table[tok % _HIDDEN_TABLE_ROWS]
            ids = torch.empty(num_layers, padded, top_k, dtype=torch.int64)  # [L, T, K] logical
            ids[:, :batch] = ids_all[:, tok]
            ids[:, batch:] = pad_ids
            wts = torch.zeros(num_layers, padded, top_k)
            wts[:, :batch] = w_all[:, tok]
            # Router of every layer: the bound router runs dataplane's map_to_physical_and_record on
            # the layer's lookup (records the first B rows when recording is on).
            phys = torch.stack([layers[i].router._apply_eplb_mapping(ids[i]) for i in range(num_layers)])
            # Dispatch: all-gather of every layer's logical and physical ids, weights and the hidden
            # states (one collective per dtype for all layers: the layers of this simulator are
            # independent, each reads the batch's hidden states).
            ints = torch.cat([ids, phys.to(torch.int64)], dim=2).transpose(0, 1).contiguous()  # [T, L, 2K]
            floats = torch.cat([hid, wts.transpose(0, 1).reshape(padded, -1)], dim=1)  # [T, H + L*K]
            gi = [torch.empty_like(ints) for _ in range(num_ranks)]
            dist.all_gather(gi, ints, group=group)
            gf = [torch.empty_like(floats) for _ in range(num_ranks)]
            dist.all_gather(gf, floats, group=group)
            all_ints, all_f = torch.cat(gi).transpose(0, 1), torch.cat(gf)  # [L, N*T, 2K], [N*T, H+L*K]
            all_logical, all_phys = all_ints[..., :top_k], all_ints[..., top_k:]
            all_hid = all_f[:, :hidden]
            all_wts = all_f[:, hidden:].reshape(world_rows, num_layers, top_k).transpose(0, 1)
            # Local experts with the format's reference kernel: [0] EPLB placement (every row, padding
            # included, as a graph-captured runner computes it), [1] the EPLB-off reference (real rows).
            local = all_phys - rank * per_rank
            local = torch.where((local >= 0) & (local < per_rank), local, -1)
            ref_local = all_logical - ref_lo
            ref_local = torch.where((ref_local >= 0) & (ref_local < ref_hi - ref_lo) & real.view(1, -1, 1),
                                    ref_local, -1)  # fmt: skip
            out = torch.empty(2, num_layers, world_rows, hidden)
            for layer in range(num_layers):
                out[0, layer] = fmt.apply(layers[layer].storage, all_hid, all_wts[layer], local[layer])
                out[1, layer] = fmt.apply(ref_storages[layer], all_hid, all_wts[layer], ref_local[layer])
            dist.all_reduce(out, group=group)  # combine (both worlds, all layers, one collective)
            rows = slice(rank * padded, rank * padded + batch)  # the rank keeps its own rows
            mine, ref = out[0, :, rows], out[1, :, rows]
            err = (mine - ref).abs().amax(dim=(1, 2))  # [L]
            bound = OUTPUT_ATOL + OUTPUT_RTOL * ref.abs().amax(dim=(1, 2))
            stats["max_output_error"] = max(stats["max_output_error"], float(err.max()))
            rank_load = torch.bincount(
                ((all_phys[:, real] // per_rank) + layer_offsets * num_ranks).reshape(-1),
                minlength=num_layers * num_ranks,
            ).view(num_layers, num_ranks).float()  # fmt: skip
            if violation is None and bool((err > bound).any()):
                layer = int((err > bound).nonzero()[0])
                violation = _CheckViolationError(
                    "outputs",
                    f"step {step} layer {layer} rank {rank}: "
                    f"max |out - ref| = {float(err[layer]):.3g} > {float(bound[layer]):.3g}",
                )
            if violation is None:
                expected_load = torch.zeros(num_layers, num_physical, dtype=torch.int32)
                if recording:
                    expected_load = torch.bincount(
                        (phys[:, :batch].to(torch.int64) + layer_offsets * num_physical).reshape(-1),
                        minlength=num_layers * num_physical,
                    ).view(num_layers, num_physical).to(torch.int32)  # fmt: skip
                recorded = model_state.expert_load_pass.clone()
                if not torch.equal(recorded, expected_load):
                    bad = int((recorded != expected_load).any(dim=1).nonzero()[0])
                    violation = _CheckViolationError(
                        "load",
                        f"step {step} rank {rank} layer {bad}: recorded "
                        f"{recorded[bad].sum().item()} selections, expected "
                        f"{expected_load[bad].sum().item()} (recording {'on' if recording else 'off'})",
                    )
            in_flight = bool(model_state.rebalanced)
            controller.step()
            stats["step_seconds"].append(time.perf_counter() - t0)
            stats["step_cpu_seconds"].append(time.process_time() - c0)  # this process, all its threads
            stats["step_in_flight"].append(in_flight)
            new_events = list(state.commit_log)[log_len:] if len(state.commit_log) >= log_len else []
            log_len = len(state.commit_log)
            committed = sorted({ev.layer for ev in new_events if ev.kind == "commit"})
            stats["commits_per_step"].append(committed)
            stats["rearrangements_per_step"].append(state.num_rearrangements)
            if violation is None:
                violation = _check_after_step(
                    rank, step, num_ranks, per_rank, num_physical, group, layers, lookups, table_ptrs,
                    model_state, committed, ref_fps, state, lookup_cache,
                )  # fmt: skip
            loads = rank_load.numpy()
            bal = float(np.mean(loads.mean(axis=1) / np.maximum(loads.max(axis=1), 1)))
            stats["balancedness_per_step"].append(bal)
            stats["rank_load_per_step"].append(loads.sum(axis=0).tolist())
            flag = torch.tensor([0 if violation is None else 1], dtype=torch.int32)
            dist.all_reduce(flag, group=group)
            if rank == 0 and queue is not None:
                queue.put(("step", step, state.num_rearrangements, bal))
            if int(flag) > 0:
                break
        stats["violation"] = None if violation is None else (violation.check, str(violation))
        stats["steps_run"] = len(stats["step_seconds"])
        stats["num_rearrangements"] = state.num_rearrangements
        stats["commit_log_tail"] = [(ev.kind, ev.layer, ev.rearrangement) for ev in list(state.commit_log)]
        stats["bytes_moved"] = _bytes_moved(model_state)
        return stats


class _LookupCache:
    """Per layer: the committed maps last seen and ``build_replica_table`` of them, rebuilt only when the
    committed maps change (the comparison with the live table still runs every step)."""

    def __init__(self, num_layers: int) -> None:
        self.maps: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers
        self.tables: list[torch.Tensor | None] = [None] * num_layers

    def expected(self, layer, l2p, counts, rank, rows, num_physical, dtype) -> torch.Tensor:
        seen = self.maps[layer]
        if seen is None or not (torch.equal(seen[0], l2p) and torch.equal(seen[1], counts)):
            table = build_replica_table(l2p, counts, rank, rows, num_physical_experts=num_physical)
            self.maps[layer] = (l2p.clone(), counts.clone())
            self.tables[layer] = table.to(dtype)
        return self.tables[layer]


def _check_after_step(rank, step, num_ranks, per_rank, num_physical, group, layers, lookups, table_ptrs,
                      model_state, committed, ref_fps, state, lookup_cache):  # fmt: skip
    """``worker``, ``lookups`` (every layer) and ``fingerprints`` (layers committed this step)."""
    worker = getattr(state, "async_worker", None)
    if worker is not None and not worker.is_alive():
        return _CheckViolationError(
            "worker", f"step {step} rank {rank}: upstream's async EPLB worker thread died"
        )
    p2l = model_state.physical_to_logical_map
    l2p, counts = model_state.logical_to_physical_map, model_state.logical_replica_count
    sums = torch.tensor([table_checksum(p2l[i : i + 1]) for i in range(p2l.shape[0])], dtype=torch.int64)
    gathered = [torch.empty_like(sums) for _ in range(num_ranks)]
    dist.all_gather(gathered, sums, group=group)
    for other, theirs in enumerate(gathered):
        if not torch.equal(theirs, sums):
            layer = int((theirs != sums).nonzero()[0])
            return _CheckViolationError(
                "lookups", f"step {step} layer {layer}: committed map of rank {other} != rank {rank}"
            )
    for layer, lookup in enumerate(lookups):
        if lookup.table.data_ptr() != table_ptrs[layer]:
            return _CheckViolationError(
                "lookups", f"step {step} layer {layer} rank {rank}: lookup table storage changed"
            )
        expected = lookup_cache.expected(
            layer, l2p[layer], counts[layer], rank, lookup.rows, num_physical, lookup.table.dtype
        )
        if not torch.equal(lookup.table, expected):
            return _CheckViolationError(
                "lookups",
                f"step {step} layer {layer} rank {rank}: lookup checksum {lookup.checksum()} != "
                f"committed map's {table_checksum(expected)}",
            )
    for layer in committed:
        storage = layers[layer].storage
        for row in range(per_rank):
            logical = int(p2l[layer, rank * per_rank + row])
            if expert_fingerprint(storage, row) != ref_fps[layer][logical]:
                return _CheckViolationError(
                    "fingerprints",
                    f"step {step} layer {layer} rank {rank} slot {rank * per_rank + row}: weights are "
                    f"not logical expert {logical}'s after the commit",
                )
    return None


def _bytes_moved(model_state) -> int:
    stats = getattr(model_state.communicator, "cumulative_stats", None)
    if stats is None:
        return 0
    value = stats() if callable(stats) else stats
    for name in ("bytes_received", "bytes_recv", "recv_bytes", "bytes"):
        if hasattr(value, name):
            return int(getattr(value, name))
    return 0
