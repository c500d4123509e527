"""The README's "Headline studies" table, from each study's results file.

One row per folder of ``experiments/``: the study (its README), its question, and the headline
figures its README leads with, read from its results file and formatted here, so that no figure
in the table is typed by hand. ``tests/test_readme.py`` compares the README's block with what
this script renders now: a results file that changes without the README fails it.

    python experiments/index.py           # print the table
    python experiments/index.py --write   # replace the block between the markers in README.md

Reads JSON only (no simcap import): a study's row is a function of its results file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
README = ROOT / "README.md"
BEGIN = "<!-- studies:begin -->"
END = "<!-- studies:end -->"

# experiments/cpu-extrapolation fits on these closed-loop levels and holds out the rest
# (FIT_LEVELS in its analyse.py); its results file lists every level without saying which.
CPU_FIT_LEVELS = (1, 2, 4)


def _load(folder: str, name: str = "results.json") -> dict:
    return json.loads((HERE / folder / name).read_text())


def _pct(value: float, digits: int = 1) -> str:
    """A signed percentage from a percentage (``-2.73`` -> ``-2.7%``)."""
    return f"{value:+.{digits}f}%"


def _frac(value: float, digits: int = 1) -> str:
    """A fraction as a percentage (``0.9175`` -> ``91.7%``)."""
    return f"{value * 100:.{digits}f}%"


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.1f} ms" if ms < 100 else f"{ms:,.0f} ms"


def _span(values) -> str:
    values = list(values)
    return f"{min(values)}-{max(values)}"


def a800_eagle3_crossover(d: dict) -> tuple[str, str]:
    rows = d["published_vs_simulated"]
    errors = [abs(r[m]["error_pct"]) for r in rows for m in ("throughput", "latency_mean")]
    published_spec = max(r["concurrency"] for r in rows if r["arm"] == "eagle3")
    withheld = [p["concurrency"] for p in d["prediction"]]
    boot = d["bootstrap"]
    question = "Where does EAGLE3 stop paying on the A800 MiniMax-M3 deployment?"
    result = (f"predicted crossover **{d['crossover']['value']:.1f} clients** "
              f"({boot['p05']:.1f}-{boot['p95']:.1f} over {boot['sets_used']} bootstrap sets); the "
              f"field published EAGLE3 up to {published_spec} clients and withheld "
              f"{_span(withheld)}: predicted, not yet checked. Fitted rows: mean abs. error "
              f"{sum(errors) / len(errors):.1f}% (max {max(errors):.1f}%)")
    mf = d.get("model_form")
    if mf:
        result += (f"; model-form 90% interval: the gain's sign undecided from "
                   f"{min(mf['undecided']):g} clients up" if mf["undecided"] else "")
    return question, result


def ascend910b4_capacity(d: dict) -> tuple[str, str]:
    pred, search = d["prediction"], d["search"]
    lo, hi = pred["safe_rate_interval"]
    question = "Safe request rate under the field's SLO, and saturation rate, of one 910B4 replica"
    result = (f"predicted safe rate **{pred['safe_rate']:.2f} req/s** ({lo:.2f}-{hi:.2f} over "
              f"{search['safe_rate_interval_sets']} bootstrap sets), saturation rate "
              f"**{pred['saturation_rate']:.2f} req/s**; the field withheld both")
    mf = d.get("model_form")
    if mf:
        (lo, hi), (mlo, mhi) = mf["safe_rate_interval"], mf["saturation_rate_interval"]
        result += f"; model-form 90% intervals {lo:.2f}-{hi:.2f} and {mlo:.2f}-{mhi:.2f} req/s"
    return question, result


def ascend910b4_multiturn(d: dict) -> tuple[str, str]:
    pub, base = d["published"], d["baseline"]

    def err(key: str) -> str:
        return _pct((base[key] / pub[key] - 1) * 100)

    question = "Input throughput and prefix-cache hits of the field's 910B4 multi-turn run"
    result = (f"input **{base['input_tokens_per_s']:,.0f} tok/s** vs "
              f"{pub['input_tokens_per_s']:,.0f} published ({err('input_tokens_per_s')}); "
              f"prefix-hit share {_frac(base['prefix_hit_share'])} vs "
              f"{_frac(pub['prefix_hit_share'])} ({err('prefix_hit_share')}); actual prefill "
              f"{base['prefill_tokens_per_s']:,.0f} vs {pub['prefill_tokens_per_s']:,.0f} tok/s "
              f"({err('prefill_tokens_per_s')})")
    return question, result


def chunked_prefill_itl(d: dict) -> tuple[str, str]:
    (fitted, pub), = d["published"].items()
    sim = d["budgets"][fitted]
    others = [b for b in d["budgets"] if b != fitted]
    question = "What a smaller batched-token budget does to the 910B4 long-context run's ITL"
    result = (f"budget {int(fitted):,} (fitted): ITL median {_ms(sim['median_s'])} vs "
              f"{_ms(pub['median_s'])} published, ITLs > 1.5 s {_frac(sim['frac_above'])} vs "
              f"{_frac(pub['frac_above'])}; predicted at "
              f"{' / '.join(f'{int(b):,}' for b in others)}: median "
              f"{' / '.join(_ms(d['budgets'][b]['median_s']) for b in others)}, ITLs > 1.5 s "
              f"{' / '.join(_frac(d['budgets'][b]['frac_above']) for b in others)}")
    return question, result


def leave_high_out(d: dict) -> tuple[str, str]:
    a800, b4 = d["a800"], d["910b4"]

    def high_gen(variant: str) -> str:
        (p,) = [p for p in b4[variant]["predictions"] if p["point"] == "high-generation"]
        return _pct(p["error_pct"])

    question = "Linear or roofline step-time form: which predicts held-out field figures better?"
    result = (f"A800, {len(a800['linear']['predictions'])} held-out figures: mean abs. error "
              f"linear **{a800['linear']['mean_abs_error_pct']:.1f}%**, roofline "
              f"{a800['roofline-sum']['mean_abs_error_pct']:.1f}% (sum) / "
              f"{a800['roofline-max']['mean_abs_error_pct']:.1f}% (max); 910B4 high-generation "
              f"throughput: linear **{high_gen('linear')}**, roofline {high_gen('roofline-sum')} / "
              f"{high_gen('roofline-max')}")
    return question, result


def hardware_transfer(d: dict) -> tuple[str, str]:
    oss = d["gpt-oss"]
    s = oss["summary"]

    def part(variant: str) -> str:
        v = s[variant]
        return f"{v['median_max_abs_pct']:.1f}% ({v['pairs_within']} of {v['pairs']} within 15%)"

    question = ("Does a roofline profile fitted on one accelerator predict another, and what must "
                "be measured there?")
    result = (f"gpt-oss-120b on {len(oss['gpus'])} GPUs, each moved to each other, largest held-out "
              f"error per move, median: datasheet alone {part('datasheet')}; one row, experts' "
              f"efficiency refitted {part('experts@high')}; two rows, that and the fixed cost "
              f"**{part('base+experts@low+high')}**")
    llama = d.get("llama-70b")
    if llama:
        moves = llama["summary"]
        result += (f"; Llama-3.3-70B FP8 (dense) H100 <-> H200: datasheet alone "
                   f"{moves['datasheet']['median_max_abs_pct']:.1f}% ({moves['datasheet']['pairs_within']} of "
                   f"{moves['datasheet']['pairs']} within 15%), one row, weights refitted "
                   f"{moves['weights@high']['median_max_abs_pct']:.1f}%")
    return question, result


def workload_shapes(d: dict) -> tuple[str, str]:
    gpus = d["gpus"]

    def span(variant: str, key: str) -> str:
        values = [gpus[g]["roofline"][variant]["max_abs_pct"][key] for g in gpus]
        return f"{min(values):.1f}-{max(values):.1f}%"

    question = ("Which low-load rows should a profile be fitted on: one workload shape, or three "
                "(1k/1k, 1k/8k, 8k/1k)?")
    result = (f"gpt-oss-120b on {len(gpus)} GPUs, roofline form, largest error above 16 clients per GPU: "
              f"1k/1k rows from one shape {span('one shape, low load', '1k1k high')}, from three shapes "
              f"**{span('three shapes, low load', '1k1k high')}** (every shape "
              f"{span('three shapes, low load', 'all')}): the 8k prompts pin the compute efficiency")
    return question, result


def cpu_extrapolation(d: dict) -> tuple[str, str]:
    results = d["results"]

    def held_out(run: str) -> list[str]:
        return sorted((lv for lv in results[run]["measured"] if int(lv) not in CPU_FIT_LEVELS), key=int)

    def mean_abs(run: str, form: str) -> str:
        levels = results[run]["forms"][form]["levels"]
        errors = [abs(levels[lv]["error"]["decode"]) for lv in held_out(run)]
        return f"{sum(errors) / len(errors) * 100:.0f}%"

    def pair(model: str, form: str) -> str:
        return " / ".join(mean_abs(run, form) for run in sorted(results) if run.startswith(model + "/"))

    def runs(model: str) -> str:
        return " / ".join(run.split("/")[1] for run in sorted(results) if run.startswith(model + "/"))

    levels = held_out(sorted(results)[0])
    question = ("Does a step-time model fitted at low concurrency predict a real vLLM CPU "
                "server's decode step at high concurrency?")
    result = (f"fitted at {_span(CPU_FIT_LEVELS)} clients, median decode step at "
              f"{levels[0]}-{levels[-1]}, mean abs. error per run: MoE ({runs('moe')}) roofline (max) "
              f"**{pair('moe', 'roofline max')}**, linear {pair('moe', 'linear')}; dense ({runs('dense')}) "
              f"roofline (max) {pair('dense', 'roofline max')}, linear {pair('dense', 'linear')}")
    return question, result


def live_cpu_validation(d: dict) -> tuple[str, str]:
    cap = d["capacity"]
    safe, sat = cap["headline"]["safe_rate"], cap["headline"]["saturation_rate"]
    xo = d["crossover"]["headline"]
    agree = sum(xo["same_status_per_repeat"])
    statuses = sorted(set(xo["measured_status"]))

    def bracket(h: dict) -> str:
        lo, hi = h["bracket_over_instances"]
        return f"{lo:.2f}-{hi:.2f}: {'inside' if h['in_bracket_over_instances'] else 'outside'}"

    question = ("Do predictions from a light-load calibration fall inside what a real vLLM CPU "
                "server measures?")
    result = (f"calibrated at {_span(cap['calibration']['concurrencies'])} clients: safe rate "
              f"**{safe['predicted']:.2f} req/s** predicted, "
              f"{' / '.join(f'{m:.2f}' for m in safe['measured_per_instance'])} measured on "
              f"{len(safe['measured_per_instance'])} server instances (bracket {bracket(safe)}); "
              f"saturation rate {sat['predicted']:.2f} predicted (bracket {bracket(sat)}); ngram "
              f"crossover: {' / '.join(statuses)} measured, same as predicted in {agree} of "
              f"{len(xo['same_status_per_repeat'])} repeats")
    return question, result


def live_ngram_proposer(d: dict) -> tuple[str, str]:
    (cond,) = [c for c in d["conditions"] if c["prompt_period"]]
    parts = []
    for load in cond["loads"]:
        err = load["median_error_pct"]
        parts.append(f"{_pct(err['per_request']['tpot_p50'])} vs {_pct(err['fixed']['tpot_p50'])} "
                     f"at {load['clients']} clients")
    question = "Does an onset before ngram's first match improve the prediction on a real server?"
    result = (f"prompts repeating every {cond['prompt_period']} tokens, TPOT p50 error (median of "
              f"{d['repeats']} runs), onset vs fixed rate: **{parts[0]}**, "
              + ", ".join(parts[1:]))
    return question, result


def live_engine_speed(d: dict) -> tuple[str, str]:
    import statistics

    by = {p: statistics.median(r["engine_speed"]["ratio"] for r in d["runs"] if r["point"] == p) for p in d["points"]}
    ratios = [r["engine_speed"]["ratio"] for r in d["runs"]]
    question = "Does open-loop load slow the real CPU server's engine, or does the machine?"
    result = (f"one instance, closed and Poisson runs alternating: engine speed against the fitted price "
              + ", ".join(f"{p} **{v:.2f}x**" for p, v in by.items())
              + f" (median); runs range {min(ratios):.2f}-{max(ratios):.2f}x: the machine, not the load")
    return question, result


def live_eagle3_crossover(d: dict) -> tuple[str, str]:
    def where(c: dict) -> str:
        return f"{c['value']:.1f}" if c["status"] == "found" else "none"

    parts = []
    for s in d["summary"].values():
        held = [r for r in s["points"] if r["held_out"]]
        worst = {kind: max(held, key=lambda r: abs(r[kind]["error_points"])) for kind in ("roofline", "linear")}
        one = max(abs(r["one_profile"]["error_points"]) for r in s["points"])
        xs = s["crossovers"]
        parts.append(
            f"acceptance {s['acceptance_length']}: crossover measured {' / '.join(where(c['measured']) for c in xs)}, "
            f"predicted {' / '.join(where(c['roofline']) for c in xs)} clients; held-out gain error up to "
            f"**{worst['roofline']['roofline']['error_points']:+.1f} points** (roofline; linear "
            f"{worst['linear']['linear']['error_points']:+.1f}), one profile for both arms up to {one:.0f}")
    question = "Does EAGLE3 help or hurt at each concurrency on a real vLLM server with a real drafter?"
    result = (f"each arm calibrated at 1-{d['meta']['calibrate_up_to']} clients, {d['meta']['instances']} server "
              "instances: " + "; ".join(parts))
    return question, result


# (folder, results file, row): the order of the table.
STUDIES = [
    ("a800-eagle3-crossover", "results.json", a800_eagle3_crossover),
    ("ascend910b4-capacity", "results.json", ascend910b4_capacity),
    ("ascend910b4-multiturn", "results.json", ascend910b4_multiturn),
    ("chunked-prefill-itl", "results.json", chunked_prefill_itl),
    ("leave-high-out", "results.json", leave_high_out),
    ("hardware-transfer", "results.json", hardware_transfer),
    ("workload-shapes", "results.json", workload_shapes),
    ("cpu-extrapolation", "results-roofline.json", cpu_extrapolation),
    ("live-cpu-validation", "results.json", live_cpu_validation),
    ("live-ngram-proposer", "results.json", live_ngram_proposer),
    ("live-eagle3-crossover", "results.json", live_eagle3_crossover),
    ("live-engine-speed", "results.json", live_engine_speed),
]


def study_folders() -> list[str]:
    """Every study folder of experiments/ (a folder with a README.md)."""
    return sorted(p.parent.name for p in HERE.glob("*/README.md"))


def render() -> str:
    """The markdown table, one line a row, ending in a newline."""
    listed = [folder for folder, _, _ in STUDIES]
    missing = sorted(set(study_folders()) - set(listed))
    if missing:
        raise SystemExit(f"experiments/index.py: no row for {', '.join(missing)}: add it to STUDIES")
    lines = ["| study | question | current result | from |", "|---|---|---|---|"]
    for folder, results, row in STUDIES:
        question, result = row(_load(folder, results))
        lines.append(f"| [{folder}](experiments/{folder}/README.md) | {question} | {result} | "
                     f"[{results}](experiments/{folder}/{results}) |")
    return "\n".join(lines) + "\n"


def readme_block(text: str) -> str:
    """What README.md holds between the markers (without them)."""
    if BEGIN not in text or END not in text:
        raise SystemExit(f"README.md has no {BEGIN} ... {END} block")
    return text.split(BEGIN, 1)[1].split(END, 1)[0].lstrip("\n")


def write(readme: Path = README) -> bool:
    """Replace the README's block with the table; True if it changed."""
    text = readme.read_text()
    readme_block(text)  # the markers are there
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    new = f"{head}{BEGIN}\n{render()}{END}{tail}"
    if new != text:
        readme.write_text(new)
    return new != text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true",
                        help="replace the block between the markers in README.md")
    args = parser.parse_args()
    if args.write:
        print("README.md updated" if write() else "README.md already up to date")
    else:
        print(render(), end="")


if __name__ == "__main__":
    main()
