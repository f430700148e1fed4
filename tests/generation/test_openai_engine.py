"""The openai engine against real servers on loopback.

- `transformers serve` on the default model (the real thing, a few tok/s on CPU): a shard
  through HTTP has the in-process engine's records and schema; killing the server mid-shard
  stops the client with a clear error after its retries, a restart finishes the shard; kill -9
  of the regenerating process at random moments loses and duplicates nothing.
- A small stdlib stub server (STUB_SERVER, http.server in its own process) for what
  `transformers serve` cannot show: it does not reject prompts over the context (it generates
  garbage after two minutes), so the error-row path runs against a stub that answers 400 the
  way SGLang and vLLM do; also retries on 503/429, API keys, several servers, time attribution.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2 as httpx
import pyarrow.parquet as pq
import pytest
from factories import STUB_PROMPTS, STUB_SERVER, STUB_SETTINGS, run_shard, write_prompts

from eyrie.core.errors import ConfigError
from eyrie.generation.conversations import COMPLETIONS_SCHEMA, ERROR, PROMPT_TOO_LONG, settings_key
from eyrie.generation.openai_engine import OpenAIEngine
from eyrie.generation.openai_requests import ServerUnavailable
from eyrie.generation.partial import PartialLog, logs_of

# ---------------------------------------------------------------------------- helpers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ShardLog(PartialLog):
    """The shard's resume log, found again at each use: where a server answered, its name holds the served model's
    identity (eyrie.generation.partial), known once a job has run."""

    def __init__(self, workdir: Path, settings: dict, fingerprint: str):
        self.folder, self.key = workdir / "partial", settings_key(settings, fingerprint)

    @property
    def path(self) -> Path:
        logs = logs_of(self.folder, self.key)
        return logs[0] if logs else self.folder / f"{self.key}.jsonl"


def partial_log(workdir: Path, settings=STUB_SETTINGS, fingerprint="fp") -> PartialLog:
    return ShardLog(workdir, settings, fingerprint)


def log_lines(log: PartialLog) -> list[dict]:
    if not log.path.exists():
        return []
    return [json.loads(line) for line in log.path.read_text().splitlines() if line.endswith("}")]


def wait_http(url: str, timeout: float, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not healthy after {timeout} s")


def stop(process: subprocess.Popen, sig=signal.SIGTERM) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        return
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


# ---------------------------------------------------------------------------- the stub server (STUB_SERVER, tests/factories.py)


@pytest.fixture(scope="module")
def stub_script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("stub") / "stub_server.py"
    path.write_text(STUB_SERVER)
    return path


class Stub:
    def __init__(self, script: Path, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen([sys.executable, str(script), "--port", str(self.port), *args], start_new_session=True, stdout=subprocess.DEVNULL)
        wait_http(self.url, 30, self.process)

    def stats(self) -> dict:
        return httpx.get(self.url + "/stats").json()

    def close(self):
        stop(self.process)


@pytest.fixture
def stubs(stub_script):
    started = []

    def make(*args: str) -> Stub:
        started.append(Stub(stub_script, *args))
        return started[-1]

    yield make
    for stub in started:
        stub.close()


def engine_for(*urls, **kw) -> OpenAIEngine:
    kw.setdefault("max_in_flight", 2)
    kw.setdefault("max_retries", 2)
    kw.setdefault("backoff_s", 0.05)
    kw.setdefault("backoff_max_s", 0.2)
    kw.setdefault("health_timeout_s", 10)
    kw.setdefault("timeout_s", 30)
    return OpenAIEngine(list(urls), **kw)


# ---------------------------------------------------------------------------- stub tests (fast)

LONG = "word " * 50


def test_a_prompt_over_the_servers_context_is_kept_as_prompt_too_long_and_ends_its_conversation(tmp_path, stubs):
    """The named permanent refusal: the server's 400 saying the prompt is over its context is a prompt_too_long row
    (what the local length check writes), kept on a rerun. Other rejections are failed turns (test_server_faults)."""
    stub = stubs("--context-words", "40")
    prompts = [
        ("ok", [{"role": "user", "content": "hello there"}, {"role": "user", "content": "and again"}]),
        ("first-too-long", [{"role": "user", "content": LONG}, {"role": "user", "content": "never asked"}]),
        ("second-too-long", [{"role": "user", "content": "short"}, {"role": "user", "content": LONG}]),
    ]
    write_prompts(tmp_path / "p.parquet", prompts)
    stats = run_shard(tmp_path, engine_for(stub.url))

    table = pq.read_table(tmp_path / "c.parquet")
    assert table.schema.remove_metadata() == COMPLETIONS_SCHEMA
    records = {r["id"]: r for r in table.to_pylist()}
    assert records["ok"]["finish_reasons"] == ["stop", "stop"] and records["ok"]["n_turns"] == 2
    # Turn 2 was sent on the model's own first reply.
    assert records["ok"]["messages"][1] == {"role": "assistant", "content": "reply to hello there"}
    assert records["first-too-long"]["finish_reasons"] == [PROMPT_TOO_LONG] and records["first-too-long"]["n_turns"] == 0
    assert [m["role"] for m in records["first-too-long"]["messages"]] == ["user"]  # the question stays, explained
    assert records["second-too-long"]["finish_reasons"] == ["stop", PROMPT_TOO_LONG] and records["second-too-long"]["n_turns"] == 1
    assert stats["errors"] == 0 and stats["finish_reasons"][PROMPT_TOO_LONG] == 2
    rows = log_lines(partial_log(tmp_path))
    refused = [r for r in rows if r["finish_reason"] == PROMPT_TOO_LONG]
    assert len(refused) == 2 and all("HTTP 400" in r["error"] and "longer than the model's context length" in r["error"] for r in refused)
    assert stub.stats()["requests"] == 5  # "never asked" was never asked
    meta = json.loads(table.schema.metadata[b"eyrie"])
    assert meta["stats"]["run"]["engine"] == "openai" and meta["served"]["model"] == "stub-model"

    # A rerun (here: the output removed) reuses every turn, the refusals too: nothing is asked again.
    (tmp_path / "c.parquet").unlink()
    stats = run_shard(tmp_path, engine_for(stub.url))
    assert stats["resumed_turns"] == 5 and stub.stats()["requests"] == 5


def test_local_prompt_check_matches_the_in_process_engine(tmp_path, stubs, tokenizer):
    stub = stubs()
    write_prompts(tmp_path / "p.parquet", [("long", [{"role": "user", "content": "x " * 300}]), ("short", [{"role": "user", "content": "hi"}])])
    stats = run_shard(tmp_path, engine_for(stub.url, tokenizer=tokenizer))
    assert stats["finish_reasons"] == {PROMPT_TOO_LONG: 1, "stop": 1}
    assert stub.stats()["requests"] == 1


def test_retries_503_and_429_with_backoff_then_succeeds(tmp_path, stubs):
    write_prompts(tmp_path / "p.parquet", STUB_PROMPTS)
    for status in ("503", "429"):
        stub = stubs("--fail-first", "3", "--fail-status", status)
        workdir = tmp_path / status
        write_prompts(workdir / "p.parquet", STUB_PROMPTS)
        stats = run_shard(workdir, engine_for(stub.url, max_in_flight=1, max_retries=5))
        assert stats["records"] == 3 and stats["errors"] == 0
        assert stats["run"]["retries"] == 3 and stats["run"]["requests"] == 4 + 3


def test_too_many_failures_stop_with_a_clear_error_and_keep_finished_turns(tmp_path, stubs):
    stub = stubs("--fail-first", "1000", "--fail-status", "500")
    write_prompts(tmp_path / "p.parquet", STUB_PROMPTS)
    with pytest.raises(ServerUnavailable, match=r"no answer after 3 attempts.*HTTP 500"):
        run_shard(tmp_path, engine_for(stub.url, max_in_flight=1))
    assert not (tmp_path / "c.parquet").exists()


def test_api_key_comes_from_the_named_variable_and_is_never_shown(tmp_path, stubs, monkeypatch):
    secret = "sk-test-" + "7" * 20
    stub = stubs("--api-key", secret)
    write_prompts(tmp_path / "p.parquet", STUB_PROMPTS)
    monkeypatch.setenv("EYRIE_TEST_KEY", secret)
    engine = engine_for(stub.url, api_key_env="EYRIE_TEST_KEY", api_key_required=True)
    assert secret not in repr(engine)
    stats = run_shard(tmp_path, engine)
    assert stats["records"] == 3
    assert secret not in json.dumps(stats) and secret not in partial_log(tmp_path).path.read_text()

    monkeypatch.delenv("EYRIE_TEST_KEY")
    with pytest.raises(ConfigError, match="EYRIE_TEST_KEY is not set"):
        engine_for(stub.url, api_key_env="EYRIE_TEST_KEY", api_key_required=True)
    # Not required: no header at all, and the server's 401 stops the job (a config problem, not an error row).
    (tmp_path / "c.parquet").unlink()
    partial_log(tmp_path).path.unlink()
    with pytest.raises(ConfigError, match="HTTP 401") as err:
        run_shard(tmp_path, engine_for(stub.url, api_key_env="EYRIE_TEST_KEY"))
    assert secret not in str(err.value)


def test_wrong_model_name_is_refused_before_any_request(tmp_path, stubs):
    stub = stubs()
    write_prompts(tmp_path / "p.parquet", STUB_PROMPTS)
    with pytest.raises(ConfigError, match="serves"):
        run_shard(tmp_path, engine_for(stub.url, model="not-this-one"))
    assert stub.stats()["requests"] == 0


def test_several_servers_share_the_work_within_their_limits_and_time_is_wall_time(tmp_path, stubs):
    first, second = stubs("--delay", "0.2"), stubs("--delay", "0.2")
    prompts = [(f"p{i}", [{"role": "user", "content": f"question {i}"}]) for i in range(16)]
    write_prompts(tmp_path / "p.parquet", prompts)
    started = time.perf_counter()
    stats = run_shard(tmp_path, engine_for(first.url, second.url, max_in_flight=2))
    wall = time.perf_counter() - started
    assert stats["records"] == 16
    for stub in (first, second):
        assert 4 <= stub.stats()["requests"] <= 12 and stub.stats()["max_in_flight"] <= 2
    # 16 requests of 0.2 s, 4 at a time: ~0.8 s of wall time, not the 3.2 s the latencies add up to.
    assert stats["generation_seconds"] <= wall
    assert stats["generation_seconds"] == pytest.approx(stats["run"]["busy_seconds"], rel=0.05)
    assert stats["latency_seconds"]["mean"] * 16 > 2 * stats["generation_seconds"]
    assert stats["tokens_per_second"] == pytest.approx(stats["completion_tokens"] / stats["generation_seconds"])


def test_no_server_is_a_clear_error(tmp_path):
    write_prompts(tmp_path / "p.parquet", STUB_PROMPTS)
    with pytest.raises(ServerUnavailable, match="no server became healthy"):
        run_shard(tmp_path, engine_for(f"http://127.0.0.1:{free_port()}", health_timeout_s=1))


# ---------------------------------------------------------------------------- transformers serve (real)


class Serve:
    """`transformers serve` on the default model, on loopback; can be killed and restarted on its port."""

    def __init__(self, model_dir: Path, log: Path):
        self.model_dir, self.log = model_dir, log
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = None

    def start(self):
        command = [str(Path(sys.executable).with_name("transformers")), "serve", str(self.model_dir), "--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        wait_http(self.url, 120, self.process)

    def kill(self):
        stop(self.process, signal.SIGKILL)


@pytest.fixture(scope="session")
def serve(model_dir, tmp_path_factory):
    server = Serve(model_dir, tmp_path_factory.mktemp("serve") / "serve.log")
    server.start()
    yield server
    server.kill()


def serve_engine(serve, **kw) -> OpenAIEngine:
    kw.setdefault("max_in_flight", 2)
    kw.setdefault("timeout_s", 120)
    kw.setdefault("health_timeout_s", 120)
    return engine_for(serve.url, **kw)


def test_shard_through_transformers_serve_has_the_in_process_engines_records(tmp_path, serve, model_dir):
    write_prompts(tmp_path / "http" / "p.parquet", STUB_PROMPTS)
    stats = run_shard(tmp_path / "http", serve_engine(serve))
    http = pq.read_table(tmp_path / "http" / "c.parquet")

    import torch

    from eyrie.generation.transformers_engine import TransformersEngine

    torch.set_num_threads(2)
    write_prompts(tmp_path / "local" / "p.parquet", STUB_PROMPTS)
    run_shard(tmp_path / "local", TransformersEngine(str(model_dir)))
    local = pq.read_table(tmp_path / "local" / "c.parquet")

    assert http.schema == local.schema  # same columns, types and metadata keys
    http_meta, local_meta = json.loads(http.schema.metadata[b"eyrie"]), json.loads(local.schema.metadata[b"eyrie"])
    # The same metadata keys, and a server's shard says which model answered (the in-process engine is the target).
    assert http_meta.keys() - {"served"} == local_meta.keys() and http_meta["served"]["model"]
    for h, l in zip(http.to_pylist(), local.to_pylist()):
        assert h["id"] == l["id"] and h["n_turns"] == l["n_turns"]
        assert [m["role"] for m in h["messages"]] == [m["role"] for m in l["messages"]]
        assert len(h["finish_reasons"]) == len(l["finish_reasons"])
        assert h["prompt_tokens"][0] == l["prompt_tokens"][0]  # the server renders the same template
        assert all(0 < t <= STUB_SETTINGS["max_new_tokens"] for t in h["completion_tokens"])
        assert h["seconds"] >= 0
    # Turn 2 of "a" went out on the server's own first reply.
    a = http.to_pylist()[0]
    assert a["messages"][2]["content"] == "And a vegetable?" and a["messages"][1]["content"]
    assert stats["errors"] == 0 and stats["run"]["requests"] == 4 and stats["tokens_per_second"] > 0
    # Greedy in fp32 on both sides: the server's replies are the in-process engine's, turn for turn.
    assert [h["messages"] for h in http.to_pylist()] == [l["messages"] for l in local.to_pylist()]


def test_server_killed_mid_shard_then_restarted(tmp_path, serve):
    prompts = [(f"k{i}", [{"role": "user", "content": f"Count to {i}."}]) for i in range(4)]
    write_prompts(tmp_path / "p.parquet", prompts)
    log = partial_log(tmp_path)
    outcome = {}

    def regenerate():
        try:
            outcome["stats"] = run_shard(tmp_path, serve_engine(serve, max_in_flight=1, max_retries=2, backoff_s=0.2))
        except Exception as err:  # noqa: BLE001
            outcome["error"] = err

    worker = threading.Thread(target=regenerate)
    worker.start()
    deadline = time.monotonic() + 120
    while not log_lines(log) and time.monotonic() < deadline:
        time.sleep(0.05)
    serve.kill()
    worker.join(timeout=120)
    try:
        assert isinstance(outcome.get("error"), ServerUnavailable), outcome
        message = str(outcome["error"])
        assert "no answer after 3 attempts" in message and serve.url in message and "rerun" in message
        kept = log.load()
        assert 1 <= len(kept) < 4 and not (tmp_path / "c.parquet").exists()
    finally:
        serve.start()
    stats = run_shard(tmp_path, serve_engine(serve))
    assert stats["resumed_turns"] == len(kept)
    ids = pq.read_table(tmp_path / "c.parquet", columns=["id"]).column(0).to_pylist()
    assert sorted(ids) == [f"k{i}" for i in range(4)]
    assert len(log_lines(log)) == 4  # each turn generated exactly once


DRIVER = r"""
import json, sys
from eyrie.generation.regenerate import regenerate_shard
from eyrie.generation.openai_engine import OpenAIEngine
workdir, url, settings, in_flight = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
engine = OpenAIEngine([url], max_in_flight=in_flight, timeout_s=300, health_timeout_s=120, max_retries=2, backoff_s=0.2)
regenerate_shard(prompts_path=f"{workdir}/p.parquet", out_path=f"{workdir}/c.parquet", partial_dir=f"{workdir}/partial",
                 dataset="t", shard="0000", settings=settings, engine_settings={}, engine=engine, model_fingerprint="fp", template_sha256="tpl")
"""


def wait_for(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def check_exactly_once(workdir: Path, prompts, turns: int, settings=STUB_SETTINGS) -> None:
    records = pq.read_table(workdir / "c.parquet").to_pylist()
    assert sorted(r["id"] for r in records) == sorted(pid for pid, _ in prompts), "a prompt was lost or duplicated"
    assert sum(len(r["finish_reasons"]) for r in records) == turns
    keys = [(r["id"], r["turn"]) for r in log_lines(partial_log(workdir, settings))]
    assert len(keys) == turns == len(set(keys)), "a turn was written twice"


def test_kill_9_at_random_moments_against_transformers_serve(tmp_path, serve):
    """kill -9 of the regenerating process: once while it starts, then at a random moment after each new row."""
    settings = {**STUB_SETTINGS, "max_new_tokens": 2}
    prompts = [
        ("m0", [{"role": "user", "content": "Name a colour."}, {"role": "user", "content": "Another one?"}]),
        ("m1", [{"role": "user", "content": "Name an animal."}]),
        ("m2", [{"role": "user", "content": "Name a city."}, {"role": "user", "content": "Why?"}]),
        ("m3", [{"role": "user", "content": "Name a tool."}]),
        ("m4", [{"role": "user", "content": "Name a planet."}]),
    ]
    turns = 7
    write_prompts(tmp_path / "p.parquet", prompts)
    log = partial_log(tmp_path, settings)
    rng = random.Random(4)
    command = [sys.executable, "-c", DRIVER, str(tmp_path), serve.url, json.dumps(settings), "2"]
    history = []
    for round_ in range(6):
        before = len(log_lines(log))
        if len(log.load()) == turns:
            break
        driver = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if round_ == 0:
            time.sleep(rng.uniform(0.1, 1.0))  # while it imports, checks health or sends its first requests
        else:
            assert wait_for(lambda: len(log_lines(log)) > before or driver.poll() is not None, 180)
            time.sleep(rng.uniform(0.0, 1.0))
        driver.kill()
        driver.wait()
        history.append((before, len(log.load())))
    finished = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-3000:]
    check_exactly_once(tmp_path, prompts, turns, settings)
    print("kill -9 rounds against transformers serve (rows before, after):", history)


def test_kill_9_at_many_random_moments_against_a_stub_loses_only_requests_in_flight(tmp_path, stubs):
    """Many kills on a fast server: exactly-once records, and the server redid at most what was in flight."""
    requests_log = tmp_path / "requests.jsonl"
    stub = stubs("--delay", "0.2", "--requests-log", str(requests_log))
    prompts = [(f"s{i:02d}", [{"role": "user", "content": f"question {i}"}, {"role": "user", "content": f"follow-up {i}"}]) for i in range(40)]
    turns, in_flight = 80, 4
    write_prompts(tmp_path / "p.parquet", prompts)
    log = partial_log(tmp_path)
    command = [sys.executable, "-c", DRIVER, str(tmp_path), stub.url, json.dumps(STUB_SETTINGS), str(in_flight)]
    rng = random.Random(7)
    history = []
    for round_ in range(10):
        before = len(log_lines(log))
        if len(log.load()) == turns:
            break
        driver = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if round_ % 3 == 0:
            time.sleep(rng.uniform(0.0, 1.0))  # while it starts up
        else:
            assert wait_for(lambda: len(log_lines(log)) > before or driver.poll() is not None, 60)
            time.sleep(rng.uniform(0.0, 0.5))  # mid-shard: requests in flight, rows being written
        driver.kill()
        driver.wait()
        history.append((before, len(log.load())))
    kills = len(history)
    finished = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert finished.returncode == 0, finished.stderr[-3000:]
    check_exactly_once(tmp_path, prompts, turns)
    assert kills >= 5 and sum(after > before for before, after in history) >= 3, history
    sent = [json.loads(line) for line in requests_log.read_text().splitlines()]
    redone = len(sent) - turns
    assert 0 <= redone <= kills * in_flight, f"{redone} requests redone after {kills} kills of {in_flight} in flight"
    # Turn 2 always went out on the model's own turn-1 reply.
    for request in sent:
        if len(request["messages"]) > 1:
            assert request["messages"][1]["content"] == "reply to " + request["messages"][0]["content"]
    print(f"kill -9 x{kills} against the stub: rows before/after {history}; {redone} requests redone")


# ---------------------------------------------------------------------------- through the real Snakefile


@pytest.mark.e2e
def test_pipeline_regenerates_through_the_openai_engine_and_survives_kill_9(tmp_path, serve, shared_resources):
    """engine.kind openai in config.yaml: Snakemake's job talks to the server; kill -9 of the whole run, rerun."""
    from conftest import SNAKEMAKE, make_workdir, snakemake

    prompts = [{"id": f"w{i}", "messages": [{"role": "user", "content": f"Name a number above {i}."}]} for i in range(5)]

    def use_the_server(config):
        config["datasets"] = {"local": {"source": {"file": "data/local.jsonl"}, "shards": 1, "heldout_fraction": 0.0}}
        config["generation"].update(max_new_tokens=3, max_turns=1)
        config["engine"] = {"kind": "openai", "openai": {"base_urls": [serve.url], "max_in_flight": 1, "max_retries": 2, "backoff_s": 0.2}}

    workdir = make_workdir(tmp_path / "w", shared_resources, use_the_server, prompts)
    target = "results/completions/local/0000.parquet"
    partial_dir = workdir / "results/partial/completions/local/0000"
    process = subprocess.Popen(
        [*SNAKEMAKE, "-d", str(workdir), "--cores", "2", target],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert wait_for(lambda: any(p.read_text().count("\n") >= 1 for p in partial_dir.glob("*.jsonl")) or process.poll() is not None, 240)
    time.sleep(random.Random(1).uniform(0.0, 1.0))
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    kept = sum(p.read_text().count("\n") for p in partial_dir.glob("*.jsonl"))

    snakemake(workdir, "--unlock")
    snakemake(workdir, "--rerun-incomplete", target)
    table = pq.read_table(workdir / target)
    assert table.schema.remove_metadata() == COMPLETIONS_SCHEMA
    assert sorted(table.column("id").to_pylist()) == sorted(p["id"] for p in prompts)
    stats = json.loads(table.schema.metadata[b"eyrie"])["stats"]
    assert stats["run"]["engine"] == "openai" and stats["resumed_turns"] == kept and stats["errors"] == 0
    assert "regenerate local/0000" in (workdir / "logs/completions/local/0000.log").read_text()
