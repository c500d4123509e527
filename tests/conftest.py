"""Test factories with small defaults, and the engine invariants checked after every step."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from simcap.config.scenario import EngineConfig, parse_scenario
from simcap.engine.request import Request
from simcap.engine.scheduler import Scheduler, SchedulerOutput


# CI replays the same examples on every run (a property that fails there fails for everyone,
# with the example in the log); runs elsewhere keep exploring new ones.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


def run_interpreted(statement: str, setup: str = "") -> Any:
    """Run ``setup`` then ``statement`` (which prints one Python literal) in a fresh process
    whose engine modules run as source (``SIMCAP_INTERPRETED=1``), and return the literal. For
    spies that replace a method: the compiled engine's extension types do not allow that."""
    env = {**os.environ, "SIMCAP_INTERPRETED": "1"}
    done = subprocess.run([sys.executable, "-c", f"{setup}\n{statement}"], env=env,
                          cwd=Path(__file__).resolve().parents[1], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return ast.literal_eval(done.stdout.strip().splitlines()[-1])


def make_engine(**overrides: Any) -> EngineConfig:
    values: dict[str, Any] = dict(
        max_num_seqs=8,
        max_num_batched_tokens=256,
        block_size=16,
        num_gpu_blocks=1000,
        max_model_len=4096,
    )
    values.update(overrides)
    return EngineConfig(**values)


def make_scheduler(**overrides: Any) -> Scheduler:
    return Scheduler(make_engine(**overrides))


def make_request(request_id: int, prompt: int, max_tokens: int, segments=None) -> Request:
    return Request(request_id, 0.0, prompt, max_tokens, segments)


def make_scenario(**sections: Any):
    """A valid scenario dict with small defaults; keyword sections are merged in."""
    data: dict[str, Any] = {
        "engine": dict(max_num_seqs=8, max_num_batched_tokens=256, block_size=16,
                       num_gpu_blocks=1000, max_model_len=4096),
        "step_time": dict(base=0.01, per_prefill_token=0.0, per_decode_token=0.0),
        "workload": dict(arrival={"process": "poisson", "rate": 1.0}, num_requests=1,
                         input_len=100, output_len=10),
        "seed": 0,
    }
    for key, value in sections.items():
        roofline = key == "step_time" and isinstance(value, dict) and value.get("form") == "roofline"
        if isinstance(value, dict) and isinstance(data.get(key), dict) and not roofline:
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return parse_scenario(data)


def check_step_invariants(scheduler: Scheduler, out: SchedulerOutput) -> None:
    """Invariants of one scheduled step (written down once, used by every engine test)."""
    cfg = scheduler.config
    assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens, "budget exceeded"
    assert sum(out.num_scheduled_tokens) == out.total_num_scheduled_tokens
    assert len(scheduler.running) <= cfg.max_num_seqs, "max_num_seqs exceeded"
    assert len(set(map(id, out.reqs))) == len(out.reqs), "request scheduled twice"
    scheduler.kv.check_invariants()
    in_use = sum(1 for c in scheduler.kv.ref_counts()[1:] if c > 0)
    assert in_use <= cfg.num_blocks - 1, "more blocks in use than the pool"
    running = set(map(id, scheduler.running))
    assert not running & set(map(id, scheduler.waiting)), "request both running and waiting"
    for req in scheduler.running:
        held = scheduler.kv.num_blocks_held(req)
        assert held * cfg.block_size >= req.num_computed_tokens, "computed tokens without KV slots"
        assert req.num_computed_tokens <= req.num_tokens_with_spec


def run_to_completion(
    scheduler: Scheduler, requests, arrivals=None, max_steps=100_000, acceptance=None, proposer=None
):
    """Drive the pure scheduler step by step; ``arrivals[i]`` is request i's arrival step.

    With ``acceptance`` and ``proposer`` (engine.speculative), drafts are verified and proposed
    as the simulator does. Returns (emitted tokens per request id, first-scheduled order, steps).
    """
    arrivals = arrivals or [0] * len(requests)
    pending = sorted(range(len(requests)), key=lambda i: (arrivals[i], i))
    emitted: dict[int, list[int]] = {r.request_id: [] for r in requests}
    first_scheduled: list[int] = []
    seen: set[int] = set()
    step = 0
    while pending or scheduler.has_unfinished_requests():
        while pending and arrivals[pending[0]] <= step:
            scheduler.add_request(requests[pending.pop(0)])
        if scheduler.has_unfinished_requests():
            releasing = bool(scheduler.finished_pending or scheduler.unapplied)
            out = scheduler.schedule()
            check_step_invariants(scheduler, out)
            # A step may schedule nothing only when a request preempted itself (it resumes next),
            # or (async) when the last step's output, applied after this schedule, frees slots or
            # blocks or rolls back drafts that left no room below max_model_len.
            assert out.total_num_scheduled_tokens > 0 or out.preempted_reqs or releasing, "engine stalled"
            for req in out.reqs:
                if req.request_id not in seen:
                    seen.add(req.request_id)
                    first_scheduled.append(req.request_id)
            accepted = None
            if acceptance is not None and out.num_verify_tokens:
                accepted = acceptance.sample(out.num_scheduled_spec_tokens)
            result = scheduler.update_from_output(out, accepted)
            if proposer is not None:
                proposer.propose(result.reqs)
            for req, n in zip(result.reqs, result.num_new_tokens):
                emitted[req.request_id].append(n)
            scheduler.kv.check_invariants()
        step += 1
        assert step < max_steps, "did not finish"
    scheduler.apply_pending()  # (async) the last step's output, applied by the idle engine
    return emitted, first_scheduled, step


@pytest.fixture
def scheduler_factory():
    return make_scheduler
