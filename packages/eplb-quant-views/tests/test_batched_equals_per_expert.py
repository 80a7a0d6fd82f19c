"""`apply` (batched over every selection) equals the plain per-expert loop `per_expert_apply`, bit for bit."""

from pathlib import Path

import pytest
import torch

from ascend_eplb.quant_views import build_expert_storage, get_format
from ascend_eplb.quant_views.per_expert import per_expert_apply
from ascend_eplb.testing import load_module

C = load_module(Path(__file__).with_name("cases.py"))
_one_torch_thread = pytest.fixture(autouse=True)(C.one_torch_thread)

# (H, I) per format: small sizes the layout allows, with H, I and 2I distinct and, where the layout has
# no divisibility rule, odd.
ODD_SIZES = {
    "bf16": (33, 17),
    "fp16": (33, 17),
    "w8a8_dynamic": (33, 17),
    "w4a8_dynamic": (24, 12),
    "mxfp8": (64, 192),
    "mxfp4": (64, 192),
}
# Mostly float64: apply returns hidden_TH's dtype, and rounding to a narrower one would hide a last-bit
# difference of the float64 result; the narrower dtypes are covered too.
HIDDEN_DTYPES = (torch.float64, torch.bfloat16, torch.float64, torch.float32, torch.float64, torch.float16)


def _routings(p):
    """(label, local_ids (T, K)) over a storage of p local rows: edge cases first, then bulk."""
    g = torch.Generator().manual_seed(p)
    skewed = torch.randint(-1, p, (40, 6), generator=g)
    skewed[:, :4] = 0  # most selections on row 0, a few elsewhere
    return [
        ("no tokens", torch.empty(0, 2, dtype=torch.int64)),
        ("one token, top-1, last row", torch.tensor([[p - 1]])),
        ("every selection off this rank", torch.full((5, 3), -1)),
        ("a token choosing one row twice", torch.tensor([[0, 0, -1], [p - 1, 0, p - 1]])),
        ("random int32 ids, K=5", torch.randint(-1, p, (9, 5), generator=g).to(torch.int32)),
        ("skewed to row 0", skewed),
        # more selections than one SiLU chunk holds (32768 / I rows), so the batched form splits it
        ("700 tokens, K=4", torch.randint(-1, p, (700, 4), generator=g)),
    ]


def _storages(variant, lists):
    """The shared test storage (p=4), an odd-sized one with a replicated expert (p=5) and p=1."""
    _, name, options, with_bias = variant
    fmt = get_format(name)
    hidden, inter = ODD_SIZES[name]
    kw = {"per_expert_lists": lists, "with_bias": with_bias, **options}
    return fmt, [
        (C.H, C.build(variant, lists)[1]),
        (hidden, build_expert_storage(fmt, [3, 1, 4, 1, 5], hidden, inter, seed=2, **kw)),
        (hidden, build_expert_storage(fmt, [9], hidden, inter, seed=3, **kw)),
    ]


@pytest.mark.parametrize(("variant", "lists"), C.CASES, ids=C.CASE_IDS)
def test_apply_equals_the_per_expert_loop_bit_for_bit(variant, lists):
    fmt, storages = _storages(variant, lists)
    checked = 0
    for hidden_size, storage in storages:
        p = storage.num_local_experts
        for index, (label, ids) in enumerate(_routings(p)):
            num_tokens, top_k = ids.shape
            g = torch.Generator().manual_seed(100 + index)
            dtype = HIDDEN_DTYPES[index % len(HIDDEN_DTYPES)]
            x = torch.randn(num_tokens, hidden_size, generator=g).to(dtype)
            weights = torch.softmax(torch.randn(num_tokens, top_k, generator=g), dim=1)
            for path in C.comm_paths(storage):
                batched = fmt.apply(storage, x, weights, ids, comm_path=path)
                plain = per_expert_apply(fmt, storage, x, weights, ids, comm_path=path)
                case = (p, label, path)
                assert batched.dtype == plain.dtype == dtype, case
                assert batched.shape == plain.shape == (num_tokens, hidden_size), case
                assert torch.equal(batched, plain), case
                routed = (ids >= 0).any(dim=1)
                assert bool((plain[~routed] == 0).all()), case  # tokens with no local row get exactly 0
                assert bool((plain[routed].abs().sum(dim=1) > 0).all()), case
                checked += 1
    assert checked == 3 * 7 * len(C.comm_paths(storages[0][1]))


def test_per_expert_apply_checks_its_input_like_apply():
    fmt, storage = C.build(C.VARIANTS[3], False)  # w8a8, stacked
    x = C.hidden()
    w, ids = C.route_to(0)
    for call in (fmt.apply, lambda *a, **k: per_expert_apply(fmt, *a, **k)):
        with pytest.raises(ValueError, match=r"local_ids_TK values must be in \[-1, p=4\), got min -1 max 4"):
            call(storage, x, w, torch.where(ids >= 0, 4, -1))
        with pytest.raises(
            ValueError, match="comm_path='fused_mc2' needs storage built with fused_scales=True"
        ):
            call(storage, x, w, ids, comm_path="fused_mc2")
    with pytest.raises(ValueError, match="storage was built by format 'w8a8_dynamic', not 'bf16'"):
        per_expert_apply(get_format("bf16"), storage, x, w, ids)


#: Formats whose GEMMs are integer (exact in float64 whatever the row count): `apply_graph_safe` equals
#: `apply` there by construction; the float formats' GEMMs of T rows may round otherwise (documented).
INTEGER_GEMMS = ("w8a8_dynamic", "w4a8_dynamic")


@pytest.mark.parametrize(("variant", "lists"), C.CASES, ids=C.CASE_IDS)
def test_apply_graph_safe_equals_apply_and_traces_whole(variant, lists):
    """`apply_graph_safe` (every row on every token, fixed shapes, no host read) equals `apply` on every
    routing of the shared cases: bit for bit on the integer formats, and on the float formats on these
    inputs (measured: 0 difference, though not guaranteed); one TorchDynamo graph (fullgraph, no graph
    break) computes it equal to the eager call, on the kernel tensors it reads through their storage,
    after a row is moved in place too. (The plane traces with torch alone: dataplane's `trace_once` is
    not among its dependencies.)"""
    fmt, storages = _storages(variant, lists)
    for hidden_size, storage in storages:
        p = storage.num_local_experts
        for index, (label, ids) in enumerate(_routings(p)):
            num_tokens, top_k = ids.shape
            g = torch.Generator().manual_seed(100 + index)
            x = torch.randn(num_tokens, hidden_size, generator=g).to(
                HIDDEN_DTYPES[index % len(HIDDEN_DTYPES)]
            )
            weights = torch.softmax(torch.randn(num_tokens, top_k, generator=g), dim=1)
            for path in C.comm_paths(storage):
                want = fmt.apply(storage, x, weights, ids, comm_path=path)
                got = fmt.apply_graph_safe(storage, x, weights, ids, comm_path=path)
                assert torch.equal(got, want), (p, label, path, fmt.name in INTEGER_GEMMS)
    hidden_size, storage = storages[1]
    _, ids = _routings(storage.num_local_experts)[4]
    g = torch.Generator().manual_seed(7)
    x = torch.randn(ids.shape[0], hidden_size, generator=g).to(torch.bfloat16)
    weights = torch.softmax(torch.randn(*ids.shape, generator=g), dim=1)
    torch._dynamo.reset()  # one code object for every case: each test traces its own
    graphs = []

    def count_graphs(gm, example_inputs):  # TorchDynamo's eager backend, counting the graphs it is given
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(
        lambda x, w, i: fmt.apply_graph_safe(storage, x, w, i), fullgraph=True, backend=count_graphs
    )
    assert torch.equal(compiled(x, weights, ids), fmt.apply_graph_safe(storage, x, weights, ids))
    for view in fmt.weight_views(storage):  # expert 3's rows (row 0) moved into row 1 in place
        view[1].copy_(view[0])
    assert torch.equal(compiled(x, weights, ids), fmt.apply_graph_safe(storage, x, weights, ids))
    assert len(graphs) == 1
