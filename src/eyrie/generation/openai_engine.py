"""Regeneration through OpenAI-compatible servers: any /v1/chat/completions (SGLang, vLLM, transformers serve).

The engine holds the servers' settings and connections and checks what they serve; a shard's requests (concurrency,
retries, failed turns, the resume log's writer, time per row) are eyrie.generation.openai_requests'.

Before the first request the engine identifies what it talks to (`identify`): every server must
list the model it is asked for at /v1/models, and that model must be the target at model.path
(by its name, or the path or root the server reports: vLLM's `root`, SGLang's /get_model_info);
a name that matches no part of it is refused unless engine.openai.model names it, which is then
taken as the user's word and said in the job log. The identity names the resume log
(eyrie.generation.partial) and is recorded in the shard's metadata and the report.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import httpx2 as httpx

from eyrie.core.errors import ConfigError
from eyrie.generation.conversations import Conversation
from eyrie.generation.openai_requests import Server, ServerUnavailable, ShardRequests


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
        model_dir: str | Path | None = None,
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
        self.model_dir = None if model_dir is None else Path(model_dir)  # model.path: what the server must serve
        self.served: dict | None = None  # what identify() found

    def __repr__(self) -> str:  # never shows the key
        return f"OpenAIEngine({self.base_urls}, model={self.model!r}, max_in_flight={self.max_in_flight})"

    @classmethod
    def from_config(cls, openai: dict, tokenizer=None, base_urls: list[str] | None = None, model_dir: str | Path | None = None) -> "OpenAIEngine":
        """From the config's engine.openai section; base_urls overrides the configured ones (managed servers); model_dir
        is the target (model.path) the servers must serve."""
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
            model_dir=model_dir,
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

    def identify(self) -> dict:
        """What the servers serve, checked against model.path before any request (see the module's docstring):
        {"engine", "model", "key", "servers": {url: what the server reports}}. `key` names the resume log."""
        if self.served is None:
            self.served = asyncio.run(self._with_servers(self._identify))
        return self.served

    def regenerate(self, conversations: list[Conversation], settings: dict, log, progress) -> dict:
        """Answer every pending turn; rows go to `log` as they finish. Returns run facts for the shard's stats."""
        return asyncio.run(self._with_servers(lambda servers: self._regenerate(servers, conversations, settings, log, progress)))

    async def _with_servers(self, work):
        limits = httpx.Limits(max_connections=self.max_in_flight, max_keepalive_connections=self.max_in_flight)
        timeout = httpx.Timeout(self.timeout_s, connect=min(10.0, self.timeout_s))
        servers = [
            Server(url, httpx.AsyncClient(base_url=url, headers=self._headers, timeout=timeout, limits=limits), self.max_in_flight)
            for url in self.base_urls
        ]
        try:
            return await work(servers)
        finally:
            for server in servers:
                await server.client.aclose()

    async def _identify(self, servers: list[Server]) -> dict:
        await self._wait_healthy(servers)
        model = await self._resolve_model(servers[0])
        reports = {}
        for server in servers:
            if server is not servers[0]:
                await self._resolve_model(server)  # every server must serve it, not only the first
            reports[server.url] = await self._report(server, model)
        self._check_target(model, reports)
        identity = {"model": model, "reported": sorted({v for r in reports.values() for v in r.values() if isinstance(v, str)})}
        key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]
        return {"engine": "openai", "model": model, "key": key, "servers": reports}

    async def _regenerate(self, servers, conversations, settings, log, progress) -> dict:
        identified = self.served
        await self._wait_healthy(servers)
        model = await self._resolve_model(servers[0])
        if identified is not None and model != identified["model"]:
            raise ConfigError(f"{servers[0].url} now serves {model!r}, not {identified['model']!r} as when the job started; rerun the job")
        run = ShardRequests(self, servers, model, settings, log, progress)
        facts = await run.all(conversations)
        if identified is not None:
            facts["served"] = identified
        return facts

    async def _report(self, server: Server, model: str) -> dict:
        """What the server says of the model beside its name: vLLM's /v1/models `root` and `max_model_len`, SGLang's
        /get_model_info `model_path`; nothing for a server that says nothing."""
        report: dict = {}
        try:
            response = await server.client.get("/v1/models", timeout=min(10.0, self.timeout_s))
            for entry in response.json().get("data", []) if response.status_code == 200 else []:
                if isinstance(entry, dict) and entry.get("id") == model:
                    report.update({k: entry[k] for k in ("root", "max_model_len") if entry.get(k) is not None})
        except (httpx.TransportError, ValueError, AttributeError):
            pass
        try:
            response = await server.client.get("/get_model_info", timeout=min(10.0, self.timeout_s))
            info = response.json() if response.status_code == 200 else {}
            if isinstance(info, dict) and isinstance(info.get("model_path"), str):
                report["model_path"] = info["model_path"]
        except (httpx.TransportError, ValueError):
            pass
        return report

    def _check_target(self, model: str, reports: dict) -> None:
        """The served model must be the target at model.path: by a path that is that directory, or by name."""
        if self.model_dir is None:
            return
        claimed = [model] + [v for r in reports.values() for k, v in r.items() if k in ("root", "model_path")]
        if any(_same_target(value, self.model_dir) for value in claimed):
            return
        said = f"{', '.join(self.base_urls)} serve {model!r}" + (f" ({'; '.join(f'{u}: {r}' for u, r in reports.items() if r)})" if any(reports.values()) else "")
        if self.model is not None:  # the user named the served model: their word, said in the job log
            print(f"openai engine: {said}, whose name is not that of model.path {self.model_dir}; engine.openai.model names it, so it is used as the target", file=sys.stderr)
            return
        raise ConfigError(
            f"{said}, which is not the target at model.path {self.model_dir}: its replies would train a drafter for another model. "
            "Serve model.path (or a copy of the same name), or set engine.openai.model to the served name if it is the same model"
        )

    async def _wait_healthy(self, servers: list[Server]) -> None:
        """Every server answers /health (or /v1/models) with 200 before anything is sent."""
        deadline = time.monotonic() + self.health_timeout_s

        async def one(server: Server) -> str | None:
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

    async def _resolve_model(self, server: Server) -> str:
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


def _same_target(claimed: str, model_dir: Path) -> bool:
    """Whether a served model's name or path is the target directory: the same directory on this machine, or the same
    last path component (a hub id's name, a served path's folder) as the directory or its config's _name_or_path."""
    try:
        if Path(claimed).exists() and Path(claimed).resolve() == model_dir.resolve():
            return True
    except OSError:
        pass
    names = {model_dir.resolve().name.lower()}
    try:
        origin = json.loads((model_dir / "config.json").read_text()).get("_name_or_path")
        if isinstance(origin, str) and origin:
            names.add(origin.rstrip("/").rsplit("/", 1)[-1].lower())
    except (OSError, ValueError, AttributeError):
        pass
    return claimed.rstrip("/").rsplit("/", 1)[-1].lower() in names
