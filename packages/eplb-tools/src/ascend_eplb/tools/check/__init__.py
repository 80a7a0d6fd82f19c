"""``ascend-eplb check``: the forms an operator has, read and judged by start-up validation's rules.

:func:`check_config_file` (this package's JSON schema, or a ``vllm serve --config`` YAML/JSON) and
:func:`check_serve_command` (a ``vllm serve`` command line) read their input into the rules'
:class:`~ascend_eplb.integration.settings.EplbSettings` and judge it with the integration's one rules
function, :func:`ascend_eplb.integration.rules.check_settings`, the one start-up validation runs.

Modules: ``schema`` (this package's config-file schema), ``engine_args`` (vLLM's ``vllm serve`` parser
and engine arguments), ``model_folder`` (a local model folder's facts), ``report`` (the result and the
text ``check`` prints). YAML and vLLM's argument parser are imported here, in the tools, never by the
serving package; ``engine_args`` (vLLM) only when a serve command line or a ``--config`` file is judged.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from ascend_eplb.control.values import INT32_MAX, is_int
from ascend_eplb.integration import json_text
from ascend_eplb.integration.guardrail_facts import serving_switch_errors
from ascend_eplb.integration.model_facts import shown
from ascend_eplb.integration.regular_files import CONFIG_FILE, RegularFileError, read_regular_file
from ascend_eplb.integration.rules import Judgement, Violation, check_settings
from ascend_eplb.integration.settings import EplbSettings
from ascend_eplb.integration.settings_reader import V2_RUNNER_SWITCH, v2_runner_switch
from ascend_eplb.integration.validation import EplbConfigError, ascend_format_name
from ascend_eplb.tools.check.config_text import load_yaml
from ascend_eplb.tools.check.report import CheckResult, refused, result
from ascend_eplb.tools.check.schema import is_engine_args, settings_from_file_dict

__all__ = ["check_config_file", "check_serve_command"]


def check_config_file(
    path: str | os.PathLike[str],
    environ: Mapping[str, str] | None = None,
    *,
    num_experts: int | None = None,
    quantization: str | None = None,
) -> CheckResult:
    """Validate a config file: this package's JSON schema, or a ``vllm serve --config`` YAML/JSON.

    The form is told by content: the schema (README) has a nested ``parallel_config``, a ``model`` object
    or only schema keys; anything else is a flat mapping of vLLM engine arguments, read by vLLM's own
    ``--config`` handling and parser (``engine_args.parse_serve_command``, ``settings_from_engine_args``).
    ``.yaml``/``.yml`` is read as YAML, anything else as JSON. ``environ`` (default ``os.environ``)
    supplies the V1 switches and ``VLLM_USE_V2_MODEL_RUNNER``; ``num_experts`` and ``quantization`` (a
    format name) win over the file's model facts. Returns ``CheckResult(ok, report, violations,
    resolved, unjudged)``, which unpacks as ``ok, report``.

    Never raises on the file: whatever is wrong with it (unreadable, malformed, an argument vLLM's parser
    rejects, an unreadable model folder, anything unforeseen) is a violation (``schema``, ``engine-args``
    or ``model-folder``) naming the file and the cause; only ``KeyboardInterrupt`` passes through.

    Raises:
        ValueError: ``num_experts`` is not an int in ``[1, INT32_MAX]`` or ``quantization`` is not a str.
    """
    _check_fact_options(num_experts, quantization)
    name = os.fspath(path)
    form = "YAML" if str(name).lower().endswith((".yaml", ".yml")) else "JSON"
    try:
        raw = read_regular_file(path, CONFIG_FILE)
    except RegularFileError as exc:
        return refused("schema", f"cannot read {name!r} as a config file: {exc.reason}")
    try:
        text = raw.decode("utf-8")
        if not raw.strip():
            return refused("schema", f"{name!r}: empty file, not a config")
        data = load_yaml(text) if form == "YAML" else json_text.loads(text)
    except (Exception, RecursionError, MemoryError) as exc:
        return refused("schema", f"cannot read {name!r} as {form}: {type(exc).__name__}: {exc}")
    if data is None:
        return refused(
            "schema",
            f"{name!r}: holds {form} null, not a config (a mapping of settings: the schema's or vLLM's "
            "engine arguments)",
        )
    try:
        if is_engine_args(data):
            return _check_engine_args_file(name, data, environ, num_experts, quantization)
        settings, violations = settings_from_file_dict(data, environ)
        settings = _with_fact_options(settings, num_experts, quantization)
        return result(settings, _judge(settings, environ, violations))
    except Exception as exc:  # a structure no schema rule foresaw is still a schema violation
        return refused(
            "schema", f"{name!r} is not a config of the documented structure ({type(exc).__name__}: {exc})"
        )


def _judge(
    settings: EplbSettings, environ: Mapping[str, str] | None, violations: Sequence[Violation] = ()
) -> Judgement:
    """The file's own violations, then the start-up rules, then the serving switches start-up reads
    (``ASCEND_EPLB_VERIFY``, ``_EVENTS``, ``_METRICS``, ``_WORKER_TIMEOUT_S``, ``_ON_WORKER_FAILURE``)."""
    judged = check_settings(settings)
    if not settings.enable_eplb:
        return Judgement([*violations, *judged], judged.unjudged)
    switches = [Violation("serving-switches", message) for message in serving_switch_errors(environ)]
    return Judgement([*violations, *judged, *switches], judged.unjudged)


def _check_fact_options(num_experts: object, quantization: object) -> None:
    if num_experts is not None and not (is_int(num_experts) and 1 <= num_experts <= INT32_MAX):
        raise ValueError(f"num_experts={num_experts!r} must be an integer in [1, {INT32_MAX}] (or None)")
    if quantization is not None and not isinstance(quantization, str):
        raise ValueError(f"quantization={quantization!r} must be a format name (a str, or None)")


def _with_fact_options(s: EplbSettings, num_experts: int | None, quantization: str | None) -> EplbSettings:
    if num_experts is not None:
        s.num_logical_experts = num_experts
        s.unknown_facts.pop("num_logical_experts", None)
    if quantization is not None and quantization.lower() != "ascend":
        s.quantization = ascend_format_name(quantization)
        s.unknown_facts.pop("quantization", None)
    return s


def _check_engine_args_file(
    name: str,
    data: Mapping[str, Any],
    environ: Mapping[str, str] | None,
    num_experts: int | None,
    quantization: str | None,
) -> CheckResult:

    with tempfile.TemporaryDirectory(prefix="ascend-eplb-check-") as tmp:
        # vLLM's --config reads YAML files only, and reads the file again: the values read here (a JSON
        # file's as JSON read them; its text as YAML 1.1 would differ, e.g. tabs, 1e3) go as YAML in a copy,
        # so that vLLM opens no file the one reader did not judge.
        config = os.path.join(tmp, "engine_args.yaml")
        Path(config).write_text(yaml.safe_dump(dict(data)), encoding="utf-8")
        # Without model: in the file, the model is unknown (vLLM's --config wants one: an empty one).
        argv = ["serve", "--config", config] if "model" in data else ["serve", "", "--config", config]
        return check_serve_command(
            argv, environ, num_experts=num_experts, quantization=quantization, source=name
        )


def _parser_error(stderr: str) -> str:
    """argparse's ``PROG: error: MESSAGE`` and the lines after it (a pydantic error names the field and
    the value there), joined with ``"; "``; pydantic's documentation links left out."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if ": error: " in ln), max(len(lines) - 1, 0))
    return "; ".join(ln for ln in lines[start:] if not ln.startswith("For further information visit "))


def check_serve_command(
    argv: Sequence[str],
    environ: Mapping[str, str] | None = None,
    *,
    num_experts: int | None = None,
    quantization: str | None = None,
    source: str | None = None,
) -> CheckResult:
    """Validate a ``vllm serve`` command line (``argv`` after ``vllm``: ``serve MODEL --enable-eplb ...``).

    The arguments go through vLLM's own parser (``engine_args.parse_serve_command``, ``--config FILE``
    included) and ``engine_args.settings_from_engine_args``; ``environ``, ``num_experts`` and
    ``quantization`` as for :func:`check_config_file`; ``source`` names the input in messages.

    Never raises on the command line (an interrupt aside): an argument vLLM's parser rejects is an
    ``engine-args`` violation quoting vLLM's message (``vllm serve: error: unrecognized arguments:
    --bogus``); an unreadable model folder a ``model-folder`` violation.

    Raises:
        ValueError: ``num_experts`` or ``quantization`` as for :func:`check_config_file`.
    """
    _check_fact_options(num_experts, quantization)
    # local: vLLM only for a serve command line (`check` on a schema file imports none)
    from ascend_eplb.tools.check import engine_args as serve

    where = source or "the command line"
    for config in _config_files(argv):
        try:
            load_yaml(read_regular_file(config, CONFIG_FILE).decode("utf-8"))
        except RegularFileError as exc:
            return refused("engine-args", f"{where}: --config {config}: {exc.reason}")
        except (Exception, RecursionError) as exc:
            return refused("engine-args", f"{where}: --config {config}: cannot read it as YAML: {exc}")
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            engine_args = serve.parse_serve_command(argv)
    except SystemExit as exc:
        said = _parser_error(err.getvalue()) or f"vLLM's parser exited with status {exc.code}"
        return refused("engine-args", f"{where}: vLLM's parser rejects the engine arguments: {said}")
    except Exception as exc:
        return refused(
            "engine-args", f"{where}: vLLM's parser rejects the engine arguments: {type(exc).__name__}: {exc}"
        )
    found = [Violation("engine-args", f"{where}: {p}") for p in serve.engine_args_problems(engine_args)]
    if found:  # vLLM would refuse them before building anything: nothing else is judged on them
        return CheckResult(False, str(EplbConfigError(found)), tuple(found))
    env = dict(os.environ if environ is None else environ)
    violations = _additional_config_violations(engine_args, where)
    _, v2_error = v2_runner_switch(env)
    if v2_error is not None:
        violations.append(v2_error)
        env.pop(V2_RUNNER_SWITCH)  # judged: the other rules read the default (V2)
    try:
        settings = serve.settings_from_engine_args(
            engine_args, env, num_experts=num_experts, quantization=quantization
        )
    except EplbConfigError as exc:
        return CheckResult(False, str(exc), (*violations, *exc.violations))
    except Exception as exc:
        return refused("model-folder", f"{where}: {exc}")
    return result(settings, _judge(settings, env, violations))


def _config_files(argv: Sequence[str]) -> list[str]:
    """The files a ``vllm serve`` command line names with ``--config`` (``--config F``, ``--config=F``),
    which vLLM's parser opens and reads: judged by the one reader before it does."""
    out = []
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            out.append(argv[i + 1])
        elif arg.startswith("--config="):
            out.append(arg.split("=", 1)[1])
    return out


def _additional_config_violations(engine_args: Any, where: str) -> list[Violation]:
    """``engine-args`` violations of an ``additional_config`` that is not a JSON object, or whose
    ``eplb_config`` is not one; ``engine_args`` is left without the bad part, so that every other rule is
    still judged. vLLM's parser keeps a ``--additional-config`` value that is not a JSON object (``[1]``,
    a JSON text cut short) as a str; read as the Ascend keys, it was reported as ``[model-folder]
    additional_config.eplb_config must be a mapping, got str``."""
    additional = engine_args.additional_config
    if additional is None or isinstance(additional, Mapping):
        ascend = (additional or {}).get("eplb_config")
        if ascend is None or isinstance(ascend, Mapping):
            return []
        engine_args.additional_config = {k: v for k, v in additional.items() if k != "eplb_config"}
        return [
            Violation(
                "engine-args",
                f"{where}: additional_config.eplb_config={shown(ascend)} must be a JSON object (of the "
                f"Ascend keys), got {type(ascend).__name__}; fix: --additional-config "
                '\'{"eplb_config": {"policy": "migration_aware"}}\'',
            )
        ]
    why = type(additional).__name__
    if isinstance(additional, str):
        try:
            why = f"JSON of a {type(json.loads(additional)).__name__}"
        except ValueError as exc:
            why = f"not JSON ({exc})"
    engine_args.additional_config = {}
    return [
        Violation(
            "engine-args",
            f"{where}: additional_config={shown(additional)} must be a JSON object, got {why}; fix: "
            "--additional-config '{\"eplb_config\": {...}}'",
        )
    ]
