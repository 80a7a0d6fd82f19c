"""`ascend-eplb simulate` end to end: a short real run passes every check; each fault fires its check."""

import json

import numpy as np
import pytest

from ascend_eplb.tools.cli import main
from ascend_eplb.tools.simulate.config import SimulateConfig
from ascend_eplb.tools.simulate.driver import run_simulation

# The trace-replay world (--model replay): the embedded ESFT trace on synthetic w8a8_dynamic experts.
SHORT = dict(model="replay", num_ranks=2, num_redundant_experts=2, num_moe_layers=2, batch_size=32, steps=16,
             window_size=2, step_interval=4, progress=False, timeout_s=240)  # fmt: skip
# A fault fires at the first commit (interval 2 starts the first rearrangement at step 0) and stops the run.
FAULTY = dict(model="replay", num_ranks=2, num_redundant_experts=2, num_moe_layers=1, batch_size=16, steps=8,
              window_size=1, step_interval=2, progress=False, timeout_s=240)  # fmt: skip


@pytest.mark.multirank
def test_short_run_passes_every_check_and_balances(tmp_path):
    report = run_simulation(SimulateConfig(**SHORT, out_dir=str(tmp_path)))
    assert report["passed"], report["first_violation"]
    assert report["checks"] == {
        "outputs": True,
        "fingerprints": True,
        "lookups": True,
        "load": True,
        "worker": True,
    }
    assert report["rearrangements"] >= 2
    assert report["rearrangements_completed"] >= 2
    assert report["layers_committed"] >= 4
    assert report["bytes_moved"] > 0
    assert report["steps"] == 16
    assert report["balancedness_after"] > report["balancedness_before"]
    on_disk = json.loads((tmp_path / "report.json").read_text())
    for key in ("ranks", "format", "steps", "rearrangements", "balancedness_before", "balancedness_after",
                "balancedness_per_step", "bytes_moved", "commit_seconds", "step_seconds_p50",
                "step_seconds_p99", "checks"):  # fmt: skip
        assert key in on_disk
    assert (tmp_path / "balancedness.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # EPLB off over the same steps, from the step's logical ids under upstream's initial placement
    # with the replica split of integration.metrics; the EPLB-on run beats it after rearranging.
    off = on_disk["balancedness_off_per_step"]
    assert len(off) == len(on_disk["balancedness_per_step"]) == 16
    assert all(0 < b <= 1 for b in off)
    assert report["balancedness_after"] > report["balancedness_off_after"]
    shares = np.array(on_disk["rank_load_share_per_step"])
    assert shares.shape == (16, 2)
    np.testing.assert_allclose(shares.sum(axis=1), 1.0)
    assert on_disk["commit_completed_steps"] == sorted(on_disk["commit_completed_steps"])
    assert len(on_disk["commit_completed_steps"]) == report["rearrangements_completed"]
    assert sum(on_disk["bytes_received_per_rank"]) == report["bytes_moved"]
    assert on_disk["out_dir"] == str(tmp_path.resolve())


@pytest.mark.multirank
def test_metrics_writes_the_scrape_of_the_run_beside_the_report(tmp_path, capsys):
    from prometheus_client.parser import text_string_to_metric_families

    report = run_simulation(SimulateConfig(**FAULTY, out_dir=str(tmp_path), metrics=True))
    assert report["passed"], report["first_violation"]
    assert f"events.jsonl, metrics.prom in {tmp_path.resolve()}" in capsys.readouterr().out
    scrape = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families((tmp_path / "metrics.prom").read_text())
        for sample in family.samples
    }
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    (model,) = {e["model"] for e in events}
    kinds = [e["event"] for e in events]
    assert kinds.count("rearrangement") == report["rearrangements_completed"] >= 2
    by_model = (("model", model),)
    assert scrape[("ascend_eplb_rearrangements_started_total", by_model)] == kinds.count("window")
    assert scrape[("ascend_eplb_rearrangements_completed_total", by_model)] == kinds.count("rearrangement")
    assert scrape[("ascend_eplb_layers_committed_total", by_model)] == report["layers_committed"]
    last_window = [e for e in events if e["event"] == "window"][-1]
    assert scrape[("ascend_eplb_window_balancedness", by_model)] == last_window["balancedness"]
    per_rank = [
        scrape[("ascend_eplb_bytes_received_total", (("model", model), ("rank", str(r))))] for r in (0, 1)
    ]
    assert per_rank[0] == sum(e["bytes_received"] for e in events if e["event"] == "commit")
    assert 0 < sum(per_rank) <= report["bytes_moved"]


def test_metrics_under_torchrun_is_refused_before_anything(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    code = main(["simulate", "--model", "replay", "--ranks", "2", "--metrics", "--out", str(tmp_path / "o")])
    assert code == 2
    assert "metrics: not under torchrun (set ASCEND_EPLB_METRICS=1 and PROMETHEUS_MULTIPROC_DIR" in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "o").exists()


def test_eplb_off_balancedness_is_metrics_on_the_initial_placement():
    """The rank's EPLB-off number, recomputed here for one hand-made step: 4 experts, 2 ranks, 2
    redundant slots (upstream's initial map [0, 1, 2, 3, 0, 1]: rank 0 holds {0, 1, 2}, rank 1
    {3, 0, 1})."""
    import torch
    from vllm.distributed.eplb.eplb_state import EplbState

    from ascend_eplb.integration import metrics

    p2l = torch.tensor([EplbState.build_initial_global_physical_to_logical_map(4, 2)])
    assert p2l.tolist() == [[0, 1, 2, 3, 0, 1]]
    load = torch.tensor([[8.0, 2.0, 1.0, 1.0]])  # expert 0 split 4 | 4, expert 1 split 1 | 1
    loads = metrics.rank_loads(load, p2l, 2)
    assert loads.tolist() == [[4 + 1 + 1, 1 + 4 + 1]]
    assert metrics.balancedness(loads) == pytest.approx(1.0)


def test_the_parser_is_generated_from_the_config_fields():
    from dataclasses import fields

    from ascend_eplb.tools.cli import build_parser
    from ascend_eplb.tools.simulate.config import config_from_args

    args = build_parser().parse_args(
        [
            "simulate",
            "--ranks",
            "2",
            "--top-k",
            "8",
            "--no-progress",
            "--link-gbps",
            "100",
            "--phase",
            "decode",
        ]
    )
    config = config_from_args(args)
    assert (config.num_ranks, config.sample_top_k, config.progress, config.link_gbps) == (2, 8, False, 100.0)
    assert config.load_collection_phase == "decode"
    assert config_from_args(build_parser().parse_args(["simulate"])) == SimulateConfig()
    flags = {f.metadata["flag"] for f in fields(SimulateConfig) if "flag" in f.metadata}
    help_text = build_parser()._subparsers._group_actions[0].choices["simulate"].format_help()
    assert all(flag in help_text for flag in flags)


def test_top_k_samples_a_load_matrix_and_skips_layers_without_load(tmp_path, capsys):
    from ascend_eplb.tools.trace import load_routing_source

    load = np.zeros((3, 16))
    load[1] = np.arange(1, 17)
    load[2] = 1.0
    path = tmp_path / "load.npy"
    np.save(path, load)
    routing = load_routing_source(path, num_tokens=64, top_k=8, seed=0)
    assert routing.topk_ids.shape == (2, 64, 8)  # the dense (all-zero) layer 0 skipped
    assert routing.name == "load.npy (1 layers without load skipped)"
    assert load_routing_source(path, num_tokens=64, seed=0).top_k == 6  # the stated default
    # --top-k is for sampling: with a routing trace (.npz) it is an error naming the trace's own K.
    code = main(["simulate", "--model", "replay", "--top-k", "8", "--out", str(tmp_path / "o")])
    assert code == 2
    err = capsys.readouterr().err
    assert "top-k=8: the routing trace routes top-6; --top-k is for sampling a load matrix" in err


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("fault", "check"), [("wrong-lookup-refresh", "lookups"), ("view-skips-scale", "fingerprints")]
)
def test_each_fault_fires_its_check(tmp_path, fault, check):
    report = run_simulation(SimulateConfig(**FAULTY, out_dir=str(tmp_path), fault=fault))
    assert not report["passed"]
    assert report["steps"] < FAULTY["steps"]  # stopped at the end of the violating step
    assert report["first_violation"].startswith(f"{check}:")
    assert report["checks"][check] is False


def test_bad_options_rejected_before_any_process(tmp_path, capsys):
    code = main(["simulate", "--model", "replay", "--ranks", "3", "--redundant-experts", "1", "--layers",
                 "40", "--format", "int3", "--window-size", "9", "--step-interval", "4", "--out",
                 str(tmp_path / "o")])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    assert (
        "redundant experts=1: logical experts (64) + num_redundant_experts (1) = 65 physical experts is "
        "not divisible by 3 EP ranks; fix: choose num_redundant_experts so that 64 + num_redundant_experts "
        "is a multiple of 3, e.g. 2"
    ) in err
    assert "layers=40: must be in [1, 26]" in err
    assert "format='int3'" in err
    assert "window size=9: must be <= step interval=4" in err
    assert not (tmp_path / "o").exists()


def test_unusable_sizes_output_folder_and_timeout_rejected_before_any_process(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code = main(["simulate", "--model", "replay", "--format", "mxfp8", "--out", str(blocker / "sub"),
                 "--timeout", "inf"])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    assert (
        "format='mxfp8' with hidden size=64, intermediate size=32: mxfp8: I=32 must be a multiple of 64"
    ) in err
    assert f"out={blocker / 'sub'}: cannot be created: {blocker} is not a folder" in err
    assert "timeout=inf: must be a finite number of seconds > 0" in err
    assert main(["simulate", "--out", str(blocker), "--timeout", "nan"]) == 2
    err = capsys.readouterr().err
    assert f"out={blocker}: exists and is not a folder" in err
    assert "timeout=nan: must be a finite number of seconds > 0" in err
    missing = tmp_path / "missing.npz"
    assert main(["simulate", "--model", "replay", "--trace", str(missing), "--out", str(tmp_path / "o")]) == 2
    assert f"{missing}: no such file (a compact routing trace .npz)" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


@pytest.mark.multirank
def test_ranks_past_the_deadline_end_the_run_with_exit_1_naming_each_rank(tmp_path, capsys):
    # 100000 steps (tens of ms each) cannot finish within 60 s, start-up (which the deadline covers,
    # test_stops.py) well within it: each rank is killed at the deadline.
    code = main(["simulate", "--model", "replay", "--ranks", "2", "--layers", "1", "--steps", "100000",
                 "--timeout", "60",
                 "--no-progress", "--out", str(tmp_path / "o")])  # fmt: skip
    assert code == 1
    err = capsys.readouterr().err
    assert err.startswith("ascend-eplb simulate: error: simulation failed:\n")
    assert "--- rank 0: still running at the deadline (60 s); killed" in err
    assert "--- rank 1: still running at the deadline (60 s); killed" in err
    assert "Traceback" not in err
    assert not (tmp_path / "o" / "report.json").exists()


@pytest.mark.multirank
def test_torchrun_runs_the_same_simulation_two_ranks_on_one_host(tmp_path):
    """``torchrun --standalone --nproc-per-node 2 -m ascend_eplb.tools simulate``: rank and world from
    torchrun's environment, rank 0 writes the report."""
    import os
    import subprocess
    import sys

    out = tmp_path / "sim"
    env = os.environ | {"VLLM_TARGET_DEVICE": "cpu", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "ascend_eplb.tools", "simulate", "--ranks", "2", "--redundant-experts", "2", "--steps", "12",
         "--window-size", "2", "--step-interval", "4", "--no-progress", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["passed"] is True
    assert (report["model"], report["ranks"], report["steps"]) == ("DeepseekV3ForCausalLM", 2, 12)
    assert report["rearrangements"] >= 2
    assert report["layers_committed"] >= 4
    assert proc.stdout.count("PASSED in") == 1  # one report, from rank 0


WORKER_FAULT = dict(model="replay", num_ranks=2, num_redundant_experts=2, num_moe_layers=3, batch_size=16,
                    steps=300, window_size=2, step_interval=4, progress=False, timeout_s=240,
                    worker_timeout_s=1.0)  # fmt: skip


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("fault", "named"),
    [
        ("worker-dies", "rank(s) 1 died (model esft_translation_top6.npz, layer 1,"),
        ("worker-stalls", "rank(s) 1 stalled (model esft_translation_top6.npz, layer 1,"),
    ],
)
def test_a_dead_or_stalled_worker_stops_eplb_on_every_rank_and_serving_goes_on(tmp_path, fault, named):
    report = run_simulation(SimulateConfig(**WORKER_FAULT, out_dir=str(tmp_path), fault=fault))
    assert not report["passed"]
    assert report["checks"] == {
        "outputs": True,  # every step after the stop still equals the EPLB-off reference
        "load": True,
        "fingerprints": True,
        "lookups": True,
        "worker": False,
    }
    assert report["steps"] == WORKER_FAULT["steps"]  # no hang, no early end: serving went on
    message, step = report["worker_failure"]
    assert named in message
    assert report["first_violation"] == f"worker: {message}"
    if fault == "worker-dies":
        assert "RuntimeError('injected fault: the expert transfer of layer 1 failed on rank 1')" in message
        assert "Traceback" in message  # the dead worker's own traceback, from its rank
    else:
        assert "rank 0's transfer waits on rank 1, which waits on no peer" in message
        # Decided once the cycle went 1 s without progress (steps take tens of ms here).
        assert step < 250
    # Exactly the layer before the failure committed: each layer wholly old or wholly new.
    assert report["layers_committed"] == 1
    assert report["rearrangements_completed"] == 0
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    failures = [e for e in events if e["event"] == "worker_failure"]
    assert len(failures) == 1
    assert failures[0]["ranks"] == [1]
    assert failures[0]["layer"] == 1
    assert failures[0]["kind"] == ("died" if fault == "worker-dies" else "stalled")
    assert [e["layer"] for e in events if e["event"] == "commit"] == [0]


@pytest.mark.multirank
def test_on_worker_failure_raise_ends_the_run_on_every_rank_at_the_same_step(tmp_path):
    config = SimulateConfig(
        **WORKER_FAULT, out_dir=str(tmp_path), fault="worker-dies", on_worker_failure="raise"
    )
    report = run_simulation(config)
    assert not report["passed"]
    assert report["checks"]["worker"] is False
    assert report["first_violation"].startswith(
        "worker: EPLB worker watchdog: the async EPLB worker of rank(s) 1 died"
    )
    assert report["steps"] < WORKER_FAULT["steps"]  # the step raised on both ranks, and the run ended


def test_quiet_drops_only_the_named_vllm_start_up_lines(caplog):
    import logging

    from ascend_eplb.tools import quiet

    assert quiet.install()
    caplog.set_level(logging.INFO)
    logging.getLogger("vllm.platforms.cpu").warning(
        "Triton is not installed. triton-cpu is expected on x86 CPUs."
    )
    logging.getLogger("vllm.platforms.interface").warning("Failed to import from vllm._C: %s", "x")
    logging.getLogger("vllm.config.vllm").warning(
        "Model Runner V2 requires Triton; using the V1 model runner"
    )
    logging.getLogger("vllm.platforms.cpu").warning("some other CPU platform warning")
    logging.getLogger("ascend_eplb.integration.watchdog").error("worker died; EPLB rearrangement is stopped")
    assert [r.getMessage() for r in caplog.records] == [
        "some other CPU platform warning",
        "worker died; EPLB rearrangement is stopped",
    ]


def test_a_bad_model_config_or_an_output_name_taken_by_a_folder_is_refused_before_any_rank(tmp_path, capsys):
    bad = tmp_path / "config.json"
    bad.write_bytes(b"\xff\x00")
    assert (
        main(["simulate", "--model", "replay", "--model-config", str(bad), "--out", str(tmp_path / "o")]) == 2
    )
    assert f"model config={bad}: {bad}: cannot read the model config as JSON" in capsys.readouterr().err
    (tmp_path / "o2" / "events.jsonl").mkdir(parents=True)
    assert main(["simulate", "--out", str(tmp_path / "o2")]) == 2
    assert (
        f"{tmp_path / 'o2' / 'events.jsonl'} is not a file; the run writes a file there"
        in capsys.readouterr().err
    )


def _trace_balancedness_off(
    num_moe_layers: int, num_ranks: int, num_redundant: int, step_tokens: int
) -> float:
    """The embedded ESFT trace's own EPLB-off balancedness: its first MoE layers' selections in steps of
    ``step_tokens`` tokens, on upstream's initial placement (the metric simulate reports per step)."""
    import torch
    from vllm.distributed.eplb.eplb_state import EplbState

    from ascend_eplb.integration import metrics
    from ascend_eplb.tools.trace import load_trace

    trace = load_trace()
    ids = torch.from_numpy(trace.topk_ids[:num_moe_layers].astype(np.int64))  # [L, T, K]
    e = trace.num_logical_experts
    p2l = torch.tensor(
        [EplbState.build_initial_global_physical_to_logical_map(e, num_redundant)] * num_moe_layers
    )
    values = []
    for start in range(0, ids.shape[1] - step_tokens + 1, step_tokens):
        load = torch.stack([torch.bincount(ids[layer, start : start + step_tokens].reshape(-1), minlength=e)
                            for layer in range(num_moe_layers)])  # fmt: skip
        values.append(metrics.balancedness(metrics.rank_loads(load, p2l, num_ranks)))
    return float(np.mean(values))


@pytest.mark.multirank
def test_the_main_job_serves_a_real_deepseek_v3_model_skewed_like_the_trace(tmp_path):
    """The default --model: vLLM's DeepseekV3ForCausalLM on the preset checkpoint (routing bias fitted to
    the ESFT trace), 4 ranks TP=4 x EP=4, every check every step."""
    config = SimulateConfig(steps=40, progress=False, timeout_s=280, out_dir=str(tmp_path))
    assert (config.model, config.num_ranks, config.batch_size) == ("deepseek-v3", 4, 32)
    report = run_simulation(config)
    assert report["passed"], report["first_violation"]
    assert report["checks"] == dict.fromkeys(("outputs", "load", "fingerprints", "lookups", "worker"), True)
    served = (report["model"], report["format"], report["layers"], report["num_logical_experts"])
    assert served == ("DeepseekV3ForCausalLM", "float32", 4, 64)
    assert report["top_k"] == 6
    assert report["steps"] == 40
    assert report["rearrangements_completed"] >= 2
    assert report["max_output_error"] <= 1e-5
    # The load is skewed like the real trace's: without EPLB, within 0.05 of the trace's own figure.
    trace_off = _trace_balancedness_off(4, 4, 4, 4 * 32)
    assert abs(report["balancedness_off_mean"] - trace_off) <= 0.05, (
        report["balancedness_off_mean"],
        trace_off,
    )
    assert report["balancedness_after"] > report["balancedness_off_after"] + 0.05
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert {e["event"] for e in events} >= {"window", "rearrangement", "commit"}


REAL_FAULTY = dict(model="qwen3-moe", num_ranks=2, num_redundant_experts=2, batch_size=16, window_size=1,
                   step_interval=2, progress=False, timeout_s=240, worker_timeout_s=1.0)  # fmt: skip


@pytest.mark.multirank
def test_a_stale_lookup_on_the_real_model_fails_the_lookups_check(tmp_path):
    report = run_simulation(
        SimulateConfig(**REAL_FAULTY, steps=8, out_dir=str(tmp_path), fault="wrong-lookup-refresh")
    )
    assert not report["passed"]
    assert report["first_violation"].startswith("lookups:")
    assert report["checks"]["lookups"] is False
    assert report["steps"] < 8  # stopped at the end of the violating step


@pytest.mark.multirank
def test_a_dead_worker_on_the_real_model_stops_eplb_and_serving_goes_on(tmp_path):
    report = run_simulation(
        SimulateConfig(**REAL_FAULTY, steps=60, out_dir=str(tmp_path), fault="worker-dies")
    )
    assert report["checks"] == {
        "outputs": True,
        "load": True,
        "fingerprints": True,
        "lookups": True,
        "worker": False,
    }
    assert report["steps"] == 60  # no hang, no early end
    assert "rank(s) 1 died" in report["worker_failure"][0]
    assert report["layers_committed"] == 1  # layer 0 committed, layer 1's transfer failed
    assert report["rearrangements_completed"] == 0


def test_real_model_runs_refuse_replay_options_and_bad_folders_before_any_process(tmp_path, capsys):
    code = main(["simulate", "--model", "qwen3-moe", "--format", "mxfp8", "--layers", "2", "--padded-size",
                 "300", "--fault", "view-skips-scale", "--out", str(tmp_path / "o")])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    assert "format=mxfp8: applies to --model replay only" in err
    assert "layers=2: applies to --model replay only" in err
    assert "fault=view-skips-scale: a quantized format's view list; applies to --model replay only" in err
    assert "padded size=300: one step is one sequence of that many tokens, the model has 256 positions" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["simulate", "--model", str(empty), "--out", str(tmp_path / "o")]) == 2
    assert f"model={empty}: neither a preset (deepseek-v3, qwen3-moe, mixtral, or replay) nor a folder" in (
        capsys.readouterr().err
    )
    (empty / "config.json").write_text("{}")
    assert main(["simulate", "--model", str(empty), "--out", str(tmp_path / "o")]) == 2
    assert f"model={empty}: the folder has no *.safetensors weights" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
