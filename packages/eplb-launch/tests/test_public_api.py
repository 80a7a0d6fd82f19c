"""The launcher's public names: each the object its module defines, the installed version."""

import importlib.metadata

import ascend_eplb.launch as launch
from ascend_eplb.launch import __about__, multirank


def test_all_is_the_documented_api():
    assert sorted(launch.__all__) == sorted(
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
    for name in launch.__all__:
        assert getattr(launch, name) is getattr(multirank, name), name
    assert __about__.__version__ == importlib.metadata.version("ascend-eplb-launch")
