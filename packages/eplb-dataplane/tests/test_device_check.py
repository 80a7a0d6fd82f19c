"""benchmarks/device_check.py runs on CPU (Triton interpreter) with tiny sizes; its correctness rows pass."""

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
        timeout=240,
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
    assert by_check == {}
    assert "FAIL" not in proc.stdout
    assert proc.stdout.rstrip().endswith("device_check: all checks that ran passed")
