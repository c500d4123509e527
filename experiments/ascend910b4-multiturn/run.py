#!/usr/bin/env python
"""The field's 910B4 multi-turn run as a session workload: input throughput, prefix-hit share
and actual prefill rate (PREDICTED, then compared with the published figures).

Regenerates every number in README.md, results.json and sessions.png::

    PYTHONPATH=. python experiments/ascend910b4-multiturn/run.py

The session workload's unpublished parts (turns per session, new tokens per turn, the first
turn's length, tool time) are fixed in scenario.yaml from what the field README says, before
any run; nothing here is tuned to a published figure. Beside the baseline prediction:

1. seeds 0-9: only 16 sessions are drawn, so the draw itself moves the figures;
2. one assumption at a time moved to a plausible low and high value (seed 0);
3. the profile's bootstrap step-time coefficient sets (seed 0).

Definitions as the field re-derived them from the server's counters: input throughput =
prompt tokens (vllm:prompt_tokens, prefix hits included) / run duration; actual prefill =
(prompt tokens - vllm:prefix_cache_hits) / duration; duration = first send to last token.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from simcap.config.scenario import load_scenario  # noqa: E402
from simcap.fleet.run import simulate  # noqa: E402
from simcap.metrics.report import to_json, write_generated_block  # noqa: E402
from simcap.studies.plots import plot_sessions  # noqa: E402
from simcap.workloads.sessions import SessionWorkload  # noqa: E402

SCENARIO = HERE / "scenario.yaml"
PUBLISHED = {"input_tokens_per_s": 13271.0, "prefill_tokens_per_s": 1088.0}
PUBLISHED["prefix_hit_share"] = 1.0 - PUBLISHED["prefill_tokens_per_s"] / PUBLISHED["input_tokens_per_s"]
SEEDS = range(10)
# (assumption, its baseline, [(label, --set overrides)]): each moved alone, seed 0.
SENSITIVITY = [
    ("new tokens per later turn", "uniform 128-1,024", [
        ("uniform 64-512", ["workload.input_len={dist: uniform, low: 64, high: 512}"]),
        ("uniform 256-2,048", ["workload.input_len={dist: uniform, low: 256, high: 2048}"]),
    ]),
    ("first turn", "4,096", [
        ("1,024", ["workload.sessions.first_input_len=1024"]),
        ("16,384", ["workload.sessions.first_input_len=16384"]),
    ]),
    ("first turn shared across sessions", "none", [
        ("2,048 of its 4,096 tokens", ["workload.prefix={shared_tokens: 2048}"]),
    ]),
    ("turns per session", "uniform 1-32", [
        ("uniform 16-32", ["workload.sessions.turns={dist: uniform, low: 16, high: 32}"]),
        ("32", ["workload.sessions.turns=32"]),
    ]),
    ("tool time between turns", "0 s", [
        ("0.5 s", ["workload.sessions.think_time_s=0.5"]),
        ("2 s", ["workload.sessions.think_time_s=2"]),
    ]),
    ("acceptance length", "2.608 (published)", [
        ("2.386 (ShareGPT run)", ["speculative.acceptance_length=2.386"]),
    ]),
]


def figures(result) -> dict:
    s = result.summary
    hits = s.prefix_cache_hit_tokens
    return {
        "input_tokens_per_s": s.input_tokens / s.duration_s,
        "prefill_tokens_per_s": (s.input_tokens - hits) / s.duration_s,
        "prefix_hit_share": hits / s.input_tokens,
        "duration_s": s.duration_s,
        "turns": s.sessions["turns"],
        "mean_prompt_tokens": s.input_tokens / s.sessions["turns"],
        "output_tokens_per_s": s.throughput["output_tokens_per_s"],
        "acceptance_length": (s.spec_decode or {}).get("mean_acceptance_length"),
    }


def run(overrides: list[str], *, records: bool = False):
    scenario = load_scenario(SCENARIO, overrides)
    return scenario, simulate(scenario, records=records, steps=records)


def err(pred: float, key: str) -> float:
    return pred / PUBLISHED[key] - 1.0


def recompute_per_turn(scenario, result) -> dict:
    """Prompt tokens a later turn computes beyond its own new tokens: the conversation's
    last partial block (the answer's tail), and the hit block EAGLE gives back."""
    workload = SessionWorkload(scenario.workload, scenario.seed)
    plans: dict[int, object] = {}
    extra = []
    for r in result.records:
        if r.turn == 0:
            continue
        plan = plans.setdefault(r.session_id, workload.plan(r.session_id))
        extra.append(r.num_prompt_tokens - r.num_cached_tokens - plan.turns[r.turn].new_tokens)
    extra = np.array(extra)
    return {"mean": float(extra.mean()), "min": int(extra.min()), "max": int(extra.max()),
            "block_size": scenario.engine.block_size}


def markdown(res: dict) -> str:
    b, pub = res["baseline"], PUBLISHED
    spread = res["seeds"]
    lines = [
        "| | published | predicted (seed 0) | error | seeds 0-9 (min-max) |",
        "|---|---|---|---|---|",
    ]
    for key, label, fmt in (
        ("input_tokens_per_s", "input tok/s incl. prefix hits", "{:,.0f}"),
        ("prefix_hit_share", "prefix-hit share of prompt tokens", "{:.1%}"),
        ("prefill_tokens_per_s", "actual prefill tok/s", "{:,.0f}"),
    ):
        lo, hi = spread[key]["min"], spread[key]["max"]
        lines.append(
            f"| {label} | {fmt.format(pub[key])} | **{fmt.format(b[key])}** | "
            f"{err(b[key], key):+.1%} | {fmt.format(lo)}-{fmt.format(hi)} |"
        )
    lines += [
        "",
        f"Baseline run: {b['turns']} turns in {b['duration_s']:,.0f} s, mean prompt "
        f"{b['mean_prompt_tokens']:,.0f} tokens, {b['output_tokens_per_s']:,.0f} output tok/s, "
        f"acceptance length {b['acceptance_length']:.3f}. A later turn computes on average "
        f"{res['recompute']['mean']:,.0f} prompt tokens beyond its own new ones "
        f"({res['recompute']['min']}-{res['recompute']['max']}; block size "
        f"{res['recompute']['block_size']}).",
        "",
        "Sensitivity, one assumption at a time (seed 0; error against the published figure):",
        "",
        "| assumption (baseline) | value | input tok/s | hit share | prefill tok/s |",
        "|---|---|---|---|---|",
    ]
    for row in res["sensitivity"]:
        f = row["figures"]
        lines.append(
            f"| {row['assumption']} ({row['baseline']}) | {row['value']} | "
            f"{f['input_tokens_per_s']:,.0f} ({err(f['input_tokens_per_s'], 'input_tokens_per_s'):+.0%}) | "
            f"{f['prefix_hit_share']:.1%} | "
            f"{f['prefill_tokens_per_s']:,.0f} ({err(f['prefill_tokens_per_s'], 'prefill_tokens_per_s'):+.0%}) |"
        )
    boot = res["bootstrap"]
    lines += [
        "",
        f"Step-time coefficients, the profile's {len(boot)} bootstrap sets (seed 0): input "
        f"{min(f['input_tokens_per_s'] for f in boot):,.0f}-{max(f['input_tokens_per_s'] for f in boot):,.0f} tok/s, "
        f"prefill {min(f['prefill_tokens_per_s'] for f in boot):,.0f}-{max(f['prefill_tokens_per_s'] for f in boot):,.0f} tok/s.",
        "",
        f"Profile `{res['provenance']['profile']}` sha256 `{res['provenance']['profile_sha256'][:12]}`; "
        f"simcap {res['provenance']['simcap_version']}. Wall time on a shared 2-core machine: "
        f"{res['wall_s']:.1f} s.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    t0 = time.perf_counter()
    scenario, base = run([], records=True)
    res: dict = {"published": PUBLISHED, "baseline": figures(base),
                 "recompute": recompute_per_turn(scenario, base)}
    plot_sessions(base, HERE / "sessions.png")
    per_seed = [figures(run([f"seed={s}"])[1]) for s in SEEDS]
    res["seeds"] = {
        key: {"min": min(f[key] for f in per_seed), "max": max(f[key] for f in per_seed),
              "median": float(np.median([f[key] for f in per_seed]))}
        for key in ("input_tokens_per_s", "prefix_hit_share", "prefill_tokens_per_s")
    }
    res["sensitivity"] = [
        {"assumption": name, "baseline": baseline, "value": label, "overrides": sets,
         "figures": figures(run(sets)[1])}
        for name, baseline, values in SENSITIVITY for label, sets in values
    ]
    profile = yaml.safe_load((SCENARIO.parent / "../../calibration/profiles/ascend910b4-minimax-m2.7.yaml")
                             .read_text())
    res["bootstrap"] = [
        figures(run([f"step_time.{k}={v}" for k, v in coeffs.items()])[1])
        for coeffs in profile.get("bootstrap", [])
    ]
    prov = base.provenance
    res["provenance"] = {
        "profile": "../../calibration/profiles/ascend910b4-minimax-m2.7.yaml",
        "profile_sha256": prov["profile"]["sha256"], "scenario_sha256": prov["scenario_sha256"],
        "simcap_version": prov["simcap_version"],
    }
    res["wall_s"] = time.perf_counter() - t0
    (HERE / "results.json").write_text(to_json({k: v for k, v in res.items() if k != "wall_s"}) + "\n")
    write_generated_block(HERE / "README.md", markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
