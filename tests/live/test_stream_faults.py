"""Faults a real server cannot produce on demand: cut streams, malformed SSE, HTTP errors.

The ONLY place live mode runs against a fake: an in-process ``httpx.MockTransport`` that
speaks vLLM's streaming protocol, so each fault is injected into one known request and the
test checks that it is recorded as an error while every other request is kept intact; and
two such hosts behind one transport, to check which host each routed request went to; a host
whose TTFT count races the client's first-wave scrape (it must not be kept). Also
the client's check for a cancellation ``asyncio.wait_for`` swallows (no server at all). (It
needs no server, so it runs in the default test suite.)
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from simcap.config.scenario import parse_scenario
from simcap.live.client import run_live
from simcap.live.routing import LiveRouterError
from simcap.metrics.records import RequestRecord

N = 10
CUT, MALFORMED, HTTP_500, NO_DONE, USAGE_MORE, ERROR_EVENT = 2, 4, 5, 6, 7, 8


class _Body(httpx.AsyncByteStream):
    def __init__(self, parts: list[bytes], fail: bool = False) -> None:
        self.parts, self.fail = parts, fail

    async def __aiter__(self):
        for part in self.parts:
            yield part
        if self.fail:
            raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")


def _sse(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


class FakeVllm:
    """Answers requests in arrival order (closed loop, one client): request i gets fault i."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/health":
            return httpx.Response(200)
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "fake", "max_model_len": 4096}]})
        if path == "/tokenize":
            return httpx.Response(200, json={"tokens": list(range(10, 100)), "count": 90})
        if path == "/metrics":
            return httpx.Response(404)
        assert path == "/v1/completions"
        body = json.loads(request.content)
        i, self.calls = self.calls, self.calls + 1
        n, prompt = body["max_tokens"], len(body["prompt"])
        if i == HTTP_500:
            return httpx.Response(500, json={"error": {"message": "engine dead"}})
        parts = [_sse({"choices": [{"text": "", "prompt_token_ids": body["prompt"], "finish_reason": None}]})]
        for k in range(n):
            choice = {"text": "x", "finish_reason": "length" if k == n - 1 else None}
            if i != USAGE_MORE:
                choice["token_ids"] = [7]
            parts.append(_sse({"choices": [choice]}))
            if i == MALFORMED and k == 2:
                parts.append(b"data: {not json\n\n")
            if i == ERROR_EVENT and k == 1:
                parts.append(_sse({"error": {"message": "out of memory", "code": 500}}))
        completion = n + 3 if i == USAGE_MORE else n
        parts.append(_sse({"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion}}))
        if i != NO_DONE:
            parts.append(_sse(b"[DONE]"))
        if i == CUT:
            return httpx.Response(200, stream=_Body(parts[:4], fail=True))
        return httpx.Response(200, stream=_Body(parts))


def test_faults_recorded_without_losing_other_records(tmp_path):
    sc = parse_scenario(
        {
            "engine": dict(block_size=32, num_gpu_blocks=1000, max_model_len=4096),
            "workload": dict(arrival={"process": "closed", "concurrency": 1}, num_requests=N,
                             input_len={"dist": "uniform", "low": 20, "high": 60}, output_len=6),
        }
    )
    out = tmp_path / "run.jsonl"
    run = run_live(sc, "http://fake:8000", transport=httpx.MockTransport(FakeVllm()),
                   out_path=out, progress=False)

    by_id = {r.request_id: r for r in run.records}
    assert sorted(by_id) == list(range(N))
    failed = {i for i, r in by_id.items() if not r.succeeded}
    assert failed == {CUT, MALFORMED, HTTP_500, NO_DONE, ERROR_EVENT}
    assert "RemoteProtocolError" in by_id[CUT].error and "after 3 chunks" in by_id[CUT].error
    assert "malformed SSE" in by_id[MALFORMED].error
    assert by_id[HTTP_500].error.startswith("HTTP 500") and "engine dead" in by_id[HTTP_500].error
    assert "without [DONE]" in by_id[NO_DONE].error
    assert "out of memory" in by_id[ERROR_EVENT].error
    for i in failed:
        assert by_id[i].finish_reason == "error"
    for i in set(by_id) - failed:
        rec = by_id[i]
        assert rec.num_output_tokens == 6 + (3 if i == USAGE_MORE else 0)
        assert rec.finish_reason == "length" and rec.finish_time == rec.chunk_times[-1]
        assert rec.num_prompt_tokens == sum(n for _, n in run.specs[i].segments)
    # Chunk counts that disagree with usage are fixed from usage, and the fix is reported.
    assert run.token_fixups == [{"request_id": USAGE_MORE, "chunk_tokens": 6, "usage_tokens": 9}]
    assert by_id[USAGE_MORE].chunk_tokens[-1] == 4
    # Every request, failed or not, is in the JSONL file and parses back.
    lines = out.read_text().splitlines()
    assert len(lines) == N
    back = {RequestRecord.from_dict(json.loads(line)).request_id: RequestRecord.from_dict(json.loads(line)) for line in lines}
    assert back == by_id
    # The summary counts failures; no metrics server means no cross-check, said so.
    summary = run.summary()
    assert summary.completed == N - len(failed) and summary.failed == len(failed)
    assert run.server_delta() == {"available": False}
    assert any("/metrics" in note for note in run.notes)


# --------------------------------------------------------------------------- timeout, API key

KEY = "sk-simcap-test-7f3a9c"
STALL = 3


class GuardedFakeVllm(FakeVllm):
    """Wants ``Authorization: Bearer KEY`` on /v1 (as vLLM's --api-key); request STALL hangs."""

    def __init__(self, key: str | None = KEY, stall_s: float = 30.0) -> None:
        super().__init__()
        self.key, self.stall_s = key, stall_s
        self.auth_seen: list[str | None] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.auth_seen.append(request.headers.get("authorization"))
        if path.startswith("/v1") and request.headers.get("authorization") != f"Bearer {self.key}":
            # A careless server echoing the header it got: the client must mask it.
            return httpx.Response(401, json={"error": f"Unauthorized: {request.headers.get('authorization')}"})
        if path == "/v1/completions" and self.calls == STALL:
            self.calls += 1
            first = _sse({"choices": [{"text": "x", "token_ids": [7], "finish_reason": None}]})
            return httpx.Response(200, stream=_Stall([first, first], self.stall_s))
        if path == "/v1/completions" and self.calls in (CUT, MALFORMED, HTTP_500, NO_DONE, USAGE_MORE, ERROR_EVENT):
            self.calls += 1  # only the stall is injected here: skip FakeVllm's own faults
            return self._plain(json.loads(request.content))
        return super().__call__(request)

    def _plain(self, body) -> httpx.Response:
        n = body["max_tokens"]
        parts = [_sse({"choices": [{"text": "x", "token_ids": [7], "finish_reason": "length" if k == n - 1 else None}]})
                 for k in range(n)]
        parts.append(_sse({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}}))
        parts.append(_sse(b"[DONE]"))
        return httpx.Response(200, stream=_Body(parts))


class _Stall(httpx.AsyncByteStream):
    def __init__(self, parts: list[bytes], stall_s: float) -> None:
        self.parts, self.stall_s = parts, stall_s

    async def __aiter__(self):
        import asyncio

        for part in self.parts:
            yield part
        await asyncio.sleep(self.stall_s)  # the server stops sending mid-stream
        yield _sse(b"[DONE]")


def _scenario():
    return parse_scenario(
        {
            "engine": dict(block_size=32, num_gpu_blocks=1000, max_model_len=4096),
            "workload": dict(arrival={"process": "closed", "concurrency": 1}, num_requests=6,
                             input_len={"dist": "uniform", "low": 20, "high": 60}, output_len=5),
        }
    )


def test_request_timeout_is_a_failed_request_with_its_reason(tmp_path):
    import time

    fake = GuardedFakeVllm(stall_s=30.0)
    out = tmp_path / "run.jsonl"
    t0 = time.monotonic()
    run = run_live(_scenario(), "http://fake:8000", transport=httpx.MockTransport(fake), api_key=KEY,
                   request_timeout_s=0.5, out_path=out, progress=False)
    assert time.monotonic() - t0 < 10  # the stalled request was cut, not waited for
    by_id = {r.request_id: r for r in run.records}
    assert sorted(by_id) == list(range(6))
    stalled = by_id[STALL]
    assert not stalled.succeeded and stalled.finish_reason == "error"
    assert stalled.error.startswith("timeout: ") and "0.5 s" in stalled.error and "after 2 chunks" in stalled.error
    assert stalled.chunk_times and stalled.finish_time == stalled.chunk_times[-1]  # what arrived is kept
    for i in set(by_id) - {STALL}:
        assert by_id[i].succeeded and by_id[i].num_output_tokens == 5
    assert run.summary().failed == 1
    assert len(out.read_text().splitlines()) == 6


def test_api_key_sent_as_bearer_and_never_written(tmp_path):
    fake = GuardedFakeVllm(stall_s=0.0)
    out = tmp_path / "run.jsonl"
    run = run_live(_scenario(), "http://fake:8000", transport=httpx.MockTransport(fake), api_key=KEY,
                   out_path=out, progress=False)
    assert all(r.succeeded for r in run.records)
    assert set(fake.auth_seen) == {f"Bearer {KEY}"}  # every request, /v1 or not
    text = json.dumps(run.to_dict()) + out.read_text() + repr(run)
    assert KEY not in text


def test_missing_or_wrong_api_key_fails_fast_with_one_line_and_no_echo():
    import pytest

    from simcap.live.client import LiveError

    for key in (None, "wrong-key-123"):
        fake = GuardedFakeVllm()
        with pytest.raises(LiveError) as info:
            run_live(_scenario(), "http://fake:8000", transport=httpx.MockTransport(fake), api_key=key,
                     progress=False)
        msg = str(info.value)
        assert "HTTP 401" in msg and "API key" in msg and "SIMCAP_API_KEY" in msg
        assert len(msg.splitlines()) == 1
        assert key is None or key not in msg
        assert fake.calls == 0  # nothing was sent to the completions endpoint


def test_server_echo_of_the_key_in_a_request_error_is_masked():
    class Echo(GuardedFakeVllm):
        def __call__(self, request):
            if request.url.path == "/v1/completions":
                self.calls += 1
                return httpx.Response(400, json={"error": {"message": f"bad header {request.headers['authorization']}"}})
            return super().__call__(request)

    run = run_live(_scenario(), "http://fake:8000", transport=httpx.MockTransport(Echo()), api_key=KEY,
                   progress=False)
    assert all(r.error and r.error.startswith("HTTP 400") for r in run.records)
    assert all(KEY not in r.error and "***" in r.error for r in run.records)


# --------------------------------------------------------------------------- several servers


class TwoFakeServers(FakeVllm):
    """Two hosts behind one transport, answering without faults; each request's host is kept."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 1000  # past every fault index
        self.hosts: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/completions":
            self.hosts.append(request.url.host)
        return super().__call__(request)


def test_several_base_urls_route_each_request_and_record_its_replica():
    sc = parse_scenario(
        {
            "engine": dict(block_size=32, num_gpu_blocks=1000, max_model_len=4096),
            "workload": dict(arrival={"process": "closed", "concurrency": 1}, num_requests=7,
                             input_len=40, output_len=3),
            "deployment": {"replicas": 2, "router": "roundrobin"},
        }
    )
    fake = TwoFakeServers()
    run = run_live(sc, ["http://a:8000", "http://b:8000/"], transport=httpx.MockTransport(fake), progress=False)
    assert [r.replica for r in run.records] == [0, 1, 0, 1, 0, 1, 0]
    assert fake.hosts == ["a", "b", "a", "b", "a", "b", "a"]
    fleet = run.to_dict()["fleet"]
    assert fleet["router"] == "roundrobin"
    assert [(r["base_url"], r["requests"], r["completed"]) for r in fleet["per_replica"]] == [
        ("http://a:8000", 4, 4), ("http://b:8000", 3, 3)]
    assert fleet["load_imbalance"]["requests"] == pytest.approx(4 / 3.5)
    assert run.metrics_before is None and run.server_delta() == {"available": False}
    from rich.console import Console

    from simcap.metrics.report import render_live_fleet

    console = Console(record=True, width=160)
    render_live_fleet(fleet, console)
    text = console.export_text()
    assert "router roundrobin" in text and "http://b:8000" in text
    assert "load imbalance (max / mean): requests 1.143, tokens 1.143" in text
    with pytest.raises(LiveRouterError, match="deployment.replicas is 2 but 3"):
        run_live(sc, ["http://a:1", "http://b:1", "http://c:1"], progress=False)
    with pytest.raises(LiveRouterError, match="deployment.replicas is 2 but 1"):
        run_live(sc, "http://a:1", progress=False)


# --------------------------------------------------------------------------- sessions

FAIL_CALL = 4  # the 5th completion request sent fails (HTTP 500): its session ends there


class SessionFakeVllm(FakeVllm):
    """Answers each request with ids of its own (200 + 10 * call + k), keeps every prompt it
    got, reports the cached tokens of each prompt (``prompt_tokens_details``), and fails one."""

    def __init__(self, fail_call: int | None = FAIL_CALL, details: bool = True) -> None:
        super().__init__()
        self.fail_call, self.details = fail_call, details
        self.prompts: list[list[int]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path != "/v1/completions":
            return super().__call__(request)
        body = json.loads(request.content)
        i, self.calls = self.calls, self.calls + 1
        self.prompts.append(body["prompt"])
        assert body["return_token_ids"] is True
        if i == self.fail_call:
            return httpx.Response(500, json={"error": {"message": "engine dead"}})
        n = body["max_tokens"]
        parts = [_sse({"choices": [{"text": "x", "token_ids": [200 + 10 * i + k],
                                    "finish_reason": "length" if k == n - 1 else None}]}) for k in range(n)]
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
        if self.details:
            usage["prompt_tokens_details"] = {"cached_tokens": 32 * (len(body["prompt"]) // 64)}
        parts += [_sse({"choices": [], "usage": usage}), _sse(b"[DONE]")]
        return httpx.Response(200, stream=_Body(parts))


def test_sessions_resend_the_answers_ids_and_an_errored_turn_ends_its_session(tmp_path):
    from simcap.workloads.sessions import SessionWorkload

    sc = parse_scenario({
        "engine": dict(block_size=32, num_gpu_blocks=1000, max_model_len=4096),
        "workload": dict(arrival={"process": "closed", "concurrency": 2}, input_len=8, output_len=5,
                         sessions={"num_sessions": 4, "turns": 3, "first_input_len": 40,
                                   "think_time_s": {"dist": "uniform", "low": 0.02, "high": 0.06}}),
    })
    fake = SessionFakeVllm()
    out = tmp_path / "run.jsonl"
    run = run_live(sc, "http://fake:8000", transport=httpx.MockTransport(fake), out_path=out, progress=False)

    assert run.sessions == {"sessions": 4, "ended_by_error": 1, "truncated_turns": 0, "dropped_turns": 0,
                            "ended_sessions": 0}
    assert any("1 session(s) ended at an errored turn" in note for note in run.notes)
    # Request ids in send order; 4 sessions x 3 turns, less the failed session's later turns.
    assert [r.request_id for r in run.records] == list(range(len(fake.prompts)))
    failed = [r for r in run.records if not r.succeeded]
    assert len(failed) == 1 and failed[0].request_id == FAIL_CALL
    ended = failed[0].session_id
    plans = SessionWorkload(sc.workload, sc.seed)
    by_session: dict[int, list[RequestRecord]] = {}
    for rec in run.records:
        assert rec.session_id is not None and rec.client_id in (0, 1)
        by_session.setdefault(rec.session_id, []).append(rec)
    assert sorted(by_session) == [0, 1, 2, 3]
    for sid, recs in by_session.items():
        assert [r.turn for r in recs] == list(range(len(recs)))
        assert len(recs) == (failed[0].turn + 1 if sid == ended else 3)
        think = [t.think_s for t in plans.plan(sid).turns]
        for prev, nxt in zip(recs, recs[1:]):
            # Turn k+1 goes out after turn k's last token plus its think time, and its prompt
            # is turn k's prompt, turn k's answer as it came back, then 8 new tokens.
            assert nxt.arrival_time >= prev.finish_time + think[prev.turn]
            answer = [200 + 10 * prev.request_id + k for k in range(5)]
            sent = fake.prompts[nxt.request_id]
            assert sent[: prev.num_prompt_tokens + 5] == fake.prompts[prev.request_id] + answer
            assert len(sent) == prev.num_prompt_tokens + 5 + 8 == nxt.num_prompt_tokens
        assert recs[0].num_prompt_tokens == 40
    # The server's cached tokens are the records' prefix hits; the per-turn summary has them.
    ok = [r for r in run.records if r.succeeded]
    assert [r.num_cached_tokens for r in ok] == [32 * (r.num_prompt_tokens // 64) for r in ok]
    sessions = run.summary().sessions
    assert sessions["sessions"] == 4 and sessions["completed_sessions"] == 3
    assert [row["turn"] for row in sessions["by_turn"]] == [0, 1, 2]
    turn1 = [r for r in ok if r.turn == 1]
    assert sessions["by_turn"][1]["prefix_hit_share"] == pytest.approx(
        sum(r.num_cached_tokens for r in turn1) / sum(r.num_prompt_tokens for r in turn1))
    # Every record, the failed one too, is on disk with its session and turn.
    back = [RequestRecord.from_dict(json.loads(line)) for line in out.read_text().splitlines()]
    assert sorted(back, key=lambda r: r.request_id) == run.records
    assert json.loads(json.dumps(run.to_dict()))["live"]["sessions"]["ended_by_error"] == 1


def test_open_loop_sessions_without_cached_tokens_leave_prefix_shares_unknown():
    from simcap.workloads.sessions import SessionWorkload

    sc = parse_scenario({
        "engine": dict(block_size=32, num_gpu_blocks=1000, max_model_len=4096),
        "workload": dict(arrival={"process": "poisson", "rate": 20.0}, input_len=8, output_len=3,
                         sessions={"num_sessions": 3, "turns": 2, "think_time_s": 0.01}),
    })
    run = run_live(sc, "http://fake:8000", transport=httpx.MockTransport(SessionFakeVllm(None, details=False)),
                   progress=False)
    assert all(r.succeeded and r.client_id is None for r in run.records) and len(run.records) == 6
    # Sessions start at their drawn start times; the rate is of sessions.
    starts = SessionWorkload(sc.workload, sc.seed).start_times()
    first = sorted(r.arrival_time for r in run.records if r.turn == 0)
    assert all(t >= s for t, s in zip(first, starts))
    assert run.to_dict()["live"]["rate_unit"] == "sessions/s" and run.requested_rate == 20.0
    # No per-request cached tokens from the server: per-turn shares are unknown, not 0.
    assert run.cached_tokens_reported == 0
    sessions = run.summary().sessions
    assert sessions["prefix_hit_share"] is None
    assert [row["prefix_hit_share"] for row in sessions["by_turn"]] == [None, None]
    assert any("--enable-prompt-tokens-details" in note for note in run.notes)


def test_a_live_session_run_replays_as_its_sessions_in_the_simulator():
    from simcap.fleet.run import simulate
    from simcap.live.validate import Repeat, compare_sessions, session_trace_of

    sc = parse_scenario({
        "engine": dict(block_size=16, num_gpu_blocks=1000, max_model_len=4096, max_num_seqs=4,
                       max_num_batched_tokens=256),
        "step_time": dict(base=0.004, per_prefill_token=1e-5, per_decode_token=1e-4),
        "workload": dict(arrival={"process": "closed", "concurrency": 2}, input_len=8, output_len=5,
                         sessions={"num_sessions": 4, "turns": 3, "first_input_len": 40, "think_time_s": 0.02}),
    })
    run = run_live(sc, "http://fake:8000", transport=httpx.MockTransport(SessionFakeVllm()), progress=False)
    trace = session_trace_of(run)
    ok = sorted((r for r in run.records if r.succeeded), key=lambda r: r.arrival_time)
    # The closed loop's 2 clients, each its sessions' turns in order; the failed turn is out.
    assert len(trace.clients) == 2 and trace.num_requests == len(ok) == len(run.records) - 1
    for c, requests in enumerate(trace.clients):
        live = [r for r in ok if r.client_id == c]
        assert [(q.spec.session_id, q.spec.turn) for q in requests] == [(r.session_id, r.turn) for r in live]
        for q, prev, rec in zip(requests[1:], live, live[1:]):
            assert q.gap_s == pytest.approx(rec.arrival_time - prev.finish_time)
            if rec.session_id == prev.session_id:
                assert q.gap_s >= 0.02  # the think time, measured
        for q, rec in zip(requests, live):
            spec = run.specs[rec.request_id]
            assert q.spec.segments == spec.segments and q.spec.output_key == spec.output_key
            assert q.spec.max_tokens == rec.num_output_tokens
    sim = simulate(sc, trace=trace, records=True)
    sim_sessions = sim.summary.sessions
    assert [row["requests"] for row in sim_sessions["by_turn"]] == [
        sum(1 for r in ok if r.turn == k) for k in range(3)]
    # Later turns resend turn 0's blocks: the simulated engine hits them, and counts it.
    assert sim_sessions["by_turn"][0]["prefix_hit_share"] == 0.0
    assert sim_sessions["by_turn"][1]["prefix_hit_share"] > 0.5
    assert 0 < sim.prefix_cache["hits"] < sim.prefix_cache["queries"]
    rep = Repeat(0, run, run.summary(), sim.summary, sim.records, {}, "skipped", sim_prefix_cache=sim.prefix_cache)
    cmp = compare_sessions([rep])
    assert cmp["prefix_hit_rate"]["live"] == [None]  # the fake has no /metrics
    assert cmp["prefix_hit_rate"]["predicted"] == pytest.approx(sim.prefix_cache["hits"] / sim.prefix_cache["queries"])
    assert [row["turn"] for row in cmp["by_turn"]] == [0, 1, 2]
    for row in cmp["by_turn"]:
        live_row = run.summary().sessions["by_turn"][row["turn"]]
        assert row["ttft_p50"]["live"] == [live_row["ttft_s"]["p50"]]
        assert row["ttft_p50"]["predicted"] == sim_sessions["by_turn"][row["turn"]]["ttft_s"]["p50"]
        assert row["live_requests"] == row["predicted_requests"]


def test_a_cancellation_wait_for_swallows_still_stops_the_client_loop():
    """Before Python 3.12 ``asyncio.wait_for`` returns its result when a cancellation arrives as
    the awaited request completes (a Ctrl-C then went unheard until the whole workload was
    sent); ``cancel_requested`` still sees it, which is what each finished request checks."""
    import asyncio

    from simcap.live.client import cancel_requested

    async def scene():
        done = asyncio.get_running_loop().create_future()

        async def request():
            return await done

        async def client():
            result = await asyncio.wait_for(request(), 10)
            return result, cancel_requested()

        task = asyncio.create_task(client())
        for _ in range(3):
            await asyncio.sleep(0)
        done.set_result("finished")
        task.cancel()  # as the request completes
        try:
            return await task
        except asyncio.CancelledError:
            return "cancelled", True

    outcome = asyncio.run(scene())
    assert outcome[1], outcome  # swallowed (3.11) or delivered (3.12+): either way, seen


def test_no_cancellation_is_seen_where_none_was_asked():
    import asyncio

    from simcap.live.client import cancel_requested

    async def scene():
        return cancel_requested()

    assert asyncio.run(scene()) is False


# --------------------------------------------------------------------------- the load generator's own pauses

HELD = 3


class HoldingFakeVllm(GuardedFakeVllm):
    """Answers every request plainly, but request HELD holds the client's event loop for
    ``hold_s`` before its stream starts (a blocking call where an await should be), as a
    descheduled or collecting load generator would."""

    def __init__(self, hold_s: float) -> None:
        super().__init__(key=None)
        self.hold_s = hold_s

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path != "/v1/completions":
            return FakeVllm.__call__(self, request)
        i, self.calls = self.calls, self.calls + 1
        if i == HELD:
            time.sleep(self.hold_s)  # (the transport runs on the client's event loop)
        return self._plain(json.loads(request.content))


def test_a_pause_of_the_load_generator_is_measured_recorded_and_named(tmp_path):
    from simcap.live.client import PAUSE_DISTURBS_S, PAUSE_MIN_S, pause_spans
    from simcap.live.recording import load_run, save_run
    from simcap.live.validate import Repeat

    run = run_live(_scenario(), "http://fake:8000", transport=httpx.MockTransport(HoldingFakeVllm(0.3)),
                   progress=False)
    pauses = run.client_pauses
    assert pauses is not None
    # The 0.3 s hold is one pause (the watch woke at most one probe period into it), within the run.
    held = [p for p in pauses if p[1] >= 0.25]
    assert len(held) == 1 and held[0][1] < 0.3 + 0.2 and 0 <= held[0][0] <= run.wall_duration_s
    assert all(p[1] >= PAUSE_MIN_S for p in pauses)
    # Request HELD was sent before the hold and got its first chunk after it.
    assert HELD in pause_spans(run.records, pauses)
    assert run.longest_pause_s >= 0.25 and run.paused
    assert any("the load generator paused" in note for note in run.notes)
    # Kept by a recording, and a run recorded before the watch existed has none (None, not []).
    back = load_run(save_run(tmp_path / "r.run.json.gz", run)).run
    assert back.client_pauses == pauses
    old = load_run(Path(__file__).parents[2] / "calibration/corpus/cpu-dense-frontend/closed-2/i0r0.run.json.gz").run
    assert old.client_pauses is None and old.longest_pause_s == 0.0
    # A validation leaves such a run out, as it does a run disturbed by foreign CPU use.
    summary = run.summary()
    rep = Repeat(0, run, summary, summary, run.records, {"disturbed": False}, "ok")
    assert rep.disturbed and rep.to_dict()["client_pauses"] == pauses
    # So does a live crossover's arm point (and a live capacity run's facts, by the same rule).
    from simcap.live.crossover_arms import MeasuredPoint

    arm = MeasuredPoint("spec", run=run, concurrency=1, cpu={"disturbed": False}, prefix_cache_reset="ok")
    assert arm.to_dict()["disturbed"] and arm.to_dict()["client_pauses"] == pauses
    run.client_pauses = [[1.0, PAUSE_DISTURBS_S / 2]]
    assert not rep.disturbed and not arm.to_dict()["disturbed"]


def test_pause_spans_hand_computed():
    from simcap.live.client import pause_spans

    def rec(i, sent, first):
        return RequestRecord(i, sent, 10, 2, chunk_times=[first, first + 0.01], chunk_tokens=[1, 1],
                             finish_time=first + 0.01)

    records = [rec(0, 0.0, 0.05), rec(1, 0.2, 0.35), rec(2, 0.4, 0.45), rec(3, 0.31, 0.5), rec(4, 1.0, 1.0)]
    # A pause from 0.3 s to 0.42 s: request 1 (0.2-0.35) and 3 (0.31-0.5) wait through part of
    # it, request 2 (sent 0.4) too; request 0 ended before it; request 4 came after.
    assert pause_spans(records, [[0.3, 0.12]]) == {1, 2, 3}
    assert pause_spans(records, []) == set()
    assert pause_spans(records, [[0.05, 0.1]]) == set()  # (request 0's first chunk came as it began)


# --------------------------------------------------------------------------- the first-wave scrape


class _SlowBody(httpx.AsyncByteStream):
    """The first token at once, the rest after ``pause_s``: a first wave that decodes a while."""

    def __init__(self, parts: list[bytes], pause_s: float) -> None:
        self.parts, self.pause_s = parts, pause_s

    async def __aiter__(self):
        import asyncio

        yield self.parts[0] + self.parts[1]
        await asyncio.sleep(self.pause_s)
        for part in self.parts[2:]:
            yield part


class CountingFakeVllm(FakeVllm):
    """Counts the first tokens it sent in a TTFT histogram on /metrics (``extra``: first tokens
    it claims beyond those, as a server that counted a request the client had not seen)."""

    def __init__(self, extra: int = 0) -> None:
        super().__init__()
        self.first_tokens = self.done = 0
        self.extra = extra

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            n = self.first_tokens + (self.extra if self.first_tokens else 0)
            return httpx.Response(200, text=(
                "# TYPE vllm:time_to_first_token_seconds histogram\n"
                f'vllm:time_to_first_token_seconds_bucket{{le="+Inf",model_name="fake"}} {n}\n'
                f'vllm:time_to_first_token_seconds_count{{model_name="fake"}} {n}\n'
                f'vllm:time_to_first_token_seconds_sum{{model_name="fake"}} {0.05 * n}\n'
                "# TYPE vllm:request_success_total counter\n"
                f'vllm:request_success_total{{model_name="fake",finished_reason="length"}} {self.done}\n'
            ))
        if request.url.path != "/v1/completions":
            return super().__call__(request)
        body = json.loads(request.content)
        self.calls += 1
        self.first_tokens += 1
        self.done += 1  # (counted once the stream is handed over: the settled scrape's count)
        n = body["max_tokens"]
        parts = [_sse({"choices": [{"text": "", "finish_reason": None}]})]
        parts += [_sse({"choices": [{"text": "x", "token_ids": [7], "finish_reason": "length" if k == n - 1 else None}]})
                  for k in range(n)]
        parts += [_sse({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}}),
                  _sse(b"[DONE]")]
        return httpx.Response(200, stream=_SlowBody(parts, 0.3))


@pytest.mark.parametrize("extra", [0, 1])
def test_first_wave_scrape_is_kept_only_when_the_server_counted_what_the_client_saw(extra):
    sc = parse_scenario({
        "engine": dict(block_size=32, num_gpu_blocks=1000, max_model_len=4096),
        "workload": dict(arrival={"process": "closed", "concurrency": 2}, num_requests=4,
                         input_len={"dist": "uniform", "low": 20, "high": 60}, output_len=4),
    })
    fake = CountingFakeVllm(extra)
    run = run_live(sc, "http://fake:8000", transport=httpx.MockTransport(fake), progress=False,
                   first_wave_scrape=True)
    assert all(r.succeeded for r in run.records)
    if extra:  # two first tokens seen, three counted: not kept, and the notes say why
        assert run.first_wave is None and run.metrics_first_wave is None
        assert any("first-wave /metrics scrape was not kept: the server had counted 3" in n for n in run.notes)
    else:
        assert run.first_wave == [0, 1]
        assert run.metrics_first_wave.histogram_count["vllm:time_to_first_token_seconds"] == 2
    plain = run_live(sc, "http://fake:8000", transport=httpx.MockTransport(CountingFakeVllm()), progress=False)
    assert plain.first_wave is None and not any("first-wave" in n for n in plain.notes)  # (off by default)
