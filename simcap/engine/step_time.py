"""How long one engine step takes, from the batch it computes.

A small physical, linear form, fitted like a scikit-learn estimator (``fit`` returns self,
learned values end in ``_``)::

    forward = base
            + per_prefill_token  * prefill tokens      (prompt chunks, recomputation)
            + per_decode_token   * decode tokens       (1 per decoding request, + drafts)
            + per_context_token  * attended KV tokens  (sum of context lengths in the batch)
            + mixed_step         * [step mixes prefill into decodes]

The engine's step period adds ``host_overhead`` (scheduling, output processing, messaging:
work vLLM's per-iteration log does not time). With async scheduling that host work overlaps
the next forward, so the period is ``max(forward, host_overhead)``; without it (the CPU
server, and vLLM before async scheduling) the two add up.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import nnls

from simcap.engine.scheduler import SchedulerOutput
from simcap.scenario import StepTimeConfig

FEATURES = ("base", "per_prefill_token", "per_decode_token", "per_context_token", "mixed_step")


def step_features(out: SchedulerOutput) -> tuple[float, float, float, float, float]:
    """The feature row of one step, in the order of ``FEATURES``."""
    mixed = 1.0 if (out.num_prefill_tokens and out.num_decode_reqs) else 0.0
    return (
        1.0,
        float(out.num_prefill_tokens),
        float(out.num_decode_tokens),
        float(out.num_context_tokens),
        mixed,
    )


@dataclass
class StepTimeModel:
    """Linear step-time model; coefficients in seconds per unit of each feature."""

    base: float = 0.004
    per_prefill_token: float = 1.0e-5
    per_decode_token: float = 5.0e-5
    per_context_token: float = 0.0
    mixed_step: float = 0.0
    host_overhead: float = 0.0
    async_scheduling: bool = False

    @classmethod
    def from_config(cls, config: StepTimeConfig, async_scheduling: bool = False) -> "StepTimeModel":
        return cls(**config.model_dump(), async_scheduling=async_scheduling)

    @property
    def coef_(self) -> np.ndarray:
        return np.array([getattr(self, name) for name in FEATURES])

    def forward_time(self, out: SchedulerOutput) -> float:
        """Seconds of the forward pass (and sampling) for the batch ``out``."""
        t = self.base + self.per_prefill_token * out.num_prefill_tokens
        t += self.per_decode_token * out.num_decode_tokens
        if self.per_context_token:
            t += self.per_context_token * out.num_context_tokens
        if self.mixed_step and out.num_prefill_tokens and out.num_decode_reqs:
            t += self.mixed_step
        return t

    def step_period(self, out: SchedulerOutput) -> float:
        """Seconds from one step's start to the next's, host work included."""
        forward = self.forward_time(out)
        if self.async_scheduling:
            return forward if forward > self.host_overhead else self.host_overhead
        return forward + self.host_overhead

    def predict(self, X: np.ndarray) -> np.ndarray:
        """Forward seconds for rows of ``FEATURES``."""
        return np.asarray(X, dtype=float) @ self.coef_

    def fit(self, X: np.ndarray, y: np.ndarray) -> "StepTimeModel":
        """Non-negative least squares on measured forward seconds; sets ``residuals_``."""
        X = np.asarray(X, dtype=float)
        y = np.asarray(y, dtype=float)
        coef, _ = nnls(X, y)
        for name, value in zip(FEATURES, coef):
            setattr(self, name, float(value))
        self.residuals_ = y - X @ coef
        return self
