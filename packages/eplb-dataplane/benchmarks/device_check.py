"""Device check of the routing hot path (DESIGN.md invariant 9), one script for one NVIDIA GPU.

Prints one markdown table, ``| check | case | result | status |``, and exits 1 if any row failed:

0. ``kernel == torch form``: the Triton kernel's ids and counts are bit-identical to the torch form
   (``map_to_physical`` and ``map_to_physical_and_record``, int32 and int64 ids, every T).
a. ``no host sync``: both ops (Triton path and torch form) under
   ``torch.cuda.set_sync_debug_mode("error")``, which raises on any device-to-host synchronisation.
b. ``cuda graph across refresh_``: a CUDA graph captured around ``map_to_physical_and_record``,
   replayed, then ``ReplicaLookup.refresh_`` writes a new placement in place and the record flag and
   unpadded count change in place; each replay must use the new values (ids and exact counts).
c. ``speed``: Triton kernel vs torch form vs a plain gather of the same ids through the same table
   (the floor), at T = 256, 4096, 32768, K = 8, E = 256, P = 288: interleaved rounds, the median of
   each time and of each round's ratios.
d. ``staging``: device-to-host and host-to-device copies of one DeepSeek-V3 expert (H = 7168,
   I = 2048; W8A8: int8 w13 (2I, H) and w2 (H, I) plus fp32 per-channel scales (2I,) and (H,);
   bf16: the same weights in bf16) through pinned staging buffers (``ascend_eplb.movement.StagingPool``
   when it imports, which needs vllm; else plain ``pin_memory=True`` buffers, labelled so) vs pageable
   buffers.
f. ``batch split``: the split op (``map_to_physical_split_and_record``, issue 44) with the lookup's
   split inputs (8 ranks): its Triton kernels' ids, counts and stats bit-identical to its torch form;
   under ``set_sync_debug_mode("error")`` on cuda; and its time per layer beside the map-and-record
   kernel's at the same T (interleaved rounds, medians; aim: 30 us per layer at decode sizes on a GPU).
   On CPU: the equality at the largest T only, and the two torch forms timed.
e. ``moe layer graph``: a whole torch-only MoE layer (bound router, map-and-record, expert compute
   reading each supported format's storage, stacked and per-expert lists) captured once as a CUDA graph
   on 2 rank processes, rearranged through upstream's transaction with the movement plane's Gloo
   communicator and the lookup refresh, replayed: output and load equal eager, the output summed over
   the ranks equals the EPLB-off reference (``moe_layer_graph.py`` beside this file). Needs the
   workspace environment (quant_views, movement and vLLM); without it the row says so.

On CPU (``--device cpu``, or no CUDA device) the Triton kernel runs under Triton's interpreter
(``TRITON_INTERPRET=1`` is set before the package imports triton): check 0 runs, c prints interpreter
times (not a speed measurement), a, b and d print "skipped: needs cuda", f compares the split's kernels
with its torch form and prints interpreter times, and e runs its CPU mode: one
TorchDynamo trace with every guard dropped in place of the capture, and every tensor the trace reads
must keep its storage through the rearrangements.

Usage (from the repository root)::

    python packages/eplb-dataplane/benchmarks/device_check.py            # the GPU, full sizes
    python packages/eplb-dataplane/benchmarks/device_check.py --device cpu --quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

NUM_LOGICAL, NUM_PHYSICAL, TOP_K = 256, 288, 8
FULL_TOKENS = (256, 4096, 32768)
QUICK_TOKENS = (1, 17, 300)
HIDDEN, INTERMEDIATE = 7168, 2048  # DeepSeek-V3 hidden size and MoE intermediate size
SKIPPED = "skipped: needs cuda"
SPLIT_RANKS = 8


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if available")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and one short round (the test)")
    parser.add_argument("--tokens", default=None, help="comma-separated T values (default 256,4096,32768)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (default 7)")
    parser.add_argument("--min-run-time", type=float, default=None, help="seconds per timing (default 0.2)")
    parser.add_argument("--no-layer", dest="checks", action="store_const", const="0abcd",
                        help="skip check e (the MoE layer graph, 2 rank processes)")  # fmt: skip
    return parser


class Report:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str, str]] = []

    def add(self, check: str, case: str, result: str, status: str) -> None:
        self.rows.append((check, case, result, status))
        print(f"| {check} | {case} | {result} | {status} |", flush=True)

    @property
    def failed(self) -> bool:
        return any(status == "FAIL" for *_, status in self.rows)


def _lookup(torch, device: str, seed: int):
    from ascend_eplb.dataplane import ReplicaLookup

    lookup = ReplicaLookup(NUM_LOGICAL, device, num_physical_experts=NUM_PHYSICAL, num_ranks=SPLIT_RANKS)
    lookup.refresh_(*_placement(torch, seed))
    return lookup


def _placement(torch, seed: int):
    # 32 hot logical experts get a second replica in the redundant slots 256..287.
    gen = torch.Generator().manual_seed(seed)
    hot = torch.randperm(NUM_LOGICAL, generator=gen)[: NUM_PHYSICAL - NUM_LOGICAL]
    l2p = torch.full((NUM_LOGICAL, 2), -1, dtype=torch.int64)
    l2p[:, 0] = torch.randperm(NUM_LOGICAL, generator=gen)
    l2p[hot, 1] = torch.arange(NUM_LOGICAL, NUM_PHYSICAL)
    return l2p, 1 + (l2p[:, 1] >= 0).to(torch.int64)


def _ids(torch, num_tokens: int, dtype, device: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(-2, NUM_LOGICAL + 2, (num_tokens, TOP_K), generator=gen)  # some invalid ids
    return ids.to(device=device, dtype=dtype)


def check_kernel_equals_torch_form(torch, ops, device: str, tokens, report: Report) -> None:
    check = "0. kernel == torch form"
    if not ops._triton.HAS_TRITON:
        report.add(check, "all", "triton is not installed (extra ascend-eplb-dataplane[triton])", "FAIL")
        return
    if device == "cuda":
        served = "CUDA" in ops.TRITON_DISPATCH_KEYS
        report.add(check, "ops on cuda dispatch to the Triton kernel", str(ops.TRITON_DISPATCH_KEYS),
                   "PASS" if served else "FAIL")  # fmt: skip
    table = _lookup(torch, device, 0).table
    for num_tokens in tokens:
        for dtype in (torch.int32, torch.int64):
            ids = _ids(torch, num_tokens, dtype, device, num_tokens)
            flag = torch.tensor(True, device=device)
            n = torch.tensor(num_tokens - num_tokens // 8, device=device)
            kernel_load = torch.zeros(NUM_PHYSICAL, dtype=torch.int32, device=device)
            torch_load = kernel_load.clone()
            got = ops._map_to_physical_and_record_triton(ids, table, kernel_load, flag, n)
            want = ops._map_to_physical_and_record_generic(ids, table, torch_load, flag, n)
            got_map = ops._map_to_physical_triton(ids, table)
            same = (
                torch.equal(got, want)
                and torch.equal(got_map, want)
                and torch.equal(kernel_load, torch_load)
                and int(kernel_load.sum())
                == int(((ids[: int(n)] >= 0) & (ids[: int(n)] < NUM_LOGICAL)).sum())
            )
            result = f"ids and counts identical, {int(kernel_load.sum())} counted" if same else "differ"
            report.add(check, f"T={num_tokens} {str(dtype)[6:]}", result, "PASS" if same else "FAIL")


def check_no_host_sync(torch, ops, device: str, tokens, report: Report) -> None:
    check = "a. no host sync"
    if device != "cuda":
        report.add(check, "both ops, Triton and torch form", "-", SKIPPED)
        return
    table = _lookup(torch, device, 0).table
    num_tokens = tokens[-1]
    ids = _ids(torch, num_tokens, torch.int32, device, 1)
    load = torch.zeros(NUM_PHYSICAL, dtype=torch.int32, device=device)
    flag, n = torch.tensor(True, device=device), torch.tensor(num_tokens // 2, device=device)
    forms = {
        "map_to_physical (Triton op)": lambda: ops.map_to_physical(ids, table),
        "map_to_physical_and_record (Triton op)": lambda: ops.map_to_physical_and_record(
            ids, table, load, flag, n
        ),
        "map_to_physical (torch form)": lambda: ops._map_to_physical_generic(ids, table),
        "map_to_physical_and_record (torch form)": lambda: ops._map_to_physical_and_record_generic(
            ids, table, load, flag, n
        ),
    }
    for name, call in forms.items():
        call()  # compile and allocate outside the checked region
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            call()
            error = None
        except RuntimeError as exc:
            error = str(exc).splitlines()[0]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        report.add(
            check, f"{name}, T={num_tokens}", error or "no synchronisation", "FAIL" if error else "PASS"
        )


def check_graph_across_refresh(torch, ops, device: str, tokens, report: Report) -> None:
    check = "b. cuda graph across refresh_"
    if device != "cuda":
        report.add(check, "capture, replay, refresh_, replay", "-", SKIPPED)
        return
    lookup = _lookup(torch, device, 0)
    num_tokens = tokens[-1]
    ids = _ids(torch, num_tokens, torch.int32, device, 2)
    load = torch.zeros(NUM_PHYSICAL, dtype=torch.int32, device=device)
    flag = torch.tensor(True, device=device)
    n = torch.tensor(num_tokens, dtype=torch.int32, device=device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            ops.map_to_physical_and_record(ids, lookup.table, load, flag, n)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.map_to_physical_and_record(ids, lookup.table, load, flag, n)

    def replay_and_compare(label: str) -> None:
        load.zero_()
        graph.replay()
        torch.cuda.synchronize()
        want_load = torch.zeros_like(load)
        want = ops._map_to_physical_and_record_generic(ids, lookup.table, want_load, flag, n)
        same = torch.equal(out, want) and torch.equal(load, want_load)
        report.add(check, label, f"ids and counts exact, {int(load.sum())} counted" if same else "differ",
                   "PASS" if same else "FAIL")  # fmt: skip

    replay_and_compare(f"replay, T={num_tokens}, first placement")
    before = out.clone()
    lookup.refresh_(*_placement(torch, 1))  # in place: the captured table pointer stays valid
    n.fill_(num_tokens // 3)
    replay_and_compare(f"replay after refresh_ and unpadded={num_tokens // 3}")
    changed = not torch.equal(out, before)
    report.add(check, "replay uses the new placement", "ids changed" if changed else "ids unchanged",
               "PASS" if changed else "FAIL")  # fmt: skip
    flag.fill_(False)
    replay_and_compare("replay with record flag off")
    report.add(check, "record flag off counts nothing", f"{int(load.sum())} counted",
               "PASS" if int(load.sum()) == 0 else "FAIL")  # fmt: skip


def _time(stmt: str, env: dict, min_run_time: float) -> float:
    from torch.utils import benchmark

    timer = benchmark.Timer(stmt, globals=env)
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e6


def check_speed(torch, ops, device: str, tokens, rounds: int, min_run_time: float, report: Report) -> None:
    check = "c. speed"
    if not ops._triton.HAS_TRITON:
        report.add(check, "all", "triton is not installed", "FAIL")
        return
    table = _lookup(torch, device, 0).table
    load = torch.zeros(NUM_PHYSICAL, dtype=torch.int32, device=device)
    flag = torch.tensor(True, device=device)
    status = "measured" if device == "cuda" else "interpreter: not a speed measurement"
    for num_tokens in tokens:
        ids = _ids(torch, num_tokens, torch.int32, device, 3).clamp_(0, NUM_LOGICAL - 1)
        n = torch.tensor(num_tokens - num_tokens // 8, device=device)
        env = {
            "kernel": ops._map_to_physical_and_record_triton,
            "torch_form": ops._map_to_physical_and_record_generic,
            "floor": ops._gather_rows,
            "ids": ids,
            "table": table,
            "load": load,
            "flag": flag,
            "n": n,
        }
        statements = {
            "kernel": "kernel(ids, table, load, flag, n)",
            "torch form": "torch_form(ids, table, load, flag, n)",
            "floor": "floor(table, ids)",
        }
        times = {name: [] for name in statements}
        for _ in range(rounds):  # interleaved: a burst of load on the host hits every form
            for name, stmt in statements.items():
                times[name].append(_time(stmt, env, min_run_time))
        med = {name: statistics.median(values) for name, values in times.items()}

        def ratio(a: str, b: str, times=times) -> float:
            return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))

        report.add(
            check,
            f"T={num_tokens} K={TOP_K} E={NUM_LOGICAL} P={NUM_PHYSICAL}",
            f"kernel {med['kernel']:.1f} us, torch form {med['torch form']:.1f} us, "
            f"floor {med['floor']:.1f} us; kernel/floor {ratio('kernel', 'floor'):.2f}, "
            f"torch form/floor {ratio('torch form', 'floor'):.2f}, "
            f"kernel/torch form {ratio('kernel', 'torch form'):.2f}",
            status,
        )


def check_batch_split(
    torch, ops, device: str, tokens, rounds: int, min_run_time: float, report: Report
) -> None:
    check = "f. batch split"
    from ascend_eplb.dataplane import split

    if not ops._triton.HAS_TRITON:
        report.add(check, "all", "triton is not installed", "FAIL")
        return
    lookup = _lookup(torch, device, 0)
    inputs = lookup.split_inputs
    # Under Triton's interpreter one call of the split's kernels takes half a minute at these sizes: on
    # CPU the largest T only (the kernel tests run the interpreter on small sizes too).
    for num_tokens in tokens if device == "cuda" else tokens[-1:]:
        ids = _ids(torch, num_tokens, torch.int32, device, 5)
        flag = torch.tensor(True, device=device)
        n = torch.tensor(num_tokens - num_tokens // 8, device=device)
        loads = [torch.zeros(NUM_PHYSICAL, dtype=torch.int32, device=device) for _ in range(2)]
        stats = [torch.zeros(split.SPLIT_STATS_SIZE, device=device) for _ in range(2)]
        args = (ids, lookup.table, *inputs)
        got = split._split_triton(*args, loads[0], flag, n, None, None, None, stats[0])
        want = split._split_generic(*args, loads[1], flag, n, None, None, None, stats[1])
        same = torch.equal(got, want) and torch.equal(loads[0], loads[1]) and torch.equal(stats[0], stats[1])
        counted = int(((ids[: int(n)] >= 0) & (ids[: int(n)] < NUM_LOGICAL)).sum())
        same = same and int(loads[0].sum()) == counted
        result = f"ids, counts and stats identical, {counted} counted" if same else "differ"
        report.add(check, f"kernel == torch form, T={num_tokens}", result, "PASS" if same else "FAIL")
    if device == "cuda":
        ids = _ids(torch, tokens[0], torch.int32, device, 5)
        flag, n = torch.tensor(True, device=device), torch.tensor(tokens[0], device=device)
        load = torch.zeros(NUM_PHYSICAL, dtype=torch.int32, device=device)
        try:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            split._split_triton(ids, lookup.table, *inputs, load, flag, n)
            split._split_generic(ids, lookup.table, *inputs, load, flag, n)
            torch.cuda.synchronize()
            report.add(check, "no host sync (kernels and torch form)", "no synchronising call", "PASS")
        except RuntimeError as e:
            report.add(check, "no host sync (kernels and torch form)", str(e).splitlines()[0], "FAIL")
        finally:
            torch.cuda.set_sync_debug_mode("default")
    if device != "cuda":
        _split_cpu_times(torch, ops, split, lookup, tokens, rounds, min_run_time, report)
        return
    load = torch.zeros(NUM_PHYSICAL, dtype=torch.int32, device=device)
    flag = torch.tensor(True, device=device)
    for num_tokens in tokens:
        ids = _ids(torch, num_tokens, torch.int32, device, 3).clamp_(0, NUM_LOGICAL - 1)
        n = torch.tensor(num_tokens - num_tokens // 8, device=device)
        env = {
            "split_kernel": split._split_triton,
            "split_torch": split._split_generic,
            "kernel": ops._map_to_physical_and_record_triton,
            "ids": ids,
            "table": lookup.table,
            "inputs": inputs,
            "load": load,
            "flag": flag,
            "n": n,
        }
        statements = {
            "split kernel": "split_kernel(ids, table, *inputs, load, flag, n)",
            "split torch form": "split_torch(ids, table, *inputs, load, flag, n)",
            "map-and-record kernel": "kernel(ids, table, load, flag, n)",
        }
        times = {name: [] for name in statements}
        for _ in range(rounds):
            for name, stmt in statements.items():
                times[name].append(_time(stmt, env, min_run_time))
        med = {name: statistics.median(values) for name, values in times.items()}
        ratio = statistics.median(
            x / y for x, y in zip(times["split kernel"], times["map-and-record kernel"], strict=True)
        )
        report.add(
            check,
            f"T={num_tokens} K={TOP_K} E={NUM_LOGICAL} P={NUM_PHYSICAL} N={SPLIT_RANKS}",
            f"split kernel {med['split kernel']:.1f} us per layer, split torch form "
            f"{med['split torch form']:.1f} us, map-and-record kernel {med['map-and-record kernel']:.1f} us; "
            f"split kernel/map-and-record kernel {ratio:.2f}",
            "measured",
        )


def _split_cpu_times(torch, ops, split, lookup, tokens, rounds: int, min_run_time: float, report) -> None:
    """On CPU: the split's torch form beside the map-and-record torch form (the ops as CPU dispatches
    them; the interpreted kernels are not timed)."""
    load = torch.zeros(NUM_PHYSICAL, dtype=torch.int32)
    flag = torch.tensor(True)
    for num_tokens in tokens:
        ids = _ids(torch, num_tokens, torch.int32, "cpu", 3).clamp_(0, NUM_LOGICAL - 1)
        env = {
            "split_torch": split._split_generic,
            "torch_form": ops._map_to_physical_and_record_generic,
            "ids": ids,
            "table": lookup.table,
            "inputs": lookup.split_inputs,
            "load": load,
            "flag": flag,
            "n": torch.tensor(num_tokens - num_tokens // 8),
        }
        statements = {
            "split": "split_torch(ids, table, *inputs, load, flag, n)",
            "map-and-record": "torch_form(ids, table, load, flag, n)",
        }
        times = {name: [] for name in statements}
        for _ in range(rounds):
            for name, stmt in statements.items():
                times[name].append(_time(stmt, env, min_run_time))
        med = {name: statistics.median(values) for name, values in times.items()}
        ratio = statistics.median(x / y for x, y in zip(times["split"], times["map-and-record"], strict=True))
        report.add(
            "f. batch split",
            f"T={num_tokens} K={TOP_K} E={NUM_LOGICAL} P={NUM_PHYSICAL} N={SPLIT_RANKS}",
            f"split torch form {med['split']:.1f} us per layer, map-and-record torch form "
            f"{med['map-and-record']:.1f} us; split/map-and-record {ratio:.2f}",
            "cpu: torch forms, kernels not timed",
        )


def _staging_buffers(torch, specs):
    try:
        from ascend_eplb.movement import StagingPool

        pool = StagingPool(max_bytes=4 << 30, pin_memory=True)
        return pool.take([(dtype, numel) for dtype, numel in specs]), "StagingPool (pinned)"
    except Exception as error:  # movement needs vllm; measure the same pinned buffers directly
        reason = type(error).__name__
        buffers = [torch.empty(numel, dtype=dtype, pin_memory=True) for dtype, numel in specs]
        return buffers, f"plain pinned buffers (StagingPool not importable: {reason})"


def check_staging(torch, device: str, quick: bool, rounds: int, report: Report) -> None:
    check = "d. staging"
    if device != "cuda":
        report.add(check, "one DeepSeek-V3 expert, W8A8 and bf16", "-", SKIPPED)
        return
    hidden, inter = (512, 256) if quick else (HIDDEN, INTERMEDIATE)
    formats = {
        "W8A8": [
            ((2 * inter, hidden), torch.int8),
            ((hidden, inter), torch.int8),
            ((2 * inter,), torch.float32),
            ((hidden,), torch.float32),
        ],
        "bf16": [((2 * inter, hidden), torch.bfloat16), ((hidden, inter), torch.bfloat16)],
    }
    for name, shapes in formats.items():
        tensors = [torch.ones(shape, dtype=dtype, device=device) for shape, dtype in shapes]
        specs = [(t.dtype, t.numel()) for t in tensors]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        pinned, label = _staging_buffers(torch, specs)
        pageable = [torch.empty(numel, dtype=dtype) for dtype, numel in specs]

        def copy(direction: str, buffers, non_blocking: bool, tensors=tensors) -> float:
            torch.cuda.synchronize()
            start = time.perf_counter()
            for t, buf in zip(tensors, buffers, strict=True):
                if direction == "D2H":
                    buf.copy_(t.view(-1), non_blocking=non_blocking)
                else:
                    t.view(-1).copy_(buf, non_blocking=non_blocking)
            torch.cuda.synchronize()
            return time.perf_counter() - start

        for direction in ("D2H", "H2D"):
            copy(direction, pinned, True)
            copy(direction, pageable, False)
            pinned_s, pageable_s = [], []
            for _ in range(rounds):
                pinned_s.append(copy(direction, pinned, True))
                pageable_s.append(copy(direction, pageable, False))
            p, q = statistics.median(pinned_s), statistics.median(pageable_s)
            report.add(
                check,
                f"{name} expert {nbytes / 2**20:.1f} MiB {direction}",
                f"{label}: {p * 1e3:.2f} ms ({nbytes / p / 1e9:.1f} GB/s); pageable {q * 1e3:.2f} ms "
                f"({nbytes / q / 1e9:.1f} GB/s); pageable/pinned {q / p:.2f}",
                "measured",
            )


def check_moe_layer_graph(torch, device: str, quick: bool, report: Report) -> None:
    check = "e. moe layer graph"
    try:
        import ascend_eplb.movement
        import ascend_eplb.quant_views  # noqa: F401
        from ascend_eplb.launch import load_module, run_ranks
    except ImportError as error:
        report.add(check, "every format", f"not run: {error} (run it in the workspace environment)",
                   "skipped: needs quant_views, movement and vllm")  # fmt: skip
        return
    import tempfile
    from pathlib import Path

    # The ranks run vLLM's device-neutral transaction functions only; its platform stays the launcher's.
    module = load_module(Path(__file__).with_name("moe_layer_graph.py"))
    rounds = 3 if quick else 6
    with tempfile.TemporaryDirectory(prefix="device-check-") as tmp:
        results = run_ranks(
            module.moe_layer_rank, world_size=2, tmp_path=Path(tmp), args=(device, quick, rounds),
            timeout_s=900, preload=("vllm.distributed.eplb.rebalance_execute",),
        )  # fmt: skip
    how = "CUDA graph" if device == "cuda" else "one trace, every guard dropped (CPU: no graph capture)"
    for cases in zip(*results, strict=True):
        first = cases[0]
        failures = [f"rank {r}: {f}" for r, c in enumerate(cases) for f in c["failures"]]
        mode = "per-expert lists" if first["lists"] else "stacked"
        err = max(c["max_reference_error"] for c in cases)
        result = (
            f"{how}; {first['rearrangements']} rearrangements: output and load equal eager; summed over the "
            f"ranks, the EPLB-off reference's within {err:.2g} of its scale"
        )
        if device != "cuda":
            moved = [f"rank {r}: {m}" for r, c in enumerate(cases) for m in c["moved"]]
            traced = [c["graphs"] for c in cases]
            kernel = [(c["kernel_inputs"], c["kernel_tensors"]) for c in cases]
            failures += moved + [f"traced {n} times" for n in traced if n != 1]
            failures += [
                f"{got} of {want} kernel tensors are graph inputs" for got, want in kernel if got != want
            ]
            result += (
                f"; every graph input kept its storage: the {kernel[0][1]} kernel tensors, "
                f"{', '.join(first['eplb_inputs'])}"
            )
        report.add(
            check, f"{first['case']}, {mode}", "; ".join(failures) or result, "FAIL" if failures else "PASS"
        )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("device_check: --device cuda but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    if device == "cpu":
        # Before ascend_eplb.dataplane imports triton: triton.jit then builds an interpreted kernel.
        if "ascend_eplb.dataplane" in sys.modules:
            print("device_check: import ascend_eplb.dataplane after choosing cpu", file=sys.stderr)
            return 2
        os.environ["TRITON_INTERPRET"] = "1"
    from ascend_eplb.dataplane import ops

    if args.tokens:
        tokens = tuple(int(t) for t in args.tokens.split(","))
    else:
        tokens = QUICK_TOKENS if args.quick else FULL_TOKENS
    rounds = args.rounds or (1 if args.quick else 7)
    min_run_time = args.min_run_time or (0.01 if args.quick else 0.2)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)"
    print(
        f"device={device} ({name}) torch={torch.__version__} triton={ops._triton.TRITON_VERSION} "
        f"Triton dispatch keys={ops.TRITON_DISPATCH_KEYS} tokens={tokens} rounds={rounds} "
        f"min_run_time={min_run_time}s quick={args.quick}"
    )
    print("| check | case | result | status |")
    print("|---|---|---|---|")
    report = Report()
    check_kernel_equals_torch_form(torch, ops, device, tokens, report)
    check_no_host_sync(torch, ops, device, tokens, report)
    check_graph_across_refresh(torch, ops, device, tokens, report)
    check_speed(torch, ops, device, tokens, rounds, min_run_time, report)
    check_staging(torch, device, args.quick, rounds, report)
    check_batch_split(torch, ops, device, tokens, rounds, min_run_time, report)
    if args.checks is None or "e" in args.checks:
        check_moe_layer_graph(torch, device, args.quick, report)
    print("device_check: FAILED" if report.failed else "device_check: all checks that ran passed")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
