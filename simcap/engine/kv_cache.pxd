# Compile-time declarations for Cython (simcap/runtime/build.py), read beside kv_cache.py: the pool's
# three classes as extension types (attributes read as C struct fields, not looked up by name);
# ``__dict__`` keeps any other attribute settable, as on the Python classes. The hot methods are
# cpdef (a C call from typed code) and type the requests and parts they use.
# Every field is a Python object, so the compiled classes hold and compute what the source does;
# tests/test_compiled.py checks that these fields are the ones each class sets.

import cython

from simcap.engine.request cimport Request


cdef class FreeBlockQueue:
    cdef public object _front
    cdef public object _main
    cdef public object _head
    cdef public object _stale
    cdef public object _num_stale
    cdef public object num_free
    cdef public object compact_at
    cdef dict __dict__

    cpdef popleft(self)
    cpdef popleft_many(self, n)
    cpdef extend(self, blocks)
    cpdef extend_head(self, blocks)
    cpdef remove(self, block)


cdef class PrefixCache:
    cdef public object block_hash
    cdef public object _map
    cdef public object _more
    cdef public object num_hashed
    cdef dict __dict__


cdef class KVCacheManager:
    cdef public object num_blocks
    cdef public object block_size
    cdef public object max_model_len
    cdef public object enable_caching
    cdef public object free_unhashed_first
    cdef public object ref_cnt
    cdef public object _num_shared
    cdef public object free_queue
    cdef public object prefix_cache
    cdef public object req_to_blocks
    cdef public object _num_committed
    cdef public object _preempted
    cdef public object prefix_cache_queries
    cdef public object prefix_cache_hits
    cdef dict __dict__

    @cython.locals(request=Request)
    cpdef num_blocks_held(self, request)
    @cython.locals(request=Request)
    cpdef get_computed_blocks(self, request, drop_last_block=*)
    @cython.locals(request=Request, free_queue=FreeBlockQueue)
    cpdef allocate_slots(self, request, num_new_tokens, num_new_computed_tokens=*,
                         new_computed_blocks=*, num_lookahead_tokens=*)
    @cython.locals(request=Request)
    cpdef append_blocks(self, requests)
    @cython.locals(request=Request)
    cpdef cache_blocks(self, request, num_tokens)
    @cython.locals(request=Request)
    cpdef _cache_full_blocks(self, request, num_tokens)
    @cython.locals(request=Request)
    cpdef _register(self, request, start, stop, blocks=*)
    @cython.locals(request=Request)
    cpdef _committable(self, request)
    @cython.locals(request=Request)
    cpdef free(self, request)
