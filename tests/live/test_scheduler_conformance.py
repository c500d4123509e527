"""simcap's scheduler, step for step, against vLLM's own V1 ``Scheduler`` (no model, no server).

The vLLM venv runs ``vllm_scheduler_driver.py`` in a subprocess over scenarios generated
from fixed seeds (simcap cannot be imported there: no simpy); simcap's side runs here, on
the same scenarios, with the same fabricated model output (one sampled token per request
whose scheduled tokens reach its length, plus a seeded number of accepted drafts). Every
step must agree on the ordered batch (tokens and drafts per request), the preempted and
finished requests, the prefix-cache hit at each admission, the free KV blocks after the
step (how many, and a digest of their eviction order), and the running and waiting counts. A failure names the first divergent step with
both sides' rows.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from simcap.engine.request import Request
from simcap.engine.scheduler import Scheduler
from simcap.live.server import tiny_model_dir, vllm_python
from simcap.scenario import EngineConfig
from tests.live import vllm_scheduler_driver as driver
from tests.live.conftest import _ensure_installed

pytestmark = pytest.mark.live

DRIVER = Path(driver.__file__)
NUM_PLAIN = 160  # random scenarios without speculation
NUM_SPEC = 80  # with ngram drafts (seeded proposals and acceptance)


def scheduler_scenarios() -> list[dict]:
    return ([driver.random_scenario(s) for s in range(NUM_PLAIN)]
            + [driver.random_scenario(10_000 + s, spec=True) for s in range(NUM_SPEC)])


def run_vllm(scenarios: list[dict], tmp: Path, mode: str = "sync") -> dict:
    _ensure_installed()
    src, dst = tmp / f"scenarios-{mode}.json", tmp / f"vllm-{mode}.json"
    src.write_text(json.dumps(scenarios))
    proc = subprocess.run([str(vllm_python()), str(DRIVER), str(src), str(dst), str(tiny_model_dir()), mode],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"driver failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(dst.read_text())


# ---------------------------------------------------------------------------- simcap side


def simcap_log(sc: dict, vllm_version: str = "0.32") -> dict:
    """The driver's loop over simcap's :class:`Scheduler`."""
    engine = EngineConfig(vllm_version=vllm_version, async_scheduling=False, **sc["engine"])
    spec = sc.get("speculative") or {}
    k = spec.get("k", 0)
    seed = sc["seed"]
    sched = Scheduler(engine, num_speculative_tokens=k)
    pending = sorted(sc["requests"], key=lambda q: (q["arrival_step"], q["id"]))
    log: list[dict] = []
    step = 0
    while pending or sched.has_unfinished_requests():
        while pending and pending[0]["arrival_step"] <= step:
            q = pending.pop(0)
            segments = tuple((key, n) for key, n in q["segments"])
            prompt = sum(n for _, n in segments)
            sched.add_request(Request(q["id"], float(q["arrival_step"]), prompt, q["max_tokens"], segments))
        if not sched.has_unfinished_requests():
            step = pending[0]["arrival_step"]
            continue
        if len(log) >= driver.MAX_STEPS:
            return dict(name=sc["name"], steps=log, stalled=True)
        waiting_before = {id(r) for r in sched.waiting}
        out = sched.schedule()
        batch, hits, accepted = [], {}, []
        for req, n, d in zip(out.reqs, out.num_scheduled_tokens, out.num_scheduled_spec_tokens):
            batch.append([req.request_id, n, d])
            if id(req) in waiting_before:
                hits[str(req.request_id)] = req.num_computed_tokens - n
            padded = req in out.spec_padded_reqs
            accepted.append(0 if padded else driver.num_accepted(seed, req.request_id, req.num_output_tokens, d))
        row = dict(step=step, batch=batch, preempted=sorted(r.request_id for r in out.preempted_reqs),
                   hits=hits, running=len(sched.running), waiting=len(sched.waiting))
        log.append(row)
        result = sched.update_from_output(out, accepted)
        row["finished"] = sorted(r.request_id for r in result.finished)
        row["free"] = sched.kv.num_free_blocks
        row["free_order"] = driver.free_order_digest(sched.kv.free_block_ids())
        if k:
            for req in result.reqs:
                if not req.is_finished and driver.proposes(seed, spec["proposal_rate"], req.request_id,
                                                           req.num_output_tokens):
                    req.num_spec_tokens = k
        step += 1
    return dict(name=sc["name"], steps=log, stalled=False)


def first_divergence(sc: dict, ours: dict, theirs: dict) -> str | None:
    """None when both logs agree; else the first divergent step, both sides' rows."""
    a, b = ours["steps"], theirs["steps"]
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            keys = [key for key in y if x.get(key) != y.get(key)]
            before = f"\n  step before (both): {json.dumps(a[i - 1])}" if i else ""
            return (f"{sc['name']}: step {i} differs in {keys}{before}\n  simcap: {json.dumps(x)}\n"
                    f"  vLLM:   {json.dumps(y)}\n  engine: {json.dumps(sc['engine'])} "
                    f"speculative: {json.dumps(sc.get('speculative'))}")
    if len(a) != len(b) or ours["stalled"] != theirs["stalled"]:
        return (f"{sc['name']}: simcap ran {len(a)} steps (stalled: {ours['stalled']}), "
                f"vLLM {len(b)} (stalled: {theirs['stalled']})")
    return None


@pytest.fixture(scope="module")
def vllm_logs(tmp_path_factory):
    scenarios = scheduler_scenarios()
    return scenarios, run_vllm(scenarios, tmp_path_factory.mktemp("conformance"))


def test_scheduler_matches_vllm_step_for_step(vllm_logs):
    scenarios, data = vllm_logs
    assert data["vllm_version"].startswith("0.32")
    t0 = time.perf_counter()
    failures = []
    num_steps = num_drafts = num_padded = num_preempted = num_hits = 0
    for sc, theirs in zip(scenarios, data["logs"], strict=True):
        ours = simcap_log(sc)
        assert not theirs["stalled"], f"{sc['name']}: vLLM stalled (scenario generator bug)"
        diff = first_divergence(sc, ours, theirs)
        if diff:
            failures.append(diff)
            continue
        for row in theirs["steps"]:
            num_steps += 1
            num_drafts += sum(d for _, _, d in row["batch"])
            num_preempted += len(row["preempted"])
            num_hits += sum(1 for h in row["hits"].values() if h > 0)
    print(f"\nscheduler conformance vs vLLM {data['vllm_version']}: {len(scenarios)} scenarios, "
          f"{num_steps} steps identical; {num_drafts} drafts scheduled, {num_preempted} preemptions, "
          f"{num_hits} prefix-cache hits; vLLM import {data['import_s']:.1f} s, run {data['run_s']:.1f} s, "
          f"simcap {time.perf_counter() - t0:.1f} s")
    assert not failures, f"{len(failures)} of {len(scenarios)} scenarios diverge; first:\n" + "\n".join(failures[:3])
