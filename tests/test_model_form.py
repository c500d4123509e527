"""The model-form error (simcap.accuracy.model_form): families, distances, the fit against
hand-computed cases and planted laws, leave-one-case-out coverage."""

from __future__ import annotations

import math

import numpy as np
import pytest

from simcap.accuracy import model_form as mf


@pytest.mark.parametrize("metric, family", [
    ("output_throughput", "throughput"), ("input_throughput", "throughput"), ("ttft_p50", "ttft"),
    ("ttft_mean", "ttft"), ("ttft_p95", "ttft tail"), ("later_turns_ttft_p50", "ttft"), ("tpot_p50", "token"),
    ("itl_p99", "token tail"), ("e2e_mean", "e2e"), ("e2e_p95", "e2e tail"), ("prefix_hit_rate", None),
    ("preemptions", None),
])
def test_each_metric_has_its_family(metric, family):
    assert mf.family(metric) == family


def test_distance_counts_doublings_past_the_fit_part():
    assert mf.distance(16.0, 4.0) == pytest.approx(2.0)
    assert mf.distance(3.0, 4.0) == 0.0  # inside the fitted range
    assert mf.distance(None, 4.0) == 0.0 and mf.distance(8.0, None) == 0.0


def _samples(errors, dists=None, case="c", fam="throughput"):
    dists = dists if dists is not None else [0.0] * len(errors)
    return [mf.Sample(case, fam, e, d) for e, d in zip(errors, dists)]


def test_without_distance_s0_is_the_rms_and_q_the_conformal_rank():
    errors = [0.1, -0.2, 0.3, -0.05, 0.15, 0.0, -0.25, 0.12, 0.08, -0.4, 0.02, 0.2, -0.1, 0.05, 0.3, -0.15,
              0.07, -0.09, 0.11, 0.01]  # n = 20
    t = mf.fit(_samples(errors)).term("throughput")
    rms = math.sqrt(np.mean(np.square(errors)))
    assert t.s0 == pytest.approx(rms, rel=1e-4)
    assert t.a == 0.0
    # ceil(21 * 0.9) = 19: the 19th smallest |e| / s0 (of 20), here 0.3 / rms
    assert t.q == pytest.approx(sorted(abs(e) for e in errors)[18] / t.s0, rel=1e-6)
    assert t.figures == 20


def test_a_planted_law_is_recovered():
    rng = np.random.default_rng(7)
    d = rng.uniform(0, 3, 4000)
    e = rng.normal(0, np.sqrt(0.05**2 + (0.2 * d) ** 2))
    t = mf.fit([mf.Sample("c", "token", float(a), float(b)) for a, b in zip(e, d)]).term("token")
    assert t.s0 == pytest.approx(0.05, rel=0.15)
    assert t.a == pytest.approx(0.2, rel=0.05)
    assert t.q == pytest.approx(1.645, rel=0.05)  # normal errors: the conformal quantile is the normal one


def test_leave_one_case_out_covers_at_its_level_on_a_planted_law():
    rng = np.random.default_rng(11)
    data = []
    for case in range(12):
        d = rng.uniform(0, 2, 40)
        e = rng.normal(0, np.sqrt(0.1**2 + (0.15 * d) ** 2))
        data += [mf.Sample(f"case{case}", "e2e", float(a), float(b), "live") for a, b in zip(e, d)]
    cov = mf.coverage(data)
    assert 0.85 <= cov["all"]["share"] <= 0.95
    assert cov["all"]["figures"] == 480 and set(cov["case"]) == {f"case{i}" for i in range(12)}
    assert cov["kind"]["live"]["figures"] == 480


def test_a_family_with_few_figures_takes_the_pooled_term():
    data = _samples([0.1, -0.1] * 5, fam="e2e") + _samples([0.5, -0.5, 0.4], fam="ttft")
    model = mf.fit(data)
    assert "ttft" not in model.terms and model.term("ttft") is model.terms[mf.POOLED]
    assert "e2e" in model.terms


def test_the_interval_is_the_prediction_times_exp_of_the_half_width():
    model = mf.FormError({mf.POOLED: mf.Term(0.1, 0.2, 2.0, 10), "throughput": mf.Term(0.05, 0.1, 1.5, 20)})
    lo, hi = model.interval(100.0, "output_throughput", load=32.0, fit_load=8.0)  # d = 2
    h = 1.5 * math.sqrt(0.05**2 + 0.2**2)
    assert (lo, hi) == (pytest.approx(100 * math.exp(-h)), pytest.approx(100 * math.exp(h)))
    assert model.interval(1.0, "prefix_hit_rate") is None
    back = mf.FormError.from_dict(model.to_dict())
    assert back.term("throughput") == model.term("throughput") and back.level == 0.9


def test_too_few_figures_and_a_foreign_record_are_refused():
    with pytest.raises(ValueError, match="at least 8 figures"):
        mf.fit(_samples([0.1, 0.2]))
    with pytest.raises(ValueError, match="not a model-form error record"):
        mf.FormError.from_dict({"format": "something else"})


def test_a_figure_without_error_or_family_is_no_sample():
    fig = {"case": "c", "metric": "ttft_p50", "error": 0.25, "load": 8.0, "fit_load": 2.0}
    s = mf.Sample.of(fig, "live")
    assert s == mf.Sample("c", "ttft", math.log(1.25), 2.0, "live")
    assert mf.Sample.of({**fig, "error": None}) is None
    assert mf.Sample.of({**fig, "metric": "prefix_hit_rate"}) is None
