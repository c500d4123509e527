"""The speculative-decoding crossover measured on real servers, beside simcap's prediction.

:func:`live_crossover` is ``simcap live crossover SCENARIO --concurrency ... --launch
SERVER.yaml``. The two arms need two server configurations, so it starts them itself from the
launch config (:mod:`simcap.live.launch`), one after the other:

1. **The speculative arm**: the server with the config's speculative section. A profile is
   calibrated on it first (:func:`~simcap.live.calibration.calibrate_live`, from its per-step
   log: verify tokens and, for EAGLE, the draft passes priced as their own terms) with at
   most ``calibrate_up_to`` clients -- the lowest concurrencies only, so the higher points
   are a prediction. Then, at each concurrency (the prefix cache reset before each), the
   closed-loop workload :func:`simcap.studies.crossover.arm_scenarios` gives that point
   (``max(num_requests, requests_per_client x c)`` requests). The server's spec-decode
   counters give each point's acceptance.
2. **The baseline arm**: the same server without the speculative config, calibrated the same
   way on its own log (its own profile), then the same workloads.

Each server is stopped (its whole process group) before the next starts. Prompts repeat every
``prompt_period`` tokens (:class:`~simcap.live.prompts.PromptBuilder`), so ngram's prompt
lookup finds matches and its drafts are accepted where the model continues the pattern.

The measured points become a :class:`~simcap.studies.crossover.CrossoverResult` through the same
analysis and rendering as ``simcap crossover``. The prediction is ``simcap crossover`` itself
(:func:`~simcap.studies.crossover.find_crossover`) with each arm priced by its own server's
profile (step time and KV pool; ``simcap crossover --baseline-profile``), and the acceptance
(per-position rates and, for ngram, the proposal rate) the server's counters measured at the
lowest concurrency: the acceptance of this workload's content, measured where the profile was
calibrated. For ngram the calibration's proposal onset and spread over requests (from its
step log) go with it. Beside it, ``one_profile``: both arms priced by the speculative
server's profile alone, the only choice of a user with one server.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from simcap.studies.crossover import (
    REQUESTS_PER_CLIENT, ArmPoint, CrossoverPoint, CrossoverResult, analyse, arm_scenarios,
    check_loads, find_crossover,
)
from simcap.config.scenario import Scenario, parse_scenario
from simcap.errors import ScenarioError
from simcap.live.calibration import calibrate_live
from simcap.live.client import LiveError, LiveRun, run_live
from simcap.live.hostload import DEFAULT_THRESHOLD_CORES, CpuWatch
from simcap.live.launch import ServerConfig, engine_mismatches, launch_server
from simcap.live.validate import _local_port, adopt_run_acceptance, reset_prefix_cache

DEFAULT_PROMPT_PERIOD = 16
ARMS = ("spec", "baseline")


@dataclass
class MeasuredPoint:
    """One arm at one concurrency, as run live."""

    arm: str
    concurrency: int
    run: LiveRun
    cpu: dict[str, Any]
    prefix_cache_reset: str

    def arm_point(self, scenario: Scenario) -> ArmPoint:
        recs = [r for r in self.run.records if r.succeeded]
        e2e = np.array([r.chunk_times[-1] - r.arrival_time for r in recs])
        tokens = np.array([r.num_output_tokens for r in recs])
        acc = self.run.server_delta().get("spec_decode_mean_acceptance_length") if self.arm == "spec" else None
        return ArmPoint.from_summary(self.run.summary(), e2e, tokens, acc, scenario.digest())

    def to_dict(self) -> dict[str, Any]:
        delta = self.run.server_delta()
        return {
            "arm": self.arm,
            "concurrency": self.concurrency,
            "completed": sum(1 for r in self.run.records if r.succeeded),
            "failed": self.run.num_failed,
            "wall_duration_s": round(self.run.wall_duration_s, 3),
            "prefix_cache_reset": self.prefix_cache_reset,
            "disturbed": self.run.disturbed(self.cpu),
            "cpu": self.cpu,
            "client_pauses": self.run.client_pauses,
            "server": {k: v for k, v in delta.items() if k.startswith("spec_decode") or k == "available"},
            "records": self.run.out_path,
        }


@dataclass
class LiveCrossover:
    """Measured and predicted crossovers of one scenario and launch config."""

    measured: CrossoverResult
    predicted: CrossoverResult
    calibration: dict[str, Any]
    servers: list[dict[str, Any]]
    points: list[MeasuredPoint]
    notes: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    one_profile: CrossoverResult | None = None  # both arms priced by the speculative server's profile

    def comparison(self) -> dict[str, Any]:
        """Per concurrency: the measured and predicted throughput gain; and both crossovers."""
        return compare(self.measured, self.predicted, self.one_profile)

    def to_dict(self) -> dict[str, Any]:
        return {
            "measured": self.measured.to_dict(),
            "predicted": self.predicted.to_dict(),
            "one_profile": None if self.one_profile is None else self.one_profile.to_dict(),
            "comparison": self.comparison(),
            "calibration": self.calibration,
            "servers": self.servers,
            "runs": [p.to_dict() for p in self.points],
            "notes": list(self.notes),
            "wall_s": round(self.wall_s, 1),
        }


def compare(measured: CrossoverResult, predicted: CrossoverResult,
            one_profile: CrossoverResult | None = None) -> dict[str, Any]:
    """Per load point: the measured and predicted throughput gain (and ``one_profile``'s), each
    arm's throughput and TPOT; and the crossovers."""
    rows = []
    one = one_profile.points if one_profile is not None else [None] * len(measured.points)
    for m, p, o in zip(measured.points, predicted.points, one):
        gm, gp = m.gain_pct["throughput"], p.gain_pct["throughput"]
        row = {
            "concurrency": int(m.load),
            "throughput_gain_pct": {"measured": gm, "predicted": gp},
            "same_sign": None if gm is None or gp is None else (gm > 0) == (gp > 0),
            "spec_tokens_per_s": {"measured": m.spec.output_tokens_per_s, "predicted": p.spec.output_tokens_per_s},
            "baseline_tokens_per_s": {"measured": m.baseline.output_tokens_per_s,
                                      "predicted": p.baseline.output_tokens_per_s},
            "spec_tpot_mean_s": {"measured": m.spec.tpot_mean_s, "predicted": p.spec.tpot_mean_s},
            "baseline_tpot_mean_s": {"measured": m.baseline.tpot_mean_s, "predicted": p.baseline.tpot_mean_s},
        }
        if o is not None:
            row["throughput_gain_pct"]["one_profile"] = o.gain_pct["throughput"]
        rows.append(row)
    keys = ("status", "value", "between")
    crossover = {"measured": {k: measured.crossover[k] for k in keys},
                 "predicted": {k: predicted.crossover[k] for k in keys}}
    if one_profile is not None:
        crossover["one_profile"] = {k: one_profile.crossover[k] for k in keys}
    return {"points": rows, "crossover": crossover}


def check_launch(config: ServerConfig, scenario: Scenario) -> None:
    """One-line errors: no speculative section on either side, or flags that disagree."""
    if config.speculative is None:
        raise ScenarioError(
            "launch config: speculative: missing; the crossover's second arm needs the server's "
            "--speculative-config (method, num_speculative_tokens, ...)"
        )
    if scenario.speculative is None:
        arm_scenarios(scenario, concurrency=1)  # raises the one-line error
    differ = engine_mismatches(config, scenario)
    if differ:
        raise ScenarioError("launch config contradicts the scenario: " + "; ".join(differ))


def live_crossover(
    scenario: Scenario,
    config: ServerConfig,
    concurrencies: Sequence[int],
    *,
    base_dir: Path | None = None,
    calibrate_up_to: int | None = None,
    calibration_requests: int = 24,
    requests_per_client: int = REQUESTS_PER_CLIENT,
    prompt_period: int | None = DEFAULT_PROMPT_PERIOD,
    out_dir: str | Path | None = None,
    bootstrap: int = 50,
    progress: Callable[[str], None] | None = None,
    request_timeout_s: float | None = 600.0,
    roofline: dict[str, Any] | None = None,
) -> LiveCrossover:
    """Measure both arms at each concurrency on servers started from ``config`` and predict
    them from each arm's profile, calibrated on its own server at ``calibrate_up_to`` clients
    at most (default: the lowest
    concurrency, 2 if that is 1 and 2 is below the highest). ``roofline``: fit both profiles in
    the roofline form (``hardware``, ``model``, ``combine``: as ``live calibrate --form roofline``;
    None: the linear form). ``out_dir``: where the profiles, the calibration runs (recorded for
    replays), the servers' logs and every run's records go (default: a temporary folder,
    removed). Raises one-line
    :class:`ScenarioError` / :class:`LiveError` / :class:`~simcap.live.server.VllmServerError`."""
    import tempfile

    started = time.monotonic()
    say = progress or (lambda _msg: None)
    check_launch(config, scenario)
    loads = check_loads(concurrencies, "--concurrency", integer=True)
    if requests_per_client < 1:
        raise ScenarioError(f"--requests-per-client: must be >= 1 (got {requests_per_client})")
    if prompt_period is not None and prompt_period < 1:
        raise ScenarioError(f"--prompt-period: must be >= 1 tokens (got {prompt_period})")
    if len(loads) < 2:
        raise ScenarioError(
            f"--concurrency: give at least two concurrencies (the profile is calibrated at the lowest "
            f"and predicts the others; got {loads[0]})"
        )
    cap = calibrate_up_to if calibrate_up_to is not None else max(2, loads[0])
    if calibrate_up_to is None and cap >= loads[-1]:
        cap = loads[0]
    if cap < 1:
        raise ScenarioError(f"--calibrate-up-to: must be >= 1 client (got {cap})")
    if cap >= loads[-1]:
        raise ScenarioError(
            f"--calibrate-up-to: {cap} clients reaches the highest concurrency ({loads[-1]}); "
            "nothing would be left to predict"
        )
    arms = [arm_scenarios(scenario, concurrency=c, requests_per_client=requests_per_client) for c in loads]
    tmp = None
    if out_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="simcap-live-crossover-")
        folder = Path(tmp.name)
    else:
        folder = Path(out_dir)
        folder.mkdir(parents=True, exist_ok=True)
    base = base_dir or Path.cwd()
    notes: list[str] = []
    servers: list[dict[str, Any]] = []
    measured: dict[tuple[str, int], MeasuredPoint] = {}
    live_kw: dict[str, Any] = dict(request_timeout_s=request_timeout_s, prompt_period=prompt_period)
    try:
        calibrations: dict[str, dict[str, Any]] = {}
        for arm in ARMS:
            spec = arm == "spec"
            # Without out_dir the server logs into its own temporary folder, kept if it fails.
            log = folder / f"server-{arm}.log" if out_dir is not None else None
            server = launch_server(config, base, speculative=spec, log_path=log)
            say(f"{arm} arm: starting the server")
            with server:
                servers.append({"arm": arm, "startup_s": round(server.startup_seconds or 0.0, 1),
                                "log": str(server.log_path), "command": server.command()[1:]})
                model = config.served_model_name
                say(f"{arm} arm: calibrating with at most {cap} clients")
                profile_path = folder / f"profile-{arm}.yaml"
                cal = calibrate_live(
                    server.base_url, model, profile_path, max_num_seqs=config.engine.max_num_seqs,
                    max_num_batched_tokens=config.engine.max_num_batched_tokens,
                    max_model_len=config.engine.max_model_len, log_path=server.log_path,
                    num_requests=calibration_requests,
                    speculative_method=config.speculative.method if spec else None,
                    request_timeout_s=request_timeout_s, bootstrap=bootstrap, seed=scenario.seed,
                    server_pids=sorted(server.pids()), max_concurrency=cap, prompt_period=prompt_period,
                    noise=None, name=f"{config.served_model_name} ({arm} server) calibrated at <= {cap} clients",
                    roofline=roofline, record=folder / f"calibration-{arm}" if out_dir is not None else None,
                )  # fmt: skip
                calibrations[arm] = {
                    "profile": str(profile_path),
                    "concurrencies": sorted({p["concurrency"] for p in cal.phases}),
                    "requests": sum(p["num_requests"] for p in cal.phases),
                    "source": cal.source,
                    "step_time": cal.profile["step_time"],
                    "num_gpu_blocks": cal.profile["engine"].get("num_gpu_blocks"),
                    "speculative": cal.speculative,
                    "notes": list(cal.notes),
                    "wall_s": round(cal.wall_s, 1),
                }
                pids = sorted(server.pids())
                for c, (spec_sc, base_sc, _) in zip(loads, arms):
                    sc = spec_sc if spec else base_sc
                    say(f"{arm} arm: {c} clients, {sc.workload.num_requests} requests")
                    reset = reset_prefix_cache(server.base_url)
                    watch = CpuWatch(pids, DEFAULT_THRESHOLD_CORES, _local_port(server.base_url)).start()
                    out = folder / f"{arm}-c{c}.jsonl" if out_dir is not None else None
                    run = run_live(sc, server.base_url, model, out_path=out, progress=False, **live_kw)
                    cpu = watch.stop()
                    if not any(r.succeeded for r in run.records):
                        errors = sorted({r.error for r in run.records if r.error})[:3]
                        raise LiveError(f"{arm} arm at {c} clients: no request completed ({errors})")
                    if run.num_failed:
                        notes.append(f"{arm} arm at {c} clients: {run.num_failed} request(s) failed")
                    if cpu.get("disturbed"):
                        notes.append(f"{arm} arm at {c} clients: disturbed (foreign CPU "
                                     f"{cpu['foreign_cores']:.2f} cores)")
                    if run.paused:
                        notes.append(f"{arm} arm at {c} clients: {run.pause_line}")
                    measured[(arm, c)] = MeasuredPoint(arm, c, run, cpu, reset)
            if server.failed:
                notes.append(f"{arm} server did not stop cleanly (log {server.log_path})")
        points = [
            CrossoverPoint(c, n, measured[("spec", c)].arm_point(spec_sc),
                           measured[("baseline", c)].arm_point(base_sc))
            for c, (spec_sc, base_sc, n) in zip(loads, arms)
        ]
        wall = time.monotonic() - started
        result = analyse(scenario, "concurrency", loads, points, None, requests_per_client, wall)
        result.provenance.update({
            "step_time_source": "measured live (vLLM servers started from the launch config, one per arm)",
            "measured": "live: vLLM servers started from the launch config, one per arm",
            "prompt_period": prompt_period,
        })
        calibration = {**calibrations["spec"], "baseline": calibrations["baseline"]}
        predicted_scenario, how = _predicted_scenario(scenario, calibration, measured[("spec", loads[0])], loads[0])
        baseline_scenario, _ = _predicted_scenario(scenario, calibrations["baseline"], None, loads[0])
        calibration["acceptance_fed"] = how
        say("predicting")
        predicted = find_crossover(predicted_scenario, loads, requests_per_client=requests_per_client,
                                   baseline=baseline_scenario)
        one_profile = find_crossover(predicted_scenario, loads, requests_per_client=requests_per_client)
        for prediction in (predicted, one_profile):
            prediction.provenance["calibrated_at_concurrencies"] = calibration["concurrencies"]
        points_out = [measured[(arm, c)] for arm in ARMS for c in loads]
        return LiveCrossover(result, predicted, calibration, servers, points_out, notes,
                             time.monotonic() - started, one_profile)
    finally:
        if tmp is not None:
            tmp.cleanup()


def _predicted_scenario(
    scenario: Scenario, calibration: dict[str, Any], lowest: MeasuredPoint | None, concurrency: int
) -> tuple[Scenario, str]:
    """The scenario with the calibrated step time, the server's KV pool and the acceptance
    measured at the lowest concurrency (see the module doc); ``lowest`` None: the baseline
    arm's scenario (no acceptance to feed)."""
    profile = Path(calibration["profile"])
    data = scenario.model_dump(mode="json")
    data["profile"] = profile.name  # its step time, and the server's KV pool and release
    data.pop("step_time")
    for key in ("num_gpu_blocks", "memory", "vllm_version", "async_scheduling"):
        data["engine"].pop(key, None)
    sc = parse_scenario(data, base_dir=profile.parent)
    if lowest is None:
        return sc, "none (baseline arm)"
    # ngram: the onset and the spread of match probabilities over requests, from the
    # calibration's step log (the rate measured below then counts the steps after the onset).
    fitted = {key: value for key, value in (calibration.get("speculative") or {}).items()
              if key in ("proposal_onset_tokens", "proposal_concentration")}
    ngram = sc.speculative is not None and sc.speculative.method == "ngram"
    if fitted and ngram:
        spec = type(sc.speculative).model_validate({**sc.speculative.model_dump(), **fitted})
        sc = sc.model_copy(update={"speculative": spec})
    notes: list[str] = []
    sc = adopt_run_acceptance(sc, lowest.run, 0, notes)
    how = (f"server counters of the speculative arm at {concurrency} clients: "
           + (notes[0].split("speculative ", 1)[1] if notes else "no drafts counted; the scenario's acceptance kept"))
    if ngram and "proposal_onset_tokens" in fitted:
        how += f" from the onset, {fitted['proposal_onset_tokens']} output tokens (calibration's step log)"
    if ngram and "proposal_concentration" in fitted:
        how += f", proposal concentration {fitted['proposal_concentration']:.3g} over requests (calibration's step log)"
    return sc, how


def comparison_lines(data: dict[str, Any]) -> list[str]:
    """Measured vs predicted, from :meth:`LiveCrossover.to_dict`."""

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{v:+.1f}%"

    def where(c: dict[str, Any]) -> str:
        return f"~{c['value']:.3g} (between {c['between'][0]:g} and {c['between'][1]:g})" if c["status"] == "found" \
            else "none in range"

    comp, cal = data["comparison"], data["calibration"]
    lines = [
        f"each arm calibrated on its own server at concurrencies "
        f"{', '.join(str(c) for c in cal['concurrencies'])} ({cal['requests']} + {cal['baseline']['requests']} "
        f"requests, {cal['source']}); acceptance fed to the prediction: {cal['acceptance_fed']}"
    ]
    for row in comp["points"]:
        g = row["throughput_gain_pct"]
        sign = {True: "same sign", False: "SIGN DIFFERS", None: "-"}[row["same_sign"]]
        one = f"; one profile for both arms {pct(g['one_profile'])}" if "one_profile" in g else ""
        lines.append(f"{row['concurrency']} clients: throughput gain measured {pct(g['measured'])}, "
                     f"predicted {pct(g['predicted'])} ({sign}){one}")
    xo = comp["crossover"]
    lines.append(f"throughput crossover: measured {where(xo['measured'])}, predicted {where(xo['predicted'])}"
                 + (f"; one profile for both arms {where(xo['one_profile'])}" if "one_profile" in xo else ""))
    return lines

