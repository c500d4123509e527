# Compile-time declarations for Cython (simcap/_build.py), read beside kv_cache.py: PrefixCache as
# an extension type (attributes read as C struct fields, not looked up by name); ``__dict__``
# keeps any other attribute settable, as on the Python class.
# Every field is a Python object, so the compiled class holds and computes what the source does;
# tests/test_compiled.py checks that these fields are the ones the class sets.

cdef class PrefixCache:
    cdef public object block_hash
    cdef public object _map
    cdef public object _more
    cdef public object num_hashed
    cdef dict __dict__
