"""The one reader and the one writer (issue 43, cases 1 and 2): only regular files are read, at most a cap
per kind, never blocking; only regular files (or a link's regular target) are replaced, never an input."""

from __future__ import annotations

import os
import socket
import stat
import threading

import pytest

from ascend_eplb.integration import regular_files as rf
from ascend_eplb.integration.guardrail_facts import serving_switch_errors


def _in_thread(call, seconds: float = 10.0):
    """``call()``'s result or exception, from a thread given ``seconds``: a read that blocks (a FIFO with
    no writer) fails the test instead of hanging it."""
    out: list = []

    def run() -> None:
        try:
            out.append(call())
        except Exception as e:
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert out, f"{call} blocked for {seconds} s"
    return out[0]


def _unix_socket(path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    return s


def test_only_a_regular_file_is_read_and_a_fifo_without_a_writer_never_blocks(tmp_path):
    good = tmp_path / "placement.json"
    good.write_bytes(b"{}")
    assert rf.read_regular_file(good, rf.PLACEMENT_FILE) == b"{}"
    link = tmp_path / "link.json"
    link.symlink_to(good)
    assert rf.read_regular_file(link, rf.PLACEMENT_FILE) == b"{}"
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    refused = _in_thread(lambda: rf.read_regular_file(fifo, rf.CONFIG_FILE))
    assert str(refused) == (
        f"{fifo}: is a FIFO, not a regular file (reading it would block or never end); fix: name a regular "
        "file; copy what it holds into one first"
    )
    to_fifo = tmp_path / "to-fifo.json"
    to_fifo.symlink_to(fifo)
    assert str(_in_thread(lambda: rf.read_regular_file(to_fifo, rf.CONFIG_FILE))).startswith(
        f"{to_fifo}: is a FIFO, not a regular file"
    )
    sock = _unix_socket(tmp_path / "s.sock")
    try:
        assert str(_in_thread(lambda: rf.read_regular_file(tmp_path / "s.sock", rf.CONFIG_FILE))).startswith(
            f"{tmp_path / 's.sock'}: is a socket, not a regular file"
        )
    finally:
        sock.close()
    assert str(_in_thread(lambda: rf.read_regular_file(tmp_path, rf.CONFIG_FILE))) == (
        f"{tmp_path}: is a folder, not a file to read; fix: name the file, not its folder"
    )
    assert str(_in_thread(lambda: rf.read_regular_file(tmp_path / "absent", rf.CONFIG_FILE))) == (
        f"{tmp_path / 'absent'}: no such file"
    )


def test_a_file_beyond_its_kinds_cap_is_refused_unread_and_the_switch_raises_the_cap(tmp_path, monkeypatch):
    monkeypatch.delenv(rf.ENV_MAX_INPUT_MIB, raising=False)
    big = tmp_path / "config.json"
    with open(big, "wb") as f:
        f.truncate((rf.CONFIG_FILE.max_mib + 1) * rf.MIB)  # sparse: nothing on disk
    refused = _in_thread(lambda: rf.read_regular_file(big, rf.CONFIG_FILE))
    assert str(refused) == (
        f"{big}: 17.0 MiB, more than the 16 MiB a config file is read up to (not read); fix: name the right "
        "file, or raise the limit: ascend-eplb's --max-input-mib 17 (ASCEND_EPLB_MAX_INPUT_MIB=17 for a "
        "server)"
    )
    with rf.input_limit(17):
        assert os.environ[rf.ENV_MAX_INPUT_MIB] == "17"  # what rank processes started inside read
        assert len(rf.read_regular_file(big, rf.CONFIG_FILE)) == 17 * rf.MIB
    assert rf.ENV_MAX_INPUT_MIB not in os.environ
    # The switch itself: judged with the serving switches, one line, before anything is read.
    assert rf.max_input_mib({rf.ENV_MAX_INPUT_MIB: " "}) is None
    assert [e for e in serving_switch_errors({rf.ENV_MAX_INPUT_MIB: "lots"}) if "MAX_INPUT" in e] == [
        "ASCEND_EPLB_MAX_INPUT_MIB='lots': must be an integer >= 1 (MiB); unset: each file's own cap"
    ]
    monkeypatch.setenv(rf.ENV_MAX_INPUT_MIB, "0")  # refused by the switch check; the reader keeps the cap
    assert isinstance(_in_thread(lambda: rf.read_regular_file(big, rf.CONFIG_FILE)), rf.RegularFileError)


def test_the_writer_replaces_a_regular_file_whole_keeping_its_mode_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "placement.json"
    assert rf.write_regular_file(target, "one\n") == target
    target.write_text("old")
    target.chmod(0o640)
    rf.write_regular_file(target, b"two\n")
    assert (target.read_text(), stat.S_IMODE(target.stat().st_mode)) == ("two\n", 0o640)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["placement.json"]


def test_a_link_to_a_regular_file_has_its_target_replaced_and_stays_a_link(tmp_path):
    real = tmp_path / "real.json"
    real.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    assert rf.write_regular_file(link, "new") == real
    assert link.is_symlink()
    assert os.readlink(link) == str(real)
    assert real.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "real.json"]


def test_a_fifo_a_socket_a_folder_and_links_to_them_or_to_nothing_are_never_replaced(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    sock = _unix_socket(tmp_path / "s.sock")
    folder = tmp_path / "folder"
    folder.mkdir()
    to_fifo, dangling = tmp_path / "to-fifo", tmp_path / "dangling"
    to_fifo.symlink_to(fifo)
    dangling.symlink_to(tmp_path / "nothing")
    try:
        refusals = {
            path.name: str(_in_thread(lambda path=path: rf.write_regular_file(path, "x")))
            for path in (fifo, tmp_path / "s.sock", folder, to_fifo, dangling)
        }
    finally:
        sock.close()
    replaced = "not a regular file (only a regular file is replaced); fix: name a regular file"
    assert refusals == {
        "fifo": f"{fifo}: is a FIFO, {replaced}",
        "s.sock": f"{tmp_path / 's.sock'}: is a socket, {replaced}",
        "folder": f"{folder}: is a folder, not a file to write; fix: name the file, not its folder",
        "to-fifo": f"{to_fifo}: is a symbolic link to {fifo}, a FIFO, {replaced}",
        "dangling": f"{dangling}: is a symbolic link to {tmp_path / 'nothing'}, which does not exist (a link "
        "is written through only to a regular file); fix: name the file to write, not the link",
    }
    # Each is what it was, and nothing was left beside it.
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert stat.S_ISSOCK(os.lstat(tmp_path / "s.sock").st_mode)
    assert to_fifo.is_symlink()
    assert dangling.is_symlink()
    assert folder.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "fifo", "folder", "s.sock", "to-fifo"]


def test_an_input_of_the_same_run_is_never_written_by_any_of_its_names(tmp_path):
    events = tmp_path / "events.jsonl"
    events.write_text("recorded\n")
    hard = tmp_path / "hard.jsonl"
    os.link(events, hard)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    inputs = [("the load", events), ("--model-config", model)]
    for name in (events, hard, model / "config.json"):
        problem = rf.writable_file_problem(name, inputs)
        assert str(problem).startswith(f"{name}: is the file "), (name, problem)
        with pytest.raises(rf.RegularFileError, match="writing it would destroy that input"):
            rf.write_regular_file(name, "placement", inputs)
    assert events.read_text() == "recorded\n"
    assert (model / "config.json").read_text() == "{}"
    assert rf.writable_file_problem(tmp_path / "placement.json", inputs) is None
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert str(rf.writable_file_problem(blocker / "p.json")) == (
        f"{blocker / 'p.json'}: {blocker} is a file, not a folder: nothing can be written under it"
    )
