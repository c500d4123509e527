"""``simcap serve``: a scenario's simulated deployment behind vLLM's own HTTP API.

- :mod:`simcap.serve.engine` -- :class:`ServedEngine`: the engine model (or fleet) stepped on
  the wall clock, taking requests as they arrive, its clock lag, its record and trace files.
- :mod:`simcap.serve.app` -- :class:`ServeApp`: the OpenAI-compatible endpoints, vLLM's error
  bodies, streaming.
- :mod:`simcap.serve.metrics` -- ``/metrics`` with vLLM's names, labels and buckets.
- :mod:`simcap.serve.prompts` -- a request's prompt as tokens and content blocks (the served
  model's tokenizer, or a documented rule).
- :func:`serve` -- all of it, run by uvicorn until interrupted.
"""

from __future__ import annotations

from simcap.runtime.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {"serve": "simcap.serve.run"})
