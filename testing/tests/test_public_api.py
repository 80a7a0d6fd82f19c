"""The public names of the test support, and the public-names oracle every package's test runs."""

import sys

import ascend_eplb.testing as testing
from ascend_eplb.testing.api import check_public_names

LAUNCHER = [
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


def test_all_is_the_documented_api():
    """The test support re-exports the launcher's names (the very objects of ascend_eplb.launch, where
    ``simulate`` takes them from too) and defines none of its own at the top."""
    import ascend_eplb.launch as launch

    assert sorted(testing.__all__) == sorted(LAUNCHER)
    assert sorted(launch.__all__) == sorted(LAUNCHER)
    for name in LAUNCHER:
        assert getattr(testing, name) is getattr(launch, name), name
    check_public_names("ascend_eplb.launch", "ascend-eplb-launch")


def test_the_public_names_oracle_fails_on_what_hasattr_lets_through(monkeypatch):
    """check_public_names refuses a re-exported foreign class, a stale copy of a function, a constant no
    module binds, a name listed twice and a wrong version; each message names the culprit."""
    import importlib.metadata
    import types
    from collections import OrderedDict

    import pytest

    from ascend_eplb.launch import multirank

    pkg = types.ModuleType("ascend_eplb.fakepkg")
    pkg.__path__ = []
    sub = types.ModuleType("ascend_eplb.fakepkg.sub")
    sub.LIMIT = [1, 2]
    monkeypatch.setitem(sys.modules, pkg.__name__, pkg)
    monkeypatch.setitem(sys.modules, sub.__name__, sub)

    def refused(all_, match, **attrs):
        pkg.__all__ = all_
        for k, v in attrs.items():
            setattr(pkg, k, v)
        with pytest.raises(AssertionError, match=match):
            check_public_names(pkg.__name__, "ascend-eplb-testing")

    refused(["OrderedDict"], r"fakepkg\.OrderedDict is defined in collections", OrderedDict=OrderedDict)

    def helper():
        return 1

    def stale():
        return 1

    helper.__module__ = stale.__module__ = sub.__name__
    stale.__name__ = stale.__qualname__ = "helper"
    sub.helper = helper
    refused(["helper"], r"fakepkg\.helper is not the object ascend_eplb\.fakepkg\.sub\.helper", helper=stale)
    refused(
        ["run_ranks"], r"defined in ascend_eplb\.launch\.multirank, outside", run_ranks=multirank.run_ranks
    )
    refused(["LIMIT"], r"fakepkg\.LIMIT is bound by no module", LIMIT=[1, 2])  # equal, but a copy
    refused(["LIMIT", "LIMIT"], "lists a name twice", LIMIT=sub.LIMIT)
    refused(["__version__"], r"__version__ '0\.0' != installed", __version__="0.0")
    refused(["missing"], r"fakepkg\.missing does not resolve")
    pkg.__all__ = ["LIMIT", "__version__"]
    pkg.__version__ = importlib.metadata.version("ascend-eplb-testing")
    check_public_names(pkg.__name__, "ascend-eplb-testing")  # the object itself, the right version
