"""The engine model: three pure pieces, no clock.

- :mod:`simcap.engine.scheduler`: vLLM V1's scheduler (``schedule`` / ``update_from_output``);
- :mod:`simcap.engine.kv_cache`: the paged KV pool with prefix caching;
- :mod:`simcap.engine.step_time`: seconds per step from the batch's features (linear or
  roofline form).

:mod:`simcap.simulation.simulator` adds the SimPy clock around them.
"""

from simcap.engine.kv_cache import KVCacheManager
from simcap.engine.request import Request, RequestStatus
from simcap.engine.scheduler import EngineOutput, Scheduler, SchedulerFeatures, SchedulerOutput
from simcap.engine.step_time import (
    RooflineStepTimeModel,
    StepTimeModel,
    make_step_model,
    step_features,
)

__all__ = [
    "EngineOutput",
    "KVCacheManager",
    "Request",
    "RequestStatus",
    "Scheduler",
    "SchedulerFeatures",
    "RooflineStepTimeModel",
    "SchedulerOutput",
    "StepTimeModel",
    "make_step_model",
    "step_features",
]
