"""Runs that cannot fit the host, and integer options that overflow what they feed, are refused (exit 2)
before anything is sampled, loaded into ranks or started; the message has the estimate."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
import torch

from ascend_eplb.quant_views import get_format
from ascend_eplb.tools import host_memory
from ascend_eplb.tools.cli import main
from ascend_eplb.tools.simulate import resources
from ascend_eplb.tools.simulate.config import SimulateConfig
from ascend_eplb.tools.trace import sample_trace_from_load


def _allocated(fmt, num_local: int, hidden: int, inter: int) -> int:
    storage = fmt.create_storage(
        torch.randn(num_local, 2 * inter, hidden), torch.randn(num_local, hidden, inter)
    )
    return sum(
        t.numel() * t.element_size()
        for t in (*storage.kernel_tensors.values(), *storage.unread_tensors.values())
    )


def test_the_default_run_estimate_counts_the_real_storage_and_fits_this_host():
    config = SimulateConfig(model="replay", num_ranks=4)
    est = resources.estimate(
        config, num_moe_layers=26, num_logical_experts=64, top_k=6, num_trace_tokens=8251, sampled=False
    )
    fmt = get_format("w8a8_dynamic")
    # 68 physical experts over 4 ranks: 17 slots a rank; the reference world holds 64 / 4 = 16.
    assert est.rank_parts["expert storage"] == 26 * _allocated(fmt, 17, 64, 32)
    assert est.rank_parts["reference storage"] == 26 * _allocated(fmt, 16, 64, 32)
    assert est.rank_parts["trace"] == 2 * 26 * 8251 * 6 * 12
    # The replay world's hidden-state table, as it builds it: 4096 float32 rows of H = 64.
    from ascend_eplb.tools.simulate import replay_world

    assert est.rank_parts["hidden table"] == 4096 * 64 * 4
    assert replay_world._hidden_table(torch.Generator().manual_seed(0), 64).nbytes == 4096 * 64 * 4
    assert est.per_rank == sum(est.rank_parts.values())
    assert est.total == 4 * est.per_rank + est.launcher + resources.PROCESS_BASE_BYTES
    assert est.total < host_memory.available_bytes()  # the README's main job runs here
    assert resources.memory_rule(
        config,
        num_moe_layers=26,
        num_logical_experts=64,
        top_k=6,
        num_trace_tokens=8251,
        available=est.total - 1,
    ) == [
        f"memory: this run needs about {host_memory.gib(est.total)} ({est.describe()}), the host has "
        f"{host_memory.gib(est.total - 1)} available (MemAvailable); use fewer layers, ranks or redundant "
        "experts, or smaller sizes"
    ]


def _refused(argv, tmp_path, capsys) -> str:
    t0 = time.monotonic()
    code = main(["simulate", "--model", "replay", "--ranks", "4", *argv, "--out", str(tmp_path / "out")])
    elapsed = time.monotonic() - t0
    err = capsys.readouterr().err
    assert code == 2, err
    assert elapsed < 20, elapsed  # nothing was built, sampled or started
    assert not (tmp_path / "out").exists()
    assert err.startswith("ascend-eplb simulate: error: invalid simulate options:\n  - ")
    return err


def test_sizes_beyond_the_host_are_refused_with_the_estimate(tmp_path, capsys):
    err = _refused(["--hidden-size", "65536", "--intermediate-size", "65536"], tmp_path, capsys)
    fmt = get_format("w8a8_dynamic")
    storage = 26 * fmt.storage_nbytes(17, 65536, 65536)
    assert "  - memory: this run needs about " in err
    assert f"per rank (expert storage {host_memory.gib(storage)}, " in err
    assert " x 4 ranks + launcher " in err
    # What is available moves between the run and this line (other processes): its form, not its value.
    assert re.search(r"the host has \d+\.\d\d GiB available \(MemAvailable\)", err), err


def test_a_trace_declaring_millions_of_experts_is_refused(tmp_path, capsys):
    path = tmp_path / "wide.npz"
    np.savez_compressed(path, topk_ids=np.zeros((1, 8, 2), np.uint8) + np.arange(2, dtype=np.uint8),
                        topk_weights_e4=np.full((1, 8, 2), 5000, np.uint16), seq_offsets=np.array([0, 8]),
                        num_logical_experts=np.array(4_000_000))  # fmt: skip
    err = _refused(["--trace", str(path)], tmp_path, capsys)
    lookups = 1 * (1024 * 4_000_000 * 4 + 4_000_000 * 5 * 8 + 4_000_004 * 8 * (3 + 8))
    assert f"lookups and placement {host_memory.gib(lookups)}" in err
    assert "  - memory: this run needs about " in err


def test_a_wide_load_matrix_is_refused_before_it_is_sampled(tmp_path, capsys):
    path = tmp_path / "wide.npy"
    np.save(path, np.ones((1, 4_000_000)))
    err = _refused(["--trace", str(path)], tmp_path, capsys)
    sampling = host_memory.sampling_bytes(1, 8192, 4_000_000)
    assert f" + sampling the load matrix {host_memory.gib(sampling)}" in err
    # The sampler refuses as well, for a caller that skips the options.
    expected = r"^memory: sampling 8192 tokens from a \[1, 4000000\] load matrix needs about 732\.42 GiB"
    with pytest.raises(ValueError, match=expected):
        sample_trace_from_load(np.ones((1, 4_000_000)), num_tokens=8192, top_k=6, seed=0)


@pytest.mark.parametrize(
    ("argv", "rule"),
    [
        (["--seed", str(2**64)], f"seed={2**64}: must be in [0, 9223344366821] (expert weights are seeded "
                                 "with seed x 1000003 + layer x 1009 + expert, an int64)"),
        (["--seed", "-1"], "seed=-1: must be in [0, 9223344366821]"),
        (["--steps", str(10**17)], f"steps={10**17}: steps x ranks x batch size = {128 * 10**17} trace "
                                   "positions overflow int64"),
        (["--batch-size", str(10**8)], "padded size=100000016: ranks x padded size x top-k = 2400000384 "
                                       "selections a step overflow the int32 load counters"),
        (["--timeout", "1e300"], "timeout=1e+300: must be at most 604800 s (7 days)"),
        (["--worker-timeout", "1e300"], "worker timeout=1e+300: must be at most 604800 s (7 days)"),
        (["--steps", str(10**12)], "memory: this run needs about "),  # the per-step statistics
    ],
)  # fmt: skip
def test_integer_options_that_overflow_what_they_feed_are_refused(tmp_path, capsys, argv, rule):
    err = _refused(argv, tmp_path, capsys)
    assert f"  - {rule}" in err
