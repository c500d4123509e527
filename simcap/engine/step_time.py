"""How long one engine step takes, from the batch it computes.

A small physical, linear form, fitted like a scikit-learn estimator (``fit`` returns self,
learned values end in ``_``)::

    forward = base
            + per_prefill_token  * prefill tokens      (prompt chunks, recomputation)
            + per_decode_token   * decode tokens       (1 per decoding request)
            + per_verify_token   * verified drafts     (speculation: k more per request)
            + per_context_token  * attended KV tokens  (sum of context lengths in the batch)
            + mixed_step         * [step mixes prefill into decodes]
            + k * (draft_per_pass + draft_per_request * requests in the batch)
                                                       (EAGLE: k sequential draft passes)

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

FEATURES = (
    "base",
    "per_prefill_token",
    "per_decode_token",
    "per_verify_token",
    "per_context_token",
    "mixed_step",
    "draft_per_pass",
    "draft_per_request",
)


def step_features(out: SchedulerOutput, num_speculative_tokens: int = 0) -> tuple[float, ...]:
    """The feature row of one step, in the order of ``FEATURES``."""
    mixed = 1.0 if (out.num_prefill_tokens and out.num_decode_reqs) else 0.0
    k = float(num_speculative_tokens)
    return (
        1.0,
        float(out.num_prefill_tokens),
        float(out.num_decode_tokens),
        float(out.num_verify_tokens),
        float(out.num_context_tokens),
        mixed,
        k,
        k * len(out.reqs),
    )


@dataclass
class StepTimeModel:
    """Linear step-time model; coefficients in seconds per unit of each feature."""

    base: float = 0.004
    per_prefill_token: float = 1.0e-5
    per_decode_token: float = 5.0e-5
    per_verify_token: float = 5.0e-5
    per_context_token: float = 0.0
    mixed_step: float = 0.0
    draft_per_pass: float = 0.0
    draft_per_request: float = 0.0
    host_overhead: float = 0.0
    async_scheduling: bool = False
    # Drafts per step (k) when speculative decoding is on; 0 disables the draft term.
    num_speculative_tokens: int = 0

    @classmethod
    def from_config(
        cls, config: StepTimeConfig, async_scheduling: bool = False, num_speculative_tokens: int = 0
    ) -> "StepTimeModel":
        values = config.model_dump()
        values.pop("noise", None)  # per-step factors: simcap.engine.noise, not the mean model
        if values["per_verify_token"] is None:
            values["per_verify_token"] = values["per_decode_token"]
        return cls(
            **values, async_scheduling=async_scheduling, num_speculative_tokens=num_speculative_tokens
        )

    @property
    def coef_(self) -> np.ndarray:
        return np.array([getattr(self, name) for name in FEATURES])

    def forward_time(self, out: SchedulerOutput) -> float:
        """Seconds of the forward pass (and sampling) for the batch ``out``."""
        t = self.base + self.per_prefill_token * out.num_prefill_tokens
        t += self.per_decode_token * out.num_decode_tokens
        if out.num_verify_tokens:
            t += self.per_verify_token * out.num_verify_tokens
        if self.per_context_token:
            t += self.per_context_token * out.num_context_tokens
        if self.mixed_step and out.num_prefill_tokens and out.num_decode_reqs:
            t += self.mixed_step
        k = self.num_speculative_tokens
        if k:
            t += k * (self.draft_per_pass + self.draft_per_request * len(out.reqs))
        return t

    def step_period(self, out: SchedulerOutput) -> float:
        """Seconds from one step's start to the next's, host work included.

        A step that only preempted (a request could not grow and gave up its own blocks)
        runs no forward pass.
        """
        forward = self.forward_time(out) if out.total_num_scheduled_tokens else 0.0
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
