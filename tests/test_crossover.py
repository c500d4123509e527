"""Speculation crossover: a synthetic engine whose crossover is known in closed form.

Design. Every draft is accepted (``acceptance_rates: [1, 1, 1]``, k = 3), prompts cost
nothing to prefill, and every request asks for 129 = 1 + 4 x 32 tokens. In a closed loop of
``B`` clients the batch then moves in lockstep: one prefill step (cost ``base``, 1 token) and
either 128 decode steps (``base + d B``, baseline) or 32 verify steps (``base + d B + 3 v B``,
4 tokens each). Both arms emit the same tokens per cycle, so the throughput gain is

    gain(B) = cycle_base / cycle_spec - 1,
    cycle_base = base + 128 (base + d B),    cycle_spec = base + 32 (base + d B + 3 v B),

which is zero at ``B* = base / (v - d)``. With base = 20 ms, d = 0.5 ms and
v = d + base / 6, speculation wins below 6 clients and loses above.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from simcap.studies.crossover import (
    REQUESTS_PER_CLIENT,
    arm_scenarios,
    find_crossover,
    find_crossovers,
    locate_crossover,
    parse_load_list,
    per_stream_answer,
)
from simcap.config.scenario import parse_scenario
from simcap.errors import ScenarioError

ROOT = Path(__file__).resolve().parents[1]
BASE, D = 0.02, 0.0005
B_STAR = 6.0
V = D + BASE / B_STAR


def synthetic(**changes) -> dict:
    data = {
        "name": "synthetic-crossover",
        # (the closed forms below are the synchronous order's; async: its own test)
        "engine": dict(max_num_seqs=256, max_num_batched_tokens=8192, block_size=16,
                       num_gpu_blocks=20000, max_model_len=1024, async_scheduling=False),
        "step_time": dict(base=BASE, per_prefill_token=0.0, per_decode_token=D, per_verify_token=V),
        "speculative": dict(method="eagle3", num_speculative_tokens=3,
                            acceptance_rates=[1.0, 1.0, 1.0]),
        "workload": dict(arrival={"process": "closed", "concurrency": 1}, num_requests=8,
                         input_len=16, output_len=129),
        "seed": 0,
    }
    for key, value in changes.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) else value
    return data


def analytic_gain(b: float, v: float = V) -> float:
    cycle_base = BASE + 128 * (BASE + D * b)
    cycle_spec = BASE + 32 * (BASE + D * b + 3 * v * b)
    return (cycle_base / cycle_spec - 1.0) * 100.0


def test_crossover_matches_the_closed_form():
    assert analytic_gain(B_STAR) == pytest.approx(0.0, abs=1e-9)
    loads = [1, 2, 4, 8, 16, 32]
    result = find_crossover(parse_scenario(synthetic()), loads)
    for p in result.points:
        assert p.gain_pct["throughput"] == pytest.approx(analytic_gain(p.load), rel=1e-6)
        assert p.num_requests == REQUESTS_PER_CLIENT * p.load  # sized with concurrency
        assert p.spec.completed == p.baseline.completed == p.num_requests
        assert p.spec.mean_acceptance_length == pytest.approx(4.0)
        assert p.baseline.mean_acceptance_length is None
    c = result.crossover
    assert c["status"] == "found" and c["between"] == [4, 8]
    g4, g8 = analytic_gain(4), analytic_gain(8)
    expected = 2 ** (2 + g4 / (g4 - g8))  # linear in log2(concurrency) between 4 and 8
    assert c["value"] == pytest.approx(expected, rel=1e-6)
    assert abs(c["value"] - B_STAR) < 0.5
    # A tighter bracket around B* lands closer to it.
    fine = find_crossover(parse_scenario(synthetic()), [5, 7]).crossover
    assert fine["between"] == [5, 7] and abs(fine["value"] - B_STAR) < 0.1


def test_async_scheduling_adds_one_wasted_verify_step_per_request_as_the_closed_form_says():
    """Under async scheduling a request its drafts finished is still scheduled once more
    (vLLM cannot know at that schedule that the drafts ended it): a decode with k placeholder
    drafts, wasted. In lockstep the b clients' requests all finish in one step; the next
    schedule runs their b wasted verifies before the clients' new requests arrive, costing
    X = base + d b + 3 v b, in every cycle but the last. So the EAGLE3 arm takes
    n (base + 32 X) + (n - 1) X for n = 8 requests per client; the baseline (no drafts, no
    wasted step) is unchanged."""
    loads = [1, 2, 4, 8]
    result = find_crossover(parse_scenario(synthetic(engine={"async_scheduling": True})), loads)
    sync = find_crossover(parse_scenario(synthetic()), loads)
    n = REQUESTS_PER_CLIENT
    for p, q in zip(result.points, sync.points):
        b = p.load
        x = BASE + D * b + 3 * V * b
        base_cycle = BASE + 128 * (BASE + D * b)
        spec_time = n * (BASE + 32 * x) + (n - 1) * x
        assert p.gain_pct["throughput"] == pytest.approx(100 * (n * base_cycle / spec_time - 1), rel=1e-9)
        assert p.baseline.output_tokens_per_s == pytest.approx(q.baseline.output_tokens_per_s, rel=1e-12)
        assert p.gain_pct["throughput"] < q.gain_pct["throughput"]


def test_a_baseline_arm_with_its_own_step_time_moves_the_crossover_as_the_closed_form_says():
    """The baseline priced by its own profile (decode 2 d, as a server without the drafter's
    work might not be): cycle_base = base + 128 (base + 2 d B), so the gain is zero at
    B* = 96 base / (96 v + 32 d - 256 d) = 7.5 clients. The speculative arm is untouched."""
    b_star = 96 * BASE / (96 * V + 32 * D - 256 * D)
    assert b_star == pytest.approx(7.5)
    baseline = parse_scenario(synthetic(step_time={"per_decode_token": 2 * D}, speculative=None))
    result = find_crossover(parse_scenario(synthetic()), [5, 7, 8, 11], baseline=baseline)
    alone = find_crossover(parse_scenario(synthetic()), [5, 7, 8, 11])
    for p, q in zip(result.points, alone.points):
        assert p.spec == q.spec
        base_cycle = BASE + 128 * (BASE + 2 * D * p.load)
        spec_cycle = BASE + 32 * (BASE + D * p.load + 3 * V * p.load)
        assert p.gain_pct["throughput"] == pytest.approx(100 * (base_cycle / spec_cycle - 1), rel=1e-6)
    assert result.crossover["between"] == [7, 8] and abs(result.crossover["value"] - b_star) < 0.1
    assert result.provenance["baseline"]["step_time"]["per_decode_token"] == 2 * D
    # The same step time as the scenario's gives the default's answer exactly.
    same = find_crossover(parse_scenario(synthetic()), [5, 7], baseline=parse_scenario(synthetic()))
    assert [p.baseline for p in same.points] == [p.baseline for p in find_crossover(
        parse_scenario(synthetic()), [5, 7]).points]
    with pytest.raises(ScenarioError, match=r"^baseline: its workload section differs from the scenario's"):
        find_crossover(parse_scenario(synthetic()), [1, 2],
                       baseline=parse_scenario(synthetic(workload={"output_len": 64})))
    with pytest.raises(ScenarioError, match=r"^baseline: seed 3 differs from the scenario's 0"):
        find_crossover(parse_scenario(synthetic()), [1, 2], baseline=parse_scenario(synthetic(seed=3)))


def test_stochastic_acceptance_still_brackets_the_crossover():
    # Acceptance length 2.5 spread over positions: no lockstep, but the sign change stays
    # between the grid points around the steady-state estimate (~7.6 clients for 64 tokens).
    data = synthetic(speculative={"acceptance_rates": None, "acceptance_length": 2.5},
                     step_time={"per_verify_token": 0.0015}, workload={"output_len": 64})
    result = find_crossover(parse_scenario(data), [1, 2, 4, 8, 16, 32])
    gains = [p.gain_pct["throughput"] for p in result.points]
    assert all(g > 0 for g in gains[:3]) and all(g < 0 for g in gains[3:])
    assert result.crossover["between"] == [4, 8]


def test_none_in_range_both_ways():
    wins = find_crossover(parse_scenario(synthetic(step_time={"per_verify_token": D})), [1, 4, 16])
    assert wins.crossover["status"] == "none in range" and wins.crossover["value"] is None
    assert "wins at every" in wins.crossover["detail"]
    loses = find_crossover(parse_scenario(synthetic(
        speculative={"acceptance_rates": [0.0, 0.0, 0.0]}, step_time={"draft_per_pass": 0.002},
    )), [1, 4, 16])
    assert loses.crossover["status"] == "none in range"
    assert "loses at every" in loses.crossover["detail"]


def test_locate_and_per_stream_helpers():
    c = locate_crossover([1, 2, 4], [10.0, -10.0, -20.0])
    assert c["value"] == pytest.approx(2 ** 0.5) and c["between"] == [1, 2]
    # A dip back above zero is listed, but the answer is the first win -> loss change.
    c = locate_crossover([1, 2, 4, 8], [-5.0, 5.0, -5.0, -6.0])
    assert [x["direction"] for x in c["crossings"]] == ["spec starts paying", "spec stops paying"]
    assert c["between"] == [2, 4]
    a = per_stream_answer([1, 2, 4, 8], [100.0, 80.0, 40.0, 20.0], 60.0)
    assert a["max_load"] == 2 and a["interpolated"] == pytest.approx(2 ** 1.5)
    assert per_stream_answer([1, 2], [10.0, 5.0], 60.0)["max_load"] is None
    assert per_stream_answer([1, 2], [90.0, 70.0], 60.0) == {
        "max_load": 2, "interpolated": None,
        "detail": "meets 60 tok/s per stream at every point up to 2",
    }


def test_same_workload_and_seed_in_both_arms():
    spec, base, n = arm_scenarios(parse_scenario(synthetic()), concurrency=16)
    assert base.speculative is None and spec.speculative is not None
    assert spec.workload == base.workload and spec.seed == base.seed and n == 128
    assert spec.workload.arrival.concurrency == 16
    spec, _, n = arm_scenarios(parse_scenario(synthetic(workload={"num_requests": 500})), concurrency=4)
    assert n == 500  # never fewer than the scenario asks for
    spec, base, _ = arm_scenarios(parse_scenario(synthetic()), rate=3.0)
    assert spec.workload.arrival.process == "poisson" and spec.workload.arrival.rate == 3.0


def test_bad_input_is_a_scenario_error_naming_the_field():
    no_spec = synthetic()
    del no_spec["speculative"]
    with pytest.raises(ScenarioError, match=r"^speculative: "):
        find_crossover(parse_scenario(no_spec), [1, 2])
    for text in ("1,x", "0,2", "2,2", "", "1.5"):
        with pytest.raises(ScenarioError, match=r"^--concurrency: "):
            parse_load_list(text, "--concurrency", integer=True)
    with pytest.raises(ScenarioError, match=r"^--rate: "):
        parse_load_list("1,-2", "--rate", integer=False)
    with pytest.raises(ScenarioError, match=r"^--rate: "):
        find_crossover(parse_scenario(synthetic()), concurrencies=[1], rates=[1.0])
    with pytest.raises(ScenarioError, match=r"^--per-stream-tps: "):
        find_crossover(parse_scenario(synthetic()), [1], per_stream_tps=0)


# --------------------------------------------------------------------------- CLI


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "simcap", "crossover", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def scenario_file(tmp_path):
    path = tmp_path / "synthetic.yaml"
    path.write_text(yaml.safe_dump(synthetic()))
    return path


def test_cli_json_shape_and_plot(scenario_file, tmp_path):
    figure = tmp_path / "xo.png"
    proc = run(str(scenario_file), "--concurrency", "1,4,16", "--json", "--per-stream-tps", "60",
               "--plot", str(figure), "--set", "seed=3")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert set(data) >= {"points", "crossover", "per_stream_target", "provenance"}
    assert [p["concurrency"] for p in data["points"]] == [1, 4, 16]
    for p in data["points"]:
        for arm in ("spec", "baseline"):
            assert set(p[arm]) >= {"output_tokens_per_s", "latency_mean_s", "latency_p95_s",
                                   "tpot_mean_s", "per_stream_tps_mean"}
        assert set(p["gain_pct"]) >= {"throughput", "latency_mean", "latency_p95"}
    assert data["crossover"]["status"] == "found" and 4 < data["crossover"]["value"] < 16
    target = data["per_stream_target"]
    assert target["target_tps"] == 60 and target["spec"]["max_load"] == 1
    assert data["provenance"]["seed"] == 3 and "sizing" in data["provenance"]
    assert figure.stat().st_size > 10_000


def invoke(*args: str):
    """In process (subprocess start-up costs seconds on a loaded machine)."""
    from typer.testing import CliRunner

    from simcap.cli import app

    return CliRunner().invoke(app, ["crossover", *args])


def test_cli_text_output(scenario_file):
    result = invoke(str(scenario_file), "--concurrency", "1,16", "--per-stream-tps", "60")
    assert result.exit_code == 0, result.output
    assert "throughput crossover: concurrency ~" in result.stdout
    assert "highest concurrency keeping 60 tok/s per stream" in result.stdout


@pytest.mark.parametrize(
    "args, field",
    [
        (["--concurrency", "1,two"], "--concurrency"),
        (["--concurrency", "0"], "--concurrency"),
        (["--rate", "1", "--concurrency", "2"], "--rate"),
        (["--concurrency", "2", "--per-stream-tps", "-5"], "--per-stream-tps"),
        (["--concurrency", "2", "--set", "speculative.num_speculative_tokens=0"],
         "speculative.num_speculative_tokens"),
    ],
)
def test_cli_bad_input_one_line_exit_2(scenario_file, args, field):
    result = invoke(str(scenario_file), *args)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {field}: "), result.stderr


def test_cli_baseline_profile_prices_the_baseline_arm(scenario_file, tmp_path):
    """--baseline-profile: the profile of a server without speculation (decode 2 d here) prices
    the baseline arm alone; the crossover moves to the closed form's 7.5 clients."""
    profile = tmp_path / "plain-server.yaml"
    profile.write_text(yaml.safe_dump({
        "name": "plain-server", "engine": synthetic()["engine"],
        "step_time": dict(base=BASE, per_prefill_token=0.0, per_decode_token=2 * D),
    }))
    result = invoke(str(scenario_file), "--concurrency", "5,7,8,11", "--baseline-profile", str(profile), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["crossover"]["between"] == [7, 8] and abs(data["crossover"]["value"] - 7.5) < 0.1
    assert data["provenance"]["baseline"]["profile"]["name"] == "plain-server"
    missing = invoke(str(scenario_file), "--concurrency", "1,2", "--baseline-profile", str(tmp_path / "none.yaml"))
    assert missing.exit_code == 2 and missing.stderr.strip().endswith("cannot read profile file: No such file or directory")


def test_cli_scenario_without_speculation(tmp_path):
    data = synthetic()
    del data["speculative"]
    path = tmp_path / "plain.yaml"
    path.write_text(yaml.safe_dump(data))
    proc = run(str(path), "--concurrency", "1,2")  # through python -m simcap
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("error: speculative: ")


def test_parallel_arms_give_the_serial_result():
    """Arms in two worker processes, and several scenarios in one batch (run costliest
    first): each result is the serial run's, byte for byte."""
    noisy = parse_scenario(synthetic(step_time={"noise": {"decode": {"kind": "lognormal", "sigma": 0.3}}}))
    other = parse_scenario(synthetic(speculative={"acceptance_rates": [0.8, 0.5, 0.2]}, seed=3))
    serial = [find_crossover(s, [1, 4, 16], per_stream_tps=30.0) for s in (noisy, other)]
    parallel = [find_crossover(s, [1, 4, 16], per_stream_tps=30.0, workers=2) for s in (noisy, other)]
    batch = find_crossovers([noisy, other], [1, 4, 16], per_stream_tps=30.0, workers=2)

    def dump(results):
        return [json.dumps(r.to_dict(), sort_keys=True) for r in results]

    assert dump(parallel) == dump(serial)
    assert dump(batch) == dump(serial)
    assert dump(serial)[0] != dump(serial)[1]
