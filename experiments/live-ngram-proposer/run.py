"""ngram proposals on the real vLLM CPU server: fitted at 1-2 clients, predicted at more.

For each prompt period (repeating prompts, and random token ids), one ngram server (k=3,
prompt_lookup_max 4, per-step log) is started; ``simcap live calibrate`` fits the step time,
the acceptance, the proposal rate and the spread of match probabilities over requests at 1-2
clients; then closed loops of more clients run ``--repeats`` times and each run is simulated
twice on its own replay (its clients, their gaps, its prompt and output lengths): with every
request matching at the fitted rate (``proposal_rate`` alone) and with the requests' own match
probabilities (``proposal_concentration`` too). Nothing measured at the higher loads is fed
to either prediction.

Run under ``flock /tmp/simcap-cpu.lock`` (it starts vLLM servers); about 4 minutes of server time on two cores.
``python experiments/live-ngram-proposer/run.py [--repeats 3] [--loads 4,8]`` writes
``results.json`` beside itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))

from simcap.config.scenario import parse_scenario  # noqa: E402
from simcap.fleet.run import simulate  # noqa: E402
from simcap.live.calibration import calibrate_live  # noqa: E402
from simcap.live.server import VllmServer  # noqa: E402
from simcap.live.validate import closed_trace_of, metric_value, validate  # noqa: E402

K = 3
SERVER_ARGS = [
    "--max-num-seqs", "8", "--max-num-batched-tokens", "512", "--block-size", "32",
    "--max-model-len", "2048", "--enable-prefix-caching", "--enable-logging-iteration-details",
    "--speculative-config", f'{{"method":"ngram","num_speculative_tokens":{K},"prompt_lookup_max":4}}',
]  # fmt: skip
METRICS = ("tpot_p50", "tpot_mean", "itl_p50", "e2e_p50", "output_throughput")


def scenario_for(profile: Path, speculative: dict, clients: int, requests: int, seed: int):
    data = yaml.safe_load((REPO / "examples" / "cpu-tiny-ngram.yaml").read_text())
    data.pop("step_time")
    data["engine"].pop("num_gpu_blocks")
    data["profile"] = str(profile)
    data["speculative"] = dict(speculative)
    data["workload"] = {"arrival": {"process": "closed", "concurrency": clients}, "num_requests": requests,
                        "input_len": {"dist": "uniform", "low": 64, "high": 256}, "output_len": 96}
    data["seed"] = seed
    return parse_scenario(data, base_dir=profile.parent)


def errors(live, sim) -> dict:
    out = {}
    for key in METRICS:
        a, b = metric_value(live, key), metric_value(sim, key)
        out[key] = None if not a or b is None else round(100.0 * (b - a) / a, 2)
    return out


def median_errors(rows: list[dict]) -> dict:
    out = {}
    for k in METRICS:
        values = [r[k] for r in rows if r[k] is not None]
        out[k] = round(statistics.median(values), 1) if values else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--loads", default="4,8")
    ap.add_argument("--periods", default="16,0")
    ap.add_argument("--requests", type=int, default=40)
    args = ap.parse_args()
    loads = [int(x) for x in args.loads.split(",")]
    results: dict = {"k": K, "repeats": args.repeats, "conditions": []}
    work = HERE / "work"
    work.mkdir(exist_ok=True)
    for period in (int(x) for x in args.periods.split(",")):
        prompt_period = period or None
        t0 = time.monotonic()
        with VllmServer(extra_args=SERVER_ARGS, eager=True, startup_timeout=420) as server:
            profile = work / f"profile-p{period}.yaml"
            cal = calibrate_live(server.base_url, "tiny", profile, max_num_seqs=8, max_num_batched_tokens=512,
                                 log_path=server.log_path, speculative_method="ngram", max_concurrency=2,
                                 prompt_period=prompt_period, server_pids=sorted(server.pids()),
                                 bootstrap=0, noise=None, progress=lambda m: print(m, flush=True))
            fitted = dict(cal.speculative)
            # The rate over every decode request-step, every request alike (what calibrate gave before).
            counters = cal.profile["provenance"]["live"]["server_counters"]
            old_rate = counters["spec_decode_num_drafts"] / cal.host_overhead["log_decode_request_steps"]
            fixed = {k: v for k, v in fitted.items()
                     if k not in ("proposal_concentration", "proposal_onset_tokens")}
            fixed["proposal_rate"] = round(min(max(old_rate, 1e-3), 1.0), 4)
            # (explicitly: the scenario's profile carries the fitted keys)
            fixed.update(proposal_concentration=None, proposal_onset_tokens=0)
            fitted.setdefault("proposal_concentration", None)
            fitted.setdefault("proposal_onset_tokens", 0)
            cond = {"prompt_period": period, "fitted": fitted, "fixed": fixed, "calibration_notes": cal.notes,
                    "step_time": cal.profile["step_time"], "loads": []}
            print(f"period {period}: fitted {fitted}", flush=True)
            for c in loads:
                sc_fixed = scenario_for(profile, fixed, c, max(args.requests, 4 * c), 100 + c)
                val = validate(sc_fixed, server.base_url, "tiny", repeats=args.repeats,
                               adopt_spec_acceptance=False, server_pids=sorted(server.pids()),
                               prompt_period=prompt_period)
                runs = []
                for rep in val.repeats:
                    mine = val.simulated_scenario.model_copy(update={"speculative": type(
                        val.simulated_scenario.speculative).model_validate(fitted)})
                    sim = simulate(mine, trace=closed_trace_of(rep.live), records=True).summary
                    delta = rep.live.server_delta()
                    runs.append({
                        "fixed": errors(rep.live_summary, rep.sim_summary), "per_request": errors(rep.live_summary, sim),
                        "live": {k: metric_value(rep.live_summary, k) for k in METRICS},
                        "live_drafts_per_step": (delta.get("spec_decode_num_drafts") or 0)
                        / max(delta.get("count_inter_token_latency_seconds") or 1, 1),
                        "live_acceptance_length": delta.get("spec_decode_mean_acceptance_length"),
                        "sim_fixed_spec": rep.sim_summary.spec_decode, "sim_per_request_spec": sim.spec_decode,
                        "disturbed": rep.disturbed,
                    })
                point = {"clients": c, "runs": runs,
                         "median_error_pct": {"fixed": median_errors([r["fixed"] for r in runs]),
                                              "per_request": median_errors([r["per_request"] for r in runs])}}
                print(f"period {period}, {c} clients: {json.dumps(point['median_error_pct'])}", flush=True)
                cond["loads"].append(point)
        cond["wall_s"] = round(time.monotonic() - t0, 1)
        results["conditions"].append(cond)
        (HERE / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
