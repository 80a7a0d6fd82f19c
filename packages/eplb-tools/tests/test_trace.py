"""The compact trace format: ESFT's text converts to exactly the embedded trace, whose shares reproduce
ESFT's summary; loaders of load matrices."""

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from ascend_eplb.tools import trace
from ascend_eplb.world import esft

#: ESFT's raw text of the translation task's MoE layers 1 and 2, byte-identical (data/esft/ORIGIN.md).
ESFT_TEXT = Path(__file__).with_name("data") / "esft"


def test_the_esft_text_ships_byte_identical_with_its_licence():
    digests = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in ESFT_TEXT.glob("expert_weights_*")}
    # sha256 of deepseek-ai/ESFT's results/expert_scores/translation files (commit in ORIGIN.md).
    assert digests == {
        "expert_weights_1.txt": "902d5a2922670fa7198424bd5a93e956620aa1178d59e9c3c79a8e49a4f7e05b",
        "expert_weights_2.txt": "ca0ab42b2aaab633324ab30d0e65f5d1f623c4e35b7ecd03aae6f649b103205f",
    }
    assert (ESFT_TEXT / "LICENSE-ESFT").read_bytes() == esft.data_path("LICENSE-ESFT").read_bytes()
    assert "18d23501abc867f049f90c0dd7af17efc749c500" in (ESFT_TEXT / "ORIGIN.md").read_text()


def test_convert_reproduces_embedded_trace_and_esft_summary(tmp_path):
    out = trace.convert(ESFT_TEXT, tmp_path / "t.npz")
    fresh, embedded = trace.load_trace(out), trace.load_trace()
    assert embedded.name == esft.EMBEDDED_TRACE  # the world's (one home)
    assert embedded.topk_ids.shape == (26, 8251, 6)
    assert embedded.seq_offsets.shape == (41,)
    assert embedded.num_logical_experts == 64
    # ESFT's text of MoE layers 1 and 2 converts to exactly the embedded trace's first two layers.
    assert fresh.topk_ids.shape == (2, 8251, 6)
    np.testing.assert_array_equal(fresh.topk_ids, embedded.topk_ids[:2])
    np.testing.assert_array_equal(fresh.topk_weights, embedded.topk_weights[:2])
    np.testing.assert_array_equal(fresh.seq_offsets, embedded.seq_offsets)
    with np.load(out) as z:
        assert z["layer_ids"].tolist() == [1, 2]
    # First token of sequence 0, layer 1, as in the text file.
    assert embedded.topk_ids[0, 0].tolist() == [8, 26, 56, 57, 60, 11]
    # No token selects the same expert twice.
    ids = np.sort(embedded.topk_ids, axis=-1)
    assert not (ids[..., 1:] == ids[..., :-1]).any()
    # Aggregate shares reproduce ESFT's summary.json token_scores (rounded to 4 decimals there).
    load = embedded.load()
    assert load.sum() == 26 * 8251 * 6
    summary = trace.load_load_matrix(esft.task_shares_path("translation"))
    assert np.abs(load / load.sum(axis=1, keepdims=True) - summary).max() < 5e-5


def test_the_worlds_sequences_are_the_esft_text_lines():
    """What the multi-rank tests route (``world.esft.esft_sequences``, read from the embedded trace) is
    each line of ESFT's text, token by token."""
    for moe_layer in (0, 1):
        lines = (ESFT_TEXT / f"expert_weights_{moe_layer + 1}.txt").read_text().splitlines()
        expected = [
            torch.tensor([int(v) for v in line.split("\t\t")[0].split("\t")]).view(-1, 6) for line in lines
        ]
        got = esft.esft_sequences(moe_layer, esft.ESFT_NUM_SEQUENCES)
        assert len(got) == len(expected) == 40
        assert all(g.dtype == torch.int64 and torch.equal(g, e) for g, e in zip(got, expected, strict=True))


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
