"""How ``ascend-eplb simulate`` ends, with real processes: a signal mid-run, the deadline during
start-up, a failed check, a crashed rank. Every time: the exit code, one line on stderr, no process of
the run left (found by a marker in their environment, reparented or not), nothing left in ``$TMPDIR``
(vLLM's message-queue sockets, torch's cache, the launcher's scratch), no "leaked" warning."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from ascend_eplb.tools.cli import main

SCRIPT = Path(sys.executable).with_name("ascend-eplb")


@pytest.fixture(autouse=True)
def _hangup_from_a_terminal():
    """The hangups these tests send are a terminal's: each test starts with SIGHUP's default disposition,
    in this process and the commands it starts. A runner started under nohup ignores SIGHUP, which the
    command then keeps ignoring on purpose (the test of a signal the process ignores)."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGHUP, previous)


#: vLLM 0.33.0's import-time notices on a host without an accelerator (SIMULATE.md), from the launcher
#: and the fork server; everything else on stderr is the command's own.
VLLM_NOTICES = (
    "Failed to import from vllm._C",
    "Triton is not installed",
    "Reset SSM cache type",
    "Model Runner V2 requires Triton",
)
SMALL = [
    "--model",
    "replay",
    "--ranks",
    "2",
    "--redundant-experts",
    "2",
    "--layers",
    "1",
    "--batch-size",
    "16",
    "--no-progress",
]


class Run:
    """One ``ascend-eplb simulate`` subprocess with a private, short ``$TMPDIR`` and a marker."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        self.marker = uuid.uuid4().hex
        # Short on purpose: vLLM's socket paths ($TMPDIR/<uuid>) must fit a unix socket address.
        self.tmpdir = Path(tempfile.mkdtemp(prefix="ae-", dir="/tmp"))
        self.out = tmp_path / "out"
        env = os.environ | {
            "TMPDIR": str(self.tmpdir),
            "ASCEND_EPLB_TEST_MARKER": self.marker,
            "VLLM_TARGET_DEVICE": "cpu",
            "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1",
        }
        env.pop("TORCHINDUCTOR_CACHE_DIR", None)
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [str(SCRIPT), "simulate", *args, "--out", str(self.out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    def processes(self) -> list[int]:
        """Pids of live processes carrying this run's marker (the launcher and all it started)."""
        found = []
        needle = f"ASCEND_EPLB_TEST_MARKER={self.marker}".encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if needle in (entry / "environ").read_bytes():
                    state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                    if state != "Z":
                        found.append(int(entry.name))
            except OSError:
                continue
        return found

    def wait_ranks_running(self, timeout: float = 300) -> list[Path]:
        """Block until both ranks recorded their vLLM resources (the world is up, mid-run)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            records = list(self.tmpdir.glob("ascend-eplb-simulate-*/world-*/resources-rank*.json"))
            if len(records) == 2:
                return records
            assert self.proc.poll() is None, self.proc.communicate()
            time.sleep(0.2)
        raise AssertionError("ranks did not start")

    def finish(self, timeout: float = 300) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=timeout)
        self.elapsed = time.monotonic() - self.t0
        return self.proc.returncode, out, err

    def assert_nothing_left(self, err: str) -> None:
        time.sleep(0.2)
        assert self.processes() == []
        assert sorted(p.name for p in self.tmpdir.iterdir()) == []
        assert "leaked" not in err
        shutil.rmtree(self.tmpdir)


def _own_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line and not line.startswith(VLLM_NOTICES)]


def _ranks(run: Run) -> list[int]:
    """The rank processes: children of the run's fork server."""
    pids = run.processes()
    parents = {pid: int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) for pid in pids}
    server = [pid for pid in pids if parents[pid] == run.proc.pid and b"forkserver" in
              Path(f"/proc/{pid}/cmdline").read_bytes()]  # fmt: skip
    assert len(server) == 1, server
    return sorted(pid for pid, parent in parents.items() if parent == server[0])


@pytest.mark.multirank
@pytest.mark.parametrize(("sig", "code"), [("SIGTERM", 143), ("SIGHUP", 129), ("SIGINT", 130)])
def test_a_signal_mid_run_stops_every_process_removes_the_scratch_and_prints_one_line(tmp_path, sig, code):
    run = Run(tmp_path, *SMALL, "--steps", "100000", "--timeout", "300")
    run.wait_ranks_running()
    assert len(_ranks(run)) == 2
    time.sleep(1.0)
    if sig == "SIGINT":
        os.killpg(run.proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole process group
    else:
        run.proc.send_signal(getattr(signal, sig))  # kill -TERM / -HUP <launcher pid>
    returncode, out, err = run.finish(timeout=60)  # at once: a fifth of the 300 s deadline at most
    assert returncode == code, err
    expected = f"ascend-eplb simulate: stopped by {sig}; every rank was stopped, nothing left behind"
    assert _own_lines(err) == [expected]
    assert "Traceback" not in err
    assert out == ""
    run.assert_nothing_left(err)


@pytest.mark.multirank
@pytest.mark.parametrize(("sig", "code"), [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_while_vllms_engine_starts_compiled_stops_every_process_and_leaves_nothing(
    tmp_path, sig, code
):
    """Issue 43 cases 5 and 6 on vLLM's engine: a signal while the EPLB-off engine starts (``--compile
    eager``: its workers import vLLM's model registry and trace) ends in one line, exit 128 + signal, no
    process of the run alive (the engine's host, core and workers run in a session of their own: Ctrl-C to
    the terminal's group does not reach them, the command stops them) and nothing in ``$TMPDIR`` (the
    engine's scratch, vLLM's compile cache and torch's included)."""
    run = Run(tmp_path, "--model", "qwen3-moe", "--ranks", "2", "--compile", "eager", "--steps", "8",
              "--no-progress")  # fmt: skip
    end = time.monotonic() + 240
    while len(run.processes()) < 4:  # the command, the engine's host, its core and a worker
        assert run.proc.poll() is None, run.proc.communicate()
        assert time.monotonic() < end, "vLLM's engine did not start its workers"
        time.sleep(0.2)
    time.sleep(3.0)
    sent = time.monotonic()
    if sig == "SIGINT":
        os.killpg(run.proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the command's group
    else:
        run.proc.send_signal(signal.SIGTERM)
    returncode, out, err = run.finish(timeout=120)
    assert returncode == code, err
    assert time.monotonic() - sent < 60
    assert _own_lines(err) == [
        f"ascend-eplb simulate: stopped by {sig}; every rank was stopped, nothing left behind"
    ]
    assert out == ""
    run.assert_nothing_left(err)


@pytest.mark.multirank
def test_the_timeout_is_the_deadline_of_the_whole_run_start_up_included(tmp_path):
    # Start-up alone (vLLM imported by the fork server) takes longer than 3 s: the deadline passes before
    # any rank steps, so the phase it names is one of start-up's. (No wall-time bound: a loaded host
    # stops the processes later, and the phase, not the clock, says what the deadline counted.)
    run = Run(tmp_path, *SMALL, "--steps", "8", "--timeout", "3")
    returncode, _, err = run.finish()
    assert returncode == 1, err
    lines = _own_lines(err)
    assert len(lines) == 1, err  # the one line of the command, whatever else a rank printed
    (line,) = lines
    assert line.startswith(
        "ascend-eplb simulate: error: simulation failed: the deadline (--timeout 3 s, start-up included) "
        "passed while "
    ), line
    assert line.endswith("; every process of the run was stopped")
    phase = line.split(" passed while ", 1)[1].removesuffix("; every process of the run was stopped")
    assert phase in ("reading the routing", "starting the ranks (the fork server imports vLLM)"), line
    assert not (run.out / "report.json").exists()
    run.assert_nothing_left(err)


def _stale(out: Path) -> None:
    out.mkdir(parents=True)
    (out / "report.json").write_text(json.dumps({"passed": True, "stale": True}))
    (out / "balancedness.png").write_bytes(b"stale")
    (out / "events.jsonl").write_text('{"event": "stale"}\n')


@pytest.mark.multirank
def test_a_passing_run_leaves_nothing_behind(tmp_path):
    # Interval 4 over 12 steps: the last rearrangement starts in the run's last steps, so one still in
    # flight at the end is judged "not progressing" only if a cycle took longer than the interval. With
    # interval 2 over 6 steps, a loaded host's worker 3 steps late on the last cycle made the run rightly
    # "not fully judged" (exit 3): CI saw it once.
    # A cycle may still be in flight when the run ends (a loaded host's worker lags the fast replay steps;
    # CI saw it once): then each rank's watchdog says so at shutdown, exactly what report.json records,
    # and nothing else may be printed.
    from ascend_eplb.integration.guardrail_facts import InFlightAtShutdown

    run = Run(tmp_path, *SMALL, "--steps", "12", "--window-size", "1", "--step-interval", "4")
    returncode, out, err = run.finish()
    report = json.loads((run.out / "report.json").read_text())
    in_flight = report["in_flight_at_end"]
    # Passed, or (a loaded host) every check passed but the worker's, not judged with the last cycle in
    # flight at the end: exit 3, that cycle named. Either way nothing may be left.
    if returncode == 3:
        assert (report["verdict"], report["checks"]["worker"], bool(in_flight)) == ("not judged", None, True)
    else:
        assert returncode == 0, err
        assert "PASSED in" in out
    expected = [InFlightAtShutdown(**cycle).message() for cycle in in_flight]
    assert sorted(_own_lines(err)) == sorted(expected)
    run.assert_nothing_left(err)


@pytest.mark.multirank
@pytest.mark.timeout(900)
def test_a_passing_inductor_run_on_vllms_engine_leaves_no_compile_cache_behind(tmp_path):
    """Issue 43 case 7 on vLLM's engine: ``--compile inductor`` left 149 MB in
    ``$TMPDIR/torchinductor_<user>/precompiled_headers`` after a passing run. vLLM's engines compile with
    their ``TMPDIR`` (inductor's cache) and ``VLLM_CACHE_ROOT`` (vLLM's compile cache) in the run's
    scratch, removed with it: nothing is left in ``$TMPDIR``, and no process of the run."""
    run = Run(tmp_path, "--model", "qwen3-moe", "--ranks", "2", "--compile", "inductor", "--steps", "8",
              "--batch-size", "2", "--no-progress", "--timeout", "840")  # fmt: skip
    returncode, out, err = run.finish(timeout=870)
    assert returncode == 0, err
    assert "PASSED in" in out
    run.assert_nothing_left(err)


@pytest.mark.multirank
def test_a_failed_check_writes_a_failed_report_over_a_stale_one_and_leaves_nothing_behind(tmp_path):
    _stale(tmp_path / "out")
    run = Run(tmp_path, *SMALL, "--steps", "8", "--window-size", "1", "--step-interval", "2",
              "--fault", "wrong-lookup-refresh")  # fmt: skip
    returncode, _, err = run.finish()
    assert returncode == 1, err
    report = json.loads((run.out / "report.json").read_text())
    assert report["passed"] is False
    assert "stale" not in report
    assert report["first_violation"].startswith("lookups:")
    assert (run.out / "balancedness.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "stale" not in (run.out / "events.jsonl").read_text()
    run.assert_nothing_left(err)


@pytest.mark.multirank
def test_a_crashed_rank_fails_the_run_removes_stale_results_and_leaves_nothing_behind(tmp_path):
    _stale(tmp_path / "out")
    run = Run(tmp_path, *SMALL, "--steps", "100000", "--timeout", "300")
    run.wait_ranks_running()
    os.kill(_ranks(run)[1], signal.SIGKILL)  # rank 1 dies holding vLLM's resources
    returncode, _, err = run.finish()
    assert returncode == 1, err
    # When rank 1 dies during a transfer, the surviving rank's async worker logs the broken transfer
    # (upstream's logger.exception: the "async loop error" line, naming rank 1, then its traceback) before
    # the launcher stops it: lines about the same crash, written by the rank, which may come before the
    # command's own error block, and nothing else may.
    own = _own_lines(err)
    start = own.index("ascend-eplb simulate: error: simulation failed:")
    before, lines = own[:start], own[start:]
    assert before == [] or (
        before[0].startswith("async loop error (Rank 0): ")
        and before[1:2] in ([], ["Traceback (most recent call last):"])
    ), before
    assert "--- rank 1: exited with code -9 without a result" in lines
    assert sorted(p.name for p in run.out.iterdir()) == []  # no stale report, plot or events
    run.assert_nothing_left(err)


def _import_wrapped_by_a_library() -> None:
    from ascend_eplb.tools.simulate.lifecycle import DeadlineExceededError

    try:
        time.sleep(5)  # the alarm comes 0.5 s after the deadline
    except DeadlineExceededError as e:
        raise RuntimeError("Failed to import transformers.something because of the error above") from e


def test_the_deadline_ends_the_run_even_when_a_library_wraps_the_alarm_in_its_own_error():
    """transformers' lazy imports re-raise an error raised during an import as their RuntimeError: the
    alarm must still end the run as the deadline, with its one line, not as that library's error."""
    from ascend_eplb.tools.simulate.lifecycle import DeadlineExceededError, RunPhase, deadline_alarm

    def run() -> None:
        with deadline_alarm(time.monotonic() - 1.0, 3.0, RunPhase("importing")):
            _import_wrapped_by_a_library()

    with pytest.raises(DeadlineExceededError) as info:
        run()
    assert str(info.value) == (
        "simulation failed: the deadline (--timeout 3 s, start-up included) passed while importing; every "
        "process of the run was stopped"
    )


class _SlowFinalizer:
    def __del__(self) -> None:
        time.sleep(0.8)  # the alarm (0.5 s after the deadline) fires in here, where Python drops errors


def test_the_deadline_ends_the_run_even_when_the_alarm_fires_inside_a_finalizer(capsys):
    """CI caught it: the alarm fired inside regex's ``Group.__del__`` during vLLM's import; Python
    printed "Exception ignored in ..." with a traceback and dropped the error. The deadline must still
    end the scope, and nothing but the command's own line may reach stderr."""
    from ascend_eplb.tools.simulate.lifecycle import DeadlineExceededError, RunPhase, deadline_alarm

    hook = sys.unraisablehook
    reached = []

    def run() -> None:
        with deadline_alarm(time.monotonic(), 3.0, RunPhase("importing")):
            _SlowFinalizer()  # dropped at once: its __del__ runs here
            reached.append("after the finalizer")
            time.sleep(5)

    with pytest.raises(DeadlineExceededError):
        run()
    assert reached == ["after the finalizer"]  # the dropped alarm came again, after the finalizer
    assert capsys.readouterr().err == ""
    assert sys.unraisablehook is hook  # the scope's hook is gone with it


#: Exit status of a command stopped by each signal (128 + signal number).
STOPPED = {"SIGTERM": 143, "SIGHUP": 129, "SIGINT": 130}


def _stop_here(monkeypatch: pytest.MonkeyPatch, target: object, name: str, sig: str) -> None:
    """``target.name`` becomes a call during which ``sig`` arrives (a CI timeout, a cancelled job,
    Ctrl-C), deep inside the command: where readers turn any ``Exception`` into a refusal."""

    def stopped(*_args: object, **_kwargs: object) -> None:
        os.kill(os.getpid(), getattr(signal, sig))
        time.sleep(10)  # the handler raises here
        raise AssertionError(f"{sig} did not stop the command")

    monkeypatch.setattr(target, name, stopped)


@pytest.mark.parametrize("sig", STOPPED)
@pytest.mark.parametrize("command", ["plan", "check a file", "check -- serve", "simulate"])
def test_a_signal_during_any_subcommand_stops_it_with_its_one_line(
    tmp_path, capsys, monkeypatch, command, sig
):
    """Issue 31: SIGTERM during ``check`` printed INVALID (exit 2) with a violation about stopped ranks
    that do not exist (the reader took the stop for a bad file); every command stops as ``simulate``."""
    import ascend_eplb.tools.check as check
    import ascend_eplb.tools.check.engine_args as engine_args
    import ascend_eplb.tools.trace as trace
    from ascend_eplb.tools.simulate.config import SimulateConfig

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"parallel_config": {"enable_eplb": False}}))
    load = tmp_path / "load.json"
    load.write_text("[[1, 2], [3, 4]]")
    argv, (target, name) = {
        "plan": (["plan", str(load), "--ranks", "2"], (trace, "_read_load")),
        "check a file": (["check", str(config)], (check, "settings_from_file_dict")),
        "check -- serve": (
            ["check", "--", "serve", "m", "--enable-eplb"],
            (engine_args, "parse_serve_command"),
        ),
        "simulate": (
            ["simulate", "--model", "replay", "--out", str(tmp_path / "o")],
            (SimulateConfig, "validate"),
        ),
    }[command]
    _stop_here(monkeypatch, target, name, sig)
    code = main(argv)
    out, err = capsys.readouterr()
    word = argv[0]
    tail = "; every rank was stopped, nothing left behind" if word == "simulate" else ""
    assert (code, out, err) == (STOPPED[sig], "", f"ascend-eplb {word}: stopped by {sig}{tail}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "load.json"]  # nothing written


#: A command stopped while its parser is built (which imports torch: about 5 s of a 10 s ``check``).
EARLY_STOP = """
import os, signal, sys, time
import ascend_eplb.tools.cli as cli

def building_the_parser():
    os.kill(os.getpid(), getattr(signal, sys.argv[1]))
    time.sleep(10)
    raise AssertionError("the signal did not stop the command")

cli.build_parser = building_the_parser
sys.exit(cli.main(sys.argv[2:]))
"""


@pytest.mark.parametrize("sig", STOPPED)
@pytest.mark.parametrize("command", ["plan", "check", "simulate"])
def test_a_signal_before_the_command_runs_stops_it_with_its_one_line(command, sig):
    """Before its own handling began (while building the parser imported torch), SIGTERM and SIGHUP
    killed the command without a word and Ctrl-C printed an 18-line ``KeyboardInterrupt`` traceback."""
    done = subprocess.run(
        [sys.executable, "-c", EARLY_STOP, sig, command, "x"], capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stdout, done.stderr) == (
        STOPPED[sig],
        "",
        f"ascend-eplb {command}: stopped by {sig}\n",
    )


def test_a_reader_that_closes_the_pipe_ends_the_command_as_sigpipe_without_a_traceback(
    tmp_path, monkeypatch, capsys
):
    """``ascend-eplb plan ... | head -1`` ended in a ``BrokenPipeError`` traceback (exit 1)."""
    load = tmp_path / "load.json"
    load.write_text("[[1, 2], [3, 4]]")

    class ClosedPipe:
        def write(self, _text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self) -> None:
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main(["plan", str(load), "--ranks", "2"]) == 128 + signal.SIGPIPE
    assert capsys.readouterr().err == ""
    print("more output goes nowhere")  # stdout is os.devnull now: the last flush cannot fail


def test_a_signal_the_process_ignores_stays_ignored_inside_a_command():
    # nohup ignores SIGHUP: a command run under it must not stop on a hangup (check -- serve exited 129)
    from ascend_eplb.tools.simulate.lifecycle import command_scope

    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with command_scope("check"):
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_IGN, signal.SIG_DFL)
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


#: Holds the output folder argv[1] (``own_output_folder``) and says so on stdout, until killed.
HOLDER = """
import sys, time
from ascend_eplb.tools.simulate.lifecycle import own_output_folder
with own_output_folder(sys.argv[1]):
    print("holding", flush=True)
    time.sleep(300)
"""


def test_an_output_folder_has_one_owner_and_a_dead_owners_lock_is_taken_over(tmp_path):
    """Issue 38: a second run on one ``--out`` deleted the first's live events.jsonl. The owner holds a
    ``flock`` on the folder's lock file: a live one is named (pid, host, start); a killed one holds
    nothing (the kernel released its lock), and its lock file is taken over."""
    from ascend_eplb.tools.simulate.lifecycle import OUTPUT_LOCK, OutputFolderInUseError, own_output_folder

    argv = [sys.executable, "-c", HOLDER, str(tmp_path)]
    holder = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "holding\n"
        written = json.loads((tmp_path / OUTPUT_LOCK).read_text())
        assert written["pid"] == holder.pid
        with pytest.raises(OutputFolderInUseError) as refused, own_output_folder(tmp_path):
            pass
        assert str(refused.value) == (
            f"out={tmp_path}: in use by another run (ascend-eplb simulate, pid {holder.pid} on "
            f"{written['host']}, started {written['started']}); two runs in one folder delete and mix each "
            "other's events.jsonl, report.json and balancedness.png: wait for it to end, or give another "
            "--out"
        )
    finally:
        holder.kill()  # SIGKILL: no clean-up of its own, the lock file stays
        holder.wait()
    assert json.loads((tmp_path / OUTPUT_LOCK).read_text())["pid"] == holder.pid  # stale, left behind
    with own_output_folder(tmp_path):
        assert json.loads((tmp_path / OUTPUT_LOCK).read_text())["pid"] == os.getpid()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # the owner's end removes it


@pytest.mark.multirank
def test_a_second_run_on_the_same_output_folder_is_refused_and_a_stopped_run_leaves_none_of_its_files(
    tmp_path,
):
    """Issue 38: the second run on one ``--out`` deleted the first's live events.jsonl (the first then
    reported rearrangements beside no records, naming a file that no longer existed), and after a SIGTERM
    the folder held one run's report beside another's partial events. The second is refused naming the
    first; the first's events grow on untouched; stopped, the first leaves none of its files."""
    from ascend_eplb.tools.simulate.lifecycle import OUTPUT_LOCK

    first = Run(tmp_path, *SMALL, "--steps", "100000", "--timeout", "300")
    first.wait_ranks_running()
    events = first.out / "events.jsonl"
    end = time.monotonic() + 120
    while not (events.exists() and events.stat().st_size > 0):
        assert time.monotonic() < end, "the first run wrote no events"
        assert first.proc.poll() is None, first.proc.communicate()
        time.sleep(0.2)
    written = json.loads((first.out / OUTPUT_LOCK).read_text())
    assert written["pid"] == first.proc.pid
    inode, size = events.stat().st_ino, events.stat().st_size
    second = Run(tmp_path, *SMALL, "--steps", "8")
    code, out, err = second.finish()
    assert (code, out) == (2, "")
    assert _own_lines(err) == [
        f"ascend-eplb simulate: error: out={first.out}: in use by another run (ascend-eplb simulate, pid "
        f"{first.proc.pid} on {written['host']}, started {written['started']}); two runs in one folder "
        "delete and mix each other's events.jsonl, report.json and balancedness.png: wait for it to end, or "
        "give another --out"
    ]
    second.assert_nothing_left(err)
    time.sleep(1.0)
    assert events.stat().st_ino == inode  # the first's, still growing
    assert events.stat().st_size > size
    first.proc.send_signal(signal.SIGTERM)
    code, _, err = first.finish(timeout=60)
    assert code == 143, err
    assert sorted(p.name for p in first.out.iterdir()) == []  # no report: none of its files, no lock
    first.assert_nothing_left(err)


def test_a_refusal_that_needs_vllms_model_class_is_one_message_exit_2_and_nothing_left(tmp_path):
    """Issue 38: a Qwen2-MoE folder (vLLM 0.33.0's class has no MixtureOfExperts part: start-up's rule
    moe-model-class, which needs vLLM's model class) printed each rank's traceback and a "leaked
    shared_memory" warning, left vLLM's socket files in $TMPDIR and exited 1. On vLLM's engine the rules
    are judged on the EPLB-on engine's arguments before any engine starts (the engine's workers would
    refuse the same, as a failed start-up)."""
    from ascend_eplb.world.checkpoints import write_checkpoint

    folder = write_checkpoint("qwen2-moe", tmp_path / "qwen2-moe", seed=0)
    run = Run(tmp_path, "--model", str(folder), "--ranks", "2", "--no-progress")
    code, out, err = run.finish()
    assert (code, out) == (2, "")
    assert _own_lines(err) == [
        "ascend-eplb simulate: error: refused before vLLM's engine starts (the serving path's start-up rules "
        "on the EPLB-on engine's arguments, as `ascend-eplb check -- serve` judges them):",
        "1 EPLB configuration rule(s) violated:",
        "  - [moe-model-class] model class Qwen2MoeForCausalLM (architecture Qwen2MoeForCausalLM) has no "
        "MixtureOfExperts part (vLLM's MixtureOfExperts interface: expert_weights, set_eplb_state, the MoE "
        "layers): upstream's EPLBController.maybe_register_model would not register it and the model would "
        "be served without EPLB; fix: serve it without --enable-eplb, or with a model class that implements "
        "MixtureOfExperts",
    ]
    assert sorted(p.name for p in run.out.iterdir()) == []
    run.assert_nothing_left(err)  # no rank, no socket file in $TMPDIR, no "leaked"


def test_check_and_plan_leave_nothing_in_tmpdir(tmp_path):
    """Issue 38: importing vLLM (``check -- serve``, ``plan --policies``) imports ``torch._dynamo``, whose
    disk cache created ``$TMPDIR/torchinductor_<user>``, left behind. Every command keeps it in its own
    scratch folder and removes it."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 8,
        "num_experts_per_tok": 2, "num_hidden_layers": 2, "torch_dtype": "bfloat16",
    }))  # fmt: skip
    load = tmp_path / "load.json"
    load.write_text("[[1, 2, 3, 4], [4, 3, 2, 1]]")
    commands = [
        ["check", "--", "serve", str(folder), "--enable-eplb", "--enable-expert-parallel", "-tp", "2",
         "--enforce-eager"],
        ["plan", str(load), "--ranks", "2", "--redundant-experts", "0", "--policies", "default"],
    ]  # fmt: skip
    for argv in commands:
        tmpdir = Path(tempfile.mkdtemp(prefix="ae-", dir="/tmp"))
        env = os.environ | {"TMPDIR": str(tmpdir), "VLLM_TARGET_DEVICE": "cpu"}
        env.pop("TORCHINDUCTOR_CACHE_DIR", None)
        done = subprocess.run([str(SCRIPT), *argv], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        assert sorted(p.name for p in tmpdir.iterdir()) == [], argv
        tmpdir.rmdir()
