"""The engine world without an engine: its plugins are inert without the opt-in (vLLM untouched), its
settings have one source, and its ``_C`` torch forms compute what the compiled kernels compute (dense
references on hand-made inputs). The engine itself runs in ``integration/tests/test_engine*.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from ascend_eplb.world.engine import environment, kernels, patches, session
from ascend_eplb.world.engine.spec import EngineSpec, EplbSpec

_UNTOUCHED = r"""
import json, os, sys
from importlib.metadata import entry_points
from ascend_eplb.world.engine import plugin
ours = {ep.name for ep in entry_points(group="vllm.platform_plugins")} | {
    ep.name for ep in entry_points(group="vllm.general_plugins") if ep.name.startswith("ascend_eplb")}
inert = (plugin.platform_plugin(), plugin.general_plugin())
heavy = sorted(m for m in ("torch", "vllm", "triton") if m in sys.modules)
from vllm.platforms import current_platform
import torch, triton.backends
from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
print(json.dumps({
    "ours": sorted(ours), "inert": list(inert), "heavy_after_plugins": heavy,
    "platform": type(current_platform).__name__,
    "kernels": [k for k in ("cpu_fused_moe", "prepack_moe_weight", "cpu_attention_with_kv_cache")
                if hasattr(torch.ops._C, k)],
    "triton_cpu": "cpu" in triton.backends.backends,
    "apply": CPUUnquantizedExperts.apply.__module__,
}))
"""


def test_without_the_opt_in_the_plugins_change_nothing_and_vllm_runs_as_if_they_were_absent():
    """Installing the world registers both entry points; without ``ASCEND_EPLB_ENGINE_WORLD=1`` they return
    at once having imported neither torch, vLLM nor Triton, and vLLM's own detection runs: this empty build
    resolves no platform, ``_C`` has none of the world's kernels, Triton no CPU backend, and vLLM's CPU
    experts keep their own ``apply``."""
    env = environment.engine_environment()
    del env[environment.SWITCH]
    out = subprocess.run(
        [sys.executable, "-c", _UNTOUCHED], env=env, capture_output=True, text=True, timeout=240, check=True
    )
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {
        "ours": ["ascend_eplb", "ascend_eplb_engine_world"],
        "inert": [None, None],
        "heavy_after_plugins": [],
        "platform": "UnspecifiedPlatform",
        "kernels": [],
        "triton_cpu": False,
        "apply": "vllm.model_executor.layers.fused_moe.experts.cpu_moe",
    }


def test_the_client_and_the_functions_sent_to_the_workers_import_no_vllm():
    """``host`` (the client), ``probes`` and ``faults`` are what ``simulate``'s driver and the engine tests
    import to start an engine and name the functions its workers run: a fresh process importing them has
    no vLLM module (their vLLM imports are inside the functions the workers run; the host's process is
    ``host_main``)."""
    code = (
        "import json, sys\n"
        "from ascend_eplb.world.engine import faults, host, probes\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_the_environment_is_written_once_and_removes_the_target_device():
    env = environment.engine_environment({"VLLM_TARGET_DEVICE": "cpu", "KEEP": "1"}, EXTRA="2")
    assert "VLLM_TARGET_DEVICE" not in env
    assert env["KEEP"] == "1"
    assert env["EXTRA"] == "2"
    assert env["TRITON_INTERPRET"] == "1"
    assert environment.opted_in(env)
    assert not environment.opted_in({})


def test_vllms_model_class_inspections_are_kept_across_engines_whole_and_only_json(tmp_path, monkeypatch):
    monkeypatch.setenv(environment.CACHE_ENV, str(tmp_path / "cache"))
    kept = session.modelinfo_cache()
    assert kept == tmp_path / "cache" / "vllm-modelinfos"
    # Nothing kept yet: nothing copied, nothing created, nothing raised.
    assert session.copy_modelinfos(kept, tmp_path / "engine1" / "modelinfos") == 0
    # What vLLM wrote in one engine's scratch: kept, but not a partial file, a link or another suffix.
    written = tmp_path / "engine1" / "modelinfos"
    assert not written.exists()
    written.mkdir(parents=True)
    (written / "vllm-model_executor-models-qwen3_moe-Qwen3MoeForCausalLM.json").write_text('{"hash": "a"}')
    (written / "notes.txt").write_text("not vLLM's")
    (written / "link.json").symlink_to(written / "notes.txt")
    assert session.copy_modelinfos(written, kept) == 1
    assert sorted(p.name for p in kept.iterdir()) == [
        "vllm-model_executor-models-qwen3_moe-Qwen3MoeForCausalLM.json"
    ]
    # The next engine's scratch gets it; a newer one written there replaces the kept one whole.
    second = tmp_path / "engine2" / "modelinfos"
    assert session.copy_modelinfos(kept, second) == 1
    (second / "vllm-model_executor-models-qwen3_moe-Qwen3MoeForCausalLM.json").write_text('{"hash": "b"}')
    assert session.copy_modelinfos(second, kept) == 1
    assert json.loads(
        (kept / "vllm-model_executor-models-qwen3_moe-Qwen3MoeForCausalLM.json").read_text()
    ) == {"hash": "b"}
    # An unwritable cache (a file where the folder would be) copies nothing and raises nothing.
    monkeypatch.setenv(environment.CACHE_ENV, str(tmp_path / "cache" / "vllm-modelinfos" / "notes"))
    (tmp_path / "cache" / "vllm-modelinfos" / "notes").write_text("a file")
    assert session.copy_modelinfos(second, session.modelinfo_cache()) == 0


def test_one_spec_gives_the_llm_keywords_and_the_same_engine_as_vllm_serve_flags(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"kv_lora_rank": 512}))
    spec = EngineSpec(
        str(tmp_path), eplb=EplbSpec(4, 8, 2, {"load_collection_phase": "decode"}), speculative_tokens=1
    )
    kwargs = spec.engine_kwargs()
    assert kwargs["attention_backend"] == "CPU_MLA"
    assert kwargs["eplb_config"] == {
        "window_size": 4, "step_interval": 8, "num_redundant_experts": 2, "use_async": True
    }  # fmt: skip
    assert kwargs["additional_config"] == {"eplb_config": {"load_collection_phase": "decode"}}
    argv = spec.serve_argv()
    assert argv[0] == str(tmp_path)
    assert argv[argv.index("--eplb-config") + 1] == json.dumps(kwargs["eplb_config"])
    assert "--enable-eplb" in argv
    assert "--enable-expert-parallel" in argv
    assert "--enforce-eager" in argv
    assert argv[argv.index("--speculative-config") + 1] == json.dumps(kwargs["speculative_config"])
    assert "--disable-log-stats" not in argv  # False: vLLM keeps its per-request timing


def _dense_moe(x, w13, w2, weights, ids):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if 0 <= e < w13.shape[0]:
                gate, up = (w13[e] @ x[t]).chunk(2)
                out[t] += weights[t, k] * (w2[e] @ (F.silu(gate) * up))
    return out


def test_the_fused_moe_form_sums_each_local_selection_and_skips_other_ranks_ids():
    g = torch.Generator().manual_seed(0)
    x, w13, w2 = (
        torch.randn(5, 8, generator=g),
        torch.randn(3, 12, 8, generator=g),
        torch.randn(3, 8, 6, generator=g),
    )
    weights = torch.rand(5, 2, generator=g)
    ids = torch.tensor([[0, 2], [1, -1], [-1, -1], [2, 2], [1, 0]], dtype=torch.int32)
    out = torch.empty_like(x)
    kernels.cpu_fused_moe(out, x, w13, w2, None, None, weights, ids, False, "silu", "amx")
    torch.testing.assert_close(out, _dense_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-6)
    assert torch.equal(out[2], torch.zeros(8))  # a row with no local selection
    with pytest.raises(NotImplementedError, match="gelu"):
        kernels.cpu_fused_moe(out, x, w13, w2, None, None, weights, ids, False, "gelu", "amx")


def test_paged_attention_equals_causal_sdpa_over_each_requests_tokens():
    """Two requests (a prefill of 5 tokens, a decode of 1 over 6 cached): written into a paged cache through
    shuffled blocks, then attended; each request's output equals SDPA over its own keys (GQA 4 heads over
    2 KV heads)."""
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, d, block = 4, 2, 8, 4
    lens = [5, 6]
    keys = [torch.randn(n, kv_heads, d, generator=g) for n in lens]
    values = [torch.randn(n, kv_heads, d, generator=g) for n in lens]
    cache = torch.zeros(6, kv_heads, block * 2, d)
    key_cache, value_cache = cache.chunk(2, dim=2)
    tables = torch.tensor([[3, 0], [5, 1]], dtype=torch.int32)
    for r, n in enumerate(lens):
        slots = torch.tensor([int(tables[r, i // block]) * block + i % block for i in range(n)])
        kernels.cpu_attn_reshape_and_cache(
            keys[r].reshape(n, -1),
            values[r].reshape(n, -1),
            key_cache,
            value_cache,
            slots,
            "vec",
            1.0,
            1.0,
            "auto",
        )
    queries = [torch.randn(5, heads, d, generator=g), torch.randn(1, heads, d, generator=g)]
    query = torch.cat(queries)
    output = torch.zeros_like(query)
    kernels.cpu_attention_with_kv_cache(
        query, key_cache, value_cache, output, torch.tensor([0, 5, 6]), torch.tensor(lens), 0.5, True, None,
        -1, tables, 0.0, torch.empty(0), None, None, 1.0, 1.0, "auto",
    )  # fmt: skip
    for r, (q, n) in enumerate(zip(queries, lens, strict=True)):
        k = keys[r].repeat_interleave(2, dim=1).transpose(0, 1)
        v = values[r].repeat_interleave(2, dim=1).transpose(0, 1)
        mask = torch.ones(q.shape[0], n, dtype=torch.bool).tril(n - q.shape[0])
        want = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=0.5).transpose(
            0, 1
        )
        got = output[:5] if r == 0 else output[5:]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_mla_decode_attends_each_requests_latent_rows_and_returns_their_first_l_columns():
    g = torch.Generator().manual_seed(2)
    heads, latent, rope, block = 3, 6, 2, 4
    cache = torch.randn(4, block, latent + rope, generator=g)
    tables = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    lens = torch.tensor([5, 3], dtype=torch.int32)
    query = torch.randn(2, heads, latent + rope, generator=g)
    out = torch.zeros(2, heads, latent)
    kernels.mla_decode_kvcache(out, query, cache, 0.7, tables, lens)
    for r in range(2):
        rows = torch.stack([cache[int(tables[r, i // block]), i % block] for i in range(int(lens[r]))])
        want = torch.softmax(query[r] @ rows.T * 0.7, dim=-1) @ rows[:, :latent]
        torch.testing.assert_close(out[r], want, rtol=1e-5, atol=1e-6)


def test_every_kernel_is_declared_with_the_caller_whose_signature_it_serves():
    from ascend_eplb.world import upstream

    assert [k.name for k in kernels.KERNELS] == [
        "init_cpu_memory_env", "prepack_moe_weight", "cpu_fused_moe", "get_scheduler_metadata",
        "cpu_attn_reshape_and_cache", "cpu_attention_with_kv_cache", "mla_decode_kvcache",
    ]  # fmt: skip
    for kernel in kernels.KERNELS[1:]:
        assert upstream.SIGNATURES[kernel.caller].users == ("world.engine.kernels",)
    # Importing CPUWorker's module replaces torch.accelerator.empty_cache: no check may import it outside
    # an engine process, so its call of init_cpu_memory_env (a list of NUMA nodes) is not a checked row.
    assert kernels.KERNELS[0].caller == "vllm.v1.worker.cpu_worker.CPUWorker.__init__"
    assert kernels.KERNELS[0].caller not in upstream.SIGNATURES


def _child(code: str) -> str:
    """Run ``code`` in a fresh interpreter (TorchDynamo on; registering the ops or importing vLLM's CPU
    worker changes a process for good); its stdout."""
    env = dict(os.environ)
    env.pop("TORCHDYNAMO_DISABLE", None)
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_a_padding_only_batch_writes_nothing_into_the_kv_cache():
    """A data-parallel rank's dummy batch: every slot -1 (padding); its reshape had no row to infer the
    head size from and raised."""
    key_cache, value_cache = torch.zeros(3, 2, 4, 8), torch.zeros(3, 2, 4, 8)
    key, value = torch.randn(5, 16), torch.randn(5, 16)
    kernels.cpu_attn_reshape_and_cache(
        key, value, key_cache, value_cache, torch.full((5,), -1), "vec", 1.0, 1.0, "auto"
    )
    assert not key_cache.any()
    assert not value_cache.any()
    kernels.cpu_attn_reshape_and_cache(
        key, value, key_cache, value_cache, torch.tensor([-1, 5, -1, 0, -1]), "vec", 1.0, 1.0, "auto"
    )
    assert torch.equal(key_cache[1, :, 1], key[1].reshape(2, 8))  # slot 5: block 1, offset 1
    assert torch.equal(value_cache[0, :, 0], value[3].reshape(2, 8))
    assert int((key_cache != 0).any(dim=-1).sum()) == 4  # two slots x two KV heads, nothing else


@pytest.mark.timeout(300)
def test_a_compiled_forward_traces_the_fused_moe_with_dynamic_token_counts():
    """TorchDynamo runs each op of a traced forward on fake tensors of symbolic shape; without its fake
    form ``cpu_fused_moe`` ran its torch form there and failed ("SymIntArrayRef expected to contain only
    concrete integers"). Two token counts through one dynamic graph equal the op run eagerly."""
    out = _child(
        """
        import torch
        from ascend_eplb.world.engine import kernels

        kernels.register()

        def moe(hidden, w13, w2, weights, ids):
            out = torch.empty_like(hidden)
            torch.ops._C.cpu_fused_moe(out, hidden, w13, w2, None, None, weights, ids, False, "silu", "vec")
            return out * 2

        compiled = torch.compile(moe, backend="eager", dynamic=True, fullgraph=True)
        torch.manual_seed(0)
        w13, w2 = torch.randn(3, 8, 8), torch.randn(3, 8, 4)
        for tokens in (5, 7):
            ids = torch.randint(0, 3, (tokens, 2)).int()
            args = (torch.randn(tokens, 8), w13, w2, torch.rand(tokens, 2), ids)
            print(torch.equal(compiled(*args), moe(*args)))
        from torch._dynamo.utils import counters
        print(counters["stats"]["unique_graphs"])
        """
    )
    assert out.split() == ["True", "True", "1"]


@pytest.mark.timeout(300)
def test_vllm_cpu_workers_event_placeholder_gives_way_to_the_host_event():
    """vLLM's CPU worker module binds ``torch.Event`` to a placeholder without ``elapsed_time`` at import,
    after the plugins ran; upstream's profile rearrangement (the compiled warm-up) times itself with it.
    The engine world's worker module imports vLLM's CPU worker, then its row."""
    out = _child(
        """
        import torch
        import vllm.v1.worker.cpu.shm

        print(hasattr(torch.Event(enable_timing=True), "elapsed_time"))
        from ascend_eplb.world.engine import worker
        from ascend_eplb.control.host_adaptation import HostEvent
        from vllm.v1.worker.cpu_worker import CPUWorker

        start, end = torch.Event(enable_timing=True), torch.Event(enable_timing=True)
        start.record()
        end.record()
        print(worker.CPUWorker is CPUWorker, torch.Event is HostEvent, start.elapsed_time(end) >= 0.0)
        """
    )
    assert out.split() == ["False", "True", "True", "True"]


def test_the_worker_row_refuses_an_event_that_times_itself():
    (row,) = patches.WORKER_PATCHES
    assert row.name == "vllm.v1.worker.cpu.shm.torch.Event"

    class _EventPlaceholder:
        def elapsed_time(self, end):
            return 0.0

    with pytest.raises(RuntimeError, match=r"not vLLM 0\.33\.0's _EventPlaceholder without elapsed_time"):
        row.check(_EventPlaceholder)
