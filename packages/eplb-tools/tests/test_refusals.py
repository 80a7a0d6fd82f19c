"""What a new operator met (issue 31): every bad option of every subcommand is refused before anything
starts, exit 2, with its one line (an argparse error: that line and a pointer to ``--help``, not the
usage block), and without importing vLLM; ``simulate --help`` says what the main job is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ascend_eplb.tools.cli import main

#: Runs each argv through the CLI's ``main`` in one fresh interpreter: exit code and stderr of each,
#: and whether vLLM was imported by the end.
PROBE = """
import contextlib, io, json, sys
from ascend_eplb.tools.cli import main
out = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    out.append([code, err.getvalue()])
print(json.dumps({"results": out, "vllm": "vllm" in sys.modules}))
"""

QWEN = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_local_experts": 8,
    "num_experts_per_tok": 2, "num_hidden_layers": 2, "hidden_size": 64, "vocab_size": 128,
    "max_position_embeddings": 256, "torch_dtype": "float32",
}  # fmt: skip


#: A whole safetensors file of no tensor (what ``safetensors.torch.save_file({})`` writes): its header
#: alone, which the library opens.
NO_TENSORS = b"\x08\x00\x00\x00\x00\x00\x00\x00{}      "


def _probe(argvs: list[list[str]], **environ: str) -> dict:
    env = os.environ | {"VLLM_TARGET_DEVICE": "cpu", **environ}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(argvs)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _folder(root, name, **config):
    folder = root / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**QWEN, **config}))
    (folder / "model.safetensors").write_bytes(NO_TENSORS)  # its tensors never read: refused before
    return str(folder)


def _hint(command: str, line: str) -> list[str]:
    return [f"ascend-eplb {command}: error: {line}", f"ascend-eplb {command} --help lists the options"]


def _options(*lines: str) -> list[str]:
    return ["ascend-eplb simulate: error: invalid simulate options:", *(f"  - {line}" for line in lines)]


def test_every_bad_option_of_every_subcommand_is_refused_before_anything_with_its_lines(tmp_path):
    good = _folder(tmp_path, "good")
    bad = _folder(tmp_path, "bad", num_local_experts="8", num_experts_per_tok=0)
    half = _folder(tmp_path, "half", torch_dtype="bfloat16")
    load = tmp_path / "load.json"
    load.write_text("[[1, 2, 3, 4], [4, 3, 2, 1]]")
    out = str(tmp_path / "out")
    config = f"{bad}/config.json"
    sizes = tmp_path / "sizes.json"  # a --model-config: its E and K read by start-up's reader too
    sizes.write_text(json.dumps({**QWEN, "moe_intermediate_size": 32, "num_experts_per_tok": 9}))
    top_k = (
        f"{sizes}: num_experts_per_tok=9 must be an integer in [1, 8] (the routed experts each token "
        "selects, of E=8); fix: correct num_experts_per_tok"
    )
    empty = "an empty path; name the file or folder"
    cases = [
        # --out= deleted report.json, balancedness.png, events.jsonl, metrics.prom where it ran; every
        # path option of every subcommand has the same class
        (["simulate", "--out="], _hint("simulate", f"argument --out: '': {empty}")),
        (["simulate", "--model="], _hint("simulate", f"argument --model: '': {empty}")),
        (["simulate", "--model", "replay", "--trace="], _hint("simulate", f"argument --trace: '': {empty}")),
        (["simulate", "--model-config= "], _hint("simulate", f"argument --model-config: ' ': {empty}")),
        (["plan", "", "--ranks", "4"], _hint("plan", f"argument load: '': {empty}")),
        (["plan", str(load), "--ranks", "4", "--model-config="],
         _hint("plan", f"argument --model-config: '': {empty}")),
        (["plan", str(load), "--ranks", "4", "--export-expert-map="],
         _hint("plan", f"argument --export-expert-map: '': {empty}")),
        (["check", ""], _hint("check", f"argument config: '': {empty}")),
        # --link-gbps was accepted and ignored on a real model; --timeout -1 ended as a failed run (the
        # deadline passed before the options were judged): every numeric option and its neighbours
        (["simulate", "--model", good, "--link-gbps", "0", "--out", out],
         _options("link gbps=0.0: must be a finite number > 0 (Gbit/s)")),
        (["simulate", "--model", good, "--link-gbps", "-5", "--timeout", "-1", "--worker-timeout", "0",
          "--out", out],
         _options("timeout=-1.0: must be a finite number of seconds > 0",
                  "worker timeout=0.0: must be a finite number of seconds > 0",
                  "link gbps=-5.0: must be a finite number > 0 (Gbit/s)")),
        (["simulate", "--model", "replay", "--link-gbps", "0", "--timeout", "-1", "--out", out],
         _options("timeout=-1.0: must be a finite number of seconds > 0",
                  "link gbps=0.0: must be a finite number > 0 (Gbit/s)")),
        # the policy and the gain gate are judged with the other options, every bad one at once (each
        # was refused alone, as argparse read it, hiding the rest)
        (["simulate", "--model", "replay", "--policy", "bogus", "--min-balancedness-gain", "1",
          "--target-balancedness", "0", "--link-gbps", "0", "--out", out],
         _options("link gbps=0.0: must be a finite number > 0 (Gbit/s)",
                  "policy: additional_config.eplb_config.policy='bogus' is not one of ['default', "
                  "'migration_aware', 'split_aware']",
                  "min balancedness gain: additional_config.eplb_config.min_balancedness_gain=1.0 must be a "
                  "number in [0, 1) (a gain of balancedness, which lies in (0, 1]; 0 turns the check off)",
                  "target balancedness: additional_config.eplb_config.target_balancedness=0.0 must be a "
                  "number in (0, 1] (a balancedness; leave it unset to turn the check off)")),
        (["plan", str(load), "--ranks", "4", "--link-gbps", "0"],
         _hint("plan", "argument --link-gbps: '0': must be a finite number > 0")),
        # a model folder's MoE facts, every bad one at once (they crashed after the ranks started)
        (["simulate", "--model", bad, "--out", out],
         _options(f"{config}: num_local_experts='8' must be an integer in [1, 2147483647] (the routed "
                  "experts of each MoE layer; EPLB balances them); fix: state one routed-expert count, an "
                  "integer >= 1",
                  f"{config}: num_experts_per_tok=0 must be an integer in [1, E] (the routed experts each "
                  "token selects); fix: correct num_experts_per_tok")),
        (["plan", str(load), "--ranks", "4", "--model-config", str(sizes)],
         [f"ascend-eplb plan: error: {top_k}"]),
        (["simulate", "--model", "replay", "--model-config", str(sizes), "--out", out],
         _options(f"model config={sizes}: {top_k}")),
        # a compiled world (issue 35): a vLLM model class with float32 experts, one way to say it, a mode
        # and backend of vLLM's CPU platform
        (["simulate", "--model", "replay", "--compile", "eager", "--out", out],
         _options("compile=eager: applies to a real model only (the replay world runs the toy MoE model "
                  "eagerly, no vLLM model class to compile)")),
        (["simulate", "--model", half, "--compile", "inductor", "--out", out],
         _options("compile with format=bf16: a compiled world serves float32 experts (the CPU stand-in of "
                  "the 16-bit and quantized experts computes each selection on its own, with host reads)")),
        (["simulate", "--model", good, "--compile", "eager", "--compilation-config", '{"mode": 2}', "--out",
          out],
         _options("compile and compilation-config: give one (--compile eager is mode 2 with backend eager)")),
        (["simulate", "--model", good, "--compilation-config", '{"mode": 1}', "--out", out],
         _options("compilation-config: compilation_config mode=1 must be 0 (NONE), 2 (DYNAMO_TRACE_ONCE) or "
                  "3 (VLLM_COMPILE, vLLM's default: DYNAMO_TRACE_ONCE on CPU); 1 (STOCK_TORCH_COMPILE) is "
                  "compiled by vLLM's model runner, which the CPU world does not run")),
        (["simulate", "--model", good, "--compilation-config", "{mode", "--out", out],
         _options("compilation-config='{mode': not JSON (Expecting property name enclosed in double "
                  "quotes: line 1 column 2 (char 1))")),
        # found by a breaker: each reached the ranks and came back as one traceback per rank from vLLM's
        # config (a dict of inductor options; num_lookahead_tokens below max_num_batched_tokens)
        (["simulate", "--model", good, "--compilation-config",
          '{"mode": 2, "backend": "eager", "inductor_compile_config": 5}', "--out", out],
         _options("compilation-config: compilation_config inductor_compile_config=5 must be a mapping "
                  "(vLLM's CompilationConfig reads it as a dict of inductor options)")),
        (["simulate", "--model", good, "--speculative-tokens", "2048", "--out", out],
         _options("speculative tokens=2048: must be below vLLM's max_num_batched_tokens (2048, its "
                  "scheduler's default, which the world serves with): a step schedules each token with its N "
                  "draft tokens",
                  "speculative tokens=2048: the MTP draft needs a float32 DeepSeek-V3 checkpoint with its "
                  f"MTP layer; model {good} is Qwen3MoeForCausalLM in float32 with 0 MTP layer(s)",
                  "steps=48 with speculative tokens=2048: each request needs 2128 positions (16 prompt "
                  "tokens, 48 generated in a round, 2048 draft, 16 spare), the model has 256 "
                  "(max_position_embeddings)")),
        (["simulate", "--compile", "aot"],
         _hint("simulate", "argument --compile: invalid choice: 'aot' (choose from 'eager', 'inductor')")),
        # argparse's own errors: one line and the pointer, named by the subcommand
        (["simulate", "--no-such"], _hint("simulate", "unrecognized arguments: --no-such")),
        (["simulate", "--ranks", "x"], _hint("simulate", "argument --ranks: 'x': must be an integer >= 1")),
        (["check", "--num-experts", "0", "x.json"],
         _hint("check", "argument --num-experts: 0: must be >= 1")),
        # the ranks an events file records are its own; a matrix records none
        (["plan", str(load)],
         [f"ascend-eplb plan: error: ranks: give --ranks N, the EP ranks to plan for ({load} records none: a "
          "serving events file records the ranks it was served on)"]),
    ]  # fmt: skip
    probed = _probe([argv for argv, _ in cases])
    for (argv, lines), (code, err) in zip(cases, probed["results"], strict=True):
        assert (code, err.splitlines()) == (2, lines), argv
    assert probed["vllm"] is False  # every refusal came before the heavy import
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "bad",
        "good",
        "half",
        "load.json",
        "sizes.json",
    ]  # nothing written


def test_simulate_help_opens_with_the_main_job_and_marks_the_replay_only_options(capsys):
    from ascend_eplb.tools.cli import build_parser
    from ascend_eplb.tools.simulate.config import REPLAY_ONLY

    with pytest.raises(SystemExit) as info:
        main(["simulate", "--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    description = text.split(" options: ")[0]
    assert "The main job: serve vLLM's real DeepseekV3ForCausalLM" in description
    assert "through vLLM's own engine on CPU" in description
    assert "Replay real MoE routing" not in text
    actions = {a.dest: a for a in build_parser().subcommands["simulate"]._actions}
    marked = sorted(dest for dest, a in actions.items() if (a.help or "").startswith("--model replay only: "))
    assert marked == sorted(REPLAY_ONLY)
    assert {"num_moe_layers", "hidden_size", "sample_top_k"} <= set(
        marked
    )  # --layers, --hidden-size, --top-k
    assert text.count("--model replay only:") == len(REPLAY_ONLY)


def test_a_truncated_events_file_warns_in_one_line_under_simulate_too(tmp_path):
    """Issue 31: ``simulate --trace`` of an events file whose last line was cut printed a raw Python
    ``UserWarning`` with its source line; it is the tools' one warning line, as under ``plan``."""
    record = {
        "event": "window",
        "time": 0.0,
        "step": 1,
        "model": "m",
        "rearrangement": 1,
        "load": [[1, 2, 3, 4], [4, 3, 2, 1]],
        "balancedness": 1.0,
        "balancedness_eplb_off": 1.0,
    }
    line = json.dumps(record) + "\n"
    events = tmp_path / "events.jsonl"
    events.write_text(line + line[:25])
    refused = ["--model", "replay", "--trace", str(events), "--ranks", "3", "--redundant-experts", "1"]
    # plan with --export-expert-map read the file three times and printed the warning twice (issue 38).
    export = ["plan", str(events), "--ranks", "2", "--export-expert-map", str(tmp_path / "p.json")]
    probed = _probe(
        [["simulate", *refused, "--out", str(tmp_path / "o")], ["plan", str(events), "--ranks", "2"], export]
    )
    warning = f"{events}:2: truncated last line skipped (Unterminated string starting at)"
    (sim_code, sim_err), (plan_code, plan_err), (export_code, export_err) = probed["results"]
    assert (export_code, export_err.splitlines()) == (0, [f"ascend-eplb plan: warning: {warning}"])
    assert sim_code == 2
    assert sim_err.splitlines()[0] == f"ascend-eplb simulate: warning: {warning}"
    assert sim_err.splitlines()[1:3] == [
        "ascend-eplb simulate: error: invalid simulate options:",
        "  - redundant experts=1: logical experts (4) + num_redundant_experts (1) = 5 physical experts is "
        "not divisible by 3 EP ranks; fix: choose num_redundant_experts so that 4 + num_redundant_experts "
        "is a multiple of 3, e.g. 2",
    ]
    assert "UserWarning" not in sim_err
    assert plan_code == 0
    assert plan_err.splitlines() == [f"ascend-eplb plan: warning: {warning}"]


def test_plan_never_writes_over_what_it_reads_and_judges_every_option_it_is_given(tmp_path):
    """``plan events.jsonl --export-expert-map events.jsonl`` replaced the recorded events with the
    placement; ``--export-expert-map out/`` wrote a file called ``out``; ``--format w8a8`` (a typo) was
    accepted without ``--model-config``; ``check --`` with nothing, or another vLLM subcommand, after it
    was blamed on vLLM's parser."""
    load = tmp_path / "load.json"
    load.write_text("[[1, 2, 3, 4], [4, 3, 2, 1]]")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({**QWEN, "moe_intermediate_size": 32, "num_local_experts": 4})
    )
    plan = ["plan", str(load), "--ranks", "2"]
    overwrite = "writing it would destroy that input; fix: write to another file"
    formats = (
        "supported: bf16, fp16, w8a8_dynamic, w4a8_dynamic, mxfp8, mxfp4; known but rejected: w4a16, "
        "w4a16_mxfp4, w4a8_mxfp4"
    )
    after_dashes = "after -- comes a vllm serve command line (serve MODEL [options], as after 'vllm'), got"
    cases = [
        ([*plan, "--export-expert-map", str(load)],
         [f"ascend-eplb plan: error: export expert map={load}: is the file the load reads ({load}): "
          f"{overwrite}"]),
        ([*plan, "--model-config", str(model), "--export-expert-map", str(model / "config.json")],
         [f"ascend-eplb plan: error: export expert map={model / 'config.json'}: is the file --model-config "
          f"reads ({model / 'config.json'}): {overwrite}"]),
        ([*plan, "--export-expert-map", f"{tmp_path}/out/"],
         _hint("plan", f"argument --export-expert-map: '{tmp_path}/out/': ends with '/', a folder; name the "
                       "file to write")),
        ([*plan, "--format", "w8a8"],
         [f"ascend-eplb plan: error: unknown quantization format 'w8a8'; {formats}"]),
        (["check", "--"], [f"ascend-eplb check: error: {after_dashes} nothing"]),
        (["check", "--", "bench", "latency"], [f"ascend-eplb check: error: {after_dashes} bench latency"]),
    ]  # fmt: skip
    probed = _probe([argv for argv, _ in cases])
    for (argv, lines), (code, err) in zip(cases, probed["results"], strict=True):
        assert (code, err.splitlines()) == (2, lines), argv
    assert load.read_text() == "[[1, 2, 3, 4], [4, 3, 2, 1]]"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["load.json", "model"]  # nothing written
    assert sorted(p.name for p in model.iterdir()) == ["config.json"]


def test_check_takes_the_whole_vllm_command_pasted_after_the_dashes(tmp_path, capsys):
    """``ascend-eplb check -- vllm serve MODEL ...`` (the serving command copied whole) is judged as
    ``-- serve MODEL ...``."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN))
    serve = ["serve", str(model), "--enable-eplb", "--enable-expert-parallel", "-tp", "2", "--enforce-eager"]
    assert main(["check", "--", "vllm", *serve]) == 0
    pasted = capsys.readouterr().out.splitlines()
    assert main(["check", "--", *serve]) == 0
    assert pasted == capsys.readouterr().out.splitlines()
    assert pasted[:2] == [f"ascend-eplb check: vllm {' '.join(serve)}: OK", "ok"]


def test_simulate_lists_a_folders_missing_weights_with_every_bad_moe_fact_at_once(tmp_path):
    """A folder with a config.json but no weights stopped at the weights, hiding the config's bad MoE
    facts, which `check` lists together: `simulate` lists them all, with start-up's rules
    (``MoeFacts.errors``: the functions of ``rules.MOE_FACT_RULES``), before anything starts."""
    folder = tmp_path / "no-weights"
    folder.mkdir()
    config = folder / "config.json"
    config.write_text(json.dumps({**QWEN, "num_local_experts": "8", "num_experts_per_tok": 0,
                                  "mlp_only_layers": [0, 1]}))  # fmt: skip
    unstated = tmp_path / "unstated"
    unstated.mkdir()
    (unstated / "config.json").write_text(json.dumps({"architectures": ["Qwen3MoeForCausalLM"]}))
    (unstated / "model.safetensors").write_bytes(NO_TENSORS)
    out = str(tmp_path / "out")
    probed = _probe([["simulate", "--model", str(folder), "--out", out],
                     ["simulate", "--model", str(unstated), "--out", out]])  # fmt: skip
    assert probed["results"] == [
        [2, "\n".join(_options(
            f"model={folder}: the folder has no *.safetensors weights",
            f"{config}: num_local_experts='8' must be an integer in [1, 2147483647] (the routed experts of "
            "each MoE layer; EPLB balances them); fix: state one routed-expert count, an integer >= 1",
            f"{config}: num_experts_per_tok=0 must be an integer in [1, E] (the routed experts each token "
            "selects); fix: correct num_experts_per_tok",
            f"{config}: num_hidden_layers=2, mlp_only_layers=[0, 1] leave no MoE layer (vLLM 0.33.0 builds "
            "the model without routed experts: DeepSeek's with num_moe_layers=0, which upstream's "
            "EPLBController.maybe_register_model does not register, so it would be served without EPLB; "
            "Qwen3-MoE's and Mixtral's raise RuntimeError 'No ... layer found' on every rank while the model "
            "is built); fix: serve it without --enable-eplb, or correct num_hidden_layers, mlp_only_layers",
        )) + "\n"],
        [2, "\n".join(_options(
            f"{unstated / 'config.json'} states no routed-expert count (none of num_experts, "
            "moe_num_experts, n_routed_experts, num_local_experts); state it",
            f"{unstated / 'config.json'} states no top-k (none of num_experts_per_tok, "
            "num_experts_per_token, top_k_experts, moe_topk, moe_top_k, top_k); state it",
            f"{unstated / 'config.json'} states no decoder layer count (none of num_hidden_layers); state it",
        )) + "\n"],
    ]  # fmt: skip
    assert probed["vllm"] is False
    assert sorted(p.name for p in tmp_path.iterdir()) == ["no-weights", "unstated"]  # nothing written


def test_simulate_refuses_a_folder_whose_layers_or_class_it_cannot_read_naming_the_field(tmp_path):
    """The world read config.json a second way: ``architectures`` null or a string, a DeepSeek
    ``first_k_dense_replace`` of null and Qwen-MoE's ``mlp_only_layers`` of null reached it as Python
    errors ('cannot unpack non-iterable NoneType object', 'too many values to unpack'), and it ignored
    ``decoder_sparse_step``. It now reads start-up's facts; what they cannot say is named before a rank
    starts, and a null ``mlp_only_layers`` is [] (as transformers reads it)."""
    deepseek = {**QWEN, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}
    folders = {
        "arch-null": {**QWEN, "architectures": None},
        "arch-string": {**QWEN, "architectures": "Qwen3MoeForCausalLM"},
        "dense-null": {**deepseek, "first_k_dense_replace": None},
        "dense-unstated": deepseek,
        "llama4": {**QWEN, "architectures": ["Llama4ForCausalLM"]},
    }
    argv = []
    for name, config in folders.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        (tmp_path / name / "model.safetensors").write_bytes(NO_TENSORS)
        argv.append(["simulate", "--model", str(tmp_path / name), "--out", str(tmp_path / "out")])
    probed = _probe(argv)
    c = {name: tmp_path / name / "config.json" for name in folders}
    assert probed["results"] == [
        [2, "\n".join(_options(
            f"{c['arch-null']}: architectures names no model class (vLLM's registry raises 'No model "
            "architectures are specified'); fix: write \"architectures\": [\"<the model class>\"], e.g. "
            '["DeepseekV3ForCausalLM"]',
        )) + "\n"],
        [2, "\n".join(_options(
            f"{c['arch-string']}: architectures='Qwen3MoeForCausalLM' must be a list of model class names "
            "(vLLM's ModelConfig refuses anything else: 'Input should be a valid list'); fix: write "
            '"architectures": ["Qwen3MoeForCausalLM"]',
        )) + "\n"],
        [2, "\n".join(_options(
            f"{c['dense-null']}: first_k_dense_replace=None must be an integer >= 0 (the leading dense "
            "layers: vLLM's class compares layer_idx >= first_k_dense_replace and counts num_moe_layers = "
            "num_hidden_layers - first_k_dense_replace); fix: correct first_k_dense_replace",
        )) + "\n"],
        [2, "\n".join(_options(
            f"{c['dense-unstated']} states no first_k_dense_replace, so vLLM reads its config class's "
            "default (DeepseekV3Config's 3, Glm4MoeConfig's 1); state first_k_dense_replace in config.json",
        )) + "\n"],
        [2, "\n".join(_options(
            "architecture Llama4ForCausalLM: the MoE layers of its model class are not counted here (only "
            "those of DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, Glm4MoeForCausalLM, Qwen2MoeForCausalLM, "
            "Qwen3MoeForCausalLM, MixtralForCausalLM); vLLM counts them when it builds the model",
        )) + "\n"],
    ]  # fmt: skip
    assert probed["vllm"] is False


def test_a_stray_comma_a_file_in_the_way_and_a_folders_own_format_are_named_as_what_is_wrong(tmp_path):
    """Issue 38: ``plan --policies ,default`` dropped the empty entry (and ``--redundant-experts 0,,2``
    alike); ``--export-expert-map FILE/x/map.json`` said "the folder FILE/x does not exist" where a file
    is in the way; a float64 folder was refused as ``format='float64'`` though no ``--format`` was
    given, listing formats EPLB rejects as if they were accepted."""
    load = tmp_path / "load.json"
    load.write_text("[[1, 2, 3, 4], [4, 3, 2, 1]]")
    f64 = _folder(tmp_path, "f64", torch_dtype="float64")
    plan = ["plan", str(load), "--ranks", "2"]
    out = str(tmp_path / "out")
    served = "bf16, fp16, mxfp4, mxfp8, w4a8_dynamic, w8a8_dynamic"
    cases = [
        ([*plan, "--policies", ",default"],
         _hint("plan", "argument --policies: ',default': entry 1 of 2 is empty (a stray comma); give e.g. "
                       "default,migration_aware")),
        ([*plan, "--redundant-experts", "0,,2,"],
         _hint("plan", "argument --redundant-experts: '0,,2,': entries 2 and 4 of 4 are empty (a stray "
                       "comma); give e.g. 0,8,16")),
        ([*plan, "--export-expert-map", f"{load}/x/map.json"],
         [f"ascend-eplb plan: error: export expert map={load}/x/map.json: {load} is a file, not a folder: "
          "nothing can be written under it"]),
        ([*plan, "--export-expert-map", f"{tmp_path}/missing/map.json"],
         [f"ascend-eplb plan: error: export expert map={tmp_path}/missing/map.json: the folder "
          f"{tmp_path}/missing does not exist; fix: create it first"]),
        (["simulate", "--model", f64, "--out", out],
         _options(f"model={f64}: its experts are float64 (its quant_model_description.json or dtype, as "
                  "start-up reads it), a format simulate cannot serve: it must be float32 or a format EPLB "
                  f"supports ({served})")),
        (["simulate", "--model", f64, "--format", "float64", "--out", out],
         _options(f"format='float64': must be float32 or a format EPLB supports ({served})")),
    ]  # fmt: skip
    probed = _probe([argv for argv, _ in cases])
    for (argv, lines), (code, err) in zip(cases, probed["results"], strict=True):
        assert (code, err.splitlines()) == (2, lines), argv
    assert probed["vllm"] is False
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f64", "load.json"]  # nothing written


def test_the_cache_variable_empty_is_unset_and_a_file_or_unreachable_path_is_refused(tmp_path, monkeypatch):
    """Issue 38: ``ASCEND_EPLB_CACHE`` set to a file or an unreachable path gave a ``NotADirectoryError``
    traceback; set empty, the preset was written (and refitted) into the current folder."""
    from ascend_eplb.tools.simulate.models import cache_folder

    default = Path.home() / ".cache" / "ascend-eplb" / "models"
    for empty in ("", "  "):
        monkeypatch.setenv("ASCEND_EPLB_CACHE", empty)
        assert cache_folder() == default
    monkeypatch.setenv("ASCEND_EPLB_CACHE", str(tmp_path / "cache"))
    assert cache_folder() == tmp_path / "cache" / "models"
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    out = str(tmp_path / "out")
    fix = "set ASCEND_EPLB_CACHE to a writable folder, or unset it for ~/.cache/ascend-eplb"
    for cache in (a_file, a_file / "below"):
        probed = _probe([["simulate", "--out", out]], ASCEND_EPLB_CACHE=str(cache))
        assert probed["results"] == [[2, "\n".join(_options(
            f"ASCEND_EPLB_CACHE={cache}: cannot write the preset deepseek-v3-v3 under {cache}/models "
            f"({a_file} is a file, not a folder); {fix}"
        )) + "\n"]]  # fmt: skip
        assert probed["vllm"] is False
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # nothing written


def test_simulate_never_starts_from_an_output_it_would_remove_first(tmp_path):
    """Issue 43 case 3: ``simulate --initial-placement OUT/events.jsonl --out OUT`` (starting from the last
    run's recording): validation read it, the run emptied OUT, the ranks refused "no such file", and the
    recording was gone. Any input that is one of the run's outputs (or a link to one) is refused before
    anything changes, the file and the folder as they were."""
    from ascend_eplb.tools.simulate import driver
    from ascend_eplb.tools.simulate.config import RUN_OUTPUTS

    assert driver.RUN_OUTPUTS is RUN_OUTPUTS  # the driver's outputs are the ones judged here
    out = tmp_path / "out"
    out.mkdir()
    recorded = out / "events.jsonl"
    window = {"event": "window", "time": 0.0, "step": 3, "model": "m", "rearrangement": 1,
              "load": [[5, 1, 1, 1]], "balancedness": 1.0, "balancedness_eplb_off": 1.0}  # fmt: skip
    recorded.write_text(json.dumps(window) + "\n")
    (out / "report.json").write_text("{}")
    link = tmp_path / "last.jsonl"
    link.symlink_to(recorded)
    for given, flag in (
        (recorded, "--initial-placement"),
        (link, "--initial-placement"),
        (recorded, "--trace"),
    ):
        code, err = _probe([["simulate", "--model", "replay", flag, str(given), "--out", str(out)]])[
            "results"
        ][0]
        name = flag.removeprefix("--").replace("-", " ")
        copy = tmp_path / "last-events.jsonl"
        line = (
            f"  - {name}={given}: is {recorded}, an output of this run, which removes it before its ranks "
            f"start and writes its own; fix: copy it out of --out first (e.g. cp {recorded} {copy}) and name "
            "the copy, or give another --out"
        )
        assert code == 2
        assert line in err.splitlines(), err
    assert recorded.read_text() == json.dumps(window) + "\n"
    assert sorted(p.name for p in out.iterdir()) == ["events.jsonl", "report.json"]


def test_simulate_judges_a_compilation_config_by_vllms_config_and_start_ups_rule_before_any_rank(tmp_path):
    """Issue 43 case 8: these passed option validation and every rank then crashed with a traceback, 48-64 s
    in (a pydantic error, an inductor RuntimeError); inductor freezing was refused by the ranks after 63 s
    though ``check`` refuses it at once. vLLM's own ``CompilationConfig`` and start-up's ``compiled-forward``
    rule (the function every rank runs) judge them now, before anything starts."""
    good = _folder(tmp_path, "good")
    out = str(tmp_path / "out")
    sim = ["simulate", "--model", good, "--out", out, "--compilation-config"]
    freezing = (
        "[compiled-forward] inductor freezing (compilation_config.inductor_compile_config freezing, or "
        "TORCHINDUCTOR_FREEZING=1) folds the expert weights into the compiled code as constants, so the "
        "weights EPLB moves in place would never be read again; fix: turn freezing off"
    )
    cases = [
        ([*sim, '{"mode": 3, "backend": "foo"}'],
         _options("compilation-config: vLLM's CompilationConfig refuses {\"mode\": 3, \"backend\": \"foo\"}: "
                  "Value error, Invalid backend for piecewise compilation: foo")),
        ([*sim, '{"mode": 3, "inductor_compile_config": {"max_autotune_nope": true}}'],
         _options("compilation-config: [compiled-forward] compilation_config.inductor_compile_config names "
                  "'max_autotune_nope', which torch's inductor has no option of (torch._inductor.config): "
                  "every rank's first compile would fail; fix: correct or remove them")),
        ([*sim, '{"mode": 2, "backend": "inductor", "inductor_compile_config": {"freezing": true}}'],
         _options(f"compilation-config: {freezing}")),
    ]  # fmt: skip
    probed = _probe([argv for argv, _ in cases])
    for (argv, lines), (code, err) in zip(cases, probed["results"], strict=True):
        assert (code, err.splitlines()) == (2, lines), argv
    # The environment's switch, which the ranks inherit, as start-up reads it.
    probed = _probe(
        [["simulate", "--model", good, "--out", out, "--compile", "inductor"]], TORCHINDUCTOR_FREEZING="1"
    )
    assert probed["results"] == [[2, "\n".join(_options(f"compile: {freezing}")) + "\n"]]
    assert not (tmp_path / "out").exists()


def test_simulate_refuses_an_empty_or_truncated_safetensors_file_in_one_line(tmp_path):
    """Issue 43 case 10: a truncated or empty ``model.safetensors`` in a ``--model`` folder: each rank's
    127-line traceback, exit 1 (the README promises one line and exit 2 for a corrupt input)."""
    import torch
    from safetensors.torch import save_file

    whole = tmp_path / "whole.safetensors"
    save_file({"w": torch.zeros(64)}, str(whole))
    data = whole.read_bytes()
    argv = []
    for name, content in (("empty", b""), ("truncated", data[:-10])):
        folder = _folder(tmp_path, name)
        (Path(folder) / "model.safetensors").write_bytes(content)
        argv.append(["simulate", "--model", folder, "--out", str(tmp_path / "out")])
    probed = _probe(argv)
    said = {
        "empty": "Error while deserializing header: header too small; 0 bytes",
        "truncated": f"Error while deserializing header: incomplete metadata, file not fully covered; "
        f"{len(data) - 10} bytes",
    }
    assert probed["results"] == [
        [2, "\n".join(_options(
            f"model={tmp_path / name}: model.safetensors is not a whole safetensors file ({said[name]}: "
            "empty or truncated?); fix: copy the checkpoint again"
        )) + "\n"]
        for name in ("empty", "truncated")
    ]  # fmt: skip
    assert not (tmp_path / "out").exists()


def test_simulate_refuses_more_redundant_experts_than_upstream_takes(tmp_path):
    """Issue 43: ``--redundant-experts 1024`` passed every rule and upstream's ``EplbState.add_model``
    asserted on every rank (it takes at most 1023)."""
    out = str(tmp_path / "out")
    probed = _probe([["simulate", "--model", "replay", "--redundant-experts", "1024", "--out", out]])
    assert probed["results"] == [[2, "\n".join(_options(
        "redundant experts=1024: must be <= 1023 (upstream's EplbState.add_model asserts "
        "num_redundant_experts <= 1023)"
    )) + "\n"]]  # fmt: skip
