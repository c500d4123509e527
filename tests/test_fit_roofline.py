"""The roofline form's fit from step samples (simcap.calibrate.fit_roofline)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from simcap.calibrate import CalibrationError, read_step_samples
from simcap.calibrate.fit_roofline import (
    ContextSource,
    coef_names,
    decode_context_of_lengths,
    decode_context_of_means,
    fit_roofline_samples,
    roofline_config,
    step_inputs,
)
from simcap.calibrate.readers import _rows_to_samples
from simcap.engine.step_time import RooflineStepTimeModel, roofline_basis, roofline_forward

HW = "cpu-amd-epyc-zen4-2vcpu"
MOE = "tiny-qwen3-moe-cpu"
DENSE = "tiny-llama-cpu"
CTX = 150.0  # mean attended context of a decoding request in the synthetic data


def _truth(model: str, **eff):
    cfg = roofline_config(HW, model)
    coef = np.array([0.004, 0.0, 0.0, *(eff.get(t, 1.0) for t in
                                         ("weights", "experts", "compute", "attention_prefill",
                                          "kv_read", "tp_comm", "tp_latency", "draft"))])
    return cfg.physics, coef


def _log(model: str, coef_eff: dict, *, sigma: float = 0.02, seed: int = 0, prefill: bool = True,
         batches=(1, 2, 4, 8, 16, 32), combine: str = "sum") -> list[str]:
    """Iteration-log lines of decode steps at ``batches`` (and prefill steps) whose times follow
    the roofline form with the given efficiencies, times lognormal noise."""
    phys, coef = _truth(model, **coef_eff)
    rng = np.random.default_rng(seed)
    rows = []
    for b in batches:
        rows += [(0, 0, b, b)] * 40
    if prefill:
        for a, tok in ((1, 64), (1, 128), (2, 200), (3, 360), (4, 480)):
            rows += [(a, tok, 0, 0)] * 6
            rows += [(a, tok, 4, 4)] * 4
    r = np.array(rows, dtype=float)
    a, p, c, d = r.T
    m = np.divide(p, a, out=np.zeros(len(p)), where=a > 0)
    X = roofline_basis(phys, prefill=p, decode=d, verify=np.zeros(len(p)), reqs=a + c,
                       mixed=((p > 0) & (c > 0)).astype(float), context=c * CTX + p,
                       pairs=a * m * (m + 1) / 2)
    y = roofline_forward(X, coef, combine) * np.exp(rng.normal(0, sigma, len(p)))
    return [f"Iteration({i}): {int(ai)} context requests, {int(pi)} context tokens, {int(ci)} generation "
            f"requests, {int(di)} generation tokens, iteration elapsed time: {t * 1e3:.4f} ms"
            for i, (ai, pi, ci, di, t) in enumerate(zip(a, p, c, d, y))]


def _samples(tmp_path, lines, name="steps.log"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return read_step_samples(path)


def test_basis_priced_equals_the_models_folded_forward_time():
    """The fit's basis (one implementation) times the coefficients equals the engine's folded
    per-step arithmetic (another), for the sum and max forms and efficiencies away from 1."""
    cfg = roofline_config(HW, MOE)
    eff = {"weights": 1.3, "experts": 2.1, "compute": 1.7, "attention_prefill": 0.8, "kv_read": 1.1}
    models = [RooflineStepTimeModel(cfg.physics, base=0.002, per_request=1e-4, mixed_step=0.003,
                                    efficiency=eff, combine=c) for c in ("sum", "max")]
    outs = [
        SimpleNamespace(num_prefill_tokens=0, num_decode_tokens=8, num_verify_tokens=0, reqs=[0] * 8,
                        num_decode_reqs=8, num_prefill_pairs=0, num_context_tokens=1200),
        SimpleNamespace(num_prefill_tokens=100, num_decode_tokens=3, num_verify_tokens=0, reqs=[0] * 4,
                        num_decode_reqs=3, num_prefill_pairs=5050, num_context_tokens=550),
    ]
    X = roofline_basis(cfg.physics, prefill=[0, 100], decode=[8, 3], verify=[0, 0], reqs=[8, 4],
                       mixed=[0, 1], context=[1200, 550], pairs=[0, 5050])
    for model in models:
        for row, out in zip(X, outs):
            priced = roofline_forward(row[None], model.coef_, model.combine)[0]
            assert priced == pytest.approx(model.forward_time(out), rel=1e-12)


def test_decode_context_by_hand():
    # prompt 10, 4 outputs: decode steps attend 11, 12, 13; prompt 20, 2 outputs: 21.
    assert decode_context_of_lengths([10], [4]) == pytest.approx(12.0)
    assert decode_context_of_lengths([10, 20], [4, 2]) == pytest.approx((11 + 12 + 13 + 21) / 4)
    assert decode_context_of_means(10, 4) == 12.0
    with pytest.raises(CalibrationError, match="no request decoded"):
        decode_context_of_lengths([10], [1])


def test_step_inputs_derive_context_and_pairs():
    rows = [
        {"num_prefill_reqs": 0, "num_prefill_tokens": 0, "num_decode_reqs": 3, "num_decode_tokens": 3,
         "num_reqs": 3, "step_time_s": 0.01},
        {"num_prefill_reqs": 2, "num_prefill_tokens": 10, "num_decode_reqs": 1, "num_decode_tokens": 1,
         "num_reqs": 3, "step_time_s": 0.02},
    ]
    s = _rows_to_samples(rows, "t", {"file": "t"})
    counts, notes = step_inputs(s, ContextSource(100.0, "by hand"))
    assert counts["context"].tolist() == [300.0, 110.0]  # 3 x 100; 1 x 100 + 10 prefill tokens
    assert counts["pairs"].tolist() == [0.0, 30.0]  # 2 requests of 5 tokens: 2 x 5 x 6 / 2
    assert counts["reqs"].tolist() == [3.0, 3.0] and counts["mixed"].tolist() == [0.0, 1.0]
    assert any("by hand" in n for n in notes)
    with pytest.raises(CalibrationError, match="attended context"):
        step_inputs(s, None)
    # A context column wins over the derivation.
    s2 = _rows_to_samples([{**r, "num_context_tokens": 7} for r in rows], "t", {"file": "t"})
    assert step_inputs(s2, ContextSource(100.0, "x"))[0]["context"].tolist() == [7.0, 7.0]


def test_synthetic_efficiencies_are_recovered(tmp_path):
    true = {"experts": 2.0, "compute": 3.0}
    s = _samples(tmp_path, _log(MOE, true))
    fit = fit_roofline_samples([s], HW, MOE, context=ContextSource(CTX, "synthetic"), bootstrap=30)
    c = fit.coefficients
    assert c["efficiency.experts"] == pytest.approx(2.0, rel=0.03)
    assert c["efficiency.compute"] == pytest.approx(3.0, rel=0.03)
    assert c["base"] == pytest.approx(0.004, rel=0.05)
    terms = fit.extra["roofline"]["terms"]
    assert terms["efficiency.experts"]["pinned"] and terms["efficiency.compute"]["pinned"]
    # The dense weights' read is a constant beside base: the data cannot pin it; it stays at 1.
    assert terms["efficiency.weights"]["pinned"] is False
    assert terms["efficiency.weights"]["prior_share"] == pytest.approx(1.0, abs=1e-3)
    assert c["efficiency.weights"] == pytest.approx(1.0, abs=1e-6)
    # Zero columns (tp 1, no draft): not in the data, exactly at the prior.
    for t in ("tp_comm", "tp_latency", "draft"):
        assert terms[f"efficiency.{t}"]["in_data"] is False and c[f"efficiency.{t}"] == 1.0
    lo, hi = fit.ci["efficiency.experts"]
    assert lo <= c["efficiency.experts"] <= hi and hi - lo < 0.2
    st = fit.step_time
    assert st["form"] == "roofline" and st["efficiency"]["experts"] == pytest.approx(2.0, rel=0.03)
    # The noise is fitted from measured / roofline prediction: centred on 1 with the data's spread.
    dec = fit.noise_report["kinds"]["decode"]
    assert dec["samples"] == 240 and dec["p50"] == pytest.approx(1.0, abs=0.02)


@pytest.mark.parametrize("combine", ["sum", "max"])
def test_an_efficiency_the_data_want_below_one_is_held_at_the_floor_and_named(tmp_path, combine):
    """Data whose experts run at 0.6 of their hardware figures' time: a fit bounded at 1 (the
    default on datasheet hardware) holds the term there and names it (the data want it faster
    than the hardware allows), pinned terms beside it still recovered; unbounded (the default
    on HW, whose rates were measured) the same data give 0.6 back, named as below the floor."""
    true = {"experts": 0.6, "compute": 3.0}
    s = _samples(tmp_path, _log(MOE, true, combine=combine))
    ctx = ContextSource(CTX, "synthetic")
    fit = fit_roofline_samples([s], HW, MOE, combine=combine, context=ctx, bootstrap=20, noise=None,
                               efficiency_floor=1.0)
    c = fit.coefficients
    assert c["efficiency.experts"] == 1.0
    assert all(c[f"efficiency.{t}"] >= 1.0 for t in ("weights", "compute", "attention_prefill", "kv_read"))
    assert fit.ci["efficiency.experts"][0] == 1.0
    # (a term that grows with the batch beside it may want less too, to make up for it)
    held = fit.extra["roofline"]["held_at_floor"]
    assert "efficiency.experts" in held and "efficiency.compute" not in held
    (note,) = [n for n in fit.notes if "physical floor" in n]
    assert note.startswith("held at the physical floor (efficiency 1) against the data")
    assert note.split(": ", 1)[1].split(";")[0] == ", ".join(held)
    free = fit_roofline_samples([s], HW, MOE, combine=combine, context=ctx, bootstrap=0, noise=None)
    assert free.extra["roofline"]["efficiency_floor"] == 0.0
    # (the prior toward 1 pulls a little; the max form, fitted by a local search, more)
    assert free.coefficients["efficiency.experts"] == pytest.approx(0.6, rel=0.02 if combine == "sum" else 0.1)
    assert free.coefficients["efficiency.compute"] == pytest.approx(3.0, rel=0.05)
    assert free.extra["roofline"]["held_at_floor"] == []
    assert any(n.startswith("below the physical floor") and "efficiency.experts 0.6" in n for n in free.notes)
    with pytest.raises(CalibrationError, match="efficiency_floor: a number from 0 to 1"):
        fit_roofline_samples([s], HW, MOE, context=ctx, efficiency_floor=1.5)


def test_the_floor_follows_the_hardwares_figures():
    """Datasheet peaks bound the efficiencies at 1; rates a microbenchmark measured do not (real
    kernels may beat them); a given floor wins over either."""
    from simcap.calibrate.fit_roofline import check_floor

    peak, measured = (roofline_config(h, DENSE).physics.hardware for h in ("a800-80gb", HW))
    assert (peak.rates, measured.rates) == ("peak", "measured")
    assert check_floor(None, peak) == 1.0 and check_floor(None, measured) == 0.0
    assert check_floor(0.5, peak) == 0.5 and check_floor(1, measured) == 1.0


def test_max_form_recovers_its_own_data(tmp_path):
    true = {"experts": 2.0, "compute": 3.0}
    s = _samples(tmp_path, _log(MOE, true, combine="max"))
    fit = fit_roofline_samples([s], HW, MOE, combine="max", context=ContextSource(CTX, "synthetic"),
                               bootstrap=0, noise=None)
    assert fit.coefficients["efficiency.experts"] == pytest.approx(2.0, rel=0.05)
    assert fit.coefficients["efficiency.compute"] == pytest.approx(3.0, rel=0.05)
    assert fit.step_time["combine"] == "max"


def test_unpinned_term_stays_near_its_prior(tmp_path):
    # kv_read's seconds are tiny beside 10 % noise: whatever its true efficiency, the data
    # cannot move it; it stays near 1 and is reported unpinned.
    s = _samples(tmp_path, _log(DENSE, {"compute": 3.0, "kv_read": 5.0}, sigma=0.1, prefill=False))
    fit = fit_roofline_samples([s], HW, DENSE, context=ContextSource(CTX, "synthetic"), bootstrap=20,
                               noise=None)
    terms = fit.extra["roofline"]["terms"]
    assert terms["efficiency.kv_read"]["pinned"] is False
    assert terms["efficiency.kv_read"]["prior_share"] > 0.5
    assert abs(fit.coefficients["efficiency.kv_read"] - 1.0) < 1.0
    # No prefill steps: the prefill attention term is not in the data and stays at 1.
    assert terms["efficiency.attention_prefill"]["in_data"] is False
    assert fit.coefficients["efficiency.attention_prefill"] == 1.0
    assert set(fit.ci) <= set(coef_names())


def test_routing_skew_fit_and_dense(tmp_path):
    s = _samples(tmp_path, _log(MOE, {"experts": 2.0}, prefill=False))
    fit = fit_roofline_samples([s], HW, MOE, routing_skew="fit", context=ContextSource(CTX, "s"),
                               bootstrap=0, noise=None)
    assert fit.extra["roofline"]["routing_skew"]["chosen"] <= 0.1  # generated with uniform routing
    d = _samples(tmp_path, _log(DENSE, {}, prefill=False), "d.log")
    fd = fit_roofline_samples([d], HW, DENSE, routing_skew="fit", context=ContextSource(CTX, "s"),
                              bootstrap=0, noise=None)
    assert "routing_skew" not in fd.step_time


def test_cli_calibrate_roofline(tmp_path):
    from simcap.cli import app
    from simcap.config.scenario import parse_scenario
    from simcap.fleet.run import simulate

    log = tmp_path / "steps.log"
    log.write_text("\n".join(_log(MOE, {"experts": 2.0, "compute": 3.0})) + "\n")
    out = tmp_path / "p.yaml"
    runner = CliRunner()
    args = ["calibrate", str(log), "--form", "roofline", "--hardware", HW, "--model", MOE,
            "--input-len", "100", "--output-len", "100", "--bootstrap", "10", "--out", str(out)]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    prof = yaml.safe_load(out.read_text())
    st = prof["step_time"]
    assert st["form"] == "roofline" and st["hardware"] == HW and st["model"] == MOE
    assert set(st["efficiency"]) >= {"experts", "compute", "weights"}
    assert "decode" in st["noise"]
    rf = prof["provenance"]["roofline"]
    assert rf["terms"]["efficiency.experts"]["pinned"] is True
    assert any("workload means: input 100 + output 100 / 2" in n for n in rf["inputs"])
    assert len(prof["bootstrap"]) == 10 and "efficiency.experts" in prof["bootstrap"][0]
    # The profile simulates.
    scen = parse_scenario({"name": "x", "profile": str(out), "engine": {"max_num_seqs": 8, "max_model_len": 2048, "num_gpu_blocks": 1000},
                           "workload": {"arrival": {"process": "closed", "concurrency": 4},
                                        "num_requests": 8, "input_len": 64, "output_len": 16}})
    assert simulate(scen).summary.completed == 8
    # Errors: no context source; no hardware.
    res = runner.invoke(app, args[:8] + ["--out", str(out)])
    assert res.exit_code != 0 and "attended context" in res.output
    res = runner.invoke(app, ["calibrate", str(log), "--form", "roofline", "--model", MOE, "--out", str(out)])
    assert res.exit_code != 0 and "--hardware" in res.output


def test_cli_roofline_bad_names_are_one_line(tmp_path):
    from simcap.cli import app

    log = tmp_path / "s.log"
    log.write_text("Iteration(1): 0 context requests, 0 context tokens, 2 generation requests, "
                   "2 generation tokens, iteration elapsed time: 5.0 ms\n")
    for flag, value, field in (("--hardware", "nope", "step_time.hardware: unknown hardware 'nope'; known: "),
                               ("--model", "nope", "step_time.model: unknown model 'nope'; known: ")):
        args = {"--hardware": "h100-sxm", "--model": "tiny-llama-cpu", flag: value}
        result = CliRunner().invoke(app, ["calibrate", str(log), "--out", str(tmp_path / "p.yaml"),
                                          "--form", "roofline", *[x for kv in args.items() for x in kv],
                                          "--input-len", "10", "--output-len", "10"])
        lines = result.stderr.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1, result.stderr
        assert lines[0].startswith(f"error: roofline form: {field}"), lines[0]


def test_an_efficiency_below_one_is_named_as_below_the_physical_floor():
    """time = efficiency x the term's bytes or FLOPs at the datasheet's rate: below 1 the term
    runs faster than the hardware allows, and the fit's notes say which terms do."""
    from simcap.calibrate.fit_roofline import physics_floor_notes

    assert physics_floor_notes({"efficiency.weights": 1.02, "efficiency.compute": 0.96, "base": 0.001}) == []
    (note,) = physics_floor_notes({"efficiency.weights": 0.583, "efficiency.kv_read": 0.0, "efficiency.compute": 3.1})
    assert note.startswith("below the physical floor (efficiency < 1: faster than the datasheet allows): "
                           "efficiency.weights 0.583, efficiency.kv_read 0; ")


# A corpus case whose max-form fit lies in a flat valley: before the solver read its
# coefficients settled (fit_roofline._settled) and its exact Jacobian, the kernels below moved
# its fitted mixed_step by up to 65%, and the accuracy record written on one machine failed on
# another.
_FIT_ONE_CASE = (
    "import json; from simcap.accuracy.corpus import load_case; from simcap.accuracy.replay import fit_live; "
    "st = fit_live(load_case('calibration/corpus/cpu-dense-frontend'), 'roofline')['step_time']; "
    "print(json.dumps({k: v for k, v in st.items() if k not in ('noise', 'hardware')}, sort_keys=True))")


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="OpenBLAS core types of x86-64")
def test_the_max_form_fit_is_the_same_whichever_blas_kernel_runs_it():
    """Machines differ in the last bits of a matrix product (OpenBLAS picks its kernels by the
    CPU: SSE3, AVX, AVX2, AVX-512); a live fit must give the same profile on every one."""
    root = Path(__file__).resolve().parents[1]
    fitted = {}
    for kernel in ("Prescott", "Sandybridge", "Haswell"):  # (the last needs AVX2, as every CI machine has)
        run = subprocess.run([sys.executable, "-c", _FIT_ONE_CASE], cwd=root, capture_output=True, text=True,
                             env={**os.environ, "OPENBLAS_CORETYPE": kernel}, timeout=300)
        assert run.returncode == 0, run.stderr
        fitted[kernel] = run.stdout
    assert len(set(fitted.values())) == 1, fitted
