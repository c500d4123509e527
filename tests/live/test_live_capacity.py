"""``simcap live capacity`` end to end against the REAL vLLM CPU server: a shortened search
(5 s of arrivals a run, 2 replicates, a bisection of a few rates), its measured brackets, the
prediction beside them, the records on disk, resume after a killed run, and a scenario whose
engine flags contradict the server's.

No accuracy threshold: how close the prediction came is printed (``-s``) and lives in the
output's ``comparison``. Run with ``python -m pytest -m live tests/live/test_live_capacity.py -s``.
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.live

SEARCH = ("--duration", "5", "--replicates", "2", "--max-points", "5", "--max-probes", "2")


@pytest.fixture(scope="module")
def quick_profile(vllm_server, tmp_path_factory):
    """A profile calibrated from the server's per-step log, as ``live calibrate`` writes it."""
    from typer.testing import CliRunner

    from simcap.cli.live import live_app

    out = tmp_path_factory.mktemp("capacity-profile") / "cpu-tiny.yaml"
    result = CliRunner().invoke(live_app, [
        "calibrate", "--base-url", vllm_server.base_url, "--model", "tiny", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "512", "--out", str(out), "--log", str(vllm_server.log_path),
        "--requests", "24", "--bootstrap", "20", "--json",
    ])  # fmt: skip
    assert result.exit_code == 0, result.stderr or result.output
    return out


@pytest.fixture
def scenario(quick_profile, tmp_path, write_yaml):
    return write_yaml(tmp_path / "capacity.yaml", {
        "name": "live-capacity",
        "profile": str(quick_profile),
        "seed": 31,
        "slo": {"ttft_p95": 0.5},
        "workload": {"arrival": {"process": "poisson", "rate": 1.0}, "duration_s": 5.0,
                     "input_len": {"dist": "uniform", "low": 32, "high": 128},
                     "output_len": {"dist": "uniform", "low": 8, "high": 24}},
    })  # fmt: skip


def test_live_capacity_brackets_both_rates_and_compares_the_prediction(vllm_server, scenario, tmp_path, live_cli):
    out = tmp_path / "search"
    fig = tmp_path / "capacity.png"
    code, stdout, err = live_cli("capacity", scenario, "--base-url", vllm_server.base_url, *SEARCH,
                                 "--out", out, "--plot", fig, "--json")
    assert code == 0, err
    data = json.loads(stdout)
    measured, comparison = data["measured"], data["comparison"]
    points = measured["points"]
    print(f"\nlive capacity: {data['runs_made']} runs, {data['live_time_s']:.1f} s live")
    for p in points:
        live = p["live"]
        print(f"  rate {p['rate']:7.3f} rep {p['replicate']} measured {p['measured_rate']:7.3f}"
              f"{'' if live['rate_reached'] else ' (not reached)'} ttft_p95 {p['ttft_p95'] * 1e3:8.1f} ms "
              f"{'pass' if p['pass'] else 'FAIL'}{' saturated' if p['saturated'] else ''} [{p['role']}]")
    for key, row in comparison.items():
        print(f"  {key}: measured {row['measured']} in {row['bracket']}, predicted {row['predicted']} "
              f"(error {row['rel_error']}, in bracket {row['in_bracket']})")
    for note in data["notes"]:
        print(f"  note: {note}")

    # Measured: the safe rate bracketed from both sides, and the queue seen diverging. By the
    # prefix rule there is a lower side when every replicate of the lowest tested rate passed;
    # when one did not (the server's TTFT, on 2 cores shared with the load generator, can
    # miss the SLO at the lowest rate the search reached), the bracket must say so, and the
    # gap is reported at the end.
    lo, hi = measured["safe_rate_bracket"]
    lowest = min(p["rate"] for p in points if p["role"] != "probe")
    lowest_ttfts = [p["ttft_p95"] for p in points if p["rate"] == lowest]
    unbracketed = not all(p["pass"] for p in points if p["rate"] == lowest)
    assert (lo is None) == unbracketed and hi is not None
    assert measured["safe_rate"] == lo
    # The queue seen diverging, and below it a rate whose runs kept up, unless a run at the
    # lowest rate tried was already called saturated (a 5 s run of 10-15 requests on a slow
    # server: none may finish inside the rule's window); the bracket must then say so.
    sat_lo, sat_hi = measured["saturation_bracket"]
    saturated_at_lowest = any(p["saturated"] for p in points if p["rate"] == min(q["rate"] for q in points))
    assert sat_hi is not None and (sat_lo is None) == saturated_at_lowest
    assert saturated_at_lowest or measured["saturation_rate"] > 0
    searched = sorted({p["rate"] for p in points if p["role"] == "search"})
    assert 2 <= len(searched) <= 5 and measured["mode"] == "auto"
    assert all(sum(1 for p in points if p["rate"] == r) == 2 for r in searched)  # both replicates
    for p in points:
        assert p["live"]["prefix_cache_reset"] == "ok" and p["live"]["failed"] == 0
        assert p["live"]["requests"] == p["completed"]
    # Predicted beside it: the same rules on the simulated server, compared.
    predicted = data["predicted"]
    assert predicted["slo"] == measured["slo"] == {"ttft_p95": 0.5}
    assert predicted["duration_s"] == 5.0 and predicted["replicates"] == 2
    assert predicted["safe_rate"] is not None and predicted["saturation_rate"] is not None
    for key in ("safe_rate", "saturation_rate"):
        row = comparison[key]
        assert row["predicted"] == predicted[key] and row["measured"] == measured[key]
        if not row["measured"]:  # (None: an unbracketed safe rate; 0: no saturated run finished in its window)
            assert row["rel_error"] is None
        else:
            assert row["rel_error"] == pytest.approx(row["predicted"] / row["measured"] - 1)
        assert isinstance(row["in_bracket"], bool)
    # The live search started where the prediction put the safe rate.
    assert min(p["rate"] for p in points if p["role"] == "search") <= predicted["safe_offered_rate"]
    assert data["server"]["model"] == "tiny" and data["server"]["engine_differences"] == {}
    assert data["provenance"]["simcap_version"] and data["provenance"]["profile"]["name"] == "cpu-tiny"
    assert fig.read_bytes()[:4] == b"\x89PNG"

    # Every run's records on disk; one line per finished run.
    lines = (out / "points.jsonl").read_text().splitlines()
    assert len(lines) == data["runs_made"] == len(points)
    for line in lines:
        entry = json.loads(line)
        assert len((out / entry["records"]).read_text().splitlines()) == entry["requests"]

    # Killed during its last run: that run has records but no line. --resume keeps the rest and
    # reruns it (then goes on, if the new measurement changes the search's path).
    (out / "points.jsonl").write_text("".join(line + "\n" for line in lines[:-1]))
    last = json.loads(lines[-1])
    written = (out / last["records"]).stat().st_mtime_ns
    code, stdout, err = live_cli("capacity", scenario, "--base-url", vllm_server.base_url, *SEARCH,
                                 "--out", out, "--resume", "--json")
    assert code == 0, err
    again = json.loads(stdout)
    assert again["runs_resumed"] == len(lines) - 1 and again["runs_made"] >= 1
    kept = {(p["rate"], p["replicate"]): p for p in again["measured"]["points"]}
    for p in points:
        if (p["rate"], p["replicate"]) != (last["rate"], last["replicate"]) and (p["rate"], p["replicate"]) in kept:
            assert kept[(p["rate"], p["replicate"])] == p  # recomputed from its records: identical
    assert (last["rate"], last["replicate"]) in kept
    assert (out / last["records"]).stat().st_mtime_ns > written  # run again, records rewritten

    # A second search into the same directory without --resume is refused: nothing is lost.
    code, _, err = live_cli("capacity", scenario, "--base-url", vllm_server.base_url, *SEARCH, "--out", out)
    assert code == 2 and "already holds a capacity search" in err and len(err.strip().splitlines()) == 1
    if unbracketed:
        pytest.xfail(
            f"the lowest rate searched, {lowest:.1f} req/s, missed the 500 ms SLO in a replicate "
            f"(TTFT p95 {', '.join(f'{s * 1e3:.0f}' for s in lowest_ttfts)} ms; predicted safe "
            f"rate {predicted['safe_rate']:.1f} req/s): the server's front-end queue on this machine"
        )


def test_engine_flags_that_contradict_the_server_are_named(vllm_server, scenario, tmp_path, live_cli):
    code, _, err = live_cli("capacity", scenario, "--base-url", vllm_server.base_url, *SEARCH,
                            "--out", tmp_path / "never", "--set", "engine.block_size=16",
                            "--set", "engine.enable_prefix_caching=false")
    assert code == 2
    line = err.strip()
    assert len(line.splitlines()) == 1 and "block_size server 32 vs scenario 16" in line
    assert "enable_prefix_caching server True vs scenario False" in line and "--adopt-server-config" in line
    assert not (tmp_path / "never").exists()  # refused before anything was sent or written
