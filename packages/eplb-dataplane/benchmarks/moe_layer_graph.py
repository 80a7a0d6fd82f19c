"""Check e of the device check: a whole torch-only MoE layer in one graph, replayed across rearrangements.

Two rank processes (``ascend_eplb.launch.run_ranks``, Gloo) hold the ``P = E + R`` physical experts of
one MoE layer, ``p = P / 2`` each, in the storage of each supported expert-weight format (both storage
modes: stacked and per-expert lists; W8A8 with and without its fused scales). Per format, each rank
builds the layer the way serving binds it:

* a router with upstream's mapping method ``_apply_eplb_mapping(self, topk_ids)``, bound by dataplane's
  ``bind_router`` to a layer state over a ``ReplicaLookup``, a load view, the record flag, the unpadded
  count and the row layout (TP-replicated rows: rank 0 records, rank 1 routes the same rows);
* expert compute reading the format's kernel tensors through their storage (quant_views
  ``apply_graph_safe``: every local row on every token, fixed shapes, no host read).

The layer's forward is captured once: a CUDA graph on ``cuda``; on ``cpu``, which has no graph capture,
one TorchDynamo trace with every guard dropped (dataplane ``trace_once``, what vLLM's CPU platform
compiles with), whose graph inputs are recorded. Then, several times: a new placement is installed
through upstream vLLM's transaction of one layer (``transfer_layer``, ``move_from_buffer``: in-place
copies into the format's weight views) with the movement plane's ``AscendGlooEplbCommunicator`` for the
cross-rank experts, the lookup is refreshed in place, the record flag and the unpadded count are
written in place; the graph is replayed and its output and recorded load must equal an eager forward's,
and the output summed over the ranks must equal the EPLB-off reference (every logical expert on one
storage, its logical ids) within the activation dtype's rounding of the partial sums. On CPU,
every tensor the trace reads keeps its storage (``TracedGraph.moved``), each format's kernel tensors
included, and nothing is traced again.

Shape letters (DESIGN.md section 2): E logical experts, R redundant, P physical, p local physical, T
tokens, K top-k, H hidden size, I intermediate size.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

E, R, K = 8, 4, 2
P = E + R
#: (label, format, create_storage options); every supported format (quant_views' support table).
FORMATS = (
    ("bf16", "bf16", {}),
    ("fp16", "fp16", {}),
    ("w8a8_dynamic", "w8a8_dynamic", {}),
    ("w8a8_dynamic fused scales", "w8a8_dynamic", {"fused_scales": True}),
    ("w4a8_dynamic", "w4a8_dynamic", {}),
    ("mxfp8", "mxfp8", {}),
    ("mxfp4", "mxfp4", {}),
)


class Router:
    """The upstream router's shape: a gate, top-k, then ``_apply_eplb_mapping(topk_ids)`` (vLLM 0.33.0
    ``BaseRouter``'s method and signature, which ``bind_router`` replaces on the instance)."""

    def __init__(self, gate: torch.Tensor) -> None:
        self.gate = gate  # float32 (E, H)
        self.eplb_state: Any = None

    def _apply_eplb_mapping(self, topk_ids: torch.Tensor) -> torch.Tensor:
        return topk_ids

    def logical(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-K weights and logical ids (T, K) of ``x`` (T, H)."""
        return torch.topk(torch.softmax(x.float() @ self.gate.T, dim=-1), K)

    def select(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = self.logical(x)
        return weights, self._apply_eplb_mapping(ids)


class MoeLayer:
    """One rank's MoE layer: the bound router, then this rank's experts from the format's storage,
    once per communication path the storage serves (W8A8 with fused scales: the standard path and
    vLLM Ascend's MC2 path, which read different scale tensors of the same experts)."""

    def __init__(
        self, fmt: Any, storage: Any, router: Router, rank: int, comm_paths: tuple[str, ...]
    ) -> None:
        self.fmt, self.storage, self.router, self.rank = fmt, storage, router, rank
        self.comm_paths, self.p = comm_paths, storage.num_local_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (T, H) -> this rank's partial outputs (paths, T, H): its local selections only."""
        weights, physical = self.router.select(x)
        local = torch.where(physical // self.p == self.rank, physical % self.p, -1)
        return torch.stack(
            [self.fmt.apply_graph_safe(self.storage, x, weights, local, comm_path=c) for c in self.comm_paths]
        )


def placement(step: int) -> torch.Tensor:
    """int64 (P,) physical -> logical: upstream's initial placement at step 0 (experts in order, then
    the first R again), then a shuffle with R replicas of random experts."""
    if step == 0:
        return torch.cat([torch.arange(E), torch.arange(R)])
    gen = torch.Generator().manual_seed(step)
    slots = torch.cat([torch.arange(E), torch.randint(0, E, (R,), generator=gen)])
    return slots[torch.randperm(P, generator=gen)]


def _capture(device: torch.device, forward: Any, x: torch.Tensor) -> tuple[Any, Any]:
    """``(replay, observer)``: ``replay()`` runs the captured forward on ``x``'s storage and returns its
    output; ``observer`` records the trace's inputs (CPU) or is None (a CUDA graph)."""
    if device.type == "cuda":
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside the capture (allocations, kernel selection)
                forward(x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = forward(x)

        def replay() -> torch.Tensor:
            graph.replay()
            torch.cuda.synchronize()
            return out

        return replay, None
    from ascend_eplb.dataplane import trace_once

    # Every layer's forward is one code object; with guards dropped a cached trace of another case's
    # layer would be taken for this one: start from an empty cache (vLLM clears it per model too).
    torch._dynamo.reset()
    compiled, observer = trace_once(forward)
    compiled(x)  # the one trace
    return (lambda: compiled(x)), observer


def _case(
    ctx: Any, device: torch.device, group: Any, comm: Any, case: tuple, sizes: tuple, rounds: int
) -> dict:
    import numpy as np
    import torch.distributed as dist
    from vllm.distributed.eplb.eplb_state import compute_logical_maps
    from vllm.distributed.eplb.rebalance_execute import move_from_buffer, transfer_layer

    from ascend_eplb.dataplane import ReplicaLookup, bind_router
    from ascend_eplb.quant_views import build_expert_storage, get_format

    label, name, options = case
    hidden, inter, tokens, lists = sizes
    fmt = get_format(name)
    rank, p = ctx.rank, P // 2
    dtype = torch.float16 if name == "fp16" else torch.bfloat16
    comm_paths = ("standard", "fused_mc2") if options.get("fused_scales") else ("standard",)
    p2l = placement(0)
    storage = build_expert_storage(
        fmt, p2l[rank * p : (rank + 1) * p].tolist(), hidden, inter, per_expert_lists=lists, device=device,
        **options,
    )  # fmt: skip
    reference = build_expert_storage(fmt, list(range(E)), hidden, inter, device=device, **options)
    gen = torch.Generator().manual_seed(11)
    router = Router((torch.randn(E, hidden, generator=gen) / hidden**0.5).to(device))
    load = torch.zeros(1, P, dtype=torch.int32, device=device)
    l2p, counts = compute_logical_maps(p2l.view(1, -1), E)
    lookup = ReplicaLookup(E, device, num_physical_experts=P)
    lookup.refresh_(l2p[0].to(device), counts[0].to(device))
    state = SimpleNamespace(
        replica_lookup=lookup,
        expert_load_view=load[0],
        should_record_tensor=torch.tensor(True, device=device),
        num_unpadded_tokens_tensors=[torch.tensor(tokens, dtype=torch.int32, device=device)],
        # TP-replicated rows: replica offset 0 on both, rank 0 records, rank 1 routes the same rows
        row_layout=torch.tensor([0, 1, 0 if rank == 0 else -1, 0], dtype=torch.int64, device=device),
    )
    bind_router(router, state)
    layer = MoeLayer(fmt, storage, router, rank, comm_paths)
    x = torch.randn(tokens, hidden, generator=gen).to(device=device, dtype=dtype)  # the captured input
    replay, observer = _capture(device, layer.forward, x)
    views = [v.view(torch.uint8) if v.element_size() == 1 else v for v in fmt.weight_views(storage)]
    buffers = [torch.empty_like(v) for v in views]
    out: dict[str, Any] = {"case": label, "lists": lists, "failures": [], "moved": [], "rearrangements": 0}
    for step in range(rounds + 1):
        if step:
            new = placement(step)
            meta = transfer_layer(p2l, new, views, buffers, group, comm, layer_idx=step)
            move_from_buffer(views, buffers, meta, np.asarray(new), rank)
            p2l = new
            l2p, counts = compute_logical_maps(p2l.view(1, -1), E)
            lookup.refresh_(l2p[0].to(device), counts[0].to(device))
            state.num_unpadded_tokens_tensors[0].fill_(tokens - step)  # padded rows are not counted
            state.should_record_tensor.fill_(step % 3 != 2)
            out["rearrangements"] += 1
        load.zero_()
        replayed = replay().clone()
        replay_load = load.clone()
        load.zero_()
        eager = layer.forward(x)
        if not torch.equal(replayed, eager):
            out["failures"].append(f"step {step}: replayed output != eager")
        if not torch.equal(replay_load, load):
            out["failures"].append(
                f"step {step}: replayed load {replay_load.tolist()} != eager {load.tolist()}"
            )
        unpadded, recording = int(state.num_unpadded_tokens_tensors[0]), bool(state.should_record_tensor)
        counted = unpadded * K if recording and rank == 0 else 0
        if int(replay_load.sum()) != counted:
            out["failures"].append(f"step {step}: {int(replay_load.sum())} selections counted, not {counted}")
        total = replayed.float()
        dist.all_reduce(total, group=group)  # EP: each token's partial outputs on both ranks
        weights, logical = router.logical(x)
        want = torch.stack(
            [fmt.apply_graph_safe(reference, x, weights, logical, comm_path=c) for c in comm_paths]
        ).float()
        # A rank rounds its partial sum to the activation dtype: a token whose two experts sit on one
        # rank is rounded once, on two ranks twice. A moved expert in the wrong slot is off by O(1).
        bound = 2 * torch.finfo(dtype).eps * float(want.abs().max())
        err = float((total - want).abs().max())
        out["max_reference_error"] = max(out.get("max_reference_error", 0.0), err / float(want.abs().max()))
        if err > bound:
            out["failures"].append(
                f"step {step}: output summed over ranks is {err:.3g} off the EPLB-off reference"
            )
        if observer is not None:
            out["moved"] += observer.graphs[0].moved({"self": layer}, MoeLayer.forward.__globals__)
    if observer is not None:
        out["graphs"] = len(observer.graphs)
        sources = [i.source for i in observer.graphs[0].state]
        out["kernel_inputs"] = sum("storage.kernel_tensors" in s for s in sources)
        out["eplb_inputs"] = sorted({s.rsplit(".", 1)[-1] for s in sources if ".eplb_state." in s})
        out["kernel_tensors"] = sum(
            len(t) if isinstance(t, list) else 1 for t in storage.kernel_tensors.values()
        )
    return out


def moe_layer_rank(ctx: Any, device: str, quick: bool, rounds: int) -> list[dict]:
    """Rank function: every case of :data:`FORMATS` in both storage modes; one result dict per case:
    ``case``, ``lists``, ``failures`` (empty: passed), ``rearrangements``; on CPU also ``moved`` (graph
    inputs whose storage changed), ``graphs`` (traces), ``kernel_inputs`` (graph inputs among the
    format's kernel tensors) and ``kernel_tensors`` (their number), ``eplb_inputs``."""
    import torch.distributed as dist

    from ascend_eplb.movement import AscendGlooEplbCommunicator, StagingPool

    ctx.init_gloo()
    dev = (
        torch.device(device, ctx.local_rank % torch.cuda.device_count())
        if device == "cuda"
        else torch.device(device)
    )
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    group = dist.group.WORLD
    comm = AscendGlooEplbCommunicator(
        group, staging_pool=StagingPool(64 << 20), stage_host_tensors=dev.type == "cpu"
    )
    sizes = (128, 64, 16) if quick else (1024, 512, 256)
    return [
        _case(ctx, dev, group, comm, case, (*sizes, lists), rounds)
        for case in FORMATS
        for lists in (False, True)
    ]
