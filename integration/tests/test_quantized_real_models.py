"""Every supported expert format on vLLM's real Qwen3-MoE class, served as vLLM Ascend serves it.

Each world (TP=2 x EP=2 over Gloo, ``own_loop.real_model_world`` through ``ranks_real_models.serving_world``,
verifier on) serves a checkpoint whose routed experts are in the format: msModelSlim tensors and
``quant_model_description.json`` with ``--quantization ascend`` (``ascend_eplb.world.quant_method``), or
a bf16/fp16 checkpoint. vLLM's loader fills the format's parameters, the method lays them out as
vllm-ascend does, EPLB moves the views ``get_eplb_weight_views`` returns, and the quant_views reference
kernel computes from the layer's own tensors. Per-expert lists are vllm-ascend's NZ mode
(``VLLM_ASCEND_ENABLE_NZ=1``), W8A8's fused scales its fused-MC2 mode (``VLLM_ASCEND_ENABLE_FUSED_MC2=1``).

The bound is 0: EPLB-on logits equal EPLB-off's bit for bit (the method computes each selection on
its own and top-2 on 2 EP ranks sums at most two nonzero partials, commutatively; see the module
docstring of ``quant_method``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ascend_eplb.quant_views import FORMAT_SUPPORT
from ascend_eplb.testing import load_module, run_ranks
from ascend_eplb.world.checkpoints import checkpoint_info, write_checkpoint
from ascend_eplb.world.own_loop import RealModelSpec

ranks = load_module(Path(__file__).with_name("ranks_real_models.py"))

PRELOAD = ("vllm", "vllm.model_executor.model_loader", "ascend_eplb.world.own_loop")
# (id, format, environment)
VARIANTS = [
    ("bf16", "bf16", {}),
    ("fp16", "fp16", {}),
    ("w8a8_dynamic", "w8a8_dynamic", {}),
    ("w8a8_dynamic-fused", "w8a8_dynamic", {"VLLM_ASCEND_ENABLE_FUSED_MC2": "1"}),
    ("w4a8_dynamic", "w4a8_dynamic", {}),
    ("mxfp8", "mxfp8", {}),
    ("mxfp4", "mxfp4", {}),
]
CASES = [(v, lists) for v in VARIANTS for lists in (False, True)]
IDS = [f"{v[0]}-{'lists' if lists else 'stacked'}" for v, lists in CASES]
#: The methods the layers must get: vllm-ascend's quantized methods' stand-in, or the unquantized one.
METHOD = {"bf16": "TorchFusedMoEMethod", "fp16": "TorchFusedMoEMethod"}
STEPS = 12  # rearrangements start at steps 0, 4, 8; each commits its 2 layers over the next 2 steps


@pytest.mark.multirank
@pytest.mark.timeout(180)
@pytest.mark.parametrize(("variant", "lists"), CASES, ids=IDS)
def test_each_format_serves_bit_equal_logits_through_rearrangements(variant, lists, tmp_path):
    _, fmt, environ = variant
    folder = write_checkpoint(
        "qwen3-moe",
        tmp_path / "ckpt",
        seed=0,
        fmt=fmt,
        moe_intermediate_size=64 if fmt.startswith("mx") else None,
    )
    files = sorted(p.name for p in folder.iterdir())
    assert ("quant_model_description.json" in files) is (fmt not in ("bf16", "fp16"))
    env = {**environ, "VLLM_ASCEND_ENABLE_NZ": "1" if lists else "0"}
    spec = RealModelSpec(
        folder=str(folder),
        num_redundant_experts=2,
        steps=STEPS,
        step_interval=4,
        environ=env,
    )
    reports = run_ranks(
        ranks.serving_world, world_size=2, tmp_path=tmp_path, args=(spec,), timeout_s=150, preload=PRELOAD
    )
    info = checkpoint_info(folder)
    for r in reports:
        # The format's method is what ran, with the layout asked for, in every MoE layer.
        assert r.methods == [METHOD.get(fmt, "QuantViewsFusedMoEMethod")] * info.num_moe_layers
        assert r.formats == [fmt] * info.num_moe_layers
        assert r.view_names[0] == [n + ("_list" if lists else "") for n in r.kernel_names]
        if fmt == "w8a8_dynamic":
            assert ("fused_w1_scale" in r.kernel_names) is ("VLLM_ASCEND_ENABLE_FUSED_MC2" in environ)
        assert r.initial_slot_mismatches == []
        assert r.worker_alive is True
        # >= 2 completed rearrangements: every MoE layer committed at least twice, and after each
        # commit every local slot's fingerprint over the layer's kernel tensors equals its expert's.
        committed = [layer for _, layer in r.commits]
        assert all(committed.count(layer) >= 2 for layer in range(info.num_moe_layers)), r.commits
        assert r.num_rearrangements >= 3
        assert len(r.slot_checks) == len(r.commits)
        assert all(mismatches == [] for _, mismatches in r.slot_checks), r.slot_checks
        # Bit for bit, every step.
        unequal = [
            s for s, (a, b) in enumerate(zip(r.logits_on, r.logits_off, strict=True)) if not torch.equal(a, b)
        ]
        assert unequal == [], f"{fmt}: EPLB-on logits differ from EPLB-off at steps {unequal}"
    # The placement really changed: some slot holds another expert than at start.
    assert any(not torch.equal(m, reports[0].maps[0]) for m in reports[0].maps[1:])
    assert all(torch.equal(a, b) for a, b in zip(reports[0].maps, reports[1].maps, strict=True))


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_rejected_formats_fail_at_start_up_with_the_reason_on_a_real_checkpoint(tmp_path):
    folders = {}
    for fmt in ("w4a16", "w4a16_mxfp4", "w4a8_mxfp4"):
        folders[fmt] = str(write_checkpoint("qwen3-moe", tmp_path / fmt, seed=0, fmt=fmt))
    reports = run_ranks(
        ranks.start_up_errors,
        world_size=2,
        tmp_path=tmp_path,
        args=(folders,),
        timeout_s=100,
        preload=PRELOAD,
    )
    for r in reports:
        for fmt, (kind, message, loaded) in r["errors"].items():
            assert kind == "EplbConfigError", (fmt, kind, message)
            assert message.startswith("1 EPLB configuration rule(s) violated:\n  - [quantization] ")
            assert f"quantization format {fmt!r} does not support EPLB: " in message
            assert FORMAT_SUPPORT[fmt].reason in message
            assert message.endswith("; fix: use a supported format")
            assert loaded is False  # refused before vLLM's loader ran
