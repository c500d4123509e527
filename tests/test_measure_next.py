"""What to measure next (simcap.calibrate.measure_next): Laplace intervals of predictions and
the candidate point that narrows them most, on tables simcap measured on itself."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from simcap.calibrate import read_benchmarks
from simcap.calibrate.core import CalibrationError
from simcap.calibrate.measure_next import Query, at_concurrency, measure_next, point_at
from simcap.cli.main import app
from tests.test_calibrate_roofline import ENGINE, start, synthetic_table


@pytest.fixture(scope="module")
def low_rows(tmp_path_factory):
    """Closed loops of 1 and 4 clients: the experts' read is pinned, compute is not (the steps
    are memory-bound at these batches); prompts of 256 tokens, 32 out."""
    path = synthetic_table(tmp_path_factory.mktemp("t") / "t.json", concurrencies=(1, 4))
    return read_benchmarks(path, "runs", engine=ENGINE, speculative=None, label="syn")


def test_labels_name_rows_or_a_concurrency(low_rows):
    labels = [p.label for p in low_rows]
    assert point_at(low_rows, labels[0]) is low_rows[0]
    moved = point_at(low_rows, "syn c=64")
    assert moved.label == "syn c=64" and moved.measured == {}
    assert moved.scenario["workload"]["arrival"]["concurrency"] == 64
    assert moved.scenario["workload"]["num_requests"] == 512
    assert moved.scenario["engine"] == low_rows[0].scenario["engine"]
    with pytest.raises(CalibrationError, match="no row of arm 'x'"):
        point_at(low_rows, "x c=8")
    with pytest.raises(CalibrationError, match="a row label, ARM c=N"):
        point_at(low_rows, "syn c=zero")
    with pytest.raises(CalibrationError, match="a whole number >= 1"):
        at_concurrency(low_rows[0], 0)
    with pytest.raises(CalibrationError, match="not an open loop at a rate"):
        point_at(low_rows, "syn rate=2")


def test_an_open_loop_row_moves_to_another_rate_over_the_same_time():
    from simcap.calibrate.readers import BenchmarkPoint

    knee = BenchmarkPoint("knee rate=6", {"engine": ENGINE, "workload": {
        "arrival": {"process": "gamma", "rate": 6.0, "burstiness": 0.5}, "num_requests": 600,
        "input_len": 512, "output_len": 256}}, {"tpot_p95": 0.05}, {"file": "t"})
    moved = point_at([knee], "knee rate=2.5")
    assert moved.label == "knee rate=2.5" and moved.measured == {}
    assert moved.scenario["workload"]["arrival"] == {"process": "gamma", "rate": 2.5, "burstiness": 0.5}
    assert moved.scenario["workload"]["num_requests"] == 250
    with pytest.raises(CalibrationError, match="not a closed loop"):
        point_at([knee], "knee c=4")
    with pytest.raises(CalibrationError, match="ARM rate=R"):
        point_at([knee], "knee rate=-1")


def test_a_high_point_narrows_a_high_prediction_most(low_rows):
    """Fitted at 1 and 4 clients, compute is held by its prior; at 64 clients the steps are
    compute-bound, so the prediction there is wide, and measuring 64 (or 32) narrows it more
    than measuring 8. Every target's interval holds its own prediction."""
    targets = [Query(point_at(low_rows, "syn c=64"), ("output_throughput",)),
               Query(point_at(low_rows, "syn c=16"), ("output_throughput",))]
    candidates = [Query(point_at(low_rows, f"syn c={c}"), ("output_throughput", "e2e_mean")) for c in (8, 32)]
    rep = measure_next(low_rows, start(), "base,experts,compute", prior={"sigma": 0.7},
                       targets=targets, candidates=candidates)
    by = {t["point"]: t for t in rep["targets"]}
    for t in rep["targets"]:
        lo, hi = t["interval"]
        assert lo < t["value"] < hi and t["log_sd"] > 0
    assert by["syn c=64"]["log_sd"] > by["syn c=16"]["log_sd"]  # further out, wider
    c8, c32 = rep["candidates"]
    assert c32["shrink"]["syn c=64 output_throughput"] < c8["shrink"]["syn c=64 output_throughput"] < 1.0
    assert rep["advice"]["measure"] == "syn c=32"
    assert rep["advice"]["widest_target"] == "syn c=64 output_throughput"
    # The same call gives the same figures (deterministic simulation and fit).
    again = measure_next(low_rows, start(), "base,experts,compute", prior={"sigma": 0.7},
                         targets=targets, candidates=candidates)
    assert json.dumps(again, sort_keys=True) == json.dumps(rep, sort_keys=True)
    # Without candidates: the same intervals, and no advice.
    alone = measure_next(low_rows, start(), "base,experts,compute", prior={"sigma": 0.7},
                         targets=targets, candidates=())
    assert alone["targets"] == rep["targets"] and alone["advice"] is None and alone["candidates"] == []


def test_cli_prints_the_advice(tmp_path):
    from pathlib import Path

    recipe = Path(__file__).resolve().parents[1] / "calibration" / "recipes" / "a800-minimax-m3.roofline.yaml"
    res = CliRunner().invoke(app, ["measure-next", str(recipe), "--target", "eagle3 c=64",
                                   "--candidate", "eagle3 c=8", "--candidate", "eagle3 c=32", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["advice"]["measure"] == "eagle3 c=32"
    (t,) = data["targets"]
    assert t["point"] == "eagle3 c=64" and t["interval"][0] < t["value"] < t["interval"][1]


def test_the_model_form_interval_narrows_once_a_higher_load_is_fitted(low_rows):
    """With a model-form error (simcap.accuracy.model_form), each target's interval grows with
    its doublings past the fitted rows (4 clients here), and a candidate shrinks it by moving
    the fitted load up: measuring 32 clients puts a 16-client target inside the fitted range."""
    from simcap.accuracy.model_form import POOLED, FormError, Term

    form_error = FormError({POOLED: Term(0.1, 0.0, 1.0, 10), "throughput": Term(0.05, 0.2, 1.5, 20)})
    targets = [Query(point_at(low_rows, f"syn c={c}"), ("output_throughput",)) for c in (16, 64)]
    candidates = [Query(point_at(low_rows, f"syn c={c}"), ("output_throughput",)) for c in (8, 32)]
    rep = measure_next(low_rows, start(), "base,experts,compute", prior={"sigma": 0.7}, targets=targets,
                       candidates=candidates, form_error=form_error)
    t16, t64 = rep["targets"]
    w16 = t16["model_form_interval"][1] / t16["model_form_interval"][0]
    w64 = t64["model_form_interval"][1] / t64["model_form_interval"][0]
    assert 1.0 < w16 < w64  # 64 clients lie further past the 4 fitted than 16 do
    # about 2 doublings past: half-width 1.5 sqrt(0.05^2 + (0.2 x 2)^2); the batch is the clients
    assert math.log(w16) / 2 == pytest.approx(1.5 * math.hypot(0.05, 0.2 * 2), rel=0.05)
    c8, c32 = rep["candidates"]
    assert c32["model_form_shrink"]["syn c=16 output_throughput"] < c8["model_form_shrink"]["syn c=16 output_throughput"] < 1
    # measured at 32 clients, a 16-client prediction is inside the fitted range: s0 alone
    inside = (math.exp(1.5 * 0.05) - math.exp(-1.5 * 0.05)) / (w16 ** 0.5 - w16 ** -0.5)
    assert c32["model_form_shrink"]["syn c=16 output_throughput"] == pytest.approx(inside, rel=1e-6)
    assert rep["advice"]["model_form"]["measure"] == "syn c=32"
    # without a model-form error nothing of it appears
    plain = measure_next(low_rows, start(), "base,experts,compute", prior={"sigma": 0.7}, targets=targets,
                         candidates=candidates)
    assert "model_form_interval" not in plain["targets"][0] and "model_form" not in plain["advice"]
