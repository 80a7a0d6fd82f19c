"""Rank functions of the harness's own tests (loaded by path in each rank process)."""

from __future__ import annotations

import gc
import os
import socket
import tempfile
import time

import torch
import torch.distributed as dist

from ascend_eplb.launch import RankContext


def allreduce_rank(ctx: RankContext, value: int) -> int:
    ctx.init_gloo()
    t = torch.tensor([value + ctx.rank])
    dist.all_reduce(t)
    return int(t.item())


def raise_on_rank_one(ctx: RankContext) -> int:
    if ctx.rank == 1:
        raise RuntimeError("rank one refuses")
    return ctx.rank


def exit_on_rank_zero(ctx: RankContext) -> None:
    import os

    if ctx.rank == 0:
        os._exit(7)


def sleep_forever(ctx: RankContext) -> None:
    time.sleep(3600)


def wait_for_dead_peer(ctx: RankContext) -> None:
    """Rank 1 dies before the collective; rank 0 would block on it until killed."""
    ctx.init_gloo(timeout_s=3600)
    if ctx.rank == 1:
        raise RuntimeError("rank one died before the all_reduce")
    dist.all_reduce(torch.ones(1))


def collected_objects(ctx: RankContext) -> tuple[bool, bool]:
    """Whether the garbage collector tracks (would traverse) a module inherited from the fork server,
    and an object this rank made."""
    import multiprocessing

    made_here = [[ctx.rank]]  # a list is always tracked (a dict of atoms is not)
    tracked = {id(obj) for obj in gc.get_objects()}
    return id(multiprocessing.__dict__) in tracked, id(made_here) in tracked


def leave_at_once(ctx: RankContext) -> bool:
    """Rank 1 is slow to finish connecting (a sleep after its ``init_process_group``, then a marker
    file); whether the marker exists when ``init_gloo`` returns on this rank (it must on every rank)."""
    marker = ctx.tmp_dir / "rank1-connected"
    if ctx.rank == 1:
        connect = dist.init_process_group

        def slow_connect(*args, **kwargs):
            connect(*args, **kwargs)
            time.sleep(1.0)
            marker.touch()

        dist.init_process_group = slow_connect
    ctx.init_gloo()
    return marker.exists()


def leave_a_socket(ctx: RankContext) -> tuple[str, str, str]:
    """Bind a Unix socket in the temporary folder, as vLLM's IPC does, and never unlink it (the rank ends
    in ``os._exit``); returns the temporary folder (tempfile's and ``TMPDIR``) and the socket's path."""
    path = os.path.join(tempfile.gettempdir(), f"ipc-{ctx.rank}")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(path)
    return tempfile.gettempdir(), os.environ["TMPDIR"], path


def leave_a_file_then_sleep(ctx: RankContext) -> None:
    """A file in the temporary folder, its path sent to the launcher, then no end (killed at the deadline)."""
    fd, path = tempfile.mkstemp()
    os.close(fd)
    ctx.send(path)
    time.sleep(3600)
