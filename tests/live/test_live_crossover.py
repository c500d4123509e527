"""``simcap live crossover --launch`` and ``live validate --launch --restarts`` against REAL vLLM
CPU servers that the commands start and stop themselves (from ``examples/servers/cpu-tiny.yaml``).

- A two-point crossover (1 and 4 clients, short runs): both arms measured at both points, the
  speculative arm's acceptance read from the server's spec-decode counters, and the prediction
  of each arm's profile calibrated at 1-2 clients beside it. No accuracy threshold: the machine's noise
  (2 shared cores) is larger than any the test could hold; the figures are printed.
- The same with EAGLE3 (``examples/servers/cpu-tiny-eagle3.yaml``: the tiny draft head, synthetic
  acceptance): the server's acceptance counters against the configured rates.
- A launch config whose server fails to start: one line with its exit code and last log lines.
- ``validate --restarts 1``: two server instances, the band over both.

Each command starts its own servers one after another; run the live step under
``flock /tmp/simcap-cpu.lock`` so no other server shares the cores.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
import yaml

pytestmark = pytest.mark.live

REPO = Path(__file__).resolve().parents[2]
SERVER_YAML = REPO / "examples" / "servers" / "cpu-tiny.yaml"
SCENARIO_YAML = REPO / "examples" / "cpu-tiny-ngram.yaml"
EAGLE3_SERVER = REPO / "examples" / "servers" / "cpu-tiny-eagle3.yaml"
EAGLE3_SCENARIO = REPO / "examples" / "cpu-tiny-eagle3.yaml"


def _gone(base_url: str) -> bool:
    try:
        httpx.get(base_url.rstrip("/") + "/health", timeout=2)
    except httpx.HTTPError:
        return True
    return False


def test_two_point_live_crossover(live_cli, tmp_path):
    out_dir = tmp_path / "xo"
    t0 = time.monotonic()
    code, out, err = live_cli("crossover", SCENARIO_YAML, "--launch", SERVER_YAML, "--concurrency", "1,4",
                              "--requests-per-client", "3", "--calibration-requests", "16",
                              "--out-dir", out_dir, "--json")
    took = time.monotonic() - t0
    assert code == 0, err
    data = json.loads(out)
    measured, predicted = data["measured"], data["predicted"]
    assert [p["concurrency"] for p in measured["points"]] == [1, 4] == [p["concurrency"] for p in predicted["points"]]
    runs = {(r["arm"], r["concurrency"]): r for r in data["runs"]}
    for p in measured["points"]:
        c, n = p["concurrency"], p["num_requests"]
        assert n == max(8, 3 * c)
        for arm in ("spec", "baseline"):
            assert p[arm]["completed"] == n and p[arm]["output_tokens_per_s"] > 0, (arm, c)
            run = runs[(arm, c)]
            assert run["completed"] == n and run["failed"] == 0 and run["prefix_cache_reset"] == "ok"
            lines = Path(run["records"]).read_text().splitlines()
            assert len(lines) == n  # every run's records on disk
        assert p["gain_pct"]["throughput"] is not None
        # Acceptance: the speculative server's own counters, none for the baseline.
        server = runs[("spec", c)]["server"]
        drafts, accepted = server["spec_decode_num_drafts"], server["spec_decode_num_accepted_tokens"]
        assert drafts > 0 and accepted > 0
        assert p["spec"]["mean_acceptance_length"] == pytest.approx(1 + accepted / drafts)
        assert p["baseline"]["mean_acceptance_length"] is None
        assert not runs[("baseline", c)]["server"].get("spec_decode_num_drafts")
    # The prediction: calibrated below the highest point, fed the acceptance measured at 1 client.
    cal = data["calibration"]
    assert cal["concurrencies"] == [1, 2] and cal["source"] == "vllm iteration log"
    assert cal["speculative"]["method"] == "ngram" and cal["speculative"]["num_speculative_tokens"] == 3
    profile = yaml.safe_load(Path(cal["profile"]).read_text())
    assert predicted["provenance"]["profile"]["sha256"] and profile["step_time"]["base"] > 0
    assert predicted["provenance"]["calibrated_at_concurrencies"] == [1, 2]
    rates = runs[("spec", 1)]["server"]["spec_decode_acceptance_rates"]
    fed = predicted["provenance"]["speculative"]["acceptance_rates"]
    assert fed == pytest.approx([min(rates[: i + 1]) for i in range(len(rates))], abs=1e-6)
    assert cal["acceptance_fed"].startswith("server counters of the speculative arm at 1 clients")
    for p in predicted["points"]:
        assert p["spec"]["completed"] == p["baseline"]["completed"] == p["num_requests"]
    comp = data["comparison"]
    assert [r["concurrency"] for r in comp["points"]] == [1, 4]
    for r in comp["points"]:
        g = r["throughput_gain_pct"]
        assert g["measured"] is not None and g["predicted"] is not None
    assert set(comp["crossover"]) == {"measured", "predicted", "one_profile"}
    # Each arm priced by its own server's profile; the one-profile prediction beside it.
    base_cal = cal["baseline"]
    assert base_cal["concurrencies"] == [1, 2] and base_cal["profile"] != cal["profile"]
    assert predicted["provenance"]["baseline"]["step_time"]["base"] == pytest.approx(base_cal["step_time"]["base"])
    assert data["one_profile"]["provenance"]["baseline"] == "the same scenario with the speculative section removed"
    # Both servers started and were stopped.
    assert [s["arm"] for s in data["servers"]] == ["spec", "baseline"]
    spec_cmd, base_cmd = data["servers"][0]["command"], data["servers"][1]["command"]
    assert "--speculative-config" in spec_cmd and "--speculative-config" not in base_cmd
    for cmd in (spec_cmd, base_cmd):
        assert _gone(f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}")
    print(f"\nlive crossover (1, 4 clients) took {took:.0f} s")
    for r in comp["points"]:
        g = r["throughput_gain_pct"]
        print(f"  {r['concurrency']} clients: throughput gain measured {g['measured']:+.1f}%, predicted "
              f"{g['predicted']:+.1f}%; spec tok/s {r['spec_tokens_per_s']}, base {r['baseline_tokens_per_s']}")
    print(f"  acceptance fed: {cal['acceptance_fed']}; notes: {data['notes']}")


def test_two_point_eagle3_crossover_with_a_real_drafter(live_cli, tmp_path):
    """EAGLE3 with the tiny draft head (.ci/vllm-cpu-setup), synthetic acceptance at the
    launch config's per-position rates: the drafter runs, the server counts its drafts, each arm
    is calibrated on its own server. The counted acceptance must be the configured one within
    sampling error (the CPU rejection kernels' synthetic mode is simcap's server hook)."""
    out_dir = tmp_path / "xo-eagle3"
    t0 = time.monotonic()
    code, out, err = live_cli("crossover", EAGLE3_SCENARIO, "--launch", EAGLE3_SERVER, "--concurrency", "1,4",
                              "--requests-per-client", "3", "--calibration-requests", "16", "--prompt-period", "0",
                              "--out-dir", out_dir, "--json")
    took = time.monotonic() - t0
    assert code == 0, err
    data = json.loads(out)
    rates = yaml.safe_load(EAGLE3_SERVER.read_text())["speculative"]["synthetic_acceptance_rates"]
    runs = {(r["arm"], r["concurrency"]): r for r in data["runs"]}
    drafts = accepted = 0.0
    per_pos = [0.0] * len(rates)
    for c in (1, 4):
        server = runs[("spec", c)]["server"]
        assert runs[("spec", c)]["failed"] == 0 and runs[("baseline", c)]["failed"] == 0
        n = server["spec_decode_num_drafts"]
        drafts += n
        accepted += server["spec_decode_num_accepted_tokens"]
        per_pos = [a + n * r for a, r in zip(per_pos, server["spec_decode_acceptance_rates"])]
        assert server["spec_decode_num_draft_tokens"] == 3 * n  # EAGLE3 drafts k = 3 every step
    assert drafts > 300
    for got, want in zip(per_pos, rates):  # binomial proportions over the drafts, 4 sd
        assert abs(got / drafts - want) < 4 * (want * (1 - want) / drafts) ** 0.5, (got / drafts, want)
    cal = data["calibration"]
    assert cal["speculative"]["method"] == "eagle3" and cal["speculative"]["num_speculative_tokens"] == 3
    profile_notes = yaml.safe_load(Path(cal["profile"]).read_text())["provenance"]["notes"]
    assert any(n.startswith("per_verify_token tied to per_decode_token") for n in profile_notes), profile_notes
    assert cal["baseline"]["step_time"]["draft_per_pass"] == 0.0
    # The spec server's steps cost more than the plain server's at the same batch (the drafter).
    spec_st, base_st = cal["step_time"], cal["baseline"]["step_time"]
    assert spec_st["base"] + 4 * spec_st["per_decode_token"] > base_st["base"] + base_st["per_decode_token"]
    comp = data["comparison"]
    print(f"\nlive EAGLE3 crossover (1, 4 clients) took {took:.0f} s; acceptance counted "
          f"{1 + accepted / drafts:.3f} over {drafts:.0f} drafts, per position "
          f"{[round(a / drafts, 3) for a in per_pos]} (configured {rates})")
    for r in comp["points"]:
        g = r["throughput_gain_pct"]
        print(f"  {r['concurrency']} clients: throughput gain measured {g['measured']:+.1f}%, predicted "
              f"{g['predicted']:+.1f}% (one profile for both arms {g['one_profile']:+.1f}%)")


def test_launch_config_whose_server_fails_to_start(live_cli, tmp_path, write_yaml):
    server = yaml.safe_load(SERVER_YAML.read_text())
    server["engine"]["block_size"] = 16  # the CPU backend takes multiples of 32 only
    path = write_yaml(tmp_path / "bad-server.yaml", server)
    t0 = time.monotonic()
    code, out, err = live_cli("crossover", SCENARIO_YAML, "--launch", path, "--concurrency", "1,4",
                              "--set", "engine.block_size=16", "--json")
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1, err
    line = lines[0]
    assert line.startswith(f"error: --launch {path}: vLLM server exited with code ")
    assert "during startup; log " in line and "; last log lines: " in line
    log = Path(line.split("; log ", 1)[1].split("; last log lines", 1)[0])
    assert log.exists()  # a failed server's log outlives it
    shown = line.split("; last log lines: ", 1)[1].split(" | ")
    text = log.read_text()
    assert 1 <= len(shown) <= 3 and all(s in text for s in shown)
    assert any("Error" in s for s in shown)
    print(f"\nfailed start reported in {time.monotonic() - t0:.0f} s: {line}")


def test_validate_restarts_the_server_between_repeats(live_cli, tmp_path, write_yaml):
    server = yaml.safe_load(SERVER_YAML.read_text())
    del server["speculative"]
    launch = write_yaml(tmp_path / "server.yaml", server)
    scenario = yaml.safe_load(SCENARIO_YAML.read_text())
    del scenario["speculative"]
    scenario["workload"] = {"arrival": {"process": "closed", "concurrency": 2}, "num_requests": 6,
                            "input_len": {"dist": "uniform", "low": 32, "high": 128}, "output_len": 24}
    path = write_yaml(tmp_path / "s.yaml", scenario)
    t0 = time.monotonic()
    code, out, err = live_cli("validate", path, "--launch", launch, "--restarts", "1", "--repeats", "1", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert [r["instance"] for r in data["repeats"]] == [0, 1]
    assert all(r["completed"] == 6 for r in data["repeats"])
    spread = data["spread"]
    assert spread["kind"] == "restarts" and spread["instances"] == 2 and spread["repeats_per_instance"] == 1
    assert "instance-to-instance" in spread["text"]
    for key, fig in spread["metrics"].items():
        assert fig["between_instances"] is not None and fig["within_instance"] is None, key
    m = data["metrics"]["ttft_p50"]
    assert len(m["live"]) == 2 and m["live_min"] <= m["live_max"]
    print(f"\nvalidate --restarts 1 took {time.monotonic() - t0:.0f} s; spread {spread['metrics']}")
