"""The engine world: vLLM 0.33.0's own engine (``LLM``, ``vllm serve``, Model Runner V2's CPU runner) on a
CPU host whose vLLM build has no device kernels, opted in per process (``ASCEND_EPLB_ENGINE_WORLD=1``).

:mod:`.environment` (the engine processes' environment, written once), :mod:`.kernels` (torch forms of the
``_C`` ops vLLM's CPU platform calls), :mod:`.platform_patches` (a CPU build of vLLM and Triton's
interpreter, while vLLM resolves its platform) and :mod:`.patches` (what else it needs, each a declared
row), :mod:`.plugin` (the two vLLM entry points that install them, inert without the opt-in), :mod:`.worker`
(vLLM's CPU worker loaded with the world's worker row), :mod:`.spec` (one engine's settings),
:mod:`.host` (an engine in a process of its own, :mod:`.host_main`; :mod:`.data_parallel`, vLLM's DP
engine there), :mod:`.probes` (what the world observes inside the workers) and :mod:`.faults` (what it
breaks there).

The import-order rule, written here once: an engine process's environment is set before vLLM or Triton is
imported (Triton reads ``TRITON_INTERPRET`` when it loads; vLLM's platform plugin runs while vLLM resolves
its platform), so an engine runs in a process started with it (:mod:`.host`), never in one that has
imported them. vLLM loads :mod:`.plugin` in every process of an environment that installs this package: it
imports nothing more before the opt-in. Then the platform plugin imports :mod:`.platform_patches`, which
imports Triton and no more of vLLM (vLLM is resolving its platform); the general plugin, run once the
platform is known, imports :mod:`.kernels` and :mod:`.patches`, and with them the world's ``stand_ins``,
``quant_method`` and ``kernel_logs``, which import vLLM at the top. :mod:`.host` (the client) imports no
vLLM; the host's process, :mod:`.host_main`, imports it at the top. :mod:`.probes` and :mod:`.faults` run
in vLLM's workers but are imported by the processes that send them there (``ascend-eplb simulate``, the
engine tests), which import no vLLM: they import it inside their functions. Each import kept inside a
function says ``# local:`` and why.
"""
