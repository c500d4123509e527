# Compile-time declarations for Cython (simcap/runtime/build.py), read beside scheduler.py: Scheduler as
# an extension type (attributes read as C struct fields, not looked up by name); ``__dict__``
# keeps any other attribute settable, as on the Python class.
# Every field is a Python object, so the compiled class holds and computes what the source does;
# tests/test_compiled.py checks that these fields are the ones the class sets.
# The methods declared below type the requests they walk as Request (C struct reads).

import cython

from simcap.engine.request cimport Request

cdef class Scheduler:
    cdef public object config
    cdef public object async_scheduling
    cdef public object finished_pending
    cdef public object unapplied
    cdef public object features
    cdef public object max_num_seqs
    cdef public object max_num_batched_tokens
    cdef public object max_model_len
    cdef public object long_prefill_token_threshold
    cdef public object num_lookahead_tokens
    cdef public object num_spec_tokens
    cdef public object block_size
    cdef public object watermark_blocks
    cdef public object kv
    cdef public object waiting
    cdef public object running
    cdef public object num_preemptions
    cdef public object _stats_at_lookup
    cdef public object _stats_at_admission
    cdef public object _may_pad
    cdef public object prefill_schedule_interval
    cdef public object step_counter
    cdef public object prefill_capacity_bound
    cdef public object _defer_prefills
    cdef dict __dict__

    @cython.locals(req=Request)
    cpdef _advance(self, out)
    cpdef _add(self, out, Request req, n, num_spec)
    @cython.locals(req=Request)
    cpdef _schedule_running(self, out, budget, threshold)
    cpdef _preempt(self, Request req, out)
    @cython.locals(req=Request)
    cpdef _schedule_waiting(self, out, budget, threshold)
    @cython.locals(req=Request)
    cpdef update_from_output(self, out, num_accepted=*)
    @cython.locals(req=Request)
    cpdef finish_requests(self, finished)
    @cython.locals(req=Request)
    cpdef apply_pending(self)
    @cython.locals(req=Request)
    cpdef apply_tokens(self)
    @cython.locals(req=Request)
    cpdef hold_tokens(self, reqs, tokens, rejected=*)
    @cython.locals(req=Request)
    cpdef _release(self, finished)
