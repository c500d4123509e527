"""Multi-turn sessions: each turn resends the conversation, hits what the cache kept of it,
and is sent no earlier than the previous answer's last token plus the think time."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from simcap.config.scenario import parse_scenario
from simcap.fleet.run import simulate
from simcap.metrics.summary import summarize
from simcap.studies.plots import write_simulation_plots
from simcap.workloads.sessions import SESSION_KEY_BASE, Conversation, SessionPlan, SessionWorkload, Turn


def make(sessions: dict, *, arrival=None, engine=None, workload=None, speculative=None, seed=0):
    data = {
        "engine": {"max_num_seqs": 8, "max_num_batched_tokens": 256, "block_size": 16,
                   "max_model_len": 1024, "num_gpu_blocks": 400, **(engine or {})},
        "step_time": {"base": 0.004, "per_prefill_token": 1e-5, "per_decode_token": 5e-5},
        "workload": {"arrival": arrival or {"process": "closed", "concurrency": 1},
                     "input_len": 40, "output_len": 24, "sessions": sessions, **(workload or {})},
        "seed": seed,
    }
    if speculative:
        data["speculative"] = speculative
    return parse_scenario(data)


def by_session(records):
    out: dict[int, list] = {}
    for r in records:
        out.setdefault(r.session_id, []).append(r)
    return {s: sorted(rs, key=lambda r: r.turn) for s, rs in out.items()}


# ----------------------------------------------------------------------------- by hand


@pytest.mark.parametrize("output_len,expected_hit", [(24, 48), (25, 64)])
def test_two_turn_session_hits_the_blocks_turn_one_computed(output_len, expected_hit):
    """Block size 16; turn 0: 40 new tokens and an answer of 24 (or 25) tokens; turn 1: 40 more.

    Turn 0 computes its prompt and every answer token but the last (the last sampled token is
    never fed back): 40 + 24 - 1 = 63 tokens, 3 full blocks = 48 tokens cached; with a 25-token
    answer 64 tokens, 4 full blocks = 64. Turn 1's prompt is 40 + answer + 40 tokens and opens
    with exactly those blocks, so it hits 48 (or 64) tokens; turn 0 hits nothing.
    """
    sc = make({"num_sessions": 1, "turns": 2, "think_time_s": 1.5},
              workload={"output_len": output_len})
    res = simulate(sc, records=True)
    t0, t1 = by_session(res.records)[0]
    assert (t0.num_prompt_tokens, t1.num_prompt_tokens) == (40, 40 + output_len + 40)
    assert (t0.num_cached_tokens, t1.num_cached_tokens) == (0, expected_hit)
    sessions = res.summary.sessions
    assert sessions["by_turn"][1]["prefix_hit_share"] == expected_hit / (80 + output_len)
    assert sessions["prefix_hit_share"] == expected_hit / (120 + output_len)
    assert res.summary.prefix_cache_hit_tokens == expected_hit
    off = simulate(make({"num_sessions": 1, "turns": 2}, workload={"output_len": output_len},
                        engine={"enable_prefix_caching": False}), records=True)
    assert [r.num_cached_tokens for r in off.records] == [0, 0]


def test_a_shared_system_prompt_is_hit_across_sessions():
    """Every session's first turn (100 tokens) opens with the one shared 64-token prefix: the
    second session's first turn hits its 4 blocks; each second turn (100 + 24 + 40 = 164
    tokens) hits the 123 tokens its first turn computed, 7 full blocks = 112."""
    sc = make({"num_sessions": 2, "turns": 2, "first_input_len": 100},
              workload={"prefix": {"shared_tokens": 64}})
    turns = by_session(simulate(sc, records=True).records)
    assert [[(r.num_prompt_tokens, r.num_cached_tokens) for r in turns[s]] for s in (0, 1)] == [
        [(100, 0), (164, 112)], [(100, 64), (164, 112)]]


def test_sessions_do_not_share_content():
    """Two sessions with the same lengths side by side: neither hits the other's blocks."""
    res = simulate(make({"num_sessions": 2, "turns": 2}, arrival={"process": "closed", "concurrency": 2}),
                   records=True)
    for turns in by_session(res.records).values():
        assert [r.num_cached_tokens for r in turns] == [0, 48]


def test_an_evicted_context_is_computed_again():
    """Two sessions of 80 + 24 tokens, then 4 + 24 more, in a pool of 9 usable blocks: the
    second session's first turn (7 blocks) waits for the first's, then takes the free blocks,
    evicting most of what the first session's turn left cached while its user thinks; with a
    large pool the first session's second turn hits all 6 blocks its first turn filled."""
    def run(blocks):
        sc = make({"num_sessions": 2, "turns": 2, "think_time_s": 5.0, "first_input_len": 80},
                  arrival={"process": "closed", "concurrency": 2},
                  workload={"input_len": 4}, engine={"num_gpu_blocks": blocks})
        return by_session(simulate(sc, records=True).records)

    big, small = run(400), run(10)
    assert [r.num_cached_tokens for r in big[0]] == [0, 96]
    first, second = small[0], small[1]
    assert second[0].scheduled_time >= first[0].finish_time  # it waited for the blocks
    assert first[1].arrival_time > second[0].finish_time
    assert first[1].num_cached_tokens < 96


# ----------------------------------------------------------------------------- conversation


def test_conversation_resends_everything_and_keys_are_public():
    plan = SessionPlan(7, (Turn(10, 5, 0.0), Turn(3, 4, 1.0), Turn(2, 6, 0.0)))
    conv = Conversation(plan, max_model_len=1000)
    a = conv.request(0)
    assert a.segments == ((SESSION_KEY_BASE, 10),) and a.output_key == SESSION_KEY_BASE + 1
    assert (a.session_id, a.turn) == (7, 0)
    conv.answered(5)
    b = conv.request(1)
    assert b.segments == ((SESSION_KEY_BASE, 10), (SESSION_KEY_BASE + 1, 5), (SESSION_KEY_BASE + 2, 3))
    assert b.num_prompt_tokens == 18
    assert conv.answered(2) == 1.0  # a short answer: the next prompt quotes the 2 tokens received
    c = conv.request(2)
    assert c.segments[-2:] == ((SESSION_KEY_BASE + 3, 2), (SESSION_KEY_BASE + 4, 2))
    assert c.num_prompt_tokens == 22
    conv.answered(6)
    assert conv.done and conv.request(3) is None


@pytest.mark.parametrize("on_overflow", ["truncate", "end"])
def test_overflow_truncates_oldest_turns_or_ends(on_overflow):
    plan = SessionPlan(0, (Turn(30, 20, 0.0), Turn(30, 20, 0.0), Turn(30, 20, 0.0)))
    conv = Conversation(plan, max_model_len=110, on_overflow=on_overflow)
    conv.request(0)
    conv.answered(20)
    conv.request(1)  # 50 + 30 + 20 = 100 <= 110
    conv.answered(20)
    third = conv.request(2)  # 100 + 30 + 20 = 150 > 110
    if on_overflow == "end":
        assert third is None and conv.ended and conv.truncated_turns == 0
    else:
        # Dropping turn 0 leaves 50 + 30 + 20 = 100 <= 110.
        assert third.num_prompt_tokens == 80 and third.segments[0][0] == SESSION_KEY_BASE + 2
        assert (conv.truncated_turns, conv.dropped_turns, conv.ended) == (1, 1, False)


def test_truncation_keeps_the_shared_prefix():
    plan = SessionPlan(0, (Turn(40, 20, 0.0), Turn(30, 20, 0.0), Turn(30, 20, 0.0)), prefix=(3, 16))
    conv = Conversation(plan, max_model_len=120)
    first = conv.request(0)
    assert first.segments == ((3, 16), (SESSION_KEY_BASE, 24)) and first.num_prompt_tokens == 40
    conv.answered(20)
    conv.request(1)  # 60 + 30 + 20 = 110
    conv.answered(20)
    third = conv.request(2)  # 110 + 50 > 120: turn 0 goes (24 + 20 tokens), the prefix stays
    assert third.segments[0] == (3, 16) and third.segments[1][0] == SESSION_KEY_BASE + 2
    assert third.num_prompt_tokens == 16 + 50 + 30 and conv.dropped_turns == 1


def test_overflow_is_counted_in_the_summary():
    sc = make({"num_sessions": 3, "turns": 12, "on_overflow": "end"}, engine={"max_model_len": 400})
    s = simulate(sc).summary.sessions
    # 40 + 24 per turn: turn k (0-based) needs 64 (k + 1) tokens, so turns 0-5 fit in 400.
    assert (s["turns"], s["ended_sessions"], s["truncated_turns"]) == (18, 3, 0)
    sc = make({"num_sessions": 3, "turns": 12}, engine={"max_model_len": 400})
    res = simulate(sc, records=True)
    s = res.summary.sessions
    assert s["turns"] == 36 and s["truncated_turns"] == 3 * 6 and s["ended_sessions"] == 0
    assert all(r.num_prompt_tokens + r.max_tokens <= 400 for r in res.records)


# ----------------------------------------------------------------------------- pacing

lengths = st.one_of(st.integers(1, 80), st.builds(lambda a, b: {"dist": "uniform", "low": a, "high": a + b},
                                                  st.integers(1, 60), st.integers(0, 60)))
thinks = st.one_of(st.floats(0, 3), st.builds(lambda m: {"dist": "exponential", "mean_s": m}, st.floats(0.01, 2)))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    turns=st.integers(1, 6), new=lengths, out=lengths, think=thinks,
    concurrency=st.integers(1, 4), num_sessions=st.integers(1, 6), open_loop=st.booleans(),
    block_size=st.sampled_from([4, 16]), max_model_len=st.sampled_from([300, 4096]),
    on_overflow=st.sampled_from(["truncate", "end"]), seed=st.integers(0, 2**31),
)
def test_next_turn_never_before_last_token_plus_think_time(
    turns, new, out, think, concurrency, num_sessions, open_loop, block_size, max_model_len,
    on_overflow, seed,
):
    arrival = ({"process": "poisson", "rate": 2.0} if open_loop
               else {"process": "closed", "concurrency": concurrency})
    sc = make({"num_sessions": num_sessions, "turns": {"dist": "uniform", "low": 1, "high": turns},
               "think_time_s": think, "on_overflow": on_overflow},
              arrival=arrival, workload={"input_len": new, "output_len": out},
              engine={"block_size": block_size, "max_model_len": max_model_len, "num_gpu_blocks": 2000},
              seed=seed)
    res = simulate(sc, records=True)
    workload = SessionWorkload(sc.workload, sc.seed)
    overflow = res.summary.sessions
    for sid, recs in by_session(res.records).items():
        plan = workload.plan(sid)
        assert [r.turn for r in recs] == list(range(len(recs)))
        assert len(recs) <= len(plan.turns)
        for prev, nxt in zip(recs, recs[1:]):
            think_s = plan.turns[prev.turn].think_s
            assert nxt.arrival_time >= prev.chunk_times[-1] + think_s
            assert prev.chunk_times[-1] == prev.finish_time
            if overflow["truncated_turns"] == 0:
                turn = plan.turns[nxt.turn]
                assert nxt.num_prompt_tokens == prev.num_prompt_tokens + prev.num_output_tokens + turn.new_tokens
        for r in recs:
            assert r.num_prompt_tokens + r.max_tokens <= max_model_len
            assert r.num_output_tokens == r.max_tokens


# ----------------------------------------------------------------------------- paths agree

CASES = {
    "closed": ({"num_sessions": 12, "turns": {"dist": "uniform", "low": 1, "high": 6},
                "think_time_s": {"dist": "exponential", "mean_s": 0.3}},
               {"process": "closed", "concurrency": 4}, None),
    "open": ({"num_sessions": 12, "turns": 4, "think_time_s": {"dist": "uniform", "low": 0, "high": 1},
              "first_input_len": {"dist": "uniform", "low": 100, "high": 400}},
             {"process": "poisson", "rate": 3.0}, None),
    "eagle": ({"num_sessions": 8, "turns": 5, "think_time_s": 0.2},
              {"process": "closed", "concurrency": 3},
              {"method": "eagle3", "num_speculative_tokens": 3, "acceptance_length": 2.6}),
    "truncate": ({"num_sessions": 6, "turns": 20, "think_time_s": 0.1},
                 {"process": "closed", "concurrency": 2}, None),
    "duration": ({"turns": 3, "think_time_s": 0.5}, {"process": "closed", "concurrency": 2}, None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_fast_path_equals_reference_path(name):
    sessions, arrival, spec = CASES[name]
    workload = {"input_len": {"dist": "uniform", "low": 20, "high": 120},
                "output_len": {"dist": "uniform", "low": 8, "high": 64}}
    if name == "duration":
        workload["duration_s"] = 5.0
    if name == "open":  # first turns open with one of two shared prefixes
        workload["prefix"] = {"shared_tokens": 64, "num_prefixes": 2}
    sc = make(sessions, arrival=arrival, speculative=spec, workload=workload,
              engine={"num_gpu_blocks": 60, "max_model_len": 800})
    fast = simulate(sc, records=True, steps=True)
    ref = simulate(sc, fast=False, records=True, steps=True)
    assert json.dumps(fast.to_dict()) == json.dumps(ref.to_dict())
    assert [r.to_dict() for r in fast.records] == [r.to_dict() for r in ref.records]
    assert fast.summary.sessions["turns"] > fast.summary.sessions["sessions"]
    if name == "truncate":
        assert fast.summary.sessions["truncated_turns"] > 0
    # The one metrics path: the records give the same sessions block.
    overflow = {k: fast.summary.sessions[k] for k in ("truncated_turns", "dropped_turns", "ended_sessions")}
    assert summarize(fast.records, session_overflow=overflow).sessions == fast.summary.sessions
    # Same scenario and seed, same bytes.
    assert json.dumps(simulate(sc).to_dict()) == json.dumps(fast.to_dict())


def test_a_session_is_drawn_the_same_whatever_the_arrivals():
    a = make({"num_sessions": 5, "turns": {"dist": "uniform", "low": 1, "high": 9},
              "think_time_s": {"dist": "exponential", "mean_s": 1.0}},
             arrival={"process": "poisson", "rate": 1.0})
    b = make(dict(a.workload.sessions.model_dump()), arrival={"process": "closed", "concurrency": 3})
    wa, wb = SessionWorkload(a.workload, 0), SessionWorkload(b.workload, 0)
    assert [wa.plan(i) for i in range(5)] == [wb.plan(i) for i in range(5)]
    assert wa.plan(0) != SessionWorkload(a.workload, 1).plan(0)


def test_session_plot(tmp_path):
    sc = make({"num_sessions": 6, "turns": 4, "think_time_s": 0.2}, arrival={"process": "closed", "concurrency": 2})
    res = simulate(sc, records=True, steps=True)
    paths = write_simulation_plots(res, tmp_path)
    assert tmp_path / "sessions.png" in paths and (tmp_path / "sessions.png").stat().st_size > 10_000
    plain = simulate(make({"num_sessions": 1, "turns": 1}), records=True, steps=True)
    assert plain.summary.sessions is not None
