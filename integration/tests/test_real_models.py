"""vLLM 0.33.0's real MoE model classes over Gloo in every row layout vLLM takes on a CPU host, checked
against HF transformers.

One world per architecture (``ranks_real_models.real_model_checks``, TP=2 x EP=2): with EPLB off the
rank's logits equal HF transformers' on the same tiny checkpoint (the stand-ins of
``ascend_eplb.world`` for expert compute and attention are what run); with EPLB on, vLLM's own
loader fills every local slot, redundant slots included, with the checkpoint's expert under upstream's
initial placement. The serving worlds run the EPLB-on serving path through rearrangements with the
verifier on where vLLM's engine on this host cannot (its engine tests, ``test_engine*.py``, serve the
rest): the data-parallel layouts of the world's loop (``ranks_real_models.layout_world``): DP=2 x TP=1 with
vLLM's gather-before-route dispatch (``gathered``) and the route-first all-to-all (``split`` rows), DP=2 x
TP=2 (``gathered-sp``: vLLM on CPU always takes sequence-parallel MoE there), each DP rank serving its own
batch, and the batch split in them.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from ascend_eplb.testing import load_module, run_ranks
from ascend_eplb.testing.hf import hf_logits
from ascend_eplb.world.checkpoints import checkpoint_info, write_checkpoint
from ascend_eplb.world.own_loop import RealModelSpec
from ascend_eplb.world.rank_model import prompt

ranks = load_module(Path(__file__).with_name("ranks_real_models.py"))

PRELOAD = ("vllm", "vllm.model_executor.model_loader", "ascend_eplb.world.own_loop")
NUM_TOKENS = 12
#: max |vLLM - HF| / max |HF| allowed per logit tensor (float32).
TOLERANCE = 1e-5
#: The measured figures are printed (``pytest -s``) for notes/real-models-on-cpu.md.
MEASURED: dict[str, dict[str, float]] = {}


@pytest.mark.multirank
@pytest.mark.timeout(180)
@pytest.mark.parametrize("arch", ["qwen3-moe", "deepseek-v3", "mixtral"])
def test_real_model_on_two_ranks_matches_hf_and_loads_every_slot(arch, tmp_path):
    folder = write_checkpoint(arch, tmp_path / arch, seed=0)
    info = checkpoint_info(folder)
    redundant = info.redundant_experts_for(2, at_least=2)
    assert (info.num_logical_experts + redundant) % 2 == 0
    prompts = [prompt(seed, NUM_TOKENS, info.vocab_size) for seed in range(2)]
    start = time.monotonic()
    reports = run_ranks(
        ranks.real_model_checks,
        world_size=2,
        tmp_path=tmp_path,
        args=(str(folder), prompts, redundant),
        timeout_s=150,
        preload=PRELOAD,
    )
    world_s = time.monotonic() - start
    e, p_off, p_on = (
        info.num_logical_experts,
        info.num_logical_experts // 2,
        (info.num_logical_experts + redundant) // 2,
    )
    for r in reports:
        rank = r["rank"]
        # The stand-ins are what runs: the plain-torch expert method in every MoE layer, once per layer
        # per forward; an SDPA forward on every attention layer of the architecture's class.
        assert r["moe_methods"] == ["TorchFusedMoEMethod"]
        assert r["moe_methods_are_stand_in"] is True
        assert r["moe_calls_per_forward"] == [1.0] * info.num_moe_layers
        want_attention = (
            {"Attention": 0, "MLAAttention": 3}
            if arch == "deepseek-v3"
            else {"Attention": 2, "MLAAttention": 0}
        )
        assert r["attention_stand_ins"] == want_attention
        # vLLM's torch.compile'd helpers (get_masked_input_and_mask at TP = 2, ...) ran their eager ops,
        # as under vLLM Ascend's simple_compile_backend = "eager": no graph was compiled.
        assert r["graphs_compiled"] == 0
        # EP=2: rank r's slots are [r * p, (r + 1) * p) (expert_map: global -> local, -1 elsewhere).
        local_off = [-1] * e
        local_off[rank * p_off : (rank + 1) * p_off] = range(p_off)
        assert r["expert_map_off"] == [local_off] * info.num_moe_layers
        assert r["slot_mismatches_off"] == []
        # Routing is not degenerate: the tokens of each prompt pick more distinct experts than K.
        assert len(r["selections"]) == info.num_moe_layers * len(prompts)
        for ids in r["selections"]:
            assert ids.shape == (NUM_TOKENS, info.top_k)
            assert int(ids.min()) >= 0
            assert int(ids.max()) < e
            assert len(torch.unique(ids)) > info.top_k + 1
        # EPLB on: P = E + R slots, p per rank, each holding its expert under the initial placement.
        local_on = [-1] * (e + redundant)
        local_on[rank * p_on : (rank + 1) * p_on] = range(p_on)
        assert r["expert_map_on"] == [local_on] * info.num_moe_layers
        assert r["local_slots_on"] == [p_on] * info.num_moe_layers
        assert r["slot_mismatches_on"] == []
        assert r["distinct_local_rows"] == [p_on] * info.num_moe_layers
    errors = []
    for i, tokens in enumerate(prompts):
        reference = hf_logits(folder, tokens)
        assert reference.shape == (NUM_TOKENS, info.vocab_size)
        scale = float(reference.abs().max())
        assert scale > 0.5  # real logits, not zeros
        for r in reports:
            got = r["logits_off"][i]
            assert got.shape == (NUM_TOKENS, info.vocab_size)
            assert got.dtype == torch.float32
            errors.append(float((got - reference).abs().max()) / scale)
        # Both TP ranks return the same gathered logits.
        assert torch.equal(reports[0]["logits_off"][i], reports[1]["logits_off"][i])
    worst = max(errors)
    MEASURED[arch] = {
        "max_rel_err": worst,
        "world_s": world_s,
        "build_off_s": max(r["build_off_s"] for r in reports),
        "build_on_s": max(r["build_on_s"] for r in reports),
        "forward_s": max(r["forward_off_s"] for r in reports),
    }
    print(f"\n{arch}: {MEASURED[arch]}")
    assert worst <= TOLERANCE, f"{arch}: max |vLLM - HF| / max |HF| = {worst:.3g} > {TOLERANCE}"


#: (architecture, DP, ranks, the row layout vLLM takes, whether the world also runs the route-first
#: all-to-all dispatch (``split`` rows) and injects the replica fault)
LAYOUT_CASES = [
    ("qwen3-moe", 2, 2, "gathered", True),
    ("deepseek-v3", 2, 4, "gathered-sp", False),
]


def _recorded_rows(rows: str, tp_rank: int, tp_size: int, num_tokens: int, real: int) -> int:
    """The real rows one rank records per forward: its DP rank's real rows on its TP leader
    (``replicated``, ``gathered``; every rank under ``split``, where TP = 1), or its sequence-parallel
    chunk's real rows (``gathered-sp``: vLLM's ``_compute_sp_num_tokens`` chunks of ``ceil(T / TP)``)."""
    if rows != "gathered-sp":
        return real if tp_rank == 0 else 0
    chunk = -(-num_tokens // tp_size)
    return max(0, min(real, (tp_rank + 1) * chunk) - tp_rank * chunk)


def _check_serving_run(runs, rows, tp, info, num_physical, real_tokens, hf):
    """The checks of one ``real_model_world`` run in a DP layout (``runs``: every rank's report); returns
    the worst relative logits errors against EPLB off and HF (``hf(prompt)``: HF's logits, cached)."""
    for r in runs:
        assert (r.dp_rank, r.tp_rank) == (r.rank // tp, r.rank % tp)
        assert r.moe_rows == rows
        assert r.num_real_tokens == real_tokens[r.dp_rank]
        assert r.num_physical_experts == num_physical
        assert r.initial_slot_mismatches == []
        assert r.worker_alive is True
        committed_layers = [layer for _, layer in r.commits]
        assert all(committed_layers.count(layer) >= 3 for layer in range(info.num_moe_layers)), r.commits
        assert len(r.slot_checks) == len(r.commits)
        assert all(mismatches == [] for _, mismatches in r.slot_checks), r.slot_checks
    # The rows each rank's experts received: its own (split), the DP ranks' gathered, or every EP rank's
    # sequence-parallel chunk gathered.
    num_tokens = int(runs[0].prompts[0].shape[0])
    gathered = {"split": num_tokens, "gathered": len(real_tokens) * num_tokens}
    want_rows = gathered.get(rows, len(runs) * -(-num_tokens // tp))
    assert all(r.kernel_rows == [want_rows] * len(r.prompts) for r in runs)
    assert any(not torch.equal(m, runs[0].maps[0]) for m in runs[0].maps)
    for r in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0].maps, r.maps, strict=True))

    # Each DP rank's own batch: its prompts differ from the other DP rank's; on its real rows the logits
    # equal the EPLB-off model's and HF's; TP peers return the same logits.
    leaders = [r for r in runs if r.tp_rank == 0]
    assert not torch.equal(leaders[0].prompts[0], leaders[1].prompts[0])
    worst_off = worst_hf = 0.0
    for r in runs:
        leader = leaders[r.dp_rank]
        real = r.num_real_tokens
        for step, ids in enumerate(r.prompts):
            assert torch.equal(ids, leader.prompts[step])
            assert torch.equal(r.logits_on[step], leader.logits_on[step])
            on, off = r.logits_on[step][:real], r.logits_off[step][:real]
            worst_off = max(worst_off, float((on - off).abs().max()) / float(off.abs().max()))
            reference = hf(ids[:real])
            worst_hf = max(worst_hf, float((on - reference).abs().max()) / float(reference.abs().max()))

    # The load: over all ranks, every DP rank's real tokens x K once per layer, when the step records;
    # each rank its own rows (a TP leader its DP rank's, or its sequence-parallel chunk's).
    assert all(r.recorded == runs[0].recorded for r in runs)
    assert sum(runs[0].recorded) == 5  # steps 0, 5, 6, 11, 12 (window 2, interval 6)
    for step, recorded in enumerate(runs[0].recorded):
        total = sum(r.load[step] for r in runs).sum(dim=1).tolist()
        want = sum(real_tokens) * info.top_k if recorded else 0
        assert total == [want] * info.num_moe_layers, step
        for r in runs:
            mine = _recorded_rows(rows, r.tp_rank, tp, num_tokens, r.num_real_tokens) * info.top_k
            assert r.load[step].sum(dim=1).tolist() == [mine if recorded else 0] * info.num_moe_layers
    return worst_off, worst_hf


def _split_shares(total: torch.Tensor, placement: torch.Tensor, world_size: int) -> torch.Tensor:
    """int64 ``(L, P)``: each slot's share of its expert's recorded selections under the batch split of
    these counts (``total`` ``(L, P)`` recorded per slot; ``placement`` ``(L, P)`` committed)."""
    from ascend_eplb.dataplane import split_boundaries, split_inputs

    num_layers, num_physical = placement.shape
    num_logical = int(placement.max()) + 1
    out = torch.zeros_like(total)
    for layer in range(num_layers):
        row = placement[layer]
        counts = torch.zeros(num_logical, dtype=torch.int64).index_add_(0, row, total[layer])
        replicas = torch.bincount(row, minlength=num_logical)
        l2p = torch.full((num_logical, num_physical - num_logical + 1), -1, dtype=torch.int64)
        for e in range(num_logical):
            slots = torch.nonzero(row == e).flatten()
            l2p[e, : slots.numel()] = slots
        inputs = split_inputs(l2p, replicas, num_physical, world_size)
        shares = torch.diff(split_boundaries(counts, *inputs), dim=1, prepend=torch.zeros(num_logical, 1))
        valid = l2p >= 0
        out[layer, l2p[valid]] = shares[valid].long()
    return out


@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_the_batch_split_on_a_real_model_gives_eplb_off_logits_and_records_the_split_shares(tmp_path):
    """Issue 44: the serving world (TP=2 x EP=2, ``replicated`` rows, verifier on) with
    ``replica_split=batch``, through rearrangements: every step's logits equal the EPLB-off run's and
    HF's, and every recorded step's load per slot is exactly the batch split's shares of its counts under
    the placement in force (the TP leader records every real row)."""
    arch, world_size = "qwen3-moe", 2
    folder = write_checkpoint(arch, tmp_path / arch, seed=0)
    info = checkpoint_info(folder)
    redundant = info.redundant_experts_for(world_size, at_least=2)
    spec = RealModelSpec(
        folder=str(folder), num_redundant_experts=redundant, steps=24, phase="all",
        ascend_keys={"replica_split": "batch"},
    )  # fmt: skip
    reports = run_ranks(
        ranks.serving_world, world_size=world_size, tmp_path=tmp_path, args=(spec,), timeout_s=200,
        preload=PRELOAD,
    )  # fmt: skip
    worst_off = worst_hf = 0.0
    for step in range(spec.steps):
        reference = hf_logits(folder, reports[0].prompts[step])
        for r in reports:
            on, off = r.logits_on[step], r.logits_off[step]
            worst_off = max(worst_off, float((on - off).abs().max()) / float(off.abs().max()))
            worst_hf = max(worst_hf, float((on - reference).abs().max()) / float(reference.abs().max()))
    MEASURED[f"{arch}-serving-batch-split"] = {"max_rel_err_vs_off": worst_off, "max_rel_err_vs_hf": worst_hf}
    print(f"{arch} batch split: EPLB on vs off {worst_off:.3g}, vs HF {worst_hf:.3g}")
    assert worst_off <= TOLERANCE
    assert worst_hf <= TOLERANCE
    assert sum(layer == 0 for _, layer in reports[0].commits) >= 2  # placements changed under it
    checked = 0
    maps = reports[0].maps
    for step in range(1, spec.steps):
        if not reports[0].recorded[step] or not torch.equal(maps[step], maps[step - 1]):
            continue
        total = sum(r.load[step] for r in reports)
        assert torch.equal(total, _split_shares(total, maps[step], world_size)), step
        checked += 1
    assert checked >= 4


@pytest.mark.multirank
@pytest.mark.timeout(420)
def test_the_batch_split_in_gathered_and_split_rows_gives_eplb_off_and_hf_logits(tmp_path):
    """Issue 44: ``replica_split=batch`` in the DP=2 x TP=1 world, the same prompts twice: gathered rows
    (every rank splits the gathered batch alike, no communication) and the route-first all-to-all
    dispatch (split rows: each MoE layer all-gathers the ranks' counts over vLLM's EP group and splits
    the global batch). Each DP rank's logits equal the EPLB-off run's and HF's on its own batch, and
    every window's load counts each real selection once."""
    arch, dp, world_size = "qwen3-moe", 2, 2
    folder = write_checkpoint(arch, tmp_path / arch, seed=0)
    refused = write_checkpoint("qwen2-moe", tmp_path / "qwen2-moe", seed=0)
    info = checkpoint_info(folder)
    redundant = info.redundant_experts_for(world_size, at_least=2)
    real_tokens = (NUM_TOKENS, NUM_TOKENS - 3)
    spec = RealModelSpec(
        folder=str(folder), num_redundant_experts=redundant, steps=16, data_parallel_size=dp,
        real_tokens=real_tokens, ascend_keys={"replica_split": "batch"},
    )  # fmt: skip
    reports = run_ranks(
        ranks.layout_world, world_size=world_size, tmp_path=tmp_path, args=(spec, str(refused), False, True),
        timeout_s=390, preload=PRELOAD,
    )  # fmt: skip
    cache: dict[tuple[int, ...], torch.Tensor] = {}

    def hf(ids):
        key = tuple(ids.tolist())
        if key not in cache:
            cache[key] = hf_logits(folder, ids)
        return cache[key]

    num_physical = info.num_logical_experts + redundant
    for name, run in (
        ("gathered", [r["serving"] for r in reports]),
        ("split", [r["split"] for r in reports]),
    ):
        worst_off, worst_hf = _check_serving_run(run, name, 1, info, num_physical, real_tokens, hf)
        MEASURED[f"{arch}-dp{dp}-tp1-{name}-batch-split"] = {
            "max_rel_err_vs_off": worst_off,
            "max_rel_err_vs_hf": worst_hf,
        }
        print(f"{arch} DP={dp} {name} batch split: EPLB on vs off {worst_off:.3g}, vs HF {worst_hf:.3g}")
        assert worst_off <= TOLERANCE
        assert worst_hf <= TOLERANCE


@pytest.mark.multirank
@pytest.mark.timeout(360)
@pytest.mark.parametrize(
    ("arch", "dp", "world_size", "rows", "more"),
    LAYOUT_CASES,
    ids=[f"{a}-dp{d}-tp{n // d}-{r}" for a, d, n, r, _ in LAYOUT_CASES],
)
def test_data_parallel_worlds_of_a_real_model_give_eplb_off_and_hf_logits_and_count_each_token_once(
    arch, dp, world_size, rows, more, tmp_path
):
    """Issue 29: vLLM's real model class with ``data_parallel_size=2`` (every DP rank in one world, as
    vLLM's external launcher builds them; the harness's ``all_gatherv`` / ``reduce_scatterv`` stand-ins
    under vLLM's gather-before-route dispatch), each DP rank its own prompts with its own real rows
    (12 and 9 of T = 12), through >= 3 completed asynchronous rearrangements with the verifier on:
    each DP rank's logits equal the EPLB-off run's and HF's on its own batch; every window's load over
    all ranks is every DP rank's real tokens x K, each counted once (per rank: its own rows or chunk);
    every commit leaves each slot holding its logical expert. The same world first refuses, on every
    rank before anything loads, a Qwen2-MoE checkpoint (its vLLM class has no MixtureOfExperts part) and
    checks the collectives with unequal sizes; at TP = 1 it then serves the same prompts with the
    route-first all-to-all dispatch (the ``split`` rows: each rank routes its own, replica offset = EP
    rank, every rank records its own), and puts a rank-dependent replica choice back into the gathered
    rows: the verifier names the broken agreement on every rank."""
    folder = write_checkpoint(arch, tmp_path / arch, seed=0)
    refused = write_checkpoint("qwen2-moe", tmp_path / "qwen2-moe", seed=0)
    info = checkpoint_info(folder)
    redundant = info.redundant_experts_for(world_size, at_least=2)
    tp = world_size // dp
    real_tokens = (NUM_TOKENS, NUM_TOKENS - 3)
    spec = RealModelSpec(
        folder=str(folder), num_redundant_experts=redundant, steps=16, data_parallel_size=dp,
        real_tokens=real_tokens,
    )  # fmt: skip
    start = time.monotonic()
    reports = run_ranks(
        ranks.layout_world, world_size=world_size, tmp_path=tmp_path,
        args=(spec, str(refused), more, more), timeout_s=330, preload=PRELOAD,
    )  # fmt: skip
    took = time.monotonic() - start
    serving = reports[0]["serving"]
    print(
        f"\nlayout_world {arch} DP={dp} TP={tp} ({rows}): {took:.1f} s, build on {serving.build_on_s:.1f} s, "
        f"off {serving.build_off_s:.1f} s, steps {serving.steps_s:.1f} s"
    )

    # Start-up refuses the model class EPLB cannot balance, on every rank, before vLLM's loader runs.
    for r in reports:
        kind, message, loaded = r["refused"]
        assert kind == "EplbConfigError"
        assert message == (
            "1 EPLB configuration rule(s) violated:\n  - [moe-model-class] model class Qwen2MoeForCausalLM "
            "(architecture Qwen2MoeForCausalLM) has no MixtureOfExperts part (vLLM's MixtureOfExperts "
            "interface: expert_weights, set_eplb_state, the MoE layers): upstream's "
            "EPLBController.maybe_register_model would not register it and the model would be served "
            "without EPLB; fix: serve it without --enable-eplb, or with a model class that implements "
            "MixtureOfExperts"
        )
        assert loaded is False

    cache: dict[tuple[int, ...], torch.Tensor] = {}

    def hf(ids):
        key = tuple(ids.tolist())
        if key not in cache:
            cache[key] = hf_logits(folder, ids)
        return cache[key]

    num_physical = info.num_logical_experts + redundant
    runs = {rows: [r["serving"] for r in reports]}
    if more:
        runs["split"] = [r["split"] for r in reports]
    for name, run in runs.items():
        worst_off, worst_hf = _check_serving_run(run, name, tp, info, num_physical, real_tokens, hf)
        MEASURED[f"{arch}-dp{dp}-tp{tp}-{name}"] = {
            "max_rel_err_vs_off": worst_off,
            "max_rel_err_vs_hf": worst_hf,
        }
        print(f"{arch} DP={dp} TP={tp} {name}: EPLB on vs off {worst_off:.3g}, vs HF {worst_hf:.3g}")
        assert worst_off <= TOLERANCE, (
            f"{arch} {name}: EPLB-on logits differ from EPLB-off by {worst_off:.3g}"
        )
        assert worst_hf <= TOLERANCE, f"{arch} {name}: EPLB-on logits differ from HF by {worst_hf:.3g}"
    if more:
        # The same prompts both ways; the all-to-all run's replicas differ by rank (offset = EP rank).
        for r in reports:
            assert all(
                torch.equal(a, b) for a, b in zip(r["serving"].prompts, r["split"].prompts, strict=True)
            )

    # The harness's variable-size collectives on the EP group: rank r holds 2 + 3 r rows.
    sizes = [2 + 3 * r for r in range(world_size)]
    want_rows = torch.cat(
        [torch.arange(n * 3, dtype=torch.float32).view(-1, 3) + 100 * r for r, n in enumerate(sizes)]
    )
    want_ids = torch.cat([torch.arange(n, dtype=torch.int32) + 10 * r for r, n in enumerate(sizes)])
    total_weight = sum(range(1, world_size + 1))
    for r in reports:
        got = r["collectives"]
        assert got["sizes"] == sizes
        assert torch.equal(got["gathered"][0], want_rows)
        assert torch.equal(got["gathered"][1], want_ids)
        assert torch.equal(got["scattered"], torch.full((sizes[r["serving"].rank], 2), float(total_weight)))

    if more:
        for r in reports:
            f = r["fault"]
            assert f["rows"] == rows
            assert f["check"] == "lookups"
            assert (
                f"replica agreement: ranks 0 and 1 route the same rows ({rows} row layout) but chose "
                f"different replicas for the probe batch of model {folder}'s layer(s) [0]"
            ) in f["error"]
            assert f["max_rel_err"] > 1e-3  # tokens' experts computed twice or not at all
            # A model without MoE layers is refused at registration, never served silently without EPLB.
            assert f["dense_registration"] == (
                "ValueError",
                "EPLB is on but model class Linear has no MixtureOfExperts part (vLLM's "
                "get_mixture_of_experts_model finds none): upstream would serve it without EPLB; serve it "
                "without --enable-eplb",
            )
        assert len({r["fault"]["step"] for r in reports}) == 1
