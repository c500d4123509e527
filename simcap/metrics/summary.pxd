# Compile-time declarations for Cython (simcap/runtime/build.py), read beside metrics.py:
# MetricsAccumulator as an extension type (attributes read as C struct fields, not looked up by
# name); ``__dict__`` keeps any other attribute settable, as on the Python class.
# Every field is a Python object, so the compiled class holds and computes what the source does;
# tests/test_compiled.py checks that these fields are the ones the class sets.

cdef class MetricsAccumulator:
    cdef public object _times
    cdef public object _ints
    cdef public object _failed
    cdef public object _preemptions
    cdef public object _cached
    cdef public object _itl
    cdef public object _itl_token
    cdef public object _session_ints
    cdef dict __dict__
