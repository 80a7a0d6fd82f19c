"""``ascend-eplb simulate``: real routing replayed across EP rank processes through every plane."""

# Every rank process imports this package (``simulate.rank``) before vLLM: keep vLLM's start-up lines
# that do not concern EPLB out of each rank's output (``ascend_eplb.tools.quiet``).
from ascend_eplb.tools import quiet as _quiet

_quiet.install()
