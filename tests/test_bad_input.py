"""Malformed input to every command: one line naming the field, exit code 2, no traceback.

The table runs the CLI in-process (typer's CliRunner); a few cases run as real processes. The
live commands' cases all fail before any server is contacted (the URL is a closed port, so a
case that reached it would fail with a different line).
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from simcap.cli import app
from simcap.errors import ScenarioError
from simcap.studies.capacity import find_capacity
from simcap.studies.plots import IMAGE_FORMATS, check_figure_path
from simcap.config.scenario import (
    MAX_CLIENTS, MAX_KV_BLOCKS, MAX_NUM_SEQS, MAX_REQUESTS, MAX_SIMULATED_S, MAX_TOKENS,
    MAX_RECORDED_TOKENS, check_limits, expected_requests, parse_scenario,
)
from simcap.fleet.run import simulate

ROOT = Path(__file__).resolve().parents[1]
URL = "http://127.0.0.1:9"  # nothing listens there
URL2 = "http://127.0.0.1:7"  # nor there
SCENARIO = {
    "engine": dict(max_num_seqs=8, max_num_batched_tokens=512, block_size=32, num_gpu_blocks=64,
                   max_model_len=2048),
    "workload": {"arrival": {"process": "poisson", "rate": 2.0}, "num_requests": 10,
                 "input_len": 512, "output_len": 64},
    "slo": {"ttft_p95": 2.0},
}
ZERO_STEP = ["--set", "step_time.base=0", "--set", "step_time.per_prefill_token=0",
             "--set", "step_time.per_decode_token=0"]
CLOSED = ["--set", "workload.arrival={process: closed, concurrency: 4}"]
DURATION = ["--set", "workload.num_requests=null", "--set"]  # + "workload.duration_s=..."
LIVE_CAL = ["live", "calibrate", "--base-url", URL, "--out", "{tmp}/p.yaml", "--max-num-seqs", "4",
            "--max-num-batched-tokens", "64"]
KV = str(ROOT / "examples" / "ascend910b4-kv.yaml")
ESTIMATE = ["--set", "engine.memory.kv_cache_gb=null"]  # the pool from card memory, not measured
MANY = ",".join(str(i) for i in range(400))
SESSIONS = ["--set", "workload.num_requests=null", "--set"]  # + "workload.sessions={...}"

# (args, the field the line must name). {s}: a valid scenario; {csv}: valid step samples;
# {recipe}: a calibration recipe with a negative bootstrap; {file}: a regular file (a path
# under it cannot be made); {tmp}: an empty directory.
CASES = [
    # serve: refused before it listens
    (["serve", "{s}", "--speed", "-1"], "--speed"),
    (["serve", "{s}", "--port", "70000"], "--port"),
    (["serve", "{s}", "--replicas", "0"], "--replicas"),
    (["serve", "{s}", "--tokenizer", "{file}"], "--tokenizer"),
    # score: the profile, the tables, the options
    (["score", "{csv}", "{csv}"], "s.csv: expected a mapping of name, engine, step_time"),
    (["measure-next", "{roofline_recipe}", "--target", "foo c=16", "--candidate", "eagle3 c=8"],
     "'foo c=16': no row of arm 'foo' (arms: eagle3, no-spec)"),
    (["measure-next", "{roofline_recipe}", "--target", "eagle3 c=0", "--candidate", "eagle3 c=8"],
     "'eagle3 c=0': a row label, ARM c=N (N clients) or ARM rate=R"),
    (["measure-next", "{linear_recipe}", "--target", "eagle3 c=16", "--candidate", "eagle3 c=8"],
     "a roofline recipe with datasets is needed"),
    (["measure-next", "{roofline_recipe}", "--target", "eagle3 c=16", "--candidate", "eagle3 c=8",
      "--metrics", ","], "--metrics: at least one metric"),
    (["measure-next", "{roofline_recipe}", "--target", "eagle3 c=16", "--candidate", "eagle3 c=8",
      "--metrics", "tokens"], "--metrics 'tokens': not a metric"),
    (["score", "{profile}", "{csv}", "--input-len", "0"], "--input-len"),
    (["score", "{profile}", "{csv}", "--column", "x=y"], "--column"),
    (["score", "{profile}", "{csv}", "--metrics", "speed"], "--metrics"),
    (["score", "{profile}", "{csv}"], "compares a profile with benchmark results"),
    # simulate: integers, types, finiteness, limits, plot paths
    (["simulate", "{s}", "--set", "engine.num_gpu_blocks=" + "1" * 31], "engine.num_gpu_blocks"),
    (["simulate", "{s}", "--set", "workload.num_requests=1000000000000"], "workload.num_requests"),
    (["simulate", "{s}", "--set", "workload.num_requests=1e12"], "workload.num_requests"),
    (["simulate", "{s}", "--set", "engine.max_num_seqs=true"], "engine.max_num_seqs"),
    (["simulate", "{s}", "--set", "engine.max_model_len='2048'"], "engine.max_model_len"),
    (["simulate", "{s}", "--set", "engine.enable_prefix_caching=1"], "engine.enable_prefix_caching"),
    (["simulate", "{s}", "--set", "workload.arrival.rate=.inf"], "workload.arrival.rate"),
    (["simulate", "{s}", "--set", "workload.arrival.rate=.nan"], "workload.arrival.rate"),
    (["simulate", "{s}", "--set", "step_time.base=1e999"], "step_time.base"),
    (["simulate", "{s}", "--set", "slo.ttft_p95=.inf"], "slo.ttft_p95"),
    (["simulate", "{s}", "--set", "seed=1.5"], "seed"),
    (["simulate", "{s}", "--set", "seed=-1"], "seed"),
    (["simulate", "{s}", "--set", "engine.max_num_batched_tokens=100000000"], "engine.max_num_batched_tokens"),
    (["simulate", "{s}", "--set", "workload.input_len={dist: uniform, low: 1, high: 99999999}"],
     "workload.input_len.high"),
    (["simulate", "{s}", *DURATION, "workload.duration_s=1e9"], "workload.duration_s"),
    (["simulate", "{s}", *DURATION, "workload.duration_s=1e6", "--set", "workload.arrival.rate=100"],
     "workload.duration_s"),
    (["simulate", "{s}", "--set", "workload.arrival.rate=1e-9"], "workload.arrival.rate"),
    (["simulate", "{s}", *CLOSED, *DURATION, "workload.duration_s=10", *ZERO_STEP], "workload.duration_s"),
    (["simulate", "{s}", *CLOSED, *DURATION, "workload.duration_s=9000000", "--set", "workload.output_len=1"],
     "workload.duration_s"),
    (["simulate", "{s}", "--set", "workload.arrival={process: closed, concurrency: 100000000}"],
     "workload.arrival.concurrency"),
    (["simulate", "{s}", "--plot", "{file}/figures"], "--plot"),
    (["simulate", "{s}", "--plot", "{file}"], "--plot"),
    (["simulate", "{s}", "--plot", "{tmp}/figs", "--set", "workload.num_requests=1000000"],
     "workload.num_requests"),
    (["simulate", "{s}", "--bogus"], "--bogus"),
    # simulate: session workloads
    (["simulate", "{s}", "--set", "workload.sessions={num_sessions: 2, turns: 3}"], "workload.num_requests"),
    (["simulate", "{s}", *SESSIONS, "workload.sessions={turns: 3}"], "workload.sessions.num_sessions"),
    (["simulate", "{s}", *SESSIONS, "workload.sessions={num_sessions: 2, turns: 0}"], "workload.sessions.turns"),
    (["simulate", "{s}", *SESSIONS, "workload.sessions={num_sessions: 2, turns: 3, think_time_s: -1}"],
     "workload.sessions.think_time_s"),
    (["simulate", "{s}", *SESSIONS,
      "workload.sessions={num_sessions: 2, turns: 3, think_time_s: {dist: exponential, mean_s: 0}}"],
     "workload.sessions.think_time_s.mean_s"),
    (["simulate", "{s}", *SESSIONS,
      "workload.sessions={num_sessions: 2, turns: 3, think_time_s: {dist: gauss, mean_s: 1}}"],
     "workload.sessions.think_time_s"),
    (["simulate", "{s}", *SESSIONS, "workload.sessions={num_sessions: 2, turns: 3, on_overflow: drop}"],
     "workload.sessions.on_overflow"),
    (["simulate", "{s}", *SESSIONS, "workload.sessions={num_sessions: 2, turns: 3, first_input_len: 2000}"],
     "workload.sessions.first_input_len"),
    (["simulate", "{s}", *SESSIONS, "workload.sessions={num_sessions: 2, turns: 3, bogus: 1}"],
     "workload.sessions.bogus"),
    (["simulate", "{s}", *SESSIONS, "workload.sessions={num_sessions: 2, turns: 3}", "--set",
      "workload.prefix={shared_tokens: 512}"], "workload.prefix.shared_tokens"),
    (["simulate", "{s}", *SESSIONS, "workload.sessions={num_sessions: 2, turns: 3, first_input_len: 1900}",
      "--set", "workload.prefix={shared_tokens: 1800}", "--set", "workload.input_len=200"],
     "workload.prefix.shared_tokens"),
    (["simulate", "{s}", *SESSIONS, "workload.sessions={num_sessions: 9000000, turns: 3}"],
     "workload.sessions.num_sessions"),
    (["simulate", "{s}", *SESSIONS, "workload.sessions={num_sessions: 2, turns: 3}", "--set",
      "workload.duration_s=10"], "workload.sessions.num_sessions"),
    (["simulate", "{s}", "--plot", "{tmp}/figs", *SESSIONS, "workload.sessions={num_sessions: 400000, turns: 3}"],
     "workload.sessions.num_sessions"),
    (["simulate"], "scenario"),
    (["capacity", "{s}", "--rates", "1", *SESSIONS, "workload.sessions={num_sessions: 2, turns: 3}"],
     "workload.sessions"),
    (["crossover", "{s}", "--concurrency", "1", "--set",
      "speculative={method: eagle3, num_speculative_tokens: 3, acceptance_length: 2.5}", *SESSIONS,
      "workload.sessions={num_sessions: 2, turns: 3}"], "workload.sessions"),
    # live sessions: the completions endpoint only (exact token ids); replayed as sessions
    (["live", "run", "{s}", "--base-url", URL, "--endpoint", "chat", *SESSIONS,
      "workload.sessions={num_sessions: 2, turns: 3}"], "workload.sessions"),
    (["live", "validate", "{s}", "--base-url", URL, "--endpoint", "chat", *SESSIONS,
      "workload.sessions={num_sessions: 2, turns: 3}"], "workload.sessions"),
    (["live", "validate", "{s}", "--base-url", URL, "--replay", "closed", *CLOSED, *SESSIONS,
      "workload.sessions={num_sessions: 2, turns: 3}"], "replay"),
    (["live", "validate", "{s}", "--base-url", URL, "--replay", "sessions"], "replay"),
    # kv
    (["kv", "{s}", "--set", "engine.num_gpu_blocks=true"], "engine.num_gpu_blocks"),
    (["kv", KV, "--set", "engine.memory.gpu_memory_utilization=.nan"], "engine.memory.gpu_memory_utilization"),
    (["kv", KV, *ESTIMATE, "--set", "engine.memory.gpu_memory_gb=1e308"], "engine.memory.gpu_memory_gb"),
    (["simulate", KV, *ESTIMATE, "--set", "engine.memory.gpu_memory_gb=1e8", "--set", "engine.block_size=1"],
     "engine.memory"),
    # crossover
    (["crossover", "{s}", "--plot", "{tmp}/x.foo"], "--plot"),
    (["crossover", "{s}", "--plot", "{file}/x.png"], "--plot"),
    (["crossover", "{s}", "--concurrency", "0,2"], "--concurrency"),
    (["crossover", "{s}", "--concurrency", "1", "--rate", "1"], "--rate"),
    (["crossover", "{s}", "--concurrency", "1", "--workers", "0"], "--workers"),
    # capacity
    (["capacity", "{s}", "--rates", "1", "--workers", "0"], "--workers"),
    (["capacity", "{s}", "--rates", "1", "--workers", "-3"], "--workers"),
    (["capacity", "{s}", "--rates", "1", "--workers", "abc"], "--workers"),
    (["capacity", "{s}", "--rates", "1", "--plot", "{file}/sub.png"], "--plot"),
    (["capacity", "{s}", "--rates", "1", "--plot", "{tmp}/cap.foo"], "--plot"),
    (["capacity", "{s}", "--rates", "1", "--duration", "1e9"], "--duration"),
    (["capacity", "{s}", "--rates", "1", "--duration", "nan"], "--duration"),
    (["capacity", "{s}", "--rates", "1e9"], "--rates"),
    (["capacity", "{s}", "--rates", "1:2:100000000"], "--rates"),
    (["capacity", "{s}", "--rates", "1", "--replicates", "0"], "--replicates"),
    (["capacity", "{s}", "--rates", "1", "--interval-sets", "-3"], "--interval-sets"),
    # sweep
    (["sweep", "{s}", "--grid", "seed=1,2", "--workers", "0"], "--workers"),
    (["sweep", "{s}", "--grid", "seed=1,2", "--workers", "-3"], "--workers"),
    (["sweep", "{s}", "--grid", "engine.max_num_seqs=true,2"], "engine.max_num_seqs"),
    (["sweep", "{s}", "--grid", "seed=" + MANY, "--grid", "engine.max_num_seqs=" + MANY[2:]], "--grid"),
    (["sweep", "{s}", "--grid", "seed=1,2", "--backend", "dask"], "--backend"),
    # calibrate
    (["calibrate", "{csv}", "--out", "{tmp}/p.yaml", "--bootstrap", "-3"], "--bootstrap"),
    (["calibrate", "{csv}", "--out", "{tmp}/p.yaml", "--warn-above", "nan"], "--warn-above"),
    (["calibrate", "{csv}", "--out", "{tmp}/p.yaml", "--host-overhead", "-1"], "--host-overhead"),
    (["calibrate", "{csv}", "--out", "{tmp}/p.yaml", "--host-overhead", "inf"], "--host-overhead"),
    (["calibrate", "{csv}", "--out", "{tmp}/p.yaml", "--input-len", "0"], "--input-len"),
    (["calibrate", "{csv}", "--out", "{tmp}/p.yaml", "--num-speculative-tokens", "-1"],
     "--num-speculative-tokens"),
    (["calibrate", "{csv}", "--out", "{tmp}/p.yaml", "--residual-plot", "{tmp}/r.foo"], "--residual-plot"),
    (["calibrate", "{csv}", "--out", "{tmp}/p.yaml", "--residual-plot", "{file}/r.png"], "--residual-plot"),
    (["calibrate", "{csv}", "--out", "{tmp}/p.yaml", "--form", "roofline", "--prior-sd", "0",
      "--hardware", "a800", "--model", "x"], "--prior-sd"),
    (["calibrate", "{csv}", "--out", "{tmp}/p.yaml", "--combine", "max"], "--combine, --routing-skew, --prior-sd"),
    (["calibrate", "{csv}", "--out", "{tmp}/p.yaml", "--prior-sd", "0.5"], "--combine, --routing-skew, --prior-sd"),
    (["calibrate", "{csv}", "--out", "{tmp}/p.yaml", "--form", "roofline", "--efficiency-floor", "1.5",
      "--hardware", "a800", "--model", "x"], "--efficiency-floor: a number from 0 to 1"),
    (["calibrate", "{csv}", "--out", "{tmp}/p.yaml", "--efficiency-floor", "1"],
     "--combine, --routing-skew, --prior-sd, --efficiency-floor"),
    (["calibrate", "{csv}", "--out", "{tmp}/p.yaml", "--rows", "no-spec c=1"], "--rows"),
    (["calibrate", "{csv}", "--out", "{tmp}/p.yaml", "--leave-one-out"], "--leave-one-out: benchmark rows only"),
    (["calibrate", "{csv}"], "--out"),
    (["calibrate", "{recipe}", "--out", "{tmp}/p.yaml"], "r.yaml: bootstrap"),
    # live (each fails before contacting the server)
    (["live", "run", "{s}", "--base-url", URL, "--endpoint", "grpc"], "--endpoint"),
    (["live", "run", "{s}", "--base-url", URL, "--request-timeout", "-1"], "--request-timeout"),
    (["live", "run", "{s}", "--base-url", URL, "--set", "workload.num_requests=1000000000000"],
     "workload.num_requests"),
    (["live", "run", "{s}", "--base-url", URL, "--set", "engine.max_num_seqs=true"], "engine.max_num_seqs"),
    (["live", "run", "{s}"], "--base-url"),
    # several servers: one --base-url per deployment replica
    (["live", "run", "{s}", "--base-url", URL, "--base-url", URL2], "--base-url"),
    (["live", "run", "{s}", "--base-url", URL, "--set", "deployment.replicas=2"], "deployment.replicas is 2"),
    (["live", "run", "{s}", "--base-url", URL, "--base-url", URL2, "--set", "deployment.replicas=3"],
     "deployment.replicas is 3"),
    (["live", "validate", "{s}", "--base-url", URL, "--set", "deployment.replicas=2"], "deployment.replicas is 2"),
    (["live", "validate", "{s}", "--base-url", URL, "--base-url", URL2], "--base-url"),
    (["live", "validate", "{s}", "--base-url", URL, "--base-url", URL2, "--set",
      "deployment={groups: [{replicas: 2}]}"], "deployment"),
    (["live", "validate", "{s}", "--base-url", URL, "--base-url", URL2, "--set", "deployment.replicas=2",
      *CLOSED, "--replay", "closed"], "replay"),
    (["live", "run", "{s}", "--base-url", URL, "--base-url", URL2, "--set", "deployment.replicas=2",
      *SESSIONS, "workload.sessions={num_sessions: 2, turns: 3}"], "deployment: a session workload"),
    (["live", "validate", "{s}", "--base-url", URL, "--base-url", URL2, "--set", "deployment.replicas=2",
      *SESSIONS, "workload.sessions={num_sessions: 2, turns: 3}"], "deployment: a session workload"),
    (["live", "validate", "{s}", "--base-url", URL, "--base-url", URL2, "--set", "deployment.replicas=2",
      "--launch", str(ROOT / "examples" / "servers" / "cpu-tiny.yaml")], "--launch"),
    (["live", "validate", "{s}"], "--base-url"),
    (["live", "validate", "{s}", "--base-url", URL, "--plot", "{tmp}/e.foo"], "--plot"),
    (["live", "validate", "{s}", "--base-url", URL, "--plot", "{file}/e.png"], "--plot"),
    (["live", "validate", "{s}", "--base-url", URL, "--repeats", "0"], "--repeats"),
    (["live", "capacity", "{s}", "--base-url", URL, "--duration", "0"], "--duration"),
    (["live", "capacity", "{s}", "--base-url", URL, "--replicates", "0"], "--replicates"),
    (["live", "capacity", "{s}", "--base-url", URL, "--auto", "--rates", "1,2"], "--auto and --rates"),
    (["live", "capacity", "{s}", "--base-url", URL, "--slo", "ttft_p95=fast"], "slo.ttft_p95"),
    (["live", "capacity", "{s}", "--base-url", URL, "--plot", "{tmp}/c.foo"], "--plot"),
    (["live", "capacity", "{s}", "--base-url", URL, "--max-points", "0"], "--max-points"),
    (["live", "capacity", "{s}", "--base-url", URL, *CLOSED], "workload.arrival"),
    (["live", "capacity", "{s}", "--base-url", URL, "--predict", "{tmp}/none.yaml"], "none.yaml"),
    ([*LIVE_CAL, "--form", "exponential"], "--form"),
    ([*LIVE_CAL, "--form", "roofline", "--hardware", "a800", "--roofline-model", "x"], "--log"),
    ([*LIVE_CAL, "--requests", "3"], "--requests"),
    ([*LIVE_CAL, "--bootstrap", "-1"], "--bootstrap"),
    ([*LIVE_CAL, "--request-timeout", "-5"], "--request-timeout"),
    ([*LIVE_CAL, "--seed", "-1"], "--seed"),
    ([*LIVE_CAL, "--noise", "gauss"], "--noise"),
    (["no-such-command"], "no-such-command"),
    # fleets: replica counts, routers, weights, groups
    (["simulate", "{s}", "--set", "deployment.replicas=0"], "deployment.replicas"),
    (["simulate", "{s}", "--set", "deployment.replicas=-2"], "deployment.replicas"),
    (["simulate", "{s}", "--set", "deployment.replicas=1.5"], "deployment.replicas"),
    (["simulate", "{s}", "--set", "deployment.router=fastest"], "known: roundrobin, least_request"),
    (["simulate", "{s}", "--set", "deployment={router: prefix_cache, weights: {prefix_cache: lots}}"],
     "deployment.weights.prefix_cache"),
    (["simulate", "{s}", "--set", "deployment={router: prefix_cache, weights: {prefix_cache: -1}}"],
     "deployment.weights.prefix_cache"),
    (["simulate", "{s}", "--set", "deployment={router: prefix_cache, weights: {load: 1}}"],
     "deployment.weights.load"),
    (["simulate", "{s}", "--set", "deployment={router: prefix_cache, weights: [1, 2]}"],
     "deployment.weights"),
    (["simulate", "{s}", "--set", "deployment={router: roundrobin, weights: {queue: 1}}"],
     "deployment.weights"),
    (["simulate", "{s}", "--set", "deployment.scrape_interval_s=0"], "deployment.scrape_interval_s"),
    (["simulate", "{s}", "--set", "deployment={groups: [{replicas: 0}]}"], "deployment.groups.0.replicas"),
    (["simulate", "{s}", "--set", "deployment={groups: [{replicas: 1, engine: {max_num_seqs: -1}}]}"],
     "deployment.groups.0.engine.max_num_seqs"),
    (["simulate", "{s}", "--set", "deployment={replicas: 3, groups: [{replicas: 1}]}"],
     "deployment.replicas"),
    (["simulate", "{s}", "--compare-router", "roundrobin"], "--compare-router"),
    (["simulate", str(ROOT / "examples" / "chat-sessions.yaml"), "--set", "deployment.replicas=2"],
     "deployment: a session workload"),
    (["simulate", "{s}", "--set", "deployment={disaggregated: {prefill: {replicas: 1}, decode: "
      "{replicas: 1}, kv_transfer: {latency_s: 0.001, kv_bytes_per_token: 1000}}}"],
     "deployment.disaggregated.kv_transfer.bandwidth_gbps"),
    (["simulate", "{s}", "--set", "deployment={disaggregated: {prefill: {replicas: 1}, decode: "
      "{replicas: 1}}}"], "deployment.disaggregated.kv_transfer"),
    (["simulate", "{s}", "--set", "deployment={disaggregated: {prefill: {replicas: 1}, decode: "
      "{replicas: 1}, kv_transfer: {bandwidth_gbps: 0, kv_bytes_per_token: 1000}}}"],
     "deployment.disaggregated.kv_transfer.bandwidth_gbps"),
    (["simulate", "{s}", "--set", "deployment={disaggregated: {prefill: {replicas: 1}, decode: "
      "{replicas: 1}, kv_transfer: {bandwidth_gbps: 10}}}"],
     "deployment.disaggregated.kv_transfer.kv_bytes_per_token"),
    (["simulate", "{s}", "--set", "deployment={disaggregated: {prefill: {replicas: 0}, decode: "
      "{replicas: 1}, kv_transfer: {bandwidth_gbps: 10, kv_bytes_per_token: 1000}}}"],
     "deployment.disaggregated.prefill.replicas"),
    (["simulate", "{s}", "--set", "deployment={replicas: 2, disaggregated: {prefill: {replicas: 1}, "
      "decode: {replicas: 1}, kv_transfer: {bandwidth_gbps: 10, kv_bytes_per_token: 1000}}}"],
     "deployment.disaggregated"),
    (["simulate", "{s}", "--set", "deployment={disaggregated: {prefill: {replicas: 1, engine: "
      "{block_size: 0}}, decode: {replicas: 1}, kv_transfer: {bandwidth_gbps: 10, "
      "kv_bytes_per_token: 1000}}}"], "deployment.disaggregated.prefill.engine.block_size"),
    (["simulate", "{s}", "--set", "engine.num_gpu_blocks=9000000", "--set", "deployment.replicas=2"],
     "deployment.replicas"),
    (["capacity", "{s}", "--replicas", "0"], "--replicas"),
    (["capacity", "{s}", "--replicas", "-3"], "--replicas"),
    (["capacity", "{s}", "--router", "least_request"], "--router"),
    (["capacity", "{s}", "--replicas", "2", "--router", "nearest"], "known: roundrobin"),
    (["fleet", "{s}", "--target-rate", "0"], "--target-rate"),
    (["fleet", "{s}", "--target-rate", "-5"], "--target-rate"),
    (["fleet", "{s}", "--target-rate", "5", "--router", "roundrobin,nearest"], "known: roundrobin"),
    (["fleet", "{s}", "--target-rate", "5", "--price-per-replica-hour", "-1"], "--price-per-replica-hour"),
    (["fleet", "{s}", "--target-rate", "5", "--max-replicas", "0"], "--max-replicas"),
    (["fleet", "{s}", "--target-rate", "5", "--backend", "mpi"], "--backend"),
    (["fleet", "{s}", "--target-rate", "5", "--disaggregated"], "deployment.disaggregated"),
    (["fleet", "{s}", "--target-rate", "5", "--disaggregated", "--router", "roundrobin"], "--router"),
    (["fleet", "{s}", "--target-rate", "5", "--slo", "ttft_p95=-1"], "ttft_p95"),
    (["fleet", "{s}", "--target-rate", "5", "--set", "deployment={groups: [{replicas: 1}]}"],
     "deployment.groups"),
    # traces (workload.trace): not the format, bad rows, too long, options
    (["simulate", "{t}", "--set", "workload.trace.format=mooncake"], "is not a mooncake trace: expected"),
    (["simulate", "{t}", "--set", "workload.trace.path={s}"], "expected CSV columns TIMESTAMP,ContextTokens"),
    (["simulate", "{t}", "--set", "workload.trace.path=neg.csv"], "line 3: ContextTokens is -4, negative"),
    (["simulate", "{t}", "--set", "workload.trace.path=neg.csv", "--set", "workload.trace.on_bad_row=halt"],
     "workload.trace.on_bad_row"),
    (["simulate", "{t}", "--set", "engine.max_model_len=300"], "exceed engine.max_model_len (300)"),
    (["simulate", "{t}", "--set", "workload.trace.path=nothing.csv"], "workload.trace.path"),
    (["simulate", "{t}", "--set", "workload.trace.format=csv"], "workload.trace.format"),
    (["simulate", "{t}", "--speedup", "0"], "workload.trace.speedup"),
    (["simulate", "{t}", "--trace-start", "1e6"], "workload.trace.start_s"),
    (["simulate", "{t}", "--trace-requests", "-1"], "workload.trace.num_requests"),
    (["simulate", "{t}", "--set", "workload.input_len=5"], "workload.input_len"),
    (["simulate", "{t}", "--set", "workload.trace.format=sharegpt"], "workload.arrival"),
    (["simulate", "{s}", "--speedup", "2"], "workload.trace"),
    (["capacity", "{t}", "--rates", "1"], "workload.trace"),
    (["live", "capacity", "{t}", "--base-url", URL, "--rates", "1"], "workload.trace: capacity searches"),
    (["live", "run", "{t}", "--base-url", URL, "--set", "workload.trace.format=burstgpt"],
     "is not a burstgpt trace"),
]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    scenario = root / "s.yaml"
    scenario.write_text(yaml.safe_dump(SCENARIO))
    rows = ["num_prefill_tokens,num_decode_tokens,step_time_s"]
    rows += [f"{p},{d},{0.004 + 1e-5 * p + 3e-4 * d}" for p in (0, 128, 512) for d in (1, 8, 16)]
    samples = root / "s.csv"
    samples.write_text("\n".join(rows) + "\n")
    recipe = root / "r.yaml"
    recipe.write_text("name: r\nbootstrap: -3\ndatasets: []\n")
    regular = root / "regular"
    regular.write_text("a file, not a directory\n")
    (root / "t.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,44\n"
                                "2023-11-16 18:15:47.12,396,109\n")
    (root / "neg.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,44\n"
                                  "2023-11-16 18:15:47.12,-4,109\n")
    trace = root / "trace.yaml"
    trace.write_text(yaml.safe_dump({**SCENARIO, "workload": {"trace": {"format": "azure", "path": "t.csv"}}}))
    return {"s": str(scenario), "csv": str(samples), "file": str(regular), "recipe": str(recipe),
            "t": str(trace), "profile": str(ROOT / "calibration" / "profiles" / "a800-minimax-m3.yaml"),
            "roofline_recipe": str(ROOT / "calibration" / "recipes" / "a800-minimax-m3.roofline.yaml"),
            "linear_recipe": str(ROOT / "calibration" / "recipes" / "a800-minimax-m3.yaml")}


def test_the_table_covers_every_command():
    assert len(CASES) >= 40
    commands = {args[0] if args[0] != "live" else " ".join(args[:2]) for args, _ in CASES}
    assert commands >= {"simulate", "kv", "crossover", "capacity", "sweep", "calibrate", "fleet", "serve",
                        "score", "measure-next", "live run", "live validate", "live calibrate", "live capacity"}


@pytest.mark.parametrize("args,field", CASES, ids=lambda v: " ".join(v)[:70] if isinstance(v, list) else v)
def test_malformed_input_is_one_line_naming_the_field(paths, tmp_path, args, field):
    fill = {**paths, "tmp": str(tmp_path)}
    argv = []
    for arg in args:
        for key, value in fill.items():
            arg = arg.replace("{" + key + "}", value)
        argv.append(arg)
    res = CliRunner().invoke(app, argv)
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    assert isinstance(res.exception, SystemExit), res.exception  # no exception escaped
    assert res.stdout == "", res.stdout
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error: ") and field in lines[0], lines[0]
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "p.yaml").exists()  # nothing written


@pytest.mark.parametrize(
    "args,field",
    [
        (["simulate", "examples/chat.yaml", "--set", "engine.num_gpu_blocks=" + "1" * 31], "engine.num_gpu_blocks"),
        (["capacity", "examples/chat.yaml", "--rates", "1", "--plot", "README.md/cap.png"], "--plot"),
        (["calibrate", "x.csv", "--out", "p.yaml", "--bootstrap", "-3"], "--bootstrap"),
    ],
)
def test_as_a_process(args, field):
    proc = subprocess.run([sys.executable, "-m", "simcap", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and field in lines[0] and "Traceback" not in proc.stderr, proc.stderr


# --------------------------------------------------------------------------- the library


def test_image_formats_are_ones_matplotlib_writes():
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    supported = FigureCanvasAgg(Figure()).get_supported_filetypes()
    assert {f.lstrip(".") for f in IMAGE_FORMATS} <= set(supported)


def test_figure_paths(tmp_path):
    assert check_figure_path(tmp_path / "new" / "deeper" / "f.PNG", "--plot").name == "f.PNG"
    assert check_figure_path(tmp_path / "figs", "--plot", directory=True) == tmp_path / "figs"
    (tmp_path / "f").write_text("")
    for path, directory in ((tmp_path / "f" / "x.png", False), (tmp_path / "x", False),
                            (tmp_path / "f", True), (tmp_path / "f" / "d", True), (tmp_path, False)):
        with pytest.raises(Exception, match="^--plot "):
            check_figure_path(path, "--plot", directory=directory)


def scenario(**workload):
    data = {**SCENARIO, "workload": {**SCENARIO["workload"], **workload}}
    return parse_scenario(data, check=False)


def test_limits_are_checked_up_front_in_the_library():
    # capacity builds its runs with model_copy (no validation): simulate checks them itself
    s = scenario(num_requests=None, duration_s=100.0)
    huge = s.model_copy(update={"workload": s.workload.model_copy(update={"duration_s": 1e7})})
    assert expected_requests(huge) == pytest.approx(2e7)
    with pytest.raises(ScenarioError, match=r"^workload\.duration_s: .*10,000,000 requests"):
        simulate(huge)
    check_limits(s)
    assert expected_requests(s) == pytest.approx(200.0)
    with pytest.raises(ScenarioError, match="^workload.num_requests: .*keep chunk by chunk"):
        simulate(scenario(num_requests=MAX_RECORDED_TOKENS // 64 + 1), records=True)


def test_closed_loop_bound_uses_the_shortest_request():
    s = scenario(arrival={"process": "closed", "concurrency": 2, "think_time_s": 1.0},
                 num_requests=None, duration_s=100.0, output_len=10)
    # each request: >= 1 s of think time + 10 steps of >= base (0.004 s)
    assert expected_requests(s) == pytest.approx(2 * (100.0 / 1.04 + 1))
    zero = scenario(arrival={"process": "closed", "concurrency": 2}, num_requests=None, duration_s=1.0)
    zero = zero.model_copy(update={"step_time": zero.step_time.model_copy(update={"base": 0.0})})
    assert math.isinf(expected_requests(zero))


def test_library_refuses_worker_counts():
    with pytest.raises(ScenarioError, match=r"^--workers: .*\(got 0\)"):
        find_capacity(scenario(), rates=[1.0], workers=0, interval=False)


def test_readme_states_the_limits():
    text = (ROOT / "README.md").read_text()
    for value in (f"{MAX_REQUESTS:,}", f"{MAX_SIMULATED_S:.0e}", f"{MAX_KV_BLOCKS:,}", f"{MAX_TOKENS:,}",
                  f"{MAX_NUM_SEQS:,}", f"{MAX_CLIENTS:,}", f"{MAX_RECORDED_TOKENS:,}"):
        assert value in text, value


def test_empirical_lengths_parse_and_are_checked(tmp_path):
    # The workload's shorthand step runs before validation; strict validation still takes the
    # list of an inline (or file) empirical length, and still names a bad entry.
    from tests.conftest import make_scenario

    sc = make_scenario(workload=dict(input_len={"dist": "empirical", "values": [16, 64]}))
    assert sc.workload.input_len.values == (16, 64)
    with pytest.raises(ScenarioError, match=r"^workload.input_len.values.0: input should be a valid integer"):
        make_scenario(workload=dict(input_len={"dist": "empirical", "values": [True, 64]}))
