#!/usr/bin/env python
"""Chunked prefill and ITL on the 910B4 long-context run: batch budget 32768 vs 8192.

Regenerates every number in README.md and the figures beside it::

    python experiments/chunked-prefill-itl/run.py            # writes results.json and PNGs here
    python experiments/chunked-prefill-itl/run.py --profile P  # another profile (e.g. a draft)

Measured (published, budget 32768): ITL median 64.5 ms, 22.7% of ITLs > 1,500 ms, 9.3% in
100-1,500 ms. Predicted: the same three figures at budget 8192 (withheld by the field).
Each budget is also rerun with every bootstrap coefficient set of the profile, for the spread
that the fit's uncertainty puts on each figure.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

import simcap
from simcap.capacity import bootstrap_sets
from simcap.plots import itl_by_step_kind, itl_stats, plot_itl_histogram, plot_step_timeline
from simcap.scenario import StepTimeConfig

HERE = Path(__file__).resolve().parent
BUDGETS = (32768, 8192)
# The field's rerun at 8192 let vLLM size the pool again: 767,872 tokens = 5,999 blocks of 128
# (they also pinned it back to the 32768 pool once: no ITL figure moved by more than 2.1%).
POOL_BLOCKS_AT_8192 = 767_872 // 128
PUBLISHED = {32768: {"median_s": 0.0645, "frac_above": 0.227, "frac_between": 0.093}}


MARK_BEGIN, MARK_END = "<!-- results:begin (written by run.py) -->", "<!-- results:end -->"


def update_readme(markdown: str) -> None:
    """Replace the generated block of README.md (between the markers) with ``markdown``."""
    path = HERE / "README.md"
    if not path.exists():
        return
    text = path.read_text()
    if MARK_BEGIN in text and MARK_END in text:
        head, rest = text.split(MARK_BEGIN, 1)
        tail = rest.split(MARK_END, 1)[1]
        path.write_text(f"{head}{MARK_BEGIN}\n{markdown}{MARK_END}{tail}")


def results_markdown(res: dict) -> str:
    pub = res["published"]["32768"]

    def pct(x):
        return "-" if x is None else f"{x * 100:.1f}%"

    def rng(entry, key, scale, fmt):
        b = entry.get("bootstrap", {}).get(key)
        return "-" if not b else f"{fmt(b[0] * scale)}-{fmt(b[1] * scale)}"

    lines = [
        "| ITL per stream chunk | median | 100-1,500 ms | > 1,500 ms |",
        "|---|---|---|---|",
        f"| budget 32,768, published (measured) | {pub['median_s'] * 1e3:.1f} ms | "
        f"{pct(pub['frac_between'])} | {pct(pub['frac_above'])} |",
    ]
    for budget in ("32768", "8192"):
        e = res["budgets"][budget]
        kind = "simulated (fitted to the row above)" if budget == "32768" else "**PREDICTED**"
        lines.append(
            f"| budget {int(budget):,}, {kind} | {e['median_s'] * 1e3:.1f} ms | "
            f"{pct(e['frac_between'])} | {pct(e['frac_above'])} |"
        )
        if "bootstrap" in e:
            n = e["bootstrap"]["num_sets"]
            lines.append(
                f"| budget {int(budget):,}, range over {n} bootstrap sets (2.5-97.5%) | "
                f"{rng(e, 'median_s', 1e3, lambda v: f'{v:.0f}')} ms | "
                f"{rng(e, 'frac_between', 100, lambda v: f'{v:.1f}')}% | "
                f"{rng(e, 'frac_above', 100, lambda v: f'{v:.1f}')}% |"
            )
    a, b = res["budgets"]["32768"], res["budgets"]["8192"]
    prof = res["provenance"].get("profile") or {}
    lines += [
        "",
        "| other figures (simulated) | budget 32,768 | budget 8,192 |",
        "|---|---|---|",
        f"| ITLs ended by a step that computed a prefill chunk | {pct(a['frac_of_itls_ended_by_a_prefill_step'])} | {pct(b['frac_of_itls_ended_by_a_prefill_step'])} |",
        f"| longest step | {a['max_step_s']:.2f} s | {b['max_step_s']:.2f} s |",
        f"| input throughput (published at 32,768: 14,459 tok/s) | {a['input_tokens_per_s']:,.0f} tok/s | {b['input_tokens_per_s']:,.0f} tok/s |",
        f"| run duration | {a['duration_s']:.0f} s | {b['duration_s']:.0f} s |",
        f"| TTFT p50 / TPOT p50 | {a['ttft_p50_s']:.2f} s / {a['tpot_p50_s'] * 1e3:.0f} ms | {b['ttft_p50_s']:.2f} s / {b['tpot_p50_s'] * 1e3:.0f} ms |",
        f"| KV pool (blocks of 128) | {a['kv_pool_blocks']:,} | {b['kv_pool_blocks']:,} |",
        "",
        f"Profile `{prof.get('path')}` sha256 `{str(prof.get('sha256'))[:12]}`. Wall time on a "
        f"shared 2-core machine: {a['wall_s']:.2f} s and {b['wall_s']:.2f} s per simulation, "
        f"{res['wall_s']:.0f} s for the whole script (bootstrap reruns and figures included).",
        "",
    ]
    return "\n".join(lines)


def load(budget: int, profile: str | None) -> simcap.Scenario:
    overrides = [f"engine.max_num_batched_tokens={budget}"]
    if profile:
        overrides.append(f"profile={Path(profile).resolve()}")
    scenario = simcap.load_scenario(HERE / "scenario.yaml", overrides)
    if budget != 32768 and scenario.engine.memory is None:
        scenario = simcap.load_scenario(
            HERE / "scenario.yaml", overrides + [f"engine.num_gpu_blocks={POOL_BLOCKS_AT_8192}"]
        )
    return scenario


def with_coefficients(scenario: simcap.Scenario, coefs: dict[str, float]) -> simcap.Scenario:
    values = {**scenario.step_time.model_dump(), **coefs}
    return scenario.model_copy(update={"step_time": StepTimeConfig(**values)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", help="profile file instead of the scenario's")
    parser.add_argument("--out", default=str(HERE), help="folder for results.json and figures")
    parser.add_argument("--max-sets", type=int, default=40, help="bootstrap sets to rerun")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    results: dict[str, object] = {"budgets": {}, "published": {str(k): v for k, v in PUBLISHED.items()}}
    runs = {}
    for budget in BUDGETS:
        scenario = load(budget, args.profile)
        t0 = time.perf_counter()
        result = simcap.simulate(scenario)
        wall = time.perf_counter() - t0
        itl, with_prefill = itl_by_step_kind(result)
        stats = itl_stats(itl)
        steps = result.steps.as_arrays()
        entry = {
            **stats,
            "frac_of_itls_ended_by_a_prefill_step": float(with_prefill.mean()),
            "input_tokens_per_s": result.summary.throughput["input_tokens_per_s"],
            "output_tokens_per_s": result.summary.throughput["output_tokens_per_s"],
            "duration_s": result.summary.duration_s,
            "ttft_p50_s": result.summary.ttft_s.p50,
            "tpot_p50_s": result.summary.tpot_s.p50,
            "kv_pool_blocks": scenario.engine.num_blocks,
            "num_steps": len(result.steps),
            "max_step_s": float(steps["duration"].max()),
            "wall_s": wall,
        }
        sets, notes = bootstrap_sets(scenario)
        if sets:
            idx = np.linspace(0, len(sets) - 1, min(args.max_sets, len(sets))).round().astype(int)
            boot = [itl_stats(itl_by_step_kind(simcap.simulate(with_coefficients(scenario, sets[i])))[0])
                    for i in sorted(set(idx.tolist()))]
            entry["bootstrap"] = {
                "num_sets": len(boot),
                "notes": notes,
                **{
                    key: [float(v) for v in np.percentile([b[key] for b in boot], [2.5, 97.5])]
                    for key in ("median_s", "frac_between", "frac_above")
                },
            }
        results["budgets"][str(budget)] = entry
        runs[budget] = result
        plot_step_timeline(result, out / f"step_timeline_{budget}.png")
        print(f"budget {budget:>6}: median ITL {stats['median_s'] * 1e3:7.1f} ms, "
              f"> 1.5 s {stats['frac_above'] * 100:5.1f}%, 0.1-1.5 s {stats['frac_between'] * 100:5.1f}%"
              f"  ({wall:.2f} s wall)")

    plot_itl_histogram(
        {f"budget {b:,}": runs[b] for b in BUDGETS},
        out / "itl_histograms.png",
        title="910B4 long context (33,077-token prompts, 16 in flight): per-step ITL by batch budget",
        reference={f"budget {b:,}": PUBLISHED[b] for b in PUBLISHED},
    )
    first = runs[BUDGETS[0]]
    results["provenance"] = {
        **first.provenance,
        "scenario_sha256_by_budget": {str(b): runs[b].scenario.digest() for b in BUDGETS},
        "command": "python experiments/chunked-prefill-itl/run.py"
        + (f" --profile {args.profile}" if args.profile else ""),
    }
    results["wall_s"] = time.perf_counter() - t_start
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    if out == HERE:
        update_readme(results_markdown(results))
    print(f"wrote {out / 'results.json'}, itl_histograms.png, step_timeline_*.png "
          f"in {results['wall_s']:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
