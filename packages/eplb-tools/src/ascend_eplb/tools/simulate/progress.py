"""What ``simulate`` shows on stderr while it runs: start-up as its own phase, then a bar of the steps.

Start-up (vLLM's import in the fork server, the ranks' start, the model's load and wiring) takes most
of a short run (about 48 s of a 63 s run on 2 cores); counted as the first step, the bar read
``1/24 [00:48<18:34]``, an estimate 18 times the run's. The steps' bar starts at the first step, so its
elapsed time, rate and estimate are the steps' own; the start-up line states how long start-up took.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from tqdm import tqdm

__all__ = ["START_UP", "Progress"]

#: The start-up phase's label.
START_UP = "start-up (vLLM import, ranks, model load)"


class Progress:
    """tqdm on ``file`` (default stderr): a start-up line until rank 0's first step, then the steps.

    Args:
        steps: the run's steps (the bar's total).
        file: where to draw.
    """

    def __init__(self, steps: int, file: TextIO | None = None) -> None:
        self._tqdm = tqdm
        self._steps = steps
        self._file = sys.stderr if file is None else file
        self._start_up = tqdm(total=None, desc=START_UP, bar_format="{desc}: {elapsed}", file=self._file)
        self._bar: Any = None

    def step(self, step: int, rearrangements: int, balancedness: float) -> None:
        """Rank 0 finished ``step`` (0-based), with ``rearrangements`` started so far and the step's
        ``balancedness``; the first one ends the start-up phase."""
        if self._bar is None:
            self._start_up.close()
            self._bar = self._tqdm(total=self._steps, desc="steps", unit="step", file=self._file)
        self._bar.n = step + 1
        self._bar.set_postfix(
            rearrangements=rearrangements, balancedness=f"{balancedness:.3f}", refresh=False
        )
        self._bar.refresh()

    def close(self) -> None:
        """End whichever phase is drawing (a run that ends during start-up ends its line)."""
        (self._start_up if self._bar is None else self._bar).close()
