"""The public names of ascend_eplb.world, and that importing it imports no vLLM."""

import subprocess
import sys

import ascend_eplb.world as world
from ascend_eplb.testing.api import check_public_names


def test_all_is_the_documented_api():
    assert sorted(world.__all__) == sorted([
        "__version__",
        # checkpoints
        "ARCHITECTURES",
        "DESCRIPTION_FILE",
        "EXPERT_KEYS",
        "MTP_LAYERS_KEY",
        "VOCAB_SIZE",
        "CheckpointInfo",
        "add_mtp_layer",
        "checkpoint_experts",
        "checkpoint_format",
        "checkpoint_info",
        "checkpoint_tensors",
        "fit_routing_bias",
        "format_of_quant_type",
        "msmodelslim_quant_type",
        "to_format",
        "write_checkpoint",
        "write_quantized_experts",
        "write_tokenizer",
        # kernel_logs
        "KernelLog",
        "attach_kernel_log",
        "kernel_log",
        # compilation
        "COMPILATION_MODES",
        "COMPILE_BACKENDS",
        "compilation_error",
        "compilation_of",
        "is_compiled",
        # own_loop
        "RealModelRun",
        "RealModelSpec",
        "ServingWorker",
        "WorkerStep",
        "real_model_world",
        # rank_model
        "ParallelLayout",
        "build_model",
        "forward",
        "init_world",
        "load_model",
        "moe_layers",
        "parallel_layout",
        "prepare_world",
        "prompt",
        "routed_experts",
        # slots
        "checkpoint_expert_storage",
        "initial_physical_to_logical",
        "local_slot_mismatches",
        "slot_fingerprint_mismatches",
        # stand_ins
        "MOE_DISPATCHES",
        "STAND_INS",
        "cpu_all_gatherv",
        "cpu_reduce_scatterv",
        "grouped_expert_compute",
        "install_attention_stand_ins",
        "install_model_stand_ins",
        "install_stand_ins",
        "register_torch_moe_method",
        "stand_in_patches",
    ])  # fmt: skip
    check_public_names("ascend_eplb.world", "ascend-eplb-world")


def test_importing_the_world_imports_no_vllm():
    code = "import sys, ascend_eplb.world; print(sorted(m for m in sys.modules if m.startswith('vllm')))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"
