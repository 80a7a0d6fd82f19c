"""Time `ExpertWeightFormat.apply` against the per-expert loop it replaced, side by side in one run.

The baseline (`legacy_apply`) is the per-expert Python loop of `formats.py` at git revision 79138c9,
copied here verbatim except that each ``_expert_forward`` method became a function: for each local row,
``nonzero`` its selections, dequantize that row, run the two GEMMs, ``index_add_`` the weighted result.
It exists only here, as the baseline. Every timed case also checks that the two give bit-identical
outputs (``torch.equal``).

Sizes: the simulator's (`ascend-eplb simulate` defaults: p=17 local experts, H=64, I=32, T=32 tokens,
K=6) and a larger one (p=8, H=1024, I=512, T=256, K=8). Routing: each (token, k) picks a uniformly random
local row or -1 (not on this rank) with probability 1/4; one torch thread; median of interleaved rounds.

Run: ``/tmp/venv/bin/python packages/eplb-quant-views/benchmarks/bench_apply.py [--rounds N]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from ascend_eplb.quant_views import _numerics as nx
from ascend_eplb.quant_views import build_expert_storage, get_format, supported_formats

SIZES = {
    "simulator (p=17, H=64, I=32, T=32, K=6)": dict(p=17, H=64, I=32, T=32, K=6),
    "large (p=8, H=1024, I=512, T=256, K=8)": dict(p=8, H=1024, I=512, T=256, K=8),
}


# ------------------------------------------------------------------ baseline: revision 79138c9


def _legacy_silu_and_mul(h, inter):
    return F.silu(h[:, :inter]) * h[:, inter:]


def _legacy_unquantized(fmt, storage, row, fused):
    kt = storage.kernel_tensors
    inter = storage.intermediate_size
    w13 = kt["w13_weight"][row].to(torch.float64)
    w2 = kt["w2_weight"][row].to(torch.float64)
    b13 = kt["w13_bias"][row].to(torch.float64) if "w13_bias" in kt else None
    b2 = kt["w2_bias"][row].to(torch.float64) if "w2_bias" in kt else None
    dt = fmt.dtype

    def forward(x):
        h = x.to(dt).to(torch.float64) @ w13
        if b13 is not None:
            h = h + b13
        a = _legacy_silu_and_mul(h, inter).to(dt).to(torch.float64)
        y = a @ w2
        return y + b2 if b2 is not None else y

    return forward


def _legacy_w8a8(fmt, storage, row, fused):
    kt = storage.kernel_tensors
    inter = storage.intermediate_size
    w13 = kt["w13_weight"][row].to(torch.float64)
    w2 = kt["w2_weight"][row].to(torch.float64)
    if fused:
        s13 = nx.scale_word_to_float(kt["fused_w1_scale"][row]).to(torch.float64)
        s2 = nx.scale_word_to_float(kt["fused_w2_scale"][row]).to(torch.float64)
    else:
        s13 = kt["w13_weight_scale_fp32"][row].to(torch.float64)
        s2 = kt["w2_weight_scale"][row].to(torch.float64)

    def forward(x):
        xq, xs = nx.quantize_per_token(x)
        h = (xq @ w13) * xs.unsqueeze(1) * s13
        aq, as_ = nx.quantize_per_token(_legacy_silu_and_mul(h, inter))
        return (aq @ w2) * as_.unsqueeze(1) * s2

    return forward


def _legacy_w4a8(fmt, storage, row, fused):
    kt = storage.kernel_tensors
    inter = storage.intermediate_size

    def weight(name):
        return nx.unpack_int4(kt[name][row].contiguous().view(torch.int8)).to(torch.float64)

    w13, w2 = weight("w13_weight"), weight("w2_weight")
    s13 = nx.scale_word_to_float(kt["w13_weight_scale"][row]).reshape(-1).to(torch.float64)
    s2 = nx.scale_word_to_float(kt["w2_weight_scale"][row]).reshape(-1).to(torch.float64)
    b13 = kt["w13_scale_bias"][row].to(torch.float64)
    b2 = kt["w2_scale_bias"][row].to(torch.float64)

    def gemm(xq, w, s, b):
        hi = torch.floor(xq / 16.0)
        lo_s = xq - 16.0 * hi - 8.0
        return s * (16.0 * (hi @ w) + lo_s @ w) + b

    def forward(x):
        xq, xs = nx.quantize_per_token(x)
        h = gemm(xq, w13, s13, b13) * xs.unsqueeze(1)
        aq, as_ = nx.quantize_per_token(_legacy_silu_and_mul(h, inter))
        return gemm(aq, w2, s2, b2) * as_.unsqueeze(1)

    return forward


def _legacy_mx(fmt, storage, row, fused):
    kt = storage.kernel_tensors
    inter = storage.intermediate_size

    def weight(name):
        q = fmt._row_base(name, kt[name][row])
        s = fmt._row_base(name + "_scale", kt[name + "_scale"][row])
        return fmt._dequantize_weight(q, s.reshape(s.shape[0], -1))

    w13 = weight("w13_weight")
    w2 = weight("w2_weight")

    def forward(x):
        h = fmt._fake_quantize_act(x) @ w13.T
        return fmt._fake_quantize_act(_legacy_silu_and_mul(h, inter)) @ w2.T

    return forward


_LEGACY = {
    "bf16": _legacy_unquantized,
    "fp16": _legacy_unquantized,
    "w8a8_dynamic": _legacy_w8a8,
    "w4a8_dynamic": _legacy_w4a8,
    "mxfp8": _legacy_mx,
    "mxfp4": _legacy_mx,
}


def legacy_apply(fmt, storage, hidden_TH, topk_weights_TK, local_ids_TK, *, comm_path="standard"):  # noqa: N803
    """BASELINE ONLY: `ExpertWeightFormat.apply` as of revision 79138c9 (one Python iteration per row)."""
    fused = comm_path == "fused_mc2"
    x = hidden_TH.to(torch.float64)
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    ids = local_ids_TK.to(torch.int64)
    for row in range(storage.num_local_experts):
        tok, kk = (ids == row).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        y = _LEGACY[fmt.name](fmt, storage, row, fused)(x[tok])
        out.index_add_(0, tok, y * topk_weights_TK[tok, kk].to(torch.float64).unsqueeze(1))
    return out.to(hidden_TH.dtype)


# ------------------------------------------------------------------ benchmark


def _inputs(size, seed=0):
    g = torch.Generator().manual_seed(seed)
    t, k, p = size["T"], size["K"], size["p"]
    x = torch.randn(t, size["H"], generator=g).to(torch.bfloat16)
    weights = torch.softmax(torch.randn(t, k, generator=g), dim=1)
    ids = torch.randint(0, p, (t, k), generator=g)
    ids = torch.where(torch.rand(t, k, generator=g) < 0.25, torch.full_like(ids, -1), ids)
    return x, weights, ids


def _time(fn, args, repeats):
    start = time.perf_counter()
    for _ in range(repeats):
        fn(*args)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per case (default 5)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    header = ["size", "format", "mode", "per-expert loop (ms)", "apply (ms)", "speed-up", "bit-identical"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for label, size in SIZES.items():
        repeats = 20 if size["H"] <= 128 else 1
        inputs = _inputs(size)
        for name in supported_formats():
            fmt = get_format(name)
            inter = size["I"]
            if name.startswith("mx") and inter % 64:
                inter = 64  # MX scales come in pairs of 32-blocks: I must be a multiple of 64
            for lists in (False, True):
                storage = build_expert_storage(
                    fmt, list(range(size["p"])), size["H"], inter, seed=1, per_expert_lists=lists
                )
                new = fmt.apply(storage, *inputs)
                same = torch.equal(new, legacy_apply(fmt, storage, *inputs))
                old_t, new_t = [], []
                for _ in range(args.rounds):
                    old_t.append(_time(legacy_apply, (fmt, storage, *inputs), repeats))
                    new_t.append(_time(fmt.apply, (storage, *inputs), repeats))
                old_ms, new_ms = statistics.median(old_t) * 1e3, statistics.median(new_t) * 1e3
                shown = label if inter == size["I"] else label.replace(f"I={size['I']}", f"I={inter}")
                cells = [shown, name, "lists" if lists else "stacked", f"{old_ms:.2f}", f"{new_ms:.2f}"]
                cells += [f"{old_ms / new_ms:.1f}x", "yes" if same else "NO"]
                print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
