"""Live mode: drive a real vLLM server with a scenario's workload, and validate against it.

- :mod:`simcap.live.client` -- :func:`run_live`: the load generator (asyncio + httpx
  streaming), one :class:`~simcap.metrics.records.RequestRecord` per request, as the simulator makes.
- :mod:`simcap.live.routing` -- :class:`LiveRouter`: the fleet's routers over several servers
  (their own outstanding counts, the servers' scraped gauges).
- :mod:`simcap.live.prompts` -- exact-length token-id prompts from a request's content segments.
- :mod:`simcap.live.session_prompts` -- a live session's prompts: the conversation so far as exact
  token ids, answers as the server sent them.
- :mod:`simcap.live.prom` -- the server's ``/metrics``: snapshots, counter deltas, cross-checks.
- :mod:`simcap.live.validate` -- ``validate.validate``: live repeats vs simulations of the same
  traces (the package's ``validate`` is that module, never the function).
- :mod:`simcap.live.calibration` -- :func:`calibrate_live`: a calibration workload against a live
  server, fitted (from the server's per-step log, else black-box probes) into a profile.
- :mod:`simcap.live.rate_search` -- :func:`live_capacity`: the safe and saturation rates measured
  on a live server by :mod:`simcap.studies.capacity`'s search and rules, the prediction beside them.
- :mod:`simcap.live.plot` -- ECDFs of live vs simulated TTFT and ITL (``validate --plot``).
- :mod:`simcap.live.hostload` -- CPU use of foreign processes, to flag disturbed runs.
- :mod:`simcap.live.server` -- :class:`VllmServer`: start/stop a local vLLM CPU server.
- :mod:`simcap.live.launch` -- launch configs (``--launch SERVER.yaml``): model, engine flags and
  speculative config, turned into a :class:`VllmServer`.
- :mod:`simcap.live.crossover_arms` -- :func:`live_crossover`: both speculative arms measured on
  launched servers, beside the crossover predicted from a low-concurrency calibration.
- :mod:`simcap.cli.live` -- the ``simcap live`` commands.
"""

from simcap.runtime.lazy import lazy_exports

# Imported on first use (PEP 562): ``simcap live --help`` and the ``simcap`` command need
# none of httpx, prometheus_client or the fitting code until a live command runs.
_LAZY = {
    "LiveCalibration": "simcap.live.calibration",
    "LiveCapacity": "simcap.live.rate_search",
    "LiveCrossover": "simcap.live.crossover_arms",
    "LiveError": "simcap.live.client",
    "LiveRouter": "simcap.live.routing",
    "LiveRun": "simcap.live.client",
    "PromptBuilder": "simcap.live.prompts",
    "Validation": "simcap.live.validate",
    "VllmServer": "simcap.live.server",
    "VllmServerError": "simcap.live.server",
    "calibrate_live": "simcap.live.calibration",
    "live_capacity": "simcap.live.rate_search",
    "launch_server": "simcap.live.launch",
    "live_crossover": "simcap.live.crossover_arms",
    "run_live": "simcap.live.client",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
