"""``simcap live calibrate`` and ``validate --plot`` pieces that need no server."""

from __future__ import annotations

import numpy as np
import pytest

from simcap.calibrate import read_step_samples
from simcap.calibrate import parse_iteration_log
from simcap.live.calibration import (
    default_phases,
    fit_log_samples,
    host_overhead_from_itl,
    one_at_a_time_steps,
    prompt_lengths,
)
from simcap.live.recording import read_log_window
from simcap.metrics.records import RequestRecord

LINE = ("(APIServer pid=1) INFO 11-30 00:46:38 [loggers.py:199] Engine 000: Iteration({i}): {a} context "
        "requests, {b} context tokens, {c} generation requests, {d} generation tokens, iteration elapsed "
        "time: {ms:.2f} ms, CPU KV cache usage: 0.0%")


def _record(rid, first, gaps):
    rec = RequestRecord(rid, 0.0, 16, len(gaps) + 1)
    t = first
    rec.add_chunk(t, 1)
    for g in gaps:
        t += g
        rec.add_chunk(t, 1)
    rec.finish_time = t
    rec.finish_reason = "length"
    return rec


def test_host_overhead_is_client_period_minus_logged_elapsed():
    # Two requests decoding together for 4 steps: the client sees 12 ms between tokens, the
    # log says each step's forward took 10 ms -> 2 ms of host work per step.
    records = [_record(0, 0.1, [0.012] * 4), _record(1, 0.1, [0.012] * 4)]
    rows = [{"num_decode_reqs": 2, "step_time_s": 0.010} for _ in range(4)]
    rows.append({"num_decode_reqs": 0, "step_time_s": 0.5})  # a prefill step: no decode weight
    host = host_overhead_from_itl(records, rows)
    assert host["log_decode_request_steps"] == host["client_decode_request_steps"] == 8
    assert host["step_period_s"] == pytest.approx(0.012)
    assert host["logged_elapsed_s"] == pytest.approx(0.010)
    assert host["host_overhead_s"] == pytest.approx(0.002)
    assert host["client_mean_itl_s"] == pytest.approx(0.012)
    # Periods shorter than the log's elapsed: never a negative overhead.
    fast = host_overhead_from_itl([_record(0, 0.1, [0.005] * 4)], rows[:4])
    assert fast["host_overhead_s"] == 0.0 and "note" in fast


def test_two_stage_fit_recovers_the_step_time_of_a_log(tmp_path):
    rng = np.random.default_rng(0)
    base, pre, dec = 0.012, 0.0025, 0.0011
    lines, i = [], 0
    for _ in range(60):  # decode-only steps, small noise
        c = int(rng.integers(1, 9))
        lines.append(LINE.format(i=i, a=0, b=0, c=c, d=c, ms=(base + dec * c) * 1e3 * rng.normal(1, 0.01)))
        i += 1
    for _ in range(20):  # prefill and mixed steps, 10 % noise
        b, c = int(rng.integers(16, 512)), int(rng.integers(0, 4))
        lines.append(LINE.format(i=i, a=1, b=b, c=c, d=c, ms=(base + pre * b + dec * c) * 1e3 * rng.normal(1, 0.1)))
        i += 1
    path = tmp_path / "p.iterations.log"
    path.write_text("\n".join(["some other line"] + lines) + "\n")
    fit = fit_log_samples(read_step_samples(path), 0, 0.003, bootstrap=20)
    c = fit.coefficients
    assert c["base"] == pytest.approx(base, rel=0.05)
    assert c["per_decode_token"] == pytest.approx(dec, rel=0.1)
    assert c["per_prefill_token"] == pytest.approx(pre, rel=0.1)
    assert c["host_overhead"] == 0.003
    assert fit.method.startswith("two-stage") and set(fit.ci) >= {"base", "per_decode_token", "per_prefill_token"}
    assert len(fit.bootstrap) == 20 and fit.quality["n"] == 80


def test_the_linear_fit_prices_context_only_where_steps_say_it_exactly():
    """Decode steps cost base + per request + per context token. With 60 steps of one request
    whose contexts (200 to 1,200 tokens) are known exactly, the two-stage fit finds the cost
    per context token; with the same contexts taken at a run's mean (not exact) it leaves the
    term out (a fit on them would trade the one cost for the other)."""
    from simcap.calibrate.readers import _rows_to_samples

    rng = np.random.default_rng(1)
    base, dec, ctx, pre = 0.004, 0.0005, 2e-6, 0.0002
    rows = []
    for j in range(60):
        n, c = 1, 200 + 1000 * j / 59
        rows.append({"num_prefill_tokens": 0, "num_prefill_reqs": 0, "num_decode_tokens": n, "num_decode_reqs": n,
                     "num_context_tokens": c, "step_time_s": (base + dec * n + ctx * c) * rng.normal(1, 0.005)})
    for j in range(30):  # several requests, each at the run's mean context
        n = int(rng.integers(2, 9))
        c = n * 300.0
        rows.append({"num_prefill_tokens": 0, "num_prefill_reqs": 0, "num_decode_tokens": n, "num_decode_reqs": n,
                     "num_context_tokens": c, "step_time_s": (base + dec * n + ctx * c) * rng.normal(1, 0.005)})
    for j in range(10):
        b = int(rng.integers(32, 512))
        rows.append({"num_prefill_tokens": b, "num_prefill_reqs": 1, "num_decode_tokens": 0, "num_decode_reqs": 0,
                     "num_context_tokens": b, "step_time_s": (base + pre * b + ctx * b) * rng.normal(1, 0.01)})
    samples = _rows_to_samples(rows, "synthetic", {"file": "synthetic"})
    exact = np.array([True] * 60 + [False] * 40)
    samples.counts["context_exact"] = exact
    fit = fit_log_samples(samples, 0, 0.0, bootstrap=0)
    assert fit.coefficients["per_context_token"] == pytest.approx(ctx, rel=0.1)
    assert fit.coefficients["per_decode_token"] == pytest.approx(dec, rel=0.15)
    samples.counts["context_exact"] = np.zeros(100, dtype=bool)
    assert fit_log_samples(samples, 0, 0.0, bootstrap=0).coefficients["per_context_token"] == 0.0


def test_eagle_log_ties_verify_to_decode_where_every_request_drafts(tmp_path):
    """EAGLE drafts k = 3 tokens for every decode request in every step, so the log's
    generation tokens are always 4 per request: decode and verify columns are proportional and
    only their sum is fitted (as per_decode_token, verify tied to it). Steps of 12 ms + 2 ms per
    request: 0.5 ms per token of the 4."""
    lines = [LINE.format(i=i, a=0, b=0, c=c, d=4 * c, ms=12 + 2 * c)
             for i, c in enumerate([1, 2, 3, 4, 5, 6] * 4)]
    lines += [LINE.format(i=100 + i, a=1, b=b, c=0, d=0, ms=12 + 0.05 * b) for i, b in enumerate([64, 128, 256, 512])]
    path = tmp_path / "eagle.iterations.log"
    path.write_text("\n".join(lines) + "\n")
    fit = fit_log_samples(read_step_samples(path, 3), 3, 0.0, bootstrap=5)
    c = fit.coefficients
    assert c["base"] == pytest.approx(0.012) and c["per_decode_token"] == pytest.approx(0.0005)
    assert c["per_verify_token"] == c["per_decode_token"] and "per_verify_token" not in fit.form.free
    assert fit.notes[0].startswith("per_verify_token tied to per_decode_token: every decode request verified its k = 3")
    # Where some requests draft fewer (ngram finds no match), the two are told apart.
    mixed = [LINE.format(i=i, a=0, b=0, c=c, d=c + v, ms=12 + 1.0 * c + 0.3 * v)
             for i, (c, v) in enumerate([(1, 0), (1, 3), (2, 3), (2, 6), (3, 0), (3, 9), (4, 4), (4, 12)] * 3)]
    path.write_text("\n".join(mixed + lines[-4:]) + "\n")
    fit = fit_log_samples(read_step_samples(path, 3), 3, 0.0, bootstrap=5)
    assert fit.coefficients["per_verify_token"] == pytest.approx(0.0003)
    assert fit.coefficients["per_decode_token"] == pytest.approx(0.001)
    assert not any(n.startswith("per_verify_token tied") for n in fit.notes)


def test_log_window_is_what_was_appended(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("before\n")
    offset = log.stat().st_size
    with open(log, "a") as fh:
        fh.write("during 1\nduring 2\n")
    assert read_log_window(log, offset, settle_s=0.01, max_wait_s=0.1) == "during 1\nduring 2\n"


def test_calibration_mix_spans_lengths_batches_and_chunked_prefill():
    assert prompt_lengths(512, 2000) == (16, 64, 128, 256, 384, 640)
    assert max(prompt_lengths(512, 300)) <= 300
    phases = default_phases(8, 512, 2048, 40)
    # 40 in the first four phases (the 8 clients' about two waves), 4 + 2 in the last two.
    assert [p.num_requests for p in phases] == [5, 8, 10, 17, 4, 2]
    assert [p.concurrency for p in phases][0] == 1 and max(p.concurrency for p in phases) <= 8
    assert any(max(p.input_lens) > 512 for p in phases)  # chunked prefill
    assert len({n for p in phases for n in p.output_lens}) >= 3  # clients desynchronise
    assert max(p.concurrency for p in default_phases(2, 512, 2048, 16)) == 2
    # The last phases: one client whose prompts open with the same 256 tokens (cached after its
    # first request), 1/8 to 1/2 of the budget more; one client with half-length prompts and
    # long outputs (decode steps over long contexts).
    cached, long = phases[-2:]
    assert (cached.concurrency, cached.shared_prefix, cached.input_lens) == (1, 256, (320, 384, 512))
    assert (long.concurrency, long.input_lens, long.output_lens) == (1, (1024,), (48,))
    assert max(p.concurrency for p in phases) == 8


def test_steps_of_one_request_at_a_time_give_exact_pairs_and_contexts():
    """A: a 600-token prompt in chunks of 512 and 88, three chunks out. B: a 300-token prompt
    of which the log computed 44 (a 256-token cache hit), two chunks out. A chunk of m after s
    tokens: m s + m (m + 1) / 2 pairs (512 x 513 / 2 = 131,328; 88 x 512 + 88 x 89 / 2 =
    48,972; 44 x 256 + 44 x 45 / 2 = 12,254) and s + m of context; a decode step no pairs and
    the prompt plus the tokens out so far (601, 602; 301)."""
    steps = [(1, 512, 0), (1, 88, 0), (0, 0, 1), (0, 0, 1), (1, 44, 0), (0, 0, 1)]
    rows = parse_iteration_log(LINE.format(i=i, a=a, b=b, c=c, d=c, ms=5.0) for i, (a, b, c) in enumerate(steps))
    a = _record(0, 0.1, [0.01, 0.01])
    a.num_prompt_tokens = 600
    b = _record(1, 0.5, [0.01])
    b.arrival_time, b.num_prompt_tokens = 0.4, 300
    assert one_at_a_time_steps(rows, [a, b]) == [
        (131328.0, 512.0), (48972.0, 600.0), (0.0, 601.0), (0.0, 602.0), (12254.0, 300.0), (0.0, 301.0)]
    assert one_at_a_time_steps(rows[:-1], [a, b]) is None  # B's decode step is missing
    assert one_at_a_time_steps(rows + rows[-1:], [a, b]) is None  # a step no request took


def test_validate_plot_writes_ecdf_overlay(tmp_path):
    from simcap.config.scenario import parse_scenario
    from simcap.fleet.run import simulate
    from simcap.live.client import LiveRun
    from simcap.live.plot import plot_validation_ecdfs
    from simcap.live.validate import Repeat, Validation, compare

    sc = parse_scenario({
        "name": "plot-check",
        "engine": dict(block_size=32, num_gpu_blocks=1000, max_model_len=2048, max_num_seqs=4),
        "workload": dict(arrival={"process": "closed", "concurrency": 4}, num_requests=12,
                         input_len={"dist": "uniform", "low": 32, "high": 256}, output_len=16),
    })
    reps = []
    for i in range(2):
        sim = simulate(sc.model_copy(update={"seed": i}), records=True)
        live = LiveRun(records=sim.records, specs={}, base_url="http://x", model="m", endpoint="completions",
                       closed_loop=True, requested_rate=None, scheduled_rate=None, achieved_rate=None,
                       wall_duration_s=1.0, max_send_lag_s=None)
        reps.append(Repeat(i, live, sim.summary, sim.summary, sim.records, {"disturbed": False}, "ok"))
    metrics, ks = compare(reps)
    out = plot_validation_ecdfs(Validation(sc, sc, reps, metrics, ks), tmp_path / "ecdf.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_validate_simulates_each_run_with_its_own_spec_acceptance():
    from simcap.config.scenario import parse_scenario
    from simcap.live.client import LiveRun
    from simcap.live.prom import ServerMetrics
    from simcap.live.validate import adopt_run_acceptance

    sc = parse_scenario({
        "engine": dict(block_size=32, num_gpu_blocks=1000, max_model_len=2048),
        "speculative": {"method": "ngram", "num_speculative_tokens": 3, "acceptance_length": 3.3,
                        "proposal_rate": 0.3},
        "workload": dict(arrival={"process": "closed", "concurrency": 1}, num_requests=2, input_len=16,
                         output_len=8),
    })  # fmt: skip
    before = ServerMetrics(0.0, counters={"vllm:spec_decode_num_drafts": 10.0}, histogram_count={
        "vllm:inter_token_latency_seconds": 100.0}, spec_accepted_per_pos={0: 5.0, 1: 4.0, 2: 3.0})
    after = ServerMetrics(1.0, counters={"vllm:spec_decode_num_drafts": 110.0,
                                         "vllm:spec_decode_num_accepted_tokens": 227.0},
                          histogram_count={"vllm:inter_token_latency_seconds": 300.0},
                          spec_accepted_per_pos={0: 95.0, 1: 84.0, 2: 71.0})
    run = LiveRun(records=[], specs={}, base_url="x", model="m", endpoint="completions", closed_loop=True,
                  requested_rate=None, scheduled_rate=None, achieved_rate=None, wall_duration_s=1.0,
                  max_send_lag_s=None, metrics_before=before, metrics_after=after)
    notes: list[str] = []
    new = adopt_run_acceptance(sc, run, 0, notes).speculative
    assert new.acceptance_rates == (0.9, 0.8, 0.68) and new.acceptance_length is None
    assert new.proposal_rate == 0.5  # 100 drafts over 200 decode request-steps
    assert notes == ["run 0: simulated with the run's own speculative acceptance length 3.380, proposal rate "
                     "0.500 (scenario 3.300, 0.300)"]
    assert sc.speculative.proposal_rate == 0.3  # the scenario itself is untouched


def test_the_linear_fit_sees_each_batch_size_where_pooled_medians_read_flat():
    """The shape of a fitted-levels log that looked contradictory: pooled medians over every
    batch up to c (mostly batch 1) grew 3.75 -> 4.3 ms from c=1 to 4 while the linear fit's
    per-decode-token term was 2.27 ms. Synthetic steps with that slope: the fit recovers it,
    the per-batch medians show it, the pooled medians hide it."""
    from simcap.calibrate import Form, fit_step_samples
    from tests.live.test_live_roofline import LINEAR_FORM, _samples, decode_medians_by_batch

    rng = np.random.default_rng(0)
    base, slope, per_prefill = 1.48e-3, 2.27e-3, 0.3e-3
    rows = []
    for batch, steps in ((1, 570), (2, 380), (4, 380)):  # levels 1, 2, 4 as the test runs them
        times = (base + slope * batch) * rng.lognormal(0.0, 0.1, steps)
        rows += [{"num_prefill_tokens": 0, "num_prefill_reqs": 0, "num_decode_tokens": batch,
                  "num_decode_reqs": batch, "step_time_s": float(t)} for t in times]
    for i, tokens in enumerate(rng.integers(64, 129, 30)):  # prefills, alone or beside decodes
        decodes = i % 4
        rows.append({"num_prefill_tokens": int(tokens), "num_prefill_reqs": 1, "num_decode_tokens": decodes,
                     "num_decode_reqs": decodes, "step_time_s": float(
                         base + per_prefill * tokens + slope * decodes + (1e-3 if decodes else 0.0))})

    fit = fit_step_samples([_samples(rows, "synthetic")], Form.parse(LINEAR_FORM), host_overhead=0.0,
                           bootstrap=0, noise=None)
    assert fit.coefficients["per_decode_token"] == pytest.approx(slope, rel=0.05)
    by_batch = decode_medians_by_batch(rows)
    assert sorted(by_batch) == [1, 2, 4] and [n for _, n in by_batch.values()] == [570, 380, 380]
    medians = np.array([m for m, _ in by_batch.values()])
    assert np.polyfit([1, 2, 4], medians, 1)[0] == pytest.approx(slope, rel=0.05)
    pooled = [np.median([r["step_time_s"] for r in rows
                         if r["num_prefill_tokens"] == 0 and r["num_decode_reqs"] <= c]) for c in (1, 2, 4)]
    assert (pooled[2] - pooled[0]) / 3 < slope / 2  # what the old printout read as the slope


def test_record_folder_that_cannot_be_made_is_one_line_before_any_request(tmp_path):
    from simcap.live.calibration import calibrate_live
    from simcap.live.client import LiveError

    log = tmp_path / "server.log"
    log.write_text("")
    with pytest.raises(LiveError, match=r"^--record .*: cannot make the folder: "):
        # (no server at this address: the check comes first)
        calibrate_live("http://127.0.0.1:9", "tiny", tmp_path / "p.yaml", max_num_seqs=8,
                       max_num_batched_tokens=512, log_path=log, record=log / "runs")
