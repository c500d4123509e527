"""``simcap live validate --rate-of-saturation``: the probe's pieces that need no server.

The probe's rate is checked against the simulator's own: a closed loop on an engine that
serves one request per fixed step completes exactly one request a step, so the records of its
simulation, read as a client would read them, must give that rate.
"""

from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from simcap.cli.live import live_app
from simcap.config.scenario import parse_scenario
from simcap.fleet.run import simulate
from simcap.live.client import LiveError
from simcap.live.saturation import (
    PROBE_REQUESTS_PER_CLIENT, SaturationProbe, at_fraction, check_rate_of_saturation, probe_scenario,
    steady_completion_rate,
)

D = 0.01  # one 10 ms step a request (one prompt step, one output token): 100 req/s
ENGINE = dict(max_num_seqs=1, max_num_batched_tokens=64, block_size=16, num_gpu_blocks=64, max_model_len=256,
              enable_prefix_caching=False)


def _open(rate: float = 3.0, **workload) -> dict:
    return {"name": "open", "engine": ENGINE, "seed": 3,
            "step_time": dict(base=D, per_prefill_token=0.0, per_decode_token=0.0),
            "workload": dict(arrival={"process": "poisson", "rate": rate}, num_requests=20, input_len=16,
                             output_len=1, **workload)}


def test_steady_rate_hand_computed():
    # 2 clients, 10 completions: the 2nd (t=0.3) to the 8th (t=1.5), 6 completions in 1.2 s.
    t = [0.1, 0.3, 0.4, 0.6, 0.9, 1.0, 1.2, 1.5, 1.9, 2.0]
    rate, n, window = steady_completion_rate(list(reversed(t)), clients=2)
    assert (n, window) == (10, pytest.approx(1.2)) and rate == pytest.approx(5.0)
    with pytest.raises(LiveError, match="5 request\\(s\\) completed; at least 6"):
        steady_completion_rate(t[:5], clients=2)
    with pytest.raises(LiveError, match="one instant"):
        steady_completion_rate([1.0] * 6, clients=2)


def test_probe_reads_the_simulated_engines_own_rate():
    sc = parse_scenario(_open())
    probe = probe_scenario(sc)
    arrival = probe.workload.arrival
    assert arrival.process == "closed" and arrival.concurrency == 2 * sc.engine.max_num_seqs
    assert probe.workload.num_requests == 2 * PROBE_REQUESTS_PER_CLIENT and probe.seed != sc.seed
    assert probe.workload.input_len == sc.workload.input_len and probe.engine == sc.engine
    result = simulate(probe, records=True)
    rate, n, _ = steady_completion_rate([r.finish_time for r in result.records], 2)
    assert n == 12 and rate == pytest.approx(1 / D, rel=1e-9)


def test_the_point_is_sent_at_the_fraction_and_says_so():
    sc = parse_scenario(_open(rate=3.0))
    probe = SaturationProbe(rate=4.0, clients=16, requests=96, completed=96, window_s=16.0)
    sent = at_fraction(sc, 0.85, probe)
    assert sent.workload.arrival.rate == pytest.approx(3.4) and sent.workload.input_len == sc.workload.input_len
    assert sc.workload.arrival.rate == 3.0  # the scenario itself is left as it was
    assert probe.line(0.85) == ("rate 3.4 req/s: 0.85 x this server instance's saturation rate 4 req/s "
                                "(closed loop of 16 clients, 96 requests; 64 completions over 16.0 s after "
                                "the first 16)")


@pytest.mark.parametrize("fraction, data, fleet, expected", [
    (0.0, _open(), False, "--rate-of-saturation: must be > 0 and at most 2 (got 0)"),
    (2.5, _open(), False, "--rate-of-saturation: must be > 0 and at most 2 (got 2.5)"),
    (0.8, {**_open(), "workload": {**_open()["workload"], "arrival": {"process": "closed", "concurrency": 2}}},
     False, "--rate-of-saturation: sets an open-loop workload's rate (workload.arrival.process: poisson or "
            "gamma, no sessions); this one is closed"),
    (0.8, _open(), True, "--rate-of-saturation: probes one server; a fleet's rate is given in the scenario"),
])
def test_bad_fractions_and_workloads_are_one_line(fraction, data, fleet, expected):
    with pytest.raises(LiveError) as exc:
        check_rate_of_saturation(parse_scenario(data), fraction, fleet)
    assert str(exc.value) == expected
    check_rate_of_saturation(parse_scenario(data), None, fleet)  # not asked for: nothing to check


def test_the_cli_refuses_before_anything_is_sent(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(_open()))
    url = "http://127.0.0.1:9"  # nothing listens: the check comes first
    result = CliRunner().invoke(live_app, ["validate", "--base-url", url, "--rate-of-saturation", "3", str(path)])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == ["error: --rate-of-saturation: must be > 0 and at most 2 (got 3)"]
