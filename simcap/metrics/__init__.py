"""One path from requests to numbers: the per-request record (the same type for simulated and
live runs), the summary built from records or requests streamed as they finish, and the
tables that show it with its provenance."""
