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
MIN_ONSET_REQUESTS = 3  # requests that ran alone and drafted, needed for an onset
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


def one_request_segments(rows: Sequence[Mapping[str, float]]) -> list[tuple[list[Mapping[str, float]], bool]]:
    """The decode steps of requests that ran alone: after a step that only prefills one
    request, the following steps that decode exactly one request and prefill none. Each
    segment comes with whether it ran to the request's end (the next step prefills another
    request alone, or the log ends) rather than being cut by another request joining."""
    out: list[tuple[list[Mapping[str, float]], bool]] = []
    current: list[Mapping[str, float]] | None = None
    for row in rows:
        alone_prefill = row["num_prefill_reqs"] == 1 and row["num_decode_reqs"] == 0
        if current is not None:
            if not row["num_prefill_reqs"] and row["num_decode_reqs"] == 1:
                current.append(row)
                continue
            out.append((current, alone_prefill))
            current = None
        if alone_prefill:
            current = []
    if current is not None:
        out.append((current, True))
    return [(seg, whole) for seg, whole in out if seg]


def fit_proposal_onset(rows: Sequence[Mapping[str, float]]) -> dict[str, Any]:
    """Output tokens a request has before its prompt lookup first matches (the median over
    requests that ran alone): a request's prefill step gives it 1 token and each decode
    step without drafts 1 more, so drafts first verified in its j-th decode step were
    proposed when it had j tokens. Requests that never drafted are counted, not used."""
    onsets, undrafted = [], []
    for seg, whole in one_request_segments(rows):
        j = next((i + 1 for i, r in enumerate(seg) if r["num_verify_tokens"] > 0), None)
        if j is not None:
            onsets.append(j)
        elif whole:
            undrafted.append(len(seg))
    out: dict[str, Any] = {"requests": len(onsets), "never_drafted": 0, "onset_tokens": 0}
    if len(onsets) >= MIN_ONSET_REQUESTS:
        onsets.sort()
        m = out["onset_tokens"] = int(onsets[(len(onsets) - 1) // 2])
        out["quartiles"] = [onsets[len(onsets) // 4], onsets[(3 * len(onsets)) // 4]]
        # Requests that ended before the onset tell nothing; those that ran past it undrafted never matched.
        out["never_drafted"] = sum(1 for n in undrafted if n >= m)
    else:
        out["note"] = f"{len(onsets)} requests ran alone and drafted (need {MIN_ONSET_REQUESTS}): no onset"
    return out


def rows_after_onset(rows: Sequence[Mapping[str, float]], onset: int) -> list[Mapping[str, float]]:
    """The one-request segments' steps whose drafts were proposed at ``onset`` tokens or
    later, the segments kept apart (a prefill row between them) for
    :func:`fit_proposal_concentration`."""
    out: list[Mapping[str, float]] = []
    gap = {"num_prefill_reqs": 1, "num_decode_reqs": 0, "num_verify_tokens": 0}
    for seg, _ in one_request_segments(rows):
        out += seg[max(onset - 1, 0):]
        out.append(gap)
    return out


def onset_from_records(records: Sequence[Any]) -> dict[str, Any]:
    """The onset from the client's records when few requests ran alone in the log: a request's
    first stream chunk of more than one token is the first step whose drafts verified, so its
    drafts were proposed when it had the tokens of the chunks before (the median over
    requests). A draft rejected whole hides its step (the estimate runs late), a client that
    reads two steps as one chunk shows one early."""
    onsets = []
    for rec in records:
        tokens = rec.chunk_tokens if rec.succeeded else []
        j = next((i for i, n in enumerate(tokens) if i and n > 1), None)
        if j is not None:
            onsets.append(sum(tokens[:j]))
    out: dict[str, Any] = {"requests": len(onsets), "never_drafted": 0, "onset_tokens": 0,
                           "source": "client stream chunks"}
    if len(onsets) >= MIN_ONSET_REQUESTS:
        onsets.sort()
        out["onset_tokens"] = int(onsets[(len(onsets) - 1) // 2])
        out["quartiles"] = [onsets[len(onsets) // 4], onsets[(3 * len(onsets)) // 4]]
    return out
