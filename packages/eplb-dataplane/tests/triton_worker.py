"""Run the ops' Triton path on CPU under Triton's interpreter and save what it produced (not a test module).

Usage: ``TRITON_INTERPRET=1 python triton_worker.py OUT.pt``. ``test_triton_kernel.py`` starts it in a
subprocess, because ``triton.jit`` reads ``TRITON_INTERPRET`` when the kernel is defined (at the first
import of ``ascend_eplb.dataplane``), and compares the results with the torch form in its own process.

The worker registers the ops' Triton path for the ``CPU`` dispatch key (``ops._register_triton``, the
same function that registers it for ``CUDA``), so the ops called on CPU tensors go through the
dispatcher to the Triton wrapper, its checks and the interpreted kernel. Exits 3, saying why, when
triton is not installed: the tests then fail, they do not skip.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def main(out_path: str) -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("triton_worker: TRITON_INTERPRET=1 must be set before triton is imported", file=sys.stderr)
        return 2
    import torch

    from ascend_eplb.dataplane import _triton, map_to_physical, map_to_physical_and_record, ops, split

    if not _triton.HAS_TRITON:
        print(
            "triton_worker: triton is not installed; the test environment must install the "
            "ascend-eplb-dataplane[triton] extra",
            file=sys.stderr,
        )
        return 3
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import kernel_cases

    impl = torch.library.Library("ascend_eplb", "IMPL")
    ops._register_triton(impl, "CPU")
    split._register_triton(impl, "CPU")
    registered = all(
        torch._C._dispatch_has_kernel_for_dispatch_key(f"ascend_eplb::{name}", "CPU")
        for name in ("map_to_physical", "map_to_physical_and_record", "map_to_physical_split_and_record")
    )
    results: dict = {"triton_version": _triton.TRITON_VERSION, "registered_for_cpu": registered}

    equal = {}
    for case in kernel_cases.equality_cases():
        args = kernel_cases.case_inputs(case)
        load = args["load"]
        ids = map_to_physical_and_record(
            args["ids"], args["table"], load, args["record"], args["unpadded"], args["layout"]
        )
        equal[case["name"]] = {
            "ids": ids,
            "load": load,
            "map": map_to_physical(args["ids"], args["table"]),
        }
    results["equal"] = equal

    split_results = {}
    for case in kernel_cases.split_cases():
        args = kernel_cases.split_case_inputs(case)
        ids = kernel_cases.call_split(args)
        split_results[case["name"]] = {"ids": ids, "load": args["load"], "stats": args["stats"]}
    results["split"] = split_results

    errors = {}
    for name, _, _ in kernel_cases.BAD_ARGUMENTS:
        args = kernel_cases.bad_arguments(name)
        before = args["load"].clone() if args["load"].device.type == "cpu" else None
        got = {}
        calls = {
            "record_direct": lambda a=args: ops._map_to_physical_and_record_triton(
                a["ids"], a["table"], a["load"], a["record"], a["unpadded"], a["layout"]
            ),
            "map_direct": lambda a=args: ops._map_to_physical_triton(a["ids"], a["table"]),
        }
        if all(
            t.device.type == "cpu" for t in args.values() if t is not None
        ):  # the dispatcher reaches the CPU key
            calls["record_op"] = lambda a=args: map_to_physical_and_record(
                a["ids"], a["table"], a["load"], a["record"], a["unpadded"], a["layout"]
            )
            calls["map_op"] = lambda a=args: map_to_physical(a["ids"], a["table"])
        for path, call in calls.items():
            try:
                call()
            except Exception as error:
                got[path] = (type(error).__name__, str(error))
            else:
                got[path] = None
        got["load_unchanged"] = before is None or torch.equal(args["load"], before)
        errors[name] = got
    results["errors"] = errors
    torch.save(results, out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
