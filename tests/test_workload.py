"""Workload: the i-th request is a function of the scenario and seed alone."""

from __future__ import annotations

from simcap.config.scenario import parse_scenario
from simcap.workloads.requests import Workload


def _scenario(prefix: dict | None = None):
    data = {
        "engine": {"num_gpu_blocks": 1024, "block_size": 16, "max_model_len": 4096},
        "step_time": {"base": 0.004},
        "workload": {
            "arrival": {"process": "poisson", "rate": 5.0},
            "num_requests": 5000,
            "input_len": {"dist": "uniform", "low": 10, "high": 3000},
            "output_len": {"dist": "uniform", "low": 1, "high": 500},
            **({"prefix": prefix} if prefix else {}),
        },
        "seed": 7,
    }
    return parse_scenario(data)


def test_request_specs_do_not_depend_on_the_order_they_are_asked_in():
    """Lengths are drawn in chunks as requests are asked for: asking for a late request
    first (beyond every chunk drawn so far), or for one already drawn, gives the request
    that asking in order gives."""
    for prefix in (None, {"shared_tokens": 8, "num_prefixes": 3}):
        scenario = _scenario(prefix)
        in_order = Workload(scenario.workload, scenario.seed)
        expected = [in_order.spec(i) for i in range(5000)]
        shuffled = Workload(scenario.workload, scenario.seed)
        order = [4321, 17, 2048, 0, 1023, 1024, 4999, 3000, 2047, 5]
        assert [shuffled.spec(i) for i in order] == [expected[i] for i in order]
        assert [shuffled.spec(i) for i in range(5000)] == expected
        assert len({s.num_prompt_tokens for s in expected}) > 100  # (lengths that differ)
