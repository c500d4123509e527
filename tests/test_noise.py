"""Step-time noise: the sampler, its stream, its effect on a run, and its fit from step samples."""

from __future__ import annotations

import math

import numpy as np
import pytest
import yaml

from simcap.calibrate import Recipe, fit_step_samples, profile_dict
from simcap.calibrate.noise_fit import empirical_from_ratios, fit_noise, ks_distance
from simcap.calibrate.readers import StepSamples
from simcap.config.scenario import EmpiricalNoise, LognormalNoise, StepNoiseConfig
from simcap.engine.noise import StepNoise, inverse_cdf, mean_factor
from simcap.engine.step_time import FEATURES
from simcap.errors import ScenarioError
from simcap.fleet.run import simulate
from simcap.metrics.report import to_json
from tests.conftest import make_scenario

EMP = {"kind": "empirical", "quantiles": [0.5, 1.0, 2.0]}


# --------------------------------------------------------------------------- the sampler


def test_empirical_inverse_cdf_by_hand():
    dist = EmpiricalNoise(**EMP)  # quantiles at p = 0, 0.5, 1
    u = np.array([0.0, 0.25, 0.5, 0.75, 0.9, 0.1])
    # linear between neighbours: 0.5 + 0.5 * (u / 0.5) below the median, 1 + 1 * ((u - .5) / .5) above
    assert inverse_cdf(dist, u).tolist() == pytest.approx([0.5, 0.75, 1.0, 1.5, 1.8, 0.6], abs=1e-15)
    assert mean_factor(dist) == pytest.approx((0.75 + 1.5) / 2)  # trapezoids of the two halves
    big = EmpiricalNoise(kind="empirical", quantiles=(0.8, 0.9, 1.0, 1.1, 1.2))  # p = 0, .25, .5, .75, 1
    assert inverse_cdf(big, np.array([0.125, 0.6, 0.99])).tolist() == pytest.approx([0.85, 1.04, 1.196])


def test_lognormal_inverse_cdf_by_hand():
    dist = LognormalNoise(kind="lognormal", sigma=0.5)
    phi1 = 0.8413447460685429  # standard normal CDF at 1
    got = inverse_cdf(dist, np.array([0.5, phi1, 1 - phi1]))
    assert got.tolist() == pytest.approx([math.exp(-0.125), math.exp(0.375), math.exp(-0.625)], rel=1e-12)
    assert inverse_cdf(LognormalNoise(kind="lognormal", sigma=0.0), np.array([0.3, 0.9])).tolist() == [1.0, 1.0]
    # mean one: the sample mean of many draws
    u = np.random.default_rng(0).random(400_000)
    assert inverse_cdf(dist, u).mean() == pytest.approx(1.0, abs=0.005)


def test_stream_uses_its_own_seed_sequence_one_uniform_per_step():
    cfg = StepNoiseConfig(decode=EmpiricalNoise(**EMP), prefill=LognormalNoise(kind="lognormal", sigma=0.2))
    noise = StepNoise.from_config(cfg, seed=7)
    u = np.random.default_rng(np.random.SeedSequence([7, 2])).random(10)
    kinds = ["decode", "prefill", "spec", "decode", "prefill"] * 2
    got = [noise.factor(k) for k in kinds]
    want = [float(inverse_cdf(cfg.prefill if k == "prefill" else cfg.decode, u[i : i + 1])[0])
            for i, k in enumerate(kinds)]  # spec falls back to decode
    assert got == want


def test_peek_and_advance_across_block_boundaries(monkeypatch):
    monkeypatch.setattr(StepNoise, "BLOCK", 5)
    cfg = StepNoiseConfig(decode=LognormalNoise(kind="lognormal", sigma=0.3))
    a = StepNoise.from_config(cfg, seed=3)
    b = StepNoise.from_config(cfg, seed=3)
    seen = []
    for n, m in [(3, 2), (7, 7), (1, 0), (12, 4), (2, 2), (9, 9)]:
        ahead = a.peek(n, "decode", 1)
        assert a.peek(n, "decode", 1) == ahead  # peeking uses nothing up
        assert a.peek(n + 1)[1:] == ahead
        seen += a.peek(m)
        a.advance(m)
    assert seen == [b.factor("decode") for _ in seen]
    assert a.peek(4, "prefill") == [1.0] * 4  # a kind without a distribution: factor 1


def test_noise_off_is_none_and_changes_nothing():
    assert StepNoise.from_config(None, 0) is None
    assert StepNoise.from_config(StepNoiseConfig(), 0) is None
    base = dict(workload={"arrival": {"process": "poisson", "rate": 20.0}, "num_requests": 30,
                          "input_len": {"dist": "uniform", "low": 10, "high": 300}, "output_len": 40})
    plain = make_scenario(**base)
    off = make_scenario(step_time={"noise": None}, **base)
    empty = make_scenario(step_time={"noise": {}}, **base)
    assert plain.digest() == off.digest()
    out = to_json(simulate(plain).to_dict())
    assert to_json(simulate(off).to_dict()) == out
    assert json_without_digest(simulate(empty).to_dict()) == json_without_digest(simulate(plain).to_dict())


def json_without_digest(d):
    d = dict(d)
    d["provenance"] = {k: v for k, v in d["provenance"].items() if k != "scenario_sha256"}
    return to_json(d)


@pytest.mark.parametrize(
    "noise, message",
    [
        ({"decode": {"kind": "empirical", "quantiles": [1.0, 0.9, 1.2]}},
         "step_time.noise.decode: quantiles must be non-decreasing"),
        ({"prefill": {"kind": "empirical", "quantiles": [0.0, 1.0, 2.0]}},
         "step_time.noise.prefill: quantiles must be positive"),
        ({"decode": {"kind": "empirical", "quantiles": [1.0]}}, "step_time.noise.decode: quantiles need at least 2"),
        ({"spec": {"kind": "lognormal", "sigma": -0.1}}, "step_time.noise.spec.sigma"),
        ({"decode": {"kind": "gamma", "sigma": 0.1}}, "step_time.noise.decode"),
        ({"decode": {"kind": "lognormal", "sigma": 0.1, "mu": 0}}, "step_time.noise.decode.mu: unknown key"),
        ({"verify": {"kind": "lognormal", "sigma": 0.1}}, "step_time.noise.verify: unknown key"),
    ],
)
def test_bad_noise_is_one_clear_error_naming_the_field(noise, message):
    with pytest.raises(ScenarioError) as exc:
        make_scenario(step_time={"noise": noise})
    assert str(exc.value).startswith(message), str(exc.value)


# --------------------------------------------------------------------------- in a run

NOISY = {"decode": {"kind": "lognormal", "sigma": 0.35}, "prefill": {"kind": "empirical", "quantiles": [0.7, 1.0, 1.3]}}


def test_same_seed_same_run_and_workload_untouched():
    wl = {"arrival": {"process": "poisson", "rate": 30.0}, "num_requests": 60,
          "input_len": {"dist": "uniform", "low": 10, "high": 400},
          "output_len": {"dist": "uniform", "low": 5, "high": 80}}
    st = dict(base=0.004, per_prefill_token=1e-5, per_decode_token=2e-4)
    noisy = make_scenario(step_time={**st, "noise": NOISY}, workload=wl, seed=11)
    plain = make_scenario(step_time=st, workload=wl, seed=11)
    a, b = simulate(noisy, records=True), simulate(noisy, records=True)
    assert to_json(a.to_dict()) == to_json(b.to_dict()) and a.records == b.records
    c = simulate(plain, records=True)
    assert [(r.arrival_time, r.num_prompt_tokens, r.max_tokens) for r in a.records] == [
        (r.arrival_time, r.num_prompt_tokens, r.max_tokens) for r in c.records]
    assert a.summary.ttft_s.p50 != c.summary.ttft_s.p50  # the noise did act
    other = simulate(make_scenario(step_time={**st, "noise": NOISY}, workload=wl, seed=12))
    assert to_json(other.to_dict()) != to_json(a.to_dict())


def test_noise_leaves_the_acceptance_stream_alone():
    """One closed-loop client: the same steps in the same order whatever they cost, so the
    acceptance draws (and counters) must not move when the noise is turned on."""
    wl = {"arrival": {"process": "closed", "concurrency": 1}, "num_requests": 6, "input_len": 50, "output_len": 60}
    spec = {"method": "eagle3", "num_speculative_tokens": 3, "acceptance_length": 2.2}
    st = dict(base=0.004, per_decode_token=1e-4, per_verify_token=1e-4)
    on = simulate(make_scenario(step_time={**st, "noise": {"spec": {"kind": "lognormal", "sigma": 0.4}}},
                                workload=wl, speculative=spec), steps=True)
    off = simulate(make_scenario(step_time=st, workload=wl, speculative=spec), steps=True)
    assert on.summary.spec_decode == off.summary.spec_decode
    assert len(on.steps) == len(off.steps)
    assert on.summary.itl_s.p95 != off.summary.itl_s.p95


def test_noise_widens_itl_tail_and_keeps_the_mean_step():
    wl = {"arrival": {"process": "closed", "concurrency": 4}, "num_requests": 40, "input_len": 64,
          "output_len": {"dist": "uniform", "low": 100, "high": 300}}
    st = dict(base=0.008, per_prefill_token=2e-5, per_decode_token=5e-4, host_overhead=0.002)
    off = simulate(make_scenario(step_time=st, workload=wl), steps=True)
    for noise in ({"decode": {"kind": "lognormal", "sigma": 0.3}},
                  {"decode": empirical_from_ratios(np.random.default_rng(1).gamma(9, 1 / 9, 3000)).model_dump()}):
        on = simulate(make_scenario(step_time={**st, "noise": noise}, workload=wl), steps=True)
        off_itl, on_itl = off.summary.itl_s, on.summary.itl_s
        assert on_itl.p95 / on_itl.p50 > off_itl.p95 / off_itl.p50 + 0.2
        mean_on = on.summary.duration_s / len(on.steps)
        mean_off = off.summary.duration_s / len(off.steps)
        assert mean_on == pytest.approx(mean_off, rel=0.03)
        assert on_itl.mean == pytest.approx(off_itl.mean, rel=0.03)


# --------------------------------------------------------------------------- fitting


def test_empirical_fit_is_mean_one_and_robust_to_a_stray_step():
    r = np.random.default_rng(4).lognormal(0.0, 0.2, 500)
    r[0] = 20.0  # one stray step
    dist = empirical_from_ratios(r)
    assert len(dist.quantiles) == 41 and dist.samples == 500
    assert mean_factor(dist) == pytest.approx(1.0, abs=1e-4)
    assert dist.quantiles[-1] < 5.0  # the end segment keeps its samples' mean, not the stray max
    assert ks_distance(r, dist) < 0.03
    assert len(empirical_from_ratios(r[:50]).quantiles) == 21


def _samples(n_decode, n_prefill, factor_rng, sigma=0.25):
    rng = np.random.default_rng(0)
    rows, y = [], []
    for i in range(n_decode + n_prefill):
        pre = 0 if i < n_decode else int(rng.integers(32, 512))
        dec = int(rng.integers(1, 9))
        x = dict.fromkeys(FEATURES, 0.0)
        x.update(base=1.0, per_prefill_token=pre, per_decode_token=dec, mixed_step=float(bool(pre and dec)))
        rows.append([x[f] for f in FEATURES])
        t = 0.005 + 2e-5 * pre + 6e-4 * dec
        y.append(t * factor_rng.lognormal(-sigma**2 / 2, sigma))
    X = np.array(rows)
    return StepSamples(X, np.array(y), set(FEATURES) - {"per_verify_token"}, {"file": "synthetic"})


def test_fit_recovers_the_noise_per_kind_and_writes_it_to_the_profile(tmp_path):
    s = _samples(600, 300, np.random.default_rng(9))
    fit = fit_step_samples([s], bootstrap=0)
    kinds = fit.noise_report["kinds"]
    assert kinds["decode"]["samples"] == 600 and kinds["prefill"]["samples"] == 300
    assert kinds["spec"]["samples"] == 0 and "spec" not in fit.noise
    for k in ("decode", "prefill"):
        assert kinds[k]["lognormal_sigma"] == pytest.approx(0.25, rel=0.15)
        assert kinds[k]["ks_empirical"] < 0.03
        assert fit.noise[k]["kind"] == "empirical"
    recipe = Recipe(name="t", engine={"max_num_seqs": 8, "max_num_batched_tokens": 512, "block_size": 16,
                                      "num_gpu_blocks": 500, "max_model_len": 2048})
    prof = profile_dict(fit, recipe)
    assert prof["step_time"]["noise"]["decode"]["samples"] == 600
    assert prof["provenance"]["noise"]["written"] is True
    assert "noise" not in profile_dict(fit, recipe, noise=False)["step_time"]
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(json_roundtrip(prof)))
    sc = make_scenario(profile=str(path), workload={"arrival": {"process": "closed", "concurrency": 2},
                                                    "num_requests": 4, "input_len": 64, "output_len": 20})
    assert sc.step_time.noise.decode.kind == "empirical"
    simulate(sc)
    lognormal = fit_step_samples([s], bootstrap=0, noise="lognormal")
    assert lognormal.noise["decode"] == {"kind": "lognormal", "sigma": pytest.approx(0.25, rel=0.15),
                                         "samples": 600}
    assert fit_step_samples([s], bootstrap=0, noise=None).noise is None


def json_roundtrip(d):
    import json

    return json.loads(json.dumps(d))


def test_fit_noise_needs_enough_steps_of_a_kind():
    section, report = fit_noise(np.ones(25), np.ones(25), ["decode"] * 19 + ["prefill"] * 6)
    assert section is None and report["kinds"]["decode"]["samples"] == 19


def test_calibrate_cli_noise_option(tmp_path):
    from typer.testing import CliRunner

    from simcap.cli import app

    rng = np.random.default_rng(2)
    lines = ["num_prefill_tokens,num_decode_tokens,step_time_s"]
    for i in range(120):
        p, d = (int(rng.integers(32, 512)), 0) if i % 4 == 0 else (0, int(rng.integers(1, 9)))
        lines.append(f"{p},{d},{(0.004 + 1e-5 * p + 3e-4 * d) * rng.lognormal(-0.02, 0.2):.6g}")
    csv = tmp_path / "s.csv"
    csv.write_text("\n".join(lines) + "\n")
    runner = CliRunner()
    res = runner.invoke(app, ["calibrate", str(csv), "--out", str(tmp_path / "a.yaml"), "--bootstrap", "0"])
    assert res.exit_code == 0, res.output
    assert "step-time noise" in res.output
    noise = yaml.safe_load((tmp_path / "a.yaml").read_text())["step_time"]["noise"]
    assert noise["decode"]["kind"] == "empirical" and noise["decode"]["samples"] == 90
    res = runner.invoke(app, ["calibrate", str(csv), "--out", str(tmp_path / "b.yaml"), "--bootstrap", "0",
                              "--noise", "none"])
    assert res.exit_code == 0, res.output
    assert "noise" not in yaml.safe_load((tmp_path / "b.yaml").read_text())["step_time"]
    res = runner.invoke(app, ["calibrate", str(csv), "--out", str(tmp_path / "c.yaml"), "--noise", "gauss"])
    assert res.exit_code == 2 and "--noise: must be one of" in res.output
