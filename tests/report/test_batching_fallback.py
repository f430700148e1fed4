"""The report's generation settings say why engine.batching: static ran padded: the reason the in-process engine
keeps (TransformersEngine.fallback) travels with the completions shard it answered (stats.run) to the page, beside
what answered, instead of only as a warning in the job log."""

from __future__ import annotations

import html
import json
import re

import pyarrow.parquet as pq
import pytest
from factories import STUB_PROMPTS, STUB_SETTINGS, TOOLS_TEMPLATE, byte_tokenizer, report_inputs, run_shard, tiny_llama, write_prompts

from eyrie.core.artifacts import PARQUET_KEY, parquet_metadata
from eyrie.generation.transformers_engine import TransformersEngine
from eyrie.report.build import write_report


def tiny_engine(directory, batching: str = "static") -> TransformersEngine:
    """The in-process engine on a random two-layer Llama over a byte tokenizer (its 258 ids are the model's vocabulary)."""
    tiny_llama(directory, vocab=258, hidden=32, layers=2, heads=4, kv_heads=2, positions=512)
    byte_tokenizer(TOOLS_TEMPLATE).save_pretrained(directory)
    return TransformersEngine(str(directory), dtype="float32", device="cpu", batching=batching)


def settings_row(page: str, dataset: str) -> str:
    table = page.split("<h3>Generation settings</h3>", 1)[1].split("</table>", 1)[0]
    return re.search(rf"<tr><td>{dataset}</td>.*?</tr>", table, flags=re.S).group(0)


def test_the_reason_static_batching_ran_padded_reaches_the_generation_settings_table(tmp_path):
    engine = tiny_engine(tmp_path / "target")
    write_prompts(tmp_path / "p.parquet", STUB_PROMPTS)
    with pytest.warns(UserWarning, match="static runs these turns padded instead"):  # the job log's line
        run_shard(tmp_path, engine, {**STUB_SETTINGS, "temperature": 0.7})  # sampling: the static loop is greedy only
    run = parquet_metadata(pq.read_schema(tmp_path / "c.parquet").metadata, tmp_path / "c.parquet")["stats"]["run"]
    assert run["engine"] == "transformers" and run["batching_fallback"] == engine.fallback and "sampling" in engine.fallback

    # The regenerated shard's run facts in the report's chat/0000 shard; sharegpt's shards keep none.
    config, summaries, completions, tokens = report_inputs(tmp_path / "report")
    shard = tmp_path / "report" / "results" / "completions" / "chat" / "0000.parquet"
    table = pq.read_table(shard)
    meta = parquet_metadata(table.schema.metadata, shard)
    meta["stats"]["run"] = run
    pq.write_table(table.replace_schema_metadata({PARQUET_KEY: json.dumps(meta).encode()}), shard)
    out = tmp_path / "report" / "report.html"
    write_report(config, summaries, completions, tokens, str(out))
    page = out.read_text(encoding="utf-8")

    chat = settings_row(page, "chat")
    assert "transformers" in chat and f"batching static ran padded: {html.escape(engine.fallback)}" in chat
    assert "ran padded" not in settings_row(page, "sharegpt")
    assert page.count("batching static ran padded") == 1


def test_a_run_that_asked_for_padded_records_no_fallback(tmp_path):
    engine = tiny_engine(tmp_path / "target", batching="padded")
    write_prompts(tmp_path / "p.parquet", STUB_PROMPTS)
    stats = run_shard(tmp_path, engine, {**STUB_SETTINGS, "temperature": 0.7})
    assert engine.fallback is None and "batching_fallback" not in stats["run"]
