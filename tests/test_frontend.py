"""The front end (simcap.simulation.frontend) against hand-computed times, and its fit
(simcap.live.frontend_fit) against hand-made runs."""

from __future__ import annotations

import pytest

from simcap.errors import ScenarioError
from simcap.fleet.run import simulate
from simcap.live.client import LiveRun
from simcap.live.frontend_fit import fit_frontend, max_in_flight, run_figures
from simcap.live.prom import ServerMetrics
from simcap.metrics.records import RequestRecord
from simcap.workloads.requests import RequestSpec
from tests.conftest import make_scenario

FE = {"arrival_s": 0.005, "output_s": 0.002, "per_chunk_s": 0.001}
# Every step 10 ms, whatever it runs.
FLAT = {"base": 0.01, "per_prefill_token": 0.0, "per_decode_token": 0.0, "host_overhead": 0.0}


def spec(i: int, prompt: int, out: int) -> RequestSpec:
    return RequestSpec(i, prompt, out, ((-1 - i, prompt),))


def run(trace, frontend=FE, fast=True, **workload):
    scenario = make_scenario(step_time=FLAT, frontend=frontend,
                             engine={"async_scheduling": False}, **({"workload": workload} if workload else {}))
    return simulate(scenario, trace, fast=fast, records=True)


@pytest.mark.parametrize("fast", [True, False])
def test_one_request_sees_arrival_and_output_delays(fast):
    """Sent at 0, it reaches the engine at 5 ms; its steps end at 15, 25, 35 ms, each with one
    chunk, seen 2 + 1 x 1 ms later."""
    rec = run([(0.0, spec(0, 16, 3))], fast=fast).records[0]
    assert rec.arrival_time == 0.0
    assert rec.scheduled_time == pytest.approx(0.005)
    assert rec.chunk_times == pytest.approx([0.018, 0.028, 0.038])
    assert rec.finish_time == pytest.approx(0.038)


@pytest.mark.parametrize("fast", [True, False])
def test_a_step_delivers_later_the_more_chunks_it_emits(fast):
    """Two requests at 0 share every step (2 chunks: 2 + 2 x 1 = 4 ms late) until request 0's
    second token ends it; request 1's later steps emit one chunk (3 ms late), so its gap
    across that change is 10 - 1 = 9 ms."""
    res = run([(0.0, spec(0, 16, 2)), (0.0, spec(1, 16, 4))], fast=fast)
    r0, r1 = res.records
    assert r0.chunk_times == pytest.approx([0.019, 0.029])
    assert r1.chunk_times == pytest.approx([0.019, 0.029, 0.038, 0.048])
    assert res.summary.ttft_s.p50 == pytest.approx(0.019)


@pytest.mark.parametrize("fast", [True, False])
def test_a_closed_loop_client_sends_after_it_saw_the_last_chunk(fast):
    scenario = make_scenario(step_time=FLAT, frontend=FE, engine={"async_scheduling": False},
                             workload={"arrival": {"process": "closed", "concurrency": 1},
                                       "num_requests": 3, "input_len": 16, "output_len": 3})
    recs = simulate(scenario, fast=fast, records=True).records
    for before, after in zip(recs, recs[1:]):
        assert after.arrival_time == before.finish_time
    # Each cycle: 5 ms to the engine, three 10 ms steps, 3 ms to the client.
    assert recs[2].finish_time == pytest.approx(3 * 0.038)


def test_no_front_end_is_the_engine_alone():
    """No section, an explicit null and all-zero terms give the same bytes; the scenario's
    digest does not change with a front end left out."""
    trace = [(0.0, spec(0, 40, 20)), (0.004, spec(1, 300, 9))]
    plain = make_scenario(step_time=FLAT)
    outs = [simulate(make_scenario(step_time=FLAT, **extra), trace, records=True)
            for extra in ({}, {"frontend": None}, {"frontend": {}})]
    assert outs[0].records == outs[1].records == outs[2].records
    assert outs[0].summary.to_dict() == outs[2].summary.to_dict()
    assert make_scenario(step_time=FLAT, frontend=None).digest() == plain.digest()
    assert "frontend" not in outs[0].provenance
    shifted = simulate(make_scenario(step_time=FLAT, frontend=FE), trace)
    assert shifted.provenance["frontend"] == FE
    assert shifted.summary.ttft_s.mean > outs[0].summary.ttft_s.mean


def test_bad_front_end_is_one_line():
    with pytest.raises(ScenarioError, match=r"frontend\.arrival_s"):
        make_scenario(frontend={"arrival_s": -1.0})
    with pytest.raises(ScenarioError, match=r"frontend\.queue_s"):
        make_scenario(frontend={"queue_s": 0.1})
    with pytest.raises(ScenarioError, match="frontend: modelled for one engine"):
        make_scenario(frontend=FE, deployment={"replicas": 2, "router": "roundrobin"})


# --------------------------------------------------------------------------- the fit


def _metrics(ttft: float, queue: float, prefill: float, n: int) -> tuple[ServerMetrics, ServerMetrics]:
    names = ("vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds",
             "vllm:request_prefill_time_seconds")
    before = ServerMetrics(time=0.0, histogram_sum={k: 0.0 for k in names},
                           histogram_count={k: 0.0 for k in names})
    after = ServerMetrics(time=10.0, histogram_sum=dict(zip(names, (ttft * n, queue * n, prefill * n))),
                          histogram_count={k: float(n) for k in names})
    return before, after


def _run(client_ttft: float, server: tuple[float, float, float], concurrent: bool) -> LiveRun:
    """Four requests with the given client TTFT, one at a time or two at a time."""
    records = []
    for i in range(4):
        start = (i // 2 if concurrent else i) * 1.0
        rec = RequestRecord(i, start, 16, 2, chunk_times=[start + client_ttft, start + 0.5],
                            chunk_tokens=[1, 1], finish_time=start + 0.5, finish_reason="length")
        records.append(rec)
    before, after = _metrics(*server, 4)
    return LiveRun(records=records, specs={}, base_url="http://server", model="m", endpoint="completions",
                   closed_loop=True, requested_rate=None, scheduled_rate=None, achieved_rate=1.0,
                   wall_duration_s=4.0, max_send_lag_s=None, metrics_before=before, metrics_after=after)


def _line(i: int, prefills: int, decodes: int) -> str:
    return (f"Engine 000: Iteration({i}): {prefills} context requests, {16 * prefills} context tokens, "
            f"{decodes} generation requests, {decodes} generation tokens, iteration elapsed time: "
            "5.00 ms, CPU KV cache usage: 0.1%")


def test_fit_takes_arrival_from_lone_requests_and_the_slope_from_batches():
    """A run one request at a time: client - server 4 ms, server - queue - prefill 3 ms; its
    first-token steps emit 1 chunk. A run two at a time whose first-token steps emit 5 chunks
    (1 prefill + 4 decodes): client - server 8 ms. So arrival 3 ms, and 4 ms = output + 1 x
    per chunk, 8 ms = output + 5 x per chunk: output 3 ms, 1 ms per chunk."""
    lone = _run(0.050, (0.046, 0.001, 0.042), concurrent=False)
    busy = _run(0.090, (0.082, 0.010, 0.050), concurrent=True)
    assert max_in_flight(lone) == 1 and max_in_flight(busy) == 2
    fit = fit_frontend([(lone, [_line(0, 1, 0), _line(1, 0, 1)]),
                        (busy, [_line(0, 1, 4), _line(1, 0, 5)])])
    assert fit.config == pytest.approx({"arrival_s": 0.003, "output_s": 0.003, "per_chunk_s": 0.001})
    assert [r.chunks_per_first_token_step for r in fit.runs] == [1.0, 5.0]


def test_fit_needs_a_lone_run_and_a_spread_of_batches():
    busy = _run(0.090, (0.082, 0.010, 0.050), concurrent=True)
    fit = fit_frontend([(busy, [_line(0, 1, 4)])])
    assert fit.config is None and "no run had one request in flight" in fit.notes[0]
    lone = _run(0.050, (0.046, 0.001, 0.042), concurrent=False)
    fit = fit_frontend([(lone, [_line(0, 1, 0)])])
    assert fit.config == pytest.approx({"arrival_s": 0.003, "output_s": 0.004, "per_chunk_s": 0.0})
    assert "not identified" in fit.notes[0]


def test_a_closed_loops_first_wave_is_left_out_where_the_run_scraped_after_it():
    """Two clients, four requests. The first wave (0 and 1) came as a burst: its server TTFT
    is 60 ms against the client's 90 (client - server 30 ms); the later two's is 82 ms (8 ms).
    The first-wave scrape counted the wave's two first tokens, so the run's figures are the
    later requests': 8 ms at 5 chunks per first-token step (the steps from the first one that
    prefilled nothing: one prefill beside four decodes). Without the scrape: the mean over all
    four, 19 ms, at (2 x 2 + 1 x 5) / 3 = 3 chunks."""
    busy = _run(0.090, (0.071, 0.010, 0.050), concurrent=True)
    names = ("vllm:time_to_first_token_seconds",)
    busy.metrics_first_wave = ServerMetrics(time=1.0, histogram_sum={names[0]: 0.120},
                                            histogram_count={names[0]: 2.0})
    log = [_line(0, 2, 0), _line(1, 0, 2), _line(2, 1, 4), _line(3, 0, 5)]
    whole = run_figures(busy, log)
    assert whole.client_minus_server_s == pytest.approx(0.019) and whole.first_wave_left_out == 0
    assert whole.chunks_per_first_token_step == pytest.approx(3.0)
    busy.first_wave = [0, 1]
    later = run_figures(busy, log)
    assert later.client_minus_server_s == pytest.approx(0.008) and later.first_wave_left_out == 2
    assert later.chunks_per_first_token_step == pytest.approx(5.0) and later.requests == 2
    assert later.server_minus_engine_s == whole.server_minus_engine_s  # (the whole run's: lone runs only)
    busy.first_wave = [0]  # a scrape that counted other requests than the client's wave: not used
    assert run_figures(busy, log).first_wave_left_out == 0


def test_a_run_off_the_line_leaves_no_slope():
    """Client - server 4, 6.8, 7.3 ms at 1, 2, 3 chunks, then 37.8 ms at 6 chunks (a client that
    stalled): no line holds every run within 2 ms (or 30 %), so no slope; output_s is the
    median, (6.8 + 7.3) / 2 ms."""
    lone = _run(0.050, (0.046, 0.001, 0.042), concurrent=False)
    runs = [(lone, [_line(0, 1, 0)])]
    for ec, decodes in ((0.0068, 1), (0.0073, 2), (0.0378, 5)):
        runs.append((_run(0.090 + ec, (0.090, 0.010, 0.050), concurrent=True), [_line(0, 1, decodes)]))
    fit = fit_frontend(runs)
    assert fit.config == pytest.approx({"arrival_s": 0.003, "output_s": 0.00705, "per_chunk_s": 0.0})
    assert "do not line up" in fit.notes[0] and "output_s is the runs' median" in fit.notes[0]


def test_simcap_serve_drops_the_modelled_front_end():
    """A served engine is behind a real front end: its records carry the engine's times."""
    from simcap.serve.engine import ServedEngine

    served = ServedEngine(make_scenario(step_time=FLAT, frontend=FE))
    assert served.scenario.frontend is None and served.replicas[0].frontend is None


def test_a_fleet_leaves_out_its_profiles_front_end(tmp_path):
    """A live-calibrated profile carries a front end; a scenario with a deployment built on it
    runs its replicas without one (its router stands in front of them)."""
    from simcap.config.scenario import load_scenario

    profile = tmp_path / "p.yaml"
    profile.write_text("name: p\nengine: {max_num_seqs: 4, max_num_batched_tokens: 256, block_size: 16, "
                       "num_gpu_blocks: 500, max_model_len: 2048}\nstep_time: {base: 0.01}\n"
                       "frontend: {arrival_s: 0.003, output_s: 0.002, per_chunk_s: 0.001}\n")
    body = ("profile: p.yaml\nworkload: {arrival: {process: poisson, rate: 5}, num_requests: 20, "
            "input_len: 50, output_len: 10}\n")
    (tmp_path / "one.yaml").write_text(body)
    (tmp_path / "fleet.yaml").write_text(body + "deployment: {replicas: 2, router: roundrobin}\n")
    assert load_scenario(tmp_path / "one.yaml").frontend.per_chunk_s == 0.001
    fleet = load_scenario(tmp_path / "fleet.yaml")
    assert fleet.frontend is None and simulate(fleet).summary.completed == 20


def test_simulate_prints_the_front_end_it_used(tmp_path):
    """The provenance line names the front end (or none), as the JSON's provenance does."""
    import os
    import subprocess
    import sys

    path = tmp_path / "s.yaml"
    path.write_text("engine: {max_num_seqs: 4, max_num_batched_tokens: 256, block_size: 16, num_gpu_blocks: 500, "
                    "max_model_len: 2048}\nstep_time: {base: 0.01}\nfrontend: {arrival_s: 0.002, output_s: 0.001, "
                    "per_chunk_s: 0.0005}\nworkload: {arrival: {process: poisson, rate: 5}, num_requests: 20, "
                    "input_len: 50, output_len: 10}\n")
    out = subprocess.run([sys.executable, "-m", "simcap", "simulate", str(path)], capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "300"}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "front end: arrival 2.00 ms, output 1.00 ms + 0.500 ms per chunk of the step" in out.stdout
