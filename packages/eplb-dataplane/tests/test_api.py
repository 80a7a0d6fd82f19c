"""The public names of ascend_eplb.dataplane, and the package without its optional triton extra."""

import subprocess
import sys
import textwrap

from ascend_eplb.testing.api import check_public_names


def test_each_public_name_is_the_packages_own():
    # Each name is the object a dataplane module defines or binds; __version__ is the installed one.
    check_public_names("ascend_eplb.dataplane", "ascend-eplb-dataplane")


# Run in a fresh interpreter where `import triton` fails, as on a host without the [triton] extra.
_WITHOUT_TRITON = textwrap.dedent(
    """
    import sys

    class NoTriton:
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ImportError(f"blocked {name}")
            return None

    sys.meta_path.insert(0, NoTriton())
    import torch
    from ascend_eplb.dataplane import _triton, map_to_physical_and_record, ops

    assert "triton" not in sys.modules
    assert _triton.HAS_TRITON is False and _triton.TRITON_VERSION is None
    assert ops.TRITON_DISPATCH_KEYS == ()
    for name in ("map_to_physical", "map_to_physical_and_record"):
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(f"ascend_eplb::{name}", "CUDA")
    table = torch.tensor([[2, 0, 1]], dtype=torch.int32)
    load = torch.zeros(3, dtype=torch.int32)
    ids = torch.tensor([[0, 1], [2, 3], [0, 0]])
    out = map_to_physical_and_record(ids, table, load, torch.tensor(True), torch.tensor(2))
    print(out.tolist(), load.tolist())
    """
)


def test_package_imports_and_maps_without_triton():
    proc = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TRITON], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[[2, 0], [1, -1], [2, 2]] [1, 1, 1]"
