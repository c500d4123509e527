# Compile-time declarations for Cython (simcap/runtime/build.py), read beside steplog.py: StepLog as an
# extension type (attributes read as C struct fields, not looked up by name); ``__dict__`` keeps
# any other attribute settable, as on the Python class.
# Every field is a Python object, so the compiled class holds and computes what the source does;
# tests/test_compiled.py checks that these fields are the ones the class sets.

cdef class StepLog:
    cdef public object keep
    cdef public object _columns
    cdef public object _num_rows
    cdef public object _starts
    cdef public object _usages
    cdef public object _run_usages
    cdef public object _run_counts
    cdef public object _weighted
    cdef public object _weight
    cdef public object _usage_sum
    cdef public object _max
    cdef public object last
    cdef dict __dict__
