"""The public names of the tools (the command is the interface; these are its Python entry points)."""

import pytest

from ascend_eplb.testing.api import check_public_names


@pytest.mark.parametrize(
    "module",
    [
        "ascend_eplb.tools",
        "ascend_eplb.tools.cli",
        "ascend_eplb.tools.check",
        "ascend_eplb.tools.simulate.driver",
    ],
)
def test_each_public_name_is_the_tools_own(module):
    check_public_names(module, "ascend-eplb-tools")
