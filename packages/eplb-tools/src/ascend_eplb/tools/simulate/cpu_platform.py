"""The vLLM platform of every simulator process, set before vLLM is first imported.

Every module of the simulator that imports vLLM at its top imports this one first: vLLM picks its
platform from ``VLLM_TARGET_DEVICE`` at import, and the simulator's ranks are CPU processes (a value
already in the environment is kept).
"""

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
