# Compile-time declarations for Cython (simcap/runtime/build.py), read beside fast_forward.py: the
# requests these functions walk are typed as Request, and the scheduler and KV pool they drive
# by their classes, so that fields are C struct reads and the pool's cpdef methods C calls.
# Counts of requests, steps and blocks (far below 2**63) are C integers; a C integer's true
# division is that of the exact quotient, rounded once, as Python's int / int.

import cython

from simcap.engine.kv_cache cimport FreeBlockQueue, KVCacheManager
from simcap.engine.request cimport Request
from simcap.engine.scheduler cimport Scheduler


@cython.locals(req=Request, scheduler=Scheduler, kv=KVCacheManager)
cpdef schedule_admission(world)

@cython.locals(periods=list, t=cython.double, horizon=cython.double, lo=Py_ssize_t, n=Py_ssize_t,
               j=Py_ssize_t, s=cython.double, p=cython.double, v=cython.double[:])
cpdef decode_starts(periods, t, horizon, lo)

@cython.locals(running=list, needs=list, keys=list, usages=list, counts=list, takers=list,
               m=Py_ssize_t, bs=Py_ssize_t, free=Py_ssize_t, scale=Py_ssize_t,
               num_reqs=Py_ssize_t, b=Py_ssize_t, j=Py_ssize_t, n=Py_ssize_t, i=Py_ssize_t,
               key=Py_ssize_t, q=Py_ssize_t, step=Py_ssize_t, done=Py_ssize_t, base=Py_ssize_t)
cpdef take_decode_blocks(running, needs, m, bs, free, scale)

@cython.locals(e=Py_ssize_t, step=Py_ssize_t, done=Py_ssize_t, free=Py_ssize_t,
               num_reqs=Py_ssize_t, num_steps=Py_ssize_t)
cpdef usage_runs_by_step(events, num_reqs, num_steps, free, scale)

@cython.locals(req=Request, scheduler=Scheduler, kv=KVCacheManager, free_queue=FreeBlockQueue,
               num_reqs=Py_ssize_t, m=Py_ssize_t, runs=Py_ssize_t, j=Py_ssize_t)
cpdef advance_decode_stretch(world, now, horizon, admitted=*, span=*)
