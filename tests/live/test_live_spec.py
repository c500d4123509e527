"""Live mode against a REAL vLLM CPU server with ngram speculative decoding and an API key.

The one extra server configuration (``spec_server``): ``--speculative-config`` ngram, k=3,
``--enable-logging-iteration-details``, and ``VLLM_API_KEY``. Checks that the spec-decode
counters come back and the mean acceptance length is reported, that the key is read from the
environment, sent, and never printed or written, that a missing key fails fast, and that a
profile calibrated from this server's log (with its speculative section) predicts a workload
it never saw.
"""

from __future__ import annotations

import json
import math

import pytest
import yaml

from tests.live.conftest import assert_decode_fit_matches_the_log, recorded_decode_contexts

pytestmark = pytest.mark.live

OUT = 48


def _scenario(write_yaml, path, n, concurrency, low, high, out=OUT, seed=0, **extra):
    return write_yaml(path, {
        "engine": {"block_size": 32, "num_gpu_blocks": 1000, "max_model_len": 2048},
        "workload": {"arrival": {"process": "closed", "concurrency": concurrency}, "num_requests": n,
                     "input_len": {"dist": "uniform", "low": low, "high": high}, "output_len": out},
        "seed": seed, **extra,
    })  # fmt: skip


def test_ngram_run_reports_acceptance_and_keeps_the_key_secret(spec_server, tmp_path, live_cli, write_yaml):
    key = spec_server.api_key
    scenario = _scenario(write_yaml, tmp_path / "s.yaml", 12, 4, 32, 128, seed=3)
    records = tmp_path / "run.jsonl"
    code, out, err = live_cli("run", scenario, "--base-url", spec_server.base_url, "--model", "tiny",
                              "--out", records, "--json", "--no-progress", env={"SIMCAP_API_KEY": key})
    assert code == 0, err
    data = json.loads(out)
    assert data["live"]["failed"] == 0 and data["completed"] == 12
    server = data["server"]
    assert server["spec_decode_num_drafts"] > 0 and server["spec_decode_num_draft_tokens"] > 0
    assert server["spec_decode_num_speculative_tokens"] == 3
    acc = server["spec_decode_mean_acceptance_length"]
    assert 1.0 < acc <= 4.0
    assert acc == pytest.approx(1 + server["spec_decode_num_accepted_tokens"] / server["spec_decode_num_drafts"])
    rates = server["spec_decode_acceptance_rates"]
    assert len(rates) == 3 and all(a >= b for a, b in zip(rates, rates[1:]))
    # Several tokens per chunk now; the client's totals still match the server's exactly.
    assert data["cross_check"]["generation_tokens_rel_diff"] == 0.0
    assert data["cross_check"]["server_generation_tokens"] == 12 * OUT
    lines = records.read_text().splitlines()
    assert len(lines) == 12 and max(max(json.loads(line)["chunk_tokens"]) for line in lines) > 1
    assert key not in out + err + records.read_text()

    # Text output, key from a variable named on the command line: the acceptance is printed.
    small = _scenario(write_yaml, tmp_path / "small.yaml", 4, 2, 32, 64, seed=4)
    code, out, err = live_cli("run", small, "--base-url", spec_server.base_url, "--model", "tiny",
                              "--api-key-env", "MY_VLLM_KEY", "--out", records, "--no-progress",
                              env={"MY_VLLM_KEY": key, "SIMCAP_API_KEY": None})
    assert code == 0, err
    assert "speculative decoding (server counters): mean acceptance length" in out
    assert key not in out + err + records.read_text()
    print(f"\nngram k=3 run: mean acceptance length {acc:.3f}, per-position {[round(r, 3) for r in rates]}")


def test_missing_or_wrong_key_fails_fast(spec_server, tmp_path, live_cli, write_yaml):
    scenario = _scenario(write_yaml, tmp_path / "s.yaml", 2, 1, 16, 32, out=4)
    for env in ({"SIMCAP_API_KEY": None}, {"SIMCAP_API_KEY": "sk-wrong-key-42"}):
        code, out, err = live_cli("run", scenario, "--base-url", spec_server.base_url, "--model", "tiny",
                                  "--no-progress", env=env)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1, err
        assert "HTTP 401" in lines[0] and "API key" in lines[0] and "sk-wrong-key-42" not in err


def test_ngram_calibrate_then_validate_an_unseen_workload(spec_server, tmp_path, live_cli, write_yaml,
                                                          show_validation):
    env = {"SIMCAP_API_KEY": spec_server.api_key}
    out = tmp_path / "cpu-tiny-ngram.yaml"
    code, stdout, err = live_cli("calibrate", "--base-url", spec_server.base_url, "--model", "tiny",
                                 "--max-num-seqs", "8", "--max-num-batched-tokens", "512", "--out", out,
                                 "--log", spec_server.log_path, "--requests", "24", "--bootstrap", "30",
                                 "--json", "--record", tmp_path / "runs", env=env)
    assert code == 0, err
    cal = json.loads(stdout)
    profile = yaml.safe_load(out.read_text())
    assert spec_server.api_key not in out.read_text() + stdout + err
    spec = profile["speculative"]
    assert spec["method"] == "ngram" and spec["num_speculative_tokens"] == 3
    counters = profile["provenance"]["live"]["server_counters"]
    assert spec["acceptance_length"] == pytest.approx(counters["spec_decode_mean_acceptance_length"], abs=1e-3)
    assert 0 < spec["proposal_rate"] <= 1
    # Verified drafts fitted from the log: the line through the logged decode steps, however
    # small a draft's cost is on this CPU.
    assert "per_verify_token" in profile["step_time_ci"]
    assert_decode_fit_matches_the_log(profile["step_time"], profile["step_time_ci"],
                                      out.with_name("cpu-tiny-ngram.iterations.log"), k=3,
                                      context=recorded_decode_contexts(tmp_path / "runs", 3))
    assert cal["host_overhead"]["log_decode_request_steps"] > 50
    print(f"\nlive calibrate (ngram log): step_time {profile['step_time']}; speculative {spec}")

    scenario = _scenario(write_yaml, tmp_path / "unseen.yaml", 9, 3, 64, 200, out=40, seed=31,
                         profile=str(out), name="unseen-ngram")
    scenario_data = yaml.safe_load(scenario.read_text())
    del scenario_data["engine"]  # the profile's engine
    write_yaml(scenario, scenario_data)
    code, stdout, err = live_cli("validate", scenario, "--base-url", spec_server.base_url, "--model", "tiny",
                                 "--repeats", "1", "--json", env=env)
    assert code == 0, err
    data = json.loads(stdout)
    errors = show_validation("validate (ngram log profile, unseen closed-loop workload)", data)
    rep = data["repeats"][0]
    assert rep["completed"] == 9 and rep["server"]["spec_decode_num_drafts"] > 0
    print(f"  live mean acceptance length {rep['server']['spec_decode_mean_acceptance_length']:.3f}, "
          f"profile's {spec['acceptance_length']}")
    for key in ("ttft_p50", "tpot_p50", "e2e_p50", "output_throughput"):
        assert errors[key] is not None and abs(math.log1p(errors[key])) < math.log(2.5), (key, errors[key])
