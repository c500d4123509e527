"""A public trace sent to the real server: its lengths, its times, and its prefix sharing.

A hand-written Mooncake-style trace whose hash ids share blocks: the server's prefix-cache
hits over the run are the simulator's, token for token (computed by hand below).
"""

from __future__ import annotations

import json

import pytest

from simcap.fleet.run import simulate
from simcap.live.client import run_live

from .conftest import live_scenario

pytestmark = pytest.mark.live

# Trace blocks of 256 tokens (block_size: 256), the server's blocks of 32; requests 6 s apart
# so each runs alone. Request 1 shares hash id 0 with request 0: 256 tokens, 8 blocks. Request
# 2's 512-token prompt is request 0's first two blocks: hit up to its last token, 15 blocks.
ROWS = [
    {"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [0, 1, 2]},
    {"timestamp": 6000, "input_length": 400, "output_length": 4, "hash_ids": [0, 3]},
    {"timestamp": 12000, "input_length": 512, "output_length": 4, "hash_ids": [0, 1]},
]
HITS = 256 + 480


def test_a_mooncake_trace_hits_the_server_prefix_cache_as_simulated(base_url, tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    scenario = live_scenario({"trace": {"format": "mooncake", "path": str(path), "block_size": 256}})
    assert simulate(scenario).summary.prefix_cache_hit_tokens == HITS
    run = run_live(scenario, base_url, "tiny", progress=False)
    assert [r.succeeded for r in run.records] == [True] * 3, [r.error for r in run.records]
    assert [r.num_prompt_tokens for r in run.records] == [600, 400, 512]
    assert [r.num_output_tokens for r in run.records] == [4, 4, 4]
    sends = [r.arrival_time - run.records[0].arrival_time for r in run.records]
    assert sends == pytest.approx([0.0, 6.0, 12.0], abs=0.5)
    delta = run.server_delta()
    assert delta["prefix_cache_queries"] == 600 + 400 + 512
    assert delta["prefix_cache_hits"] == HITS
