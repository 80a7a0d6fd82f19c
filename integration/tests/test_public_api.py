"""The public names of the serving product's modules (what vLLM Ascend imports)."""

import importlib

import pytest

from ascend_eplb.testing.api import check_public_names

API = {
    "ascend_eplb.integration": ["__version__"],
    "ascend_eplb.integration.plugin": ["ENV_SWITCH", "eplb_requested", "register"],
    "ascend_eplb.integration.switches": ["FALSE_VALUES", "PLUGIN_SWITCH", "TRUE_VALUES", "env_flag",
                                         "is_true"],
    "ascend_eplb.integration.patches": ["INSTANCE_BINDINGS", "PATCHES", "SURFACE", "applied_bindings",
                                        "apply_patches", "check_upstream", "patches_applied",
                                        "remove_patches"],
    "ascend_eplb.integration.surface": ["render"],
    "ascend_eplb.integration.upstream": ["ATTRIBUTES", "SIGNATURES", "SURFACE", "USERS",
                                         "WORKER_ERROR_ATTR"],
    "ascend_eplb.integration.settings": ["ASCEND_V2_KEYS", "COMPILATION_MODES", "CUDAGRAPH_MODES",
                                         "LOAD_COLLECTION_PHASES", "POLICY_KEYS",
                                         "SUPPORTED_COMMUNICATORS", "V1_EPLB_ENV_SWITCHES", "V1_EPLB_KEYS",
                                         "EplbSettings"],
    "ascend_eplb.integration.model_facts": ["EXPERT_COUNT_KEYS", "GROUP_KEYS", "LAYER_KEYS", "LAYER_SCHEMES",
                                            "MAX_REDUNDANT_EXPERTS", "TOP_K_KEYS", "ModelClass", "MoeFacts",
                                            "architectures_error",
                                            "experts_divisibility_error", "read_model_class",
                                            "read_moe_facts", "shown", "text_config"],
    "ascend_eplb.integration.rules": ["EPLB_OFF_RULES", "MOE_FACT_RULES", "RULES", "Judgement", "Rule",
                                      "Violation", "check_settings", "moe_fact_errors", "split_line"],
    "ascend_eplb.integration.settings_reader": ["ASCEND_SECTION", "FILE_SCHEMA", "V2_RUNNER_SWITCH",
                                                "additional_paths", "file_sections", "is_mtp",
                                                "optimization_level",
                                                "parallel_paths", "read_settings", "v2_runner_switch"],
    "ascend_eplb.integration.validation": ["ASCEND_QUANT_TYPES", "DTYPE_FORMATS", "EplbConfigError",
                                           "ascend_format_name", "experts_format",
                                           "quantization_format_name", "settings_from_vllm_config",
                                           "validate_eplb_config"],
    "ascend_eplb.integration.runner": ["Mrv2EplbWiring", "batch_has_prefill", "create_eplb_controller"],
    "ascend_eplb.integration.serving": ["Guardrails", "ServingSetup", "active_line",
                                        "build_serving_controller", "guardrails_of", "read_serving_setup"],
    "ascend_eplb.integration.guardrail_facts": ["DEFAULT_WORKER_TIMEOUT_S", "ENV_EVENTS", "ENV_METRICS",
                                                "ENV_MULTIPROC_DIR", "ENV_ON_WORKER_FAILURE", "ENV_VERIFY",
                                                "ENV_WORKER_TIMEOUT", "ON_FAILURE_POLICIES",
                                                "VERIFIER_CHECKS", "WATCHDOG_CHECK", "InFlightAtShutdown",
                                                "events_path", "metrics_requested", "read_serving_switches",
                                                "serving_switch_errors", "verify_requested",
                                                "watchdog_settings"],
    "ascend_eplb.integration.verify": ["EplbVerificationError", "EplbVerifier", "VerifierViolation"],
    "ascend_eplb.integration.watchdog": ["PATCHES", "EplbWorkerFailureError", "WorkerFailure",
                                         "WorkerWatchdog"],
    "ascend_eplb.integration.events.records": ["RECORD_KINDS", "CommitRecord", "InitialPlacementRecord",
                                               "RearrangementRealisedRecord", "RearrangementRecord", "Record",
                                               "RunStartRecord", "VerifierViolationRecord", "WindowRecord",
                                               "WorkerFailureRecord"],
    "ascend_eplb.integration.events.recorder": ["EventsRecord", "EventsRecorder", "EventsWriter"],
    "ascend_eplb.integration.events.reader": ["EventsFile", "RecordedLoad", "Run", "read_events"],
    "ascend_eplb.integration.placement_file": ["CONFIG_KEY", "FACTS", "FORMAT", "VERSION",
                                               "VERSION_MODELS", "Placement", "PlacementFileError",
                                               "assign_placements", "describe_mismatch", "dumps",
                                               "placement_from_map", "read_placement", "read_placements",
                                               "write_placement", "write_placements"],
    "ascend_eplb.integration.startup_placement": ["attach_startup_install"],
    "ascend_eplb.integration.prometheus": ["METRICS", "PrometheusMetrics"],
    "ascend_eplb.integration.metrics": ["bytes_moved", "bytes_received", "expert_bytes"],
    "ascend_eplb.integration.regular_files": ["CONFIG_FILE", "ENV_MAX_INPUT_MIB", "EVENTS_FILE", "LOAD_FILE",
                                              "MIB", "MODEL_CONFIG", "PLACEMENT_FILE", "ROUTING_TRACE",
                                              "FileKind", "RegularFileError", "input_limit", "max_input_mib",
                                              "open_for_append", "read_regular_file", "regular_file_problem",
                                              "writable_file_problem", "write_regular_file"],
    "ascend_eplb.integration.model_names": ["DRAFT_SUFFIX", "is_draft"],
}  # fmt: skip


@pytest.mark.parametrize("module", sorted(API))
def test_all_is_the_documented_api(module):
    mod = importlib.import_module(module)
    assert sorted(mod.__all__) == sorted(API[module])
    # Each name resolves to what the module defines (classes and functions: defined in the
    # integration, not re-exported from upstream); __version__ is the installed one.
    check_public_names(module, "ascend-eplb-integration")
