"""Torch forms of the ``vllm._C`` operations vLLM 0.33.0's CPU engine calls, for a build without ``_C``.

vLLM built with ``VLLM_TARGET_DEVICE=empty`` has no ``vllm._C``; its CPU platform's Python code still calls
``torch.ops._C.<op>``. :func:`register` defines each op of :data:`KERNELS` in torch's ``_C`` namespace
(once per process), so vLLM's own code runs unchanged and only the missing compiled kernels are stood in
for. Each is reference-quality torch (loops over requests or experts), checked against HF transformers
through the engine (``integration/tests/test_engine.py``); none is a speed figure. Shapes: T tokens,
H hidden, I intermediate (per TP rank), p local experts, K top-k, heads ``h``, KV heads ``g``, head size D,
block size B.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ascend_eplb.control.patching import check_signatures
from ascend_eplb.world import upstream

__all__ = ["KERNELS", "Kernel", "register", "registered"]


@dataclass(frozen=True)
class Kernel:
    """One ``_C`` op: its ``schema`` (as vLLM's caller passes the arguments), the ``caller`` in vLLM whose
    call it serves (``module.qualname``; a row of ``world.upstream.SIGNATURES`` checked before the op is
    registered, but for ``CPUWorker.__init__``, whose module an engine process alone may import), its torch
    form ``impl`` and its ``fake`` form (what TorchDynamo and inductor run on fake tensors when a compiled
    forward traces the op: the outputs' shapes and dtypes, no values; None for an op that returns nothing,
    whose fake form does nothing)."""

    schema: str
    caller: str
    impl: Callable[..., object]
    fake: Callable[..., object] | None = None

    @property
    def name(self) -> str:
        return self.schema.split("(", 1)[0]


def init_cpu_memory_env(nodes: list[int]) -> None:
    """vLLM's NUMA memory binding of a CPU worker: nothing to bind (one node, threads unbound)."""


def prepack_moe_weight(weight: torch.Tensor, output: torch.Tensor, isa: str) -> None:
    """The kernel layout is the checkpoint layout ``(p, 2I, H)`` / ``(p, H, I)`` here: a copy, so the
    parameter vLLM replaces with ``output`` is what :func:`cpu_fused_moe` reads and what EPLB moves."""
    output.copy_(weight)


def cpu_fused_moe(
    output: torch.Tensor,
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    skip_weighted: bool,
    act: str,
    isa: str,
) -> None:
    """``output (T, H) = sum_k weight_tk * expert_{id_tk}(hidden_t)`` over the selections of local slots.

    ``topk_ids (T, K)`` are local slots (``0 <= id < p``); any other id (-1: another rank's expert) adds
    nothing. ``w13 (p, 2I, H)`` holds gate rows then up rows (SiLU-gated). ``skip_weighted``: the
    weights were applied to ``hidden`` already (top-1 ``apply_router_weight_on_input``).

    Raises:
        NotImplementedError: an activation other than ``silu``.
    """
    if act != "silu":
        raise NotImplementedError(f"the engine world's cpu_fused_moe runs silu, not {act!r}")
    x = hidden.float()
    out = torch.zeros(hidden.shape, dtype=torch.float32)
    for slot in range(w13.shape[0]):
        hit = topk_ids == slot  # (T, K)
        rows = hit.any(dim=1).nonzero().flatten()
        if rows.numel() == 0:
            continue
        b13 = None if w13_bias is None else w13_bias[slot].float()
        gate, up = F.linear(x[rows], w13[slot].float(), b13).chunk(2, dim=-1)
        b2 = None if w2_bias is None else w2_bias[slot].float()
        y = F.linear(F.silu(gate) * up, w2[slot].float(), b2)
        if not skip_weighted:
            y = y * (topk_weights[rows].float() * hit[rows]).sum(dim=1, keepdim=True)
        out.index_add_(0, rows, y)
    output.copy_(out.to(output.dtype))


def get_scheduler_metadata(
    num_reqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    seq_lens: torch.Tensor,
    dtype: torch.dtype,
    query_start_loc: torch.Tensor,
    causal: bool,
    sliding_window_size: int,
    isa: str,
    enable_kv_split: bool,
    dynamic_causal: torch.Tensor | None,
    kv_cache_dtype: str,
) -> torch.Tensor:
    """The compiled kernel's work split; :func:`cpu_attention_with_kv_cache` needs none (empty int32)."""
    return torch.empty(0, dtype=torch.int32)


def _no_output(*args: object) -> None:
    """The fake form of an op that only writes its arguments in place: nothing to compute."""


def _cache_rows(cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, offset) of each slot ``block * B + offset`` of a ``(blocks, g, B, D)`` cache."""
    block_size = cache.shape[2]
    return slots // block_size, slots % block_size


def cpu_attn_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    isa: str,
    k_scale: float,
    v_scale: float,
    kv_cache_dtype: str,
) -> None:
    """Write ``key``/``value (n, g * D)`` into ``key_cache``/``value_cache (blocks, g, B, D)`` at each
    row's slot; slot -1 (padding) is skipped.

    Raises:
        NotImplementedError: a quantized KV cache (``kv_cache_dtype`` other than ``auto``).
    """
    if kv_cache_dtype != "auto":
        raise NotImplementedError(f"the engine world's KV cache is unquantized, not {kv_cache_dtype!r}")
    slots = slot_mapping[: key.shape[0]].long()
    rows = (slots >= 0).nonzero().flatten()
    blocks, offsets = _cache_rows(key_cache, slots[rows])
    # Explicit head sizes: a batch of padding only (a data-parallel rank's dummy batch) has no row.
    heads = key_cache.shape[1]
    key_cache[blocks, :, offsets] = (
        key[rows].reshape(rows.numel(), heads, key_cache.shape[-1]).to(key_cache.dtype)
    )
    value_cache[blocks, :, offsets] = (
        value[rows].reshape(rows.numel(), heads, value_cache.shape[-1]).to(value_cache.dtype)
    )


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """Attention of ``q (n, h, D)`` over ``k (S, h, D)``/``v (S, h, Dv)``, the queries being the last n of
    the S positions; float32, ``(n, h, Dv)``."""
    n, seq_len = q.shape[0], k.shape[0]
    scores = torch.einsum("nhd,shd->hns", q.float(), k.float()) * scale
    if causal:
        future = torch.arange(seq_len)[None, :] > torch.arange(seq_len - n, seq_len)[:, None]
        scores = scores.masked_fill(future, float("-inf"))
    return torch.einsum("hns,shd->nhd", torch.softmax(scores, dim=-1), v.float())


def cpu_attention_with_kv_cache(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    output: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    causal: bool,
    alibi_slopes: torch.Tensor | None,
    sliding_window: int,
    block_table: torch.Tensor,
    softcap: float,
    scheduler_metadata: torch.Tensor,
    s_aux: torch.Tensor | None,
    dynamic_causal: torch.Tensor | None,
    k_scale: float,
    v_scale: float,
    kv_cache_dtype: str,
) -> None:
    """Paged attention of each request's queries ``query (T, h, D)`` (rows ``query_start_loc[r] ..
    [r + 1]``, the last of its ``seq_lens[r]`` positions) over its cached keys and values, read through
    ``block_table (requests, blocks)``; written into ``output (T, h, D)``. GQA repeats each KV head.

    Raises:
        NotImplementedError: ALiBi, a sliding window, a soft cap, attention sinks or a dynamic causal mask
            (none of the engine world's models uses them).
    """
    if alibi_slopes is not None or sliding_window not in (-1, 0) or softcap or s_aux is not None:
        raise NotImplementedError(
            "the engine world's attention has no ALiBi, sliding window, soft cap or sinks"
        )
    if dynamic_causal is not None:
        raise NotImplementedError("the engine world's attention has no dynamic causal mask")
    starts = query_start_loc.tolist()
    repeat = query.shape[1] // key_cache.shape[1]
    for r, seq_len in enumerate(seq_lens.tolist()):
        if starts[r + 1] == starts[r]:
            continue
        positions = torch.arange(seq_len)
        blocks = block_table[r, positions // key_cache.shape[2]].long()
        offsets = positions % key_cache.shape[2]
        k = key_cache[blocks, :, offsets].repeat_interleave(repeat, dim=1)
        v = value_cache[blocks, :, offsets].repeat_interleave(repeat, dim=1)
        out = _attend(query[starts[r] : starts[r + 1]], k, v, scale, causal)
        output[starts[r] : starts[r + 1]] = out.reshape(output[starts[r] : starts[r + 1]].shape).to(
            output.dtype
        )


def mla_decode_kvcache(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    scale: float,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    """MLA's absorbed decode: each request's query ``(h, L + R)`` attends over its cached latent rows
    ``(S, L + R)`` (``kv_cache (blocks, B, L + R)``, L the KV LoRA rank, R the RoPE dims); the values are
    the rows' first ``L`` columns: ``out (requests, h, L)``."""
    latent = out.shape[-1]
    flat = kv_cache.reshape(-1, kv_cache.shape[-1])
    block_size = kv_cache.shape[1]
    for r, seq_len in enumerate(seq_lens.tolist()):
        positions = torch.arange(seq_len)
        rows = flat[block_tables[r, positions // block_size].long() * block_size + positions % block_size]
        scores = query[r].float() @ rows.float().T * scale  # (h, S)
        out[r] = (torch.softmax(scores, dim=-1) @ rows[:, :latent].float()).to(out.dtype)


_CPU_ATTN = "vllm.v1.attention.backends.cpu_attn"

#: Every ``_C`` op of the engine world, in registration order.
KERNELS: tuple[Kernel, ...] = (
    Kernel(
        "init_cpu_memory_env(int[] nodes) -> ()",
        "vllm.v1.worker.cpu_worker.CPUWorker.__init__",
        init_cpu_memory_env,
    ),
    Kernel(
        "prepack_moe_weight(Tensor weight, Tensor(a!) output, str isa) -> ()",
        "vllm._custom_ops.cpu_prepack_moe_weight",
        prepack_moe_weight,
    ),
    Kernel(
        "cpu_fused_moe(Tensor(a!) output, Tensor input, Tensor w13, Tensor w2, Tensor? w13_bias, "
        "Tensor? w2_bias, Tensor topk_weights, Tensor topk_ids, bool skip_weighted, str act, str isa) -> ()",
        "vllm._custom_ops.cpu_fused_moe",
        cpu_fused_moe,
    ),
    Kernel(
        "get_scheduler_metadata(int num_reqs, int num_heads, int num_kv_heads, int head_dim, "
        "Tensor seq_lens, ScalarType dtype, Tensor query_start_loc, bool causal, int sliding_window_size, "
        "str isa, bool enable_kv_split, Tensor? dynamic_causal, str kv_cache_dtype) -> Tensor",
        "vllm._custom_ops.cpu_attn_get_scheduler_metadata",
        get_scheduler_metadata,
        get_scheduler_metadata,  # its output's shape depends on no input
    ),
    Kernel(
        "cpu_attn_reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping, str isa, float k_scale, float v_scale, str kv_cache_dtype) -> ()",
        "vllm._custom_ops.cpu_attn_reshape_and_cache",
        cpu_attn_reshape_and_cache,
    ),
    Kernel(
        "cpu_attention_with_kv_cache(Tensor query, Tensor key_cache, Tensor value_cache, Tensor(a!) output, "
        "Tensor query_start_loc, Tensor seq_lens, float scale, bool causal, Tensor? alibi_slopes, "
        "int sliding_window, Tensor block_table, float softcap, Tensor scheduler_metadata, Tensor? s_aux, "
        "Tensor? dynamic_causal, float k_scale, float v_scale, str kv_cache_dtype) -> ()",
        "vllm._custom_ops.cpu_attention_with_kv_cache",
        cpu_attention_with_kv_cache,
    ),
    Kernel(
        "mla_decode_kvcache(Tensor(a!) out, Tensor query, Tensor kv_cache, float scale, Tensor block_tables, "
        "Tensor seq_lens) -> ()",
        "vllm._custom_ops.mla_decode_kvcache_cpu",
        mla_decode_kvcache,
    ),
)

_LIBRARY: torch.library.Library | None = None


def registered() -> bool:
    """Whether :func:`register` defined the ops in this process."""
    return _LIBRARY is not None


def register() -> None:
    """Define every op of :data:`KERNELS` in torch's ``_C`` namespace with its torch form and its fake form
    (a compiled forward traces ``cpu_fused_moe``); idempotent.

    Raises:
        RuntimeError: a caller of :data:`KERNELS` changed signature since vLLM 0.33.0 (its arguments no
            longer match the op's schema), or ``_C`` already defines one of them (a ``vllm._C`` is
            loaded: this build has its kernels, so the engine world must not run here); nothing is
            registered then.
    """
    global _LIBRARY
    if _LIBRARY is not None:
        return
    check_signatures(upstream.SIGNATURES[k.caller] for k in KERNELS if k.caller in upstream.SIGNATURES)
    present = [k.name for k in KERNELS if hasattr(torch.ops._C, k.name)]
    if present:
        raise RuntimeError(
            f"torch.ops._C already defines {present}: this vLLM has its compiled kernels, and the engine "
            "world's torch forms must not replace them (unset ASCEND_EPLB_ENGINE_WORLD)"
        )
    library = torch.library.Library("_C", "DEF")
    for kernel in KERNELS:
        library.define(kernel.schema)
        library.impl(kernel.name, kernel.impl, "CompositeExplicitAutograd")
        torch.library.register_fake(f"_C::{kernel.name}", kernel.fake or _no_output, lib=library)
    _LIBRARY = library
