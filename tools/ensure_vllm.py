"""Install torch 2.13.0 and vLLM 0.33.0 (built from its source release) into the running interpreter.

vLLM is built the way vLLM Ascend installs it (DESIGN.md section 6): from the PyPI source release, with
``VLLM_TARGET_DEVICE=empty VLLM_SKIP_VERSION_SUFFIX=1`` and no build isolation, against the torch that is
already installed. The built wheel is cached under ``$ASCEND_EPLB_CACHE`` (default
``~/.cache/ascend-eplb``) so a second environment installs it in seconds. Every step is skipped when
what it produces is already present, so this is quick when nothing is missing.

Run by hatch as a ``pre-install-commands`` entry, before the workspace packages (which pin
``vllm==0.33.0``) are installed, so pip never tries to fetch a CUDA wheel of vLLM from the index.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

TORCH_VERSION = "2.13.0"
VLLM_VERSION = "0.33.0"
BUILD_REQUIREMENTS = [
    "setuptools>=77,<81",
    "setuptools-scm",
    "setuptools-rust",
    "wheel",
    "jinja2",
    "packaging",
]


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _pip(*args: str, env: dict[str, str] | None = None) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env)


def _cached_wheel(cache: Path) -> Path | None:
    wheels = sorted(cache.glob(f"vllm-{VLLM_VERSION}-*.whl"))
    return wheels[-1] if wheels else None


def main() -> int:
    torch_version = _installed("torch")
    if torch_version is None or not torch_version.startswith(TORCH_VERSION):
        # Plain pip honours the machine's pip configuration, which serves the CPU build of torch.
        _pip("install", "-q", f"torch=={TORCH_VERSION}")
    if _installed("vllm") == VLLM_VERSION:
        return 0
    # An empty ASCEND_EPLB_CACHE is unset (Path("") would be the current folder), as the tools read it.
    given = os.environ.get("ASCEND_EPLB_CACHE", "")
    cache = Path(given) if given.strip() else Path.home() / ".cache" / "ascend-eplb"
    cache.mkdir(parents=True, exist_ok=True)
    wheel = _cached_wheel(cache)
    build_env = dict(os.environ, VLLM_TARGET_DEVICE="empty", VLLM_SKIP_VERSION_SUFFIX="1")
    if wheel is None:
        _pip("install", "-q", *BUILD_REQUIREMENTS)
        _pip(
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-binary",
            "vllm",
            "-w",
            str(cache),
            f"vllm=={VLLM_VERSION}",
            env=build_env,
        )
        wheel = _cached_wheel(cache)
        if wheel is None:
            raise SystemExit(f"building vllm {VLLM_VERSION} produced no wheel in {cache}")
    _pip("install", "-q", str(wheel), env=build_env)
    if _installed("vllm") != VLLM_VERSION:
        raise SystemExit(f"vllm {VLLM_VERSION} is not importable after installing {wheel}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
