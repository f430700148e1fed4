"""eyrie: an incremental pipeline that raises EAGLE-3 speculative-decoding drafters."""

__version__ = "0.1.0"
