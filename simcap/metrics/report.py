"""Rendering results for people: rich tables of a run's summary, with its provenance.

rich is imported where a table is drawn, so that ``--json`` output never loads it. Emoji
codes in printed text (``:fire:``) are left as written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

_LATENCIES = (
    ("ttft_s", "TTFT"),
    ("tpot_s", "TPOT"),
    ("itl_s", "ITL (per step)"),
    ("itl_per_token_s", "ITL (per token)"),
    ("e2e_s", "E2E"),
    ("queue_s", "queue"),
)
_PERCENTILES = ("p90", "p95", "p99")


def wide_console(min_width: int = 100) -> Console:
    """A console at least ``min_width`` columns wide (wider when the terminal is). Text prints
    as written, neither emoji codes nor markup read in it: a scenario name or file path such
    as ``a:fire:b`` or ``run[/b]`` prints as given (rich's table of emoji, some 3 ms to
    import, is not loaded); styles come as ``style=`` or :class:`rich.text.Text`."""
    from rich.console import Console

    return Console(width=max(min_width, Console().width), emoji=False, markup=False)


def to_json(data: dict[str, Any]) -> str:
    """The JSON form of a result: stable key order, so equal results are equal bytes."""
    return json.dumps(data, indent=2, allow_nan=False)


GENERATED_BEGIN = "<!-- results:begin (written by run.py) -->"
GENERATED_END = "<!-- results:end -->"


def write_generated_block(readme: Path, markdown: str) -> None:
    """Replace the generated block of a README (between the markers) with ``markdown``.

    Experiments regenerate their numbers this way, so that a README never quotes a figure
    its script did not produce. A README without the markers is left alone.
    """
    if not readme.exists():
        return
    text = readme.read_text()
    if GENERATED_BEGIN in text and GENERATED_END in text:
        head, rest = text.split(GENERATED_BEGIN, 1)
        tail = rest.split(GENERATED_END, 1)[1]
        readme.write_text(f"{head}{GENERATED_BEGIN}\n{markdown}{GENERATED_END}{tail}")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:,.1f}"


def leave_one_out_table(rows: list[dict[str, Any]]) -> Table:
    """Each benchmark row's figures predicted by the fit on the other rows (``simcap calibrate
    --leave-one-out``)."""
    from rich.table import Table

    table = Table(title="leave one row out: each row predicted by the fit on the others",
                  title_justify="left")
    for col in ("row", "figure", "measured", "predicted", "error"):
        table.add_column(col, justify="left" if col in ("row", "figure") else "right")
    for r in rows:
        err = r["rel_error"]
        predicted = r["predicted"]
        table.add_row(r["point"], r["metric"], f"{r['measured']:.4g}",
                      "not fitted" if predicted is None else f"{predicted:.4g}",
                      "-" if err is None else f"{err * 100:+.1f}%")
    return table


def latency_table(result: dict[str, Any], title: str = "latency (ms)") -> Table:
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    table.add_column("metric")
    for col in ("mean", "p50", "p90", "p95", "p99", "max"):
        table.add_column(col, justify="right")
    table.add_column("n", justify="right")
    for key, label in _LATENCIES:
        dist = result.get(key)
        if not dist:
            continue
        adequate = dist.get("samples_adequate", {})
        cells = [_ms(dist.get(c)) for c in ("mean", "p50")]
        for p in _PERCENTILES:
            mark = "" if adequate.get(p, True) or dist.get(p) is None else "*"
            cells.append(_ms(dist.get(p)) + mark)
        cells.append(_ms(dist.get("max")))
        table.add_row(label, *cells, f"{dist.get('count', 0):,}")
    return table


def render_summary(result: dict[str, Any], console: Console) -> None:
    """Print a run's summary: latencies, throughput, SLO, engine counters, provenance."""
    from rich.table import Table

    console.print(latency_table(result))
    if any(
        not d.get("samples_adequate", {}).get(p, True)
        for key, _ in _LATENCIES
        if (d := result.get(key)) and d.get("count")
        for p in _PERCENTILES
    ):
        console.print(
            "* too few samples for this percentile (MLPerf early stopping, 99% confidence, "
            "one sample over the bound)",
            style="dim",
        )
    tp = result["throughput"]
    console.print(
        f"completed {result['completed']:,} requests ({result['failed']:,} failed) in "
        f"{result['duration_s']:,.2f} s: {tp['requests_per_s']:.3f} req/s, "
        f"{tp['output_tokens_per_s']:,.1f} output tok/s, {tp['input_tokens_per_s']:,.1f} input tok/s"
    )
    slo = result.get("slo") or {}
    if slo:
        table = Table(title="SLO", title_justify="left")
        for col in ("target", "target (ms)", "value (ms)", "pass"):
            table.add_column(col, justify="right" if col != "target" else "left")
        for key, row in slo.items():
            verdict = "yes" if row["pass"] else "NO"
            if not row.get("samples_adequate", True):
                verdict += " *"
            table.add_row(key, _ms(row["target"]), _ms(row["value"]), verdict)
        console.print(table)
        good = result.get("goodput") or {}
        if good:
            console.print(
                f"goodput {good['requests_per_s']:.3f} req/s ({good['fraction'] * 100:.1f}% of "
                f"requests meet every per-request SLO); SLO {'met' if result['slo_pass'] else 'MISSED'}"
            )
    kv = result.get("kv_cache_usage") or {}
    line = f"preemptions {result['preemptions']:,}"
    if result.get("input_tokens"):
        hits = result.get("prefix_cache_hit_tokens", 0)
        line += f"; prefix-cache hits {hits:,} tokens ({hits / result['input_tokens'] * 100:.1f}% of input)"
    if kv:
        line += f"; KV cache usage mean {kv['mean'] * 100:.1f}%, max {kv['max'] * 100:.1f}%"
    if "num_steps" in result:
        line += f"; engine steps {result['num_steps']:,}"
    console.print(line)
    if result.get("sessions"):
        render_sessions(result["sessions"], console)
    if result.get("fleet"):
        render_fleet(result["fleet"], console)
    prov = result.get("provenance") or {}
    trace = prov.get("trace")
    if trace:
        line = (f"trace: {trace['format']} {trace['file']} (sha256 {trace['sha256'][:12]}): "
                f"{trace['requests']:,} requests of {trace['rows']:,} rows")
        line += f", sent over {trace['span_s']:.1f} s" if "span_s" in trace else ", sent by workload.arrival"
        skipped = [f"{trace[k]:,} {what}" for k, what in
                   (("bad_rows_skipped", "bad rows"), ("too_long_skipped", "too long for max_model_len"))
                   if trace.get(k)]
        if skipped:
            line += f"; skipped {', '.join(skipped)}"
        console.print(line)
    if prov:
        console.print(
            f"simcap {prov.get('simcap_version')} modelling vLLM {prov.get('vllm_version_modelled')}"
            f" V1; scenario {prov.get('scenario_name') or '(unnamed)'} "
            f"sha256 {str(prov.get('scenario_sha256'))[:12]}, seed {prov.get('seed')}, "
            f"step time from {prov.get('step_time_source')}"
            + (f"; {describe_line(prov['frontend'])}" if prov.get("frontend") else ""),
            style="dim",
        )


def describe_line(terms: dict[str, float] | None) -> str:
    """``front end: arrival 1.90 ms, output 5.24 ms + 0.120 ms per chunk of the step``, from the
    terms a result's provenance (or a profile's ``frontend``) holds; or that there is none."""
    if not terms:
        return "front end: none (times are the engine's)"
    return (f"front end: arrival {terms['arrival_s'] * 1e3:.2f} ms, output {terms['output_s'] * 1e3:.2f} ms "
            f"+ {terms['per_chunk_s'] * 1e3:.3f} ms per chunk of the step")


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def render_sessions(sessions: dict[str, Any], console: Console) -> None:
    """Print a session workload's block: TTFT and prefix hits by turn, session durations."""
    from rich.table import Table

    table = Table(title="sessions: by turn (TTFT in ms)", title_justify="left")
    for col in ("turn (0 = first)", "requests", "mean prompt", "prefix hits", "TTFT mean", "p50", "p90", "p99"):
        table.add_column(col, justify="right")
    for row in sessions["by_turn"]:
        ttft = row["ttft_s"]
        prompt = row["mean_prompt_tokens"]
        table.add_row(
            str(row["turn"]), f"{row['requests']:,}", "-" if prompt is None else f"{prompt:,.0f}",
            _share(row["prefix_hit_share"]), *(_ms(ttft[c]) for c in ("mean", "p50", "p90", "p99")),
        )
    console.print(table)
    dur = sessions["duration_s"]
    line = (
        f"{sessions['sessions']:,} sessions ({sessions['completed_sessions']:,} completed), "
        f"{sessions['turns']:,} turns; prefix hits {_share(sessions['prefix_hit_share'])} of "
        f"prompt tokens; session duration mean {dur['mean'] or 0:,.2f} s, p90 {dur['p90'] or 0:,.2f} s"
    )
    if "truncated_turns" in sessions:
        line += (
            f"; over max_model_len: {sessions['truncated_turns']:,} turns truncated "
            f"({sessions['dropped_turns']:,} turns dropped), {sessions['ended_sessions']:,} "
            "sessions ended"
        )
    console.print(line)


def render_fleet(fleet: dict[str, Any], console: Console) -> None:
    """Print a fleet's router, load imbalance and one row per replica."""
    from rich.table import Table

    table = Table(
        title=f"fleet: {fleet['replicas']} replicas, router {fleet['router']}, scrapes every "
              f"{fleet['scrape_interval_s']:g} s (latencies in ms)",
        title_justify="left",
    )
    for col in ("#", "group", "reqs", "TTFT p50", "TTFT p95", "E2E p95", "out tok/s", "preempt",
                "prefix hit", "KV mean", "KV max"):
        table.add_column(col, justify="left" if col in ("#", "group") else "right")
    for row in fleet["per_replica"]:
        table.add_row(
            str(row["replica"]), row["group"] or "-", f"{row['requests']:,}",
            _ms(row["ttft_p50_s"]), _ms(row["ttft_p95_s"]), _ms(row["e2e_p95_s"]),
            f"{row['output_tokens_per_s']:,.1f}", f"{row['preemptions']:,}",
            _share(row["prefix_cache_hit_rate"]), _share(row["kv_cache_usage_mean"]),
            _share(row["kv_cache_usage_max"]),
        )
    console.print(table)
    imb = fleet["load_imbalance"]

    def ratio(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    line = f"load imbalance (max / mean): requests {ratio(imb['requests'])}, tokens {ratio(imb['tokens'])}"
    if "weights" in fleet:
        line += "; weights " + ", ".join(f"{k} {v:g}" for k, v in fleet["weights"].items())
    console.print(line)
    pd = fleet.get("disaggregated")
    if pd:
        mean = pd["kv_transfer_mean_s"]
        console.print(
            f"disaggregated: {pd['prefill_replicas']} prefill + {pd['decode_replicas']} decode "
            f"replicas; KV {pd['kv_bytes_per_token']:,} bytes a token, transfer mean "
            f"{_ms(mean)} ms a request (in TTFT); prefill load imbalance "
            f"{ratio(pd['prefill_load_imbalance'])}"
        )


def render_live_fleet(fleet: dict[str, Any], console: Console) -> None:
    """Print a live run over several servers: one row per server (requests routed to it, its
    latencies, and its own counters against the client's), and the load imbalance."""
    from rich.table import Table

    table = Table(
        title=f"fleet: {fleet['replicas']} servers, router {fleet['router']} (latencies in ms)",
        title_justify="left",
    )
    for col in ("#", "server", "reqs", "done", "tokens", "TTFT p50", "TTFT p95", "E2E p95",
                "out tok/s", "server gen tokens"):
        table.add_column(col, justify="left" if col in ("#", "server") else "right")
    for row in fleet["per_replica"]:
        check = row["cross_check"]
        rel = check["generation_tokens_rel_diff"]
        out = row["output_tokens_per_s"]
        table.add_row(
            str(row["replica"]), row["base_url"], f"{row['requests']:,}", f"{row['completed']:,}",
            f"{row['tokens']:,}", _ms(row["ttft_p50_s"]), _ms(row["ttft_p95_s"]),
            _ms(row["e2e_p95_s"]), "-" if out is None else f"{out:,.1f}",
            "n/a" if rel is None else f"{rel * 100:+.2f}%",
        )
    console.print(table)
    imb = fleet["load_imbalance"]
    parts = ["-" if imb[k] is None else f"{imb[k]:.3f}" for k in ("requests", "tokens")]
    console.print(f"load imbalance (max / mean): requests {parts[0]}, tokens {parts[1]}")


def render_kv_plan(plan: dict[str, Any], console: Console) -> None:
    """Print a KV pool plan: where each card's memory goes and what the pool holds."""
    from rich.table import Table

    table = Table(title=f"KV pool per card (GB = 1e9 bytes; source: {plan['source']})",
                  title_justify="left")
    table.add_column("item")
    table.add_column("value", justify="right")
    rows = [
        ("usable memory (total x gpu_memory_utilization)", f"{plan['usable_gb']:.2f} GB"),
        ("weights", f"{plan['weights_gb']:.2f} GB"),
        ("graph-capture reserve", f"{plan['cuda_graph_gb']:.2f} GB"),
        ("profiling activations", f"{plan['activation_gb']:.2f} GB"),
        ("KV cache", f"{plan['kv_gb']:.2f} GB"),
        ("KV bytes per token per card", f"{plan['kv_bytes_per_token_per_card']:,}"),
        ("block size (tokens)", f"{plan['block_size']}"),
        ("blocks", f"{plan['num_gpu_blocks']:,}"),
        ("pool tokens (blocks x block size)", f"{plan['pool_tokens']:,}"),
        ("usable tokens (block 0 reserved)", f"{plan['usable_tokens']:,}"),
        (f"max concurrency at max_model_len {plan['max_model_len']:,}",
         f"{plan['max_concurrency_at_max_model_len']:.2f}"),
        ("max_model_len fits", "yes" if plan["max_model_len_fits"] else "NO"),
    ]
    for item, value in rows:
        table.add_row(item, value)
    console.print(table)


def model_form_band_line(band: dict[str, Any]) -> str:
    """A crossover's model-form interval (``simcap.accuracy.model_form.crossover_band``) in
    one line."""
    def cross(c: dict[str, Any]) -> str:
        return f"at {c['value']:.3g}" if c.get("value") else "nowhere in the range"

    points = ", ".join(f"{r['load']:g}: {r['gain_pct']:+.0f}% [{r['low_pct']:+.0f}, {r['high_pct']:+.0f}]"
                       for r in band["points"])
    undecided = ", ".join(f"{x:g}" for x in band["undecided"]) or "none"
    return (f"model-form {band['level']:.0%} interval of the throughput gain: {points}; its pessimistic end "
            f"crosses zero {cross(band['crossover_low'])}, its optimistic end {cross(band['crossover_high'])}; "
            f"sign undecided at {undecided}")


def model_form_capacity_line(band: dict[str, Any] | None) -> str:
    """A capacity search's model-form interval (``simcap.accuracy.model_form.capacity_interval``)
    in one line."""
    if band is None:
        return "model-form interval: none (the search found no safe or no saturation rate)"
    lo, hi = band["safe_rate_interval"]
    mu_lo, mu_hi = band["saturation_rate_interval"]
    limits = ", ".join(f"{k} {v:.3g}-{band['slo_loose'][k]:.3g} s" for k, v in band["slo_strict"].items())
    return (f"model-form {band['level']:.0%} interval: safe rate {'-' if lo is None else f'{lo:.3g}'}-"
            f"{'-' if hi is None else f'{hi:.3g}'} req/s (SLO limits read as {limits}), saturation rate "
            f"{mu_lo:.3g}-{mu_hi:.3g} req/s; {band['load_at_safe_rate']:.1f} requests running at the safe "
            f"rate, {band['fit_load']:.1f} in the profile's fitted rows")


def model_form_summary_line(band: dict[str, Any]) -> str:
    """A simulation's model-form intervals (``simcap.accuracy.model_form.summary_intervals``)
    in one line: latencies in ms, throughput in tok/s."""
    def fmt(metric: str, v: float) -> str:
        return f"{v:,.0f}" if metric == "output_throughput" else f"{v * 1e3:,.1f}"

    parts = ", ".join(f"{m} {fmt(m, e['predicted'])} [{fmt(m, e['low'])}-{fmt(m, e['high'])}]"
                      for m, e in band["metrics"].items())
    return (f"model-form {band['level']:.0%} intervals (latencies ms, throughput tok/s; "
            f"{band['load']:.1f} requests running, {band['distance']:.1f} doublings past the "
            f"{band['fit_load']:.1f} of the profile's fitted rows): {parts}")
