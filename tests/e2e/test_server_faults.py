"""The real Snakefile with engine.kind openai against the fault server (tests/fault_server.py): a turn the server
rejects fails the job, writes no completions shard and shows in `eyrie verify`; once the server is fixed a plain
rerun (no --forcerun) asks exactly that turn again."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import make_workdir, snakemake
from factories import eyrie_verify
from fault_server import FaultServer

pytestmark = pytest.mark.e2e

TARGET = "results/completions/local/0000.parquet"


def test_a_rejected_turn_fails_the_job_and_a_plain_rerun_asks_it_again(tmp_path, shared_resources):
    prompts = [{"id": f"w{i}", "messages": [{"role": "user", "content": f"Name a number above {i}."}]} for i in range(4)]
    with FaultServer(rules={"above 2.": (400, "content filter said no")}) as server:

        def use_the_server(config):
            config["datasets"] = {"local": {"source": {"file": "data/local.jsonl"}, "shards": 1, "heldout_fraction": 0.0}}
            config["generation"].update(max_new_tokens=3, max_turns=1)
            config["engine"] = {"kind": "openai", "openai": {"base_urls": [server.url], "max_in_flight": 1, "max_retries": 1, "backoff_s": 0.05}}
            # The served name is the target directory's, as a server started on model.path lists it.
            server.model = Path(config["model"].get("path") or f"resources/models/{config['model']['name']}").name

        workdir = make_workdir(tmp_path / "w", shared_resources, use_the_server, prompts)
        failed = snakemake(workdir, TARGET, check=False)
        assert failed.returncode != 0 and not (workdir / TARGET).exists()
        log = (workdir / "logs/completions/local/0000.log").read_text()
        assert "1 turn(s) failed" in log and "content filter said no" in log and "no --forcerun" in log
        verify = eyrie_verify(workdir)
        assert "w2 turn 0: HTTP 400" in verify.stdout and "asks exactly these again" in verify.stdout, verify.stdout
        assert server.sent() == 4

        server.rules.clear()  # fixed
        snakemake(workdir, TARGET)
        assert server.sent() == 5  # the failed turn only
    table = pq.read_table(workdir / TARGET).to_pylist()
    assert sorted(r["id"] for r in table) == [f"w{i}" for i in range(4)]
    assert all(m["content"] for r in table for m in r["messages"] if m["role"] == "assistant")
