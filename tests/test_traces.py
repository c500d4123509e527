"""Public traces as workload sources: each format read from small hand-written files whose
request lists are checked by hand; prefix sharing from Mooncake hash ids; slicing and speedup;
bad rows and too-long requests; the shipped Azure excerpt end to end through the CLI."""

from __future__ import annotations

import csv
import hashlib
import json
import random
from datetime import datetime
from pathlib import Path

import pytest
from typer.testing import CliRunner

from simcap.cli import app
from simcap.config.scenario import parse_scenario
from simcap.errors import ScenarioError
from simcap.fleet.run import simulate
from simcap.workloads.requests import Workload

ROOT = Path(__file__).resolve().parents[1]
EXCERPT = ROOT / "calibration" / "data" / "traces" / "AzureLLMInferenceTrace_conv.head300.csv"

AZURE = (
    "TIMESTAMP,ContextTokens,GeneratedTokens\r\n"
    "2023-11-16 18:15:46.6805900,374,44\r\n"
    "2023-11-16 18:15:50.9951690,396,109\r\n"
    "2023-11-16 18:15:47.1805900,879,55\r\n"  # out of order: sent second
    "2023-11-16 18:15:56.6805900,91,16\r\n"
)
BURSTGPT = (
    "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
    "5,ChatGPT,472,18,490,Conversation log\n"
    "45,ChatGPT,1087,0,1087,Conversation log\n"  # a failed request: no response
    "110.5,GPT-4,417,505,922,API log\n"
)


def _scenario(tmp_path: Path, trace: dict, name: str, text: str, **workload) -> dict:
    (tmp_path / name).write_text(text)
    return {
        "engine": dict(max_num_seqs=8, max_num_batched_tokens=2048, block_size=16,
                       num_gpu_blocks=2000, max_model_len=4096),
        "step_time": dict(base=0.01, per_prefill_token=1e-5, per_decode_token=0.0),
        "workload": {"trace": {"path": name, **trace}, **workload},
        "seed": 0,
    }


def _load(tmp_path, trace, name, text, **workload):
    return parse_scenario(_scenario(tmp_path, trace, name, text, **workload), base_dir=tmp_path)


def _requests(scenario):
    w = Workload(scenario.workload, scenario.seed)
    return [w.spec(i) for i in range(w.num_requests)]


# --------------------------------------------------------------------------- formats


def test_azure_rows_sorted_by_time_first_sent_at_zero(tmp_path):
    s = _load(tmp_path, {"format": "azure"}, "a.csv", AZURE)
    reqs = _requests(s)
    assert [(r.num_prompt_tokens, r.max_tokens) for r in reqs] == [(374, 44), (879, 55), (396, 109), (91, 16)]
    assert [r.request_id for r in reqs] == [0, 1, 2, 3]
    assert [r.segments for r in reqs] == [((-1, 374),), ((-3, 879),), ((-5, 396),), ((-7, 91),)]
    times = Workload(s.workload, 0).arrival_times()
    assert times.tolist() == pytest.approx([0.0, 0.5, 4.314579, 10.0], abs=1e-9)


def test_burstgpt_failed_request_is_a_bad_row(tmp_path):
    with pytest.raises(ScenarioError, match=r"line 3: Response tokens is 0.*on_bad_row: skip"):
        _load(tmp_path, {"format": "burstgpt"}, "b.csv", BURSTGPT)
    s = _load(tmp_path, {"format": "burstgpt", "on_bad_row": "skip"}, "b.csv", BURSTGPT)
    assert [(r.num_prompt_tokens, r.max_tokens) for r in _requests(s)] == [(472, 18), (417, 505)]
    assert Workload(s.workload, 0).arrival_times().tolist() == [0.0, 105.5]
    summary = s.workload.trace.requests.summary
    assert (summary["rows"], summary["bad_rows_skipped"], summary["requests"]) == (3, 1, 2)


def test_burstgpt_models_keeps_those_rows_as_vllm_bench_does(tmp_path):
    s = _load(tmp_path, {"format": "burstgpt", "models": ["GPT-4"]}, "b.csv", BURSTGPT)
    assert [(r.num_prompt_tokens, r.max_tokens) for r in _requests(s)] == [(417, 505)]
    summary = s.workload.trace.requests.summary
    assert (summary["other_models_left_out"], summary["bad_rows_skipped"]) == (2, 0)


def _mooncake(rows):
    return "".join(json.dumps(r) + "\n" for r in rows)


MOONCAKE = _mooncake([
    {"timestamp": 0, "input_length": 1100, "output_length": 4, "hash_ids": [0, 1, 2]},
    {"timestamp": 10000, "input_length": 700, "output_length": 4, "hash_ids": [0, 3]},
    {"timestamp": 20000, "input_length": 1024, "output_length": 4, "hash_ids": [0, 1]},
])


def test_mooncake_hash_ids_become_shared_segments(tmp_path):
    s = _load(tmp_path, {"format": "mooncake"}, "m.jsonl", MOONCAKE)
    reqs = _requests(s)
    # One segment of 512 tokens per hash id, the last as long as the prompt still runs.
    assert [r.segments for r in reqs] == [
        ((0, 512), (1, 512), (2, 76)),
        ((0, 512), (3, 188)),
        ((0, 512), (1, 512)),
    ]
    assert Workload(s.workload, 0).arrival_times().tolist() == [0.0, 10.0, 20.0]  # ms -> s


@pytest.mark.parametrize("engine_block,hits", [
    # Each request runs alone (10 s apart). Request 1 shares hash id 0 (512 tokens) with
    # request 0; request 2 shares ids 0 and 1 (its whole 1024-token prompt), hit up to but not
    # including its last token, as vLLM: whole engine blocks below 1023 tokens.
    (16, 512 + 1008),        # 32 blocks; 63 blocks
    (96, 480 + 960),         # 512 // 96 = 5 blocks; 1023 // 96 = 10 blocks
    (512, 512 + 512),        # one block each; the second block would hold the last token
])
def test_mooncake_prefix_hits_at_the_engine_block_size(tmp_path, engine_block, hits):
    data = _scenario(tmp_path, {"format": "mooncake"}, "m.jsonl", MOONCAKE)
    data["engine"]["block_size"] = engine_block
    data["engine"]["num_gpu_blocks"] = 100_000 // engine_block
    result = simulate(parse_scenario(data, base_dir=tmp_path))
    assert result.summary.completed == 3
    assert result.summary.prefix_cache_hit_tokens == hits


def test_mooncake_prompt_past_its_hash_ids_is_private(tmp_path):
    text = _mooncake([{"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [7]}])
    (req,) = _requests(_load(tmp_path, {"format": "mooncake"}, "m.jsonl", text))
    assert req.segments == ((7, 512), (-1, 88))
    # A trace block size other than the published 512 (another trace generator's).
    (req,) = _requests(_load(tmp_path, {"format": "mooncake", "block_size": 256}, "m.jsonl", text))
    assert req.segments == ((7, 256), (-1, 344))


SHAREGPT = [
    {"id": "a", "conversations": [{"from": "human", "value": "one two three"},
                                  {"from": "gpt", "value": "four five"}]},
    {"id": "b", "conversations": [{"from": "human", "value": "lonely"}]},  # one message: left out
    {"id": "c", "conversations": [{"from": "human", "value": "x y", "num_tokens": 40},
                                  {"from": "gpt", "value": "z", "num_tokens": 7},
                                  {"from": "human", "value": "later turn"}]},
    {"id": "d", "conversations": [{"from": "human", "value": "  spaced\n\tout  words "},
                                  {"from": "gpt", "value": "ok"}]},
]


def test_sharegpt_word_counts_or_token_counts(tmp_path):
    arrival = {"process": "poisson", "rate": 2.0}
    s = _load(tmp_path, {"format": "sharegpt"}, "g.json", json.dumps(SHAREGPT), arrival=arrival)
    assert [(r.num_prompt_tokens, r.max_tokens) for r in _requests(s)] == [(3, 2), (40, 7), (3, 1)]
    assert s.workload.trace.requests.summary["entries_without_two_messages"] == 1
    times = Workload(s.workload, 0).arrival_times()
    assert len(times) == 3 and times[0] == 0.0 and (times[1:] > 0).all()


def test_sharegpt_shuffle_is_vllm_bench_order(tmp_path):
    # vllm bench serve: random.seed(seed); random.shuffle(entries) after dropping short ones.
    entries = [{"conversations": [{"value": "w " * (i + 1)}, {"value": "o"}]} for i in range(20)]
    arrival = {"process": "closed", "concurrency": 2}
    s = _load(tmp_path, {"format": "sharegpt", "shuffle_seed": 7}, "g.json", json.dumps(entries),
              arrival=arrival)
    order = list(range(20))
    random.seed(7)
    random.shuffle(order)
    assert [r.num_prompt_tokens for r in _requests(s)] == [i + 1 for i in order]
    assert order != sorted(order)


# --------------------------------------------------------------------------- slicing


TIMED = "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
    f"2024-01-01 00:00:{t},{n},8\n" for t, n in (("00.0", 10), ("01.0", 20), ("02.5", 30), ("04.0", 40)))


@pytest.mark.parametrize("options,prompts,times", [
    ({}, [10, 20, 30, 40], [0.0, 1.0, 2.5, 4.0]),
    ({"speedup": 2.0}, [10, 20, 30, 40], [0.0, 0.5, 1.25, 2.0]),
    ({"start_s": 1.0, "duration_s": 2.0}, [20, 30], [0.0, 1.5]),  # rows in [1, 3) s
    ({"start_s": 1.0, "duration_s": 2.0, "speedup": 3.0}, [20, 30], [0.0, 0.5]),
    ({"num_requests": 3}, [10, 20, 30], [0.0, 1.0, 2.5]),
    ({"start_s": 2.5, "num_requests": 1}, [30], [0.0]),
])
def test_speedup_and_slicing(tmp_path, options, prompts, times):
    s = _load(tmp_path, {"format": "azure", **options}, "t.csv", TIMED)
    assert [r.num_prompt_tokens for r in _requests(s)] == prompts
    assert Workload(s.workload, 0).arrival_times().tolist() == pytest.approx(times)


def test_arrival_process_replaces_the_timestamps(tmp_path):
    s = _load(tmp_path, {"format": "azure"}, "t.csv", TIMED, arrival={"process": "closed", "concurrency": 2})
    result = simulate(s)
    assert result.summary.completed == 4 and result.summary.input_tokens == 100


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("fmt,name,text,match", [
    ("azure", "x.csv", "time,in,out\n1,2,3\n", r"not an azure trace: expected CSV columns TIMESTAMP,ContextTokens"),
    ("burstgpt", "x.csv", AZURE, r"not a burstgpt trace: expected CSV columns Timestamp,Model,Request tokens"),
    ("mooncake", "x.jsonl", AZURE, r"not a mooncake trace: expected one JSON object a line with keys timestamp"),
    ("mooncake", "x.jsonl", "", r"not a mooncake trace.*an empty file"),
    ("sharegpt", "x.json", MOONCAKE, r"not a sharegpt trace: expected a JSON list.*invalid JSON"),
    ("sharegpt", "x.json", json.dumps({"conversations": []}), r"not a sharegpt trace.*a JSON dict"),
    ("azure", "x.csv", "", r"not an azure trace.*an empty file"),
])
def test_a_file_not_in_the_format_names_the_expected_columns(tmp_path, fmt, name, text, match):
    workload = {"arrival": {"process": "poisson", "rate": 1.0}} if fmt == "sharegpt" else {}
    with pytest.raises(ScenarioError, match=match):
        _load(tmp_path, {"format": fmt}, name, text, **workload)


@pytest.mark.parametrize("row,problem", [
    ("2023-11-16 18:15:50.1,-5,10", "ContextTokens is -5, negative"),
    ("2023-11-16 18:15:50.1,,10", "ContextTokens is missing"),
    ("2023-11-16 18:15:50.1,12", "GeneratedTokens is missing"),
    ("2023-11-16 18:15:50.1,abc,10", "ContextTokens is 'abc', not a whole number"),
    ("2023-11-16 18:15:50.1,7.5,10", "ContextTokens is '7.5', not a whole number"),
    ("yesterday,7,10", "TIMESTAMP is 'yesterday'"),
])
def test_bad_rows_stop_or_are_counted_and_skipped(tmp_path, row, problem):
    text = AZURE.replace("2023-11-16 18:15:50.9951690,396,109", row)
    with pytest.raises(ScenarioError, match=r"a.csv line 3: " + problem.replace("(", r"\(")):
        _load(tmp_path, {"format": "azure"}, "a.csv", text)
    s = _load(tmp_path, {"format": "azure", "on_bad_row": "skip"}, "a.csv", text)
    assert [r.num_prompt_tokens for r in _requests(s)] == [374, 879, 91]
    assert s.workload.trace.requests.summary["bad_rows_skipped"] == 1


def test_mooncake_bad_rows(tmp_path):
    text = MOONCAKE + _mooncake([{"timestamp": 3, "input_length": -1, "output_length": 4, "hash_ids": []},
                                 {"timestamp": 4, "input_length": 9, "output_length": 4, "hash_ids": [-2]}])
    text += "not json\n"
    with pytest.raises(ScenarioError, match=r"line 4: input_length is -1, negative"):
        _load(tmp_path, {"format": "mooncake"}, "m.jsonl", text)
    s = _load(tmp_path, {"format": "mooncake", "on_bad_row": "skip"}, "m.jsonl", text)
    assert len(_requests(s)) == 3 and s.workload.trace.requests.summary["bad_rows_skipped"] == 3


def test_too_long_requests_stop_or_are_counted_and_skipped(tmp_path):
    data = _scenario(tmp_path, {"format": "azure"}, "a.csv", AZURE)
    data["engine"]["max_model_len"] = 500  # 879 + 55 and 396 + 109 are over it
    with pytest.raises(ScenarioError, match=r"line 4: prompt \(879\) \+ output \(55\) tokens exceed engine.max_model_len \(500\)"):
        parse_scenario(data, base_dir=tmp_path)
    data["workload"]["trace"]["on_too_long"] = "skip"
    s = parse_scenario(data, base_dir=tmp_path)
    assert [r.num_prompt_tokens for r in _requests(s)] == [374, 91]
    assert s.workload.trace.requests.summary["too_long_skipped"] == 2
    # num_requests counts the requests sent: the first 2 that fit.
    data["workload"]["trace"]["num_requests"] = 2
    assert len(_requests(parse_scenario(data, base_dir=tmp_path))) == 2


@pytest.mark.parametrize("workload,match", [
    ({"input_len": 100}, r"workload.input_len: not with workload.trace"),
    ({"num_requests": 2}, r"workload.num_requests: not with workload.trace.*trace.num_requests"),
    ({"arrival": {"process": "poisson", "rate": 1.0}, "trace": {"format": "azure", "path": "a.csv", "speedup": 2.0}},
     r"workload.trace.speedup: workload.arrival sends"),
    ({"trace": {"format": "sharegpt", "path": "a.csv"}}, r"workload.arrival: a sharegpt file has no timestamps"),
    ({"trace": {"format": "azure", "path": "a.csv", "block_size": 64}}, r"workload.trace.block_size"),
    ({"trace": {"format": "azure", "path": "a.csv", "models": ["GPT-4"]}}, r"workload.trace.models"),
    ({"trace": {"format": "azure", "path": "a.csv", "start_s": 60}}, r"workload.trace.start_s: no rows"),
    ({"trace": {"format": "azure", "path": "nope.csv"}}, r"workload.trace.path: cannot read"),
    ({"arrival": {"process": "closed", "concurrency": 2}, "sessions": {"num_sessions": 2, "turns": 2}},
     r"workload.sessions: not with workload.trace"),
])
def test_trace_options_are_checked(tmp_path, workload, match):
    data = _scenario(tmp_path, {"format": "azure"}, "a.csv", AZURE)
    data["workload"].update(workload)
    with pytest.raises(ScenarioError, match=match):
        parse_scenario(data, base_dir=tmp_path)


# --------------------------------------------------------------------------- end to end


def test_the_shipped_excerpt_is_the_published_file_head():
    raw = EXCERPT.read_bytes()
    assert raw.startswith(b"TIMESTAMP,ContextTokens,GeneratedTokens\r\n2023-11-16 18:15:46.6805900,374,44\r\n")
    assert raw.count(b"\r\n") == 301
    assert (EXCERPT.parent / "README.md").read_text().count(hashlib.sha256(raw).hexdigest()) == 1


def test_cli_replays_the_shipped_excerpt(tmp_path):
    with EXCERPT.open(newline="") as f:
        rows = list(csv.DictReader(f))[:120]
    args = ["simulate", str(ROOT / "examples" / "azure-trace.yaml"), "--json", "--trace-requests", "120",
            "--speedup", "2"]
    runs = [CliRunner().invoke(app, args) for _ in range(2)]
    assert runs[0].exit_code == 0, runs[0].output
    assert runs[0].stdout == runs[1].stdout  # same trace, same bytes
    out = json.loads(runs[0].stdout)
    assert out["completed"] == 120
    assert out["input_tokens"] == sum(int(r["ContextTokens"]) for r in rows)
    assert out["output_tokens"] == sum(int(r["GeneratedTokens"]) for r in rows)
    trace = out["provenance"]["trace"]
    assert trace["sha256"] == hashlib.sha256(EXCERPT.read_bytes()).hexdigest()
    assert (trace["rows"], trace["requests"], trace["bad_rows_skipped"]) == (300, 120, 0)
    # 120 rows over (their last timestamp - their first) of trace time, at twice the speed.
    first, last = (datetime.strptime(r["TIMESTAMP"][:26], "%Y-%m-%d %H:%M:%S.%f") for r in (rows[0], rows[-1]))
    assert trace["span_s"] == pytest.approx((last - first).total_seconds() / 2, abs=1e-6)


def test_the_digest_names_the_trace_by_content_not_path(tmp_path):
    (tmp_path / "sub").mkdir()
    a = _load(tmp_path, {"format": "azure"}, "a.csv", AZURE)
    data = _scenario(tmp_path / "sub", {"format": "azure"}, "b.csv", AZURE)
    assert parse_scenario(data, base_dir=tmp_path / "sub").digest() == a.digest()
    changed = _load(tmp_path, {"format": "azure"}, "a.csv", AZURE.replace(",44", ",45"))
    assert changed.digest() != a.digest()


def test_a_scenario_without_a_trace_dumps_as_before(tmp_path):
    from simcap.config.scenario import load_scenario

    dumped = load_scenario(ROOT / "examples" / "chat.yaml").model_dump(mode="json")["workload"]
    assert "trace" not in dumped and set(dumped) >= {"arrival", "input_len", "output_len"}
