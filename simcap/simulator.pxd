# Compile-time declarations for Cython (simcap/_build.py), read beside simulator.py: _StretchGaps
# as an extension type (attributes read as C struct fields, not looked up by name).
# Every field is a Python object, so the compiled class holds and computes what the source does;
# tests/test_compiled.py checks that these fields are the ones the class sets.

cdef class _StretchGaps:
    cdef public object times
    cdef public object lens
    cdef public object sizes
