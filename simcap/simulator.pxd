# Compile-time declarations for Cython (simcap/_build.py), read beside simulator.py: _StretchGaps
# as an extension type (attributes read as C struct fields, not looked up by name).
# Every field is a Python object, so the compiled class holds and computes what the source does;
# tests/test_compiled.py checks that these fields are the ones the class sets.

import cython

from simcap.engine.request cimport Request


cdef class _StretchGaps:
    cdef public object times
    cdef public object lens
    cdef public object sizes


# The requests whose token times a verify stretch writes, typed: their fields are C struct reads.
@cython.locals(req=Request, b=Py_ssize_t, reqs=list, news=list, gaps=list, gap_tokens=list)
cpdef _first_chunks(reqs, news, first, last, gaps, gap_tokens)
