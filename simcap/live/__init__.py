"""Live mode: drive a real vLLM server with a scenario's workload, and validate against it.

- :mod:`simcap.live.client` -- :func:`run_live`: the load generator (asyncio + httpx
  streaming), one :class:`~simcap.records.RequestRecord` per request, as the simulator makes.
- :mod:`simcap.live.prompts` -- exact-length token-id prompts from a request's content segments.
- :mod:`simcap.live.prom` -- the server's ``/metrics``: snapshots, counter deltas, cross-checks.
- :mod:`simcap.live.validate` -- :func:`validate`: live repeats vs simulations of the same traces.
- :mod:`simcap.live.hostload` -- CPU use of foreign processes, to flag disturbed runs.
- :mod:`simcap.live.server` -- :class:`VllmServer`: start/stop a local vLLM CPU server.
- :mod:`simcap.live.cli` -- the ``simcap live`` commands.
"""

from simcap.live.client import LiveError, LiveRun, run_live
from simcap.live.prompts import PromptBuilder
from simcap.live.server import VllmServer, VllmServerError
from simcap.live.validate import Validation, validate

__all__ = [
    "LiveError",
    "LiveRun",
    "PromptBuilder",
    "Validation",
    "VllmServer",
    "VllmServerError",
    "run_live",
    "validate",
]
