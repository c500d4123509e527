"""simcap transfer: a roofline profile moved to other hardware. The truth is known: tables are
made by simulating a deployment whose experts run at one efficiency on the source accelerator
and at another on the target (another kernel class), everything else equal."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from simcap.calibrate.transfer import default_refit, transfer
from simcap.config.scenario import StepTimeConfig, parse_scenario
from simcap.fleet.run import simulate

ROOT = Path(__file__).resolve().parents[1]
ENGINE = {"max_num_seqs": 32, "max_num_batched_tokens": 2048, "block_size": 16, "num_gpu_blocks": 20000,
          "max_model_len": 4096}
ROOFLINE = {"form": "roofline", "model": "qwen3-30b-a3b", "weight_dtype": "bf16", "base": 0.004}
SOURCE = {**ROOFLINE, "hardware": "h100-sxm", "efficiency": {"experts": 1.3}}
TARGET = {**ROOFLINE, "hardware": "mi300x", "efficiency": {"experts": 2.4}}  # the truth there
COLS = ["--column", "clients=concurrency", "--column", "tpot_ms=median_tpot_ms"]


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "simcap", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def tpot(step_time: dict, clients: int) -> float:
    result = simulate(parse_scenario({
        "engine": ENGINE, "step_time": step_time, "seed": 0,
        "workload": {"arrival": {"process": "closed", "concurrency": clients}, "num_requests": 4 * clients,
                     "input_len": 256, "output_len": 64},
    }))
    return result.summary.tpot_s.p50


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("transfer")
    table = folder / "target.csv"
    with table.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["clients", "input_len", "output_len", "tpot_ms"])
        for c in (2, 8, 24):
            w.writerow([c, 256, 64, f"{tpot(TARGET, c) * 1e3:.5f}"])
    profile = folder / "source.yaml"
    profile.write_text(yaml.safe_dump({"name": "src", "hardware": "1x H100", "engine": ENGINE,
                                       "step_time": SOURCE, "provenance": {"fit_method": "truth"}}))
    return folder, table, profile


def test_default_refit_by_rows():
    moe = StepTimeConfig(**SOURCE)
    dense = StepTimeConfig(**{**SOURCE, "model": "llama-3.1-8b"})
    assert default_refit(moe, 0) == []
    assert default_refit(moe, 1) == ["efficiency.experts"]
    assert default_refit(moe, 3) == ["base", "efficiency.experts"]
    assert default_refit(dense, 1) == ["efficiency.weights"]


def test_one_row_refits_the_experts_and_predicts_the_rest(setup, tmp_path):
    folder, table, profile = setup
    moved = transfer(profile, hardware="mi300x", inputs=[str(table)], rows=["c=24"],
                     table=_reading())
    st = moved.profile["step_time"]
    assert moved.refitted == ["efficiency.experts"]
    assert st["hardware"] == "mi300x" and st["base"] == SOURCE["base"]
    assert st["efficiency"]["experts"] == pytest.approx(2.4, rel=0.03)
    for c in (2, 8):  # rows it never saw
        assert tpot(st, c) == pytest.approx(tpot(TARGET, c), rel=0.03)
    record = moved.profile["provenance"]["transfer"]
    assert record["from"]["hardware"] == "h100-sxm" and record["to"]["hardware"] == "mi300x"
    assert "efficiency.experts" not in record["carried"] and "base" in record["carried"]
    # by the datasheet alone the experts keep the source's kernels and miss the target
    alone = transfer(profile, hardware="mi300x").profile
    assert alone["step_time"]["efficiency"]["experts"] == 1.3 and alone["provenance"]["transfer"]["refitted"] == []
    assert tpot(alone["step_time"], 24) < 0.85 * tpot(TARGET, 24)


def test_cli_writes_the_moved_profile_and_refuses_in_one_line(setup, tmp_path):
    folder, table, profile = setup
    out = run("transfer", profile, table, *COLS, "--rows", "c=24", "--hardware", "mi300x", "--out", tmp_path / "m.yaml")
    assert out.returncode == 0, out.stderr
    assert re.search(r"refitted: efficiency.experts = 2\.[34]", out.stdout), out.stdout
    written = yaml.safe_load((tmp_path / "m.yaml").read_text())
    assert written["name"] == "src@mi300x" and written["provenance"]["transfer"]["refitted"] == ["efficiency.experts"]
    assert "a second row, at the other end of the loads" in out.stderr, out.stderr
    js = run("transfer", profile, table, *COLS, "--rows", "c=24", "--hardware", "mi300x", "--json",
             "--out", tmp_path / "j.yaml")
    record = json.loads(js.stdout)
    assert js.returncode == 0 and record["refitted"] == ["efficiency.experts"], js.stderr
    assert record["values"]["efficiency.experts"] == pytest.approx(2.4, rel=0.03)
    assert [r["point"] for r in record["fitted_rows"]] == ["c=24"] and record["advice"].startswith("one row refitted")
    alone = run("transfer", profile, "--hardware", "mi300x", "--out", tmp_path / "alone.yaml")
    assert alone.returncode == 0 and "refitted: none (the catalog alone)" in alone.stdout, alone.stderr
    assert "note: moved by the catalog alone" in alone.stderr
    linear = tmp_path / "linear.yaml"
    linear.write_text(yaml.safe_dump({"name": "l", "engine": ENGINE, "step_time": {"base": 0.01}}))
    for args, message in (
        ((linear,), "transfer moves a roofline profile"),
        ((profile, "--refit", "base"), "--refit: refits terms on the target's measured rows"),
        ((profile, "--tensor-parallel-size", "3"), "step_time.tensor_parallel_size: 3 and the model's 4 KV heads"),
        ((profile, "--tensor-parallel-size", "0"), "step_time.tensor_parallel_size: input should be greater than 0"),
        ((profile, "--kernel-class", "nope"), "--kernel-class: unknown kernel class 'nope'; known: "),
    ):
        bad = run("transfer", *args, "--hardware", "mi300x", "--out", tmp_path / "x.yaml")
        assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and message in bad.stderr, bad.stderr
    bad = run("transfer", profile, "--hardware", "no-such", "--out", tmp_path / "x.yaml")
    assert bad.returncode == 2 and "unknown hardware 'no-such'" in bad.stderr, bad.stderr


def _reading():
    from simcap.calibrate.readers import TableReading

    return TableReading.parse(["clients=concurrency", "tpot_ms=median_tpot_ms"])


def test_a_kernel_class_covering_the_target_gives_its_efficiencies(tmp_path):
    from simcap.calibrate.core import CalibrationError
    from simcap.catalog import resolve_kernel_class

    src = {"form": "roofline", "model": "gpt-oss-120b", "hardware": "h100-sxm", "weight_dtype": "bf16",
           "expert_weight_dtype": "mxfp4", "compute_dtype": "bf16", "tensor_parallel_size": 2,
           "base": 0.003, "efficiency": {"experts": 1.24, "compute": 1.34, "tp_comm": 1.1}}
    profile = tmp_path / "oss.yaml"
    profile.write_text(yaml.safe_dump({"name": "oss", "engine": ENGINE, "step_time": src}))
    moved = transfer(profile, hardware="mi325x").profile
    cdna3 = resolve_kernel_class("cdna3-vllm-mxfp4-moe")
    eff = moved["step_time"]["efficiency"]
    assert eff["experts"] == cdna3.efficiency["experts"] and eff["tp_comm"] == 1.1  # unnamed: carried
    record = moved["provenance"]["transfer"]
    assert record["kernel_class"]["name"] == "cdna3-vllm-mxfp4-moe"
    assert "efficiency.experts" not in record["carried"] and "efficiency.tp_comm" in record["carried"]
    kept = transfer(profile, hardware="mi325x", kernel_class="none").profile
    assert kept["step_time"]["efficiency"]["experts"] == 1.24 and kept["provenance"]["transfer"]["kernel_class"] is None
    assert transfer(profile, hardware="b200").profile["provenance"]["transfer"]["kernel_class"] is None  # none covers it
    with pytest.raises(CalibrationError, match="--kernel-class: hopper-vllm-mxfp4-moe covers h100-sxm, h200-sxm"):
        transfer(profile, hardware="mi300x", kernel_class="hopper-vllm-mxfp4-moe")


def test_a_move_to_more_ranks_splits_the_weights_and_keeps_the_efficiencies(setup, tmp_path):
    folder, table, profile = setup
    moved = transfer(profile, hardware="h100-sxm", tensor_parallel_size=2).profile
    assert moved["step_time"]["tensor_parallel_size"] == 2
    assert moved["step_time"]["efficiency"]["experts"] == 1.3  # same hardware: no class, carried
    one = StepTimeConfig(**SOURCE).physics
    two = StepTimeConfig(**moved["step_time"]).physics
    assert two.weights == pytest.approx(one.weights / 2) and two.experts_all == pytest.approx(one.experts_all / 2)
    assert two.tp_latency > 0 == one.tp_latency  # the all-reduces a single rank never paid
    record = moved["provenance"]["transfer"]
    assert (record["from"]["tensor_parallel_size"], record["to"]["tensor_parallel_size"]) == (1, 2)
