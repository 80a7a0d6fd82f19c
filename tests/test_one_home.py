"""One home per fact, or homes that agree: where a fact must be written in several places (no package all
of its readers may import, or a file format that cannot import), the places are checked against each
other here."""

from __future__ import annotations

import ast
import importlib.util
import re
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _is_int_homes():
    """The four copies of "an integer, not a bool": quant_views and dataplane import torch only and
    neither the other, movement neither of them, so no package all four may import exists (DESIGN.md
    section 3)."""
    from ascend_eplb.control.values import is_int as control
    from ascend_eplb.dataplane.lookup import is_int as dataplane
    from ascend_eplb.movement._values import is_int as movement
    from ascend_eplb.quant_views._validate import is_int as quant_views

    return {"quant_views": quant_views, "dataplane": dataplane, "movement": movement, "control": control}


INTEGERS = [0, 3, -1, 2**70, np.int64(5), np.int32(-2), np.uint8(7), np.intp(1)]
NOT_INTEGERS = [True, False, np.bool_(True), 3.0, np.float64(2.0), "3", None, torch.tensor(3), [1], 1 + 0j]


@pytest.mark.parametrize("value", INTEGERS + NOT_INTEGERS, ids=repr)
def test_every_copy_of_is_int_gives_the_same_answer(value):
    """Issue 30: movement's accepted numpy integers, the other three did not."""
    answers = {home: fn(value) for home, fn in _is_int_homes().items()}
    expected = any(value is v for v in INTEGERS)
    assert answers == dict.fromkeys(answers, expected)


def _folders_on_disk() -> list[str]:
    """Every distribution of the workspace: a folder with a ``pyproject.toml`` and a ``src/ascend_eplb``."""
    return sorted(
        path.parent.relative_to(ROOT).as_posix()
        for path in [*ROOT.glob("*/pyproject.toml"), *ROOT.glob("packages/*/pyproject.toml")]
        if (path.parent / "src/ascend_eplb").is_dir()
    )


def _import_name(folder: str) -> str:
    (name,) = [
        p.name for p in (ROOT / folder / "src/ascend_eplb").iterdir() if p.is_dir() and p.name[0] != "_"
    ]
    return name


def _workspace_test_packages() -> dict:
    spec = importlib.util.spec_from_file_location("_workspace_shape", ROOT / "tests/test_workspace.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PACKAGES


def _ci_folders() -> list[str]:
    match = re.search(r"^folders = (\[.*?\])$", (ROOT / ".ci/run").read_text(), re.MULTILINE | re.DOTALL)
    assert match, ".ci/run lists no folders"
    return ast.literal_eval(match.group(1))


def _readme_packages() -> dict[str, tuple[str, str]]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Packages and dependency graph", 1)[1]
    rows = re.findall(r"^\| `([^`]+)` \| ([a-z-]+) \| `ascend_eplb\.([a-z_]+)` \|", section, re.MULTILINE)
    return {folder: (distribution, name) for folder, distribution, name in rows}


def test_every_list_of_the_packages_names_the_same_packages():
    """Issue 30: the package list is written in six places; each must name the workspace's distributions
    (the folders with a ``pyproject.toml`` and sources), no more, no fewer."""
    folders = _folders_on_disk()
    assert len(folders) >= 8
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert sorted(root["tool"]["hatch"]["envs"]["default"]["workspace"]["members"]) == folders
    assert sorted(root["tool"]["pytest"]["ini_options"]["testpaths"]) == sorted(
        [f"{f}/tests" for f in folders] + ["tests"]
    )
    assert sorted(root["tool"]["importlinter"]["root_packages"]) == sorted(
        f"ascend_eplb.{_import_name(f)}" for f in folders
    )
    assert sorted(_ci_folders()) == sorted([f"{f}/" for f in folders] + ["tests/"])
    shape = _workspace_test_packages()
    assert sorted(shape) == folders
    readme = _readme_packages()
    assert sorted(readme) == folders
    for folder in folders:
        project = tomllib.loads((ROOT / folder / "pyproject.toml").read_text())["project"]
        assert readme[folder] == (project["name"], _import_name(folder)), folder
        assert shape[folder][:2] == (project["name"], _import_name(folder)), folder
