"""A model vLLM has traced already is refused before any router is bound: its trace froze the routers it
read, so a binding afterwards would never map or record (the engine tests bind every model before its
first forward; this holds the refusal's detection on vLLM's own compile wrapper)."""

from __future__ import annotations

import torch
from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper

from ascend_eplb.control.router_adaptation import traced_modules


class _Wrapped(torch.nn.Module, TorchCompileWithNoGuardsWrapper):
    """vLLM's compile wrapper on a module, its state set as vLLM's first compiled forward leaves it (its
    ``__init__`` reads the current VllmConfig, which a unit test has none of)."""

    def __init__(self) -> None:
        torch.nn.Module.__init__(self)
        self.compiled = False
        self.aot_compiled_fn = None


def test_traced_modules_names_the_modules_vllm_compiled_and_only_those():
    model = torch.nn.Module()
    model.language_model = _Wrapped()
    model.draft = _Wrapped()
    assert traced_modules(model) == []  # built, not yet run: binding is still possible
    model.language_model.compiled = True  # DYNAMO_TRACE_ONCE's first forward ran
    assert traced_modules(model) == ["language_model"]
    model.draft.aot_compiled_fn = object()  # an AOT-compiled function loaded in place
    assert traced_modules(model) == ["language_model", "draft"]
