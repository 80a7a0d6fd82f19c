"""The world's real load: the embedded ESFT trace and the four tasks' shares ship in the package, with
their licence and origin, are found through ``importlib.resources``, and read back as ESFT wrote them."""

from __future__ import annotations

import hashlib
import json
from importlib import resources

import numpy as np
import pytest
import torch

from ascend_eplb.world import esft

#: sha256 of deepseek-ai/ESFT's files (commit 18d23501abc867f049f90c0dd7af17efc749c500): LICENSE-CODE and
#: results/expert_scores/<task>/summary.json.
ESFT_SHA256 = {
    "LICENSE-ESFT": "1c8f573e830ca9b3ebfeb7ace1823146e22b66f99ee223840e7637c9e745e1c7",
    "intent": "5d83196b5fff3236e99bf1d729af8579a249a4ea31b671732aac7c5477f10244",
    "law": "278d518e85ce9e754a86dfc2c07090a38a3a0c60ca99e03c627f137b866c21d1",
    "summary": "538b66bc0e14ac045202b4c72436770066e032fe2481f7c92f993ae107c294ba",
    "translation": "784e23b0303cd6932c23f558097b0c54c85556d6355fe3f37f705cb7250fceec",
}


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_data_ships_with_its_licence_and_origin_byte_identical():
    assert _sha256(esft.data_path("LICENSE-ESFT")) == ESFT_SHA256["LICENSE-ESFT"]
    assert {task: _sha256(esft.task_shares_path(task)) for task in esft.ESFT_TASKS} == {
        task: ESFT_SHA256[task] for task in esft.ESFT_TASKS
    }
    origin = esft.data_path("ORIGIN.md").read_text()
    assert "18d23501abc867f049f90c0dd7af17efc749c500" in origin
    assert "expert_scores/{intent,law,summary,translation}/summary.json" in origin
    with pytest.raises(ValueError, match=r"task='code': the ESFT tasks shipped are \['intent', 'law'"):
        esft.task_shares_path("code")


def test_an_installed_package_finds_the_data_through_importlib_resources():
    # What a wheel install resolves (the wheel ships ascend_eplb/world/data/*).
    data = resources.files("ascend_eplb.world").joinpath("data")
    names = sorted(entry.name for entry in data.iterdir())
    assert names == ["LICENSE-ESFT", "ORIGIN.md", esft.EMBEDDED_TRACE, "expert_scores"]
    assert sorted(entry.name for entry in data.joinpath("expert_scores").iterdir()) == list(esft.ESFT_TASKS)
    resource = data.joinpath(esft.EMBEDDED_TRACE)
    with resources.as_file(resource) as path:
        assert path == esft.embedded_trace_path()
    assert resource.read_bytes()[:4] == b"PK\x03\x04"  # an npz is a zip archive
    with np.load(esft.embedded_trace_path(), allow_pickle=False) as z:
        assert z["topk_ids"].shape == (26, 8251, 6)
        assert z["layer_ids"].tolist() == list(range(1, 27))
        assert int(z["num_logical_experts"]) == esft.ESFT_NUM_LOGICAL_EXPERTS
    scores = json.loads(esft.task_shares_path("law").read_text())["token_scores"]
    assert sorted(scores, key=int) == [str(layer) for layer in range(1, 27)]
    assert sorted(scores["1"], key=int) == [str(e) for e in range(64)]


def test_the_sequences_are_the_traces_per_layer():
    """``esft_sequences`` is what ``testing.esft`` read from ESFT's text files (equal to them for all 26
    layers and 40 sequences when it moved; the tools' tests hold layers 1 and 2 against the text)."""
    first = esft.esft_sequences(0, 1)
    assert [s.shape for s in first] == [(first[0].shape[0], 6)]
    assert first[0].dtype == torch.int64
    assert first[0][0].tolist() == [8, 26, 56, 57, 60, 11]  # layer 1's first token, as in the text
    every = esft.esft_sequences(25, esft.ESFT_NUM_SEQUENCES)
    assert len(every) == 40
    assert sum(s.shape[0] for s in every) == 8251
    assert all(int(s.min()) >= 0 and int(s.max()) < 64 for s in every)
    # Each token selects 6 distinct experts.
    assert all((s.sort(dim=1).values.diff(dim=1) > 0).all() for s in every)
    assert esft.esft_sequences(3, 0) == []
    with pytest.raises(ValueError, match=r"moe_layer=26: the ESFT trace has MoE layers 0\.\.25"):
        esft.esft_sequences(26, 1)
    with pytest.raises(ValueError, match=r"num_sequences=41: the ESFT trace has 40 sequences"):
        esft.esft_sequences(0, 41)
