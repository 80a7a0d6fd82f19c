"""The public-names oracle every package's ``test_public_api.py`` runs (standard library only).

A test pins a module's ``__all__``; :func:`check_public_names` checks what each name really is, which
``hasattr`` cannot: it resolves, a class or function is defined inside the package (not re-exported from
vLLM or the test support) and is the object its module holds, any other value is bound by one of the
package's loaded modules, and ``__version__`` is the installed distribution's.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import sys
from types import ModuleType

__all__ = ["check_public_names"]


def _submodules(package: str) -> list[ModuleType]:
    """The loaded modules below ``package`` (the ones its ``__init__`` took its names from)."""
    return [m for n, m in list(sys.modules.items()) if n.startswith(package + ".") and m is not None]


def check_public_names(module_name: str, distribution: str) -> None:
    """Check every name of ``module_name.__all__`` against what the module really binds.

    ``module_name``: e.g. ``"ascend_eplb.control"``, installed by ``distribution``
    (``"ascend-eplb-control"``). Raises ``AssertionError`` naming the first name listed twice or
    breaking a rule of the module docstring.
    """
    module = importlib.import_module(module_name)
    names = list(module.__all__)
    assert len(names) == len(set(names)), f"{module_name}.__all__ lists a name twice: {names}"
    is_package = hasattr(module, "__path__")
    root = module_name if is_package else module_name.rpartition(".")[0]
    for name in names:
        assert hasattr(module, name), f"{module_name}.{name} does not resolve"
        value = getattr(module, name)
        if name == "__version__":
            installed = importlib.metadata.version(distribution)
            assert value == installed, f"{module_name}.__version__ {value!r} != installed {installed!r}"
        elif inspect.isclass(value) or inspect.isfunction(value):
            where = value.__module__
            assert where == module_name or where.startswith(root + "."), (
                f"{module_name}.{name} is defined in {where}, outside {root}"
            )
            defining = sys.modules[where]
            assert getattr(defining, value.__name__, None) is value, (
                f"{module_name}.{name} is not the object {where}.{value.__name__}"
            )
        elif is_package:
            assert any(getattr(home, name, None) is value for home in _submodules(module_name)), (
                f"{module_name}.{name} is bound by no module of {module_name}"
            )
