"""Multi-turn sessions against a REAL vLLM CPU server: turns paced by the answers, prompts that
resend the conversation token for token, and the validation of prefix hits and TTFT by turn."""

from __future__ import annotations

import json

import pytest

from simcap.live.validate import validate
from simcap.metrics.records import RequestRecord
from simcap.workloads.sessions import SessionWorkload

pytestmark = pytest.mark.live

FIRST, NEW, OUT, TURNS, SESSIONS, THINK = 160, 32, 16, 3, 4, 0.3


def _sessions(num_sessions=SESSIONS, turns=TURNS):
    return dict(arrival={"process": "closed", "concurrency": 2}, input_len=NEW, output_len=OUT,
                sessions={"num_sessions": num_sessions, "turns": turns, "first_input_len": FIRST,
                          "think_time_s": THINK})


def test_live_sessions_are_paced_by_answers_and_validated_by_turn(base_url, scenario_for, server_speed, tmp_path):
    # A step model from the server's measured speed (the printed TTFT comparison is then
    # about this machine; no test holds it to a bound).
    from tests.live.conftest import PREFILL_PROBE_TOKENS

    step = dict(base=server_speed.decode_step_s, per_decode_token=0.0,
                per_prefill_token=max(server_speed.prefill_s - server_speed.decode_step_s, 0.0) / PREFILL_PROBE_TOKENS,
                host_overhead=max(server_speed.decode_period_s - server_speed.decode_step_s, 0.0))
    sc = scenario_for(_sessions(), seed=3, step_time=step)
    result = validate(sc, base_url, "tiny", repeats=1, warmup=False, out_prefix=str(tmp_path / "s"))
    data = result.to_dict()
    json.dumps(data, allow_nan=False)
    run = result.repeats[0].live
    assert run.sessions == {"sessions": SESSIONS, "ended_by_error": 0, "truncated_turns": 0,
                            "dropped_turns": 0, "ended_sessions": 0}
    assert len(run.records) == SESSIONS * TURNS and all(r.succeeded for r in run.records)
    plans = SessionWorkload(sc.workload, sc.seed)
    by_session: dict[int, list[RequestRecord]] = {}
    for rec in sorted(run.records, key=lambda r: r.arrival_time):
        by_session.setdefault(rec.session_id, []).append(rec)
    assert sorted(by_session) == list(range(SESSIONS))
    for sid, recs in by_session.items():
        assert [r.turn for r in recs] == list(range(TURNS))
        assert len({r.client_id for r in recs}) == 1  # a session stays on its client
        for prev, nxt in zip(recs, recs[1:]):
            # Turn k+1 is sent after turn k's last token plus the think time.
            assert nxt.arrival_time >= prev.finish_time + plans.plan(sid).turns[prev.turn].think_s
            # The server counted exactly the conversation so far: prompt, answer, new tokens.
            assert nxt.num_prompt_tokens == prev.num_prompt_tokens + OUT + NEW
        assert recs[0].num_prompt_tokens == FIRST
        for rec in recs:
            assert rec.num_output_tokens == OUT
    # Each later turn hits every full block the previous turn computed (its answer's last
    # token is never computed), as the server reports per request.
    for recs in by_session.values():
        for prev, nxt in zip(recs, recs[1:]):
            assert nxt.num_cached_tokens == 32 * ((prev.num_prompt_tokens + OUT - 1) // 32)
        assert recs[0].num_cached_tokens == 0
    # Records reached disk with their session and turn.
    back = [RequestRecord.from_dict(json.loads(line)) for line in (tmp_path / "s0.jsonl").read_text().splitlines()]
    assert sorted(back, key=lambda r: r.request_id) == run.records

    sessions = data["sessions"]
    print("\nlive sessions: " + "; ".join(
        f"{name} live {m['live_median']:.3f} predicted {m['predicted']:.3f}"
        for name, m in (("prefix hit rate", sessions["prefix_hit_rate"]),
                        ("prefix hit share", sessions["prefix_hit_share"]))))
    # The server's prefix-hit rate (its /metrics counters) is measured and compared with the
    # simulated engine's: the same content, so the same hits.
    rate = sessions["prefix_hit_rate"]
    assert 0 < rate["live"][0] < 1 and rate["predicted"] == pytest.approx(rate["live"][0], abs=0.01)
    assert data["repeats"][0]["server"]["prefix_cache_hits"] > 0
    share = sessions["prefix_hit_share"]
    assert share["predicted"] == pytest.approx(share["live"][0], abs=1e-9)
    # TTFT by turn index: every turn compared, as many turns on both sides.
    assert [row["turn"] for row in sessions["by_turn"]] == list(range(TURNS))
    for row in sessions["by_turn"]:
        assert row["live_requests"] == row["predicted_requests"] == [SESSIONS]
        for stat in ("mean", "p50", "p90"):
            m = row[f"ttft_{stat}"]
            assert m["live"][0] > 0 and m["predicted"] > 0 and m["rel_error"] is not None
            print(f"  turn {row['turn']} TTFT {stat}: live {m['live'][0] * 1e3:.1f} ms, "
                  f"predicted {m['predicted'] * 1e3:.1f} ms")
        assert row["prefix_hit_share"]["predicted"] == pytest.approx(row["prefix_hit_share"]["live"][0], abs=1e-9)
    assert data["replay"]["mode"] == "sessions"


def test_live_run_cli_sends_sessions(base_url, write_yaml, live_cli, tmp_path):
    from tests.live.conftest import ENGINE, STEP_TIME

    path = write_yaml(tmp_path / "s.yaml", {"engine": ENGINE, "step_time": STEP_TIME,
                                            "workload": _sessions(num_sessions=2, turns=2)})
    code, out, err = live_cli("run", path, "--base-url", base_url, "--json", "--out", tmp_path / "r.jsonl")
    assert code == 0, err
    data = json.loads(out)
    assert data["live"]["sessions"]["sessions"] == 2 and data["live"]["rate_unit"] == "sessions/s"
    assert data["sessions"]["turns"] == 4 and data["sessions"]["by_turn"][1]["prefix_hit_share"] > 0
    assert len((tmp_path / "r.jsonl").read_text().splitlines()) == 4
