"""benchmarks/device_check.py runs on CPU (Triton interpreter) with tiny sizes; its correctness rows pass."""

import importlib.util
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "device_check.py"


def _rows(stdout: str) -> list[list[str]]:
    rows = [line.strip("|").split(" | ") for line in stdout.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in row] for row in rows[1:]]  # without the header


def test_device_check_quick_on_cpu():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--tokens", "0,1,17,1025"],
        capture_output=True,
        text=True,
        timeout=420,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = _rows(proc.stdout)
    by_check: dict[str, list[list[str]]] = {}
    for check, *rest in rows:
        by_check.setdefault(check, []).append(rest)
    kernel = by_check.pop("0. kernel == torch form")
    assert [case for case, _, _ in kernel] == [
        f"T={t} {dtype}" for t in (0, 1, 17, 1025) for dtype in ("int32", "int64")
    ]
    assert all(status == "PASS" for _, _, status in kernel)
    assert [result for case, result, _ in kernel if case.startswith("T=0 ")] == [
        "ids and counts identical, 0 counted"
    ] * 2
    for check in ("a. no host sync", "b. cuda graph across refresh_", "d. staging"):
        assert [status for _, _, status in by_check.pop(check)] == ["skipped: needs cuda"]
    speed = by_check.pop("c. speed")
    assert [case.split()[0] for case, _, _ in speed] == ["T=0", "T=1", "T=17", "T=1025"]
    assert all(status == "interpreter: not a speed measurement" for _, _, status in speed)
    assert all("kernel/floor" in result for _, result, _ in speed)
    split = by_check.pop("f. batch split")
    # The split's kernels under the interpreter at the largest T (7059 valid selections of the 897 real
    # rows counted), then the two torch forms timed.
    assert split[0] == [
        "kernel == torch form, T=1025",
        "ids, counts and stats identical, 7059 counted",
        "PASS",
    ]
    timed = split[1:]
    assert [case.split()[0] for case, _, _ in timed] == ["T=0", "T=1", "T=17", "T=1025"]
    assert all(status == "cpu: torch forms, kernels not timed" for _, _, status in timed)
    assert all("split/map-and-record" in result for _, result, _ in timed)
    layer = by_check.pop("e. moe layer graph")
    if all(importlib.util.find_spec(m) for m in ("ascend_eplb.quant_views", "ascend_eplb.movement")):
        # The workspace environment (the suite): a whole MoE layer of every format, traced once on 2
        # ranks, replayed across 3 rearrangements through upstream's transaction and the Gloo
        # communicator: equal to eager, within rounding of the EPLB-off sum, every graph input in place.
        formats = [
            "bf16",
            "fp16",
            "w8a8_dynamic",
            "w8a8_dynamic fused scales",
            "w4a8_dynamic",
            "mxfp8",
            "mxfp4",
        ]
        assert [case for case, _, _ in layer] == [
            f"{f}, {mode}" for f in formats for mode in ("stacked", "per-expert lists")
        ]
        assert all(status == "PASS" for _, _, status in layer)
        traced = "one trace, every guard dropped (CPU: no graph capture); 3 rearrangements"
        in_place = "num_unpadded_tokens_tensors[0], row_layout, should_record_tensor, table"
        assert all(result.startswith(traced) and result.endswith(in_place) for _, result, _ in layer)
    else:  # this package alone: quant_views and movement are not its dependencies
        assert [status for _, _, status in layer] == ["skipped: needs quant_views, movement and vllm"]
    assert by_check == {}
    assert "FAIL" not in proc.stdout
    assert proc.stdout.rstrip().endswith("device_check: all checks that ran passed")
