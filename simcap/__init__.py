"""simcap: a discrete-event capacity simulator of the vLLM V1 serving engine.

The package's folders are its data flow; each imports only the folders below it in this list
(``tests/test_layers.py`` holds them to that), so the list reads top-down from the command to
the physics:

- :mod:`simcap.cli` -- the ``simcap`` command, thin over the library (``simcap live`` too).
- :mod:`simcap.accuracy` -- the corpus of recorded runs and tables, fitted on one part and
  predicting the rest: the accuracy table and its ratchet.
- :mod:`simcap.live` -- the same workload against a real server: client, scrapes, validation,
  calibration from its logs, live capacity and crossover.
- :mod:`simcap.studies` -- questions over many runs: safe request rate under an SLO,
  speculative-decoding crossover, what-if sweeps, fleet sizing, and their figures.
- :mod:`simcap.calibrate` -- measurements (step samples, iteration logs, benchmark tables) to
  a fitted profile, with intervals.
- :mod:`simcap.fleet` -- a scenario's deployment: replicas on one clock behind a router;
  :func:`simcap.fleet.run.simulate` (``simcap.simulate``) runs any scenario.
- :mod:`simcap.simulation` -- one engine on a SimPy clock: the reference path, one event per
  step, and the fast paths (:mod:`~simcap.simulation.fast_forward`,
  :mod:`~simcap.simulation.fast_verify`) that advance a stretch of steps at once; the step
  log; the early stop.
- :mod:`simcap.workloads` -- which requests arrive when: arrivals, lengths, shared prefixes,
  replayed closed loops, multi-turn sessions.
- :mod:`simcap.metrics` -- the per-request record (the same type for simulated and live runs)
  and the one path from records to a :class:`Summary`; tables with provenance.
- :mod:`simcap.config` -- the input: the scenario (engine flags under vLLM's names, step time,
  workload, SLO, seed) from YAML with ``--set`` overrides, profiles, public trace files.
- :mod:`simcap.engine` -- the pure engine model, no clock: scheduler, KV cache, step time,
  speculative acceptance, step noise. Each piece declares the plain values it reads.
- :mod:`simcap.catalog` -- hardware figures and model shapes by name, and the KV-memory
  arithmetic from them.
- :mod:`simcap.runtime` -- how the package is built and loaded: the engine loop's modules
  compiled with Cython from their unchanged source where ``pip install`` can
  (:mod:`simcap.runtime.compiled` decides, module by module, what runs; the results are the
  same either way), lazy exports, a command's start-up.

Usage::

    import simcap
    result = simcap.simulate(simcap.load_scenario("examples/chat.yaml"))
    print(result.summary.ttft_s.p95)
"""

from simcap._version import __version__
from simcap.errors import ScenarioError, SimcapError, SimulationError
from simcap.runtime import compiled
from simcap.runtime.lazy import lazy_exports

# The rest of the public API is imported on first use (PEP 562), so that ``import simcap``
# and ``simcap --help`` do not pay for numpy, pydantic and SimPy before a command needs them.
_LAZY = {
    "ClosedLoopTrace": "simcap.workloads.requests",
    "FleetResult": "simcap.fleet.replicas",
    "RequestRecord": "simcap.metrics.records",
    "Result": "simcap.simulation.simulator",
    "Scenario": "simcap.config.scenario",
    "Summary": "simcap.metrics.summary",
    "load_scenario": "simcap.config.scenario",
    "parse_scenario": "simcap.config.scenario",
    "simulate": "simcap.fleet.run",
    "summarize": "simcap.metrics.summary",
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
