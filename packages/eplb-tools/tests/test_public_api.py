"""The public names of the tools (the command is the interface; these are its Python entry points)."""

import ascend_eplb.tools as tools
from ascend_eplb.tools import check, cli
from ascend_eplb.tools.simulate import driver


def test_all_is_the_documented_api():
    assert tools.__all__ == ["__version__"]
    assert sorted(cli.__all__) == ["Parser", "build_parser", "main"]
    assert sorted(check.__all__) == ["check_config_file", "check_serve_command"]
    assert sorted(driver.__all__) == ["SimulationError", "run_simulation", "under_torchrun"]
