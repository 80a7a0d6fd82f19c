"""The world's modules bind what their ``__all__`` lists; the package itself binds ``__version__`` alone and
imports no vLLM."""

import importlib.metadata
import json
import pkgutil
import subprocess
import sys

import pytest

import ascend_eplb.world as world
import ascend_eplb.world.engine as engine
from ascend_eplb.testing.api import check_public_names

#: Every module of the package but ``__about__``, the ``engine`` package (its names are its modules) and
#: ``engine.worker`` (importing it installs the engine world's worker patches).
MODULES = sorted(
    [f"{world.__name__}.{m.name}" for m in pkgutil.iter_modules(world.__path__) if not m.ispkg]
    + [f"{engine.__name__}.{m.name}" for m in pkgutil.iter_modules(engine.__path__) if m.name != "worker"]
)
MODULES.remove("ascend_eplb.world.__about__")


def test_every_module_is_checked():
    assert len(MODULES) == 26, MODULES


@pytest.mark.parametrize("module", MODULES)
def test_each_module_binds_its_all(module):
    check_public_names(module, "ascend-eplb-world")


def test_importing_the_world_binds_its_version_and_imports_no_vllm():
    code = (
        "import json, sys, ascend_eplb.world as w; print(json.dumps({"
        "'names': sorted(n for n in vars(w) if not n.startswith('_')), 'version': w.__version__, "
        "'vllm': sorted(m for m in sys.modules if m.startswith('vllm'))}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    probed = json.loads(out.stdout)
    assert probed == {"names": [], "version": importlib.metadata.version("ascend-eplb-world"), "vllm": []}
