#!/usr/bin/env python
"""Chunked prefill and ITL on the 910B4 long-context run: batch budget 32768, 16384, 8192, 2048.

Regenerates every number in README.md and the figures beside it::

    python experiments/chunked-prefill-itl/run.py            # writes results.json and PNGs here
    python experiments/chunked-prefill-itl/run.py --profile P  # another profile (e.g. a draft)

Measured (published, budget 32768): ITL median 64.5 ms, 22.7% of ITLs > 1,500 ms, 9.3% in
100-1,500 ms, input throughput 14,459 tok/s. Predicted: every ITL figure at 16384, 8192 and 2048
(the field re-ran 8192 but withheld its figures; nothing here is tuned to them).

KV pool per budget: measured at 32768 (695,936 tokens) and 8192 (767,872 tokens); PREDICTED at
16384 and 2048 by simcap's memory planner, with the activation coefficient fitted from those two
measured pools (as tests/test_memory.py does). Each budget is also rerun with every bootstrap
coefficient set of the profile, for the spread that the fit's uncertainty puts on each figure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

import simcap
from simcap.calibrate.fit_bench import apply_coefficients
from simcap.metrics.report import write_generated_block
from simcap.studies.capacity import bootstrap_sets
from simcap.catalog.memory import (
    GB,
    GiB,
    MemorySpec,
    ModelShape,
    fit_activation_fixed,
    fit_activation_per_token,
    load_hf_config,
    plan_kv,
)
from simcap.studies.plots import (
    DECODE_COLOR,
    ITL_BANDS,
    PREFILL_COLOR,
    STALL_COLOR,
    itl_by_step_kind,
    itl_stats,
    plot_step_timeline,
)
from simcap.config.scenario import StepTimeConfig

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BUDGETS = (32768, 16384, 8192, 2048)
BLOCK_SIZE = 128  # the profile's engine.block_size
MAX_MODEL_LEN = 204_800  # field README B: max_model_len 204,800

# --------------------------------------------------------------------------- KV pool per budget
# Measured pools (field README, deployment B): "KV pool: 695,936 tokens (20.91 GiB per card)" at
# max_num_batched_tokens 32768; "With the batch budget lowered to 8192 the pool grows to 767,872
# tokens" (vLLM sized it again: the profiling run's activations shrink with the budget). The field
# also pinned the 8192 pool back to the 32768 one once: no ITL figure moved by more than 2.1%.
MEASURED_POOL_TOKENS = {32768: 695_936, 8192: 767_872}
KV_GIB_PER_CARD_AT_32768 = 20.91  # field README B: "20.91 GiB per card" (vLLM logs GiB)
TP = 8  # field README B: TP8 + expert parallel
SHAPE_FILE = REPO / "calibration" / "data" / "model-shapes" / "minimax-m2.7.json"
# 62 layers x 8 KV heads x 128 x bf16 (public config) + 1 EAGLE3 draft layer of the same layout:
# 252 KiB per token, the published figure; at TP8 one KV head per card = 32,256 B/token/card.
DRAFT_LAYERS = 1
MEMORY_SPEC = dict(
    # ASSUMPTION: the 64 GB 910B4 variant (64 GiB), as examples/ascend910b4-kv.yaml. It enters
    # only the fitted fixed activation term; the predicted pools do not depend on it.
    gpu_memory_gb=64 * GiB / GB,
    gpu_memory_utilization=0.85,  # field README B: --gpu-memory-utilization 0.85
    weights_gb=(216 + 2.68) / 8,  # field README B: weights 216 GB + EAGLE3 head 2.68 GB, over 8 cards
    tensor_parallel_size=TP,
    # activation_gb_per_batched_token: fitted below from the two measured pools;
    # activation_gb_fixed: fitted below so the estimate gives 20.91 GiB of KV at 32768.
)


def plan_pools(budgets=BUDGETS) -> dict:
    """The KV pool at each budget: measured where the field measured it, else the planner's.

    The planner is calibrated as tests/test_memory.py does (test_c): the per-batched-token
    activation coefficient from the two measured pools, the fixed term from the KV share at
    32768. It must give back both measured pools exactly (checked here).
    """
    shape = ModelShape.from_hf_config(load_hf_config(SHAPE_FILE), draft_layers=DRAFT_LAYERS)
    per_card = shape.kv_bytes_per_token(TP)
    coef = fit_activation_per_token(sorted(MEASURED_POOL_TOKENS.items()), per_card)
    base = MemorySpec(model=shape, activation_gb_per_batched_token=coef, **MEMORY_SPEC)
    kv_gb_32768 = KV_GIB_PER_CARD_AT_32768 * GiB / GB
    fixed = fit_activation_fixed(base, kv_cache_gb=kv_gb_32768, max_num_batched_tokens=32768)
    spec = base.model_copy(update={"activation_gb_fixed": fixed})
    pools = {}
    for budget in budgets:
        plan = plan_kv(spec, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                       max_num_batched_tokens=budget)
        measured = MEASURED_POOL_TOKENS.get(budget)
        if measured is not None and plan.pool_tokens != measured:
            raise SystemExit(f"memory planner gives {plan.pool_tokens} tokens at {budget}, "
                             f"the field measured {measured}: the calibration is off")
        pools[budget] = {
            "source": "measured (field)" if measured is not None else "PREDICTED (memory planner)",
            "num_gpu_blocks": plan.num_gpu_blocks,
            "pool_tokens": plan.pool_tokens,
            "planner_activation_gb_per_card": plan.activation_gb,
            "planner_kv_gb_per_card": plan.kv_gb,
        }
    calibration = {
        "kv_bytes_per_token_per_card": per_card,
        "activation_gb_per_batched_token": coef,
        "activation_gb_fixed": fixed,
        "memory_spec": {k: v for k, v in spec.model_dump().items() if k != "model"},
        "model_shape": shape.model_dump(),
    }
    return {"pools": pools, "calibration": calibration}


# --------------------------------------------------------------------------- published row
# Field README B, long-context scenario. sglang's input throughput = input tokens / duration, so
# the run took 100 x 33,077 / 14,459 = 228.8 s (derived, not published as such).
PUBLISHED = {
    32768: {
        "median_s": 0.0645,
        "frac_above": 0.227,
        "frac_between": 0.093,
        "input_tokens_per_s": 14_459.0,
        "duration_s_derived": 100 * 33_077 / 14_459.0,
    }
}

BOOT_KEYS = ("median_s", "p95_s", "mean_s", "frac_between", "frac_above",
             "input_tokens_per_s", "duration_s")

def update_readme(markdown: str) -> None:
    write_generated_block(HERE / "README.md", markdown)


def results_markdown(res: dict) -> str:
    pub = res["published"]["32768"]
    budgets = [b for b in map(str, BUDGETS) if b in res["budgets"]]

    def pct(x):
        return "-" if x is None else f"{x * 100:.1f}%"

    def ms(x):
        return "-" if x is None else f"{x * 1e3:,.0f} ms" if x >= 0.1 else f"{x * 1e3:.1f} ms"

    def rng(entry, key, scale, fmt, unit=""):
        b = entry.get("bootstrap", {}).get(key)
        if not b:
            return "-"
        lo, hi = fmt(b[0] * scale), fmt(b[1] * scale)
        return f"{lo}{unit}" if lo == hi else f"{lo}-{hi}{unit}"

    lines = [
        "| ITL per stream chunk | median | p95 | mean | 100-1,500 ms | > 1,500 ms "
        "| input tok/s | total time | KV pool (tokens) |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| budget 32,768, published (measured) | {ms(pub['median_s'])} | - | - | "
        f"{pct(pub['frac_between'])} | {pct(pub['frac_above'])} | "
        f"{pub['input_tokens_per_s']:,.0f} | {pub['duration_s_derived']:.0f} s (derived) | "
        f"{MEASURED_POOL_TOKENS[32768]:,} (measured) |",
    ]
    for budget in budgets:
        e = res["budgets"][budget]
        pool = res["kv_pools"].get(budget, {})
        pool_src = "measured" if pool.get("source", "").startswith("measured") else "**predicted**"
        kind = "simulated (fitted to the row above)" if budget == "32768" else "**PREDICTED**"
        lines.append(
            f"| budget {int(budget):,}, {kind} | {ms(e['median_s'])} | {ms(e['p95_s'])} | "
            f"{ms(e['mean_s'])} | {pct(e['frac_between'])} | {pct(e['frac_above'])} | "
            f"{e['input_tokens_per_s']:,.0f} | {e['duration_s']:.0f} s | "
            f"{e['kv_pool_blocks'] * BLOCK_SIZE:,} ({pool_src}) |"
        )
        if "bootstrap" in e:
            n = e["bootstrap"]["num_sets"]
            lines.append(
                f"| &nbsp;&nbsp;range over {n} bootstrap sets (2.5-97.5%) | "
                f"{rng(e, 'median_s', 1e3, lambda v: f'{v:,.0f}', ' ms')} | "
                f"{rng(e, 'p95_s', 1e3, lambda v: f'{v:,.0f}', ' ms')} | "
                f"{rng(e, 'mean_s', 1e3, lambda v: f'{v:,.0f}', ' ms')} | "
                f"{rng(e, 'frac_between', 100, lambda v: f'{v:.1f}', '%')} | "
                f"{rng(e, 'frac_above', 100, lambda v: f'{v:.1f}', '%')} | "
                f"{rng(e, 'input_tokens_per_s', 1, lambda v: f'{v:,.0f}')} | "
                f"{rng(e, 'duration_s', 1, lambda v: f'{v:.0f}', ' s')} | |"
            )
    head = " | ".join(f"budget {int(b):,}" for b in budgets)
    e = [res["budgets"][b] for b in budgets]

    def row(name, fn):
        return f"| {name} | " + " | ".join(fn(x) for x in e) + " |"

    prof = res["provenance"].get("profile") or {}
    cal = res["kv_calibration"]
    lines += [
        "",
        f"| other figures (simulated) | {head} |",
        "|---|" + "---|" * len(budgets),
        row("ITLs <= 100 ms", lambda x: pct(x["frac_below"])),
        row("ITLs ended by a step that computed a prefill chunk",
            lambda x: pct(x["frac_of_itls_ended_by_a_prefill_step"])),
        row("steps that computed a prefill chunk", lambda x: pct(x["frac_of_steps_with_prefill"])),
        row("engine steps", lambda x: f"{x['num_steps']:,}"),
        row("longest step", lambda x: f"{x['max_step_s']:.2f} s"),
        row("TTFT p50 / TPOT p50",
            lambda x: f"{x['ttft_p50_s']:.2f} s / {x['tpot_p50_s'] * 1e3:.0f} ms"),
        row("KV pool, blocks of 128", lambda x: f"{x['kv_pool_blocks']:,}"),
        "",
        "KV pools: measured at 32,768 and 8,192; at 16,384 and 2,048 predicted by "
        "`simcap.catalog.memory.plan_kv` with an activation coefficient of "
        f"{cal['activation_gb_per_batched_token'] * GB / 1e3:.2f} kB per batched token per card "
        "(fitted from the two measured pools, which the planner gives back exactly). Profile "
        f"`{prof.get('path')}` sha256 `{str(prof.get('sha256'))[:12]}`. Wall time on a shared "
        "2-core machine: "
        + ", ".join(f"{x['wall_s']:.2f} s" for x in e)
        + f" per simulation; {res['wall_s']:.0f} s for the whole script (bootstrap reruns and "
        "figures included).",
        "",
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------- simulation


def load(budget: int, profile: str | None, pool_blocks: int) -> simcap.Scenario:
    overrides = [f"engine.max_num_batched_tokens={budget}"]
    if profile:
        # Relative to the scenario, so no machine path reaches results.json.
        overrides.append(f"profile={os.path.relpath(Path(profile).resolve(), HERE)}")
    scenario = simcap.load_scenario(HERE / "scenario.yaml", overrides)
    if budget != 32768 and scenario.engine.memory is None:
        # The profile's pool is the one measured at 32768; vLLM re-sizes it at other budgets.
        scenario = simcap.load_scenario(
            HERE / "scenario.yaml", overrides + [f"engine.num_gpu_blocks={pool_blocks}"]
        )
    return scenario


def with_coefficients(scenario: simcap.Scenario, coefs: dict[str, float]) -> simcap.Scenario:
    values = apply_coefficients(scenario.step_time.model_dump(), coefs)
    return scenario.model_copy(update={"step_time": StepTimeConfig(**values)})


def figures(result) -> dict[str, float]:
    """ITL median, p95, mean and band shares (per stream chunk), throughput and duration."""
    itl = itl_by_step_kind(result)[0]
    stats = itl_stats(itl)
    return {
        **stats,
        "p95_s": float(np.percentile(itl, 95)) if itl.size else None,
        "mean_s": float(itl.mean()) if itl.size else None,
        "input_tokens_per_s": result.summary.throughput["input_tokens_per_s"],
        "duration_s": result.summary.duration_s,
    }


# --------------------------------------------------------------------------- figure


def plot_itl_grid(runs: dict[int, object], path: Path, *, title: str, pools: dict) -> Path:
    """The per-chunk ITL histograms of every budget in a 2x2 grid: same log bins, same y axis."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    lo_band, hi_band = ITL_BANDS
    data = {b: itl_by_step_kind(r) for b, r in runs.items()}
    positive = np.concatenate([itl[itl > 0] for itl, _ in data.values()])
    lo_edge = max(float(positive.min()) * 0.8, 1e-3)
    hi_edge = max(float(positive.max()) * 1.7, hi_band * 2.5)
    bins = np.geomspace(lo_edge, hi_edge, 70)
    ncols = 2
    nrows = -(-len(data) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(14, 4.1 * nrows + 0.7), sharex=True,
                             sharey=True, squeeze=False)
    heights = []
    for ax, (budget, (itl, kind)) in zip(axes.flat, data.items()):
        clipped = np.clip(itl, lo_edge, hi_edge)
        w = 100.0 / itl.size
        counts, _, _ = ax.hist(
            [clipped[~kind], clipped[kind]], bins=bins, stacked=True,
            weights=[np.full(int((~kind).sum()), w), np.full(int(kind.sum()), w)],
            color=[DECODE_COLOR, PREFILL_COLOR], edgecolor="white", linewidth=0.3,
            label=["the step was decode only", "the step also computed a prefill chunk"])
        heights.append(float(np.max(counts[-1])))
    top = max(heights) * 1.3
    for ax, (budget, (itl, kind)) in zip(axes.flat, data.items()):
        st = itl_stats(itl)
        ref = PUBLISHED.get(budget, {})
        ax.axvspan(lo_band, hi_band, color="#bbbbbb", alpha=0.22, lw=0)
        ax.axvspan(hi_band, hi_edge, color=STALL_COLOR, alpha=0.08, lw=0)
        for edge in ITL_BANDS:
            ax.axvline(edge, color="#777777", lw=0.8, ls=":")
        med = st["median_s"]
        ax.axvline(med, color="black", lw=1.2, ls="--", ymax=0.62)
        kind_txt = "simulated, fitted" if budget == 32768 else "PREDICTED"
        pool = pools[budget]
        pool_txt = "measured" if pool["source"].startswith("measured") else "predicted"
        head = (f"budget {budget:,} ({kind_txt}): median {med * 1e3:,.1f} ms (dashed), "
                f"p95 {np.percentile(itl, 95) * 1e3:,.0f} ms")
        if ref.get("median_s") is not None:
            head += f"\npublished median {ref['median_s'] * 1e3:.1f} ms"
        else:
            head += f"\n{st['count']:,} ITLs"
        head += f"; KV pool {pool['pool_tokens']:,} tokens ({pool_txt})"
        ax.set_title(head, fontsize=9.5, loc="left")
        regions = [
            (np.sqrt(lo_edge * lo_band), f"<= {lo_band * 1e3:.0f} ms", st["frac_below"], None,
             "#333333"),
            (np.sqrt(lo_band * hi_band), f"{lo_band * 1e3:.0f}-{hi_band * 1e3:,.0f} ms",
             st["frac_between"], ref.get("frac_between"), "#333333"),
            (np.sqrt(hi_band * hi_edge), f"> {hi_band * 1e3:,.0f} ms", st["frac_above"],
             ref.get("frac_above"), STALL_COLOR),
        ]
        for xpos, name, frac, pub, color in regions:
            text = f"{name}\n{frac * 100:.1f}%"
            if pub is not None:
                text += f"\n(published {pub * 100:.1f}%)"
            ax.text(xpos, top * 0.97, text, ha="center", va="top", fontsize=9, color=color,
                    fontweight="bold")
        ax.set_xscale("log")
        ax.set_xlim(lo_edge, hi_edge)
        ax.set_ylim(0, top)
    for ax in axes[:, 0]:
        ax.set_ylabel("% of ITLs")
    for ax in axes[-1, :]:
        ax.set_xlabel("inter-token latency per stream chunk (log scale)")
        ax.xaxis.set_major_formatter(plt.FuncFormatter(
            lambda y, _p=None: f"{y * 1e3:,.4g} ms" if y < 1 else f"{y:,.4g} s"))
    for ax in axes.flat[len(data):]:
        ax.set_visible(False)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", ncol=2, fontsize=9, framealpha=0.95,
               bbox_to_anchor=(0.99, 0.995))
    fig.suptitle(title, fontsize=11, x=0.01, ha="left", y=0.99)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", help="profile file instead of the scenario's")
    parser.add_argument("--form", choices=("linear", "roofline"), default="linear",
                        help="step-time form: linear (the scenario's profile, results here) or "
                             "roofline (the .roofline profile, results in roofline/)")
    parser.add_argument("--out", default=None, help="folder for results.json and figures")
    parser.add_argument("--max-sets", type=int, default=40, help="bootstrap sets to rerun")
    args = parser.parse_args()
    if args.form == "roofline" and not args.profile:
        args.profile = str(HERE.parents[1] / "calibration" / "profiles"
                           / "ascend910b4-minimax-m2.7.roofline.yaml")
    if args.out is None:
        args.out = str(HERE if args.form == "linear" else HERE / "roofline")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    kv = plan_pools()
    results: dict[str, object] = {
        "budgets": {},
        "published": {str(k): v for k, v in PUBLISHED.items()},
        "kv_pools": {str(b): v for b, v in kv["pools"].items()},
        "kv_calibration": kv["calibration"],
    }
    runs = {}
    for budget in BUDGETS:
        scenario = load(budget, args.profile, kv["pools"][budget]["num_gpu_blocks"])
        t0 = time.perf_counter()
        result = simcap.simulate(scenario, records=True, steps=True)
        wall = time.perf_counter() - t0
        _, with_prefill = itl_by_step_kind(result)
        stats = figures(result)
        steps = result.steps.as_arrays()
        entry = {
            **stats,
            "frac_of_itls_ended_by_a_prefill_step": float(with_prefill.mean()),
            "frac_of_steps_with_prefill": float((steps["num_prefill_tokens"] > 0).mean()),
            "output_tokens_per_s": result.summary.throughput["output_tokens_per_s"],
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
            boot = [figures(simcap.simulate(with_coefficients(scenario, sets[i]), records=True, steps=True))
                    for i in sorted(set(idx.tolist()))]
            entry["bootstrap"] = {
                "num_sets": len(boot),
                "notes": notes,
                **{key: [float(v) for v in np.percentile([b[key] for b in boot], [2.5, 97.5])]
                   for key in BOOT_KEYS},
            }
        results["budgets"][str(budget)] = entry
        runs[budget] = result
        plot_step_timeline(result, out / f"step_timeline_{budget}.png")
        print(f"budget {budget:>6}: ITL median {stats['median_s'] * 1e3:7.1f} ms, "
              f"p95 {stats['p95_s'] * 1e3:7.1f} ms, mean {stats['mean_s'] * 1e3:6.1f} ms, "
              f"> 1.5 s {stats['frac_above'] * 100:5.1f}%, 0.1-1.5 s {stats['frac_between'] * 100:5.1f}%, "
              f"input {stats['input_tokens_per_s']:,.0f} tok/s, {stats['duration_s']:.0f} s, "
              f"pool {scenario.engine.num_blocks * BLOCK_SIZE:,} ({wall:.2f} s wall)")

    plot_itl_grid(
        runs, out / "itl_histograms.png", pools=kv["pools"],
        title="910B4 long context: 33,077-token prompts, 128 output, 16 in flight, 100 prompts\n"
              "ITL per stream chunk by batch budget (same bins, same y axis)",
    )
    first = runs[BUDGETS[0]]
    results["provenance"] = {
        **first.provenance,
        "scenario_sha256_by_budget": {str(b): runs[b].scenario.digest() for b in BUDGETS},
        "command": " ".join(["python experiments/chunked-prefill-itl/run.py", *sys.argv[1:]]),
    }
    results["wall_s"] = time.perf_counter() - t_start
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    if out == HERE:
        update_readme(results_markdown(results))
    print(f"wrote {out / 'results.json'}, itl_histograms.png, step_timeline_*.png "
          f"in {results['wall_s']:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
