"""Teaching views write non-empty PNGs; the step timeline finds the prefill stall."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from simcap.studies.capacity import find_capacity
from simcap.studies.plots import (
    itl_by_step_kind,
    itl_stats,
    pick_window,
    plot_capacity,
    plot_itl_histogram,
    write_simulation_plots,
)
from simcap.config.scenario import parse_scenario
from simcap.fleet.run import simulate

ROOT = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"

# Long prompts that fill the step budget while 6 requests decode: decode stalls by design.
STALL = {
    "name": "stall",
    "engine": dict(max_num_seqs=8, max_num_batched_tokens=4096, block_size=16,
                   num_gpu_blocks=4000, max_model_len=8192, enable_prefix_caching=False),
    "step_time": dict(base=0.01, per_prefill_token=2.5e-4, per_decode_token=1.0e-4),
    "workload": {"arrival": {"process": "closed", "concurrency": 6}, "num_requests": 24,
                 "input_len": 4000, "output_len": 40},
    "seed": 0,
}


@pytest.fixture(scope="module")
def stall_result():
    return simulate(parse_scenario(STALL), records=True, steps=True)


def _is_png(path: Path) -> bool:
    return path.stat().st_size > 5000 and path.read_bytes()[:8] == PNG


def test_simulation_plots_are_pngs(stall_result, tmp_path):
    paths = write_simulation_plots(stall_result, tmp_path / "figs")
    assert [p.name for p in paths] == ["step_timeline.png", "itl_histogram.png", "kv_queue.png"]
    assert all(_is_png(p) for p in paths)


def test_itl_splits_into_decode_and_prefill_peaks(stall_result):
    itl, with_prefill = itl_by_step_kind(stall_result)
    assert itl.size == sum(len(r.chunk_times) - 1 for r in stall_result.records)
    # a 4000-token prefill step takes ~1 s, a decode step ~10 ms
    assert np.all(itl[with_prefill] > 0.5) and np.all(itl[~with_prefill] < 0.05)
    st = itl_stats(itl, (0.1, 0.5))
    assert st["frac_above"] == pytest.approx(with_prefill.mean())
    assert st["frac_below"] + st["frac_between"] + st["frac_above"] == pytest.approx(1.0)


def test_window_holds_the_longest_mixed_step(stall_result):
    t0, t1 = pick_window(stall_result)
    st = stall_result.steps.as_arrays()
    mixed = (st["num_prefill_tokens"] > 0) & (st["num_decode_tokens"] > 0)
    assert mixed.any()
    inside = mixed & (st["start"] >= t0) & (st["start"] < t1)
    assert inside.any() and t1 > t0


def test_itl_histogram_of_several_series(stall_result, tmp_path):
    itl = itl_by_step_kind(stall_result)[0]
    path = plot_itl_histogram({"a": stall_result, "b": itl}, tmp_path / "h.png",
                              reference={"a": {"median_s": 0.01, "frac_above": 0.2}})
    assert _is_png(path)


def test_capacity_plot(tmp_path):
    scenario = parse_scenario({
        "engine": dict(max_num_seqs=1, max_num_batched_tokens=64, block_size=16,
                       num_gpu_blocks=64, max_model_len=256),
        "step_time": dict(base=0.01, per_prefill_token=0.0, per_decode_token=0.0),
        "workload": {"arrival": {"process": "poisson", "rate": 10.0}, "duration_s": 5.0,
                     "input_len": 16, "output_len": 2},
    })
    result = find_capacity(scenario, {"ttft_p95": 0.05, "tpot_p95": 0.02}, rates=[5, 20, 60],
                           duration_s=5.0, replicates=1)
    assert _is_png(plot_capacity(result, tmp_path / "c.png"))


def test_cli_simulate_plot_prints_paths(tmp_path):
    out = tmp_path / "figs"
    proc = subprocess.run(
        [sys.executable, "-m", "simcap", "simulate", "examples/chat.yaml", "--set",
         "workload.num_requests=100", "--plot", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    printed = [line.split("figure: ", 1)[1] for line in proc.stdout.splitlines()
               if line.startswith("figure: ")]
    assert len(printed) == 3 and all(_is_png(Path(p)) for p in printed)
