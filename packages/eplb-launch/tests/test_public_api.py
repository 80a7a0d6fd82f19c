"""The launcher's public names: each the object its module defines, the installed version."""

import importlib.metadata

import ascend_eplb.launch as launch
from ascend_eplb.launch import __about__, multirank


def test_each_public_name_is_multiranks_own():
    for name in launch.__all__:
        assert getattr(launch, name) is getattr(multirank, name), name
    assert __about__.__version__ == importlib.metadata.version("ascend-eplb-launch")
