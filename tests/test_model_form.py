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


def _arm(tps: float, rps: float, latency: float):
    from types import SimpleNamespace

    return SimpleNamespace(output_tokens_per_s=tps, requests_per_s=rps, latency_mean_s=latency)


def test_the_crossover_band_adds_both_arms_errors_at_their_distances():
    from types import SimpleNamespace

    model = mf.FormError({mf.POOLED: mf.Term(0.1, 0.0, 1.0, 10), "throughput": mf.Term(0.1, 0.2, 1.0, 20)})
    # 4 clients: both arms inside their fitted loads (4 and 16): h = hypot(0.1, 0.1).
    # 16 clients: speculation 2 doublings past its 4 (sigma sqrt(0.01 + 0.16)), baseline at 16.
    points = [SimpleNamespace(load=4, spec=_arm(120.0, 1.0, 4.0), baseline=_arm(100.0, 1.0, 4.0)),
              SimpleNamespace(load=16, spec=_arm(90.0, 2.0, 8.0), baseline=_arm(100.0, 2.0, 8.0))]
    band = mf.crossover_band(model, SimpleNamespace(points=points, axis="concurrency"), 4.0, 16.0)
    h4, h16 = math.hypot(0.1, 0.1), math.hypot(math.sqrt(0.01 + 0.16), 0.1)
    lo4, hi4, lo16, hi16 = (r * math.exp(s * h) * 100 - 100 for r, s, h in
                            ((1.2, -1, h4), (1.2, 1, h4), (0.9, -1, h16), (0.9, 1, h16)))
    rows = band["points"]
    assert rows[0]["low_pct"] == pytest.approx(lo4) and rows[0]["high_pct"] == pytest.approx(hi4)
    assert rows[1]["low_pct"] == pytest.approx(lo16) and rows[1]["high_pct"] == pytest.approx(hi16)
    assert rows[0]["gain_pct"] == pytest.approx(20.0) and rows[1]["gain_pct"] == pytest.approx(-10.0)
    assert lo4 > 0 and lo16 < 0 < hi16  # decided at 4, undecided at 16
    assert band["undecided"] == [16]
    assert band["crossover_low"]["between"] == [4, 16] and band["crossover_high"]["value"] is None


def test_capacity_slos_move_each_limit_by_its_family():
    model = mf.FormError({mf.POOLED: mf.Term(0.2, 0.0, 1.0, 10), "ttft tail": mf.Term(0.5, 0.0, 2.0, 20)})
    strict, loose = mf.capacity_slos(model, {"ttft_p95": 2.0, "tpot_p95": 0.05}, load=10.0, fit_load=20.0)
    assert strict["ttft_p95"] == pytest.approx(2.0 * math.exp(-1.0))
    assert loose["ttft_p95"] == pytest.approx(2.0 * math.exp(1.0))
    assert strict["tpot_p95"] == pytest.approx(0.05 * math.exp(-0.2))  # no tail term: the pooled one
    with pytest.raises(ValueError, match="no model-form family"):
        mf.capacity_slos(model, {"prefix_hit_rate": 0.5}, None, None)


def test_a_record_refits_without_the_cases_it_is_checked_against(tmp_path):
    rng = np.random.default_rng(3)
    data = [mf.Sample(f"c{i % 3}", "e2e", float(e), 0.0, "live") for i, e in enumerate(rng.normal(0, 0.1, 60))]
    data += [mf.Sample("far", "e2e", 2.0, 0.0, "table")] * 10  # a case of huge errors
    record = {**mf.fit(data).to_dict(), "samples": [s.to_row() for s in data]}
    path = tmp_path / "model_form.json"
    path.write_text(__import__("json").dumps(record))
    assert mf.FormError.read(path).term("e2e").s0 > 0.5
    without = mf.FormError.read(path, leave_out=["far"])
    assert without.term("e2e").s0 < 0.15 and "far" not in without.cases


def _cli(*args):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    return subprocess.run([sys.executable, "-m", "simcap", *map(str, args)], cwd=root, capture_output=True,
                          text=True, timeout=600)


def test_crossover_and_capacity_print_the_model_form_interval():
    import json

    out = _cli("crossover", "experiments/a800-eagle3-crossover/scenario.yaml", "--concurrency", "1,4,32",
               "--model-form", "calibration/model_form.json", "--json")
    assert out.returncode == 0, out.stderr
    band = json.loads(out.stdout)["model_form"]
    assert [r["load"] for r in band["points"]] == [1, 4, 32]
    for r in band["points"]:
        assert r["low_pct"] < r["gain_pct"] < r["high_pct"]
    # the profile's rows reached 3.9 requests with EAGLE3: 32 clients lie 3 doublings past them
    assert band["points"][2]["half_width"] > 2 * band["points"][0]["half_width"]
    text = _cli("crossover", "experiments/a800-eagle3-crossover/scenario.yaml", "--concurrency", "1,4,32",
                "--model-form", "calibration/model_form.json")
    assert "model-form 90% interval of the throughput gain: 1:" in " ".join(text.stdout.split())
    cap = _cli("capacity", "experiments/ascend910b4-capacity/scenario.yaml", "--duration", "60",
               "--interval-sets", "0", "--model-form", "calibration/model_form.json", "--json")
    assert cap.returncode == 0, cap.stderr
    data = json.loads(cap.stdout)
    lo, hi = data["model_form"]["safe_rate_interval"]
    assert lo < data["safe_rate"] < hi
    mu_lo, mu_hi = data["model_form"]["saturation_rate_interval"]
    assert mu_lo < data["saturation_rate"] < mu_hi


@pytest.mark.parametrize("args, says", [
    (["crossover", "experiments/a800-eagle3-crossover/scenario.yaml", "--model-form", "nope.json"],
     "--model-form nope.json: cannot read"),
    (["capacity", "examples/chat.yaml", "--model-form", "calibration/accuracy.json"],
     "not a model-form error record"),
    (["capacity", "examples/chat.yaml", "--model-form", "calibration/model_form.json"],
     "the scenario names no profile"),
    (["capacity", "experiments/ascend910b4-capacity/scenario.yaml", "--replicas", "2", "--model-form",
      "calibration/model_form.json"], "--model-form: not with --replicas"),
    (["measure-next", "calibration/recipes/a800-minimax-m3.roofline.yaml", "--target", "eagle3 c=64",
      "--candidate", "eagle3 c=32", "--model-form", "calibration/accuracy.json"], "not a model-form error record"),
])
def test_model_form_refusals_are_one_line(args, says):
    out = _cli(*args)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], out.stderr


def test_a_table_fit_records_the_load_its_rows_reached():
    import yaml
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    loads = yaml.safe_load((root / "calibration" / "profiles" / "a800-minimax-m3.yaml").read_text())["provenance"]["fit_load"]
    # closed loops of 1-16 clients without speculation, 1-4 with EAGLE3: no queue, so the
    # requests running are the clients (EAGLE3 at 4: its ramp-up and drain count too)
    assert loads["plain"] == pytest.approx(16.0, rel=0.01) and loads["all"] == loads["plain"]
    assert 3.5 < loads["speculative"] <= 4.0


def test_simulate_prints_each_headline_with_its_model_form_interval():
    import json

    out = _cli("simulate", "experiments/a800-eagle3-crossover/scenario.yaml", "--set",
               "workload.arrival.concurrency=32", "--set", "workload.num_requests=256", "--model-form",
               "calibration/model_form.json", "--json")
    assert out.returncode == 0, out.stderr
    band = json.loads(out.stdout)["model_form"]
    # an EAGLE3 scenario is measured from the profile's EAGLE3 rows (3.9 requests running)
    assert band["fit_load"] == pytest.approx(3.888) and band["distance"] > 2.5
    for metric in ("ttft_p50", "tpot_p50", "e2e_p95", "output_throughput"):
        e = band["metrics"][metric]
        assert e["low"] < e["predicted"] < e["high"]
    plain = _cli("simulate", "experiments/a800-eagle3-crossover/scenario.yaml", "--set", "speculative=null",
                 "--set", "workload.arrival.concurrency=8", "--model-form", "calibration/model_form.json", "--json")
    assert plain.returncode == 0, plain.stderr
    assert json.loads(plain.stdout)["model_form"]["distance"] == 0.0  # inside the 16 of the no-spec rows
