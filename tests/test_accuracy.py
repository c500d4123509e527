"""The accuracy ratchet: the corpus replayed against its recorded errors, planted regressions,
the recorded-run format and the ``simcap accuracy`` command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from simcap.accuracy.corpus import CASE_FILE, CorpusError, load_case, load_corpus
from simcap.accuracy.replay import replay_corpus
from simcap.accuracy.report import form_error, markdown, ratchet, read_record, record_of
from simcap.cli.main import app
from simcap.live.client import LiveRun
from simcap.live.prom import parse_metrics
from simcap.live.recording import load_run, save_run
from simcap.metrics.records import RequestRecord
from simcap.workloads.requests import RequestSpec

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "calibration" / "corpus"
RECORD = ROOT / "calibration" / "accuracy.json"


@pytest.fixture(scope="module")
def replayed():
    cases = load_corpus(CORPUS)
    return cases, replay_corpus(cases)


def test_every_prediction_holds_its_recorded_error(replayed):
    _, replays = replayed
    problems = ratchet(replays, read_record(RECORD))
    assert not problems, "\n".join(problems)


def test_the_committed_table_is_the_replay(replayed):
    cases, replays = replayed
    assert (ROOT / "calibration" / "accuracy.md").read_text() == markdown(cases, replays)
    assert json.loads(RECORD.read_text()) == json.loads(json.dumps(record_of(replays)))


def test_the_committed_model_form_is_the_replay_and_its_intervals_cover(replayed):
    cases, replays = replayed
    record = form_error(cases, replays)
    assert json.loads((ROOT / "calibration" / "model_form.json").read_text()) == json.loads(json.dumps(record))
    cov = record["coverage"]
    # Each case's figures against 90% intervals fitted on the other cases: the share inside
    # must stay between 80% and 100%, overall and for the figures predicted past the fit part.
    assert 0.8 <= cov["all"]["share"] <= 1.0, cov["all"]
    assert 0.8 <= cov["beyond_fit"]["share"] <= 1.0, cov["beyond_fit"]
    assert {"live", "table"} <= set(cov["kind"])


def test_the_corpus_covers_both_forms_and_both_kinds(replayed):
    cases, replays = replayed
    assert {c.kind for c in cases} == {"live", "table"}
    assert {r.form for r in replays} == {"linear", "roofline"}
    live = [c for c in cases if c.kind == "live"]
    # Every live case's held-out runs come from at least two server instances.
    for case in live:
        assert len({r.instance for p in case.points for r in p.runs}) >= 2, case.name
    covered = {m for c in cases for m in c.mechanisms}
    assert {"open loop", "closed loop", "near saturation", "chunked prefill", "preemption", "prefix caching",
            "sessions", "speculative decoding (ngram)", "speculative decoding (EAGLE3)", "fleet of two replicas",
            "MoE experts", "a public table"} <= covered
    # Each mechanism's own figure is in the table where the case has one.
    metrics = {f["metric"] for r in replays for f in r.figures}
    assert {"preemptions", "prefix_hit_rate", "later_turns_ttft_p50"} <= metrics


def _plant(name: str, *cases: str) -> list[str]:
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "accuracy_plants.py"), name, *cases],
                          env={**os.environ, "SIMCAP_INTERPRETED": "1"}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


PLANTED_CASES = ("cpu-dense-open-loop", "cpu-dense-preemption", "cpu-moe-closed")


@pytest.mark.build  # the whole corpus, interpreted: 3-4 min, run in .ci/run's build step
def test_the_interpreted_engine_holds_the_record_too():
    # The engine a machine without a compiler runs, and the one the plants below patch:
    # unpatched, it must hold the whole record.
    assert _plant("none", *sorted(c.name for c in load_corpus(CORPUS))) == []


@pytest.mark.parametrize("plant", ["host_overhead_dropped", "max_num_seqs_halved", "token_budget_doubled"])
def test_a_planted_regression_fails_the_ratchet(plant):
    problems = _plant(plant, *PLANTED_CASES)
    worse = [p for p in problems if "worse than the recorded" in p]
    assert worse, f"{plant}: no figure got worse: {problems[:5]}"


def test_improvement_and_regression_both_depart_from_the_record(replayed):
    _, replays = replayed
    record = read_record(RECORD)
    key = next(k for k, v in record["figures"].items() if v is not None and abs(v) > 0.05)
    worse = {**record, "figures": {**record["figures"], key: record["figures"][key] / 2}}
    better = {**record, "figures": {**record["figures"], key: record["figures"][key] * 2}}
    problems = ratchet(replays, worse)
    assert problems and all(key in p for p in problems)
    assert "worse than the recorded" in problems[0]
    assert "tighten the record" in ratchet(replays, better)[0]
    lost = {**record, "figures": {k: v for k, v in record["figures"].items() if k != key}}
    assert ratchet(replays, lost) == [f"{key}: replayed but not recorded (a new figure; rewrite the record)"]


# --------------------------------------------------------------------------- recorded runs

METRICS_TEXT = """# HELP vllm:prompt_tokens_total Prompt tokens.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{model_name="tiny"} 96.0
# HELP vllm:generation_tokens_total Generated tokens.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{model_name="tiny"} 7.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",num_gpu_blocks="512",enable_prefix_caching="True"} 1.0
"""


def test_a_recorded_run_reads_back_as_it_was(tmp_path):
    recs = [RequestRecord(0, 0.1234567891, 64, 4, chunk_times=[0.2, 0.25, 0.3], chunk_tokens=[1, 2, 1],
                          finish_time=0.3000004, finish_reason="length", client_id=0),
            RequestRecord(1, 0.2, 32, 3, chunk_times=[0.4, 0.45, 0.5], chunk_tokens=[1, 1, 1],
                          finish_time=0.5, finish_reason="length", client_id=1, session_id=3, turn=1)]
    specs = {0: RequestSpec(0, 64, 4, ((-1, 64),)),
             1: RequestSpec(1, 32, 3, ((7, 16), (-3, 16)), output_key=9, session_id=3, turn=1)}
    run = LiveRun(recs, specs, "http://127.0.0.1:8000", "tiny", "completions", True, None, None, 10.0, 0.5, None,
                  metrics_before=parse_metrics(METRICS_TEXT, when=1.0),
                  metrics_after=parse_metrics(METRICS_TEXT.replace("7.0", "11.0"), when=2.0),
                  metrics_first_wave=parse_metrics(METRICS_TEXT.replace("7.0", "9.0"), when=1.5), first_wave=[0])
    path = save_run(tmp_path / "r0", run, iterations=[["Iteration(1): ..."]], cpu={"disturbed": False})
    assert path.name == "r0.run.json.gz"
    assert path.read_bytes() == save_run(tmp_path / "r0", run, iterations=[["Iteration(1): ..."]],
                                         cpu={"disturbed": False}).read_bytes()  # same run, same bytes
    back = load_run(path)
    assert back.run.specs == specs
    assert [r.chunk_times for r in back.run.records] == [[0.2, 0.25, 0.3], [0.4, 0.45, 0.5]]
    assert back.run.records[0].arrival_time == 0.123457 and back.run.records[1].turn == 1
    assert back.run.server_delta()["generation_tokens"] == 4.0
    assert back.run.first_wave == [0] and back.run.metrics_first_wave.counters["vllm:generation_tokens"] == 9.0
    assert back.run.metrics_after.num_gpu_blocks == 512
    assert back.iterations == [["Iteration(1): ..."]] and back.cpu == {"disturbed": False}
    assert back.run.summary().completed == 2


def test_a_foreign_file_is_one_line(tmp_path):
    from simcap.live.client import LiveError

    bad = tmp_path / "x.run.json.gz"
    bad.write_bytes(b"not gzip")
    with pytest.raises(LiveError, match="not a recorded live run"):
        load_run(bad)


def test_a_bad_case_file_names_its_field(tmp_path):
    case = json.loads((CORPUS / "field-a800-leave-high-out" / CASE_FILE).read_text())
    case["fit_rows"] = "no-spec c=1"
    (tmp_path / CASE_FILE).write_text(json.dumps(case))
    with pytest.raises(CorpusError, match=r"case.json: fit_rows"):
        load_case(tmp_path)


# --------------------------------------------------------------------------- the command


def test_accuracy_command_checks_one_case():
    res = CliRunner().invoke(app, ["accuracy", str(CORPUS), "--case", "field-a800-leave-high-out", "--check",
                                   "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["ratchet"] == [] and {c["form"] for c in data["cases"]} == {"linear", "roofline"}


@pytest.mark.parametrize("args, message", [
    (["--form", "cubic"], "--form: must be one of linear, roofline (got 'cubic')"),
    (["--write", "--case", "field-a800-leave-high-out"], "--write: rewrites the whole record"),
    (["--case", "nope"], "--case: no case named nope"),
])
def test_accuracy_command_refuses_in_one_line(args, message):
    res = CliRunner().invoke(app, ["accuracy", str(CORPUS), *args])
    assert res.exit_code == 2 and message in res.stderr and len(res.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("extra, message", [
    (["--point", "p"], "--point: goes with --record DIR"),
    (["--record", "{tmp}/case", "--roofline-hardware", "cpu-amd-epyc-zen4-2vcpu"],
     "--roofline-hardware and --roofline-model: give both (or neither)"),
    (["--record", "{tmp}/case"], "--record: the fit part is calibrated from the server's log"),
    (["--record", "{tmp}/case", "--roofline-hardware", "{tmp}/hw.yaml", "--roofline-model", "tiny-llama-cpu"],
     "expected one hardware entry"),
])
def test_live_validate_record_refuses_in_one_line(tmp_path, extra, message):
    from simcap.cli.live import live_app

    (tmp_path / "hw.yaml").write_text("a: {memory_bandwidth_gbps: 1}\nb: {memory_bandwidth_gbps: 2}\n")
    scenario = ROOT / "calibration" / "corpus" / "cpu-dense-open-loop" / "poisson-light.yaml"
    res = CliRunner().invoke(live_app, ["validate", str(scenario), "--base-url", "http://127.0.0.1:9",
                                        *[a.format(tmp=tmp_path) for a in extra]])
    assert res.exit_code == 2, res.output
    assert message in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_a_run_the_load_generator_paused_in_is_left_out_while_another_remains(tmp_path):
    """A copy of one case's closed-2 point whose second run says its load generator paused
    0.2 s: the point's figures are the first run's alone, and the notes say why; with every
    run paused, they are all used, as before."""
    import gzip
    import shutil

    from simcap.accuracy.replay import replay_case
    from simcap.live.validate import metric_value

    src = CORPUS / "cpu-dense-frontend"
    data = json.loads((src / CASE_FILE).read_text())
    data["points"] = [p for p in data["points"] if p["name"] == "closed-2"]
    for sub in ("fit", "closed-2"):
        shutil.copytree(src / sub, tmp_path / sub)
    (tmp_path / CASE_FILE).write_text(json.dumps(data))

    def pause(name: str) -> None:
        path = tmp_path / "closed-2" / name
        run = json.loads(gzip.decompress(path.read_bytes()))
        run["run"]["client_pauses"] = [[1.0, 0.2]]
        path.write_bytes(gzip.compress(json.dumps(run).encode()))

    def figures() -> tuple[dict[str, dict], list[str]]:
        (rep,) = replay_case(load_case(tmp_path), ["linear"])
        return {f["metric"]: f for f in rep.figures}, rep.notes

    whole, _ = figures()
    first = load_run(tmp_path / "closed-2" / "i0r0.run.json.gz").run.summary()
    pause("i1r1.run.json.gz")
    calm, notes = figures()
    assert calm["ttft_p50"]["runs"] == 1 and whole["ttft_p50"]["runs"] == 2
    assert calm["ttft_p50"]["measured"] == pytest.approx(metric_value(first, "ttft_p50"))
    assert calm["ttft_p50"]["spread"] is None  # (one instance left)
    assert any("closed-2: 1 of 2 run(s) left out" in n for n in notes)
    pause("i0r0.run.json.gz")
    every, _ = figures()
    assert every["ttft_p50"]["runs"] == 2 and every["ttft_p50"]["measured"] == whole["ttft_p50"]["measured"]
