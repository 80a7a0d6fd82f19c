"""Names that do not lie: every dotted code name of ascend_eplb that INVARIANTS.md, GLOSSARY.md and the
READMEs mention resolves (its module imports, each attribute exists)."""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
import re
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before anything imports vllm


ROOT = Path(__file__).resolve().parents[1]
#: The documents whose code names are checked.
DOCUMENTS = sorted(
    {
        ROOT / "INVARIANTS.md",
        ROOT / "GLOSSARY.md",
        ROOT / "README.md",
        *ROOT.glob("*/README.md"),
        *ROOT.glob("packages/*/README.md"),
    }
)
#: A dotted name in backticks (a call's arguments dropped): ``control.state.AscendEplbState.after_commit``.
_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+$")
#: Backticked file names (``report.json``, ``test_ops.py``) are paths, not code names.
_FILES = (
    ".py",
    ".md",
    ".json",
    ".jsonl",
    ".png",
    ".toml",
    ".npz",
    ".npy",
    ".yaml",
    ".txt",
    ".safetensors",
    ".prom",
)


def _packages() -> list[str]:
    """``ascend_eplb``'s subpackages (PEP 420 namespace: one folder per distribution)."""
    import ascend_eplb

    return sorted({m.name for m in pkgutil.iter_modules(ascend_eplb.__path__)})


def _module_index() -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Every module of ascend_eplb by its last component and by each dotted suffix of it, and every class
    they define by name, each with the modules that define it."""
    modules: dict[str, list[str]] = {}
    classes: dict[str, list[str]] = {}
    for package in _packages():
        root = importlib.import_module(f"ascend_eplb.{package}")
        names = [root.__name__] + [m.name for m in pkgutil.walk_packages(root.__path__, f"{root.__name__}.")]
        for name in names:
            parts = name.split(".")[1:]
            for cut in range(len(parts)):
                modules.setdefault(".".join(parts[cut:]), []).append(name)
            module = importlib.import_module(name)
            for attr, value in vars(module).items():
                if inspect.isclass(value) and value.__module__ == name:
                    classes.setdefault(attr, []).append(name)
    return modules, classes


def _mentions() -> dict[str, set[str]]:
    """Each dotted name in backticks, with the documents that mention it."""
    found: dict[str, set[str]] = {}
    for path in DOCUMENTS:
        for match in re.finditer(r"`([^`\n]+)`", path.read_text()):
            text = match.group(1).strip().split("(")[0].removesuffix(".")
            if _DOTTED.match(text) and not text.endswith(_FILES):
                found.setdefault(text, set()).add(path.relative_to(ROOT).as_posix())
    return found


def _resolve_in(module_name: str, path: list[str]) -> bool:
    """Whether ``module_name`` plus the attribute ``path`` exists: submodules imported, attributes read
    with ``getattr``; the last one may be an instance attribute its class declares (a dataclass field,
    or ``self.<name> =`` in an ``__init__``)."""
    from ascend_eplb.control.patching import declares_attribute

    value = importlib.import_module(module_name)
    for index, part in enumerate(path):
        if inspect.ismodule(value) and not hasattr(value, part):
            try:
                value = importlib.import_module(f"{value.__name__}.{part}")
                continue
            except ImportError:
                return False
        if hasattr(value, part):
            value = getattr(value, part)
            continue
        return index == len(path) - 1 and inspect.isclass(value) and declares_attribute(value, part)
    return True


def _ours(
    name: str, modules: dict[str, list[str]], classes: dict[str, list[str]]
) -> list[tuple[str, list[str]]]:
    """Where ``name`` may live in ascend_eplb, as (module, attribute path) candidates: after the longest
    dotted prefix naming a module of ours (``verify``, ``formats.base``, ``control.state``,
    ``ascend_eplb.control.upstream``), or in the modules defining a class of that first name
    (``AscendEplbState.commit_log``). Empty when it is not a name of ours (``torch.compile``,
    ``self.eplb``, upstream's ``EplbState.step``)."""
    parts = name.split(".")
    if parts[0] == "ascend_eplb":
        parts = parts[1:]
    for cut in range(len(parts), 0, -1):
        found = modules.get(".".join(parts[:cut]), [])
        if found:
            return [(module, parts[cut:]) for module in found]
    return [(module, parts) for module in classes.get(parts[0], [])]


def test_the_index_sees_a_wrong_name_and_an_instance_attribute():
    """The resolver itself: the name issue 30 found wrong fails, its right spelling and an attribute set
    in ``__init__`` pass."""
    modules, classes = _index()
    assert not any(_resolve_in(m, p) for m, p in _ours("verify.slot_fingerprint", modules, classes))
    assert any(_resolve_in(m, p) for m, p in _ours("verify.slot_fingerprints", modules, classes))
    assert any(_resolve_in(m, p) for m, p in _ours("AscendEplbState.commit_log", modules, classes))
    assert _ours("torch.compile", modules, classes) == []
    assert _ours("EplbState.step", modules, classes) == []


_INDEX: list[tuple[dict[str, list[str]], dict[str, list[str]]]] = []


def _index() -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    if not _INDEX:
        _INDEX.append(_module_index())
    return _INDEX[0]


def test_every_code_name_the_documents_mention_resolves():
    modules, classes = _index()
    unresolved = []
    checked = 0
    for name, where in sorted(_mentions().items()):
        candidates = _ours(name, modules, classes)
        if not candidates:
            continue
        checked += 1
        if not any(_resolve_in(module, path) for module, path in candidates):
            unresolved.append(f"{name} ({', '.join(sorted(where))})")
    assert unresolved == []
    assert checked > 100  # the documents name that many of ours; a broken extraction would see none


#: A test named as ``path/to/test_x.py::test_name`` (``::test_other`` continues the previous file).
_TEST_REFERENCE = re.compile(r"`([\w./-]+\.py)?::(\w+)`")


def test_every_test_the_documents_name_exists():
    """INVARIANTS.md and the READMEs cite tests as evidence: each cited test is defined in its file (a
    parametrized test by its function's name)."""
    missing = []
    cited = 0
    for path in DOCUMENTS:
        current = None
        for match in _TEST_REFERENCE.finditer(path.read_text()):
            file, name = match.groups()
            current = file or current
            if current is None:
                continue
            cited += 1
            # A package's README cites its tests from its own folder, the others from the root.
            source = next((p for p in (path.parent / current, ROOT / current) if p.is_file()), None)
            if source is None or not re.search(rf"^def {name}\(", source.read_text(), re.MULTILINE):
                missing.append(f"{current}::{name} ({path.relative_to(ROOT).as_posix()})")
    assert missing == []
    assert cited > 50
