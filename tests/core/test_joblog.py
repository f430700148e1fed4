"""eyrie.core.joblog: a job's printed progress (stdout) and its warnings (stderr) both land in the rule's log, and a failure's traceback too."""

import sys

import pytest

from eyrie.core.joblog import job_log


def test_stdout_and_stderr_reach_the_log_and_the_terminal(tmp_path, capsys):
    log = tmp_path / "logs" / "bench" / "mtbench.log"
    with job_log(str(log)):
        print("bench mtbench: warm-up (compile, capture): 4.4 s", flush=True)
        print("a warning-like line", file=sys.stderr)
    text = log.read_text()
    assert "bench mtbench: warm-up (compile, capture): 4.4 s" in text
    assert "a warning-like line" in text
    captured = capsys.readouterr()
    assert "warm-up" in captured.out and "a warning-like line" in captured.err
    print("after the job")  # the streams are the process's own again
    assert "after the job" not in log.read_text()


def test_a_failure_leaves_its_traceback_in_the_log(tmp_path):
    log = tmp_path / "job.log"
    with pytest.raises(ValueError, match="bad record"):
        with job_log(str(log)):
            print("started")
            raise ValueError("bad record")
    text = log.read_text()
    assert "started" in text and "Traceback" in text and "ValueError: bad record" in text
    assert sys.stdout is not None and not hasattr(sys.stdout, "streams")


def test_code_needing_a_real_stream_gets_the_terminals(tmp_path):
    """faulthandler, subprocesses and libraries ask the stream for its fileno, encoding or buffer."""
    original_encoding = sys.stdout.encoding
    with job_log(str(tmp_path / "job.log")):
        assert sys.stdout.encoding == original_encoding
        assert sys.stderr.buffer is not None


def test_no_log_path_runs_the_body_as_is(capsys):
    with job_log(None):
        print("plain")
    assert capsys.readouterr().out == "plain\n"
