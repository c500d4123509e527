"""Launch configs (``--launch SERVER.yaml``), the live crossover's arms and its bad input, and
``live validate --restarts``' checks: everything that needs no server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from simcap.errors import ScenarioError
from simcap.live.launch import (
    engine_mismatches,
    launch_server,
    load_server_config,
    parse_server_config,
    server_args,
    startup_failure_line,
)
from simcap.config.scenario import load_scenario
from simcap.live.server import VllmServerError, tiny_eagle3_dir, tiny_model_dir

REPO = Path(__file__).resolve().parents[2]
SERVER_YAML = REPO / "examples" / "servers" / "cpu-tiny.yaml"
SCENARIO_YAML = REPO / "examples" / "cpu-tiny-ngram.yaml"
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
EAGLE3 = {"method": "eagle3", "num_speculative_tokens": 3, "model": "tiny-eagle3"}


def test_example_launch_config_builds_both_arms():
    config, base_dir = load_server_config(SERVER_YAML)
    assert base_dir == SERVER_YAML.parent
    assert config.speculative is not None and config.speculative.method == "ngram"
    spec = launch_server(config, base_dir, speculative=True)
    base = launch_server(SERVER_YAML, speculative=False)  # from the path too
    spec.port = base.port = 8123  # command() names the port; start() picks a free one
    spec_cmd, base_cmd = spec.command(), base.command()
    assert spec.model_dir == base.model_dir == tiny_model_dir()
    i = spec_cmd.index("--speculative-config")
    assert json.loads(spec_cmd[i + 1]) == NGRAM
    assert "--speculative-config" not in base_cmd
    # Otherwise the same server: the same flags in the same order.
    assert spec_cmd[:i] + spec_cmd[i + 2:] == base_cmd
    for flag, value in (("--max-num-seqs", "8"), ("--max-num-batched-tokens", "512"), ("--max-model-len", "2048"),
                        ("--block-size", "32"), ("--served-model-name", "tiny"), ("--dtype", "bfloat16")):
        assert base_cmd[base_cmd.index(flag) + 1] == value
    assert "--enable-prefix-caching" in base_cmd and "--enforce-eager" in base_cmd
    assert "--enable-logging-iteration-details" in base_cmd  # calibration fits the per-step log
    assert spec.kv_cache_gib == 1 and spec.startup_timeout == 420 and spec.model == "tiny"


def test_launch_config_defaults_paths_and_extra_args(tmp_path):
    (tmp_path / "draft").mkdir()
    config = parse_server_config({
        "model": "my-model", "engine": {"enable_prefix_caching": False, "enforce_eager": False},
        "speculative": {"method": "eagle3", "num_speculative_tokens": 2, "model": "draft"},
        "extra_args": ["--seed", "7"],
    })  # fmt: skip
    assert config.model_dir(tmp_path) == tmp_path / "my-model"
    assert parse_server_config({"model": "tiny-moe"}).model_dir(tmp_path).name == "moe-model"
    args = server_args(config, tmp_path)
    assert "--no-enable-prefix-caching" in args and args[-2:] == ["--seed", "7"]
    assert json.loads(args[args.index("--speculative-config") + 1]) == {
        "method": "eagle3", "num_speculative_tokens": 2, "model": str(tmp_path / "draft")}
    assert "--enforce-eager" not in launch_server(config, tmp_path).command()
    assert "--speculative-config" not in server_args(config, tmp_path, speculative=False)


def test_synthetic_acceptance_config_reaches_vllm_and_turns_on_the_cpu_hook(tmp_path):
    rates = [0.56, 0.41, 0.3]
    config = parse_server_config({"speculative": {**EAGLE3, "rejection_sample_method": "synthetic",
                                                  "synthetic_acceptance_rates": rates}})
    spec = launch_server(config, tmp_path)
    args = spec.extra_args
    sent = json.loads(args[args.index("--speculative-config") + 1])
    assert sent == {**EAGLE3, "model": str(tiny_eagle3_dir()), "rejection_sample_method": "synthetic",
                    "synthetic_acceptance_rates": rates}
    assert spec.synthetic_acceptance
    # The baseline arm, standard sampling and an ngram server get no synthetic hook.
    assert not launch_server(config, tmp_path, speculative=False).synthetic_acceptance
    assert not launch_server(parse_server_config({"speculative": EAGLE3}), tmp_path).synthetic_acceptance
    assert not launch_server(SERVER_YAML).synthetic_acceptance


def test_synthetic_accept_follows_vllms_kernels():
    """Hand-computed: conditional rates 0.5 / 0.5 / 0.5; request 0 accepts both drafts (bonus
    follows), request 1 rejects its first (target's token, nothing after), request 2 has no
    drafts (bonus only), request 3 accepts one then meets a padding -1 (rejected)."""
    from simcap.live.vllm_sitecustomize import synthetic_accept

    out = [[-1, -1, -1] for _ in range(4)]
    cu = [2, 4, 4, 6]
    draft = [10, 11, 20, 21, 40, -1]
    fallback = [90, 91, 92, 93, 94, 95]
    uniform = [0.1, 0.4, 0.7, 0.1, 0.2, 0.1]
    synthetic_accept(out, cu, draft, fallback, [100, 101, 102, 103], uniform, [0.5, 0.5, 0.5], range(4))
    assert out == [[10, 11, 100], [92, -1, -1], [102, -1, -1], [40, 95, -1]]
    skipped = [[-1, -1, -1] for _ in range(4)]
    synthetic_accept(skipped, cu, draft, fallback, [100, 101, 102, 103], uniform, [0.5, 0.5, 0.5], [1])
    assert skipped[0] == skipped[2] == skipped[3] == [-1, -1, -1] and skipped[1] == [92, -1, -1]


@pytest.mark.parametrize("data, message", [
    ({"engin": {}}, "s.yaml: engin: unknown key; allowed keys: model, served_model_name, engine, speculative"),
    ({"engine": {"max_num_seq": 8}}, "s.yaml: engine.max_num_seq: unknown key; allowed keys: max_num_seqs,"),
    ({"engine": {"max_num_seqs": 0}}, "s.yaml: engine.max_num_seqs: input should be greater than 0"),
    ({"engine": {"max_num_seqs": True}}, "s.yaml: engine.max_num_seqs: input should be a valid integer"),
    ({"engine": {"dtype": "int4"}}, "s.yaml: engine.dtype: input should be 'bfloat16', 'float16', 'float32' or 'auto'"),
    ({"speculative": {"method": "medusa", "num_speculative_tokens": 3}}, "s.yaml: speculative.method: input should be"),
    ({"speculative": {"method": "ngram"}}, "s.yaml: speculative.num_speculative_tokens: required field is missing"),
    ({"speculative": {**NGRAM, "k": 3}}, "s.yaml: speculative.k: unknown key; allowed keys: method,"),
    ({"speculative": {"method": "eagle3", "num_speculative_tokens": 3}},
     "s.yaml: speculative.model: eagle3 needs its draft head's folder"),
    ({"speculative": {**NGRAM, "model": "d"}}, "s.yaml: speculative.model: ngram drafts from the prompt"),
    ({"speculative": {**NGRAM, "prompt_lookup_min": 5}},
     "s.yaml: speculative.prompt_lookup_min: must be <= prompt_lookup_max (4) (got 5)"),
    ({"speculative": {**EAGLE3, "synthetic_acceptance_length": 2.2}},
     "s.yaml: speculative.synthetic_acceptance_length: allowed only with rejection_sample_method: synthetic"),
    ({"speculative": {**EAGLE3, "rejection_sample_method": "synthetic"}},
     "s.yaml: speculative.rejection_sample_method: synthetic needs exactly one of synthetic_acceptance_length and"),
    ({"speculative": {**EAGLE3, "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 2.0,
                      "synthetic_acceptance_rates": [0.5, 0.3, 0.1]}},
     "s.yaml: speculative.rejection_sample_method: synthetic needs exactly one of"),
    ({"speculative": {**EAGLE3, "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 4.5}},
     "s.yaml: speculative.synthetic_acceptance_length: must be in [1, 4] (num_speculative_tokens + 1) (got 4.5)"),
    ({"speculative": {**EAGLE3, "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 0.5}},
     "s.yaml: speculative.synthetic_acceptance_length: input should be greater than or equal to 1"),
    ({"speculative": {**EAGLE3, "rejection_sample_method": "synthetic", "synthetic_acceptance_rates": [0.5, 0.3]}},
     "s.yaml: speculative.synthetic_acceptance_rates: must have 3 entries, one per draft position (got 2)"),
    ({"speculative": {**EAGLE3, "rejection_sample_method": "synthetic",
                      "synthetic_acceptance_rates": [0.5, 0.6, 0.1]}},
     "s.yaml: speculative.synthetic_acceptance_rates: must be non-increasing (got [0.5, 0.6, 0.1])"),
    ({"speculative": {**EAGLE3, "rejection_sample_method": "synthetic",
                      "synthetic_acceptance_rates": [1.5, 0.6, 0.1]}},
     "s.yaml: speculative.synthetic_acceptance_rates: entries must be in [0, 1] (got [1.5, 0.6, 0.1])"),
    ({"speculative": {**EAGLE3, "rejection_sample_method": "block"}},
     "s.yaml: speculative.rejection_sample_method: input should be 'standard' or 'synthetic'"),
    ({"startup_timeout_s": -1}, "s.yaml: startup_timeout_s: input should be greater than 0"),
    ({"extra_args": "--seed 7"}, "s.yaml: extra_args: input should be a valid"),
])  # fmt: skip
def test_bad_launch_configs_are_one_line_naming_the_key(data, message):
    with pytest.raises(ScenarioError) as err:
        parse_server_config(data, "s.yaml")
    text = str(err.value)
    assert text.startswith(message) and "\n" not in text, text


def test_launch_config_files_that_are_not_configs(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ScenarioError, match="bad.yaml: expected a mapping of keys"):
        load_server_config(bad)
    with pytest.raises(ScenarioError, match="cannot read launch config file"):
        load_server_config(tmp_path / "missing.yaml")


def test_engine_mismatches_name_every_flag_that_differs():
    config, _ = load_server_config(SERVER_YAML)
    assert engine_mismatches(config, load_scenario(SCENARIO_YAML)) == []
    sc = load_scenario(SCENARIO_YAML, ["engine.max_num_seqs=16", "engine.block_size=64",
                                       "speculative.num_speculative_tokens=2"])
    assert engine_mismatches(config, sc) == [
        "max_num_seqs: scenario 16, launch config 8",
        "block_size: scenario 64, launch config 32",
        "speculative.num_speculative_tokens: scenario 2, launch config 3",
    ]
    plain = parse_server_config({})
    assert engine_mismatches(plain, load_scenario(SCENARIO_YAML)) == [
        "speculative: scenario ngram k=3, launch config none"]


def test_startup_failure_is_one_line_with_exit_code_and_last_log_lines():
    tail = ("line 1\nline 2\n\n(EngineCore pid=9) ValueError: Block size 16 is not a multiple of 32\nshutting down\n"
            "RuntimeError: Engine core initialization failed. See root cause above.\nresource_tracker: leaked\n")
    exc = VllmServerError(f"vLLM server exited with code 1 during startup; log /x/server.log:\n{tail}", 1, tail)
    line = startup_failure_line(exc)
    assert line == ("vLLM server exited with code 1 during startup; log /x/server.log; last log lines: (EngineCore "
                    "pid=9) ValueError: Block size 16 is not a multiple of 32 | RuntimeError: Engine core "
                    "initialization failed. See root cause above.")
    plain = VllmServerError("vLLM server exited with code 2 during startup; log /x/server.log:\na\nb\nc\nd", 2,
                            "a\nb\nc\nd")
    assert startup_failure_line(plain).endswith("; last log lines: b | c | d")
    waited = VllmServerError("vLLM server not healthy after 5 s; log /x/server.log:\nstill loading", None,
                             "still loading")
    assert startup_failure_line(waited) == (
        "vLLM server not healthy after 5 s; log /x/server.log; last log lines: still loading")
    assert startup_failure_line(VllmServerError("no vLLM python at /v: run .ci/vllm-cpu-setup")) == (
        "no vLLM python at /v: run .ci/vllm-cpu-setup")


def _cli(*args):
    from simcap.cli.live import live_app

    result = CliRunner().invoke(live_app, [str(a) for a in args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def _write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _server_yaml(tmp_path, **changes) -> Path:
    data = yaml.safe_load(SERVER_YAML.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key)
        else:
            data[key] = value
    return _write(tmp_path / "server.yaml", data)


@pytest.mark.parametrize("args, changes, message", [
    (["--concurrency", "1,4"], {"engine": {"max_num_seqs": 8, "max_num_batched_tokn": 512}},
     "engine.max_num_batched_tokn: unknown key"),
    (["--concurrency", "1,4"], {"engine": {"max_num_seqs": 4}},
     "launch config contradicts the scenario: max_num_seqs: scenario 8, launch config 4"),
    (["--concurrency", "1,4"], {"speculative": None}, "launch config: speculative: missing"),
    (["--concurrency", "1,4", "--set", "speculative=null"], {},
     "speculative: the scenario has no speculative section"),
    (["--concurrency", "1,4", "--calibrate-up-to", "4"], {},
     "--calibrate-up-to: 4 clients reaches the highest concurrency (4)"),
    (["--concurrency", "1,x"], {}, "--concurrency: expected comma-separated positive integers"),
    (["--concurrency", "4"], {}, "--concurrency: give at least two concurrencies"),
    (["--concurrency", "1,4", "--form", "cubic"], {}, "--form: linear or roofline (got 'cubic')"),
    (["--concurrency", "1,4", "--form", "roofline"], {}, "--form roofline: give --hardware and --roofline-model"),
])  # fmt: skip
def test_live_crossover_bad_input_fails_before_any_server_starts(tmp_path, args, changes, message):
    server = _server_yaml(tmp_path, **changes)
    code, out, err = _cli("crossover", SCENARIO_YAML, "--launch", server, *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and message in lines[0], err
    assert out == ""


@pytest.mark.parametrize("args, message", [
    ([], "--base-url: give either --base-url (a running server) or --launch SERVER.yaml"),
    (["--base-url", "http://127.0.0.1:9", "--launch", "SERVER"], "--base-url: give either"),
    (["--base-url", "http://127.0.0.1:9", "--restarts", "1"],
     "--restarts: restarting the server between repeats needs --launch"),
    (["--launch", "SERVER", "--restarts", "-1"], "--restarts: must be >= 0 (got -1)"),
    (["--launch", "SERVER", "--set", "engine.max_model_len=4096"],
     "launch config contradicts the scenario: max_model_len: scenario 4096, launch config 2048"),
])  # fmt: skip
def test_live_validate_launch_and_restarts_bad_input(args, message):
    args = [SERVER_YAML if a == "SERVER" else a for a in args]
    code, out, err = _cli("validate", SCENARIO_YAML, *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and message in lines[0], err


def test_measured_arm_points_take_the_simulated_path():
    """ArmPoint.from_summary over a run's records is ArmPoint.of over the same run."""
    import numpy as np

    from simcap.fleet.run import simulate
    from simcap.metrics.summary import summarize
    from simcap.studies.crossover import ArmPoint, arm_scenarios

    spec_sc, _, _ = arm_scenarios(load_scenario(SCENARIO_YAML), concurrency=4, requests_per_client=2)
    result = simulate(spec_sc, records=True)
    recs = result.records
    e2e = np.array([r.chunk_times[-1] - r.arrival_time for r in recs])
    point = ArmPoint.from_summary(summarize(recs), e2e, np.array([r.num_output_tokens for r in recs]),
                                  result.summary.spec_decode["mean_acceptance_length"], spec_sc.digest())
    assert point == ArmPoint.of(result)


def test_prediction_takes_the_calibrated_profile_and_the_measured_acceptance(tmp_path):
    from simcap.live.client import LiveRun
    from simcap.live.crossover_arms import MeasuredPoint, _predicted_scenario
    from simcap.live.prom import ServerMetrics
    from simcap.metrics.records import RequestRecord

    profile = _write(tmp_path / "profile.yaml", {
        "name": "cpu-tiny-test",
        "engine": {"vllm_version": "0.32", "max_num_seqs": 8, "max_num_batched_tokens": 512, "block_size": 32,
                   "max_model_len": 2048, "num_gpu_blocks": 4000, "enable_prefix_caching": True,
                   "async_scheduling": False},
        "step_time": {"base": 0.004, "per_prefill_token": 2.0e-5, "per_decode_token": 2.0e-4,
                      "per_verify_token": 1.0e-4, "host_overhead": 0.002},
    })  # fmt: skip
    before = ServerMetrics(0.0, counters={"vllm:spec_decode_num_drafts": 0.0},
                           histogram_count={"vllm:inter_token_latency_seconds": 0.0})
    after = ServerMetrics(1.0, counters={"vllm:spec_decode_num_drafts": 100.0,
                                         "vllm:spec_decode_num_accepted_tokens": 240.0},
                          histogram_count={"vllm:inter_token_latency_seconds": 125.0},
                          spec_accepted_per_pos={0: 90.0, 1: 80.0, 2: 70.0})
    run = LiveRun(records=[], specs={}, base_url="x", model="tiny", endpoint="completions", closed_loop=True,
                  requested_rate=None, scheduled_rate=None, achieved_rate=None, wall_duration_s=1.0,
                  max_send_lag_s=None, metrics_before=before, metrics_after=after)
    sc, how = _predicted_scenario(load_scenario(SCENARIO_YAML), {"profile": str(profile)},
                                  MeasuredPoint("spec", run=run, concurrency=1, cpu={}, prefix_cache_reset="ok"), 1)
    assert sc.step_time.per_verify_token == 1.0e-4 and sc.step_time.base == 0.004
    assert sc.engine.num_gpu_blocks == 4000 and sc.engine.async_scheduling is False
    assert sc.engine.max_num_seqs == 8 and sc.profile.name == "cpu-tiny-test"
    spec = sc.speculative
    assert spec.acceptance_rates == (0.9, 0.8, 0.7) and spec.proposal_rate == 0.8  # 100 drafts / 125 steps
    assert how == ("server counters of the speculative arm at 1 clients: acceptance length 3.400, proposal rate "
                   "0.800 (scenario 2.500, 1.000)")
    assert sc.workload == load_scenario(SCENARIO_YAML).workload
    assert spec.proposal_concentration is None and spec.proposal_onset_tokens == 0
    # A calibration that found an onset and requests differing in how often they match passes
    # both on; the rate then counts the steps after the onset: 5 requests of 20 tokens, the
    # first 3 decode steps of each taken off (100 drafts / (125 - 15) steps).
    run.records = [RequestRecord(i, 0.0, 16, 20, chunk_times=[1.0] * 20, chunk_tokens=[1] * 20, finish_time=2.0)
                   for i in range(5)]
    cal = {"profile": str(profile),
           "speculative": {"method": "ngram", "proposal_concentration": 0.7, "proposal_onset_tokens": 4}}
    sc2, how2 = _predicted_scenario(load_scenario(SCENARIO_YAML), cal,
                                    MeasuredPoint("spec", run=run, concurrency=1, cpu={}, prefix_cache_reset="ok"), 1)
    spec2 = sc2.speculative
    assert spec2.proposal_concentration == 0.7 and spec2.proposal_onset_tokens == 4
    assert spec2.proposal_rate == round(100 / 110, 6)
    # The baseline arm: its own server's profile, no acceptance to feed (the arm drops it).
    plain = _write(tmp_path / "plain.yaml", {**yaml.safe_load(profile.read_text()), "name": "cpu-tiny-plain",
                                             "step_time": {"base": 0.003, "per_decode_token": 1.5e-4}})
    base_sc, base_how = _predicted_scenario(load_scenario(SCENARIO_YAML), {"profile": str(plain)}, None, 1)
    assert base_how == "none (baseline arm)" and base_sc.step_time.base == 0.003
    assert base_sc.profile.name == "cpu-tiny-plain" and base_sc.workload == sc.workload
    assert how2 == ("server counters of the speculative arm at 1 clients: acceptance length 3.400, proposal rate "
                    "0.909 (scenario 2.500, 1.000) from the onset, 4 output tokens (calibration's step log), "
                    "proposal concentration 0.7 over requests (calibration's step log)")


def test_repeating_prompts_keep_shared_prefixes_shared():
    from simcap.live.prompts import PromptBuilder

    pool = range(10, 400)
    plain, rep = PromptBuilder(pool, seed=3), PromptBuilder(pool, seed=3, period=16)
    head = plain.segment_ids(5, 16)
    assert rep.segment_ids(5, 40) == head + head + head[:8]
    assert rep.segment_ids(5, 10) == head[:10] == plain.segment_ids(5, 10)
    assert rep.segments_ids([(1, 32), (-7, 20)])[:32] == rep.segments_ids([(1, 32), (-8, 20)])[:32]
    with pytest.raises(ValueError, match="period must be >= 1"):
        PromptBuilder(pool, period=0)


def test_calibration_phases_capped_at_a_concurrency():
    from simcap.live.calibration import default_phases

    full = default_phases(8, 512, 2048, 24)
    capped = default_phases(8, 512, 2048, 24, max_concurrency=2)
    assert max(p.concurrency for p in full) > 2
    assert [p.concurrency for p in capped] == [1, 2, 2, 2, 1, 1]  # (the last two: cached, long contexts)
    assert [p.num_requests for p in capped] == [p.num_requests for p in full]


def test_spread_separates_instances_from_repeats():
    """Runs against two instances: the instances' medians and the runs within each."""
    from simcap.config.scenario import parse_scenario
    from simcap.fleet.run import simulate
    from simcap.live.client import LiveRun
    from simcap.live.validate import Repeat, spread_figures, spread_line

    sc = parse_scenario({
        "engine": dict(block_size=32, num_gpu_blocks=1000, max_model_len=2048, max_num_seqs=4),
        "step_time": {"base": 0.004, "per_prefill_token": 1e-5, "per_decode_token": 1e-4},
        "workload": dict(arrival={"process": "closed", "concurrency": 2}, num_requests=6, input_len=64,
                         output_len=16),
    })  # fmt: skip
    reps = []
    # Instance 0 runs at base 4 ms and 5 ms, instance 1 at 8 ms and 10 ms a step.
    for i, (instance, base) in enumerate([(0, 0.004), (0, 0.005), (1, 0.008), (1, 0.010)]):
        run_sc = sc.model_copy(update={"step_time": sc.step_time.model_copy(update={"base": base})})
        sim = simulate(run_sc, records=True)
        live = LiveRun(records=sim.records, specs={}, base_url="x", model="m", endpoint="completions",
                       closed_loop=True, requested_rate=None, scheduled_rate=None, achieved_rate=None,
                       wall_duration_s=1.0, max_send_lag_s=None)
        reps.append(Repeat(i, live, sim.summary, sim.summary, sim.records, {"disturbed": False}, "ok",
                           instance=instance))
    figures = spread_figures(reps)
    tpot = [r.live_summary.tpot_s.p50 for r in reps]
    mid = sorted(tpot)[1:3]
    median = (mid[0] + mid[1]) / 2
    between = ((tpot[2] + tpot[3]) / 2 - (tpot[0] + tpot[1]) / 2) / median
    within = sorted([(tpot[1] - tpot[0]) / median, (tpot[3] - tpot[2]) / median])
    assert figures["tpot_p50"]["between_instances"] == pytest.approx(between)
    assert figures["tpot_p50"]["within_instance"] == pytest.approx(sum(within) / 2)
    assert between > 0.4 and figures["tpot_p50"]["within_instance"] < between
    line = spread_line({"spread": {"text": "2 server instances (restarted between them), 2 run(s) each",
                                   "metrics": figures}})
    assert line.startswith("spread: 2 server instances (restarted between them), 2 run(s) each (ttft_p50 between "
                           "instances ")
    assert f"tpot_p50 between instances {between * 100:.1f}%, within an instance" in line
    one = spread_figures(reps[:1])
    assert one["tpot_p50"] == {"between_instances": None, "within_instance": None}
