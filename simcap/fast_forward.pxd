# Compile-time declarations for Cython (simcap/_build.py), read beside fast_forward.py: the
# requests these functions walk are typed as Request, and the scheduler and KV pool they drive
# by their classes, so that fields are C struct reads and the pool's cpdef methods C calls.

import cython

from simcap.engine.kv_cache cimport FreeBlockQueue, KVCacheManager
from simcap.engine.request cimport Request
from simcap.engine.scheduler cimport Scheduler


@cython.locals(req=Request, scheduler=Scheduler, kv=KVCacheManager)
cpdef schedule_admission(world)

@cython.locals(req=Request, scheduler=Scheduler, kv=KVCacheManager, free_queue=FreeBlockQueue)
cpdef advance_decode_stretch(world, now, horizon, admitted=*, span=*)
