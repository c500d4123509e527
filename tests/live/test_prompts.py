"""Prompt construction for live runs: exact lengths, determinism, shared prefixes (no server)."""

from __future__ import annotations

import pytest

from simcap.live.client import _absorb, request_body
from simcap.live.prompts import PromptBuilder
from simcap.scenario import parse_scenario
from simcap.workload import RequestSpec, Workload

POOL = list(range(4, 260))


def _scenario(prefix=None, seed=0):
    workload = dict(
        arrival={"process": "poisson", "rate": 1.0},
        num_requests=50,
        input_len={"dist": "uniform", "low": 64, "high": 256},
        output_len=8,
    )
    if prefix:
        workload["prefix"] = prefix
    return parse_scenario(
        {
            "engine": dict(block_size=32, num_gpu_blocks=1000, max_model_len=2048),
            "workload": workload,
            "seed": seed,
        }
    )


def test_exact_lengths_and_pool_only():
    sc = _scenario()
    wl = Workload(sc.workload, sc.seed)
    builder = PromptBuilder(POOL, seed=sc.seed)
    for i in range(50):
        spec = wl.spec(i)
        ids = builder.prompt_ids(spec)
        assert len(ids) == spec.num_prompt_tokens
        assert set(ids) <= set(POOL)


def test_deterministic_across_builders_and_build_order():
    sc = _scenario(prefix={"shared_tokens": 40, "num_prefixes": 3})
    specs = [Workload(sc.workload, sc.seed).spec(i) for i in range(30)]
    a = PromptBuilder(POOL, seed=5)
    b = PromptBuilder(reversed(POOL), seed=5)  # pool order does not matter
    first = [a.prompt_ids(s) for s in specs]
    second = [b.prompt_ids(s) for s in reversed(specs)][::-1]
    assert first == second
    # A key's stream does not depend on how long it was first drawn.
    c = PromptBuilder(POOL, seed=5)
    long = c.segment_ids(-7, 1000)
    assert PromptBuilder(POOL, seed=5).segment_ids(-7, 300) == long[:300]


def test_seed_and_key_change_content():
    a = PromptBuilder(POOL, seed=0)
    b = PromptBuilder(POOL, seed=1)
    assert a.segment_ids(-1, 64) != b.segment_ids(-1, 64)
    assert a.segment_ids(-1, 64) != a.segment_ids(-3, 64)
    assert a.segment_ids(1, 64) != a.segment_ids(-1, 64)  # the key's sign matters


def test_prefix_sharing_matches_segments():
    sc = _scenario(prefix={"shared_tokens": 48, "num_prefixes": 2})
    wl = Workload(sc.workload, sc.seed)
    builder = PromptBuilder(POOL, seed=sc.seed)
    specs = [wl.spec(i) for i in range(40)]
    prompts = [builder.prompt_ids(s) for s in specs]
    by_group: dict[int, list[list[int]]] = {}
    for spec, ids in zip(specs, prompts):
        by_group.setdefault(spec.segments[0][0], []).append(ids)
    assert len(by_group) == 2
    heads = {g: {tuple(p[:48]) for p in ps} for g, ps in by_group.items()}
    for g, h in heads.items():
        assert len(h) == 1, "requests of one prefix group share the first 48 ids"
    assert heads[0] != heads[1]
    # Unique parts differ between requests (so only the prefix can hit the cache).
    tails = {tuple(p[48:80]) for p in prompts}
    assert len(tails) == len(prompts)


def test_for_vocab_avoids_special_ids():
    builder = PromptBuilder.for_vocab(64, special_ids=[0, 1, 2, 3], seed=0)
    ids = builder.segment_ids(-1, 5000)
    assert min(ids) >= 4 and max(ids) < 64


def test_bad_pool_and_mismatched_spec():
    with pytest.raises(ValueError):
        PromptBuilder([5])
    builder = PromptBuilder(POOL)
    with pytest.raises(ValueError):
        builder.prompt_ids(RequestSpec(0, 10, 4, ((-1, 9),)))


def test_request_body_completions_and_chat():
    spec = RequestSpec(0, 3, 16, ((-1, 3),))
    body = request_body("completions", "m", spec, [5, 6, 7])
    assert body["prompt"] == [5, 6, 7] and body["max_tokens"] == 16
    assert body["ignore_eos"] is True and body["stream"] is True and body["temperature"] == 0.0
    assert body["stream_options"] == {"include_usage": True}
    chat = request_body("chat", "m", spec, "hello")
    assert chat["messages"] == [{"role": "user", "content": "hello"}] and "prompt" not in chat


@pytest.mark.parametrize(
    "tokens, diff, expected",
    [([1, 1, 1], 2, [1, 1, 3]), ([1, 1, 2], -3, [1, 0, 0]), ([2], 0, [2])],
)
def test_usage_difference_goes_to_last_chunks(tokens, diff, expected):
    _absorb(tokens, diff)
    assert tokens == expected
