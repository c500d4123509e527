"""The comparison behind the scheduler conformance test: simcap's side, the vLLM driver's run,
and the first divergent step.

Shared by ``test_scheduler_conformance.py`` (vLLM 0.32, in the live CI step) and
``benchmarks/scheduler_conformance_versions.py`` (another vLLM release, by hand).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from simcap.config.scenario import EngineConfig
from simcap.engine.request import Request
from simcap.engine.scheduler import Scheduler
from tests.live import vllm_scheduler_driver as driver

DRIVER = Path(driver.__file__)


def run_driver(python: Path, model_dir: Path, scenarios: list[dict], tmp: Path, timeout: float = 300) -> dict:
    """Run the driver under ``python`` (a venv with vLLM) over ``scenarios``; its JSON log."""
    src, dst = tmp / "scenarios.json", tmp / "vllm-log.json"
    src.write_text(json.dumps(scenarios))
    proc = subprocess.run([str(python), str(DRIVER), str(src), str(dst), str(model_dir)],
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"vLLM scheduler driver failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(dst.read_text())


def simcap_log(sc: dict, vllm_version: str = "0.32") -> dict:
    """The driver's loop (:func:`driver.run_scenario`) over simcap's Scheduler. A scenario with
    ``async_scheduling`` gets simcap's async scheduler: each step's output is applied as soon
    as it is scheduled (placeholders make the tokens the synchronous ones); a finished request
    holds its slot and blocks through the next schedule; a schedule with nothing to run is no
    step (the driver logs none either) and, while a step is in flight, takes no time (the
    step counter, which times arrivals, stays);
    every decoding request drafts k placeholder tokens each step."""
    asynchronous = bool(sc.get("async_scheduling"))
    engine = EngineConfig(vllm_version=vllm_version, async_scheduling=asynchronous, **sc["engine"])
    spec = sc.get("speculative") or {}
    k = spec.get("k", 0)
    seed = sc["seed"]
    sched = Scheduler(engine, num_lookahead_tokens=driver.num_lookahead_tokens(sc.get("speculative")),
                      num_speculative_tokens=k, async_scheduling=asynchronous)
    pending = sorted(sc["requests"], key=lambda q: (q["arrival_step"], q["id"]))
    log: list[dict] = []
    step = 0
    def busy() -> bool:  # (async: a finished request not yet released is vLLM's unfinished too)
        return sched.has_unfinished_requests() or bool(sched.finished_pending)

    while pending or busy():
        while pending and pending[0]["arrival_step"] <= step:
            q = pending.pop(0)
            segments = tuple((key, n) for key, n in q["segments"])
            prompt = sum(n for _, n in segments)
            sched.add_request(Request(q["id"], float(q["arrival_step"]), prompt, q["max_tokens"], segments))
        if not busy():
            step = pending[0]["arrival_step"]
            continue
        if len(log) >= driver.MAX_STEPS:
            return dict(name=sc["name"], steps=log, stalled=True)
        waiting_before = {id(r) for r in sched.waiting}
        # The outputs vLLM has applied when it schedules (async: not the last step's): the
        # driver draws each step's acceptance from that count.
        visible = {r.request_id: r.num_output_tokens - r.num_unapplied_tokens for r in sched.running}
        in_flight = bool(sched.unapplied or sched.finished_pending)  # (the driver's queue)
        out = sched.schedule()
        if asynchronous and not out.total_num_scheduled_tokens:
            if not in_flight:
                step += 1
            continue
        batch, hits = [], {}
        for req, n, d in zip(out.reqs, out.num_scheduled_tokens, out.num_scheduled_spec_tokens):
            batch.append([req.request_id, n, d])
            if id(req) in waiting_before:
                hits[str(req.request_id)] = req.num_computed_tokens - n
        accepted = out.reject_padding([driver.accepted_for(sc, req.request_id,
                                                           visible.get(req.request_id, req.num_output_tokens), d)
                                       for req, d in zip(out.reqs, out.num_scheduled_spec_tokens)])
        row = dict(step=step, batch=batch, preempted=sorted(r.request_id for r in out.preempted_reqs),
                   hits=hits, running=len(sched.running), waiting=len(sched.waiting),
                   num_prefill_tokens=out.num_prefill_tokens, num_decode_tokens=out.num_decode_tokens,
                   free_scheduled=sched.kv.num_free_blocks)
        log.append(row)
        result = sched.update_from_output(out, accepted)
        row["finished"] = sorted(r.request_id for r in result.finished)
        row["free"] = sched.kv.num_free_blocks
        row["free_order"] = driver.free_order_digest(sched.kv.free_block_ids())
        if k:
            for req in result.reqs:
                if not req.is_finished and (asynchronous or driver.proposes(
                        seed, spec["proposal_rate"], req.request_id, req.num_output_tokens)):
                    req.num_spec_tokens = k
        step += 1
    return dict(name=sc["name"], steps=log, stalled=False)


def first_divergence(sc: dict, ours: dict, theirs: dict, fields: tuple[str, ...] | None = None) -> str | None:
    """None when both logs agree (on ``fields`` of each row, default all); else the first
    divergent step with both sides' rows."""
    a, b = ours["steps"], theirs["steps"]
    for i, (x, y) in enumerate(zip(a, b)):
        if fields is not None:
            x, y = {f: x[f] for f in fields}, {f: y[f] for f in fields}
        if x != y:
            keys = [key for key in y if x.get(key) != y.get(key)]
            before = f"\n  step before (vLLM): {json.dumps(b[i - 1])}" if i else ""
            return (f"{sc['name']}: step {i} differs in {keys}{before}\n  simcap: {json.dumps(x)}\n"
                    f"  vLLM:   {json.dumps(y)}\n  engine: {json.dumps(sc['engine'])} "
                    f"speculative: {json.dumps(sc.get('speculative'))}")
    if len(a) != len(b) or ours["stalled"] != theirs["stalled"]:
        return (f"{sc['name']}: simcap ran {len(a)} steps (stalled: {ours['stalled']}), "
                f"vLLM {len(b)} (stalled: {theirs['stalled']})")
    return None


def tally(logs: list[dict]) -> dict:
    """What the logs exercised: steps, drafts, padded drafts' requests, preemptions, hits."""
    counts = dict(steps=0, drafts=0, preemptions=0, hits=0)
    for log in logs:
        for row in log["steps"]:
            counts["steps"] += 1
            counts["drafts"] += sum(d for _, _, d in row["batch"])
            counts["preemptions"] += len(row["preempted"])
            counts["hits"] += sum(1 for h in row["hits"].values() if h > 0)
    return counts
