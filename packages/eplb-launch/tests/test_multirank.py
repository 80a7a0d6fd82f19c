from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import pytest

from ascend_eplb.launch import RankFailureError, load_module, run_ranks

rank_fns = load_module(Path(__file__).with_name("rank_fns.py"))


def test_results_of_every_rank_come_back(tmp_path):
    assert run_ranks(rank_fns.allreduce_rank, world_size=3, tmp_path=tmp_path, args=(10,)) == [33, 33, 33]


def test_a_rank_never_collects_what_it_inherited_from_the_fork_server(tmp_path):
    # gc.freeze() at the rank's start: the fork server's modules are in the permanent generation (a
    # collection neither traverses them nor writes to their pages); the rank's own objects are collected.
    assert run_ranks(rank_fns.collected_objects, world_size=2, tmp_path=tmp_path) == [(False, True)] * 2


def test_init_gloo_returns_once_every_rank_has_connected(tmp_path):
    # Without the barrier a rank with nothing to run left while a peer was still in Gloo's
    # connectFullMesh, which then failed with "Connection closed by peer" (CI, split_world on 4 ranks).
    assert run_ranks(rank_fns.leave_at_once, world_size=3, tmp_path=tmp_path) == [True, True, True]


def test_exception_of_one_rank_is_surfaced_with_traceback(tmp_path):
    with pytest.raises(RankFailureError) as info:
        run_ranks(rank_fns.raise_on_rank_one, world_size=2, tmp_path=tmp_path)
    assert info.value.reports[0] == (0, "")
    code, detail = info.value.reports[1]
    assert code == 1
    assert "RuntimeError: rank one refuses" in detail
    assert "--- rank 1: exit code 1" in str(info.value)


def test_exit_code_of_a_dying_rank_is_surfaced(tmp_path):
    with pytest.raises(RankFailureError) as info:
        run_ranks(rank_fns.exit_on_rank_zero, world_size=2, tmp_path=tmp_path)
    assert info.value.reports[0][0] == 7
    assert info.value.reports[1] == (0, "")


def test_deadline_kills_every_rank(tmp_path):
    start = time.monotonic()
    with pytest.raises(RankFailureError) as info:
        run_ranks(rank_fns.sleep_forever, world_size=2, tmp_path=tmp_path, timeout_s=2.0)
    assert time.monotonic() - start < 15
    assert {code for code, _ in info.value.reports.values()} == {None}
    assert "still running after the deadline" in info.value.reports[0][1]


def test_peer_blocked_on_a_dead_rank_is_killed_after_grace(tmp_path):
    start = time.monotonic()
    with pytest.raises(RankFailureError) as info:
        run_ranks(rank_fns.wait_for_dead_peer, world_size=2, tmp_path=tmp_path, timeout_s=120, grace_s=1.0)
    assert time.monotonic() - start < 30
    assert "rank one died" in info.value.reports[1][1]
    assert info.value.reports[0][0] in (None, 1)


def test_the_ranks_share_a_temporary_folder_removed_with_what_they_left_there(tmp_path):
    # vLLM's IPC sockets (shm_broadcast's, under TP > 1) go to the temporary folder and a rank's os._exit
    # never unlinks them: they went to the host's /tmp, two per world. Now the world's own folder, beside
    # the launcher's (a short path: AF_UNIX's 108 bytes), removed once the ranks have ended.
    results = run_ranks(rank_fns.leave_a_socket, world_size=2, tmp_path=tmp_path)
    folders = {(found, env) for found, env, _ in results}
    assert len(folders) == 1
    ((folder, env),) = folders
    assert folder == env
    assert Path(folder).parent == Path(tempfile.gettempdir())
    assert Path(folder).name.startswith("ascend-eplb-ranks-")
    assert [path for _, _, path in results] == [os.path.join(folder, "ipc-0"), os.path.join(folder, "ipc-1")]
    assert not Path(folder).exists()


def test_the_temporary_folder_goes_when_the_deadline_kills_the_ranks(tmp_path):
    paths: list[str] = []
    with pytest.raises(RankFailureError):
        run_ranks(
            rank_fns.leave_a_file_then_sleep, world_size=2, tmp_path=tmp_path, timeout_s=10.0,
            on_message=lambda rank, path: paths.append(path),
        )  # fmt: skip
    assert len(paths) == 2
    assert len({Path(p).parent for p in paths}) == 1
    assert not Path(paths[0]).parent.exists()


def test_functions_must_be_module_level(tmp_path):
    def local(ctx):
        return 0

    with pytest.raises(ValueError, match="must be defined at module level"):
        run_ranks(local, world_size=1, tmp_path=tmp_path)


def test_world_size_is_bounded(tmp_path):
    with pytest.raises(ValueError, match=r"world_size=0 must be in \[1, 8\]"):
        run_ranks(rank_fns.allreduce_rank, world_size=0, tmp_path=tmp_path)
