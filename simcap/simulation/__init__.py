"""One engine on a SimPy clock: the world that drives the engine's pure pieces step by step
(the reference path) or a stretch of steps at a time (the fast paths), the step log, and the
early stop of a run whose SLO has already failed."""
