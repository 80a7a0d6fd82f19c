"""The operators' loop of the README through vLLM's own engine: record, plan, serve from the placement.

Qwen3-MoE at TP=2 x EP=2, async EPLB through the plugin, verifier on, the gain gate on
(``min_balancedness_gain``). An engine records its events file (``ASCEND_EPLB_EVENTS``) on upstream's
initial placement; ``ascend-eplb plan EVENTS --ranks 2 --export-expert-map F`` exports a placement for the
recorded configuration; a second engine started with ``eplb_config.initial_placement: F`` holds it from
the first step (maps, every slot's weights), serves the same outputs, records its first window balanced as
``plan`` predicted, and the gate keeps the placement (no gain left). One request at a time
(``max_num_seqs=1``): both engines run the same steps, so their first windows hold the same load.
"""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from ascend_eplb.control.measures import mean_balancedness, rank_loads
from ascend_eplb.integration import placement_file as pf
from ascend_eplb.testing import load_module
from ascend_eplb.tools import cli
from ascend_eplb.world.checkpoints import checkpoint_info, write_checkpoint
from ascend_eplb.world.engine import probes
from ascend_eplb.world.engine.host import Completion, EngineWorld
from ascend_eplb.world.engine.spec import EngineSpec, EplbSpec

# Cross-package: the engine tests' judging is integration's.
judging = load_module(Path(__file__).resolve().parents[1] / "integration/tests/engine_judging.py")
PROMPTS = [[(5 * i + 3 * j + 2) % 128 for j in range(24 - 4 * i)] for i in range(4)]
MAX_TOKENS = 6
#: Window = interval 32: upstream starts its counter at 3/4 of it, so the first rearrangement comes 8 steps
#: after registration (the warm-up's dummy steps, then the first prompt's prefill and decodes) and the next
#: after the round: one window with load per engine.
WINDOW = 32
GATE = {"min_balancedness_gain": 0.01}

pytestmark = [
    pytest.mark.multirank,
    pytest.mark.timeout(900),
]


@dataclass
class Run:
    """One engine's run: its outputs, events records, observer records and EPLB state at start and end."""

    outputs: list[Completion]
    records: list[dict[str, Any]]
    observed: list[dict[str, Any]]
    start: list[dict[str, Any]]
    start_slots: list[dict[str, list[str]]]
    end: list[dict[str, Any]]


@dataclass
class Loop:
    folder: Path
    info: Any
    recorded: Run
    placement_path: Path
    plan_output: str
    served: Run


def _serve(folder: Path, root: Path, name: str, ascend: dict[str, Any]) -> Run:
    events = root / f"{name}.jsonl"
    eplb = EplbSpec(
        window_size=WINDOW, step_interval=WINDOW, num_redundant_experts=2, ascend={**GATE, **ascend}
    )
    env = {
        "ASCEND_EPLB_VERIFY": "1",
        "ASCEND_EPLB_ON_WORKER_FAILURE": "raise",
        "ASCEND_EPLB_EVENTS": str(events),
    }
    with EngineWorld(EngineSpec(str(folder), eplb=eplb, max_num_seqs=1), root / name, env=env) as engine:
        engine.run_on_workers(probes.observe, str(folder))
        start = engine.run_on_workers(probes.eplb_state)
        start_slots = engine.run_on_workers(probes.slot_mismatches, str(folder))
        outputs = engine.generate(PROMPTS, max_tokens=MAX_TOKENS)
        observed = engine.run_on_workers(probes.observed)
        end = engine.run_on_workers(probes.eplb_state)
    records = [json.loads(line) for line in events.read_text().splitlines()]
    return Run(outputs, records, observed, start, start_slots, end)


@pytest.fixture(scope="module")
def loop(tmp_path_factory) -> Loop:
    # Short folder names: vLLM's IPC sockets live in each engine's TMPDIR, a Unix socket path holds at most
    # 107 characters, and pytest-xdist's base folder is long already.
    root = tmp_path_factory.mktemp("placement")
    folder = write_checkpoint("qwen3-moe", root / "model", seed=0)
    recorded = _serve(folder, root, "rec", {})
    placement_path = root / "placement.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = cli.main(
            ["plan", str(root / "rec.jsonl"), "--ranks", "2", "--export-expert-map", str(placement_path)]
        )
    assert status == 0, out.getvalue()
    served = _serve(folder, root, "srv", {"initial_placement": str(placement_path)})
    return Loop(folder, checkpoint_info(folder), recorded, placement_path, out.getvalue(), served)


def _windows(run: Run) -> list[dict[str, Any]]:
    return [r for r in run.records if r["event"] == "window"]


def _predicted(loop: Loop) -> float:
    """What ``plan`` predicted: the exported placement's balancedness on the recorded window's load."""
    load = torch.tensor(_windows(loop.recorded)[0]["load"], dtype=torch.float64)
    chosen = torch.tensor(pf.read_placement(loop.placement_path).physical_to_logical_map)
    return mean_balancedness(rank_loads(load, chosen, 2))


def test_plan_exports_the_recorded_windows_placement_for_the_recorded_configuration(loop):
    e, layers = loop.info.num_logical_experts, loop.info.num_moe_layers
    windows = _windows(loop.recorded)
    assert [(w["rearrangement"], w["num_ranks"], w["num_physical_experts"]) for w in windows] == [
        (1, 2, e + 2)
    ]
    placement = pf.read_placement(loop.placement_path)
    assert placement.facts() == {
        "num_moe_layers": layers, "num_logical_experts": e, "num_physical_experts": e + 2, "num_ranks": 2,
    }  # fmt: skip
    assert json.loads(loop.placement_path.read_text())["source"]["load"] == str(
        loop.placement_path.parent / "rec.jsonl"
    )
    assert "num_redundant_experts=2 (the recorded configuration" in loop.plan_output
    assert (
        f"balancedness on its load {_predicted(loop):.4f} (upstream's initial placement: " in loop.plan_output
    )


def test_the_server_holds_the_placement_from_its_first_step_with_every_slot_holding_its_expert(loop):
    model, layers = str(loop.folder), loop.info.num_moe_layers
    chosen = [list(row) for row in pf.read_placement(loop.placement_path).physical_to_logical_map]
    # Upstream's state on every rank before the first request, and every local slot's weights.
    assert [s["placements"] for s in loop.served.start] == [{model: chosen}] * 2
    assert loop.served.start_slots == [{model: []}] * 2
    # Upstream's initial placement where nothing was installed.
    assert loop.recorded.start[0]["placements"][model] != chosen
    records = loop.served.records
    (install,) = [r for r in records if r["event"] == "initial_placement"]
    assert install["placement"] == chosen
    assert (install["source"], install["num_ranks"], install["num_logical_experts"]) == (
        str(loop.placement_path), 2, loop.info.num_logical_experts,
    )  # fmt: skip
    assert install["layers_changed"] == layers
    assert install["experts_moved"] > 0
    assert install["bytes_received"] > 0
    assert records.index(install) < min(i for i, r in enumerate(records) if r["event"] == "window")
    for rank in loop.served.observed:
        assert rank["commits"]
        assert [c["mismatches"] for c in rank["commits"]] == [[] for _ in rank["commits"]]


def test_it_starts_balanced_as_planned_and_the_gain_gate_keeps_the_placement(loop):
    model = str(loop.folder)
    (recorded,), (served,) = _windows(loop.recorded), _windows(loop.served)
    # The same steps route the same tokens: the first window's load is the recorded one, and under the
    # installed placement its balancedness is what plan predicted, beside upstream's initial placement's.
    assert served["load"] == recorded["load"]
    assert served["balancedness"] == pytest.approx(_predicted(loop), abs=1e-12)
    assert served["balancedness_eplb_off"] == pytest.approx(recorded["balancedness"], abs=1e-12)
    assert served["balancedness"] > recorded["balancedness"]
    # The gate: on upstream's initial placement the policy's placement gained more than the threshold and
    # moved; on the planned placement it gains nothing, so nothing moves and the placement stays.
    (moved,), (kept,) = (
        [d for _, n, d in run.observed[0]["decisions"] if n == 1] for run in (loop.recorded, loop.served)
    )
    assert moved["skipped"] is None
    assert moved["balancedness_planned"] - moved["balancedness_before"] >= GATE["min_balancedness_gain"]
    assert moved["experts_moved"] > 0
    assert kept["skipped"] == "min_gain"
    assert kept["balancedness_before"] == pytest.approx(served["balancedness"], abs=1e-12)
    assert kept["experts_moved"] == 0
    for run in (loop.recorded, loop.served):
        assert all(rank["decisions"] == run.observed[0]["decisions"] for rank in run.observed)
    (skipped,) = [r for r in loop.served.records if r["event"] == "rearrangement"]
    assert (skipped["skipped"], skipped["experts_moved"], skipped["layers_changed"]) == ("min_gain", 0, 0)
    chosen = [list(row) for row in pf.read_placement(loop.placement_path).physical_to_logical_map]
    assert [s["placements"] for s in loop.served.end] == [{model: chosen}] * 2


def test_both_engines_serve_the_same_outputs_as_hf(loop):
    for got, want in zip(loop.served.outputs, loop.recorded.outputs, strict=True):
        assert judging.judge(got, want) <= 1.0
    for prompt, completion in zip(PROMPTS, loop.served.outputs, strict=True):
        greedy, reference = judging.hf_reference(loop.folder, prompt, completion)
        assert greedy == list(completion.token_ids)
        assert judging.judge(completion, reference) <= 1.0
