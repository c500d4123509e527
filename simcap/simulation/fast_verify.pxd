# Compile-time declarations for Cython (simcap/runtime/build.py), read beside fast_verify.py:
# VerifyStretch as an extension type (attributes read as C struct fields, not looked up by name).
# Every field is a Python object, so the compiled class holds and computes what the source does;
# tests/test_compiled.py checks that these fields are the ones the class sets.

import cython

from simcap.engine.kv_cache cimport KVCacheManager
from simcap.engine.request cimport Request
from simcap.engine.scheduler cimport Scheduler


cdef class VerifyStretch:
    cdef public object world
    cdef public object reqs
    cdef public object num_reqs
    cdef public object num_waiting
    cdef public object nts
    cdef public object outs
    cdef public object maxes
    cdef public object proposed
    cdef public object matches
    cdef public object max_model_len
    cdef public object k
    cdef public object rate
    cdef public object drafts_all
    cdef public object per_request
    cdef public object onset
    cdef public object tail
    cdef public object acceptance
    cdef public object accept_stream
    cdef public object tb
    cdef public object u0
    cdef public object ui
    cdef public object propose_stream
    cdef public object pb
    cdef public object p0
    cdef public object pi
    cdef public object neg_rates
    cdef public object accepted_hist
    cdef public object num_drafts
    cdef public object num_draft_tokens
    cdef public object threshold
    cdef public object budget
    cdef public object lookahead
    cdef public object bs
    cdef public object held
    cdef public object limits
    cdef public object free
    cdef public object scale
    cdef public object allocs
    cdef public object model
    cdef public object noise
    cdef public object starts
    cdef public object periods
    cdef public object usages
    cdef public object counts
    cdef public object news_all
    cdef public object t
    cdef public object finished
    cdef public object last_tokens
    cdef public object bulk
    cdef public object full
    cdef public object ds
    cdef public object verify
    cdef public object context
    cdef public object prefill
    cdef public object out
    cdef public object verify_out
    cdef public object prompt_ends
    cdef public object first
    cdef public object flushed
    cdef public object asynchronous
    cdef public object rejected
    cdef public object unapplied
    cdef public object positions

    # The stretch's steps call these on a typed stretch: C calls. Their integer counters
    # (requests, steps, indices, tokens, blocks: at most scenario.MAX_TOKENS or the pool's
    # size, far below 2**63) are C integers, and the lists and dicts they index are typed as
    # such (an item read is a C read, not a generic look-up); in run_bulk the requests'
    # running token counts are a typed view of an integer array.
    @cython.locals(req=Request, scheduler=Scheduler, kv=KVCacheManager)
    cpdef _start(self, world, now, first, reqs, nts, num_waiting)
    @cython.locals(nts=list, proposed=list, limits=list, ds=list, grow=list, held=list,
                   num_reqs=Py_ssize_t, max_model_len=Py_ssize_t, b=Py_ssize_t, nt=Py_ssize_t,
                   d=Py_ssize_t, verify=Py_ssize_t, bs=Py_ssize_t, lookahead=Py_ssize_t,
                   need=Py_ssize_t, blocks=Py_ssize_t, need_blocks=Py_ssize_t)
    cpdef schedule(self)
    @cython.locals(num_reqs=Py_ssize_t, k=Py_ssize_t, m=Py_ssize_t, size=Py_ssize_t,
                   ui=Py_ssize_t, fin=Py_ssize_t, cap=Py_ssize_t, b=Py_ssize_t, i=Py_ssize_t,
                   plain=Py_ssize_t, last=Py_ssize_t, kv_stop=Py_ssize_t, stop=Py_ssize_t,
                   priced=Py_ssize_t, late=Py_ssize_t, ran=Py_ssize_t, scheduled=Py_ssize_t,
                   a=Py_ssize_t, news=list, cv=cython.longlong[:], row=Py_ssize_t,
                   grown=Py_ssize_t, nt=Py_ssize_t, room=Py_ssize_t, hi=Py_ssize_t,
                   over=Py_ssize_t, top=Py_ssize_t, h=Py_ssize_t, done=Py_ssize_t,
                   before=Py_ssize_t, blocks=Py_ssize_t, e=Py_ssize_t, reqs=list, allocs=list,
                   nts=list, outs=list, maxes=list, limits=list, held=list, events=list, tb=list,
                   usages=list, counts=list, max_model_len=Py_ssize_t, free=Py_ssize_t,
                   bs=Py_ssize_t, lookahead=Py_ssize_t, tail=Py_ssize_t, full=Py_ssize_t)
    cpdef run_bulk(self, horizon)
    @cython.locals(num_reqs=Py_ssize_t, b=Py_ssize_t, d=Py_ssize_t, a=Py_ssize_t, new=Py_ssize_t,
                   o=Py_ssize_t, nt=Py_ssize_t, base=Py_ssize_t, ui=Py_ssize_t, k=Py_ssize_t,
                   max_model_len=Py_ssize_t, tb=list, ds=list, accepted_hist=list,
                   last_tokens=list, outs=list, nts=list, maxes=list, news_all=list,
                   finished=dict)
    cpdef run_step(self, horizon)
    @cython.locals(req=Request, scheduler=Scheduler, kv=KVCacheManager, finished=dict,
                   gone=list, lists=list, values=list, held=list, held_map=dict, b=Py_ssize_t,
                   bs=Py_ssize_t, lookahead=Py_ssize_t, num_reqs=Py_ssize_t)
    cpdef go_on(self, horizon)
    @cython.locals(req=Request, scheduler=Scheduler, reqs=list, finished=dict, outs=list,
                   last_tokens=list, finishing=list, b=Py_ssize_t)
    cpdef flush(self)
    @cython.locals(req=Request, kv=KVCacheManager)
    cpdef hand_out(self)
    @cython.locals(req=Request, outs=list, nts=list, last_tokens=list, finished=dict,
                   proposed=list, b=Py_ssize_t)
    cpdef apply(self)


@cython.locals(stretch=VerifyStretch)
cpdef advance_verify_stretch(world, now, horizon, first=*, span=*)

@cython.locals(req=Request, scheduler=Scheduler, kv=KVCacheManager, running=list, held_map=dict,
               ds=list, allocs=list, prompt_ends=list, bs=Py_ssize_t, lookahead=Py_ssize_t,
               max_model_len=Py_ssize_t, threshold=Py_ssize_t, total=Py_ssize_t,
               context=Py_ssize_t, computed=Py_ssize_t, out=Py_ssize_t, nt=Py_ssize_t,
               d=Py_ssize_t, n=Py_ssize_t, need=Py_ssize_t, blocks=Py_ssize_t)
cpdef schedule_verify_admission(world)

@cython.locals(accepted_hist=list, news=list, c=cython.longlong[:], x=Py_ssize_t, a=Py_ssize_t)
cpdef count_accepted(accepted_hist, news)

# The requests whose token times a verify stretch writes (World.emit_steps), typed: their
# fields are C struct reads.
@cython.locals(req=Request, b=Py_ssize_t, reqs=list, news=list, gaps=list, gap_tokens=list)
cpdef first_chunks(reqs, news, first, last, gaps, gap_tokens)
