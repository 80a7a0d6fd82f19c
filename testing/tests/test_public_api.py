"""The public names of the test support."""

import ascend_eplb.testing as testing


def test_all_is_the_documented_api():
    assert sorted(testing.__all__) == sorted(
        [
            "RANK_ENV",
            "LauncherInterruptedError",
            "RankContext",
            "RankFailureError",
            "load_module",
            "reap_child",
            "run_ranks",
            "signals_raise",
            "stop_fork_server",
        ]
    )
    for name in testing.__all__:
        assert hasattr(testing, name)
