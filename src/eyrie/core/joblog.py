"""Run a Snakemake job's body with its stderr copied to the rule's log file."""

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


@contextmanager
def job_log(log_path: str | None):
    if not log_path:
        yield
        return
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    original = sys.stderr
    with open(log_path, "w", encoding="utf-8") as log_file:
        sys.stderr = _Tee(original, log_file)
        try:
            yield
        except Exception:
            traceback.print_exc(file=log_file)
            raise
        finally:
            sys.stderr = original
