"""End-to-end tests of the ``simcap`` command: the README's command, JSON, overrides, bad input."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "simcap", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```\n(.*?)```", text, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_readme_opens_with_two_setup_commands():
    install_and_run, tests = readme_commands()[:2]
    assert install_and_run.startswith("pip install -e . && simcap simulate examples/")
    assert "pytest" in tests
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests.split("&& ")[-1] in ci, ".ci/run must run the README's test command"


def test_readme_main_command_runs():
    command = readme_commands()[0].split("&& ", 1)[1]
    args = shlex.split(command)
    assert args[0] == "simcap"
    proc = run(*args[1:])
    assert proc.returncode == 0, proc.stderr
    assert "TTFT" in proc.stdout and "vLLM 0.32" in proc.stdout


@pytest.mark.parametrize("example", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_runs_to_json(example):
    proc = run("simulate", str(example), "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert set(data[key]) >= {"mean", "p50", "p90", "p95", "p99"}
    assert set(data["throughput"]) >= {"requests_per_s", "output_tokens_per_s", "input_tokens_per_s"}
    assert data["completed"] > 0 and data["duration_s"] > 0 and "preemptions" in data
    declared = yaml.safe_load(example.read_text())["engine"].get("vllm_version", "0.32")
    assert data["provenance"]["vllm_version_modelled"] == declared


def test_json_is_byte_identical_for_the_same_seed_and_changes_with_the_seed():
    first = run("simulate", "examples/chat.yaml", "--json", "--set", "workload.num_requests=200")
    second = run("simulate", "examples/chat.yaml", "--json", "--set", "workload.num_requests=200")
    other = run("simulate", "examples/chat.yaml", "--json", "--set", "workload.num_requests=200",
                "--set", "seed=1")
    assert first.stdout == second.stdout
    assert first.stdout != other.stdout


def test_set_overrides_change_the_run():
    base = json.loads(run("simulate", "examples/chat.yaml", "--json",
                          "--set", "workload.num_requests=100").stdout)
    faster = json.loads(run("simulate", "examples/chat.yaml", "--json",
                            "--set", "workload.num_requests=100",
                            "--set", "workload.arrival.rate=3",
                            "--set", "engine.max_num_batched_tokens=8192").stdout)
    assert faster["duration_s"] < base["duration_s"]
    assert faster["provenance"]["scenario_sha256"] != base["provenance"]["scenario_sha256"]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(text)
    return path


GOOD = """
engine: {max_num_seqs: 8, max_num_batched_tokens: 512, block_size: 32, num_gpu_blocks: 64, max_model_len: 2048}
workload: {arrival: {process: poisson, rate: 2.0}, num_requests: 10, input_len: 512, output_len: 64}
"""


@pytest.mark.parametrize(
    "text,overrides,expected",
    [
        (GOOD.replace("max_num_seqs: 8", "max_num_seq: 8"), [], "engine.max_num_seq: unknown key; allowed keys:"),
        (GOOD, ["workload.arrival.rate=-1"], "workload.arrival.rate: input should be greater than 0 (got -1)"),
        (GOOD, ["workload.input_len=4000"], "workload.input_len: prompt (4000) + output (64) tokens exceed engine.max_model_len (2048)"),
        (GOOD, ["engine.num_gpu_blocks=10"], "engine.num_gpu_blocks: a KV pool of 288 tokens"),
        ("engine: {max_num_seqs: [1, 2\n", [], "malformed YAML"),
        (GOOD, ["workload.arrival.process=uniform"], "workload.arrival: "),
        (GOOD, ["seed=abc"], "seed: input should be a valid integer"),
        (GOOD, ["slo.ttft_p42=1"], "slo.ttft_p42: unknown SLO"),
        (GOOD, ["workload.duration_s=5"], "give exactly one of num_requests or duration_s"),
        (GOOD, ["engine=3"], "engine: "),
        (GOOD, ["noequals"], "--set 'noequals': expected dotted.key=value"),
        (GOOD, ["workload.input_len={dist: uniform, low: 9, high: 3}"], "high must be >= low"),
        (GOOD, ["engine.watermark=0.1", "engine.vllm_version='0.23'"], "engine.watermark: vLLM 0.23 has no admission watermark"),
        (GOOD, ["engine.prefill_schedule_interval=2", "engine.vllm_version='0.26'"], "engine.prefill_schedule_interval: vLLM 0.26 has no prefill cadence (modelled from 0.32); allowed: 1"),
        (GOOD, ["engine.prefill_schedule_interval=0"], "engine.prefill_schedule_interval: input should be greater than or equal to 1"),
        (GOOD, ["engine.async_scheduling=true", "speculative={method: ngram, num_speculative_tokens: 3, acceptance_length: 2}"], "engine.async_scheduling: vLLM refuses async scheduling with ngram drafts"),
        (GOOD, ["speculative={method: eagle3, num_speculative_tokens: 0, acceptance_length: 1.5}"], "speculative.num_speculative_tokens: input should be greater than or equal to 1"),
        (GOOD, ["speculative={method: eagle3, num_speculative_tokens: 3, acceptance_length: 4.5}"], "speculative.acceptance_length: must be in [1, k+1] = [1, 4]"),
        (GOOD, ["speculative={method: eagle3, num_speculative_tokens: 3, acceptance_rates: [0.7, 0.5]}"], "speculative.acceptance_rates: need one rate per draft position, 3 (got 2)"),
        (GOOD, ["speculative={method: eagle3, num_speculative_tokens: 2, acceptance_rates: [0.7, 1.5]}"], "speculative.acceptance_rates.1: input should be less than or equal to 1"),
        (GOOD, ["speculative={method: medusa, num_speculative_tokens: 2, acceptance_length: 2}"], "speculative.method: "),
    ],
)
def test_bad_input_is_one_clear_line_with_exit_code_2(tmp_path, text, overrides, expected):
    assert expected in simulate_error_line(write(tmp_path, text), overrides)


def simulate_error_line(path: Path, overrides: list[str]) -> str:
    """``simcap simulate PATH --set ...``'s error: exit code 2, one line, no traceback."""
    args = ["simulate", str(path)]
    for item in overrides:
        args += ["--set", item]
    proc = run(*args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


def test_missing_file_is_one_line(tmp_path):
    proc = run("simulate", str(tmp_path / "nope.yaml"))
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "cannot read scenario file" in proc.stderr


def test_kv_command_prints_the_pool_from_memory():
    proc = run("kv", "examples/ascend910b4-kv.yaml", "--json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["pool_tokens"] == 695_936 and plan["kv_bytes_per_token_per_card"] == 258_048 // 8


def test_kv_command_answers_whether_a_context_fits():
    proc = run("kv", "examples/ascend910b4-kv.yaml", "--json", "--set", "engine.max_model_len=1000000")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["max_model_len_fits"] is False


def test_kv_command_needs_a_memory_section():
    proc = run("kv", "examples/chat.yaml")
    assert proc.returncode == 2 and "engine.memory:" in proc.stderr


def test_a_sweep_over_memory_flags_moves_the_simulated_pool():
    proc = run("sweep", "examples/memory-whatif.yaml", "--json",
               "--grid", "engine.max_num_batched_tokens=8192,32768",
               "--grid", "engine.memory.gpu_memory_utilization=0.8,0.85",
               "--metric", "provenance.kv_pool_blocks", "--set", "workload.num_requests=4")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)["rows"]
    blocks = {(r["engine.max_num_batched_tokens"], r["engine.memory.gpu_memory_utilization"]):
              r["provenance.kv_pool_blocks"] for r in rows}
    # The two measured 910B4 pools come back from the estimate; less memory, fewer blocks.
    assert blocks[(32768, 0.85)] == 695_936 // 128 and blocks[(8192, 0.85)] == 767_872 // 128
    assert blocks[(32768, 0.8)] < blocks[(32768, 0.85)]


ROOFLINE = GOOD + """
step_time:
  form: roofline
  hardware: {memory_gb: 80, memory_bandwidth_gbps: 100, peak_tflops: {bf16: 50},
             interconnect: {bandwidth_gbps: 50, latency_us: 5}}
  model: {config: model.json}
"""
MODEL_JSON = {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 8,
              "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 32000,
              "num_local_experts": 16, "num_experts_per_tok": 2, "torch_dtype": "bfloat16"}


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["step_time.hardware=no-such-gpu"], "step_time.hardware: unknown hardware 'no-such-gpu'; known: "),
        (["step_time.model=no-such-model"], "step_time.model: unknown model 'no-such-model'; known: "),
        (["step_time.hardware.memory_bandwidth_gbps=-5"], "step_time.hardware.memory_bandwidth_gbps: input should be greater than 0"),
        (["step_time.model.config=missing.json"], "step_time.model.config: cannot read"),
        (["step_time.hardware.memory_gb=0.01"], "step_time.model: 0.1 GB of weights per rank (tensor_parallel_size 1) exceed the hardware's memory_gb (0.01)"),
        (["step_time.per_decode_token=0.1"], "step_time.per_decode_token: a linear-form term"),
        (["step_time.form=linear"], "step_time.hardware: a roofline key; set form: roofline"),
    ],
)
def test_bad_roofline_input_is_one_line_with_exit_code_2(tmp_path, overrides, expected):
    (tmp_path / "model.json").write_text(json.dumps(MODEL_JSON))
    assert expected in simulate_error_line(write(tmp_path, ROOFLINE), overrides)


def test_roofline_scenario_runs_and_top_k_is_checked(tmp_path):
    (tmp_path / "model.json").write_text(json.dumps(MODEL_JSON))
    path = write(tmp_path, ROOFLINE)
    proc = run("simulate", str(path), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["completed"] == 10
    (tmp_path / "model.json").write_text(json.dumps({**MODEL_JSON, "num_experts_per_tok": 17}))
    proc = run("simulate", str(path))
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "error: step_time.model.num_experts_per_tok: top-17 routing exceeds the 16 routed experts")


@pytest.mark.parametrize("name", ["a[/b]", "[bold]x[/bold] [red]y"])
def test_tables_print_markup_in_a_name_as_written(name):
    """rich reads no markup in what the user wrote: a closing tag with no opening one used to
    end the command with rich's MarkupError, and a matched pair styled the name."""
    done = run("simulate", "examples/chat.yaml", "--set", "workload.num_requests=20",
               "--set", f"name={name}")
    assert done.returncode == 0, done.stderr
    assert f"scenario {name} sha256" in " ".join(done.stdout.split())


def test_calibrate_marks_a_poor_fit_in_its_table(tmp_path):
    """The one styled cell (a fitted value off by more than the warning bound) is a rich Text,
    markup being off: it prints as the error, not as a tag."""
    lines = ["num_decode_tokens,step_time_s"] + [f"{d},{0.005 + 1e-5 * d * d}" for d in range(1, 65, 3)]
    (tmp_path / "q.csv").write_text("\n".join(lines) + "\n")
    done = run("calibrate", str(tmp_path / "q.csv"), "--out", str(tmp_path / "p.yaml"))
    assert done.returncode == 0, done.stderr
    assert "fitted vs measured" in done.stdout and "[bold" not in done.stdout
    assert re.search(r"[+-]\d+\.\d%", done.stdout)


def test_a_scenario_without_step_time_is_warned_of_once_its_numbers_are_out(tmp_path):
    """No step_time, no profile: the illustrative defaults stand in. The command says so in
    one line on stderr after its output, and the output's provenance names the source; a
    scenario with step_time gets no warning, and a failing command says only why it failed."""
    from typer.testing import CliRunner

    from simcap.cli import app

    bare = {"engine": {"max_num_seqs": 4, "num_gpu_blocks": 1000, "max_model_len": 2048},
            "workload": {"arrival": {"process": "poisson", "rate": 2.0}, "num_requests": 5,
                         "input_len": 100, "output_len": 10}}
    path = tmp_path / "bare.yaml"
    path.write_text(yaml.safe_dump(bare))
    res = CliRunner().invoke(app, ["simulate", str(path), "--json"])
    assert res.exit_code == 0, res.stderr
    (line,) = res.stderr.splitlines()
    assert line.startswith(f"warning: {path}: step_time: not given (no step_time section, no profile)")
    source = json.loads(res.stdout)["provenance"]["step_time_source"]
    assert source.startswith("illustrative defaults") and "not a measurement" in source

    path.write_text(yaml.safe_dump({**bare, "step_time": {"base": 0.004}}))
    res = CliRunner().invoke(app, ["simulate", str(path), "--json"])
    assert res.exit_code == 0 and res.stderr == "", res.stderr
    assert json.loads(res.stdout)["provenance"]["step_time_source"] == "scenario"

    path.write_text(yaml.safe_dump(bare))
    res = CliRunner().invoke(app, ["simulate", str(path), "--set", "engine.max_num_seqs=0"])
    assert res.exit_code == 2 and len(res.stderr.splitlines()) == 1 and "warning" not in res.stderr, res.stderr
    # kv prices no step: no warning.
    res = CliRunner().invoke(app, ["kv", str(path)])
    assert "warning" not in res.stderr


def _a800_closed(tmp_path: Path, extra: str = "") -> Path:
    profile = ROOT / "calibration" / "profiles" / "a800-minimax-m3.yaml"
    return write(tmp_path, f"profile: {profile}\n{extra}workload: {{arrival: {{process: closed, concurrency: 2}}, "
                           "num_requests: 8, input_len: 100, output_len: 64}\n")


@pytest.mark.parametrize("how", ["scenario", "set"])
def test_speculative_null_removes_the_profiles_drafts(tmp_path, how):
    with_drafts = json.loads(run("simulate", str(_a800_closed(tmp_path)), "--json").stdout)
    assert with_drafts["spec_decode"] is not None  # the A800 profile drafts with EAGLE3
    if how == "scenario":
        args = [str(_a800_closed(tmp_path, "speculative: null\n"))]
    else:
        args = [str(_a800_closed(tmp_path)), "--set", "speculative=null"]
    done = run("simulate", *args, "--json")
    assert done.returncode == 0, done.stderr
    without = json.loads(done.stdout)
    assert without["spec_decode"] is None
    assert without["throughput"]["output_tokens_per_s"] < with_drafts["throughput"]["output_tokens_per_s"]


@pytest.mark.parametrize("section", ["engine", "step_time"])
def test_a_required_section_cannot_be_nulled_over_a_profile(tmp_path, section):
    line = simulate_error_line(_a800_closed(tmp_path), [f"{section}=null"])
    assert line == (f"error: {section}: null: a scenario cannot remove the profile's {section} section "
                    "(leave the key out to take it, or give one); only speculative: null and frontend: null remove a section")


def test_provenance_follows_a_hardware_override_and_names_what_it_inherits(tmp_path):
    profile = ROOT / "calibration" / "profiles" / "a800-minimax-m3.roofline.yaml"
    path = write(tmp_path, f"profile: {profile}\nstep_time: {{hardware: h100-sxm}}\nworkload: {{arrival: "
                           "{process: closed, concurrency: 2}, num_requests: 8, input_len: 100, output_len: 64}\n")
    provenance = json.loads(run("simulate", str(path), "--json").stdout)["provenance"]
    assert provenance["profile"]["overridden"] == {"step_time.hardware": {"profile": "a800-80gb",
                                                                           "scenario": "h100-sxm"}}
    assert provenance["profile"]["inherited_as_fitted"] == {"engine.vllm_version": "0.26"}
    assert provenance["step_time_source"].endswith(
        "; not as fitted: step_time.hardware a800-80gb -> h100-sxm; inherited as fitted: engine.vllm_version 0.26")
    plain = write(tmp_path, f"profile: {profile}\nworkload: {{arrival: {{process: closed, concurrency: 2}}, "
                            "num_requests: 8, input_len: 100, output_len: 64}\n")
    assert json.loads(run("simulate", str(plain), "--json").stdout)["provenance"]["profile"]["overridden"] is None
