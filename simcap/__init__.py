"""simcap: a discrete-event capacity simulator of the vLLM V1 serving engine.

Reading guide, in the order data flows:

1. :mod:`simcap.scenario` -- the input: engine flags (vLLM's names), step-time model,
   workload, SLO, seed; loaded from YAML with ``--set`` overrides.
2. :mod:`simcap.workload` -- the requests: arrival times, prompt/output lengths, shared prefixes;
   a recorded closed-loop run to replay client by client; :mod:`simcap.sessions` multi-turn
   sessions, each turn's prompt the conversation so far; :mod:`simcap.traces` public trace
   files (Azure, Mooncake, BurstGPT, ShareGPT) as the requests.
3. :mod:`simcap.engine` -- the pure engine model: scheduler, KV cache, step time.
4. :mod:`simcap.simulator` -- the SimPy world around it: one event per engine step on the
   reference path, bulk stretches of steps on the fast path (:mod:`simcap.fast_forward`;
   with speculative decoding :mod:`simcap.fast_verify`);
   :mod:`simcap.steplog` keeps or reduces the per-step rows.
5. :mod:`simcap.records` and :mod:`simcap.metrics` -- per-request records (the same type
   for simulated and live runs) and the one path from records, or requests streamed as they
   finish, to a :class:`Summary`.
6. :mod:`simcap.report` and :mod:`simcap.cli` -- tables, JSON and the ``simcap`` command
   (:mod:`simcap.startup`: hardly any garbage collection while a command starts).

The engine loop's modules (3-5) are compiled with Cython from their unchanged source when
``pip install`` can (:mod:`simcap.compiled` decides, module by module, what runs); the results
are the same either way.

Around that core:

- :mod:`simcap.memory` -- the KV pool from card memory, model shape and flags (and the
  shape's weights and experts, for the roofline step-time form).
- :mod:`simcap.catalog` -- hardware figures and model shapes by name, from the package's data.
- :mod:`simcap.profile` and :mod:`simcap.calibrate` -- fitted profiles, and fitting them from
  step samples, per-step logs or benchmark tables (with bootstrap intervals).
- :mod:`simcap.fleet` and :mod:`simcap.router` -- replicas behind a router on one clock (a
  scenario's ``deployment``), and the routers as pure pieces.
- :mod:`simcap.crossover`, :mod:`simcap.capacity`, :mod:`simcap.sweep`,
  :mod:`simcap.fleet_sizing` -- studies over many runs: speculative-decoding crossover, safe
  request rate, what-if grids, the fewest replicas per router for a target rate.
- :mod:`simcap.plots` -- step timelines, ITL histograms, KV and queue over time, study figures.
- :mod:`simcap.live` -- the same workload against a real server, and sim-vs-live validation.

Usage::

    import simcap
    result = simcap.simulate(simcap.load_scenario("examples/chat.yaml"))
    print(result.summary.ttft_s.p95)
"""

from simcap import compiled
from simcap._lazy import lazy_exports
from simcap._version import __version__
from simcap.errors import ScenarioError, SimcapError, SimulationError

# The rest of the public API is imported on first use (PEP 562), so that ``import simcap``
# and ``simcap --help`` do not pay for numpy, pydantic and SimPy before a command needs them.
_LAZY = {
    "ClosedLoopTrace": "simcap.workload",
    "FleetResult": "simcap.fleet",
    "RequestRecord": "simcap.records",
    "Result": "simcap.simulator",
    "Scenario": "simcap.scenario",
    "Summary": "simcap.metrics",
    "load_scenario": "simcap.scenario",
    "parse_scenario": "simcap.scenario",
    "simulate": "simcap.simulator",
    "summarize": "simcap.metrics",
}

__all__ = [
    "ClosedLoopTrace",
    "FleetResult",
    "RequestRecord",
    "Result",
    "Scenario",
    "ScenarioError",
    "SimcapError",
    "SimulationError",
    "Summary",
    "__version__",
    "load_scenario",
    "parse_scenario",
    "simulate",
    "summarize",
]


# The engine's hot modules load compiled where ``pip install`` built them from unchanged source.
compiled.install()

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
