"""simcap's scheduler, step for step, against vLLM's own V1 ``Scheduler`` (no model, no server).

The vLLM venv runs ``vllm_scheduler_driver.py`` in a subprocess over scenarios generated
from fixed seeds (simcap cannot be imported there: no simpy); simcap's side runs here, on
the same scenarios, with the same fabricated model output (one sampled token per request
whose scheduled tokens reach its length, plus a seeded number of accepted drafts). Every
step must agree on the ordered batch (tokens and drafts per request) and its prefill and
decode counts, the preempted and finished requests, the prefix-cache hit at each admission,
the free KV blocks once scheduled and after the step (with a digest of their eviction order),
and the running and waiting counts. A failure names the first divergent step with both
sides' rows.

- Scheduler: random scenarios without and with drafts (:data:`NUM_PLAIN`, :data:`NUM_SPEC`;
  ngram, and EAGLE3 with its lookahead slots and dropped last hit block).
- Simulator: ``simulate(..., steps=True)`` replays scenarios (fast path on and off) with one
  second per step, so that a step's start is its index; its step log must be vLLM's
  batches under the same arrival steps.
- Async scheduling: vLLM's ``AsyncScheduler`` driven with two batches in flight, as the
  engine core's batch queue runs it (see :func:`test_async_scheduling_matches_vllm` and
  :func:`test_async_scheduling_with_eagle_drafts_matches_vllm`).
"""

from __future__ import annotations

import time

import pytest

from simcap.config.scenario import parse_scenario
from simcap.fleet.run import simulate
from simcap.live.server import tiny_model_dir, vllm_python
from simcap.workloads.requests import RequestSpec
from tests.live import vllm_scheduler_driver as driver
from tests.live.conftest import _ensure_installed
from tests.live.scheduler_conformance import first_divergence, run_driver, simcap_log, tally

pytestmark = pytest.mark.live

NUM_PLAIN = 160  # random scenarios without speculation (seeds 0..)
NUM_SPEC = 80  # with drafts (ngram or EAGLE3): seeded proposals and acceptance (seeds 10000..)
NUM_SIM = 32  # simulator replays, each fast path on and off (seeds 20000.., every 4th with drafts)
NUM_ASYNC = 200  # async scheduling without drafts
NUM_ASYNC_EAGLE = 120  # and with EAGLE3 drafts (the CPU build refuses ngram drafts with it)
NUM_ASYNC_SIM = 24  # simulator replays under async scheduling (every 4th with EAGLE3 drafts)
NUM_CADENCE = 60  # prefill_schedule_interval 2-4 (every 4th with drafts)
# What an async step is compared on: the batch, what it preempted and admitted with which hit.
ASYNC_FIELDS = ("batch", "preempted", "hits")


def scheduler_scenarios() -> list[dict]:
    return ([driver.random_scenario(s) for s in range(NUM_PLAIN)]
            + [driver.random_scenario(10_000 + s, spec=True) for s in range(NUM_SPEC)])


def simulator_scenarios() -> list[dict]:
    scenarios = []
    for s in range(NUM_SIM):
        sc = driver.random_scenario(20_000 + s, spec=s % 4 == 3)
        if sc["speculative"]:  # the simulator's acceptance is its own draw: accept every draft
            sc["speculative"].update(proposal_rate=1.0, accept="all")
        scenarios.append(sc)
    return scenarios


def async_scenarios() -> list[dict]:
    """Without drafts, and with EAGLE3 drafts (the CPU build refuses ngram with async)."""
    scenarios = [driver.random_scenario(40_000 + s) for s in range(NUM_ASYNC)]
    for s in range(NUM_ASYNC_EAGLE):
        sc = driver.random_scenario(30_000 + s, spec=True)
        sc["speculative"].update(method="eagle3", proposal_rate=1.0)
        if s >= 40 and s % 2:  # every draft accepted: requests that end on their drafts
            sc["speculative"].update(accept="all")
        scenarios.append(sc)
    return [dict(sc, async_scheduling=True) for sc in scenarios]


def async_simulator_scenarios() -> list[dict]:
    """Simulator replays under async scheduling: every draft accepted (the simulator's
    acceptance is its own draw), EAGLE3 (the CPU build refuses ngram with async)."""
    scenarios = []
    for s in range(NUM_ASYNC_SIM):
        sc = driver.random_scenario(50_000 + s, spec=s % 4 == 3)
        if sc["speculative"]:
            sc["speculative"].update(method="eagle3", proposal_rate=1.0, accept="all")
        scenarios.append(dict(sc, async_scheduling=True))
    return scenarios


def cadence_scenarios() -> list[dict]:
    """A prefill cadence (``prefill_schedule_interval`` 2, 3 or 4), synchronous."""
    scenarios = []
    for s in range(NUM_CADENCE):
        sc = driver.random_scenario(60_000 + s, spec=s % 4 == 3)
        sc["engine"]["prefill_schedule_interval"] = 2 + s % 3
        if sc["speculative"]:  # (replayed by the simulator too: its acceptance is its own draw)
            sc["speculative"].update(proposal_rate=1.0, accept="all")
        scenarios.append(sc)
    return scenarios


@pytest.fixture(scope="module")
def vllm_runs(tmp_path_factory):
    """One driver run over every scenario set (vLLM's import is most of a short run)."""
    _ensure_installed()
    sets = {"scheduler": scheduler_scenarios(), "simulator": simulator_scenarios(), "async": async_scenarios(),
            "async_simulator": async_simulator_scenarios(), "cadence": cadence_scenarios()}
    everything = [sc for scenarios in sets.values() for sc in scenarios]
    t0 = time.perf_counter()
    data = run_driver(vllm_python(), tiny_model_dir(), everything, tmp_path_factory.mktemp("conformance"))
    wall = time.perf_counter() - t0
    runs, logs = {}, iter(data["logs"])
    for name, scenarios in sets.items():
        runs[name] = [(sc, next(logs)) for sc in scenarios]
    runs["meta"] = dict(vllm_version=data["vllm_version"], import_s=data["import_s"], run_s=data["run_s"],
                        wall_s=wall)
    return runs


def test_scheduler_matches_vllm_step_for_step(vllm_runs):
    pairs, meta = vllm_runs["scheduler"], vllm_runs["meta"]
    assert meta["vllm_version"].startswith("0.32")
    logs = [log for _, log in pairs]
    t0 = time.perf_counter()
    failures = []
    for sc, theirs in pairs:
        assert not theirs["stalled"], f"{sc['name']}: vLLM stalled (a scenario no engine can finish)"
        diff = first_divergence(sc, simcap_log(sc), theirs)
        if diff:
            failures.append(diff)
    plain, spec = tally(logs[:NUM_PLAIN]), tally(logs[NUM_PLAIN:])
    print(f"\nscheduler conformance vs vLLM {meta['vllm_version']}: {len(pairs)} scenarios, "
          f"{plain['steps'] + spec['steps']} steps ({spec['steps']} with drafts in play: {spec['drafts']} drafts "
          f"scheduled); {plain['preemptions'] + spec['preemptions']} preemptions, "
          f"{plain['hits'] + spec['hits']} prefix-cache hits; vLLM driver {meta['wall_s']:.1f} s for every "
          f"scenario of this module (import {meta['import_s']:.1f} s, run {meta['run_s']:.1f} s); "
          f"simcap {time.perf_counter() - t0:.1f} s")
    assert not failures, f"{len(failures)} of {len(pairs)} scenarios diverge; first:\n" + "\n".join(failures[:3])
    # The generator reaches what the comparison is for.
    assert plain["preemptions"] > 100 and plain["hits"] > 100 and spec["drafts"] > 1000


def simulate_replay(sc: dict, fast: bool) -> list[dict]:
    """``simulate(..., steps=True)`` of the scenario at one second per step: its step log."""
    spec = sc.get("speculative")
    data = dict(
        name=sc["name"], seed=sc["seed"],
        engine=dict(sc["engine"], vllm_version="0.32", async_scheduling=bool(sc.get("async_scheduling"))),
        step_time=dict(base=1.0, per_prefill_token=0.0, per_decode_token=0.0, host_overhead=0.0),
        workload=dict(arrival={"process": "poisson", "rate": 1.0}, num_requests=len(sc["requests"]),
                      input_len=1, output_len=1),
    )
    if spec:
        data["speculative"] = dict(method=spec["method"], num_speculative_tokens=spec["k"],
                                   acceptance_rates=[1.0] * spec["k"], proposal_rate=spec["proposal_rate"])
    trace = []
    for q in sc["requests"]:
        segments = tuple((key, n) for key, n in q["segments"])
        trace.append((float(q["arrival_step"]),
                      RequestSpec(q["id"], sum(n for _, n in segments), q["max_tokens"], segments)))
    columns = simulate(parse_scenario(data), trace, fast=fast, steps=True).steps.as_arrays()
    return [dict(zip(columns, values)) for values in zip(*(columns[k].tolist() for k in columns))]


def vllm_step_rows(sc: dict, log: dict) -> list[dict]:
    """vLLM's steps in the simulator's step-log terms (usage as the KV pool computes it)."""
    pool = sc["engine"]["num_gpu_blocks"] - 1
    return [dict(start=float(r["step"]), duration=1.0, num_prefill_tokens=r["num_prefill_tokens"],
                 num_decode_tokens=r["num_decode_tokens"], num_reqs=len(r["batch"]), num_running=r["running"],
                 num_waiting=r["waiting"], kv_cache_usage=1.0 - r["free_scheduled"] / pool,
                 num_preempted=len(r["preempted"]))
            for r in log["steps"]]


def replay_divergences(pairs, keys: tuple[str, ...] | None = None) -> tuple[list[str], int]:
    """Each scenario's simulator replay (fast path on and off) against vLLM's steps, on every
    step-log column (or ``keys``): the first step that differs, per scenario and path."""
    failures, num_steps = [], 0
    for sc, theirs in pairs:
        want = vllm_step_rows(sc, theirs)
        num_steps += len(want)
        for fast in (False, True):
            got = simulate_replay(sc, fast)
            if keys is not None:
                got = [{k: g[k] for k in keys} for g in got]
                want = [{k: w[k] for k in keys} for w in want]
            for i, (g, w) in enumerate(zip(got, want)):
                if g != w:
                    failures.append(f"{sc['name']} (fast={fast}): step {i}\n  simulate: {g}\n  vLLM:     {w}")
                    break
            else:
                if len(got) != len(want):
                    failures.append(f"{sc['name']} (fast={fast}): {len(got)} steps, vLLM {len(want)}")
    return failures, num_steps


def test_simulator_replays_vllm_batches(vllm_runs):
    failures, num_steps = replay_divergences(vllm_runs["simulator"])
    print(f"\nsimulator replay vs vLLM: {NUM_SIM} scenarios x fast path on/off, {num_steps} steps each way")
    assert not failures, f"{len(failures)} replays diverge; first:\n" + "\n".join(failures[:3])


# What an async replay is compared on: the batches and when they ran. (vLLM's running and
# waiting counts and free blocks at a schedule still include the requests the step before
# finished; the simulator's step log counts after their release.)
ASYNC_REPLAY_KEYS = ("start", "num_prefill_tokens", "num_decode_tokens", "num_reqs", "num_preempted")


def test_simulator_replays_vllm_async_batches(vllm_runs):
    """The simulator under async scheduling (reference path and fast paths) runs vLLM's
    AsyncScheduler's batches, EAGLE3 drafts included."""
    pairs = vllm_runs["async_simulator"]
    failures, num_steps = replay_divergences(pairs, ASYNC_REPLAY_KEYS)
    print(f"\nasync simulator replay vs vLLM: {len(pairs)} scenarios x fast path on/off, {num_steps} steps each way")
    assert not failures, f"{len(failures)} replays diverge; first:\n" + "\n".join(failures[:3])


def test_prefill_cadence_matches_vllm(vllm_runs):
    """``prefill_schedule_interval`` N in 2-4: vLLM's scheduler with ``throttle_prefills`` as
    its data-parallel engine core sets it (a schedule not at a multiple of N since the engine
    was idle), against simcap's scheduler step for step and the simulator's replay."""
    pairs = vllm_runs["cadence"]
    failures = [d for sc, theirs in pairs if (d := first_divergence(sc, simcap_log(sc), theirs))]
    replays, num_steps = replay_divergences(pairs)
    # The cadence acts: without it, simcap's scheduler departs from vLLM's cadenced steps.
    acts = sum(1 for sc, theirs in pairs if first_divergence(
        sc, simcap_log(dict(sc, engine=dict(sc["engine"], prefill_schedule_interval=1))), theirs))
    print(f"\nprefill cadence vs vLLM: {len(pairs)} scenarios, {num_steps} steps; "
          f"{len(failures)} diverge in the scheduler, {len(replays)} replays diverge; "
          f"{acts} would diverge without the cadence")
    assert not failures, f"{len(failures)} of {len(pairs)} scenarios diverge; first:\n" + "\n".join(failures[:2])
    assert not replays, f"{len(replays)} replays diverge; first:\n" + "\n".join(replays[:2])
    assert acts >= len(pairs) // 2


def _async_divergences(pairs) -> tuple[list[str], dict]:
    failures = []
    for sc, theirs in pairs:
        assert not theirs["stalled"]
        diff = first_divergence(sc, simcap_log(sc), theirs, fields=ASYNC_FIELDS)
        if diff:
            failures.append(diff)
    return failures, tally([log for _, log in pairs])


def test_async_scheduling_matches_vllm(vllm_runs):
    """vLLM's AsyncScheduler on the CPU build: it runs without a model (a batch queue of two,
    placeholders for the sampled tokens). The CPU platform's config hook sets
    ``async_scheduling`` off; the driver sets it back and builds the class itself. simcap's
    async scheduler must give the same ordered batches, preemptions and admissions (with
    their prefix hits) on every scenario without drafts."""
    pairs = vllm_runs["async"][:NUM_ASYNC]
    failures, counts = _async_divergences(pairs)
    print(f"\nasync scheduling vs vLLM: {len(pairs)} scenarios, {counts['steps']} steps, "
          f"{counts['preemptions']} preemptions, {counts['hits']} prefix-cache hits; {len(failures)} diverge")
    assert not failures, f"{len(failures)} of {len(pairs)} scenarios diverge; first:\n" + "\n".join(failures[:2])
    assert counts["preemptions"] > 100 and counts["hits"] > 100


def test_async_scheduling_with_eagle_drafts_matches_vllm(vllm_runs):
    """The same comparison with EAGLE3 drafts (the CPU build refuses ngram drafts with async):
    every decoding request drafts k placeholder tokens each step; a request its drafts may have
    finished gets one more (wasted) step, and allocations count the last step's rejected drafts."""
    pairs = vllm_runs["async"][NUM_ASYNC:]
    failures, counts = _async_divergences(pairs)
    print(f"\nasync scheduling with EAGLE3 drafts vs vLLM: {len(pairs)} scenarios, {counts['steps']} steps, "
          f"{counts['drafts']} drafts; {len(failures)} diverge")
    assert not failures, f"{len(failures)} of {len(pairs)} scenarios diverge; first:\n" + "\n".join(failures[:2])
