"""Faults a real server cannot produce on demand: cut streams, malformed SSE, HTTP errors.

The ONLY place live mode runs against a fake: an in-process ``httpx.MockTransport`` that
speaks vLLM's streaming protocol, so each fault is injected into one known request and the
test checks that it is recorded as an error while every other request is kept intact; and
two such hosts behind one transport, to check which host each routed request went to. (It
needs no server, so it runs in the default test suite.)
"""

from __future__ import annotations

import json

import httpx
import pytest

from simcap.live.client import run_live
from simcap.live.routing import LiveRouterError
from simcap.records import RequestRecord
from simcap.scenario import parse_scenario

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

    from simcap.report import render_live_fleet

    console = Console(record=True, width=160)
    render_live_fleet(fleet, console)
    text = console.export_text()
    assert "router roundrobin" in text and "http://b:8000" in text
    assert "load imbalance (max / mean): requests 1.143, tokens 1.143" in text
    with pytest.raises(LiveRouterError, match="deployment.replicas is 2 but 3"):
        run_live(sc, ["http://a:1", "http://b:1", "http://c:1"], progress=False)
    with pytest.raises(LiveRouterError, match="deployment.replicas is 2 but 1"):
        run_live(sc, "http://a:1", progress=False)
