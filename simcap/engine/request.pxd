# Compile-time declarations for Cython (simcap/runtime/build.py), read beside request.py: Request as an
# extension type (attributes read as C struct fields, not looked up by name).
# Every field is a Python object, so the compiled class holds and computes what the source does;
# tests/test_compiled.py checks that these fields are the ones the class sets.

cdef class Request:
    cdef public object num_external_tokens
    cdef public object request_id
    cdef public object arrival_time
    cdef public object num_prompt_tokens
    cdef public object max_tokens
    cdef public object segments
    cdef public object output_key
    cdef public object status
    cdef public object num_computed_tokens
    cdef public object num_output_tokens
    cdef public object num_spec_tokens
    cdef public object match_probability
    cdef public object is_prefill_chunk
    cdef public object num_accepted_uncommitted
    cdef public object num_unapplied_tokens
    cdef public object num_rejected_pending
    cdef public object num_preemptions
    cdef public object num_cached_tokens
    cdef public object num_public_tokens
    cdef public object block_hashes
    cdef public object _hash_cursor
    cdef public object scheduled_ts
    cdef public object first_token_ts
    cdef public object last_token_ts
