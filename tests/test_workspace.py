"""The workspace's shape (DESIGN.md section 3): packages, declared dependency edges, import contracts."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# DESIGN.md section 3: folder -> (distribution, import package, dependency edges).
PACKAGES = {
    "packages/eplb-launch": ("ascend-eplb-launch", "launch", {"torch"}),
    "packages/eplb-quant-views": ("ascend-eplb-quant-views", "quant_views", {"torch"}),
    "packages/eplb-dataplane": ("ascend-eplb-dataplane", "dataplane", {"torch"}),
    "packages/eplb-movement": ("ascend-eplb-movement", "movement", {"torch", "vllm"}),
    "packages/eplb-control": ("ascend-eplb-control", "control", {"torch", "vllm", "ascend-eplb-dataplane"}),
    "integration": (
        "ascend-eplb-integration",
        "integration",
        {
            "torch",
            "vllm",
            "ascend-eplb-quant-views",
            "ascend-eplb-dataplane",
            "ascend-eplb-movement",
            "ascend-eplb-control",
        },
    ),
    "packages/eplb-world": ("ascend-eplb-world", "world", {"torch", "vllm", "ascend-eplb-integration"}),
    "packages/eplb-tools": (
        "ascend-eplb-tools",
        "tools",
        {"torch", "vllm", "ascend-eplb-integration", "ascend-eplb-launch", "ascend-eplb-world"},
    ),
    "testing": ("ascend-eplb-testing", "testing", {"torch", "ascend-eplb-launch"}),
}
# Third-party libraries a package may use beside its edges (traces, progress, plots; the serving
# product's Prometheus metrics, prometheus_client, already a dependency of vLLM).
TOOL_LIBRARIES = {
    "packages/eplb-tools": {"numpy", "tqdm", "matplotlib", "psutil", "prometheus-client", "pyyaml"},
    # the world's tiny checkpoints (world.checkpoints), its ESFT trace, vLLM's loader's progress-bar lock,
    # an engine session's processes (world.engine.session)
    "packages/eplb-world": {"transformers", "safetensors", "numpy", "tqdm", "psutil"},
    "integration": {"prometheus-client"},
}
#: Optional extras a package may declare: torch_npu probes, the dataplane's Triton kernel, the toy
#: MoE model's vLLM.
EXTRAS = {"npu", "triton", "vllm"}
#: The serving product: what a serving image installs. None of it may need the tools' libraries.
SERVING = [
    "packages/eplb-quant-views",
    "packages/eplb-dataplane",
    "packages/eplb-movement",
    "packages/eplb-control",
    "integration",
]
PINS = {"torch": "==2.13.0", "vllm": "==0.33.0"}
#: The torch-only planes declare the range they are tested on (floor: the root's `floor` environment).
TORCH_RANGE = {
    "packages/eplb-launch": ">=2.9.1,<2.14",
    "packages/eplb-quant-views": ">=2.9.1,<2.14",
    "packages/eplb-dataplane": ">=2.9.1,<2.14",
    "testing": ">=2.9.1,<2.14",
}


def _requirement_name(requirement: str) -> tuple[str, str]:
    match = re.match(r"^([A-Za-z0-9_.\-]+)\s*(.*)$", requirement)
    assert match, requirement
    return match.group(1).lower().replace("_", "-"), match.group(2).split(";")[0].strip()


def _pyproject(folder: str) -> dict:
    return tomllib.loads((ROOT / folder / "pyproject.toml").read_text())


@pytest.mark.parametrize("folder", sorted(PACKAGES))
def test_package_layout_and_metadata(folder):
    distribution, module, _ = PACKAGES[folder]
    data = _pyproject(folder)
    assert data["project"]["name"] == distribution
    assert data["build-system"]["build-backend"] == "hatchling.build"
    assert data["project"]["dynamic"] == ["version"]
    about = f"src/ascend_eplb/{module}/__about__.py"
    assert data["tool"]["hatch"]["version"]["path"] == about
    assert re.fullmatch(r'__version__ = "\d+\.\d+\.\d+"\n', (ROOT / folder / about).read_text())
    for name in ("README.md", "CHANGELOG.md", f"src/ascend_eplb/{module}/py.typed"):
        assert (ROOT / folder / name).is_file(), f"{folder}/{name} is missing"
    assert not (ROOT / folder / "src/ascend_eplb/__init__.py").exists(), (
        "ascend_eplb must stay a PEP 420 namespace"
    )
    assert any((ROOT / folder / "tests").glob("test_*.py")), f"{folder}/tests has no tests"


@pytest.mark.parametrize("folder", sorted(PACKAGES))
def test_declared_dependencies_are_the_design_edges(folder):
    _, _, edges = PACKAGES[folder]
    declared = dict(_requirement_name(r) for r in _pyproject(folder)["project"]["dependencies"])
    assert set(declared) == edges | TOOL_LIBRARIES.get(folder, set())
    for name, pin in PINS.items():
        if name == "torch" and folder in TORCH_RANGE:
            pin = TORCH_RANGE[folder]
            floor = _pyproject(".")["tool"]["hatch"]["envs"]["floor"]["dependencies"]
            assert f"torch=={pin.split(',')[0].removeprefix('>=')}" in floor
        if name in declared:
            assert declared[name] == pin, f"{folder} pins {name}{declared[name]}, DESIGN says {name}{pin}"
    extras = _pyproject(folder)["project"].get("optional-dependencies", {})
    assert set(extras) <= EXTRAS, f"{folder} declares extras {sorted(extras)}; allowed: {sorted(EXTRAS)}"


@pytest.mark.parametrize("folder", SERVING)
def test_the_serving_product_pulls_no_tool_library_or_trace(folder):
    declared = {_requirement_name(r)[0] for r in _pyproject(folder)["project"]["dependencies"]}
    assert not declared & {
        "numpy",
        "tqdm",
        "matplotlib",
        "psutil",
        "ascend-eplb-tools",
        "ascend-eplb-world",
        "ascend-eplb-launch",
        "ascend-eplb-testing",
    }
    assert not list((ROOT / folder / "src").rglob("*.npz")), f"{folder} ships trace data"
    assert "scripts" not in _pyproject(folder)["project"], f"{folder} installs a command"


@pytest.mark.parametrize("folder", sorted(PACKAGES))
def test_torch_npu_is_imported_in_at_most_one_probe_module(folder):
    _, module, _ = PACKAGES[folder]
    importers = [
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / folder / "src/ascend_eplb" / module).rglob("*.py")
        if re.search(r"^\s*(import torch_npu|from torch_npu)", path.read_text(), re.MULTILINE)
    ]
    assert len(importers) <= 1, (
        f"torch_npu imported in {importers}; DESIGN allows one guarded probe per package"
    )


def _lint_imports(src_roots: list[Path]) -> subprocess.CompletedProcess[str]:
    """Run import-linter with the workspace's contracts over the given ``src`` roots (first wins)."""
    env = {"PYTHONPATH": ":".join(str(p) for p in src_roots), "PATH": str(Path(sys.executable).parent)}
    return subprocess.run(
        [
            str(Path(sys.executable).parent / "lint-imports"),
            "--config",
            str(ROOT / "pyproject.toml"),
            "--no-cache",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=240,
    )


def _copy_sources(tmp_path: Path) -> list[Path]:
    roots = []
    for folder in PACKAGES:
        dst = tmp_path / folder / "src"
        shutil.copytree(ROOT / folder / "src", dst, ignore=shutil.ignore_patterns("__pycache__", "*.npz"))
        roots.append(dst)
    return roots


_LAYERS = "tools over the world over integration over the planes, without cycles"
_SERVING_FORBIDDEN = "the serving product imports no tools, world, launcher or test support"


def test_import_contracts_hold_on_the_tree():
    result = _lint_imports([ROOT / folder / "src" for folder in PACKAGES])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 15 kept, 0 broken." in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "broken_contract"),
    [
        (
            "dataplane",
            "import vllm.distributed.eplb.eplb_state",
            "quant-views and dataplane never import vllm",
        ),
        ("quant_views", "import vllm", "quant-views and dataplane never import vllm"),
        (
            "control",
            "import ascend_eplb.integration",
            _LAYERS,
        ),
        (
            "dataplane",
            "import ascend_eplb.control",
            _LAYERS,
        ),
        ("integration", "import ascend_eplb.tools", _LAYERS),
        ("integration", "import ascend_eplb.world", _LAYERS),
        ("world", "import ascend_eplb.tools", _LAYERS),
        ("control", "import ascend_eplb.movement", "control depends on dataplane only among the planes"),
        (
            "integration",
            "import ascend_eplb.testing",
            _SERVING_FORBIDDEN,
        ),
        ("tools", "import ascend_eplb.testing", "product code never imports the test support"),
        ("world", "import ascend_eplb.testing", "product code never imports the test support"),
        ("launch", "import ascend_eplb.testing", "product code never imports the test support"),
        ("launch", "import vllm", "the launcher imports no vllm and no other ascend_eplb package"),
        (
            "integration",
            "import ascend_eplb.launch",
            _SERVING_FORBIDDEN,
        ),
        ("integration", "import yaml", "the serving package imports no YAML or argument parser"),
        ("integration", "import argparse", "the serving package imports no YAML or argument parser"),
    ],
)
def test_a_forbidden_import_breaks_the_check(tmp_path, module, line, broken_contract):
    roots = _copy_sources(tmp_path)
    folder = next(f for f, (_, m, _) in PACKAGES.items() if m == module)
    init = tmp_path / folder / "src/ascend_eplb" / module / "__init__.py"
    init.write_text(init.read_text() + f"\n{line}  # injected by the test\n")
    result = _lint_imports(roots)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{broken_contract} BROKEN" in result.stdout


#: vLLM's argument parsing and CLI: the readers of `ascend-eplb check`, the tools', never the serving
#: package's (submodules of an external package, which import-linter cannot name in a contract).
VLLM_CLI_MODULES = ("vllm.entrypoints", "vllm.utils.argparse_utils", "vllm.engine.arg_utils")


def _imports_of(src: Path, modules: tuple[str, ...]) -> list[str]:
    """``file:line module`` for every import (any depth: module, function, TYPE_CHECKING) of ``modules``
    or their submodules under ``src``."""
    found = []
    for path in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            hits = [n for n in names if any(n == m or n.startswith(m + ".") for m in modules)]
            if hits:
                found.append(f"{path.relative_to(src)}:{node.lineno} {hits[0]}")
    return found


def _vllm_cli_imports(src: Path) -> list[str]:
    return _imports_of(src, VLLM_CLI_MODULES)


def test_the_serving_package_imports_no_vllm_argument_parser(tmp_path):
    src = ROOT / "integration/src"
    assert _vllm_cli_imports(src) == []
    # the check sees one put back, inside a function as the removed one was
    copy = tmp_path / "src"
    shutil.copytree(src, copy, ignore=shutil.ignore_patterns("__pycache__"))
    validation = copy / "ascend_eplb/integration/validation.py"
    validation.write_text(
        validation.read_text()
        + "\n\ndef _parser():\n    from vllm.utils.argparse_utils import FlexibleArgumentParser  # injected\n"
    )
    lineno = len(validation.read_text().splitlines())
    assert _vllm_cli_imports(copy) == [
        f"ascend_eplb/integration/validation.py:{lineno} vllm.utils.argparse_utils"
    ]
    # and the tools, where the readers are, do import it
    assert any("argparse_utils" in hit for hit in _vllm_cli_imports(ROOT / "packages/eplb-tools/src"))


def _tools_imports_in_tests(root: Path) -> list[str]:
    """``folder/tests/file:line module`` for every import of ``ascend_eplb.tools`` in the tests of every
    package but the tools (import-linter sees only the packages' sources)."""
    return [
        f"{folder}/tests/{hit}"
        for folder, (_, module, _) in sorted(PACKAGES.items())
        if module != "tools"
        for hit in _imports_of(root / folder / "tests", ("ascend_eplb.tools",))
    ]


def test_no_planes_tests_import_the_tools(tmp_path):
    """DESIGN's "nothing imports the tools" holds for the tests too (issue 39): what the tools and the
    tests share (the CPU world, the toy MoE model, the ESFT trace) is ``ascend-eplb-world``'s."""
    assert _tools_imports_in_tests(ROOT) == []
    # the check sees one put back, in a test and inside a rank function, as `from ascend_eplb import tools`
    for folder in PACKAGES:
        shutil.copytree(
            ROOT / folder / "tests", tmp_path / folder / "tests", ignore=shutil.ignore_patterns("__pycache__")
        )
    control = tmp_path / "packages/eplb-control/tests/test_policy.py"
    control.write_text(control.read_text() + "\nfrom ascend_eplb.tools import plan  # injected\n")
    integration = tmp_path / "integration/tests/ranks_mrv2.py"
    integration.write_text(
        integration.read_text() + "\n\ndef _rank():\n    from ascend_eplb import tools  # injected\n"
    )
    tools = tmp_path / "packages/eplb-tools/tests/test_plan.py"
    tools.write_text(tools.read_text() + "\nfrom ascend_eplb.tools import plan  # the tools' own: allowed\n")
    lines = {path: len(path.read_text().splitlines()) for path in (integration, control)}
    assert _tools_imports_in_tests(tmp_path) == [
        f"integration/tests/ranks_mrv2.py:{lines[integration]} ascend_eplb.tools",
        f"packages/eplb-control/tests/test_policy.py:{lines[control]} ascend_eplb.tools",
    ]


#: The packages CI tests alone, each in its own environment (`.ci/run`'s loop; the `floor` environment).
TESTED_ALONE = ("packages/eplb-launch", "packages/eplb-quant-views", "packages/eplb-dataplane")


def _modules_beyond_its_environment(root: Path) -> list[str]:
    """``folder/tests/file:line module`` for every ``ascend_eplb`` module the tests of a package CI tests
    alone import that the package's own environment does not install: itself and its declared edges,
    and its workspace members (the launcher, the test support), each with their edges."""
    by_path = {(ROOT / folder).resolve(): folder for folder in PACKAGES}
    distributions = {distribution: folder for folder, (distribution, _, _) in PACKAGES.items()}

    def closure(folder: str) -> set[str]:
        _, module, edges = PACKAGES[folder]
        return {module}.union(*(closure(distributions[e]) for e in edges if e in distributions))

    found = []
    for folder in TESTED_ALONE:
        env = _pyproject(folder)["tool"]["hatch"]["envs"]["default"]
        members = [
            by_path[(ROOT / folder / m).resolve()] for m in env.get("workspace", {}).get("members", [])
        ]
        allowed = closure(folder).union(*(closure(m) for m in members))
        for hit in _imports_of(root / folder / "tests", ("ascend_eplb",)):
            module = hit.split()[1].split(".")
            if len(module) > 1 and module[1] not in allowed:
                found.append(f"{folder}/tests/{hit}")
    return found


def test_each_packages_tests_import_only_what_its_environment_installs(tmp_path):
    assert f"for package in {' '.join(TESTED_ALONE)}; do" in (ROOT / ".ci/run").read_text()
    assert _modules_beyond_its_environment(ROOT) == []
    # the import CI's "quant-views alone" caught (dataplane's trace_once in a quant-views test) is seen
    for folder in PACKAGES:
        shutil.copytree(
            ROOT / folder / "tests", tmp_path / folder / "tests", ignore=shutil.ignore_patterns("__pycache__")
        )
    test = tmp_path / "packages/eplb-quant-views/tests/test_batched_equals_per_expert.py"
    test.write_text(
        test.read_text() + "\n\ndef _trace():\n    from ascend_eplb.dataplane import trace_once\n"
    )
    line = len(test.read_text().splitlines())
    assert _modules_beyond_its_environment(tmp_path) == [
        f"packages/eplb-quant-views/tests/test_batched_equals_per_expert.py:{line} ascend_eplb.dataplane"
    ]


#: One import cycle per package (a function-level import back into a module that imports this one), and
#: the contract that must catch it.
CYCLES = [
    (
        "quant_views",
        "_batched.py",
        "from ascend_eplb.quant_views.formats.base import ExpertWeightFormat",
        "quant-views' modules depend one way (no import cycle inside the plane)",
    ),
    (
        "dataplane",
        "ops.py",
        "from ascend_eplb.dataplane.router import bind_router",
        "dataplane's modules depend one way (no import cycle inside the plane)",
    ),
    (
        "movement",
        "staging.py",
        "from ascend_eplb.movement.communicator import AscendGlooEplbCommunicator",
        "movement's modules depend one way (no import cycle inside the plane)",
    ),
    (
        "control",
        "layout.py",
        "from ascend_eplb.control.state import AscendEplbState",
        "control's modules depend one way (no import cycle inside the plane)",
    ),
    (
        "integration",
        "patches.py",
        "from ascend_eplb.integration.runner import create_eplb_controller",
        "integration's modules depend one way (no import cycle inside the package)",
    ),
    (
        "testing",
        "oracles.py",
        "from ascend_eplb.testing.tagged import TaggedExperts",
        "the test support's modules depend one way (no import cycle inside the package)",
    ),
    (
        "world",
        "checkpoints.py",
        "from ascend_eplb.world.rank_model import build_model",
        "the world's modules depend one way (no import cycle inside the package)",
    ),
    (
        "tools",
        "options.py",
        "from ascend_eplb.tools.cli import main",
        "the tools' modules depend one way (no import cycle inside the package)",
    ),
]


def test_an_import_cycle_in_any_package_breaks_its_contract(tmp_path):
    """The cycles issue 21 removed (patches <-> runner, _batched <-> formats.base, ...) cannot come back:
    one cycle injected into each package (inside a function, as the removed ones were) breaks exactly
    that package's contract, and nothing else."""
    roots = _copy_sources(tmp_path)
    for module, file, line, _ in CYCLES:
        folder = next(f for f, (_, m, _) in PACKAGES.items() if m == module)
        path = tmp_path / folder / "src/ascend_eplb" / module / file
        path.write_text(path.read_text() + f"\n\ndef _cycle():\n    {line}  # injected by the test\n")
    result = _lint_imports(roots)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"Contracts: {15 - len(CYCLES)} kept, {len(CYCLES)} broken." in result.stdout
    for _, _, _, contract in CYCLES:
        assert f"{contract} BROKEN" in result.stdout


def _conflict_markers(root: Path, files: list[str]) -> list[str]:
    """``file:line`` of every line a merge left unresolved (git's ``<<<<<<<`` / ``>>>>>>>`` markers)."""
    found = []
    for name in files:
        path = root / name
        if path.suffix not in {".py", ".md", ".toml", ".txt", ".yaml", ".cfg", ""} or not path.is_file():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if line.startswith(("<<<<<<< ", ">>>>>>> ")):
                found.append(f"{name}:{number}")
    return found


def test_no_file_holds_an_unresolved_merge(tmp_path):
    files = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert _conflict_markers(ROOT, files) == []
    # the markers a merge of two CHANGELOG entries once left in integration/CHANGELOG.md are seen
    (tmp_path / "CHANGELOG.md").write_text(
        "# Changelog\n<<<<<<< HEAD\n- ours\n=======\n- theirs\n>>>>>>> b\n"
    )
    assert _conflict_markers(tmp_path, ["CHANGELOG.md"]) == ["CHANGELOG.md:2", "CHANGELOG.md:6"]
