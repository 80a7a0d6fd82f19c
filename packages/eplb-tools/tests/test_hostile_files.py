"""Every file the tools read, under every corruption: one error naming the file and what is wrong, exit 2.

Table-driven: each reader (the command that reads it) x each corruption. A reader never lets a library's
own exception out (``zlib.error``, ``EOFError``, ``KeyError``, ``TypeError``, ``OverflowError``, ...), and a
load whose sums would not be finite is refused instead of printing ``nan``.
"""

from __future__ import annotations

import io
import json
import os
import stat
import zipfile
from pathlib import Path

import numpy as np
import pytest

from ascend_eplb.testing.configs import VALID_EPLB_CONFIG
from ascend_eplb.tools.check import check_config_file
from ascend_eplb.tools.cli import main

GOOD_CONFIG = VALID_EPLB_CONFIG


def _npz_bytes(**overrides) -> bytes:
    arrays = {
        "topk_ids": np.array([[[0, 1], [2, 3], [1, 2], [3, 0]]], dtype=np.uint8),
        "topk_weights_e4": np.full((1, 4, 2), 5000, dtype=np.uint16),
        "seq_offsets": np.array([0, 4], dtype=np.int64),
        "layer_ids": np.array([1], dtype=np.int64),
        "num_logical_experts": np.array(4, dtype=np.int64),
    }
    arrays.update(overrides)
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    return buf.getvalue()


def _npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=True)
    return buf.getvalue()


def _corrupt_member(data: bytes) -> bytes:
    """The archive with the compressed bytes of its first member flipped (a zlib stream error)."""
    raw = bytearray(data)
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        info = z.infolist()[0]
    start = info.header_offset + 30 + len(info.filename) + len(info.extra)
    for i in range(start + 2, start + min(info.compress_size, 40)):
        raw[i] ^= 0xFF
    return bytes(raw)


def _window(load, rearrangement: int = 1) -> str:
    """An events file's ``window`` line (``integration.events.records.WindowRecord``) of ``load``."""
    record = {"event": "window", "time": 0.0, "step": rearrangement, "model": "m",
              "rearrangement": rearrangement, "load": load, "balancedness": 1.0,
              "balancedness_eplb_off": 1.0}  # fmt: skip
    return json.dumps(record) + "\n"


VALID = {
    "trace.npz": _npz_bytes(),
    "load.npy": _npy_bytes(np.array([[1.0, 2.0], [3.0, 4.0]])),
    "load.csv": b"1,2\n3,4\n",
    "load.json": b"[[1, 2], [3, 4]]",
    "summary.json": json.dumps({"token_scores": {"1": {"0": 0.25, "1": 0.75}}}).encode(),
    "events.jsonl": (_window([[1, 2], [3, 4]]) + _window([[1, 2], [3, 4]], 2)).encode(),
    "config.json": json.dumps(GOOD_CONFIG).encode(),
}
GARBAGE = b"\xff\xfe\x80\x81 not text \x00\x9f" * 16

# (file, corruption, file bytes, a fragment of the one error line after "<path>: ")
CASES = [
    # every reader: empty, truncated to half, binary garbage
    *[(name, "empty", b"", "empty file, not ") for name in VALID],
    ("trace.npz", "truncated", VALID["trace.npz"][: len(VALID["trace.npz"]) // 2],
     "not a compact routing trace .npz (BadZipFile: "),
    ("load.npy", "truncated", VALID["load.npy"][:100], "not an [L, E] load matrix ("),
    ("load.csv", "truncated", b"1,2\n3,", "load must be a numeric [L, E] matrix"),
    ("load.json", "truncated", b"[[1, 2], [3,", "not valid JSON ("),
    ("summary.json", "truncated", VALID["summary.json"][:20], "not valid JSON ("),
    ("events.jsonl", "truncated", _window([[1, 2]]).encode()[:30],
     "the events file holds no complete 'window' record (its last line was truncated and skipped"),
    ("config.json", "truncated", VALID["config.json"][:40], "cannot read "),
    ("trace.npz", "garbage", GARBAGE, "not a compact routing trace .npz (no zip archive signature)"),
    ("load.npy", "garbage", GARBAGE, "not an [L, E] load matrix (no .npy signature)"),
    ("load.csv", "garbage", GARBAGE, "not UTF-8 text (byte 0), not an [L, E] load matrix"),
    ("load.json", "garbage", GARBAGE, "not UTF-8 text (byte 0), not an [L, E] load matrix"),
    ("summary.json", "garbage", GARBAGE, "not UTF-8 text (byte 0), not an [L, E] load matrix"),
    ("events.jsonl", "garbage", GARBAGE, "not UTF-8 text (byte 0); not an events file"),
    ("config.json", "garbage", GARBAGE, "UnicodeDecodeError"),
    # corrupt inside a valid container
    ("trace.npz", "corrupt member", _corrupt_member(VALID["trace.npz"]),
     "not a compact routing trace .npz ("),
    # valid encoding, wrong structure
    ("trace.npz", "wrong keys", _npz_bytes(topk_ids=np.zeros(3)).replace(b"topk_ids", b"topk_xyz"),
     "missing keys ['topk_ids']"),
    ("trace.npz", "object arrays", _npz_bytes(seq_offsets=np.array([0, "x"], dtype=object)),
     "not a compact routing trace .npz (ValueError: Object arrays cannot be loaded when allow_pickle=False)"),
    ("trace.npz", "non-scalar expert count", _npz_bytes(num_logical_experts=np.array([4, 4])),
     "num_logical_experts must be an integer scalar, got int64 (2,)"),
    ("load.npy", "object array", _npy_bytes(np.array([[1, "x"]], dtype=object)),
     "not an [L, E] load matrix (ValueError: Object arrays cannot be loaded when allow_pickle=False)"),
    ("load.npy", "3-D", _npy_bytes(np.ones((2, 2, 2))), "load must be a [L, E] matrix, got shape (2, 2, 2)"),
    ("load.csv", "text cells", b"1,a\n3,4\n", "load must be a numeric [L, E] matrix"),
    ("load.json", "object", b'{"a": 1}', "JSON object must hold 'token_scores' (ESFT) or 'logical_count'"),
    ("load.json", "nested strings", b'[["1", "x"]]', "load must be a numeric [L, E] matrix"),
    ("summary.json", "scores a list", b'{"token_scores": [1, 2]}',
     "token_scores must map layer numbers to {expert number: share} objects"),
    ("summary.json", "layer key text", b'{"token_scores": {"a": {"0": 1}}}',
     "(key 'a' is not an integer written as 0, 1, 2, ...)"),
    ("summary.json", "share text", b'{"token_scores": {"1": {"0": "x"}}}', "(share 'x' is not a number)"),
    ("events.jsonl", "record a list", b"[1, 2]\n" + _window([[1]]).encode(),
     "events.jsonl:1: not an events record"),
    ("events.jsonl", "load a string", _window("x").encode(), "events.jsonl:1: a window's 'load' must be"),
    ("config.json", "a list", b"[1, 2]", "[schema]"),
    ("config.json", "sections of wrong types", b'{"parallel_config": [], "model": 3}', "[schema]"),
    # numbers that overflow
    ("load.json", "integer beyond float64", b"[[1, " + b"9" * 400 + b"]]",
     "load must be a numeric [L, E] matrix"),
    ("load.json", "sum beyond float32", b"[[3e38, 3e38]]", "the loads sum to 6e+38, more than 3.403e+38"),
    ("load.json", "infinite", b"[[1e400, 1]]", "load must be finite and >= 0"),
    ("load.json", "NaN", b"[[NaN, 1]]", "load must be finite and >= 0"),
    ("load.npy", "sum beyond float64", _npy_bytes(np.full((2, 2), 1e308)), "the loads sum to inf, more than"),
    ("load.csv", "sum beyond float32", b"3e38,3e38\n", "the loads sum to 6e+38"),
    ("summary.json", "sum beyond float32", b'{"token_scores": {"1": {"0": 3e38, "1": 3e38}}}',
     "the loads sum to 6e+38"),
    ("events.jsonl", "integer beyond int64", _window([[2**70, 1]]).encode(), "a window's 'load' must be"),
    ("trace.npz", "ids beyond the expert count", _npz_bytes(num_logical_experts=np.array(2, dtype=np.int64)),
     "expert ids must lie in [0, num_logical_experts=2), got [0, 3]"),
    ("config.json", "integer beyond float64",
     b'{"parallel_config": {"tensor_parallel_size": ' + b"9" * 400 + b"}}",
     "[schema] parallel_config.tensor_parallel_size=99999999999999999999...(400 characters) "
     "must be an integer in [1, 2147483647]"),
    ("config.json", "infinite", b'{"parallel_config": {"tensor_parallel_size": 1e400}}', "[schema]"),
]  # fmt: skip


def _command(name: str, path: Path, tmp_path: Path) -> list[str]:
    if name == "trace.npz":
        return ["simulate", "--model", "replay", "--trace", str(path), "--out", str(tmp_path / "out")]
    if name == "config.json":
        return ["check", str(path)]
    return ["plan", str(path), "--ranks", "2"]


@pytest.mark.parametrize(
    ("name", "corruption", "data", "fragment"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES]
)
def test_every_reader_refuses_every_corruption_with_one_line_naming_the_file(
    tmp_path, capsys, name, corruption, data, fragment
):
    path = tmp_path / name
    path.write_bytes(data)
    command = _command(name, path, tmp_path)
    code = main(command)
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    if name == "config.json":
        # check reports on stdout (ok or not) and never raises
        assert err == ""
        assert out.startswith(f"ascend-eplb check: {path}: INVALID\n")
        assert fragment in out
        result = check_config_file(path)
        assert (result.ok, result.exit_code) == (False, 2)
        assert result.violations[0].rule == "schema"
        return
    assert out == ""
    prefix = f"ascend-eplb {command[0]}: error: {path}:"
    assert err.startswith(prefix), err
    assert err.count("\n") == 1, err  # one line, no traceback
    assert fragment in err, err
    assert not (tmp_path / "out").exists()


def test_the_valid_file_of_each_reader_is_accepted(tmp_path, capsys):
    """The table's corruptions start from files each reader accepts (so each case fails for its reason)."""
    for name, data in VALID.items():
        path = tmp_path / name
        path.write_bytes(data)
        if name == "trace.npz":
            from ascend_eplb.tools.trace import load_trace

            assert load_trace(path).topk_ids.shape == (1, 4, 2)
            continue
        assert main(_command(name, path, tmp_path)) == 0, capsys.readouterr()
    capsys.readouterr()


@pytest.mark.timeout(300)
def test_a_fifo_is_refused_by_every_reader_of_placements_and_events_before_it_is_opened(tmp_path, capsys):
    """Issue 38 defects 3 and 9: a FIFO as ``initial_placement`` blocked ``check -- serve`` and ``simulate``
    until the deadline, ``check`` accepted one as ``ASCEND_EPLB_EVENTS`` (serving's recorder would block
    opening it on rank 0), and ``plan`` on one said "no such file"."""
    from ascend_eplb.tools.check import check_serve_command

    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    assert main(["plan", str(fifo), "--ranks", "2"]) == 2
    assert capsys.readouterr().err == (
        f"ascend-eplb plan: error: {fifo}: is a FIFO, not a regular file (reading it would block or never "
        "end) (a serving events file (.jsonl)); fix: name a regular file; copy what it holds into one first\n"
    )
    out = tmp_path / "out"
    assert main(["simulate", "--model", "replay", "--initial-placement", str(fifo), "--out", str(out)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "ascend-eplb simulate: error: invalid simulate options:",
        f"  - initial placement={fifo}: cannot read the placement file: is a FIFO, not a regular file "
        "(reading it would block or never end)",
    ]
    assert not out.exists()
    folder = tmp_path / "Qwen3-MoE-tiny"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 8,
        "num_experts_per_tok": 2, "torch_dtype": "bfloat16", "num_hidden_layers": 2, "decoder_sparse_step": 1,
    }))  # fmt: skip
    config = json.dumps({"eplb_config": {"initial_placement": str(fifo)}})
    served = check_serve_command(
        ["serve", str(folder), "--enable-eplb", "-tp", "2", "--enable-expert-parallel", "--enforce-eager",
         "--additional-config", config], {},
    )  # fmt: skip
    assert [(v.rule, v.message) for v in served.violations] == [
        (
            "initial-placement",
            f"eplb_config.initial_placement={fifo}: cannot read the placement file: is a FIFO, not a regular "
            "file (reading it would block or never end); fix: name a placement file of ascend-eplb plan "
            "--export-expert-map (or an events file with a committed placement)",
        )
    ]
    good = tmp_path / "config.json"
    good.write_bytes(VALID["config.json"])
    events = check_config_file(good, environ={"ASCEND_EPLB_EVENTS": str(fifo)})
    assert [(v.rule, v.message) for v in events.violations] == [
        (
            "serving-switches",
            f"ASCEND_EPLB_EVENTS={fifo}: is a FIFO, not a regular file (appending to it would block or never "
            "end); name an events file (e.g. events.jsonl)",
        )
    ]


def _load_file(tmp_path: Path) -> Path:
    load = tmp_path / "load.json"
    load.write_text("[[1, 2, 3, 4], [4, 3, 2, 1]]")
    return load


def test_the_export_replaces_only_a_regular_file_or_a_links_regular_target(tmp_path, capsys):
    """Issue 43 case 1: ``plan --export-expert-map`` onto a FIFO (or a device node: on a copy of
    ``/dev/null``, as root on the real one) replaced it with a regular JSON file and exited 0."""
    load = _load_file(tmp_path)
    plan = ["plan", str(load), "--ranks", "2", "--export-expert-map"]
    fifo = tmp_path / "map.fifo"
    os.mkfifo(fifo)
    to_fifo = tmp_path / "to-fifo.json"
    to_fifo.symlink_to(fifo)
    for target, said in (
        (fifo, f"{fifo}: is a FIFO"),
        (to_fifo, f"{to_fifo}: is a symbolic link to {fifo}, a FIFO"),
    ):
        assert main([*plan, str(target)]) == 2
        out, err = capsys.readouterr()
        assert err == (
            f"ascend-eplb plan: error: export expert map={said}, not a regular file (only a regular file is "
            "replaced); fix: name a regular file\n"
        )
        assert out == ""  # refused before anything was planned
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert to_fifo.is_symlink()
    # A link to a regular file: the file it points to is replaced, the link stays.
    real = tmp_path / "real.json"
    real.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    assert main([*plan, str(link)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith(f"wrote {link}: num_redundant_experts=")
    assert link.is_symlink()
    assert json.loads(real.read_text())["format"] == "ascend-eplb-placement"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "load.json", "map.fifo", "real.json",
                                                         "to-fifo.json"]  # fmt: skip


def test_check_never_blocks_on_a_fifo_nor_reads_past_a_config_files_cap(tmp_path, capsys):
    """Issue 43 case 2: ``check`` opened any path: a FIFO config blocked forever, ``check /dev/zero`` read
    until the OOM killer stopped it (exit 137). A file past the cap (here a sparse one: nothing on disk)
    is refused unread; ``--max-input-mib`` raises the cap."""
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(17 * 2**20)
    results = {}

    def run(name: str, argv: list[str]) -> None:
        results[name] = (main(argv), capsys.readouterr())

    import threading

    for name, argv in (
        ("fifo", ["check", str(fifo)]),
        ("serve --config fifo", ["check", "--", "serve", "m", "--config", str(fifo)]),
        ("big", ["check", str(big)]),
        ("big raised", ["check", "--max-input-mib", "17", str(big)]),
    ):
        t = threading.Thread(target=run, args=(name, argv), daemon=True)
        t.start()
        t.join(60)
        assert name in results, f"check {name} blocked"
    fifo_said = (
        "is a FIFO, not a regular file (reading it would block or never end); fix: name a regular file"
    )
    assert results["fifo"][0] == 2
    assert f"[schema] cannot read '{fifo}' as a config file: {fifo_said}" in results["fifo"][1].out
    assert results["serve --config fifo"][0] == 2
    assert (
        f"[engine-args] the command line: --config {fifo}: {fifo_said}"
        in results["serve --config fifo"][1].out
    )
    assert results["big"][0] == 2
    assert (
        f"[schema] cannot read '{big}' as a config file: 17.0 MiB, more than the 16 MiB a config file is "
        "read up to (not read); fix: name the right file, or raise the limit: ascend-eplb's "
        "--max-input-mib 17"
    ) in results["big"][1].out
    # Read with the cap raised: 17 MiB of zero bytes, which are not JSON.
    assert results["big raised"][0] == 2
    assert f"[schema] cannot read '{big}' as JSON: JSONDecodeError: " in results["big raised"][1].out
    assert "ASCEND_EPLB_MAX_INPUT_MIB" not in os.environ  # the command's, given back


def test_a_config_key_given_twice_a_null_config_and_an_alias_bomb_are_refused_at_once(tmp_path):
    """Issue 43 case 14 and the YAML alias bomb (refused after 75 s)."""
    cases = {
        "twice.json": (b'{"parallel_config": {"tensor_parallel_size": 2, "tensor_parallel_size": 4}}',
                       "cannot read '{}' as JSON: DuplicateKeyError: the key 'tensor_parallel_size' is given "
                       "twice in one object (which value is meant?)"),
        "twice.yaml": (b"enable_eplb: true\ntensor_parallel_size: 2\ntensor_parallel_size: 4\n",
                       "cannot read '{}' as YAML: DuplicateKeyError: the key 'tensor_parallel_size' is given "
                       "twice in one object (which value is meant?)"),
        "null.json": (b"null", "'{}': holds JSON null, not a config (a mapping of settings: the schema's or "
                               "vLLM's engine arguments)"),
        "null.yaml": (b"~\n", "'{}': holds YAML null, not a config (a mapping of settings: the schema's or "
                              "vLLM's engine arguments)"),
        "bomb.yaml": (b"a: &a [x, x, x, x, x, x, x, x, x]\n"
                      + b"".join(f"{chr(98 + i)}: &{chr(98 + i)} [{(('*' + chr(97 + i) + ', ') * 9)[:-2]}]\n"
                                 .encode() for i in range(8)),
                      "cannot read '{}' as YAML: ValueError: its aliases expand it to more than 100000 "
                      "values (an alias bomb?); a config file holds a few hundred: write the values out"),
    }  # fmt: skip
    for name, (data, message) in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        result = check_config_file(path)
        assert [(v.rule, v.message) for v in result.violations] == [("schema", message.format(path))], name
    # A merge key may still override (YAML's own way of giving a key again).
    merged = tmp_path / "merged.yaml"
    merged.write_text("base: &b {tensor_parallel_size: 2}\nother:\n  <<: *b\n  tensor_parallel_size: 4\n")
    from ascend_eplb.tools.check.config_text import load_yaml

    assert load_yaml(merged.read_text())["other"] == {"tensor_parallel_size": 4}
