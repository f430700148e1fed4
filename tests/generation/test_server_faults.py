"""A misbehaving OpenAI-compatible server (tests/fault_server.py) against the regenerate job: nothing wrong is
trained on, nothing answered is lost, and every failure says what happened and what to do."""

from __future__ import annotations

import errno
import json
import time
from email.utils import formatdate
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fault_server import FaultServer

import eyrie.generation.openai_requests as openai_requests
from eyrie.core.errors import ConfigError
from eyrie.generation.conversations import ERROR, PROMPT_TOO_LONG, load_conversations, make_row, settings_key
from eyrie.generation.openai_engine import OpenAIEngine
from eyrie.generation.openai_requests import ServerUnavailable, retry_after_seconds, retry_budget_s
from eyrie.generation.partial import PartialLog, PartialLogWriteError, log_path, logs_of
from eyrie.generation.regenerate import FailedTurns, regenerate_shard, shard_answered

SETTINGS = {"max_new_tokens": 6, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_turns": 2, "max_prompt_tokens": 200, "seed": 0}


def prompts(n: int, turns: int = 1) -> list[dict]:
    return [{"id": f"p{i}", "dataset": "t", "n_user_turns": turns,
             "messages": [{"role": "user", "content": f"question {i} part {t}"} for t in range(turns)]} for i in range(n)]


def shard(tmp_path: Path, records: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "p.parquet")
    return tmp_path


def engine(server: FaultServer, **kw) -> OpenAIEngine:
    kw = {"max_in_flight": 1, "max_retries": 2, "backoff_s": 0.01, "backoff_max_s": 0.05, "health_timeout_s": 10, "timeout_s": 30, **kw}
    return OpenAIEngine([server.url], **kw)


def run(tmp_path: Path, eng) -> dict:
    return regenerate_shard(prompts_path=str(tmp_path / "p.parquet"), out_path=str(tmp_path / "c.parquet"), partial_dir=str(tmp_path / "partial"),
                            dataset="t", shard="0000", settings=SETTINGS, engine_settings={}, engine=eng, model_fingerprint="fp", template_sha256="tpl")


def log_rows(tmp_path: Path) -> list[dict]:
    logs = logs_of(tmp_path / "partial", settings_key(SETTINGS, "fp"))
    return [json.loads(line) for line in logs[0].read_text().splitlines()] if logs else []


def replies(tmp_path: Path) -> list[str]:
    table = pq.read_table(tmp_path / "c.parquet").to_pylist()
    return [m["content"] for r in table for m in r["messages"] if m["role"] == "assistant"]


# ---------------------------------------------------------------------------- 1: empty and null replies


@pytest.mark.parametrize("fault", ["empty", "null"])
def test_an_empty_reply_is_retried_then_a_failed_turn_never_data_and_asked_again_once_the_server_is_fixed(tmp_path, fault):
    shard(tmp_path, prompts(4))
    with FaultServer(rules={"question 2 ": fault}) as server:
        with pytest.raises(FailedTurns) as failed:
            run(tmp_path, engine(server))
        message = str(failed.value)
        assert "1 turn(s) failed" in message and "p2 turn 0" in message and "empty reply" in message and "no --forcerun" in message
        assert not (tmp_path / "c.parquet").exists()  # nothing failed becomes data: Snakemake will rerun the job
        assert server.sent(fault) == 3  # the first try and max_retries 2
        rows = {(r["id"], r["finish_reason"]) for r in log_rows(tmp_path)}
        assert rows == {("p0", "stop"), ("p1", "stop"), ("p3", "stop"), ("p2", ERROR)}  # the answered turns are saved

        server.rules.clear()  # the server is fixed; the rerun asks for the failed turn only
        before = server.sent()
        stats = run(tmp_path, engine(server))
        assert server.sent() - before == 1 and stats["resumed_turns"] == 3 and stats["errors"] == 0
    assert all(replies(tmp_path)) and len(replies(tmp_path)) == 4


@pytest.mark.parametrize("fault", ["reasoning", "tool_call"])
def test_a_reply_with_reasoning_or_a_tool_call_but_no_content_is_not_empty(tmp_path, fault):
    shard(tmp_path, prompts(1))
    with FaultServer(faults=[fault]) as server:
        stats = run(tmp_path, engine(server))
        assert server.sent() == 1 and stats["errors"] == 0


def test_a_server_answering_nothing_at_all_stops_the_shard_loudly(tmp_path):
    shard(tmp_path, prompts(6))
    with FaultServer(then="empty") as server:
        with pytest.raises(ServerUnavailable, match="failed 3 requests in a row"):
            run(tmp_path, engine(server, max_consecutive_errors=3, max_retries=0))
    assert not (tmp_path / "c.parquet").exists()


def test_empty_replies_a_log_holds_as_finished_are_asked_again_not_trained_on(tmp_path, monkeypatch):
    shard(tmp_path, prompts(3, turns=2))
    with FaultServer(rules={"question 1 ": "empty"}) as server:
        # An engine that took an empty reply for an answer: both turns of p1 logged as 'stop' with nothing in them.
        with monkeypatch.context() as accepting:
            accepting.setattr(openai_requests, "empty_reply", lambda message: False)
            run(tmp_path, engine(server))
        poisoned = [r for r in log_rows(tmp_path) if r["id"] == "p1"]
        assert [(r["turn"], r["finish_reason"], r["reply"]) for r in poisoned] == [(0, "stop", ""), (1, "stop", "")]
        assert "reasoning_content" not in poisoned[0] and "tool_calls" not in poisoned[0]

        server.rules.clear()
        (tmp_path / "c.parquet").unlink()  # what --forcerun does before the job runs
        before = server.sent()
        stats = run(tmp_path, engine(server))
        asked = [r["messages"][-1]["content"] for r in server.requests[before:]]
    assert asked == ["question 1 part 0", "question 1 part 1"] and stats["resumed_turns"] == 4  # p1 again, from its first turn
    assert len(replies(tmp_path)) == 6 and all(replies(tmp_path))


def test_a_local_resume_log_with_an_empty_reply_opens_an_engine_and_prompt_too_long_rows_do_not(tmp_path):
    """shard_answered agrees with resume: an empty reply is a turn left to answer, a prompt over the context is done."""
    shard(tmp_path, prompts(2))
    partial = tmp_path / "partial"
    p0, p1 = load_conversations(str(tmp_path / "p.parquet"), SETTINGS["max_turns"])

    def answered(rows) -> bool:
        log = PartialLog(log_path(partial, settings_key(SETTINGS, "fp")))
        log.append(rows)
        return shard_answered(str(tmp_path / "p.parquet"), str(partial), SETTINGS, "fp")

    assert answered([make_row(p0, 0, "stop", "an answer", 5, 2, 0.1), make_row(p1, 0, "stop", "", 5, 0, 0.1)]) is False
    assert answered([make_row(p1, 0, PROMPT_TOO_LONG, "", 500, 0, 0.0)]) is True  # the newest row of p1 turn 0
    assert answered([make_row(p1, 0, "tool_calls", "", 5, 3, 0.1, tool_calls=[{"type": "function", "function": {"name": "f", "arguments": {}}}])]) is True
    assert answered([make_row(p1, 0, "stop", "", 5, 3, 0.1, reasoning_content="thought it through")]) is True
    assert answered([make_row(p1, 0, "length", "", 5, 0, 0.1)]) is False


# ---------------------------------------------------------------------------- 1: the served model


def test_a_server_serving_another_model_is_refused_before_any_request(tmp_path):
    target = tmp_path / "tiny-target"
    target.mkdir()
    shard(tmp_path, prompts(2))
    with FaultServer(model="some-other-model") as server:
        with pytest.raises(ConfigError, match="not the target at model.path") as refused:
            run(tmp_path, engine(server, model_dir=target))
        assert "some-other-model" in str(refused.value) and server.sent() == 0


def test_the_served_model_is_recorded_and_names_the_resume_log(tmp_path):
    target = tmp_path / "tiny-target"
    target.mkdir()
    shard(tmp_path, prompts(2))
    with FaultServer(model="org/tiny-target") as server:  # a hub id whose name is the target directory's
        run(tmp_path, engine(server, model_dir=target))
    served = json.loads(pq.read_schema(tmp_path / "c.parquet").metadata[b"eyrie"])["served"]
    assert served["engine"] == "openai" and served["model"] == "org/tiny-target"
    log = logs_of(tmp_path / "partial", settings_key(SETTINGS, "fp"))[0]
    assert log.name.endswith(f"-{served['key']}.jsonl")
    # Another served model (by its path, which is the target's) writes to another log: nothing is reused across them.
    with FaultServer(model="tiny-target", root=str(target)) as server:
        (tmp_path / "c.parquet").unlink()
        stats = run(tmp_path, engine(server, model_dir=target))
        assert stats["resumed_turns"] == 0 and server.sent() == 2


def test_a_named_served_model_that_does_not_match_is_said_in_the_log(tmp_path, capsys):
    target = tmp_path / "tiny-target"
    target.mkdir()
    shard(tmp_path, prompts(1))
    with FaultServer(model="alias") as server:
        run(tmp_path, engine(server, model="alias", model_dir=target))
    assert "engine.openai.model names it" in capsys.readouterr().err


# ---------------------------------------------------------------------------- 3: disk full while saving turns


def test_the_first_failed_write_of_the_resume_log_stops_the_shard_naming_the_file(tmp_path, monkeypatch):
    shard(tmp_path, prompts(30))
    calls = []
    real = PartialLog.append

    def append(self, rows):
        calls.append(len(rows))
        if len(calls) >= 3:
            error = OSError(errno.ENOSPC, "No space left on device")
            raise PartialLogWriteError(f"{self.path}: cannot save finished turns to the resume log (OSError: {error})") from error
        return real(self, rows)

    monkeypatch.setattr(PartialLog, "append", append)
    with FaultServer() as server:
        with pytest.raises(PartialLogWriteError) as stopped:
            run(tmp_path, engine(server, max_in_flight=2))
        sent = server.sent()
    assert "No space left on device" in str(stopped.value) and str(tmp_path / "partial") in str(stopped.value)
    saved = len(log_rows(tmp_path))
    # Requests in flight when the write failed may finish; nothing new is sent after it (2 in flight, group commit).
    assert sent <= saved + 2 * 3 and sent < 30, (sent, saved)
    assert len(calls) == 3 and not (tmp_path / "c.parquet").exists()


def test_a_real_oserror_from_the_log_is_named_too(tmp_path, monkeypatch):
    import os

    shard(tmp_path, prompts(5))

    def fsync(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", fsync)
    with FaultServer() as server:
        with pytest.raises(PartialLogWriteError, match=r"\.jsonl: cannot save 1 finished turn\(s\).*Errno 28"):
            run(tmp_path, engine(server))
        assert server.sent() <= 2


# ---------------------------------------------------------------------------- 4: rejected turns


def test_a_rejected_turn_is_a_failed_turn_asked_again_on_the_next_run(tmp_path):
    shard(tmp_path, prompts(3, turns=2))
    with FaultServer(rules={"question 1 part 1": (400, "content filter said no")}) as server:
        with pytest.raises(FailedTurns, match="p1 turn 1: HTTP 400: .*content filter said no"):
            run(tmp_path, engine(server))
        assert server.sent((400, "content filter said no")) == 1  # not retried: the server said no
        server.rules.clear()
        before = server.sent()
        stats = run(tmp_path, engine(server))
        assert server.sent() - before == 1 and stats["resumed_turns"] == 5
    assert len(replies(tmp_path)) == 6 and all(replies(tmp_path))


# ---------------------------------------------------------------------------- 8: Retry-After


def test_retry_after_in_seconds_and_as_a_date_is_waited_for(tmp_path):
    date = formatdate(time.time() + 4, usegmt=True)  # an HTTP date (whole seconds): 3-4 s from now, 2-3 s after the first wait
    shard(tmp_path, prompts(1))
    with FaultServer(faults=[(429, "slow down", {"Retry-After": "1"}), (503, "busy", {"Retry-After": date})]) as server:
        # Backoff alone would wait 0.01-0.04 s; the budget (the schedule's longest total wait) is about 15 s.
        eng = engine(server, max_retries=12, backoff_s=0.01, backoff_max_s=5)
        assert retry_budget_s(12, 0.01, 5) > 10
        run(tmp_path, eng)
        times = [r["time"] for r in server.requests]
    assert len(times) == 3 and times[1] - times[0] >= 1.0 and times[2] - times[1] >= 1.5


def test_a_retry_after_past_the_retry_budget_gives_up_at_once_and_says_so(tmp_path):
    shard(tmp_path, prompts(1))
    with FaultServer(then=(429, "come back tomorrow", {"Retry-After": "3600"})) as server:
        started = time.monotonic()
        with pytest.raises(ServerUnavailable, match="Retry-After.*past the retry budget"):
            run(tmp_path, engine(server, max_retries=6, backoff_s=0.01, backoff_max_s=0.05))
        assert time.monotonic() - started < 5 and server.sent() == 1


def test_retry_after_parsing_and_the_budget():
    assert retry_after_seconds("5") == 5.0 and retry_after_seconds(" 0 ") == 0.0 and retry_after_seconds(None) is None
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412470.0) == pytest.approx(10.0)
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412490.0) == 0.0  # in the past: now
    assert retry_after_seconds("soon") is None
    assert retry_budget_s(6, 2, 60) == 4 + 6 + 10 + 18 + 34 + 60  # the defaults: each wait at its most, capped
