"""A small OpenAI-compatible server for fault injection: /health, /v1/models and /v1/chat/completions on 127.0.0.1.

It runs on a thread of the test process and plays scripted faults: `faults` are used one per chat request, in order,
then `then` for every later one (a test changes `then` to "fix" the server); `rules` fault every request whose last
user message contains a key, until cleared. Bounded: it answers at most `max_requests` chat requests (then 503) and
stops by itself after `max_seconds`.

Faults: "ok" (the reply "reply to <last user text>", cut at max_tokens words), "empty" (content ""), "null" (content
null), "reasoning" (content "", reasoning_content set), "tool_call" (content null, one tool call), or an HTTP status
as (status, message) or (status, message, {header: value}) — e.g. (429, "slow down", {"Retry-After": "1"}).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FaultServer:
    def __init__(self, model: str = "stub-model", faults=(), then="ok", rules: dict | None = None, root: str | None = None,
                 max_requests: int = 500, max_seconds: float = 240.0):
        self.model, self.faults, self.then, self.rules, self.root = model, list(faults), then, dict(rules or {}), root
        self.max_requests = max_requests
        self.requests: list[dict] = []  # every chat request: {"time", "messages", "fault"}
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def send(self, status: int, body, headers: dict | None = None):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/health":
                    return self.send(200, {"status": "ok"})
                if self.path == "/v1/models":
                    entry = {"id": server.model, "object": "model", **({"root": server.root} if server.root else {})}
                    return self.send(200, {"object": "list", "data": [entry]})
                self.send(404, {"detail": "not found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, payload, headers = server._answer(body)
                self.send(status, payload, headers)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.timer = threading.Timer(max_seconds, self.close)
        self.timer.daemon = True
        self.timer.start()

    def _fault(self, last_user: str):
        for key, fault in self.rules.items():
            if key in last_user:
                return fault
        return self.faults.pop(0) if self.faults else self.then

    def _answer(self, body: dict):
        messages = body["messages"]
        last_user = next((m.get("content") or "" for m in reversed(messages) if m["role"] == "user"), "")
        with self.lock:
            if len(self.requests) >= self.max_requests:
                return 503, {"error": {"message": "fault server: request limit reached"}}, None
            fault = self._fault(last_user)
            self.requests.append({"time": time.monotonic(), "messages": messages, "fault": fault})
        if isinstance(fault, tuple):
            status, message, *headers = fault
            return status, {"object": "error", "message": message, "code": status}, (headers[0] if headers else None)
        if body.get("model") != self.model:
            return 404, {"error": {"message": f"model {body.get('model')!r} is not served"}}, None
        words = ["reply", "to"] + last_user.split()
        reply = " ".join(words[: body.get("max_tokens", 16)])
        message = {"role": "assistant", "content": reply}
        if fault == "empty":
            message["content"] = ""
        elif fault == "null":
            message["content"] = None
        elif fault == "reasoning":
            message.update(content="", reasoning_content="thinking it over")
        elif fault == "tool_call":
            message.update(content=None, tool_calls=[{"id": "c1", "type": "function", "function": {"name": "look_up", "arguments": "{}"}}])
        tokens = len(reply.split())  # claimed whatever the content: as a misbehaving server does
        return 200, {"id": f"fault-{len(self.requests)}", "object": "chat.completion", "model": self.model,
                     "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                     "usage": {"prompt_tokens": 3, "completion_tokens": tokens, "total_tokens": 3 + tokens}}, None

    def sent(self, fault=None) -> int:
        """Chat requests received (with that fault, if given)."""
        return sum(1 for r in self.requests if fault is None or r["fault"] == fault)

    def close(self) -> None:
        self.timer.cancel()
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> "FaultServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
