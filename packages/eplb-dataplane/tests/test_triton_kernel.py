"""The Triton kernel, run on CPU under Triton's interpreter, against the torch form: bit-identical.

``triton.jit`` reads ``TRITON_INTERPRET`` when the kernel is defined, so the Triton side runs in one
subprocess (``triton_worker.py``, started once per module) with ``TRITON_INTERPRET=1``; this process
(plain triton, no interpreter) runs the torch form, the loop reference and the fake implementation
on the same inputs. Triton is a dependency of this test environment: without it the worker exits 3
and every test here fails (none skips).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ascend_eplb.dataplane import _triton, map_to_physical, map_to_physical_and_record, ops

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import kernel_cases  # noqa: E402

sys.path.remove(str(HERE))

CASES = kernel_cases.equality_cases()
SPLIT_CASES = kernel_cases.split_cases()


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    out = tmp_path_factory.mktemp("triton") / "results.pt"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, str(HERE / "triton_worker.py"), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, f"triton worker failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return torch.load(out)


def test_triton_is_installed_and_registered_for_cuda():
    # The package env installs the [triton] extra; the kernel serves the CUDA dispatch key.
    assert _triton.HAS_TRITON
    assert ops.TRITON_DISPATCH_KEYS == ("CUDA",)
    for name in ("map_to_physical", "map_to_physical_and_record", "map_to_physical_split_and_record"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"ascend_eplb::{name}", "CUDA")
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(f"ascend_eplb::{name}", "CPU")


def test_worker_ran_the_triton_path_through_the_dispatcher(interpreted):
    assert interpreted["triton_version"] == _triton.TRITON_VERSION
    assert interpreted["registered_for_cpu"] is True
    assert sorted(interpreted["equal"]) == sorted(case["name"] for case in CASES)
    assert sorted(interpreted["split"]) == sorted(case["name"] for case in SPLIT_CASES)


@pytest.mark.parametrize("case", SPLIT_CASES, ids=[case["name"] for case in SPLIT_CASES])
def test_split_kernel_equals_torch_form_and_loop_reference(interpreted, case):
    got = interpreted["split"][case["name"]]
    args = kernel_cases.split_case_inputs(case)
    want = kernel_cases.call_split(args)
    ref_ids, ref_load = kernel_cases.split_reference(kernel_cases.split_case_inputs(case))
    assert want.dtype == got["ids"].dtype == case["ids_dtype"]
    assert torch.equal(want, ref_ids)
    assert torch.equal(got["ids"], want)
    assert torch.equal(args["load"].long(), ref_load)
    assert got["load"].dtype == case["load_dtype"]
    assert torch.equal(got["load"], args["load"])
    assert torch.equal(got["stats"], args["stats"])
    shared = int(args["unpadded"]) > 0 and case["num_tokens"] > 0 and case["record"]
    assert got["stats"][2].item() == (1.0 if shared else 0.0)


@pytest.mark.parametrize("case", CASES, ids=[case["name"] for case in CASES])
def test_kernel_equals_torch_form_and_loop_reference(interpreted, case):
    got = interpreted["equal"][case["name"]]
    args = kernel_cases.case_inputs(case)
    load = args["load"]
    start = load.clone()
    want = ops._map_to_physical_and_record_generic(
        args["ids"], args["table"], load, args["record"], args["unpadded"], args["layout"]
    )
    counted_rows = max(case["unpadded"], 0) if case["record"] else 0
    ref_ids, ref_counts = kernel_cases.reference(
        args["ids"], args["table"], load.shape[0], counted_rows, case.get("layout")
    )
    assert want.dtype == got["ids"].dtype == case["ids_dtype"]
    assert got["ids"].shape == (case["num_tokens"], args["ids"].shape[1])
    assert torch.equal(want, ref_ids)
    assert torch.equal(got["ids"], want)
    if case.get("layout") is None or case["layout"][0] == 0:  # map_to_physical reads row t % rows
        assert torch.equal(got["map"], ref_ids)
    assert got["load"].dtype == case["load_dtype"]
    assert torch.equal(load - start, ref_counts.to(case["load_dtype"]))
    assert torch.equal(got["load"], load)
    # Exact totals: every valid selection of a counted row whose id the view can count, once.
    assert int((got["load"] - start).sum()) == int(ref_counts.sum())


def _error(call):
    try:
        call()
    except Exception as error:
        return type(error).__name__, str(error)
    return None


def _fake_call(args, op):
    with FakeTensorMode() as mode:
        fake = {k: mode.from_tensor(v) for k, v in args.items() if v is not None}
        return _error(lambda: op(fake))


def _meta(args):
    # Same shapes, strides and dtypes on the meta device (Tensor.to would make an expanded view dense).
    return {
        k: torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta") for k, v in args.items()
    }


def _record(a):
    return map_to_physical_and_record(
        a["ids"], a["table"], a["load"], a["record"], a["unpadded"], a["layout"]
    )


def _map(a):
    return map_to_physical(a["ids"], a["table"])


@pytest.mark.parametrize(
    ("rule", "pattern"),
    [(rule, pattern) for rule, _, pattern in kernel_cases.BAD_ARGUMENTS],
    ids=[rule for rule, _, _ in kernel_cases.BAD_ARGUMENTS],
)
def test_metadata_rule_raises_the_same_value_error_on_every_path(interpreted, rule, pattern):
    args = kernel_cases.bad_arguments(rule)
    load = args["load"]
    before = load.clone() if load.device.type == "cpu" else None
    record_paths = {
        "torch form": _error(
            lambda: ops._map_to_physical_and_record_generic(
                args["ids"], args["table"], load, args["record"], args["unpadded"], args["layout"]
            )
        ),
        "fake": _fake_call(args, _record),
    }
    map_paths = {
        "torch form": _error(lambda: ops._map_to_physical_generic(args["ids"], args["table"])),
        "fake": _fake_call(args, _map),
    }
    triton = interpreted["errors"][rule]
    record_paths["triton (interpreter)"] = triton["record_direct"]
    map_paths["triton (interpreter)"] = triton["map_direct"]
    if all(t.device.type == "cpu" for t in args.values()):
        record_paths["op on cpu"] = _error(lambda: _record(args))
        record_paths["op on meta"] = _error(lambda: _record(_meta(args)))
        record_paths["triton op (interpreter)"] = triton["record_op"]
        map_paths["op on cpu"] = _error(lambda: _map(args))
        map_paths["op on meta"] = _error(lambda: _map(_meta(args)))
        map_paths["triton op (interpreter)"] = triton["map_op"]
    expected = record_paths["torch form"]
    assert expected is not None
    assert expected[0] == "ValueError"
    assert re.search(pattern, expected[1]), expected[1]
    assert record_paths == dict.fromkeys(record_paths, expected)
    if rule in kernel_cases.MAP_RULES:
        assert map_paths == dict.fromkeys(map_paths, expected)
    else:  # a recording argument: map_to_physical does not take it and succeeds on every path
        assert map_paths == dict.fromkeys(map_paths)
    assert before is None or torch.equal(load, before)
    assert triton["load_unchanged"] is True
