"""What a ``simulate`` run checks, in plain words, and the outputs check's tolerance.

:data:`CHECKS`: the simulator's own (:data:`SIMULATOR_CHECKS`), then the serving verifier's
(``ASCEND_EPLB_VERIFY=1``) and the serving watchdog's (always on); :data:`CHECK_DESCRIPTIONS` (the
summary prints them); :func:`output_rtol` and :data:`OUTPUT_ATOL` (EPLB on against EPLB off).
"""

from __future__ import annotations

from ascend_eplb.integration.guardrail_facts import VERIFIER_CHECKS, WATCHDOG_CHECK

__all__ = [
    "CHECKS",
    "CHECK_DESCRIPTIONS",
    "OUTPUT_ATOL",
    "OUTPUT_RTOL",
    "OUTPUT_RTOL_16BIT",
    "SIMULATOR_CHECKS",
    "output_rtol",
]

#: The simulator's own checks; the others are the serving verifier's (ASCEND_EPLB_VERIFY=1) and the
#: serving watchdog's (always on).
SIMULATOR_CHECKS = ("outputs", "load")
CHECKS = (*SIMULATOR_CHECKS, *VERIFIER_CHECKS, WATCHDOG_CHECK)
#: Each check in plain words (the summary prints them).
CHECK_DESCRIPTIONS = {
    "outputs": "the outputs equal the EPLB-off model's every step",
    "load": "the recorded load equals the routed real tokens (padding excluded)",
    "fingerprints": "each moved expert's weights equal its logical expert's after the commit",
    "lookups": "routing tables equal the committed placement, the same on every rank",
    "worker": "the async EPLB worker stayed alive and made progress",
}
#: Output tolerance against the EPLB-off reference. Moved weights are bit-identical, so the only
#: difference is float32 summation order (per-rank partial sums, then all_reduce): a few ulps of the
#: largest value.
OUTPUT_RTOL = 1e-5
OUTPUT_ATOL = 1e-6
#: 16-bit activations (the bf16/fp16 formats): the per-rank partial sums of a token's selections are
#: rounded in the activation dtype, so a placement that splits them differently differs by rounding of
#: that dtype (measured on logits, before the engine world: at most 0.0625 on a scale of ~9.4, 0.7 %, for
#: bf16 on the DeepSeek-V3 preset, 4 ranks, top-6, 96 steps); the check allows 16 units of roundoff (bf16
#: 2**-8, fp16 2**-11). A wrong expert or replica is off by tens of percent (the replica-agreement bug:
#: 52-105 %).
OUTPUT_RTOL_16BIT = {"bf16": 16 * 2.0**-8, "fp16": 16 * 2.0**-11}


def output_rtol(fmt: str | None) -> float:
    """The outputs check's relative tolerance for experts of format ``fmt`` (activations in its dtype)."""
    return OUTPUT_RTOL_16BIT.get(fmt or "", OUTPUT_RTOL)
