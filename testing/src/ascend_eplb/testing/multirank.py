"""Run one function on N real rank processes over Gloo on CPU, and surface every rank's failure.

This is the single multi-rank harness of the repository (DESIGN.md section 6): every package whose
tests need ranks calls :func:`run_ranks`; none keeps a copy.

* Ranks are started with ``multiprocessing``'s ``forkserver`` method. Modules named in ``preload``
  (vLLM, typically: importing it costs about 12 s) are imported once in the fork server of the test
  process, so every later world of that process starts in well under a second.
* The rendezvous is a ``file://`` URL in the test's own tmp dir, never a fixed port, so worlds of
  parallel pytest-xdist workers cannot collide.
* Each rank runs with one torch thread, ``GLOO_SOCKET_IFNAME=lo`` and ``VLLM_TARGET_DEVICE=cpu`` (the
  last must be set before vLLM is imported on a host without an accelerator).
* The whole world has a deadline. When a rank fails, the others get ``grace_s`` to finish (they may
  be blocked in a collective with the failed rank) and are then killed. :class:`RankFailureError` lists the
  exit code and the traceback (or "killed after the deadline") of every rank.

Rank functions are module-level functions ``fn(ctx: RankContext, *args)``. They may live in an
installed module or in a plain file next to the tests, loaded with :func:`load_module` (the child loads
it the same way), but never in a test file: pytest's import mode gives test modules names no child can
import.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib
import importlib.util
import inspect
import multiprocessing
import multiprocessing.connection
import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["RANK_ENV", "RankContext", "RankFailureError", "load_module", "run_ranks"]

#: Environment every rank process gets (set in the test process before the fork server starts, so
#: modules preloaded there see it too). Values already present in the environment are kept.
RANK_ENV = {
    "GLOO_SOCKET_IFNAME": "lo",
    "OMP_NUM_THREADS": "1",
    "VLLM_TARGET_DEVICE": "cpu",
    "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
}


@dataclass(frozen=True)
class RankContext:
    """What a rank function learns about its world.

    Attributes:
        rank: global rank of this process, in ``[0, world_size)``.
        world_size: number of rank processes.
        init_method: ``file://`` rendezvous URL, unique to this world.
        tmp_dir: a directory shared by all ranks of this world (the test's tmp dir).
        timeout_s: the world's deadline in seconds; use it for collective timeouts.
    """

    rank: int
    world_size: int
    init_method: str
    tmp_dir: Path
    timeout_s: float

    def init_gloo(self, timeout_s: float | None = None) -> None:
        """Initialise the default ``torch.distributed`` process group over Gloo for this world."""
        import torch.distributed as dist

        dist.init_process_group(
            backend="gloo",
            init_method=self.init_method,
            rank=self.rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(seconds=timeout_s if timeout_s is not None else self.timeout_s),
        )


class RankFailureError(AssertionError):
    """One or more ranks raised, exited non-zero or missed the deadline.

    Attributes:
        reports: per rank, ``(exit_code, detail)``; ``exit_code`` is None for a rank killed at the deadline.
    """

    def __init__(self, fn_name: str, reports: dict[int, tuple[int | None, str]]):
        self.reports = reports
        lines = [f"{fn_name}: {sum(1 for c, _ in reports.values() if c != 0)} of {len(reports)} ranks failed"]
        for rank in sorted(reports):
            code, detail = reports[rank]
            state = "ok" if code == 0 else ("killed" if code is None else f"exit code {code}")
            lines.append(f"--- rank {rank}: {state}")
            if code != 0 and detail:
                lines.append(detail.rstrip())
        super().__init__("\n".join(lines))


def _function_spec(fn: Callable[..., Any]) -> tuple[str, str, str]:
    """(module name, file, qualname) of a module-level function, checked in the test process."""
    qualname = fn.__qualname__
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(f"rank function {qualname!r} must be defined at module level")
    file = inspect.getfile(fn)
    return fn.__module__, file, qualname


def load_module(file: str | os.PathLike[str]) -> ModuleType:
    """Import a plain Python file (a tests folder's rank functions) under a stable private name.

    The test process and every rank process load the same file under the same name, so functions
    from it can be handed to :func:`run_ranks`. The file's folder is put on ``sys.path`` so it can
    import its siblings.
    """
    path = os.path.realpath(file)
    alias = "_ascend_eplb_ranks_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    module = sys.modules.get(alias)
    if module is None:
        folder = os.path.dirname(path)
        if folder not in sys.path:
            sys.path.insert(0, folder)
        file_spec = importlib.util.spec_from_file_location(alias, path)
        if file_spec is None or file_spec.loader is None:
            raise ImportError(f"cannot load {path}")
        module = importlib.util.module_from_spec(file_spec)
        sys.modules[alias] = module
        file_spec.loader.exec_module(module)
    return module


def _load_function(module_name: str, file: str, qualname: str) -> Callable[..., Any]:
    spec = None
    if module_name != "__main__" and not module_name.startswith("_ascend_eplb_ranks_"):
        spec = importlib.util.find_spec(module_name)
    if spec is not None and spec.origin and os.path.samefile(spec.origin, file):
        module = importlib.import_module(module_name)
    else:
        module = load_module(file)
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _rank_main(
    fn_spec: tuple[str, str, str],
    ctx: RankContext,
    args: tuple[Any, ...],
    result_file: str,
) -> None:
    os.environ.update({k: v for k, v in RANK_ENV.items() if k not in os.environ})
    try:
        import torch

        torch.set_num_threads(1)
        fn = _load_function(*fn_spec)
        result = fn(ctx, *args)
        payload: tuple[str, Any] = ("ok", result)
    except BaseException:
        payload = ("error", traceback.format_exc())
    with open(result_file, "wb") as f:
        try:
            pickle.dump(payload, f)
        except Exception:
            pickle.dump(
                ("error", f"result of rank {ctx.rank} is not picklable:\n{traceback.format_exc()}"), f
            )
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: daemon threads (vLLM's async worker) and Gloo groups of a test
    # world need no orderly shutdown, and joining them could hang.
    os._exit(0 if payload[0] == "ok" else 1)


def run_ranks(
    fn: Callable[..., Any],
    *,
    world_size: int,
    tmp_path: Path,
    args: Sequence[Any] = (),
    timeout_s: float = 120.0,
    grace_s: float = 10.0,
    preload: Sequence[str] = (),
) -> list[Any]:
    """Run ``fn(ctx, *args)`` on ``world_size`` rank processes and return each rank's result.

    Args:
        fn: module-level function taking a :class:`RankContext` first; its return value must pickle.
        world_size: number of ranks, 1 to 8 (DESIGN.md keeps tests at 4 or fewer).
        tmp_path: the test's tmp dir; the rendezvous file and per-rank results go in a fresh folder there.
        args: extra positional arguments for ``fn``, pickled to every rank.
        timeout_s: deadline for the whole world, in seconds.
        grace_s: after a rank fails, how long the others may still run before they are killed.
        preload: modules imported once in this process's fork server (for example ``"vllm"``).

    Returns:
        ``[result of rank 0, ..., result of rank world_size-1]``.

    Raises:
        ValueError: ``world_size`` outside ``[1, 8]`` or ``fn`` not defined at module level.
        RankFailureError: any rank raised, exited non-zero or missed the deadline.
    """
    if not 1 <= world_size <= 8:
        raise ValueError(f"world_size={world_size} must be in [1, 8]")
    spec = _function_spec(fn)
    world_dir = Path(tmp_path) / f"world-{time.monotonic_ns()}"
    world_dir.mkdir(parents=True)
    for key, value in RANK_ENV.items():
        os.environ.setdefault(key, value)
    mp = multiprocessing.get_context("forkserver")
    if preload:
        mp.set_forkserver_preload(list(preload))
    procs = []
    for rank in range(world_size):
        ctx = RankContext(
            rank=rank,
            world_size=world_size,
            init_method=f"file://{world_dir / 'rendezvous'}",
            tmp_dir=world_dir,
            timeout_s=timeout_s,
        )
        result_file = str(world_dir / f"rank{rank}.pkl")
        proc = mp.Process(
            target=_rank_main, args=(spec, ctx, tuple(args), result_file), name=f"rank{rank}", daemon=True
        )
        proc.start()
        procs.append(proc)

    deadline = time.monotonic() + timeout_s
    first_failure: float | None = None
    while True:
        alive = [p for p in procs if p.exitcode is None]
        if not alive:
            break
        if first_failure is None and any(p.exitcode not in (None, 0) for p in procs):
            first_failure = time.monotonic()
        now = time.monotonic()
        limit = deadline if first_failure is None else min(deadline, first_failure + grace_s)
        if now >= limit:
            break
        multiprocessing.connection.wait([p.sentinel for p in alive], timeout=min(0.5, limit - now))

    reports: dict[int, tuple[int | None, str]] = {}
    results: list[Any] = []
    for rank, proc in enumerate(procs):
        if proc.exitcode is None:
            proc.kill()
            proc.join(5)
            reason = "deadline" if first_failure is None else "grace period after another rank failed"
            waited = timeout_s if first_failure is None else grace_s
            reports[rank] = (None, f"still running after the {reason} ({waited:.0f} s); killed")
            results.append(None)
            continue
        proc.join()
        result_file = world_dir / f"rank{rank}.pkl"
        if not result_file.exists():
            reports[rank] = (proc.exitcode or 1, f"exited with code {proc.exitcode} without a result")
            results.append(None)
            continue
        with open(result_file, "rb") as f:
            status, value = pickle.load(f)
        if status == "ok" and proc.exitcode == 0:
            reports[rank] = (0, "")
            results.append(value)
        else:
            reports[rank] = (proc.exitcode or 1, value if status == "error" else "")
            results.append(None)
    if any(code != 0 for code, _ in reports.values()):
        raise RankFailureError(f"{spec[2]} on {world_size} ranks", reports)
    return results
