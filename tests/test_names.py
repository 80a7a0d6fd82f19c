"""Names that do not lie: every dotted code name of ascend_eplb that INVARIANTS.md, GLOSSARY.md and the
READMEs mention resolves (its module imports, each attribute exists), and every other backticked name that
looks like code (a CamelCase class, a ``snake_case()`` call, a dotted name) is defined in the project, its
tests' helpers, vLLM (read from its installed source), prometheus_client or Python, or is one of the few
named in :data:`EXTERNAL`."""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.util
import inspect
import os
import pkgutil
import re
import sys
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


#: Modules only an engine process imports: importing vLLM's CPU worker rebinds torch's globals
#: (``torch.Event``, ``torch.accelerator.empty_cache``) for the rest of the process, and a later test on
#: this worker would see upstream's surface drifted. Their classes are read from their source.
ENGINE_ONLY = ("ascend_eplb.world.engine.worker",)


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
            if name in ENGINE_ONLY:
                source = Path(importlib.util.find_spec(name).origin).read_text()
                for node in ast.parse(source).body:
                    if isinstance(node, ast.ClassDef):
                        classes.setdefault(node.name, []).append(name)
                continue
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

    if module_name in ENGINE_ONLY or any(f"{module_name}.{part}" in ENGINE_ONLY for part in path[:1]):
        name = module_name if module_name in ENGINE_ONLY else f"{module_name}.{path[0]}"
        rest = path if module_name in ENGINE_ONLY else path[1:]
        tree = ast.parse(Path(importlib.util.find_spec(name).origin).read_text())
        defined = {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))} | {
            alias.asname or alias.name
            for n in tree.body
            if isinstance(n, ast.ImportFrom)
            for alias in n.names
        }
        return not rest or (len(rest) == 1 and rest[0] in defined)
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


#: The sources whose names are the project's: every distribution's ``src``.
SOURCES = sorted({*ROOT.glob("packages/*/src"), ROOT / "integration" / "src", ROOT / "testing" / "src"})
#: Import roots of other projects (``torch.compile``, ``tl.atomic_add``); the standard library's
#: (``gc.freeze``) are Python's own.
EXTERNAL_MODULES = {
    "torch",
    "dist",
    "triton",
    "tl",
    "numpy",
    "np",
    "vllm",
    "vllm_ascend",
    "prometheus_client",
    "yaml",  # PyYAML, the config files' reader
}
#: Names the documents use that are not ours and that no installed source here defines, each by origin.
EXTERNAL = {
    # vLLM Ascend (not installed in this workspace)
    "AscendConfig",
    "AscendRoutedExperts",
    "AscendUnquantizedFusedMoEMethod",
    "AscendW4A8DynamicFusedMoEMethod",
    "AscendW8A8DynamicFusedMoEMethod",
    # torch (not scanned: its source is large): the tensor class, a method, two dispatch keys
    "Tensor",
    "transpose",
    "CompositeExplicitAutograd",
    "PrivateUse1",
    # PromQL's functions, /proc/meminfo's field
    "increase",
    "rate",
    "MemAvailable",
    # placeholders, a formula's function and variables of the documents' snippets
    "Class",
    "fn",
    "clamp",
    "self",
    "storage",
    "consumed_event",
    "vllm_config",
}
#: A CamelCase name (two humps at least: ``AscendEplbState``, ``DeepseekV3ForCausalLM``).
_CAMEL = re.compile(r"^_?[A-Z][a-z0-9]+(?:[A-Z][A-Za-z0-9]*)+$")
#: A snake_case name called: ``check_upstream_state_signatures()``, ``fn(ctx, *args)``.
_CALL = re.compile(r"^(_?[a-z][a-z0-9]*(?:_[a-z0-9]+)*)\(")
#: A function, method or class defined in a source read as text.
_DEFINITION = re.compile(r"^\s*(?:async\s+)?(?:def|class)\s+(\w+)", re.MULTILINE)


def _assigned(body: list[ast.stmt]) -> set[str]:
    names: set[str] = set()
    for node in body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for target in targets if isinstance(node, ast.Assign | ast.AnnAssign) else []:
            names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def _defined() -> set[str]:
    """Every name the project's sources define: each module's and package's name, every function,
    method and class (at any depth), every module-level and class-level assigned name (constants,
    dataclass fields)."""
    names: set[str] = set()
    for src in SOURCES:
        for path in src.rglob("*.py"):
            names.update(part for part in path.relative_to(src).with_suffix("").parts if part != "__init__")
            tree = ast.parse(path.read_text())
            names.update(_assigned(tree.body))
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    names.add(node.name)
                if isinstance(node, ast.ClassDef):
                    names.update(_assigned(node.body))
    return names


def _test_helpers() -> dict[str, set[str]]:
    """The tests' modules by name (``ranks_real_models``), each with its top-level names."""
    helpers: dict[str, set[str]] = {}
    for path in [*ROOT.glob("tests/*.py"), *ROOT.glob("*/tests/*.py"), *ROOT.glob("packages/*/tests/*.py")]:
        tree = ast.parse(path.read_text())
        top = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)}
        helpers.setdefault(path.stem, set()).update(top | _assigned(tree.body))
    return helpers


def _upstream() -> set[str]:
    """The names installed vLLM and prometheus_client define: modules, functions, methods and classes (a
    text scan of their sources), and vLLM's config fields (``eplb_config``, ``additional_config``)."""
    names: set[str] = set()
    for package in ("vllm", "prometheus_client"):
        (folder,) = importlib.util.find_spec(package).submodule_search_locations
        for path in Path(folder).rglob("*.py"):
            names.add(path.stem)
            names.update(_DEFINITION.findall(path.read_text()))
    (vllm,) = importlib.util.find_spec("vllm").submodule_search_locations
    for path in (Path(vllm) / "config").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                names.update(_assigned(node.body))
    return names


_KNOWN: list[tuple[set[str], dict[str, set[str]], set[str]]] = []


def _known() -> tuple[set[str], dict[str, set[str]], set[str]]:
    if not _KNOWN:
        _KNOWN.append((_defined(), _test_helpers(), _upstream()))
    return _KNOWN[0]


def _unknown(text: str) -> bool:
    """Whether a backticked ``text`` looks like code but names nothing known: a dotted name that is not a
    name of ours (those :func:`_ours` resolves) whose first component is nothing known, or whose first
    component is a test helper module that does not define the second; a CamelCase name or a
    ``snake_case(...)`` call that nothing known defines."""
    defined, helpers, upstream = _known()
    name = text.split("(")[0].removesuffix(".")

    def known(word: str) -> bool:
        return any(word in names for names in (defined, upstream, EXTERNAL)) or hasattr(builtins, word)

    if _DOTTED.match(name) and not name.endswith(_FILES):
        if _ours(name, *_index()):
            return False  # test_every_code_name_the_documents_mention_resolves checks it
        first, second = name.split(".")[:2]
        if first in helpers and first not in defined:
            return second not in helpers[first]
        return not (first in EXTERNAL_MODULES or first in sys.stdlib_module_names or known(first))
    call = _CALL.match(text)
    if call or _CAMEL.match(name):
        return not known(call.group(1) if call else name)
    return False


def test_a_misspelled_or_unknown_name_is_seen_and_known_ones_pass():
    """The check itself (issue 30): names of ours misspelled, renamed or invented fail; ours, vLLM's,
    Python's and the test helpers' pass; words that do not look like code are not judged."""
    for wrong in (
        "AscendEplbStat",  # a class of ours misspelled
        "check_upstreams()",  # patches.check_upstream() is the function
        "Foo.bar",
        "ranks_real_models.metric_world",  # the helper defines metrics_world
        "EplbStat.step",
    ):
        assert _unknown(wrong), wrong
    for right in (
        "AscendEplbState",
        "check_upstream()",
        "check_upstream_state_signatures()",
        "ranks_real_models.metrics_world",
        "EplbState.step",  # vLLM's
        "DeepseekV3ForCausalLM",
        "eplb_config.policy",  # vLLM's config field
        "gc.freeze",
        "ValueError",
        "int(x)",
        "torch.compile",
        "AscendW8A8DynamicFusedMoEMethod",  # EXTERNAL
        "window_size",  # a field name, not a call: not judged
        "ASCEND_EPLB_EVENTS",
    ):
        assert not _unknown(right), right


def test_every_name_that_looks_like_code_is_defined_somewhere_known():
    unknown: dict[str, set[str]] = {}
    for path in DOCUMENTS:
        for match in re.finditer(r"`([^`\n]+)`", path.read_text()):
            text = match.group(1).strip()
            if _unknown(text):
                unknown.setdefault(text, set()).add(path.relative_to(ROOT).as_posix())
    assert {name: sorted(where) for name, where in unknown.items()} == {}
