"""One shard's requests to OpenAI-compatible servers: workers, retries, failed turns, the resume log's writer, time per row.

Many conversations are answered concurrently, each turn by turn (turn t+1 is sent only after
turn t finished, on the model's own reply), with at most `max_in_flight` requests per server and
every request sent to the least busy server. Connection errors, timeouts, 429 and 5xx are
retried with exponential backoff and jitter (tenacity), waiting at least what a Retry-After
header asks (seconds or an HTTP date) as long as the retry budget (the backoff schedule's
longest total wait, `retry_budget_s`) allows; when the retries run out the shard stops with a
clear error and every finished turn stays in the partial log.

A reply is data only when it is one: a reply with no content (empty or null), no reasoning and
no tool call is retried like a 5xx, and when it stays empty it is a failed turn. So is a request
the server rejects (another 4xx): a failed turn is an error row (finish_reason "error", with the
server's message), never trained on; it ends its conversation and is asked again on the next run
(eyrie.generation.regenerate writes no shard while one is left, so Snakemake reruns the job).
The one named permanent refusal is a prompt over the server's context (`PERMANENT_REFUSAL`):
a prompt_too_long row, kept, as the in-process engine's own length check makes.

Rows reach the log through one writer task: rows finished while the previous write was being
fsynced go out together in the next (group commit), so a kill loses only the requests in
flight and the few milliseconds of rows not yet on disk, and fsync never stalls the requests.
The first write that fails (disk full) stops the shard at once, naming the file and the error:
no request is sent after it, since its reply could not be kept.

Time is attributed to rows so that their `seconds` sum to the wall time during which at least
one request was in flight (`BusyClock`): each finished row is booked the busy wall time since the
row before it finished. Tokens over seconds is then the real throughput under any concurrency,
for a whole shard and just as well for the first rows of one (which `eyrie plan` measures from
the partial log mid-run): nothing is booked ahead, so early rows do not look faster than the
server is. A row's `seconds` is therefore not its request's cost; its `latency` is.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
from collections import deque
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any

import httpx2 as httpx
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from eyrie.core.errors import ConfigError, EyrieError
from eyrie.generation.conversations import (
    ERROR,
    PROMPT_TOO_LONG,
    Conversation,
    empty_reply,
    make_row,
    openai_messages,
    reply_fields,
    stable_seed,
)
from eyrie.generation.partial import PartialLogWriteError

RETRY_STATUS = {408, 429}  # and every 5xx
FATAL_STATUS = {401, 403, 404, 405}  # the configuration is wrong, not the prompt: stop, write no row
ERROR_TEXT_CHARS = 1000
# The named permanent refusal: a 4xx saying the prompt is over the context (SGLang, vLLM, OpenAI wordings; 413 by status).
PERMANENT_REFUSAL = re.compile(r"context[ _]length|maximum context|context window|longer than the model|too many tokens|prompt is too long", re.I)


class ServerUnavailable(EyrieError):
    """A request still failed after every retry: the shard stops, its finished turns are kept."""


class _RetryableResponse(Exception):
    def __init__(self, status: int, text: str, retry_after: float | None = None):
        super().__init__(f"HTTP {status}: {text[:300]}" + (f" (Retry-After {retry_after:.0f} s)" if retry_after is not None else ""))
        self.status = status
        self.retry_after = retry_after


class _EmptyReply(Exception):
    """A 200 whose message has no content, no reasoning and no tool call: retried, then a failed turn."""


class _Rejected(Exception):
    """The server refused this request (or kept answering it with nothing); it becomes an error row."""


class _TooLong(_Rejected):
    """The server refused the prompt as longer than its context: a prompt_too_long row, kept."""


def _retryable(error: BaseException) -> bool:
    return isinstance(error, (httpx.TransportError, _RetryableResponse, _EmptyReply))


def retry_after_seconds(value: str | None, now: float | None = None) -> float | None:
    """A Retry-After header's wait: delta-seconds or an HTTP date (RFC 9110); None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None or when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def retry_budget_s(max_retries: int, backoff_s: float, backoff_max_s: float) -> float:
    """The longest the backoff schedule waits over all retries (each wait capped at backoff_max_s, jitter included):
    how long a Retry-After may hold a request in all."""
    return sum(min(backoff_s * 2**i + backoff_s, backoff_max_s) for i in range(max_retries))


@dataclass
class Server:
    """One server's client and how busy it is: each request goes to the least busy one that is not marked down."""

    url: str
    client: httpx.AsyncClient
    capacity: int
    in_flight: int = 0
    sent: int = 0
    down_until: float = 0.0


class BusyClock:
    """Counts wall time during which at least one request is in flight, and books it to finished rows."""

    def __init__(self):
        self.n = 0
        self.last = time.perf_counter()
        self.busy = 0.0
        self.booked = 0.0

    def _advance(self) -> None:
        now = time.perf_counter()
        if self.n:
            self.busy += now - self.last
        self.last = now

    def start(self) -> None:
        self._advance()
        self.n += 1

    def end(self) -> None:
        self._advance()
        self.n -= 1

    def book(self) -> float:
        """Busy seconds since the previous booking: the share of the row that just finished."""
        self._advance()
        seconds, self.booked = self.busy - self.booked, self.busy
        return seconds

    def busy_seconds(self) -> float:
        self._advance()
        return self.busy


class ShardRequests:
    """One shard's requests: workers, the writer task, retries, counters. `engine` is the OpenAIEngine whose settings
    (max_in_flight, retries and backoff, max_consecutive_errors, the local tokenizer) they follow."""

    def __init__(self, engine, servers: list[Server], model: str, settings: dict, log, progress):
        self.engine, self.servers, self.model, self.settings = engine, servers, model, settings
        self.log, self.progress = log, progress
        self.clock = BusyClock()
        self.pending_rows: list[dict] = []
        self.rows_waiting = asyncio.Event()
        self.closing = False
        self.retries = 0
        self.requests = 0
        self.consecutive_errors = 0
        self.rr = 0
        self.write_error: BaseException | None = None  # the resume log's first failed write: nothing more is sent

    async def all(self, conversations: list[Conversation]) -> dict:
        started = time.perf_counter()
        queue = deque(c for c in conversations if not c.ended)
        writer = asyncio.create_task(self._writer())
        workers = [asyncio.create_task(self._worker(queue)) for _ in range(sum(s.capacity for s in self.servers))]
        try:
            running = set(workers)
            while running:  # until every worker is done, the first to fail fails the shard
                done, _ = await asyncio.wait(running | {writer}, return_when=asyncio.FIRST_COMPLETED)
                if writer in done:  # it ends early only when a write failed
                    raise self._write_failure()
                running -= done
                for task in done:
                    if task.exception() is not None:
                        raise task.exception()
        finally:
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            self.closing = True
            self.rows_waiting.set()
            # Every finished row reaches the disk, also when stopping on an error (unless writing is what failed).
            await asyncio.gather(asyncio.shield(writer), return_exceptions=True)
        if self.write_error is not None:
            raise self._write_failure()
        return {
            "engine": "openai",
            "servers": [s.url for s in self.servers],
            "model": self.model,
            "max_in_flight_per_server": self.engine.max_in_flight,
            "requests": self.requests,
            "retries": self.retries,
            "wall_seconds": time.perf_counter() - started,
            "busy_seconds": self.clock.busy_seconds(),
            "requests_per_server": {s.url: s.sent for s in self.servers},
        }

    # ---------------------------------------------------------------- log writer (group commit)

    async def _writer(self) -> None:
        while True:
            await self.rows_waiting.wait()
            self.rows_waiting.clear()
            rows, self.pending_rows = self.pending_rows, []
            if rows:
                try:
                    await asyncio.to_thread(self.log.append, rows)
                except BaseException as err:
                    self.write_error = err
                    raise
            if self.closing and not self.pending_rows:
                return

    def _write_failure(self) -> BaseException:
        """The resume log's failed write as the shard's error: PartialLogWriteError names the file; anything else is
        wrapped so that it does."""
        error = self.write_error
        if isinstance(error, PartialLogWriteError):
            return error
        return PartialLogWriteError(f"{getattr(self.log, 'path', self.log)}: cannot save finished turns to the resume log "
                                    f"({type(error).__name__}: {error}); no more requests were sent. Rerun to go on")

    def _finish(self, conversation: Conversation, row: dict) -> None:
        conversation.answered.append(row)
        self.pending_rows.append(row)
        self.rows_waiting.set()
        self.progress.turn_done(conversation, row)
        self.progress.show(self.clock.busy_seconds(), sum(s.in_flight for s in self.servers))

    # ---------------------------------------------------------------- conversations

    async def _worker(self, queue: deque) -> None:
        while queue and self.write_error is None:
            await self._answer(queue.popleft())

    async def _answer(self, conversation: Conversation) -> None:
        settings = self.settings
        while not conversation.ended and self.write_error is None:
            turn = len(conversation.answered)
            messages = conversation.messages(upto_turn=turn)
            local_tokens = None
            if self.engine.tokenizer is not None:
                local_tokens = len(self.engine.prompt_ids(messages, conversation.tools))
                if local_tokens > settings["max_prompt_tokens"]:
                    self._finish(conversation, make_row(conversation, turn, PROMPT_TOO_LONG, "", local_tokens, 0, 0.0))
                    return
            body: dict[str, Any] = {
                "model": self.model,
                "messages": openai_messages(messages),
                "max_tokens": settings["max_new_tokens"],
                "temperature": settings["temperature"],
                "top_p": settings["top_p"],
                # Per request, so sampled replies do not depend on the order requests were sent in.
                "seed": stable_seed(settings["seed"], conversation.id, turn),
            }
            if settings["top_k"]:
                body["top_k"] = settings["top_k"]
            if conversation.tools:  # the record's tool definitions: the server's template renders them, its tool parser reads the calls
                body["tools"] = conversation.tools
            self.clock.start()
            sent = time.perf_counter()
            try:
                payload, attempts = await self._complete(body, f"{conversation.id} turn {turn}")
            except _TooLong as refused:  # the named permanent refusal: kept, as the local length check's rows are
                self.clock.end()
                self.consecutive_errors = 0
                row = make_row(conversation, turn, PROMPT_TOO_LONG, "", local_tokens or 0, 0, self.clock.book(), latency=time.perf_counter() - sent, error=str(refused))
                self._finish(conversation, row)
                return
            except _Rejected as rejected:
                self.clock.end()
                row = make_row(conversation, turn, ERROR, "", local_tokens or 0, 0, self.clock.book(), latency=time.perf_counter() - sent, error=str(rejected))
                self.consecutive_errors += 1
                self._finish(conversation, row)
                if self.consecutive_errors >= self.engine.max_consecutive_errors:
                    raise ServerUnavailable(
                        f"the server failed {self.consecutive_errors} requests in a row (rejected, or answered with nothing; last: {rejected}); "
                        "this looks like a configuration or server problem, not bad prompts. Finished turns are kept; "
                        "failed turns are asked again on the next run."
                    ) from None
                return
            except BaseException:
                self.clock.end()
                raise
            self.clock.end()
            self.consecutive_errors = 0
            self._finish(conversation, self._row(conversation, turn, payload, self.clock.book(), time.perf_counter() - sent, attempts, local_tokens))

    def _row(self, conversation, turn, payload, seconds, latency, attempts, local_tokens) -> dict:
        try:
            choice = payload["choices"][0]
            reply = choice["message"].get("content") or ""
            finish_reason = choice.get("finish_reason") or "unknown"
            emitted = reply_fields(choice["message"])  # reasoning and tool calls a server's parsers split off the text
        except (KeyError, IndexError, TypeError, AttributeError) as err:
            raise ServerUnavailable(f"{conversation.id} turn {turn}: the server's answer has no choices[0].message ({err!r}): {str(payload)[:300]}") from None
        usage = payload.get("usage") or {}
        prompt_tokens = usage.get("prompt_tokens")
        completion_tokens = usage.get("completion_tokens")
        if prompt_tokens is None:
            prompt_tokens = local_tokens or 0
        if completion_tokens is None:
            completion_tokens = len(self.engine.tokenizer(reply, add_special_tokens=False)["input_ids"]) if self.engine.tokenizer else 0
        return make_row(conversation, turn, finish_reason, reply, int(prompt_tokens), int(completion_tokens), seconds, latency=latency, attempts=attempts, **emitted)

    # ---------------------------------------------------------------- one request, retried

    def _pick(self) -> Server:
        """The least busy server with room, preferring ones not marked down; ties go round-robin."""
        now = time.monotonic()
        self.rr += 1
        n = len(self.servers)
        order = [self.servers[(self.rr + i) % n] for i in range(n)]
        with_room = [s for s in order if s.in_flight < s.capacity] or order
        up = [s for s in with_room if s.down_until <= now] or with_room
        return min(up, key=lambda s: s.in_flight)

    async def _complete(self, body: dict, what: str) -> tuple[dict, int]:
        engine = self.engine
        budget = retry_budget_s(engine.max_retries, engine.backoff_s, engine.backoff_max_s)
        backoff = wait_exponential_jitter(multiplier=engine.backoff_s, max=engine.backoff_max_s, jitter=engine.backoff_s)
        over_budget = []  # a Retry-After that the budget cannot wait for: said in the error

        def wait(state: RetryCallState) -> float:
            error = state.outcome.exception() if state.outcome else None
            asked = getattr(error, "retry_after", None)
            return backoff(state) if asked is None else max(backoff(state), asked)

        def stop(state: RetryCallState) -> bool:
            if stop_after_attempt(engine.max_retries + 1)(state):
                return True
            if state.idle_for + (state.upcoming_sleep or 0.0) > budget + 1e-9:
                over_budget.append(state.upcoming_sleep)
                return True
            return False

        retrying = AsyncRetrying(stop=stop, wait=wait, retry=retry_if_exception(_retryable), before_sleep=self._before_retry(what), reraise=True)
        attempts = 0
        first = time.monotonic()
        try:
            async for attempt in retrying:
                with attempt:
                    attempts += 1
                    payload = await self._post(body)
                    message = _message(payload)  # an answer without one is malformed: _row stops the shard on it
                    if message is not None and empty_reply(message):
                        raise _EmptyReply(f"an empty reply (no content, reasoning or tool call): {json.dumps(payload)[:300]}")
                    return payload, attempts
        except _EmptyReply as err:
            raise _Rejected(f"{err} on each of {attempts} attempts") from None
        except (httpx.TransportError, _RetryableResponse) as err:
            budget_note = (f"; the server asked to wait {over_budget[0]:.0f} s more (Retry-After), past the retry budget of "
                           f"{budget:.0f} s (engine.openai max_retries, backoff_s, backoff_max_s)") if over_budget else ""
            raise ServerUnavailable(
                f"{what}: no answer after {attempts} attempts over {time.monotonic() - first:.0f} s "
                f"(servers {', '.join(s.url for s in self.servers)}; last error {type(err).__name__}: {err}){budget_note}. "
                "Finished turns are kept in the partial log; rerun to go on once the server is back."
            ) from None
        raise AssertionError("unreachable")

    def _before_retry(self, what: str):
        def note(state: RetryCallState) -> None:
            self.retries += 1
            error = state.outcome.exception() if state.outcome else None
            print(f"openai engine: {what}: attempt {state.attempt_number} failed ({type(error).__name__}: {error}); retrying", file=sys.stderr)

        return note

    async def _post(self, body: dict) -> dict:
        server = self._pick()
        server.in_flight += 1
        server.sent += 1
        self.requests += 1
        try:
            response = await server.client.post("/v1/chat/completions", json=body)
        except httpx.TransportError:
            server.down_until = time.monotonic() + self.engine.backoff_s
            raise
        finally:
            server.in_flight -= 1
        status = response.status_code
        if status == 200:
            try:
                return response.json()
            except ValueError as err:
                raise _RetryableResponse(status, f"not JSON ({err}): {response.text[:200]}") from None
        text = response.text[:ERROR_TEXT_CHARS]
        if status in RETRY_STATUS or status >= 500:
            raise _RetryableResponse(status, text, retry_after_seconds(response.headers.get("retry-after")))
        if status in FATAL_STATUS:
            raise ConfigError(f"{server.url}/v1/chat/completions: HTTP {status}: {text[:300]} (check engine.openai base_urls, model and api_key_env)")
        if status == 413 or PERMANENT_REFUSAL.search(text):
            raise _TooLong(f"HTTP {status}: {text}")
        raise _Rejected(f"HTTP {status}: {text}")


def _message(payload) -> dict | None:
    """choices[0].message of a chat completion, or None where the answer has none."""
    try:
        message = payload["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        return None
    return message if isinstance(message, dict) else None
