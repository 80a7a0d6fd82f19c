"""Test support shared by every ascend-eplb package (development only, never released)."""

from ascend_eplb.testing.multirank import RANK_ENV, RankContext, RankFailureError, load_module, run_ranks

__all__ = ["RANK_ENV", "RankContext", "RankFailureError", "load_module", "run_ranks"]
