"""Weight views are the kernel storage; moving view rows moves experts exactly (DESIGN §4, invariant 5)."""

from pathlib import Path

import pytest
import torch

from ascend_eplb.quant_views import ExpertTensorList, expert_fingerprint
from ascend_eplb.quant_views._batched import Selection
from ascend_eplb.quant_views.formats.base import batched_apply
from ascend_eplb.testing import load_module

C = load_module(Path(__file__).with_name("cases.py"))
_one_torch_thread = pytest.fixture(autouse=True)(C.one_torch_thread)

EXPECTED_NAMES = {
    "bf16": ["w13_weight", "w2_weight"],
    "bf16-bias": ["w13_weight", "w2_weight", "w13_bias", "w2_bias"],
    "fp16": ["w13_weight", "w2_weight"],
    "w8a8": ["w13_weight", "w2_weight", "w13_weight_scale_fp32", "w2_weight_scale"],
    "w8a8-fused": [
        "w13_weight",
        "w2_weight",
        "w13_weight_scale_fp32",
        "w2_weight_scale",
        "fused_w1_scale",
        "fused_w2_scale",
    ],
    "w4a8": [
        "w13_weight",
        "w2_weight",
        "w13_weight_scale",
        "w2_weight_scale",
        "w13_scale_bias",
        "w2_scale_bias",
    ],
    "mxfp8": ["w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"],
    "mxfp4": ["w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"],
}

H, I2, I = C.H, 2 * C.I, C.I  # noqa: E741 (GLOSSARY.md letters)
E8 = torch.float8_e8m0fnu
# Stacked kernel tensors: (shape, stride or None for contiguous, dtype). p = 4, H = 192, I = 64.
EXPECTED_LAYOUT = {
    "bf16": {
        "w13_weight": ((4, H, I2), None, torch.bfloat16),
        "w2_weight": ((4, I, H), None, torch.bfloat16),
    },
    "w8a8": {
        "w13_weight": ((4, H, I2), None, torch.int8),
        "w2_weight": ((4, I, H), None, torch.int8),
        "w13_weight_scale_fp32": ((4, I2), None, torch.float32),
        "w2_weight_scale": ((4, H), None, torch.float32),
    },
    "w8a8-fused": {
        "fused_w1_scale": ((4, I2), None, torch.int64),
        "fused_w2_scale": ((4, H), None, torch.int64),
    },
    "w4a8": {
        "w13_weight": ((4, H, I // 4), None, torch.int32),
        "w2_weight": ((4, I, H // 8), None, torch.int32),
        "w13_weight_scale": ((4, I2), None, torch.int64),
        "w2_weight_scale": ((4, 1, H), None, torch.int64),
        "w13_scale_bias": ((4, I2), None, torch.float32),
        "w2_scale_bias": ((4, H), None, torch.float32),
    },
    "mxfp8": {
        "w13_weight": ((4, H, I2), (I2 * H, 1, H), torch.float8_e4m3fn),
        "w2_weight": ((4, I, H), (H * I, 1, I), torch.float8_e4m3fn),
        "w13_weight_scale": ((4, H // 64, I2, 2), (I2 * H // 32, 2, H // 32, 1), E8),
        "w2_weight_scale": ((4, I // 64, H, 2), (H * I // 32, 2, I // 32, 1), E8),
    },
    "mxfp4": {
        "w13_weight": ((4, H // 2, I2), (I2 * H // 2, 1, H // 2), torch.uint8),
        "w2_weight": ((4, I // 2, H), (H * I // 2, 1, I // 2), torch.uint8),
        "w13_weight_scale": ((4, H // 64, I2, 2), (I2 * H // 32, 2, H // 32, 1), E8),
        "w2_weight_scale": ((4, I // 64, H, 2), (H * I // 32, 2, I // 32, 1), E8),
    },
}


@pytest.mark.parametrize(("variant", "lists"), C.CASES, ids=C.CASE_IDS)
def test_views_name_every_kernel_tensor_in_ascend_order(variant, lists):
    fmt, storage = C.build(variant, lists)
    suffix = "_list" if lists else ""
    assert fmt.view_names(storage) == [n + suffix for n in EXPECTED_NAMES[variant[0]]]
    views = fmt.weight_views(storage)
    assert len(views) == len(EXPECTED_NAMES[variant[0]])
    for view in views:
        assert view.shape[0] == C.p
        if lists:
            assert isinstance(view, ExpertTensorList)
            assert all(t.dim() == 1 and t.is_contiguous() for t in view)
        else:
            assert isinstance(view, torch.Tensor)
            assert view.dim() == 2
            assert view[0].is_contiguous()


@pytest.mark.parametrize("case", sorted(EXPECTED_LAYOUT))
def test_stacked_kernel_layout_matches_ascend(case):
    variant = next(v for v in C.VARIANTS if v[0] == case)
    _, storage = C.build(variant, False)
    for name, (shape, stride, dtype) in EXPECTED_LAYOUT[case].items():
        t = storage.kernel_tensors[name]
        assert tuple(t.shape) == shape, name
        assert t.dtype == dtype, name
        if stride is None:
            assert t.is_contiguous(), name
        else:
            assert tuple(t.stride()) == stride, name
    if case.startswith("w8a8"):
        assert set(storage.unread_tensors) == {"w13_weight_offset", "w2_weight_offset"}


@pytest.mark.parametrize(("variant", "lists"), C.CASES, ids=C.CASE_IDS)
def test_views_share_memory_and_write_through_changes_apply(variant, lists):
    fmt, storage = C.build(variant, lists)
    views = fmt.weight_views(storage)
    kernel = list(storage.kernel_tensors.values())
    for view, k in zip(views, kernel, strict=True):
        pairs = zip(view, k, strict=True) if lists else [(view, k)]
        for v, kt in pairs:
            assert v.data_ptr() == kt.data_ptr()
            assert v.untyped_storage().data_ptr() == kt.untyped_storage().data_ptr()
            assert v.numel() * v.element_size() == kt.numel() * kt.element_size()
    x = C.hidden()
    before = C.outputs_per_row(fmt, storage, x)
    for index, name in enumerate(fmt.view_names(storage)):
        saved = views[index][0].clone()
        views[index][0].copy_(views[index][1])  # write through the view only
        after = C.outputs_per_row(fmt, storage, x)
        changed = [path for path in C.comm_paths(storage) if not torch.equal(after[0, path], before[0, path])]
        assert changed, f"writing view {name} did not change apply"
        for row in (1, 2, 3):
            for path in C.comm_paths(storage):
                assert torch.equal(after[row, path], before[row, path]), name
        views[index][0].copy_(saved)
    restored = C.outputs_per_row(fmt, storage, x)
    assert all(torch.equal(restored[key], before[key]) for key in before)


def _move(views, sources):
    """Upstream-style layer move through a one-layer buffer: new row i <- old row sources[i]."""
    buffers = [torch.empty_like(v) for v in views]  # ExpertTensorList answers empty_like
    for dst, src in enumerate(sources):
        for v, b in zip(views, buffers, strict=True):
            b[dst].copy_(v[src])
    for dst in range(len(sources)):
        for v, b in zip(views, buffers, strict=True):
            v[dst].copy_(b[dst])


@pytest.mark.parametrize(("variant", "lists"), C.CASES, ids=C.CASE_IDS)
def test_three_successive_moves_are_bit_exact(variant, lists):
    fmt, storage = C.build(variant, lists)
    x = C.hidden()
    by_expert = C.outputs_per_row(fmt, storage, x)  # row r holds logical expert r
    prints = [expert_fingerprint(storage, r) for r in range(C.p)]
    views = fmt.weight_views(storage)

    # Copy expert 2's rows over row 0 (all views): row 0 now computes exactly what row 2 did.
    for v in views:
        v[0].copy_(v[2])
    holds = [2, 1, 2, 3]
    for row, expert in enumerate(holds):
        for path in C.comm_paths(storage):
            w, ids = C.route_to(row)
            assert torch.equal(fmt.apply(storage, x, w, ids, comm_path=path), by_expert[expert, path])
    # Three different placements in a row, with a replicated expert, as upstream moves them.
    for sources in ([3, 2, 1, 0], [1, 0, 0, 2], [2, 3, 1, 0]):
        _move(views, sources)
        holds = [holds[s] for s in sources]
        for row, expert in enumerate(holds):
            assert expert_fingerprint(storage, row) == prints[expert]
            for path in C.comm_paths(storage):
                w, ids = C.route_to(row)
                out = fmt.apply(storage, x, w, ids, comm_path=path)
                assert torch.equal(out, by_expert[expert, path]), (sources, row, expert, path)
    assert holds == [3, 1, 3, 2]
    # The storage tensors are still the ones the views cover (no reallocation happened).
    assert [v.data_ptr() if not lists else v[0].data_ptr() for v in fmt.weight_views(storage)] == [
        v.data_ptr() if not lists else v[0].data_ptr() for v in views
    ]


@pytest.mark.parametrize(("variant", "lists"), C.CASES, ids=C.CASE_IDS)
def test_fingerprint_changes_iff_a_kernel_row_changes(variant, lists):
    fmt, storage = C.build(variant, lists, ids=(5, 6, 5, 7))
    prints = [expert_fingerprint(storage, r) for r in range(C.p)]
    assert prints[0] == prints[2]
    assert len({prints[0], prints[1], prints[3]}) == 3
    # Same expert in another slot, in another storage mode, on another "rank": same fingerprint.
    _, single = C.build(variant, not lists, ids=(7,))
    assert expert_fingerprint(single, 0) == prints[3]
    views = fmt.weight_views(storage)
    for index, name in enumerate(fmt.view_names(storage)):
        row_bytes = views[index][1].view(torch.uint8)
        row_bytes[-1] ^= 0x01  # flip one bit of the last byte of expert row 1 of this tensor
        now = [expert_fingerprint(storage, r) for r in range(C.p)]
        assert now[1] != prints[1], name
        assert [now[r] for r in (0, 2, 3)] == [prints[r] for r in (0, 2, 3)], name
        row_bytes[-1] ^= 0x01
        assert expert_fingerprint(storage, 1) == prints[1], name
    for name, t in storage.unread_tensors.items():  # offsets the kernel never reads
        t[1].add_(1.0)
        assert expert_fingerprint(storage, 1) == prints[1], name


@pytest.mark.parametrize(("variant", "lists"), C.CASES, ids=C.CASE_IDS)
def test_a_view_list_missing_a_tensor_leaves_a_fingerprint_mismatch(variant, lists):
    fmt, storage = C.build(variant, lists)
    x = C.hidden()
    by_expert = C.outputs_per_row(fmt, storage, x)
    prints = [expert_fingerprint(storage, r) for r in range(C.p)]
    views = fmt.weight_views(storage)
    names = fmt.view_names(storage)
    for missing in range(len(views)):
        _, fresh = C.build(variant, lists)
        partial = [v for i, v in enumerate(fmt.weight_views(fresh)) if i != missing]
        _move(partial, [1, 0, 2, 3])  # swap experts 0 and 1, forgetting one tensor
        assert expert_fingerprint(fresh, 0) != prints[1], names[missing]
        assert expert_fingerprint(fresh, 1) != prints[0], names[missing]
        if names[missing].removesuffix("_list") not in ("fused_w1_scale", "fused_w2_scale"):
            w, ids = C.route_to(0)
            assert not torch.equal(fmt.apply(fresh, x, w, ids), by_expert[1, "standard"]), names[missing]
    _move(views, [1, 0, 2, 3])  # every view: exact
    assert [expert_fingerprint(storage, r) for r in range(C.p)] == [
        prints[1],
        prints[0],
        prints[2],
        prints[3],
    ]


@pytest.mark.parametrize(("variant", "lists"), C.CASES, ids=C.CASE_IDS)
def test_a_token_computes_the_same_alone_and_in_a_batch(variant, lists):
    """apply's output for a token does not depend on the other tokens of the call (bit-identical)."""
    fmt, storage = C.build(variant, lists)
    x = C.hidden().to(torch.float64)  # float64 output: no last bit hidden by rounding
    g = torch.Generator().manual_seed(11)
    alone_ids = torch.tensor([[1, -1, 0]])
    alone_w = torch.tensor([[0.5, 0.3, 0.2]])
    # 11 other tokens routed to rows 2 and 3 (and -1), the token itself at position 5 of the batch.
    others = torch.randint(2, 4, (C.T, 3), generator=g)
    others[:, 1] = -1
    exact = variant[1] in ("w8a8_dynamic", "w4a8_dynamic")
    batches = [others]
    if exact:  # integer GEMMs round nowhere: even tokens sharing its experts change nothing
        batches.append(torch.randint(-1, C.p, (C.T, 3), generator=g))
    for path in C.comm_paths(storage):
        alone = fmt.apply(storage, x[5:6], alone_w, alone_ids, comm_path=path)
        assert alone.abs().sum() > 0
        for batch_ids in batches:
            ids = batch_ids.clone()
            ids[5] = alone_ids[0]
            weights = torch.softmax(torch.randn(C.T, 3, generator=g), dim=1)
            weights[5] = alone_w[0]
            out = fmt.apply(storage, x, weights, ids, comm_path=path)
            assert torch.equal(out[5:6], alone), (path, batch_ids.tolist())
            # and the others' rows are their own, not zero
            assert out[[i for i in range(C.T) if i != 5]].abs().sum(dim=1).gt(0).sum() >= C.T // 2


@pytest.mark.parametrize(("variant", "lists"), C.CASES, ids=C.CASE_IDS)
def test_apply_in_expert_chunks_equals_apply_at_once(variant, lists):
    """Large layers are computed a few experts at a time; the chunking changes no bit."""
    fmt, storage = C.build(variant, lists)
    x = C.hidden().to(torch.float64)  # float64 output: no last bit hidden by rounding
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(-1, C.p, (C.T, 3), generator=g)
    weights = torch.softmax(torch.randn(C.T, 3, generator=g), dim=1)
    for path in C.comm_paths(storage):
        at_once = fmt.apply(storage, x, weights, ids, comm_path=path)
        fused = path == "fused_mc2"
        selections = Selection.of(ids, weights)
        one_per_chunk = batched_apply(fmt, storage, x, selections, fused=fused, chunk_bytes=1)
        assert len(Selection.of(ids, weights).split(1)) == len(set(ids[ids >= 0].tolist())) > 1
        assert torch.equal(one_per_chunk, at_once), path
