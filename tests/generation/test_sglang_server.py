"""The managed SGLang engine: its launch command parses with SGLang's own ServerArgs parser, a wrong
algorithm for an EAGLE-3 drafter is refused before launch, and the server's lifecycle (start on a
free loopback port, health, regeneration through the openai path, shutdown of the whole process
group on return, exception, SIGTERM and kill -9 of the job) holds.

SGLang cannot run here (its install pulls GBs of CUDA packages). Its argument parser can:
`pip install --no-deps sglang==0.5.23 orjson pybase64 msgspec pyzmq`. Two things are stubbed,
inside the `sglang_parser` fixture (tests/conftest.py) only: `triton` (~1 GB; server_args -> sglang.srt.utils imports it at the
top and only uses it for GPU kernels) is replaced by an inert module, and sglang's top-level
`__init__` (which imports the whole runtime) is skipped by registering the package by path, so
`sglang.srt.server_args` is imported directly. Without sglang installed these tests skip.

The lifecycle tests launch a fake `sglang.launch_server` (tests/factories.py's STUB_SERVER, the stub
OpenAI server, found first on PYTHONPATH), through exactly the command eyrie builds.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from factories import STUB_PROMPTS, STUB_SERVER, run_shard, sglang_argv, write_prompts

from eyrie.core.errors import ConfigError
from eyrie.generation.sglang_server import managed_server, shared_server
from eyrie.target.serving import command_from_config, launch_command


def write_drafter(path: Path, architecture: str = "LlamaForCausalLMEagle3") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"architectures": [architecture], "draft_vocab_size": 2048}))
    return path


def test_baseline_and_eagle3_commands_parse_with_sglangs_own_parser(tmp_path, sglang_parser):
    parser, SpeculativeAlgorithm = sglang_parser
    baseline = launch_command("/models/target", 31234, tp_size=2, mem_fraction_static=0.8, context_length=4096, extra_args=["--attention-backend", "triton"])
    args = parser.parse_args(sglang_argv(baseline))
    assert (args.model_path, args.host, args.port, args.tp_size) == ("/models/target", "127.0.0.1", 31234, 2)
    assert args.mem_fraction_static == 0.8 and args.context_length == 4096 and args.speculative_algorithm is None

    drafter = write_drafter(tmp_path / "drafter")
    speculative = {"algorithm": "EAGLE3", "draft_model_path": str(drafter), "num_steps": 5, "eagle_topk": 1, "num_draft_tokens": 6}
    eagle3 = launch_command("/models/target", 31235, speculative=speculative)
    args = parser.parse_args(sglang_argv(eagle3))
    assert args.speculative_algorithm == "EAGLE3" and args.speculative_draft_model_path == str(drafter)
    assert (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens) == (5, 1, 6)
    assert SpeculativeAlgorithm.from_string(args.speculative_algorithm).is_eagle3()

    # From the config section, with the schema's defaults.
    from eyrie.config import validate

    config = validate({"model": {"name": "m", "path": "/m"}, "datasets": {"d": {"source": {"file": "x.jsonl"}}}, "engine": {"kind": "sglang", "sglang": {"speculative": speculative}}})
    args = parser.parse_args(sglang_argv(command_from_config(config["engine"]["sglang"], "/m", 31236)))
    assert args.model_path == "/m" and args.speculative_algorithm == "EAGLE3"

    # The parser is strict: a misspelt flag does not slip through.
    with pytest.raises(SystemExit):
        parser.parse_args(sglang_argv(launch_command("/m", 1, extra_args=["--speculative-eagle-top-k", "1"])))


def test_trust_remote_code_and_tensor_parallelism_parse_with_sglangs_own_parser(sglang_parser):
    """Regeneration's command from a validated config (model.trust_remote_code, engine.sglang.tp_size), as
    eyrie.generation.engines builds it: SGLang reads both, and without trust_remote_code the flag is absent."""
    from eyrie.config import validate

    parser, _ = sglang_parser
    for trust in (True, False):
        config = validate({"model": {"name": "m", "path": "/m", "trust_remote_code": trust}, "datasets": {"d": {"source": {"file": "x.jsonl"}}},
                           "engine": {"kind": "sglang", "sglang": {"tp_size": 8}}})
        command = command_from_config(config["engine"]["sglang"], "/m", 31237, bool(config["model"]["trust_remote_code"]))
        args = parser.parse_args(sglang_argv(command))
        assert (args.model_path, args.tp_size, args.trust_remote_code) == ("/m", 8, trust)
        assert ("--trust-remote-code" in command) is trust


def test_eagle_for_an_eagle3_drafter_is_refused_before_launch(tmp_path):
    drafter = write_drafter(tmp_path / "drafter")
    wrong = {"algorithm": "EAGLE", "draft_model_path": str(drafter), "num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4}
    with pytest.raises(ConfigError, match=r"EAGLE-3 drafter.*--speculative-algorithm EAGLE3"):
        launch_command("/models/target", 30000, speculative=wrong)
    log = tmp_path / "logs" / "server.log"
    with pytest.raises(ConfigError):
        with managed_server(lambda port: launch_command("/models/target", port, speculative=wrong), log):
            pass
    assert not log.exists()  # nothing was launched
    with pytest.raises(ConfigError, match="no config.json"):
        launch_command("/m", 1, speculative={**wrong, "algorithm": "EAGLE3", "draft_model_path": str(tmp_path / "missing")})


@pytest.fixture
def fake_sglang(tmp_path) -> dict:
    """An environment whose `python -m sglang.launch_server` is the stub OpenAI server."""
    package = tmp_path / "fake" / "sglang"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "launch_server.py").write_text(STUB_SERVER)
    return {**os.environ, "PYTHONPATH": str(tmp_path / "fake")}


def gone(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
        return False
    except ProcessLookupError:
        return True


def wait_gone(pid: int, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return gone(pid)


def started_pid(text: str) -> int:
    return int(re.findall(r"sglang: started pid (\d+)", text)[-1])


def test_managed_server_regenerates_and_always_stops(tmp_path, fake_sglang, capsys):
    from eyrie.generation.openai_engine import OpenAIEngine

    write_prompts(tmp_path / "p.parquet", STUB_PROMPTS)
    log = tmp_path / "logs" / "sglang" / "t" / "0000.log"
    command = lambda port: launch_command("stub-model", port)  # noqa: E731
    with managed_server(command, log, startup_timeout_s=30, env=fake_sglang) as url:
        assert url.startswith("http://127.0.0.1:")
        stats = run_shard(tmp_path, OpenAIEngine([url], max_in_flight=2, health_timeout_s=10))
        pid = started_pid(capsys.readouterr().err)
    assert stats["records"] == 3 and stats["run"]["model"] == "stub-model"
    assert wait_gone(pid)
    assert "# eyrie: " in log.read_text() and "sglang.launch_server" in log.read_text()

    with pytest.raises(RuntimeError, match="boom"):
        with managed_server(command, log, startup_timeout_s=30, env=fake_sglang) as url:
            pid = started_pid(capsys.readouterr().err)
            raise RuntimeError("boom")
    assert wait_gone(pid)


JOB = r"""
import sys, time
from eyrie.generation.sglang_server import managed_server
from eyrie.target.serving import launch_command
with managed_server(lambda port: launch_command("stub-model", port), sys.argv[1], startup_timeout_s=30):
    print("up", flush=True)
    time.sleep(120)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_the_server_dies_with_its_job(tmp_path, fake_sglang, sig):
    log = tmp_path / "server.log"
    errors = tmp_path / "job.err"
    with open(errors, "w") as err:
        job = subprocess.Popen([sys.executable, "-c", JOB, str(log)], stdout=subprocess.PIPE, stderr=err, text=True, env=fake_sglang)
    try:
        assert job.stdout.readline().strip() == "up", errors.read_text()
        pid = started_pid(errors.read_text())
        job.send_signal(sig)
        job.wait(timeout=60)
        assert wait_gone(pid), f"server {pid} outlived its job after signal {sig}"
    finally:
        job.kill()


def test_shared_server_is_started_once_and_stopped_by_the_last_user(tmp_path, fake_sglang):
    command = lambda port: launch_command("stub-model", port)  # noqa: E731
    state = tmp_path / "state"
    with shared_server(command, tmp_path / "shared.log", state, startup_timeout_s=30, env=fake_sglang) as first:
        pid = json.loads(next(state.glob("*.json")).read_text())["pid"]
        with shared_server(command, tmp_path / "shared.log", state, startup_timeout_s=30, env=fake_sglang) as second:
            assert second == first
        assert not gone(pid)  # the first user still needs it
    assert wait_gone(pid) and not list(state.glob("*.json"))


@pytest.mark.e2e
def test_pipeline_runs_a_managed_server_per_job(tmp_path, shared_resources, fake_sglang, monkeypatch):
    """engine.kind sglang through the real Snakefile: the job starts the (fake) server, regenerates, stops it."""
    from conftest import make_workdir, snakemake

    def use_sglang(config):
        config["datasets"] = {"local": {"source": {"file": "data/local.jsonl"}, "shards": 1, "heldout_fraction": 0.0}}
        config["engine"] = {"kind": "sglang", "sglang": {"startup_timeout_s": 60, "extra_args": ["--log-level", "info"]}}

    workdir = make_workdir(tmp_path / "w", shared_resources, use_sglang)
    monkeypatch.setenv("PYTHONPATH", fake_sglang["PYTHONPATH"])
    snakemake(workdir, "results/completions/local/0000.parquet")
    records = pq.read_table(workdir / "results/completions/local/0000.parquet").to_pylist()
    assert records and all(r["messages"][-1]["content"].startswith("reply to") for r in records if r["n_turns"])
    server_log = (workdir / "logs/sglang/local/0000.log").read_text()
    assert "sglang.launch_server --model-path resources/models/" in server_log and "--log-level info" in server_log
    job_log = (workdir / "logs/completions/local/0000.log").read_text()
    pid = started_pid(job_log)
    assert f"sglang: stopped pid {pid}" in job_log and wait_gone(pid)
