"""``simcap serve`` against real clients and a real vLLM: ``vllm bench serve`` runs against it
unchanged and its report agrees with ``simcap simulate`` of the same workload; prompts count
as the real server counts them; ``simcap live validate`` against it reproduces the
simulation; its /metrics has the real server's names and labels.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from simcap.config.scenario import load_scenario
from simcap.fleet.run import simulate
from simcap.serve.engine import replay_overrides
from tests.serve_helpers import served, write_scenario

pytestmark = pytest.mark.live

# Steps of 40 ms and more: a chunk handed over one step late would be seen 40 ms late.
STEP_BASE_S = 0.040
SLOW = {"step_time": {"base": STEP_BASE_S, "per_prefill_token": 1.0e-4, "per_decode_token": 2.0e-3},
        "engine": {"max_num_seqs": 8, "max_num_batched_tokens": 512, "block_size": 32, "num_gpu_blocks": 2048,
                   "max_model_len": 2048, "enable_prefix_caching": True}}


def _ms(x: float) -> str:
    return f"{x * 1e3:.2f} ms"


def test_vllm_bench_serve_runs_unchanged_and_agrees_with_simulate(tmp_path, vllm_install):
    """``vllm bench serve`` (random prompts of 256 tokens by the tiny model's tokenizer, 32
    output tokens, Poisson at 6 req/s, 60 prompts) against ``simcap serve --tokenizer``: every
    request completes; the input and output token totals are the trace's (the prompts count
    as vLLM's tokenizer counts them); TPOT and ITL agree with ``simcap simulate`` of the served
    trace within 1%; its TTFT is the simulation's plus the HTTP front end, never less, and
    by less than half a step (a chunk a step late would show)."""
    python, model = vllm_install
    scenario = write_scenario(tmp_path, **SLOW)
    out = tmp_path / "bench"
    with served(scenario, "--tokenizer", str(model), "--served-model-name", "tiny", folder=tmp_path) as run:
        bench = subprocess.run(
            [str(python), "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "vllm",
             "--base-url", run.base_url, "--model", "tiny", "--tokenizer", str(model),
             "--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "32",
             "--num-prompts", "60", "--request-rate", "6", "--ignore-eos", "--seed", "5",
             "--save-result", "--save-detailed", "--result-dir", str(out), "--result-filename", "bench.json"],
            capture_output=True, text=True, timeout=600,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu"},
        )
        assert bench.returncode == 0, bench.stderr[-3000:]
    assert run.exit_code == 0, run.stderr
    report = json.loads((out / "bench.json").read_text())
    trace = [json.loads(line) for line in run.trace_path.read_text().splitlines()]
    assert (report["completed"], report["failed"]) == (60, 0)
    assert report["total_input_tokens"] == sum(t["input_length"] for t in trace)
    assert report["total_output_tokens"] == sum(t["output_length"] for t in trace) == 60 * 32
    sim = simulate(load_scenario(scenario, replay_overrides(str(run.trace_path), 32)), records=True)
    summary = sim.summary.to_dict()
    rows = [("mean TTFT", report["mean_ttft_ms"] / 1e3, summary["ttft_s"]["mean"]),
            ("median TTFT", report["median_ttft_ms"] / 1e3, summary["ttft_s"]["p50"]),
            ("mean TPOT", report["mean_tpot_ms"] / 1e3, summary["tpot_s"]["mean"]),
            ("median TPOT", report["median_tpot_ms"] / 1e3, summary["tpot_s"]["p50"]),
            ("mean ITL", report["mean_itl_ms"] / 1e3, summary["itl_s"]["mean"]),
            ("output tok/s", report["output_throughput"], summary["throughput"]["output_tokens_per_s"])]
    print("\nvllm bench serve vs simcap simulate of the served trace:")
    for name, bench_value, sim_value in rows:
        print(f"  {name:13s} bench {bench_value:10.4f}  simulate {sim_value:10.4f}  ({bench_value / sim_value - 1:+.2%})")
    print(f"  clock lag at the server: {run.status['clock_lag']}")
    for name, bench_value, sim_value in rows[2:5]:
        assert bench_value == pytest.approx(sim_value, rel=0.01), name
    # The client's TTFTs less the simulated ones, order statistic by order statistic (which
    # request is which is not in the report; if each client TTFT is at least its simulated
    # one, so is each order statistic).
    served_ttft = sorted(r.chunk_times[0] - r.arrival_time for r in run.records())
    front = [b - s for b, s in zip(sorted(report["ttfts"]), served_ttft)]
    print(f"  front end (client TTFT - simulated): median {_ms(statistics.median(front))}, max {_ms(max(front))}")
    assert min(front) > -1e-3
    assert statistics.median(front) < STEP_BASE_S / 2


def test_prompts_count_as_the_real_server_counts_them(tmp_path, vllm_server, vllm_install):
    """Text, token-id and chat prompts through ``simcap serve --tokenizer`` (the tiny model's
    folder) and through the real vLLM: the same usage.prompt_tokens, the same /tokenize ids;
    the real server's /metrics has every series ``simcap serve`` shows, label for label."""
    _, model = vllm_install
    requests = [
        ("/v1/completions", {"prompt": "hello world how are you", "max_tokens": 2}),
        ("/v1/completions", {"prompt": "The quick brown fox jumps over the lazy dog. " * 7, "max_tokens": 2}),
        ("/v1/completions", {"prompt": [11, 12, 13, 14, 15], "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "How many replicas?"}], "max_tokens": 2}),
    ]
    real = vllm_server.base_url
    with served(write_scenario(tmp_path, **SLOW), "--tokenizer", str(model), "--served-model-name", "tiny",
                folder=tmp_path) as run:
        for path, body in requests:
            body = {**body, "model": "tiny", "ignore_eos": True}
            ours, theirs = (httpx.post(base + path, json=body, timeout=60).json()["usage"] for base in (run.base_url, real))
            assert ours["prompt_tokens"] == theirs["prompt_tokens"], (path, body)
        for body in ({"prompt": "hello world how are you"}, {"prompt": "a b", "add_special_tokens": False}):
            ours, theirs = (httpx.post(base + "/tokenize", json={**body, "model": "tiny"}, timeout=60).json()
                            for base in (run.base_url, real))
            assert ours["tokens"] == theirs["tokens"]
        ours_metrics = httpx.get(run.base_url + "/metrics").text

    def shapes(text: str) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out.setdefault(s.name, set()).update(k for k in s.labels if k != "le")
        return out

    theirs = shapes(httpx.get(real + "/metrics").text)
    for name, labels in shapes(ours_metrics).items():
        if name.startswith("simcap:"):
            continue
        assert name in theirs, name
        assert labels <= theirs[name] if name.endswith("_info") else labels == theirs[name], name


def test_live_validate_against_simcap_serve_reproduces_the_simulation(tmp_path, live_cli, show_validation):
    """``simcap live validate`` (its own client, 3 repeats, the prefix cache reset between
    them) against ``simcap serve`` of the same scenario: every run gives the same figures, and
    the prediction is the measurement less the HTTP front end: E2E and TPOT p50 within 1%,
    output throughput within 1%; TTFT p50 below the measured one, by less than half a step."""
    scenario = write_scenario(
        tmp_path, **SLOW,
        workload={"arrival": {"process": "poisson", "rate": 3.0}, "num_requests": 30, "input_len": 200,
                  "output_len": 24, "prefix": {"num_prefixes": 2, "shared_tokens": 128}},
    )
    with served(scenario, folder=tmp_path) as run:
        code, out, err = live_cli("validate", scenario, "--base-url", run.base_url, "--json")
    assert code == 0, err
    data = json.loads(out)
    errors = show_validation("simcap live validate against simcap serve", data)
    print(f"  clock lag at the server: {run.status['clock_lag']}")
    for key in ("e2e_p50", "tpot_p50", "output_throughput"):
        assert abs(errors[key]) < 0.01, key
    ttft = data["metrics"]["ttft_p50"]
    front = ttft["live_median"] - ttft["predicted"]
    print(f"  front end at TTFT p50: {_ms(front)}")
    assert 0 <= front < STEP_BASE_S / 2
    for key in ("e2e_p50", "output_throughput"):
        m = data["metrics"][key]
        assert m["live_max"] - m["live_min"] <= 0.01 * m["live_median"], key  # the runs agree
