# Compile-time declarations for Cython (simcap/runtime/build.py), read beside simulator.py: _StretchGaps
# as an extension type (attributes read as C struct fields, not looked up by name).
# Every field is a Python object, so the compiled class holds and computes what the source does;
# tests/test_compiled.py checks that these fields are the ones the class sets.
# No cimport here: one (of simcap.engine.request) made the module import simcap.engine before
# its own numpy import, and that order cost a whole simcap simulate process some 75 ms
# (benchmarks/bench_startup.py --stages, "import simcap.simulation.simulator"); typed helpers live in
# the fast paths' modules, which simulator.py imports after numpy.

cdef class _StretchGaps:
    cdef public object times
    cdef public object lens
    cdef public object sizes
