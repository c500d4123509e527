"""``simcap live calibrate`` and ``live validate`` end to end against the REAL vLLM CPU server.

Calibrate from the server's own per-step log, then validate the fitted profile on a workload
the calibration never sent (open loop, other lengths; a closed loop at concurrency =
max_num_seqs, replayed as a closed loop), printing measured vs predicted; the
black-box fallback; and the faults a real server gives: a wrong model name, request timeouts.
Run with ``python -m pytest -m live tests/live -s`` to see the figures.
"""

from __future__ import annotations

import json
import math
import time

import httpx
import numpy as np
import pytest
import yaml

from simcap.live.prom import parse_metrics
from tests.live.conftest import assert_decode_fit_matches_the_log, recorded_decode_contexts, wait_idle

pytestmark = pytest.mark.live

CAL_ARGS = ("--model", "tiny", "--max-num-seqs", "8", "--max-num-batched-tokens", "512")



@pytest.fixture(scope="module")
def log_profile(vllm_server, tmp_path_factory):
    """``live calibrate --log`` once for the module: (profile path, the command's JSON)."""
    from typer.testing import CliRunner

    from simcap.cli.live import live_app

    out = tmp_path_factory.mktemp("calibrate") / "cpu-tiny.yaml"
    result = CliRunner().invoke(live_app, [
        "calibrate", "--base-url", vllm_server.base_url, *CAL_ARGS, "--out", str(out),
        "--log", str(vllm_server.log_path), "--requests", "32", "--bootstrap", "50", "--json",
        "--record", str(out.with_name("runs")),
    ])  # fmt: skip
    assert result.exit_code == 0, result.stderr or result.output
    return out, json.loads(result.stdout)


def test_calibrate_from_the_server_log(log_profile, vllm_server):
    out, data = log_profile
    assert data["source"] == "vllm iteration log" and data["profile"] == str(out)
    profile = yaml.safe_load(out.read_text())
    metrics = parse_metrics(httpx.get(vllm_server.base_url + "/metrics", timeout=10).text)
    assert profile["engine"] == {
        "vllm_version": "0.32",
        "max_num_seqs": 8,
        "max_num_batched_tokens": 512,
        "block_size": 32,  # from vllm:cache_config_info
        "num_gpu_blocks": metrics.num_gpu_blocks,  # from vllm:cache_config_info
        "max_model_len": 2048,  # from /v1/models
        "enable_prefix_caching": True,
        "async_scheduling": False,
    }
    assert "speculative" not in profile
    st = profile["step_time"]
    # A prompt chunk of up to 512 tokens costs more than a one-token decode on any CPU.
    assert st["base"] > 0 and st["per_prefill_token"] > 0 and st["per_decode_token"] >= 0
    assert len(list(out.with_name("runs").glob("phase*.run.json.gz"))) == len(data["phases"])
    assert_decode_fit_matches_the_log(st, profile["step_time_ci"], out.with_name("cpu-tiny.iterations.log"),
                                      context=recorded_decode_contexts(out.with_name("runs")))
    assert 0 < st["host_overhead"] < 0.05
    host = data["host_overhead"]
    # The log window holds exactly the calibration's steps: its decode request-steps are the
    # client's (one token per step without speculation).
    assert host["log_decode_request_steps"] == host["client_decode_request_steps"] > 100
    assert host["host_overhead_s"] == pytest.approx(host["step_period_s"] - host["logged_elapsed_s"], abs=1e-5)
    prov = profile["provenance"]
    live = prov["live"]
    assert live["fitted_from"] == "vllm iteration log" and live["served_model"] == "tiny"
    assert prov["fitted_with"].startswith("simcap live calibrate --base-url")
    assert prov["fit_method"].startswith("two-stage nnls")
    iterations = out.with_name("cpu-tiny.iterations.log")
    assert live["data_file"] == iterations.name and prov["data"][0]["file"] == str(iterations)
    assert prov["data"][0]["rows"] == len(iterations.read_text().splitlines()) > 100
    assert [p["completed"] for p in live["workload"]] == [p["num_requests"] for p in live["workload"]]
    # --requests 32 in the closed loops of 1-8 clients, 3 + 2 more in the cached- and
    # long-context phases.
    assert sum(p["num_requests"] for p in live["workload"]) == 37
    assert {p["concurrency"] for p in live["workload"]} >= {1, 2, 4}
    assert live["server_counters"]["request_success"] == 37
    assert prov["fit_quality"]["r2"] > 0.8
    # The front end: fitted from the phases' request histograms and client records. A real
    # server always takes some time between the client and its engine, and the phase with one
    # client (no step in flight at an arrival) sets arrival_s.
    fe = profile["frontend"]
    assert fe == data["frontend"]["fitted"] and set(fe) == {"arrival_s", "output_s", "per_chunk_s"}
    assert 0 < fe["arrival_s"] + fe["output_s"] < 0.05 and fe["per_chunk_s"] >= 0
    runs = live["frontend"]["runs"]
    assert len(runs) == len(live["workload"]) and runs[0]["max_in_flight"] == 1
    lone = [r["server_minus_engine_s"] for r in runs if r["max_in_flight"] == 1]
    assert len(lone) == 3  # the first phase, the cached-context one, the long-context one
    assert fe["arrival_s"] == pytest.approx(max(float(np.median(lone)), 0.0), abs=1e-6)
    assert max(r["max_in_flight"] for r in runs) > 2  # phases beyond two clients: a slope to fit
    # The closed loops of 2, 4 and 8 clients scraped /metrics after their first wave, which the
    # fit leaves out: every client's first request (a run whose scrape raced says so in a note).
    waves = [(p["concurrency"], r["first_wave_left_out"]) for p, r in zip(live["workload"], runs)
             if p["concurrency"] > 1]
    assert len(waves) == 3 and sum(c == left for c, left in waves) >= 2, waves
    print("\nfront end per phase (requests, first wave left out, client - server ms, chunks per step):",
          [(r["requests"], r["first_wave_left_out"], round(r["client_minus_server_s"] * 1e3, 2),
            round(r["chunks_per_first_token_step"], 2)) for r in runs])
    print(f"\nlive calibrate (log): step_time {st}; fit {prov['fit_quality']}; "
          f"host {host}; frontend {fe} ({live['frontend']['notes']}); cpu disturbed {live['cpu'].get('disturbed')}")


def test_validate_the_profile_on_a_workload_it_never_saw(log_profile, vllm_server, tmp_path, live_cli,
                                                         write_yaml, show_validation):
    profile, _ = log_profile
    scenario = write_yaml(tmp_path / "unseen.yaml", {
        "name": "unseen-open-loop",
        "profile": str(profile),
        "seed": 21,
        # Open loop at 1 req/s with lengths the calibration's closed-loop mix never drew.
        "workload": {"arrival": {"process": "poisson", "rate": 1.0}, "num_requests": 16,
                     "input_len": {"dist": "uniform", "low": 40, "high": 300},
                     "output_len": {"dist": "uniform", "low": 12, "high": 40}},
    })  # fmt: skip
    fig = tmp_path / "ecdf.png"
    code, out, err = live_cli("validate", scenario, "--base-url", vllm_server.base_url, "--model", "tiny",
                              "--repeats", "2", "--plot", fig, "--json")
    assert code == 0, err
    data = json.loads(out)
    errors = show_validation("validate (log profile, unseen open-loop workload)", data)
    assert data["plot"] == str(fig) and fig.read_bytes()[:4] == b"\x89PNG" and fig.stat().st_size > 20_000
    assert data["simulated_engine"]["async_scheduling"] is False
    assert data["frontend"] == yaml.safe_load(profile.read_text())["frontend"]  # the prediction used it
    for rep in data["repeats"]:
        assert rep["completed"] == 16 and rep["failed"] == 0
    # The prediction is of the right size; how close it is (noisy, shared 2-core machine) is
    # printed above and recorded, not asserted tightly. Not ITL p50: a client that shares two
    # cores with the server reads chunks in pairs when it is starved, and then half its gaps
    # are ~0 (one repeat measured a median of 0.0 ms); TPOT (a request's decode span over its
    # tokens) is immune to that and stands for the decode step.
    for key in ("ttft_p50", "tpot_p50", "e2e_p50", "output_throughput"):
        assert errors[key] is not None and abs(math.log1p(errors[key])) < math.log(2.5), (key, errors[key])


def test_validate_replays_a_closed_loop_run_as_a_closed_loop(log_profile, vllm_server, tmp_path, live_cli,
                                                             write_yaml, show_validation):
    """Concurrency = max_num_seqs: each live client's requests, replayed after its measured gaps."""
    from simcap.live.validate import replay_line
    from simcap.metrics.records import RequestRecord

    profile, _ = log_profile
    scenario = write_yaml(tmp_path / "closed.yaml", {
        "name": "closed-at-max-num-seqs",
        "profile": str(profile),
        "seed": 23,
        "workload": {"arrival": {"process": "closed", "concurrency": 8}, "num_requests": 48,
                     "input_len": {"dist": "uniform", "low": 40, "high": 300},
                     "output_len": {"dist": "uniform", "low": 12, "high": 40}},
    })  # fmt: skip
    code, out, err = live_cli("validate", scenario, "--base-url", vllm_server.base_url, "--model", "tiny",
                              "--repeats", "3", "--out-prefix", tmp_path / "rep", "--json")
    assert code == 0, err
    data = json.loads(out)
    errors = show_validation("validate (log profile, closed loop at concurrency = max_num_seqs)", data)
    assert data["replay"]["mode"] == "closed" and data["replay"]["clients"] == 8
    assert replay_line(data).startswith("replay: closed loop, 8 clients")
    for i, rep in enumerate(data["repeats"]):
        assert rep["completed"] == 48 and rep["failed"] == 0
        recs = [RequestRecord.from_dict(json.loads(line)) for line in (tmp_path / f"rep{i}.jsonl").read_text().splitlines()]
        # Every request names its client, and a client sends only after its previous response.
        assert sorted({r.client_id for r in recs}) == list(range(8))
        for c in range(8):
            mine = sorted((r for r in recs if r.client_id == c), key=lambda r: r.arrival_time)
            assert all(b.arrival_time >= a.finish_time for a, b in zip(mine, mine[1:]))
    # Replayed at fixed send times, TTFT p50 came out several times the measured one here; as
    # a closed loop it is of the measured size (how close is printed above). TPOT, what the
    # engine model prices, is held to the band. TTFT also holds the API server's own queue,
    # which the model leaves out: with 8 clients on 2 cores the server at times takes them
    # nearly one at a time (an AMX machine gave TTFT p50 13, 30 and 589 ms in three repeats of
    # this workload, its engine steps then mostly of one request), so a TTFT outside the band
    # is reported as a known gap (xfail), not a failure; three repeats keep one such repeat
    # from setting the median.
    band = math.log(2.5)
    assert errors["tpot_p50"] is not None and abs(math.log1p(errors["tpot_p50"])) < band, errors["tpot_p50"]
    outside = {key: errors[key] for key in ("ttft_p50", "ttft_p95")
               if errors[key] is None or abs(math.log1p(errors[key])) >= band}
    if outside:
        pytest.xfail(f"TTFT outside the 2.5x band (the API server's queue is not modelled): {outside}; "
                     f"live ranges {({k: (data['metrics'][k]['live_min'], data['metrics'][k]['live_max']) for k in outside})}")


def test_calibrate_black_box_probes_say_they_overstate_prefill(vllm_server, tmp_path, live_cli):
    out = tmp_path / "probes.yaml"
    code, stdout, err = live_cli("calibrate", "--base-url", vllm_server.base_url, *CAL_ARGS, "--out", out,
                                 "--bootstrap", "20")
    assert code == 0, err
    assert "fitted from: black-box probes" in stdout and "OVERSTATE prefill" in stdout
    profile = yaml.safe_load(out.read_text())
    prov = profile["provenance"]
    assert prov["live"]["fitted_from"] == "black-box probes"
    assert any("OVERSTATE prefill" in a for a in prov["assumptions"])
    assert profile["step_time"]["host_overhead"] == 0.0
    # The decode slope of a tiny model on a shared, busy CPU can drown in noise (the fit then
    # says 0); the prefill slope is always there.
    st = profile["step_time"]
    assert st["per_prefill_token"] > 0 and st["per_decode_token"] >= 0
    samples = json.loads(out.with_name("probes.probes.json").read_text())["samples"]
    assert {s["probe"] for s in samples} == {"ttft", "tpot"}
    assert sorted(s["num_decode_reqs"] for s in samples if s["probe"] == "tpot") == [1, 2, 4, 8]
    print(f"\nlive calibrate (black-box probes): step_time {profile['step_time']}")


def test_wrong_model_fails_fast_with_one_line(vllm_server, tmp_path, live_cli, write_yaml):
    scenario = write_yaml(tmp_path / "s.yaml", {
        "engine": {"block_size": 32, "num_gpu_blocks": 1000, "max_model_len": 2048},
        "workload": {"arrival": {"process": "closed", "concurrency": 1}, "num_requests": 2,
                     "input_len": 16, "output_len": 4},
    })  # fmt: skip
    for cmd in (("run", scenario, "--no-progress"), ("validate", scenario, "--no-warmup"),
                ("calibrate", "--out", tmp_path / "p.yaml", "--max-num-seqs", "8", "--max-num-batched-tokens", "512")):
        t0 = time.monotonic()
        code, out, err = live_cli(*cmd, "--base-url", vllm_server.base_url, "--model", "tiny-nope")
        assert time.monotonic() - t0 < 10
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1, err
        assert lines[0] == (f"error: model 'tiny-nope' is not served at {vllm_server.base_url}; served: tiny")
    assert not (tmp_path / "p.yaml").exists()


def test_request_timeout_is_recorded_as_a_failed_request(vllm_server, server_speed, tmp_path, live_cli,
                                                         write_yaml):
    # The timeout comes from this server's measured speed: two requests of 1,200 output tokens
    # need at least 1,200 decode steps each (steps at batch 2 are no shorter than at batch 1,
    # and a step's period is its logged forward time plus host work), and the client gives up
    # after a quarter of that at the logged forward time, after the prefill of the 64-token
    # prompt: mid-stream on a fast CPU or a slow one, with a margin of 4x against steps running
    # faster than they were measured.
    out_len = 1200
    timeout = round(server_speed.prefill_s * 64 / 512 + 0.25 * out_len * server_speed.decode_step_s, 3)
    scenario = write_yaml(tmp_path / "slow.yaml", {
        "engine": {"block_size": 32, "num_gpu_blocks": 1000, "max_model_len": 2048},
        "workload": {"arrival": {"process": "closed", "concurrency": 2}, "num_requests": 2,
                     "input_len": 64, "output_len": out_len},
    })  # fmt: skip
    records = tmp_path / "slow.jsonl"
    code, out, err = live_cli("run", scenario, "--base-url", vllm_server.base_url, "--model", "tiny",
                              "--request-timeout", timeout, "--out", records, "--json", "--no-progress")
    assert code == 0, err
    data = json.loads(out)
    assert data["live"]["failed"] == 2 and data["completed"] == 0, (timeout, server_speed, data["live"])
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    assert len(lines) == 2
    for rec in lines:
        # Cut mid-stream: the record keeps the chunks that arrived, and says how many.
        assert rec["finish_reason"] == "error", rec
        assert rec["error"] == (f"timeout: not complete within {timeout:g} s (request timeout) "
                                f"after {len(rec['chunk_times'])} chunks")
        assert len(rec["chunk_times"]) < out_len
    assert sorted(data["live"]["errors"]) == sorted({r["error"] for r in lines})
    wait_idle(vllm_server.base_url)  # the server aborted the requests the client gave up on
