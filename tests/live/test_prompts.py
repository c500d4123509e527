"""Prompt construction for live runs: exact lengths, determinism, shared prefixes (no server)."""

from __future__ import annotations

import pytest

from simcap.config.scenario import parse_scenario
from simcap.live.client import _absorb, request_body
from simcap.live.prompts import PromptBuilder
from simcap.workloads.requests import RequestSpec, Workload

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


# --------------------------------------------------------------------------- session prompts


def _session(turns, max_model_len=4096, prefix=None, on_overflow="truncate"):
    from simcap.live.session_prompts import SessionPrompts
    from simcap.workloads.sessions import Conversation, SessionPlan, Turn

    plan = SessionPlan(3, tuple(Turn(*t) for t in turns), prefix)
    builder = PromptBuilder(POOL, seed=11)
    return SessionPrompts(Conversation(plan, max_model_len, on_overflow), builder), builder


def test_session_turn_resends_prompt_and_the_answer_ids_that_came_back():
    from simcap.workloads.sessions import SESSION_KEY_BASE

    prompts, builder = _session([(40, 5, 0.5), (8, 4, 1.0), (6, 3, 0.0)])
    spec0, ids0 = prompts.request(0)
    # By hand: turn 0 is its 40 new tokens under request 0's key.
    assert ids0 == builder.segment_ids(SESSION_KEY_BASE, 40)
    assert (spec0.session_id, spec0.turn, spec0.max_tokens, spec0.num_prompt_tokens) == (3, 0, 5, 40)
    # The answer came back one token short, with ids of the server's choosing.
    assert prompts.answered([901, 902, 903, 904]) == 0.5
    spec1, ids1 = prompts.request(7)
    assert ids1 == ids0 + [901, 902, 903, 904] + builder.segment_ids(SESSION_KEY_BASE + 14, 8)
    assert spec1.num_prompt_tokens == len(ids1) == 52 and spec1.turn == 1
    assert spec1.segments == ((SESSION_KEY_BASE, 40), (SESSION_KEY_BASE + 1, 4), (SESSION_KEY_BASE + 14, 8))
    assert spec1.output_key == SESSION_KEY_BASE + 15
    assert prompts.answered([5, 6, 7, 8]) == 1.0
    spec2, ids2 = prompts.request(9)
    assert ids2[:len(ids1) + 4] == ids1 + [5, 6, 7, 8] and len(ids2) == 62
    assert prompts.answered([1, 2, 3]) == 0.0 and prompts.done and prompts.request(10) is None


def test_session_truncation_drops_the_oldest_turns_ids_and_keeps_the_shared_prefix():
    from simcap.workloads.sessions import SESSION_KEY_BASE

    group = 2
    prompts, builder = _session([(40, 10, 0.0), (20, 10, 0.0), (20, 10, 0.0)], max_model_len=100,
                                prefix=(group, 16))
    _, ids0 = prompts.request(0)
    shared = builder.segment_ids(group, 16)
    assert ids0[:16] == shared and len(ids0) == 40  # the prefix is part of the first turn's 40
    prompts.answered(list(range(300, 310)))
    _, ids1 = prompts.request(1)
    assert len(ids1) == 70
    prompts.answered(list(range(400, 410)))
    # 80 + 20 new + 10 answer > 100: turn 0 (24 new + 10 answer) is dropped, the prefix kept.
    spec2, ids2 = prompts.request(2)
    assert prompts.conversation.truncated_turns == 1 and prompts.conversation.dropped_turns == 1
    new1 = builder.segment_ids(SESSION_KEY_BASE + 2, 20)
    assert ids2 == shared + new1 + list(range(400, 410)) + builder.segment_ids(SESSION_KEY_BASE + 4, 20)
    assert spec2.num_prompt_tokens == len(ids2) == 66
    assert set(prompts.answers) == {SESSION_KEY_BASE + 3}  # turn 0's answer is never sent again


def test_session_answer_before_request_is_refused():
    prompts, _ = _session([(10, 2, 0.0)])
    with pytest.raises(ValueError, match="no turn awaits"):
        prompts.answered([1, 2])
