"""Run a Snakemake job's body with its stdout and stderr copied to the rule's log file.

Both: progress lines (a benchmark's phases, the loads at concurrency) are printed to stdout, and a user reads them in
logs/<rule>/... as the job runs, not only in Snakemake's own output (a cluster job's file of its own).
"""

from __future__ import annotations

import sys
import traceback
from contextlib import contextmanager
from pathlib import Path


class _Tee:
    """Writes to the terminal (so progress bars stay visible) and to the job's log."""

    def __init__(self, *streams):
        self.streams = streams

    def write(self, text):
        for stream in self.streams:
            stream.write(text)
            stream.flush()
        return len(text)

    def flush(self):
        for stream in self.streams:
            stream.flush()

    def isatty(self):
        return self.streams[0].isatty()

    def __getattr__(self, name):
        # fileno, encoding, buffer, ...: the terminal's, for code that needs a real stream (faulthandler, subprocesses)
        return getattr(self.streams[0], name)


@contextmanager
def job_log(log_path: str | None):
    if not log_path:
        yield
        return
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    original_out, original_err = sys.stdout, sys.stderr
    with open(log_path, "w", encoding="utf-8") as log_file:
        sys.stdout, sys.stderr = _Tee(original_out, log_file), _Tee(original_err, log_file)
        try:
            yield
        except Exception:
            traceback.print_exc(file=log_file)
            raise
        finally:
            sys.stdout, sys.stderr = original_out, original_err
