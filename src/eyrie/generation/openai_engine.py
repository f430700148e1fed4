"""Regeneration through OpenAI-compatible servers: any /v1/chat/completions (SGLang, vLLM, transformers serve).

Many conversations are answered concurrently, each turn by turn (turn t+1 is sent only after
turn t finished, on the model's own reply), with at most `max_in_flight` requests per server and
every request sent to the least busy server. Connection errors, timeouts, 429 and 5xx are
retried with exponential backoff and jitter (tenacity); when the retries run out the shard
stops with a clear error and every finished turn stays in the partial log. A request the
server rejects for good (another 4xx, e.g. a prompt over its context) becomes an error row
(finish_reason "error", with the server's message) that ends its conversation.

Rows reach the log through one writer task: rows finished while the previous write was being
fsynced go out together in the next (group commit), so a kill loses only the requests in
flight and the few milliseconds of rows not yet on disk, and fsync never stalls the requests.

Time is attributed to rows so that their `seconds` sum to the wall time during which at least
one request was in flight (`BusyClock`): each finished row is booked the busy wall time since the
row before it finished. Tokens over seconds is then the real throughput under any concurrency,
for a whole shard and just as well for the first rows of one (which `eyrie plan` measures from
the partial log mid-run): nothing is booked ahead, so early rows do not look faster than the
server is. A row's `seconds` is therefore not its request's cost; its `latency` is.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import httpx2 as httpx
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from eyrie.core.errors import ConfigError, EyrieError
from eyrie.generation.conversations import (
    ERROR,
    PROMPT_TOO_LONG,
    Conversation,
    make_row,
    openai_messages,
    reply_fields,
    stable_seed,
)

RETRY_STATUS = {408, 429}  # and every 5xx
FATAL_STATUS = {401, 403, 404, 405}  # the configuration is wrong, not the prompt: stop, write no row
ERROR_TEXT_CHARS = 1000


class ServerUnavailable(EyrieError):
    """A request still failed after every retry: the shard stops, its finished turns are kept."""


class _RetryableResponse(Exception):
    def __init__(self, status: int, text: str):
        super().__init__(f"HTTP {status}: {text[:300]}")
        self.status = status


class _Rejected(Exception):
    """The server refused this request for good; it becomes an error row."""


def _retryable(error: BaseException) -> bool:
    return isinstance(error, (httpx.TransportError, _RetryableResponse))


@dataclass
class _Server:
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


def api_key_headers(api_key_env: str | None, required: bool) -> dict[str, str]:
    """The Authorization header from the environment variable the config names; never the key itself in config or logs."""
    if not api_key_env:
        if required:
            raise ConfigError("engine.openai.api_key_required is true but engine.openai.api_key_env names no environment variable")
        return {}
    key = os.environ.get(api_key_env)
    if not key:
        if required:
            raise ConfigError(f"engine.openai.api_key_env: the environment variable {api_key_env} is not set (or empty), and the config says a key is required")
        return {}
    return {"Authorization": f"Bearer {key}"}


class OpenAIEngine:
    """Answers conversations through one or more OpenAI-compatible servers."""

    def __init__(
        self,
        base_urls: list[str],
        *,
        model: str | None = None,
        api_key_env: str | None = None,
        api_key_required: bool = False,
        max_in_flight: int = 8,
        timeout_s: float = 600.0,
        max_retries: int = 5,
        backoff_s: float = 1.0,
        backoff_max_s: float = 60.0,
        health_timeout_s: float = 600.0,
        max_consecutive_errors: int = 32,
        tokenizer=None,
    ):
        if not base_urls:
            raise ConfigError("engine.openai.base_urls: give at least one server URL (e.g. http://127.0.0.1:30000)")
        self.base_urls = [self._normalize(u) for u in base_urls]
        self.model = model
        self._headers = api_key_headers(api_key_env, api_key_required)
        self.max_in_flight = max_in_flight
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.health_timeout_s = health_timeout_s
        self.max_consecutive_errors = max_consecutive_errors
        self.tokenizer = tokenizer

    def __repr__(self) -> str:  # never shows the key
        return f"OpenAIEngine({self.base_urls}, model={self.model!r}, max_in_flight={self.max_in_flight})"

    @classmethod
    def from_config(cls, openai: dict, tokenizer=None, base_urls: list[str] | None = None) -> "OpenAIEngine":
        """From the config's engine.openai section; base_urls overrides the configured ones (managed servers)."""
        return cls(
            base_urls if base_urls is not None else list(openai["base_urls"]),
            model=openai["model"],
            api_key_env=openai["api_key_env"],
            api_key_required=openai["api_key_required"],
            max_in_flight=openai["max_in_flight"],
            timeout_s=openai["timeout_s"],
            max_retries=openai["max_retries"],
            backoff_s=openai["backoff_s"],
            backoff_max_s=openai["backoff_max_s"],
            health_timeout_s=openai["health_timeout_s"],
            max_consecutive_errors=openai["max_consecutive_errors"],
            tokenizer=tokenizer,
        )

    @staticmethod
    def _normalize(url: str) -> str:
        url = url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url

    # ------------------------------------------------------------------ local tokenizer (optional)

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        from eyrie.target.chat_template import render

        text = render(self.tokenizer, messages, add_generation_prompt=True, tools=tools)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    # ------------------------------------------------------------------ the shard

    def regenerate(self, conversations: list[Conversation], settings: dict, log, progress) -> dict:
        """Answer every pending turn; rows go to `log` as they finish. Returns run facts for the shard's stats."""
        return asyncio.run(self._regenerate(conversations, settings, log, progress))

    async def _regenerate(self, conversations, settings, log, progress) -> dict:
        limits = httpx.Limits(max_connections=self.max_in_flight, max_keepalive_connections=self.max_in_flight)
        timeout = httpx.Timeout(self.timeout_s, connect=min(10.0, self.timeout_s))
        servers = [
            _Server(url, httpx.AsyncClient(base_url=url, headers=self._headers, timeout=timeout, limits=limits), self.max_in_flight)
            for url in self.base_urls
        ]
        try:
            await self._wait_healthy(servers)
            model = await self._resolve_model(servers[0])
            run = _Run(self, servers, model, settings, log, progress)
            return await run.all(conversations)
        finally:
            for server in servers:
                await server.client.aclose()

    async def _wait_healthy(self, servers: list[_Server]) -> None:
        """Every server answers /health (or /v1/models) with 200 before anything is sent."""
        deadline = time.monotonic() + self.health_timeout_s

        async def one(server: _Server) -> str | None:
            last = "no answer"
            delay = 0.2
            while True:
                for path in ("/health", "/v1/models"):
                    try:
                        response = await server.client.get(path, timeout=min(10.0, self.timeout_s))
                        if response.status_code == 200:
                            return None
                        last = f"GET {path}: HTTP {response.status_code}"
                        if response.status_code in (401, 403):
                            raise ConfigError(f"{server.url}{path}: HTTP {response.status_code}: the server wants a valid API key (see engine.openai.api_key_env)")
                    except httpx.TransportError as err:
                        last = f"GET {path}: {type(err).__name__}: {err}"
                        break  # not up yet: no use trying the other path
                if time.monotonic() + delay > deadline:
                    return last
                await asyncio.sleep(delay)
                delay = min(delay * 1.5, 5.0)

        problems = await asyncio.gather(*(one(s) for s in servers))
        down = [(s, p) for s, p in zip(servers, problems) if p is not None]
        if len(down) == len(servers):
            details = "; ".join(f"{s.url}: {p}" for s, p in down)
            raise ServerUnavailable(f"no server became healthy within {self.health_timeout_s:.0f} s ({details})")
        for server, problem in down:
            print(f"openai engine: {server.url} is not healthy ({problem}); going on with the others", file=sys.stderr)
            servers.remove(server)
            await server.client.aclose()

    async def _resolve_model(self, server: _Server) -> str:
        """The configured model, checked against /v1/models where the server lists them; else the one it serves."""
        try:
            response = await server.client.get("/v1/models", timeout=min(10.0, self.timeout_s))
            served = [m["id"] for m in response.json()["data"]] if response.status_code == 200 else None
        except (httpx.TransportError, ValueError, KeyError, TypeError):
            served = None
        if self.model is not None:
            if served and self.model not in served:
                raise ConfigError(f"engine.openai.model is {self.model!r} but {server.url} serves {served}")
            return self.model
        if not served:
            raise ConfigError(f"{server.url} does not list its models (GET /v1/models); set engine.openai.model")
        if len(served) > 1:
            raise ConfigError(f"{server.url} serves several models {served}; set engine.openai.model to one of them")
        return served[0]


class _Run:
    """One shard's requests: workers, the writer task, retries, counters."""

    def __init__(self, engine: OpenAIEngine, servers: list[_Server], model: str, settings: dict, log, progress):
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

    async def all(self, conversations: list[Conversation]) -> dict:
        started = time.perf_counter()
        queue = deque(c for c in conversations if not c.ended)
        writer = asyncio.create_task(self._writer())
        workers = [asyncio.create_task(self._worker(queue)) for _ in range(sum(s.capacity for s in self.servers))]
        try:
            done, pending = await asyncio.wait(workers, return_when=asyncio.FIRST_EXCEPTION)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for task in done:
                if task.exception() is not None:
                    raise task.exception()
        finally:
            for task in workers:
                task.cancel()
            self.closing = True
            self.rows_waiting.set()
            await asyncio.shield(writer)  # every finished row reaches the disk, also when stopping on an error
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
                await asyncio.to_thread(self.log.append, rows)
            if self.closing and not self.pending_rows:
                return

    def _finish(self, conversation: Conversation, row: dict) -> None:
        conversation.answered.append(row)
        self.pending_rows.append(row)
        self.rows_waiting.set()
        self.progress.turn_done(conversation, row)
        self.progress.show(self.clock.busy_seconds(), sum(s.in_flight for s in self.servers))

    # ---------------------------------------------------------------- conversations

    async def _worker(self, queue: deque) -> None:
        while queue:
            await self._answer(queue.popleft())

    async def _answer(self, conversation: Conversation) -> None:
        settings = self.settings
        while not conversation.ended:
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
            except _Rejected as rejected:
                self.clock.end()
                row = make_row(conversation, turn, ERROR, "", local_tokens or 0, 0, self.clock.book(), latency=time.perf_counter() - sent, error=str(rejected))
                self.consecutive_errors += 1
                self._finish(conversation, row)
                if self.consecutive_errors >= self.engine.max_consecutive_errors:
                    raise ServerUnavailable(
                        f"the server rejected {self.consecutive_errors} requests in a row (last: {rejected}); "
                        "this looks like a configuration problem, not bad prompts. Finished turns are kept; "
                        "rejected turns are asked again on the next run."
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

    def _pick(self) -> _Server:
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
        retrying = AsyncRetrying(
            stop=stop_after_attempt(engine.max_retries + 1),
            wait=wait_exponential_jitter(multiplier=engine.backoff_s, max=engine.backoff_max_s, jitter=engine.backoff_s),
            retry=retry_if_exception(_retryable),
            before_sleep=self._before_retry(what),
            reraise=True,
        )
        attempts = 0
        first = time.monotonic()
        try:
            async for attempt in retrying:
                with attempt:
                    attempts += 1
                    return await self._post(body), attempts
        except (httpx.TransportError, _RetryableResponse) as err:
            raise ServerUnavailable(
                f"{what}: no answer after {attempts} attempts over {time.monotonic() - first:.0f} s "
                f"(servers {', '.join(s.url for s in self.servers)}; last error {type(err).__name__}: {err}). "
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
            raise _RetryableResponse(status, text)
        if status in FATAL_STATUS:
            raise ConfigError(f"{server.url}/v1/chat/completions: HTTP {status}: {text[:300]} (check engine.openai base_urls, model and api_key_env)")
        raise _Rejected(f"HTTP {status}: {text}")
