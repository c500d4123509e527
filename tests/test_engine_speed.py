"""The engine's speed during a live run against its replay (simcap.live.engine_speed): the
ratios against hand-computed logs and step rows, and the replay at a given speed."""

from __future__ import annotations

import numpy as np
import pytest

from simcap.config.scenario import parse_scenario
from simcap.fleet.run import simulate
from simcap.live.engine_speed import at_speed, engine_speed


def line(second: int, prefill_tokens: int, decode_reqs: int, ms: float) -> str:
    return (f"(APIServer pid=1) INFO 12-06 01:11:{second:02d} [loggers.py:199] Engine 000: Iteration(1): "
            f"{1 if prefill_tokens else 0} context requests, {prefill_tokens} context tokens, {decode_reqs} "
            f"generation requests, {decode_reqs} generation tokens, iteration elapsed time: {ms} ms, "
            "CPU KV cache usage: 0.0%")


def steps(rows):
    """Simulated step rows (prefill tokens, requests, duration in s)."""
    a = np.array(rows, dtype=float)
    return {"num_prefill_tokens": a[:, 0].astype(np.int64), "num_reqs": a[:, 1].astype(np.int64),
            "duration": a[:, 2]}


def test_decode_steps_are_matched_by_batch_size_and_prompt_steps_in_total():
    # live: batch 1 at 6 ms (x30), batch 4 at 12 ms (x10), prompt steps 40 ms (x5)
    lines = ([line(1, 0, 1, 6.0)] * 30 + [line(2, 0, 4, 12.0)] * 10 + [line(2, 256, 1, 40.0)] * 5
             + [line(3, 0, 8, 20.0)] * 3)  # batch 8: too few steps to count
    # replay: batch 1 at 4 ms + 1 ms host, batch 4 at 10 + 1 ms, prompt steps 20 + 1 ms
    sim = steps([(0, 1, 0.005)] * 20 + [(0, 4, 0.011)] * 20 + [(256, 1, 0.021)] * 6 + [(0, 8, 0.02)] * 20)
    speed = engine_speed(lines, sim, host_overhead_s=0.001)
    # (30 x 6 + 10 x 12) / (30 x 4 + 10 x 10) = 300 / 220
    assert speed["ratio"] == pytest.approx(300 / 220)
    assert speed["prefill_ratio"] == pytest.approx(5 * 40 / (6 * 20))
    assert speed["decode_steps"] == 40 and speed["batch_sizes"] == 2
    # second 1: 30 steps of batch 1 (6/4); second 2: its 10 decode steps, under 20: left out
    assert speed["per_second"] == {"seconds": 1, "p10": pytest.approx(1.5), "p50": pytest.approx(1.5),
                                   "p90": pytest.approx(1.5)}
    # under async scheduling the step's duration is the forward time (host work overlaps it)
    # (30 x 6 + 10 x 12) / (30 x 5 + 10 x 11)
    assert engine_speed(lines, sim, 0.001, asynchronous=True)["ratio"] == pytest.approx(300 / 260)


def test_no_common_batch_size_is_no_speed():
    assert engine_speed([line(1, 0, 2, 5.0)] * 10, steps([(0, 1, 0.004)] * 10), 0.0) is None
    assert engine_speed([], steps([(0, 1, 0.004)] * 10), 0.0) is None


SCENARIO = {
    "engine": {"max_num_seqs": 4, "max_num_batched_tokens": 512, "num_gpu_blocks": 4096, "block_size": 16,
               "max_model_len": 2048,
               "async_scheduling": False},
    "step_time": {"base": 0.004, "per_prefill_token": 2e-5, "per_decode_token": 3e-4, "host_overhead": 0.001},
    "workload": {"arrival": {"process": "closed", "concurrency": 4}, "num_requests": 12, "input_len": 128,
                 "output_len": 32},
    "seed": 3,
}


@pytest.mark.parametrize("noise", [None, {"decode": {"kind": "lognormal", "sigma": 0.1}}])
def test_a_replay_at_speed_prices_each_step_kind_by_its_factor(noise):
    sc = parse_scenario({**SCENARIO, "step_time": {**SCENARIO["step_time"], "noise": noise}})
    base = simulate(sc, steps=True).steps.as_arrays()
    fast = simulate(at_speed(sc, 2.0, 0.5), steps=True).steps.as_arrays()
    host = 0.001
    if noise is None:  # no noise: every step's forward time exactly times its kind's factor
        for rows in (base, fast):
            assert len(rows["duration"]) > 0
        decode = lambda r: r["num_prefill_tokens"] == 0  # noqa: E731
        fwd = lambda r, sel: r["duration"][sel] - host  # noqa: E731
        def price(r):
            return 0.004 + 2e-5 * r["num_prefill_tokens"] + 3e-4 * r["num_decode_tokens"]

        assert np.allclose(fwd(base, decode(base)), price(base)[decode(base)])
        assert np.allclose(fwd(fast, decode(fast)), 2.0 * price(fast)[decode(fast)])
        pre = ~decode(fast)
        assert pre.any() and np.allclose(fwd(fast, pre), 0.5 * price(fast)[pre])
    else:  # a lognormal decode noise keeps its spread around the factor: mean forward x2
        dec = base["num_prefill_tokens"] == 0
        ratio = (fast["duration"][fast["num_prefill_tokens"] == 0] - host).mean() / (base["duration"][dec] - host).mean()
        assert ratio == pytest.approx(2.0, rel=0.1)
    # the host overhead is not the engine's forward time: left as it was
    assert at_speed(sc, 2.0).step_time.host_overhead == sc.step_time.host_overhead
