"""Live mode against a REAL vLLM CPU server (``pytest -m live tests/live``)."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from simcap.live.client import run_live
from simcap.live.hostload import autogroup
from tests.live.conftest import wait_idle
from simcap.live.validate import METRICS, validate
from simcap.metrics.records import RequestRecord

pytestmark = pytest.mark.live

OUT = 32


def _closed(n, concurrency=4, low=64, high=256, out=OUT, prefix=None):
    wl = dict(arrival={"process": "closed", "concurrency": concurrency}, num_requests=n,
              input_len={"dist": "uniform", "low": low, "high": high}, output_len=out)
    if prefix:
        wl["prefix"] = prefix
    return wl


def test_closed_loop_exact_tokens_and_server_counters(base_url, scenario_for, tmp_path):
    sc = scenario_for(_closed(16, prefix={"shared_tokens": 48, "num_prefixes": 2}), seed=1)
    out = tmp_path / "run.jsonl"
    run = run_live(sc, base_url, "tiny", out_path=out, progress=False)

    assert len(run.records) == 16
    for rec in run.records:
        assert rec.succeeded, rec.error
        assert rec.num_output_tokens == OUT and rec.finish_reason == "length"
        assert rec.num_prompt_tokens == run.specs[rec.request_id].num_prompt_tokens  # exact prompts
        assert rec.arrival_time < rec.chunk_times[0] <= rec.finish_time == rec.chunk_times[-1]
        assert all(n >= 1 for n in rec.chunk_tokens)
    assert run.token_fixups == []
    # Client totals agree exactly with the server's counters over the run.
    check = run.cross_check()
    assert check["server_prompt_tokens"] == sum(r.num_prompt_tokens for r in run.records)
    assert check["prompt_tokens_rel_diff"] == 0.0
    assert check["generation_tokens_rel_diff"] == 0.0
    assert check["server_generation_tokens"] == 16 * OUT
    assert check["requests_rel_diff"] == 0.0
    delta = run.server_delta()
    assert delta["num_preemptions"] == 0
    # Shared 48-token prefixes (one full 32-token block each) hit the prefix cache live.
    assert delta["prefix_cache_hits"] > 0
    assert delta["cache_config"]["block_size"] == "32"
    # The JSONL file has every record, and they parse back to the same records.
    back = [RequestRecord.from_dict(json.loads(line)) for line in out.read_text().splitlines()]
    assert sorted(back, key=lambda r: r.request_id) == run.records
    summary = run.summary()
    assert summary.completed == 16 and summary.output_tokens == 16 * OUT
    assert summary.ttft_s.p50 > 0 and summary.itl_s.count == sum(len(r.chunk_times) - 1 for r in run.records)
    json.dumps(run.to_dict(), allow_nan=False)


def test_open_loop_reports_achieved_vs_requested_rate(base_url, scenario_for):
    rate = 3.0
    sc = scenario_for(dict(arrival={"process": "poisson", "rate": rate}, num_requests=12,
                           input_len={"dist": "uniform", "low": 64, "high": 192}, output_len=16), seed=2)
    run = run_live(sc, base_url, "tiny", progress=False)
    assert all(r.succeeded for r in run.records)
    assert run.requested_rate == rate
    assert run.scheduled_rate is not None and run.achieved_rate is not None
    # Sends follow the drawn schedule: the achieved rate is the schedule's, within 10 %.
    assert run.achieved_rate == pytest.approx(run.scheduled_rate, rel=0.10)
    # (The client shares 2 cores with the server: its event loop is sometimes late by ~0.1 s.)
    assert run.max_send_lag_s < 0.25
    sends = sorted(r.arrival_time for r in run.records)
    assert sends[0] < 0.05
    data = run.to_dict()
    assert data["live"]["requested_rate"] == rate and data["live"]["achieved_rate"] == run.achieved_rate


def test_chat_endpoint_counts_prompt_from_usage(base_url, scenario_for):
    sc = scenario_for(_closed(4, concurrency=2, out=8), seed=3)
    run = run_live(sc, base_url, "tiny", endpoint="chat", progress=False)
    for rec in run.records:
        assert rec.succeeded, rec.error
        assert rec.num_output_tokens == 8
        assert rec.num_prompt_tokens > 0
    assert run.cross_check()["prompt_tokens_rel_diff"] == 0.0
    assert any("chat endpoint" in n for n in run.notes)


def _live_command() -> list[str]:
    """``simcap live`` when the main CLI mounts it, else the same app as a module."""
    exe = shutil.which("simcap")
    if exe:
        probe = subprocess.run([exe, "live", "--help"], capture_output=True, text=True)
        if probe.returncode == 0:
            return [exe, "live"]
    return [sys.executable, "-m", "simcap", "live"]



@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["crash", "ctrl-c"])
def test_records_survive_a_killed_run(base_url, scenario_for, tmp_path, sig):
    sc = scenario_for(_closed(200, concurrency=2, low=32, high=96, out=OUT), seed=4)
    scenario_file = tmp_path / "scenario.yaml"
    scenario_file.write_text(yaml.safe_dump(sc.model_dump(mode="json", exclude_none=True)))
    out = tmp_path / "run.jsonl"
    cmd = [*_live_command(), "run", "--base-url", base_url, "--model", "tiny", str(scenario_file),
           "--out", str(out), "--no-progress"]
    # A terminal's Ctrl-C reaches a process whose SIGINT has its default disposition; a shell
    # running this suite in the background hands its children SIGINT ignored, so restore it.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists() and out.read_text().count("\n") >= 5:
                break
            time.sleep(0.1)
        assert proc.poll() is None, f"run ended early: {proc.communicate()}"
        os.kill(proc.pid, sig)  # SIGKILL: a crash, no cleanup runs; SIGINT: Ctrl-C
        _, err = proc.communicate(timeout=30)
        if sig == signal.SIGINT:
            assert proc.returncode == 130 and "interrupted" in err, err
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
    text = out.read_text()
    lines = text.splitlines()
    assert len(lines) >= 5
    # Every line written is complete (a record is one write + flush) and parses.
    assert text.endswith("\n")
    for line in lines:
        rec = RequestRecord.from_dict(json.loads(line))
        assert rec.succeeded and rec.num_output_tokens == OUT
    assert len(lines) < 200
    wait_idle(base_url)


def test_validate_compares_every_metric(base_url, scenario_for, tmp_path):
    sc = scenario_for(_closed(12, concurrency=4, out=16, prefix={"shared_tokens": 40, "num_prefixes": 2}), seed=5)
    result = validate(sc, base_url, "tiny", repeats=2, warmup=False, out_prefix=str(tmp_path / "rep"))
    data = result.to_dict()
    json.dumps(data, allow_nan=False)
    assert len(data["repeats"]) == 2
    assert set(data["metrics"]) == set(METRICS)
    for key, m in data["metrics"].items():
        assert len(m["live"]) == 2 and all(v is not None and v > 0 for v in m["live"]), key
        assert m["predicted"] is not None and m["predicted"] > 0, key
        assert m["live_min"] <= m["live_median"] <= m["live_max"]
        assert m["rel_error"] == pytest.approx((m["predicted"] - m["live_median"]) / m["live_median"])
        assert m["in_range"] == (m["live_min"] <= m["predicted"] <= m["live_max"])
    for name in ("ttft", "itl"):
        ks = data["ks"][name]
        assert 0.0 <= ks["statistic"] <= 1.0 and ks["live_n"] > 0 and ks["sim_n"] > 0
        # (ITL counts may differ: vLLM merges a request's outputs of two steps into one chunk
        # when its stream lags, which the simulator does not model.)
    for rep in data["repeats"]:
        assert rep["prefix_cache_reset"] == "ok"
        assert rep["cpu"]["available"] and "foreign_cpu_s" in rep["cpu"]
        assert rep["completed"] == 12 and rep["cross_check"]["generation_tokens_rel_diff"] == 0.0
        assert (tmp_path / f"rep{rep['index']}.jsonl").read_text().count("\n") == 12
    # The simulation used the server's KV cache shape.
    assert data["simulated_engine"]["block_size"] == 32
    assert not math.isnan(data["metrics"]["ttft_p50"]["predicted"])


def test_the_saturation_probe_drives_the_engine_as_an_overloaded_open_loop(vllm_server, base_url, scenario_for):
    """``--rate-of-saturation``'s probe claims the rate an overloaded open loop of the same
    request mix completes at. Sent at 1.5x that rate, the open loop must keep the engine's
    batch full as the probe's closed loop did (the median step's), and complete as many
    requests per engine step. Per second the two differ by the engine's speed, which moves by 10-40% between runs
    on this shared host: each rate is read per step, through the mean logged time of the run's full-batch
    steps (the rates are read while the batch is full; the ramp's and the drain's smaller, faster steps,
    whose share differs between the two runs, are left out of both)."""
    from simcap.calibrate.readers import parse_iteration_log
    from simcap.live.recording import iteration_lines, log_size, read_log_window
    from simcap.live.saturation import at_fraction, measure_saturation, steady_completion_rate

    log = Path(vllm_server.log_path)
    workload = dict(arrival={"process": "poisson", "rate": 1.0}, num_requests=128,
                    input_len={"dist": "uniform", "low": 64, "high": 256}, output_len=16)
    sc = scenario_for(workload, seed=9)

    def steps_of(offset):
        rows = parse_iteration_log(iteration_lines(read_log_window(log, offset)), 0)
        batch = np.median([r["num_reqs"] for r in rows])
        return batch, np.mean([r["step_time_s"] for r in rows if r["num_reqs"] == batch])

    offset = log_size(log)
    probe = measure_saturation(sc, base_url, "tiny", "completions")
    probe_batch, probe_step = steps_of(offset)
    assert probe.clients == 16 and probe.requests == 96 == probe.completed
    wait_idle(base_url)
    offset = log_size(log)
    run = run_live(at_fraction(sc, 1.5, probe), base_url, "tiny", progress=False)
    open_batch, open_step = steps_of(offset)
    assert run.requested_rate == pytest.approx(1.5 * probe.rate) and all(r.succeeded for r in run.records)
    done, _, _ = steady_completion_rate([r.finish_time for r in run.records], 8)
    print(f"\nprobe {probe.rate:.2f} req/s, batch {probe_batch:.2f}, step {probe_step * 1e3:.1f} ms; "
          f"open loop at 1.5x: {done:.2f} req/s, batch {open_batch:.2f}, step {open_step * 1e3:.1f} ms")
    assert probe_batch == open_batch == 8  # most steps run a full batch (max_num_seqs)
    assert abs((probe.rate * probe_step) / (done * open_step) - 1) < 0.1


def test_validate_sends_a_point_at_a_fraction_of_each_instances_saturation(base_url, scenario_for):
    """The plumbing of ``--rate-of-saturation``: the probe's result in the JSON and notes, the
    runs sent at the fraction of it, each run's notes saying why."""
    workload = dict(arrival={"process": "poisson", "rate": 50.0}, num_requests=16,
                    input_len={"dist": "uniform", "low": 64, "high": 256}, output_len=16)
    result = validate(scenario_for(workload, seed=10), base_url, "tiny", repeats=1, warmup=False,
                      rate_of_saturation=0.5)
    data = result.to_dict()
    (probe,) = data["saturation"]
    assert probe["instance"] == 0 and probe["fraction"] == 0.5 and probe["rate_sent"] == pytest.approx(0.5 * probe["rate"])
    line = f"rate {probe['rate_sent']:.3g} req/s: 0.5 x this server instance's saturation rate {probe['rate']:.3g} req/s"
    assert f"server instance 0: {line}" in " ".join(data["notes"])
    run = result.repeats[0].live
    assert run.requested_rate == pytest.approx(probe["rate_sent"]) and any(n.startswith(line) for n in run.notes)
    assert data["repeats"][0]["completed"] == 16 and data["repeats"][0]["requested_rate"] == run.requested_rate


def test_the_server_shares_the_load_generators_scheduling_group(vllm_server):
    """A server simcap starts runs in its own process group but in the starting process's
    session: where Linux groups tasks by session (autogroup), a session of its own let vLLM's
    spinning engine core hold the load generator 50 ms to 1 s at a time (simcap.live.server)."""
    server = vllm_server.proc.pid
    assert os.getpgid(server) == server != os.getpgid(0)  # its own process group, for stop()
    assert os.getsid(server) == os.getsid(0)
    if autogroup("self") is None:
        pytest.skip("this kernel does not group tasks by session")
    assert autogroup(server) == autogroup("self")
