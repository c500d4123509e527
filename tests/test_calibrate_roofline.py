"""The simulation-based fit of the roofline form (simcap.calibrate.fit_bench)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from simcap import simulate
from simcap.calibrate import read_benchmarks
from simcap.calibrate.core import CalibrationError
from simcap.calibrate.fit_bench import RooflineForm, apply_coefficients, fit_benchmarks_roofline
from simcap.config.scenario import parse_scenario

ENGINE = dict(max_num_seqs=64, max_num_batched_tokens=1024, block_size=16, num_gpu_blocks=4000,
              max_model_len=1024, vllm_version="0.26")
PHYSICS = dict(form="roofline", hardware="h100-sxm", model="qwen3-30b-a3b", weight_dtype="bf16",
               tensor_parallel_size=1)
TRUE = {"base": 0.004, "efficiency.weights": 1.0, "efficiency.experts": 1.8,
        "efficiency.compute": 2.5}


def synthetic_table(path: Path, concurrencies=(1, 4, 16, 64), truth=TRUE) -> Path:
    """A closed-loop table measured on simcap itself with the TRUE roofline coefficients."""
    st = apply_coefficients(PHYSICS, truth)
    rows = []
    for c in concurrencies:
        sc = parse_scenario({"engine": ENGINE, "step_time": st, "seed": 0,
                             "workload": {"arrival": {"process": "closed", "concurrency": c},
                                          "num_requests": 2 * c, "input_len": 256,
                                          "output_len": 32}})
        s = simulate(sc).summary
        rows.append({"concurrency": c, "num_prompts": 2 * c, "input_len": 256, "output_len": 32,
                     "throughput": s.throughput["output_tokens_per_s"],
                     "latency_mean": s.e2e_s.mean})
    path.write_text(json.dumps({"runs": rows}))
    return path


def points(tmp_path):
    return read_benchmarks(synthetic_table(tmp_path / "t.json"), "runs", engine=ENGINE,
                           speculative=None, label="syn")


def start(**over):
    return {**PHYSICS, "base": 0.01, "efficiency": {"experts": 1.0, "compute": 1.0}, **over}


def test_roofline_fit_recovers_known_efficiencies(tmp_path):
    # A weak prior (sd 3 in log space): the data decide.
    fit = fit_benchmarks_roofline(
        points(tmp_path), start(), "base,experts,compute", prior={"sigma": 3.0},
        bootstrap=4, iterations=0)
    for term in ("base", "efficiency.experts", "efficiency.compute"):
        assert fit.coefficients[term] == pytest.approx(TRUE[term], rel=0.05), term
    assert fit.quality["max_rel_error"] < 0.01
    assert fit.step_time["efficiency"]["experts"] == pytest.approx(1.8, rel=0.05)
    assert fit.identification["efficiency.experts"]["pinned"]
    assert fit.identification["efficiency.compute"]["pinned"]
    assert len(fit.bootstrap) == 4 and set(fit.ci) == {"base", "efficiency.experts",
                                                       "efficiency.compute"}


def test_an_efficiency_the_data_want_below_one_is_held_at_the_floor(tmp_path):
    """Experts read at 0.6 of their datasheet time: held at 1 and named; floor 0 finds 0.6."""
    truth = {**TRUE, "efficiency.experts": 0.6}
    pts = read_benchmarks(synthetic_table(tmp_path / "t.json", truth=truth), "runs", engine=ENGINE,
                          speculative=None, label="syn")
    fit = fit_benchmarks_roofline(pts, start(), "base,experts,compute", prior={"sigma": 3.0},
                                  bootstrap=4, iterations=0)
    assert fit.coefficients["efficiency.experts"] == 1.0
    assert fit.identification["efficiency.experts"]["held_at_floor"] is True
    assert any(n.startswith("held at the physical floor (efficiency 1)") and "efficiency.experts" in n
               for n in fit.notes)
    assert "each at least 1" in fit.method
    free = fit_benchmarks_roofline(pts, start(), "base,experts,compute",
                                   prior={"sigma": 3.0, "efficiency_floor": 0.0}, bootstrap=4, iterations=0)
    assert free.coefficients["efficiency.experts"] == pytest.approx(0.6, rel=0.05)


def test_one_efficiency_refitted_from_the_floor_leaves_it(tmp_path):
    """A single efficiency started at the floor of 1 (log 0) is refitted where the data put it
    (1.8), as a transfer refits one term on one row; from 1.3 it reaches the same value."""
    pts = points(tmp_path)
    for begin in (1.0, 1.3):
        st = apply_coefficients(PHYSICS, {**TRUE, "efficiency.experts": begin})
        fit = fit_benchmarks_roofline(pts, st, "experts", bootstrap=0)
        assert fit.coefficients["efficiency.experts"] == pytest.approx(1.8, rel=0.02), begin
        assert not fit.identification["efficiency.experts"].get("held_at_floor")


@pytest.mark.parametrize("prior, message", [
    ({"sigma": 0.7, "floor": 1}, "prior: unknown key 'floor'; allowed: sigma, data_sigma, terms, efficiency_floor"),
    ({"efficiency_floor": 2}, "efficiency_floor: a number from 0 to 1"),
    ({"efficiency_floor": "yes"}, "prior.efficiency_floor: a number from 0 to 1"),
    ({"terms": {"experts": {"value": 0.5}}}, "prior.terms.efficiency.experts: value 0.5 is below efficiency_floor 1"),
])
def test_roofline_prior_section_is_checked(tmp_path, prior, message):
    with pytest.raises(CalibrationError, match=message.replace(".", r"\.").replace("(", r"\(")):
        fit_benchmarks_roofline(points(tmp_path), start(), "base,experts,compute", prior=prior,
                                bootstrap=0, iterations=0)


def test_unpinned_efficiency_stays_at_its_prior(tmp_path):
    # weights is a constant per step, like base (free, no prior): the data pin only their sum,
    # so the multiplier stays at its prior 1 and is reported as not pinned; experts is pinned.
    fit = fit_benchmarks_roofline(
        points(tmp_path), start(base=0.002, efficiency={"weights": 1.0, "experts": 1.0}),
        "base,weights,experts", prior={"sigma": 0.7}, bootstrap=10, iterations=0)
    ident = fit.identification
    assert fit.coefficients["efficiency.weights"] == pytest.approx(1.0, abs=0.1)
    assert not ident["efficiency.weights"]["pinned"]
    assert ident["efficiency.weights"]["data_share_of_information"] < 0.25
    assert ident["efficiency.experts"]["pinned"]
    assert fit.coefficients["efficiency.experts"] == pytest.approx(1.8, rel=0.1)
    # its bootstrap interval is about as wide as the prior's above the floor (1-3.2), not
    # narrowed; unbounded (floor 0), as wide as the whole prior (0.32-3.2)
    lo, hi = fit.ci["efficiency.weights"]
    assert lo == 1.0 and hi > 1.6
    unbounded = fit_benchmarks_roofline(
        points(tmp_path), start(base=0.002, efficiency={"weights": 1.0, "experts": 1.0}),
        "base,weights,experts", prior={"sigma": 0.7, "efficiency_floor": 0}, bootstrap=10,
        iterations=0)
    lo, hi = unbounded.ci["efficiency.weights"]
    assert lo < 0.6 and hi > 1.6


def test_roofline_form_names_and_ties():
    form = RooflineForm.parse("base, weights, efficiency.experts=efficiency.weights")
    assert form.free == ("base", "efficiency.weights")
    assert form.tied == {"efficiency.experts": "efficiency.weights"}
    with pytest.raises(CalibrationError):
        RooflineForm.parse("per_decode_token")
    with pytest.raises(CalibrationError):
        RooflineForm.parse("base,efficiency.experts=base")


def test_roofline_recipe_through_the_cli(tmp_path):
    from typer.testing import CliRunner

    from simcap.cli import app

    table = synthetic_table(tmp_path / "t.json", (1, 16))
    recipe = {"name": "syn", "engine": ENGINE, "step_time": start(),
              "form": ["base", "efficiency.experts"], "bootstrap": 2,
              "bootstrap_iterations": 0,
              "datasets": [{"file": table.name, "select": "runs", "label": "syn"}]}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = tmp_path / "p.yaml"
    res = CliRunner().invoke(app, ["calibrate", str(path), "--out", str(out)])
    assert res.exit_code == 0, res.output
    prof = yaml.safe_load(out.read_text())
    assert prof["step_time"]["form"] == "roofline"
    assert set(prof["provenance"]["identification"]) == {"base", "efficiency.experts"}
    assert all("efficiency.experts" in s for s in prof["bootstrap"])
    # the profile loads as a scenario and its bootstrap sets apply
    sc = parse_scenario({"profile": str(out), "workload": {"arrival": {"process": "closed",
                         "concurrency": 2}, "num_requests": 4, "input_len": 16, "output_len": 4}})
    assert sc.step_time.form == "roofline"


def test_more_starts_keep_the_fit_of_least_cost(tmp_path):
    """``starts``: the recipe's start, then draws around it; the fit of least cost is kept, so
    it is never worse than the one start's, and the notes give every start's cost. Started far
    off (base 10x, efficiencies at 1/5 and 5x), the data still decide."""
    pts = points(tmp_path)
    far = start(base=0.04, efficiency={"experts": 0.2, "compute": 5.0})
    one = fit_benchmarks_roofline(pts, far, "base,experts,compute", prior={"sigma": 3.0},
                                  bootstrap=2, iterations=0)
    many = fit_benchmarks_roofline(pts, far, "base,experts,compute", prior={"sigma": 3.0},
                                   bootstrap=2, iterations=0, starts=4)
    note = next(n for n in many.notes if n.startswith("4 starts"))
    costs = [float(c) for c in note.split("costs ")[1].split(";")[0].split(", ")]
    kept = int(note.rsplit("kept start ", 1)[1])
    assert len(costs) == 4 and costs[kept - 1] == min(costs)
    assert not any(n.startswith("1 starts") for n in one.notes)
    assert many.quality["rms_log_error"] <= one.quality["rms_log_error"] + 1e-9
    assert many.coefficients["efficiency.experts"] == pytest.approx(TRUE["efficiency.experts"], rel=0.1)


@pytest.mark.parametrize("value", [0, 65, 2.5, True, "many"])
def test_a_recipe_refuses_starts_that_are_not_a_count(tmp_path, value):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"name": "r", "starts": value}))
    from simcap.calibrate.recipe import Recipe

    with pytest.raises(CalibrationError, match=r"starts: a whole number from 1 to 64"):
        Recipe.load(path)


def test_a_kernel_class_centres_the_priors_of_its_hardware_only():
    from simcap.calibrate.fit_bench import _roofline_priors
    from simcap.catalog import kernel_class_names, resolve_kernel_class

    assert "hopper-vllm-mxfp4-moe" in kernel_class_names()
    kc = resolve_kernel_class("hopper-vllm-mxfp4-moe")
    form = RooflineForm.parse("base,efficiency.experts,efficiency.compute,efficiency.draft")
    st = {"hardware": "h200-sxm", "expert_weight_dtype": "mxfp4"}
    prior = {"kernel_class": "hopper-vllm-mxfp4-moe", "terms": {"efficiency.compute": {"value": 2.0}}}
    priors, _ = _roofline_priors(form, prior, st)
    assert priors["efficiency.experts"] == (kc.efficiency["experts"], kc.sigma)
    assert priors["efficiency.compute"] == (2.0, 0.7)  # the recipe's own term wins, at its sigma
    assert priors["efficiency.draft"] == (1.0, 0.7)  # a term the class does not name: the default
    assert "base" not in priors
    with pytest.raises(CalibrationError, match=r"prior.kernel_class: hopper-vllm-mxfp4-moe covers "
                                                r"h100-sxm, h200-sxm; step_time.hardware is 'mi300x'"):
        _roofline_priors(form, prior, {**st, "hardware": "mi300x"})
    with pytest.raises(CalibrationError, match="is for expert_weight_dtype mxfp4; step_time has None"):
        _roofline_priors(form, prior, {"hardware": "h100-sxm"})
    with pytest.raises(CalibrationError, match=r"prior.kernel_class: unknown kernel class 'x'; known: "):
        _roofline_priors(form, {"kernel_class": "x"}, st)
