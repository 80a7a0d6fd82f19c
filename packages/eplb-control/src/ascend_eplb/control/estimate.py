"""The load the policy plans on: the expected load of the next windows, from the windows seen so far.

Per layer, the estimate pools every window's selections since the layer's last shift and restarts when
the data shows one: the new selections and the pooled ones form a 2 x E table whose Pearson X^2, over
the dispersion ``phi``, is tested against chi-square with ``E' - 1`` degrees of freedom at
``FALSE_ALARM / L``. ``phi`` is the quasi-likelihood dispersion (McCullagh and Nelder, *Generalized
Linear Models*, 2nd ed., 1989, section 4.5.2), the median of the last :data:`DISPERSION_HISTORY`
comparisons, at least 1. Only new evidence counts: the caller hands over the selections recorded since
its last update. float64 in a fixed order: bit-identical on every rank. O(L E) a window (README "Load
estimate").
"""

from __future__ import annotations

import collections

import numpy as np
import torch

__all__ = ["DISPERSION_HISTORY", "FALSE_ALARM", "LoadEstimate"]

#: The probability that a steady window restarts some layer of the model (the test's level, split evenly
#: over the layers).
FALSE_ALARM = 1e-3
#: Comparisons per layer whose median is the layer's dispersion.
DISPERSION_HISTORY = 16


class LoadEstimate:
    """One registered model's estimate of its load per MoE layer and logical expert.

    Attributes:
        restarted: bool ``(L,)``, the layers the last :meth:`update` restarted (None before one).
        dispersion: float64 ``(L,)``, each layer's ``phi`` the last update tested with.
        windows: int, updates so far.
    """

    def __init__(self) -> None:
        self._pooled: np.ndarray | None = None
        self._scale: np.ndarray | None = None
        self._ratios: collections.deque[np.ndarray] = collections.deque(maxlen=DISPERSION_HISTORY)
        self.restarted: np.ndarray | None = None
        self.dispersion: np.ndarray | None = None
        self.windows = 0

    def update(self, selections: torch.Tensor) -> None:
        """Take in the selections recorded since the last update.

        Args:
            selections: ``(L, E)`` global selections per MoE layer and logical expert, integer or float,
                finite and non-negative (the all-reduced new evidence, equal on every rank). A layer
                with none keeps its estimate.

        Raises:
            ValueError: ``selections`` is not such a tensor, or its shape differs from the first
                update's (nothing is changed).
        """
        if (
            not isinstance(selections, torch.Tensor)
            or selections.dim() != 2
            or selections.dtype == torch.bool
        ):
            raise ValueError(f"selections={selections!r}: must be a 2-D (L, E) tensor of counts")
        new = selections.detach().to("cpu", torch.float64).numpy()
        if not np.isfinite(new).all() or (new.size and new.min() < 0):
            raise ValueError("selections: every count must be finite and >= 0")
        if self._pooled is not None and new.shape != self._pooled.shape:
            raise ValueError(
                f"selections has shape {tuple(new.shape)}: this estimate is of shape {self._pooled.shape}"
            )
        self.windows += 1
        fresh = new.sum(axis=1)  # (L,)
        if self._pooled is None:
            self._pooled, self._scale = new.copy(), fresh.copy()
            self.restarted = np.zeros(new.shape[0], dtype=bool)
            self.dispersion = np.ones(new.shape[0])
            return
        pooled = self._pooled
        x2, df = _pearson(pooled, new)
        judged = (fresh > 0) & (pooled.sum(axis=1) > 0) & (df > 0)
        if self._ratios:
            history = np.stack(self._ratios)
            seen = ~np.isnan(history).all(axis=0)
            median = np.nanmedian(np.where(seen, history, 1.0), axis=0)
            phi = np.maximum(median, 1.0)
        else:
            phi = np.ones(pooled.shape[0])
        level = FALSE_ALARM / pooled.shape[0]
        p_value = torch.special.gammaincc(
            torch.from_numpy(np.maximum(df, 1) / 2.0), torch.from_numpy(x2 / phi / 2.0)
        ).numpy()
        restart = judged & (p_value < level)
        self._ratios.append(np.where(judged, x2 / np.maximum(df, 1), np.nan))
        self._pooled = np.where(restart[:, None], new, pooled + new)
        self._scale = np.where(fresh > 0, fresh, self._scale)
        self.restarted, self.dispersion = restart, phi

    @property
    def load(self) -> torch.Tensor | None:
        """float64 ``(L, E)`` CPU: the expected selections of a window as large as each layer's latest
        evidence (the pooled shares times its selections); None before the first update."""
        if self._pooled is None or self._scale is None:
            return None
        total = self._pooled.sum(axis=1, keepdims=True)
        shares = self._pooled / np.where(total > 0, total, 1.0)
        return torch.from_numpy(shares * self._scale[:, None])


def _pearson(pooled: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(X^2, df)`` ``(L,)``: Pearson's statistic of each layer's 2 x E table (pooled, new) over the
    experts with a selection, and its degrees of freedom (those experts less one)."""
    total = pooled + new
    seen = total > 0
    n_pooled, n_new = pooled.sum(axis=1, keepdims=True), new.sum(axis=1, keepdims=True)
    grand = n_pooled + n_new
    share = total / np.where(grand > 0, grand, 1.0)
    expect_pooled, expect_new = n_pooled * share, n_new * share
    safe = np.where(seen, 1.0, 0.0)
    terms = (pooled - expect_pooled) ** 2 / np.where(seen & (expect_pooled > 0), expect_pooled, 1.0) * safe
    terms += (new - expect_new) ** 2 / np.where(seen & (expect_new > 0), expect_new, 1.0) * safe
    return terms.sum(axis=1), seen.sum(axis=1) - 1
