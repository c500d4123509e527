"""simcap's version, stamped into every result."""

__version__ = "0.1.0"
