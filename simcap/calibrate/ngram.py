"""ngram proposals from vLLM's per-step log: how much requests differ in matching.

vLLM's counters give the rate of request-steps with drafts (``spec_decode_num_drafts`` over
decode request-steps), the same whether every request matches at that rate or some requests
match in almost every step and others almost never. The per-step log tells them apart: a
step's ``generation tokens`` minus its ``generation requests`` are the drafts it verifies,
i.e. the requests that drafted after the step before (drafts / mean draft length). Over two
consecutive pure-decode steps of the same batch, the excess drafting counts
``x_t = drafting_t - rate * n`` share each request's own match probability ``p_r``:
``E[x_t x_{t+1}] = sum_r Var(p_r)``, zero when every request matches at the same rate. The
variance over request-steps ``sum(x_t x_{t+1}) / sum(n)`` then gives the concentration of
the Beta over requests (:class:`simcap.engine.speculative.Proposer`) with that variance and
the measured rate (bisection on a log scale; the variance falls as the concentration rises).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from simcap.engine.speculative import request_mean_for_step_rate, step_moments

MIN_PAIRS = 20  # consecutive pure-decode step pairs needed for an estimate
CONCENTRATION_RANGE = (1e-2, 1e3)  # fits outside are clipped to the range


def fit_proposal_concentration(
    rows: Sequence[Mapping[str, float]],
    rate: float,
    mean_draft_length: float,
    accepted_per_draft: float,
) -> dict[str, Any]:
    """The Beta concentration of ngram match probabilities over requests, from step rows.

    ``rows``: :func:`simcap.calibrate.readers.parse_iteration_log` rows with
    ``num_speculative_tokens`` set (``num_verify_tokens`` per step); ``rate``: drafts per
    decode request-step; ``mean_draft_length``: draft tokens per draft (k, or fewer where a
    lookup finds fewer tokens after its match); ``accepted_per_draft``: mean accepted tokens
    per draft. Returns ``concentration`` (None: the steps show no spread between requests,
    or too few pairs) with the figures it came from.
    """
    num = den = 0.0
    pairs = 0
    for a, b in zip(rows, rows[1:]):
        n = a["num_decode_reqs"]
        if n < 1 or a["num_prefill_reqs"] or b["num_prefill_reqs"] or b["num_decode_reqs"] != n:
            continue
        xa = a["num_verify_tokens"] / mean_draft_length - rate * n
        xb = b["num_verify_tokens"] / mean_draft_length - rate * n
        num += xa * xb
        den += n
        pairs += 1
    out: dict[str, Any] = {"method": "lag-1 covariance of drafting requests over consecutive pure-decode steps",
                           "pairs": pairs, "step_variance": None, "concentration": None}
    if pairs < MIN_PAIRS or not 0.0 < rate < 1.0:
        out["note"] = f"{pairs} step pairs (need {MIN_PAIRS}) at rate {rate:.3g}: every request at the rate"
        return out
    var = num / den
    out["step_variance"] = round(var, 6)
    if var <= 0.0:
        out["note"] = "no spread between requests: every request at the rate"
        return out

    def step_var(c: float) -> float:
        return step_moments(request_mean_for_step_rate(rate, c, accepted_per_draft), c, accepted_per_draft)[1]

    lo, hi = (math.log(x) for x in CONCENTRATION_RANGE)
    if var >= step_var(math.exp(lo)):
        conc = math.exp(lo)
    elif var <= step_var(math.exp(hi)):
        conc = math.exp(hi)
    else:
        for _ in range(40):
            mid = (lo + hi) / 2
            if step_var(math.exp(mid)) > var:
                lo = mid
            else:
                hi = mid
        conc = math.exp((lo + hi) / 2)
    out["concentration"] = float(f"{conc:.4g}")
    return out
