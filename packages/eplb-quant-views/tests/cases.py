"""Shared cases of the quant-views tests (a plain module, loaded by path from each test file)."""

from __future__ import annotations

import torch

from ascend_eplb.quant_views import build_expert_storage, get_format

# GLOSSARY.md letters: p local physical experts, H hidden, I intermediate, T tokens. Distinct H, I and 2I,
# so no transposed layout passes for another.
p, H, I = 4, 192, 64  # noqa: E741
T = 12

# (case id, format name, create_storage options, with_bias)
VARIANTS = [
    ("bf16", "bf16", {}, False),
    ("bf16-bias", "bf16", {}, True),
    ("fp16", "fp16", {}, False),
    ("w8a8", "w8a8_dynamic", {}, False),
    ("w8a8-fused", "w8a8_dynamic", {"fused_scales": True}, False),
    ("w4a8", "w4a8_dynamic", {}, False),
    ("mxfp8", "mxfp8", {}, False),
    ("mxfp4", "mxfp4", {}, False),
]
CASES = [(v, lists) for v in VARIANTS for lists in (False, True)]
CASE_IDS = [f"{v[0]}-{'lists' if lists else 'stacked'}" for v, lists in CASES]


def build(variant, per_expert_lists, ids=(0, 1, 2, 3), seed=7):
    _, name, options, with_bias = variant
    fmt = get_format(name)
    storage = build_expert_storage(
        fmt, list(ids), H, I, seed=seed, per_expert_lists=per_expert_lists, with_bias=with_bias, **options
    )
    return fmt, storage


def comm_paths(storage):
    return ("standard", "fused_mc2") if "fused_w1_scale" in storage.kernel_tensors else ("standard",)


def hidden(seed=3):
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def route_to(row):
    """Every token to local row ``row`` (k=0, weight 0.75) and to no local expert (k=1, id -1)."""
    ids = torch.tensor([[row, -1]] * T, dtype=torch.int64)
    weights = torch.tensor([[0.75, 0.25]] * T, dtype=torch.float32)
    return weights, ids


def outputs_per_row(fmt, storage, x):
    """{(row, comm_path): apply output with every token routed to that row}."""
    out = {}
    for row in range(storage.num_local_experts):
        w, ids = route_to(row)
        for path in comm_paths(storage):
            out[row, path] = fmt.apply(storage, x, w, ids, comm_path=path)
    return out


def one_torch_thread():
    """Generator for an autouse fixture: these tensors are tiny, and on a loaded shared CPU intra-op
    threads make each op 30x slower (measured); restore the caller's setting afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
