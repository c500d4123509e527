"""``simcap serve``: vLLM's API in front of the engine model, on the wall clock.

Each test runs the command as a user would (a subprocess, stopped by SIGINT) and talks to it
with a client nobody here wrote (``openai``) or plain HTTP; the served requests must be the
simulation's (``simcap simulate`` of the trace the server wrote), request for request.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from simcap.config.scenario import load_scenario
from simcap.fleet.run import simulate
from simcap.serve.engine import replay_overrides
from simcap.serve.prompts import PromptReader
from simcap.workloads.requests import Workload
from tests.serve_helpers import ROOT, SCENARIO, served, write_scenario

SCENARIO_ENGINE = SCENARIO["engine"]

VLLM = ROOT / "tests" / "data" / "vllm-0.32"  # what a real vLLM 0.32 answered (captured)
MS = 1e-3


def replayed(scenario: Path, trace: Path, block_size: int, sets: list[str] = ()):
    """``simcap simulate`` of the served workload, with every request's record."""
    return simulate(load_scenario(scenario, [*replay_overrides(str(trace), block_size), *sets]), records=True)


def series(text: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a /metrics text: (name, sorted labels) -> value."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text) for s in family.samples
    }


async def _send_all(base_url: str, model: str, jobs: list[dict]) -> list[dict]:
    """Each job after its delay: streamed with the openai client, timed on the monotonic clock."""
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0)

    async def one(job: dict) -> dict:
        await asyncio.sleep(job["delay"])
        extra = {"ignore_eos": job["ignore_eos"], **({"min_tokens": job["min_tokens"]} if "min_tokens" in job else {})}
        sent = time.monotonic()
        if job["chat"]:
            stream = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": job["text"]}], max_tokens=job["max_tokens"],
                stream=True, stream_options={"include_usage": True}, extra_body=extra,
            )
        else:
            stream = await client.completions.create(
                model=model, prompt=job["text"], max_tokens=job["max_tokens"], stream=True,
                stream_options={"include_usage": True}, extra_body=extra,
            )
        got = {"sent": sent, "chunks": [], "finish": None, "usage": None, "id": None}
        async for chunk in stream:
            got["id"] = chunk.id
            if chunk.choices:
                choice = chunk.choices[0]
                text = choice.delta.content if job["chat"] else choice.text
                if text:  # (a chat's first event carries the role only)
                    got["chunks"].append(time.monotonic())
                if choice.finish_reason:
                    got["finish"] = choice.finish_reason
            if chunk.usage:
                got["usage"] = chunk.usage
        return got

    try:
        return await asyncio.gather(*(one(job) for job in jobs))
    finally:
        await client.close()


def test_openai_client_gets_the_simulation_in_real_time(tmp_path):
    """Streamed requests (completions and chat, with and without ignore_eos, sharing a system
    prompt) through the openai client: the output lengths and finish reasons are the rule's,
    one event per engine step; no token reaches a client before its simulated step ended;
    the server's records are ``simcap simulate``'s of the trace it wrote, request for request;
    /metrics (read by prometheus_client) adds up to the records, with vLLM's names."""
    # Steps of 30 ms: a chunk held back one step comes 30 ms late, far above what two busy
    # cores add to every chunk (a median of 5.6 ms was seen with the CPUs shared three ways).
    step_time = {**SCENARIO["step_time"], "base": 0.030}
    scenario = write_scenario(tmp_path, step_time=step_time)
    rng = random.Random(7)
    system = "You are a capacity planner. Answer briefly and in numbers. " * 3
    jobs = [  # sent 40 ms apart (so they arrive in this order), a few at a time in the engine
        {"delay": 0.04 * i, "chat": i % 5 == 4, "ignore_eos": i % 3 != 0,
         "text": (system if i % 2 else "") + f"question {i}: " + "how many replicas? " * rng.randint(1, 12),
         "max_tokens": rng.randint(6, 14), **({"min_tokens": 5} if i % 6 == 0 else {})}
        for i in range(24)
    ]
    with served(scenario, "--served-model-name", "m", folder=tmp_path) as run:
        results = asyncio.run(_send_all(run.base_url, "m", jobs))
        metrics_text = httpx.get(run.base_url + "/metrics").text
    assert run.exit_code == 0, run.stderr
    assert re.search(r"served 24 requests; clock lag over \d+ chunks", run.stderr), run.stderr
    records = run.records()
    assert len(records) == 24
    start, speed = run.status["clock"]["start_monotonic_s"], run.status["clock"]["speed"]
    natural = [Workload(load_scenario(scenario).workload, 3).spec(i).max_tokens for i in range(24)]
    late = []
    # The server numbers requests as they arrive (40 ms apart is not a promise of that order);
    # each response's id names its record.
    assert sorted(int(got["id"].split("-")[1]) for got in results) == sorted(r.request_id for r in records)
    by_id = {int(got["id"].split("-")[1]): (job, got) for job, got in zip(jobs, results)}
    for rec in records:
        job, got = by_id[rec.request_id]
        n = rec.num_output_tokens
        assert got["usage"].completion_tokens == n
        assert got["usage"].prompt_tokens == rec.num_prompt_tokens
        ended = job["ignore_eos"] or natural[rec.request_id] >= job["max_tokens"]
        assert n == (job["max_tokens"] if ended else max(natural[rec.request_id], job.get("min_tokens", 0)))
        assert got["finish"] == ("length" if n == job["max_tokens"] else "stop")
        assert len(got["chunks"]) == len(rec.chunk_times)  # one event per step
        # Real time: sent before it arrived; no chunk before its step ended (1 ms: clock reads).
        assert got["sent"] <= start + rec.arrival_time / speed + MS
        for seen, due in zip(got["chunks"], rec.chunk_times):
            assert seen >= start + due / speed - MS
            late.append(seen - (start + due / speed))
    assert sorted(results, key=lambda g: g["sent"]) == results
    # ... and not a step late: a chunk held back one step would be a step's base (30 ms) late.
    print(f"chunks seen after their step ended: median {statistics.median(late) * 1e3:.2f} ms, "
          f"max {max(late) * 1e3:.2f} ms")
    assert statistics.median(late) < step_time["base"] / 2
    # Replayed by simcap simulate from the trace: the same requests, the same times.
    result = replayed(scenario, run.trace_path, 16)
    t0 = records[0].arrival_time
    for rec, sim in zip(records, result.records):
        assert (rec.num_prompt_tokens, rec.num_output_tokens) == (sim.num_prompt_tokens, sim.num_output_tokens)
        assert rec.arrival_time - t0 == pytest.approx(sim.arrival_time, abs=1e-9)
        assert [t - t0 for t in rec.chunk_times] == pytest.approx(sim.chunk_times, abs=1e-9)
    assert result.prefix_cache["hits"] > 0  # the shared system prompt
    # /metrics: what the records add up to, under vLLM's names and labels.
    got = series(metrics_text)

    def at(name: str, **labels: str) -> float:
        return got[(name, tuple(sorted({"engine": "0", "model_name": "m", **labels}.items())))]

    assert at("vllm:request_success_total", finished_reason="length") + \
        at("vllm:request_success_total", finished_reason="stop") == 24
    assert at("vllm:request_success_total", finished_reason="stop") == sum(g["finish"] == "stop" for g in results)
    assert at("vllm:prompt_tokens_total") == sum(r.num_prompt_tokens for r in records)
    assert at("vllm:generation_tokens_total") == sum(r.num_output_tokens for r in records)
    assert at("vllm:time_to_first_token_seconds_count") == 24
    assert at("vllm:time_to_first_token_seconds_sum") == pytest.approx(
        sum(r.chunk_times[0] - r.arrival_time for r in records), abs=1e-9)
    assert at("vllm:inter_token_latency_seconds_count") == sum(len(r.chunk_times) - 1 for r in records)
    assert at("vllm:e2e_request_latency_seconds_sum") == pytest.approx(
        sum(r.finish_time - r.arrival_time for r in records), abs=1e-9)
    assert at("vllm:prefix_cache_hits_total") == result.prefix_cache["hits"]
    assert at("vllm:num_requests_running") == 0


def test_metric_names_and_labels_are_vllms(tmp_path):
    """Every series ``/metrics`` shows (simcap's own ``simcap:`` ones aside) is one a real
    vLLM 0.32 shows, with the same label names: dashboards and routers read it unchanged."""
    def shapes(text: str) -> set[tuple[str, tuple]]:
        return {(name, tuple(sorted(k for k in labels if k not in ("le", "finished_reason"))))
                for name, labels in ((n, dict(lab)) for n, lab in series(text))}

    vllm = shapes((VLLM / "metrics.txt").read_text())
    with served(write_scenario(tmp_path), folder=tmp_path) as run:
        httpx.post(run.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
        ours = shapes(httpx.get(run.base_url + "/metrics").text)
    ours = {s for s in ours if not s[0].startswith("simcap:")}
    assert len(ours) >= 50
    # (an info metric's labels are the facts it gives: simcap gives those it models)
    info = [(name, labels) for name, labels in ours if name.endswith("_info")]
    assert info and all(any(n == name and set(labels) <= set(theirs) for n, theirs in vllm) for name, labels in info)
    assert ours - set(info) <= vllm, sorted(ours - set(info) - vllm)


def _event_keys(text: str) -> list[tuple[set, set]]:
    out = []
    for line in text.splitlines():
        if line.startswith("data: {"):
            obj = json.loads(line[6:])
            out.append((set(obj), set().union(*(set(c) | set(c.get("delta", {})) for c in obj["choices"]))))
    return out


def test_responses_have_vllms_shape(tmp_path):
    """Stream events and whole responses carry no key a real vLLM 0.32 response lacks; a chat
    stream opens with the assistant's role, as vLLM's does; bad requests get vLLM's error
    bodies, status codes and messages."""
    with served(write_scenario(tmp_path), "--served-model-name", "tiny", folder=tmp_path) as run:
        post = lambda path, body: httpx.post(run.base_url + path, json=body, timeout=30)  # noqa: E731
        for name, path, body in (
            ("comp_stream", "/v1/completions", {"model": "tiny", "prompt": "hello world", "max_tokens": 4,
                                                "ignore_eos": True, "stream": True,
                                                "stream_options": {"include_usage": True}}),
            ("chat_stream", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 3, "ignore_eos": True, "stream": True,
                                                     "stream_options": {"include_usage": True}}),
        ):
            ours, theirs = _event_keys(post(path, body).text), _event_keys((VLLM / f"{name}.txt").read_text())
            top_v = set().union(*(t for t, _ in theirs))
            choice_v = set().union(*(c for _, c in theirs))
            assert all(t <= top_v and c <= choice_v for t, c in ours), (name, ours)
            if name == "chat_stream":
                assert '"role":"assistant"' in post(path, body).text.split("\n\n")[0]
        for name, path, body in (
            ("comp_nostream", "/v1/completions", {"prompt": "hello", "max_tokens": 2}),
            ("chat_nostream", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 2}),
        ):
            ours, theirs = post(path, body).json(), json.loads((VLLM / f"{name}.txt").read_text())
            assert set(ours) <= set(theirs) and set(ours["choices"][0]) <= set(theirs["choices"][0])
            assert set(ours["usage"]) <= set(theirs["usage"])
        # Errors, as vLLM 0.32 words them (tests/data/vllm-0.32 and vLLM's messages).
        cases = [
            ({"model": "nope", "prompt": "hi"}, 404, "NotFoundError", "model",
             "The model `nope` does not exist. Valid aliases: tiny."),
            ({"prompt": "hi", "max_tokens": -1}, 400, "BadRequestError", "max_tokens",
             "max_tokens must be at least 1, got -1. (parameter=max_tokens, value=-1)"),
            ({"prompt": "hi", "max_tokens": 5000}, 400, "BadRequestError", "max_tokens",
             "max_tokens=5000 cannot be greater than max_model_len=1024. Please request fewer output tokens. "
             "(parameter=max_tokens, value=5000)"),
            ({"prompt": "hi", "max_tokens": 2, "min_tokens": 5}, 400, "BadRequestError", None,
             "min_tokens must be less than or equal to max_tokens=2, got 5."),
            ({"max_tokens": 3}, 400, "BadRequestError", "prompt",
             "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)"),
            ({"prompt": "x" * 5000}, 400, "BadRequestError", "input_tokens", None),
            ({"prompt": [[]], "max_tokens": 3}, 400, "BadRequestError", "prompt", None),
            ({"prompt": "hi", "max_tokens": "abc"}, 400, "Bad Request", "body.max_tokens", None),
        ]
        for body, code, kind, param, message in cases:
            resp = post("/v1/completions", body)
            error = resp.json()["error"]
            assert (resp.status_code, error["code"], error["type"], error["param"]) == (code, code, kind, param), body
            if message:
                assert error["message"] == message
        for raw in (b"not json", b"\xff\xfe{"):
            bad_json = httpx.post(run.base_url + "/v1/completions", content=raw, timeout=30)
            assert bad_json.status_code == 400 and bad_json.json()["error"]["param"] == "body.0"
        assert httpx.get(run.base_url + "/nope").json() == {"detail": "Not Found"}
        assert httpx.get(run.base_url + "/v1/completions").status_code == 405
        # max_tokens past the context is cut to what is left (vLLM 0.32), finish reason length.
        long = post("/v1/completions", {"prompt": [7] * 1000, "max_tokens": 100, "ignore_eos": True}).json()
        assert long["usage"]["completion_tokens"] == 24 and long["choices"][0]["finish_reason"] == "length"
        # n and a batch of prompts: one choice each, indexed as vLLM does.
        batch = post("/v1/completions", {"prompt": ["a b", "c d e f"], "n": 2, "max_tokens": 2, "ignore_eos": True})
        assert [c["index"] for c in batch.json()["choices"]] == [0, 1, 2, 3]
        assert batch.json()["usage"] == {"prompt_tokens": 1 + 2, "total_tokens": 11, "completion_tokens": 8}  # 3 and 7 bytes
        tokens = post("/tokenize", {"prompt": "hello world"}).json()
        assert tokens["count"] == 3 and tokens["max_model_len"] == 1024
        assert post("/detokenize", {"tokens": tokens["tokens"]}).json() == {"prompt": "hello world"}
        assert post("/reset_prefix_cache", {}).json() == {"success": True}
        models = httpx.get(run.base_url + "/v1/models").json()
        assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [("tiny", 1024)]
        assert httpx.get(run.base_url + "/version").json()["version"] == "0.32"
    assert run.exit_code == 0


def test_fleet_behind_one_endpoint(tmp_path):
    """``--replicas 2 --router roundrobin --speed 4``: requests alternate between two engines,
    labelled engine 0 and 1 in /metrics as vLLM labels a data-parallel server's engines; each
    takes at least a quarter of its simulated time on the wall clock; the fleet's simulation of
    the served trace gives the same times."""
    scenario = write_scenario(tmp_path)
    walls = []
    with served(scenario, "--replicas", "2", "--router", "roundrobin", "--speed", "4", folder=tmp_path) as run:
        for i in range(6):
            start = time.monotonic()
            httpx.post(run.base_url + "/v1/completions", json={"prompt": f"request {i}", "max_tokens": 3,
                                                               "ignore_eos": True}, timeout=30)
            walls.append(time.monotonic() - start)
        got = series(httpx.get(run.base_url + "/metrics").text)
    records = run.records()
    assert run.status["clock"]["speed"] == 4
    for rec, wall in zip(records, walls):
        assert wall >= (rec.finish_time - rec.arrival_time) / 4 - MS
    assert [r.replica for r in records] == [0, 1, 0, 1, 0, 1]
    for engine in "01":
        key = ("vllm:request_success_total",
               (("engine", engine), ("finished_reason", "length"), ("model_name", "served")))  # (sorted)
        assert got[key] == 3
    result = replayed(scenario, run.trace_path, 16,
                      ["deployment.replicas=2", "deployment.router=roundrobin"])
    t0 = records[0].arrival_time
    for rec, sim in zip(records, sorted(result.records, key=lambda r: r.request_id)):
        assert [t - t0 for t in rec.chunk_times] == pytest.approx(sim.chunk_times, abs=1e-9)


def test_overload_queues_and_preempts_as_the_engine_model_does(tmp_path):
    """More requests than the KV pool holds (8 at once, 40 blocks of 16): the server queues and
    preempts, never fails; every request completes with its tokens; /metrics counts the
    preemptions the records hold; the replay preempts the same."""
    engine = {**SCENARIO_ENGINE, "max_num_seqs": 8, "num_gpu_blocks": 40, "max_model_len": 256}
    scenario = write_scenario(tmp_path, engine=engine)

    def one(i: int) -> dict:
        body = {"prompt": f"{i:03d} " + "lorem ipsum " * 20, "max_tokens": 60, "ignore_eos": True}
        return httpx.post(base + "/v1/completions", json=body, timeout=120).json()

    with served(scenario, folder=tmp_path) as run:
        base = run.base_url
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(one, range(8)))
        got = series(httpx.get(base + "/metrics").text)
    assert [a["usage"]["completion_tokens"] for a in answers] == [60] * 8
    records = run.records()
    preempted = sum(r.num_preemptions for r in records)
    assert preempted > 0
    key = ("vllm:num_preemptions_total", (("engine", "0"), ("model_name", "served")))
    assert got[key] == preempted
    result = replayed(scenario, run.trace_path, 16)
    assert sum(r.num_preemptions for r in result.records) == preempted


def test_a_client_that_goes_away_aborts_its_request(tmp_path):
    """One sequence at a time (max_num_seqs 1): a long streamed request whose client closes
    after two chunks, and a long whole-response request whose client times out, are aborted
    before the next step, so the request sent next starts at once instead of after the long
    one's 200 steps (2 s); /metrics counts the aborts, and the records end with reason abort."""
    scenario = write_scenario(tmp_path, engine={**SCENARIO_ENGINE, "max_num_seqs": 1})
    with served(scenario, folder=tmp_path) as run:
        body = {"prompt": "a long answer", "max_tokens": 200, "ignore_eos": True, "stream": True}
        seen = 0
        with httpx.stream("POST", run.base_url + "/v1/completions", json=body, timeout=30) as resp:
            for line in resp.iter_lines():
                seen += line.startswith("data: {")
                if seen == 2:
                    break  # (and the connection closes)
        start = time.monotonic()
        short = httpx.post(run.base_url + "/v1/completions", json={"prompt": "next", "max_tokens": 3,
                                                                  "ignore_eos": True}, timeout=30)
        waited = time.monotonic() - start
        # A whole-response client that gives up (its read times out) aborts too.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(run.base_url + "/v1/completions", json={**body, "stream": False}, timeout=0.3)
        start = time.monotonic()
        httpx.post(run.base_url + "/v1/completions", json={"prompt": "last", "max_tokens": 3, "ignore_eos": True},
                   timeout=30)
        waited_again = time.monotonic() - start
        got = series(httpx.get(run.base_url + "/metrics").text)
    assert seen == 2 and short.json()["usage"]["completion_tokens"] == 3
    assert waited < 1.0 and waited_again < 1.0, (waited, waited_again)  # (vs 2 s of the long one)
    records = run.records()
    assert [(r.request_id, r.finish_reason) for r in records] == [(0, "abort"), (1, "length"), (2, "abort"),
                                                                 (3, "length")]
    assert 1 <= records[0].num_output_tokens < 200 and records[2].num_output_tokens < 200
    key = ("vllm:request_success_total", (("engine", "0"), ("finished_reason", "abort"), ("model_name", "served")))
    assert got[key] == 2


@pytest.mark.parametrize("args, says", [
    (["--speed", "0"], "--speed: a positive number"),
    (["--router", "least_request"], "--router: give --replicas N"),
    (["--tokenizer", "no-such-folder"], "--tokenizer: no-such-folder: no tokenizer.json there"),
    (["--set", "engine.max_num_seqs=0"], "engine.max_num_seqs"),
    (["--set", "engine.num_gpu_blocks=10"], "engine.max_model_len: 1024 tokens do not fit the KV pool of 144"),
])
def test_bad_input_is_one_line(tmp_path, args, says):
    out = subprocess.run([sys.executable, "-m", "simcap", "serve", str(write_scenario(tmp_path)), *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], out.stderr


def test_a_port_in_use_is_one_line(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "simcap", "serve", str(write_scenario(tmp_path)),
                              "--port", str(port)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().startswith(f"error: --host/--port: cannot listen on 127.0.0.1:{port}"), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_prompt_rule_and_content_blocks():
    """Without a tokenizer: 1 token per 4 UTF-8 bytes (ids: the bytes, read little-endian),
    reversible; content blocks keyed by a chain over the whole prefix."""
    reader = PromptReader()
    assert reader.text("hello world").tokens == (
        int.from_bytes(b"hell", "little"), int.from_bytes(b"o wo", "little"), int.from_bytes(b"rld", "little"))
    assert reader.detokenize(reader.text("héllo wörld").tokens) == "héllo wörld"
    assert reader.chat([{"role": "user", "content": "hi"}]).num_tokens == 3  # "user: hi\n": 9 bytes
    a, b = PromptReader.ids(list(range(40))), PromptReader.ids(list(range(32)) + [99] * 8)
    ka, kb = a.block_keys(16), b.block_keys(16)
    assert ka[:2] == kb[:2] and ka[2] != kb[2] and len(ka) == 3
    assert a.segments(16) == ((ka[0], 16), (ka[1], 16), (ka[2], 8))
    c = PromptReader.ids([5] + list(range(1, 40)))  # same later blocks, different first: nothing shared
    assert not set(c.block_keys(16)) & set(ka)
    assert all(k >= 0 for k in ka)
