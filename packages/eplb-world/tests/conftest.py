"""Plain ``pytest`` in this folder: vLLM must know its platform before anything imports it."""

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
