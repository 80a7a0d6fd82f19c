"""The embedded ESFT trace: reproducible conversion, fidelity to ESFT's summary, loaders of load matrices."""

import json
import re
from importlib import resources

import numpy as np
import pytest

from ascend_eplb.testing.esft import esft_data_dir
from ascend_eplb.tools import trace

ESFT = esft_data_dir()
TRANSLATION = ESFT / "results/expert_scores/translation"


def test_convert_reproduces_embedded_trace_and_esft_summary(tmp_path):
    assert TRANSLATION.is_dir(), f"shared data missing: {TRANSLATION}"
    out = trace.convert(TRANSLATION, tmp_path / "t.npz")
    fresh, embedded = trace.load_trace(out), trace.load_trace()
    assert embedded.topk_ids.shape == (26, 8251, 6)
    assert embedded.seq_offsets.shape == (41,)
    assert embedded.num_logical_experts == 64
    np.testing.assert_array_equal(fresh.topk_ids, embedded.topk_ids)
    np.testing.assert_array_equal(fresh.topk_weights, embedded.topk_weights)
    np.testing.assert_array_equal(fresh.seq_offsets, embedded.seq_offsets)
    # First token of sequence 0, layer 1, as in the text file.
    assert embedded.topk_ids[0, 0].tolist() == [8, 26, 56, 57, 60, 11]
    # No token selects the same expert twice.
    ids = np.sort(embedded.topk_ids, axis=-1)
    assert not (ids[..., 1:] == ids[..., :-1]).any()
    # Aggregate shares reproduce ESFT's summary.json token_scores (rounded to 4 decimals there).
    load = embedded.load()
    assert load.sum() == 26 * 8251 * 6
    summary = trace.load_load_matrix(TRANSLATION / "summary.json")
    assert np.abs(load / load.sum(axis=1, keepdims=True) - summary).max() < 5e-5


def test_embedded_license_and_origin_ship_beside_trace():
    data = trace.embedded_trace_path().parent
    assert (data / "LICENSE-ESFT").read_text() == (ESFT / "LICENSE-CODE").read_text()
    assert "18d23501abc867f049f90c0dd7af17efc749c500" in (data / "ORIGIN.md").read_text()


def test_installed_package_finds_embedded_trace_through_importlib_resources():
    # What a wheel install resolves (the wheel ships ascend_eplb/tools/data/*, see SIMULATE.md).
    data = resources.files("ascend_eplb.tools").joinpath("data")
    names = sorted(entry.name for entry in data.iterdir())
    assert names == ["LICENSE-ESFT", "ORIGIN.md", trace.EMBEDDED_TRACE]
    resource = data.joinpath(trace.EMBEDDED_TRACE)
    with resources.as_file(resource) as path:
        assert path == trace.embedded_trace_path()
        loaded = trace.load_trace(path)
    assert loaded.topk_ids.shape == (26, 8251, 6)
    assert loaded.name == trace.EMBEDDED_TRACE
    assert resource.read_bytes()[:4] == b"PK\x03\x04"  # an npz is a zip archive


def test_load_matrix_formats_agree(tmp_path):
    m = np.array([[3.0, 0.0, 1.0, 2.0], [0.0, 0.0, 0.0, 0.0]])
    np.save(tmp_path / "m.npy", m)
    (tmp_path / "m.csv").write_text("3,0,1,2\n0,0,0,0\n")
    (tmp_path / "m.json").write_text(json.dumps(m.tolist()))
    (tmp_path / "sglang.json").write_text(
        json.dumps({"logical_count": [[[1, 0, 1, 2], [0] * 4], [[2, 0, 0, 0], [0] * 4]]})
    )
    scores = {"1": {str(e): v for e, v in enumerate([3, 0, 1, 2])}, "2": {str(e): 0 for e in range(4)}}
    (tmp_path / "esft.json").write_text(json.dumps({"token_scores": scores}))
    for name in ("m.npy", "m.csv", "m.json", "sglang.json", "esft.json"):
        np.testing.assert_array_equal(trace.load_load_matrix(tmp_path / name), m, err_msg=name)


@pytest.mark.parametrize(
    ("content", "suffix", "match"),
    [
        ("[1, 2, 3]", ".json", r"\[L, E\] matrix, got shape \(3,\)"),
        ("[[1, -2]]", ".json", "finite and >= 0"),
        ('{"counts": []}', ".json", "'token_scores' \\(ESFT\\) or 'logical_count'"),
        ("1,2\n", ".bin", "unsupported load file type '.bin'"),
        ("1,2\n", ".txt", r"bad.txt:1: expected '<ids>\\t\\t<weights>', found no double tab"),
        (
            '[["1", "2"], ["3", "4"]]',
            ".json",
            r"numeric \[L, E\] matrix \(values of dtype <U1, not numbers\)$",
        ),
        ("[[true, false]]", ".json", r"numeric \[L, E\] matrix \(values of dtype bool, not numbers\)$"),
        ("[[1, null]]", ".json", r"numeric \[L, E\] matrix \(values of dtype object, not numbers\)$"),
        ('{"logical_count": [["1"]]}', ".json", r"values of dtype <U1, not numbers"),
        (
            '{"token_scores": {"0": {"0": 0.5, "01": 0.25, "2": 0.25}}}',
            ".json",
            r"objects \(key '01' is not an integer written as 0, 1, 2, \.\.\.\)$",
        ),
        ('{"token_scores": {"0": {"0": "0.5"}}}', ".json", r"objects \(share '0.5' is not a number\)$"),
        ('{"token_scores": {"0": {"0": true}}}', ".json", r"objects \(share True is not a number\)$"),
    ],
)
def test_load_matrix_rejects_bad_input(tmp_path, content, suffix, match):
    path = tmp_path / f"bad{suffix}"
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        trace.load_load_matrix(path)


@pytest.mark.parametrize(
    ("array", "dtype"),
    [
        (np.array([[True, False]]), "bool"),
        (np.array([[1 + 2j, 0]]), "complex128"),
        (np.array([["2026-01-01"]], dtype="datetime64[D]"), "datetime64[D]"),
    ],
)
def test_an_npy_load_of_another_kind_than_numbers_is_refused(tmp_path, array, dtype):
    path = tmp_path / "load.npy"
    np.save(path, array)
    message = f"load must be a numeric [L, E] matrix (values of dtype {dtype}, not numbers)"
    with pytest.raises(ValueError, match=f"{re.escape(message)}$"):
        trace.load_load_matrix(path)


def test_sample_trace_follows_load():
    load = np.array([[8.0, 4.0, 2.0, 1.0, 1.0, 0.0]])
    t = trace.sample_trace_from_load(load, num_tokens=4000, top_k=1, seed=3)
    assert t.topk_ids.shape == (1, 4000, 1)
    counts = np.bincount(t.topk_ids.ravel(), minlength=6)
    assert counts[5] == 0
    np.testing.assert_allclose(counts / 4000, load[0] / load.sum(), atol=0.03)
    two = trace.sample_trace_from_load(load, num_tokens=100, top_k=2, seed=3)
    assert (two.topk_ids[..., 0] != two.topk_ids[..., 1]).all()
    np.testing.assert_allclose(two.topk_weights.sum(-1), 1.0, rtol=1e-6)
    again = trace.sample_trace_from_load(load, num_tokens=100, top_k=2, seed=3)
    np.testing.assert_array_equal(two.topk_ids, again.topk_ids)
    with pytest.raises(ValueError, match=r"top_k=7: must be in \[1, E=6\]"):
        trace.sample_trace_from_load(load, num_tokens=10, top_k=7, seed=0)


def test_prefix_rule():
    t = trace.load_trace()
    assert t.prefix(3).topk_ids.shape == (3, 8251, 6)
    with pytest.raises(ValueError, match=r"layers=27: must be in \[1, 26\]"):
        t.prefix(27)


def _npz(path, **arrays):
    np.savez(path, **arrays)
    return path


def test_load_trace_rejects_bad_npz_with_a_value_error_naming_the_file(tmp_path):
    good = dict(topk_ids=np.ones((1, 4, 2), np.int64), topk_weights_e4=np.ones((1, 4, 2), np.int16),
                seq_offsets=np.array([0, 4]), num_logical_experts=np.array(8))  # fmt: skip
    assert trace.load_trace(_npz(tmp_path / "good.npz", **good)).topk_ids.shape == (1, 4, 2)
    missing = tmp_path / "missing.npz"
    with pytest.raises(ValueError, match=f"^{missing}: no such file"):
        trace.load_trace(missing)
    np.save(tmp_path / "one.npy", np.zeros(3))
    (tmp_path / "one.npy").rename(tmp_path / "one.npz")
    with pytest.raises(
        ValueError, match=r"one.npz: not a compact routing trace .npz \(no zip archive signature"
    ):
        trace.load_trace(tmp_path / "one.npz")
    (tmp_path / "garbage.npz").write_text("hello")
    with pytest.raises(
        ValueError, match=r"garbage\.npz: not a compact routing trace \.npz \(no zip archive signature\)"
    ):
        trace.load_trace(tmp_path / "garbage.npz")
    with pytest.raises(ValueError, match=r"missing keys \['num_logical_experts', 'seq_offsets'"):
        trace.load_trace(_npz(tmp_path / "keys.npz", topk_ids=good["topk_ids"]))
    ids = good["topk_ids"].copy()
    ids[0, 0, 0] = -1
    neg = _npz(tmp_path / "neg.npz", **good | {"topk_ids": ids})
    with pytest.raises(
        ValueError, match=r"expert ids must lie in \[0, num_logical_experts=8\), got \[-1, 1\]"
    ):
        trace.load_trace(neg)
    with pytest.raises(ValueError, match=r"seq_offsets \(0,\) a 1-D array of at least 2 offsets"):
        trace.load_trace(_npz(tmp_path / "off.npz", **good | {"seq_offsets": np.array([], np.int64)}))
    with pytest.raises(ValueError, match="seq_offsets must rise from 0 to the token count 4, got first 1"):
        trace.load_trace(_npz(tmp_path / "rise.npz", **good | {"seq_offsets": np.array([1, 4])}))
