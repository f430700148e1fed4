"""Agentic multi-turn data (reasoning_content, tool_calls, tool results, tools) through the real Snakefile with
`replies: source`, under a Qwen3-style thinking template that drops past thinking and under a Hermes-style tools
template: no shard fails, every assistant turn's thinking, tool calls and answer are trained, tool results never are,
and each per-turn sample's context is the serving template's rendering, token for token."""

from __future__ import annotations

import json
import os
import shutil

import pyarrow.parquet as pq
import pytest
from conftest import MODEL_NAME, make_workdir, snakemake
from factories import AGENT_CALL, AGENT_REPLIES, THINKING_TEMPLATE, TOOLS_TEMPLATE, AgentServer

from eyrie.target.chat_template import parse_tools, render
from eyrie.tokens.tokenize import answered_messages

pytestmark = pytest.mark.e2e

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "today's weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def call(call_id, city):
    return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}


RECORDS = [
    {"id": "weather", "tools": TOOLS, "messages": [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Is it raining in Oslo?"},
        {"role": "assistant", "content": None, "reasoning_content": "THINK-A I need the weather tool.", "tool_calls": [call("c1", "Oslo")]},
        {"role": "tool", "tool_call_id": "c1", "content": "RESULT-1 light rain, 9 C"},
        {"role": "assistant", "content": "ANSWER-A Yes, light rain.", "reasoning_content": "THINK-B The tool says rain."},
        {"role": "user", "content": "And in Bergen and Tromso?"},
        {"role": "assistant", "content": "", "reasoning_content": "THINK-C Two calls at once.",
         "tool_calls": [call("c2", "Bergen"), call("c3", "Tromso")]},
        {"role": "tool", "tool_call_id": "c2", "content": "RESULT-2 sunny"},
        {"role": "tool", "tool_call_id": "c3", "content": "RESULT-3 snow"},
        {"role": "assistant", "content": "ANSWER-B Sunny in Bergen, snow in Tromso.", "reasoning_content": "THINK-D Both are in."},
    ]},
    {"id": "chat", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}]},
        {"role": "assistant", "content": "ANSWER-C 4.", "thinking": "THINK-E Simple sum."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "ANSWER-D 6.", "reasoning_content": "THINK-F Another sum."},
    ]},
]


def agentic_config(model_path):
    def change(config):
        config["model"]["path"] = str(model_path)
        config["datasets"] = {"agentic": {"source": {"file": "data/agentic.jsonl"}, "format": "openai", "replies": "source",
                                          "shards": 1, "heldout_fraction": 0.0, "generation": {"max_new_tokens": 200}}}
        config["tokenize"]["max_seq_len"] = 1024
    return change


def target_with_template(model_dir, path, template):
    """The default target's files (the weights hard-linked) under another chat template."""
    path.mkdir(parents=True)
    for item in model_dir.iterdir():
        if item.name != "chat_template.jinja":
            (os.link if item.name.endswith(".safetensors") else shutil.copy)(item, path / item.name)
    (path / "chat_template.jinja").write_text(template)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(("name", "template", "per_turn"), [("thinking", THINKING_TEMPLATE, True), ("tools", TOOLS_TEMPLATE, False)])
def test_agentic_records_train_every_assistant_turn_in_its_serving_context(tmp_path, shared_resources, name, template, per_turn):
    from eyrie.target.model import load_tokenizer

    model = target_with_template(shared_resources / "models" / MODEL_NAME, tmp_path / f"{name}-target", template)
    workdir = make_workdir(tmp_path / name, shared_resources, agentic_config(model))
    (workdir / "data" / "agentic.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    snakemake(workdir, "results/hidden/agentic/0000.safetensors")  # extraction tokenizes first: no shard fails

    summary = json.loads((workdir / "results/prompts/agentic/summary.json").read_text())
    assert summary["agentic"] == {"messages_with_reasoning": 6, "messages_with_tool_calls": 2, "tool_calls": 3, "tool_results": 3,
                                  "records_with_tools": 1}
    tokenizer = load_tokenizer(model)
    assert "<think>" in render(tokenizer, [{"role": "assistant", "content": "x", "reasoning_content": "r"}], False)
    tokens_path = workdir / "results/tokens/agentic/0000.parquet"
    stats = json.loads(pq.read_schema(tokens_path).metadata[b"eyrie"])["stats"]
    samples = pq.read_table(tokens_path).to_pylist()
    completions = {r["id"]: r for r in pq.read_table(workdir / "results/completions/agentic/0000.parquet").to_pylist()}
    assert stats.get("unstable_turns", 0) == 0 and stats["truncated"] == 0
    if per_turn:  # a template that drops past thinking: one sample per assistant turn (4 + 2)
        assert stats["per_turn_records"] == 2 and stats["turn_samples"] == 6 == len(samples)
    else:  # history renders stably: one sample per conversation, as plain chat
        assert "per_turn_records" not in stats and len(samples) == 2

    trained = {rid: "" for rid in completions}
    for sample in samples:
        record_id, _, turn = sample["id"].partition("#")
        record = completions[record_id]
        messages = answered_messages([{k: v for k, v in m.items() if v is not None} for m in record["messages"]])
        masked = tokenizer.decode([t for t, m in zip(sample["input_ids"], sample["loss_mask"]) if m])
        context = tokenizer.decode([t for t, m in zip(sample["input_ids"], sample["loss_mask"]) if not m])
        assert "RESULT-" not in masked  # tool results are context, never labels
        if turn:
            j = int(turn)
            start = sample["loss_mask"].index(1)
            serving = render(tokenizer, messages[:j], True, parse_tools(record.get("tools")))
            assert sample["input_ids"][:start] == tokenizer(serving, add_special_tokens=False)["input_ids"]
            assert masked.rstrip().endswith(tokenizer.eos_token if tokenizer.eos_token in masked else "<|im_end|>")
        trained[record_id] += masked
        assert context  # every sample has its context
    for source in RECORDS:
        text = trained[source["id"]]
        for message in source["messages"]:
            if message["role"] != "assistant":
                continue
            reasoning = message.get("reasoning_content") or message.get("thinking")
            assert reasoning in text and (message["content"] or "") in text
            for tool_call in message.get("tool_calls") or []:
                assert json.loads(tool_call["function"]["arguments"])["city"] in text
        assert text.count("<|im_end|>") == sum(m["role"] == "assistant" for m in source["messages"])


def test_in_process_regeneration_answers_in_the_context_of_the_sources_tool_results(tmp_path, shared_resources):
    """replies: target with the in-process engine: each turn is asked with the record's tools and its reply is split as
    a server's parsers would (thinking, <tool_call> blocks). The default target writes no call in its 12 tokens, so the
    tool record ends before the source's results (counted), and the rest trains; a target that makes the source's call
    continues on its results (tests/generation/test_agentic_turns.py)."""
    model = target_with_template(shared_resources / "models" / MODEL_NAME, tmp_path / "target", THINKING_TEMPLATE)

    def regenerated(config):
        agentic_config(model)(config)
        config["datasets"]["agentic"].update(replies="target", generation={"max_new_tokens": 12})

    workdir = make_workdir(tmp_path / "regen", shared_resources, regenerated)
    (workdir / "data" / "agentic.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    snakemake(workdir, "results/hidden/agentic/0000.safetensors")

    completions = pq.read_table(workdir / "results/completions/agentic/0000.parquet")
    stats = json.loads(completions.schema.metadata[b"eyrie"])["stats"]
    assert stats["tool_calls_differ"] == 1
    records = {r["id"]: r for r in completions.to_pylist()}
    weather = records["weather"]["messages"]
    assert [m["role"] for m in weather] == ["system", "user", "assistant"]  # ended before RESULT-1 ...
    assert not weather[-1].get("tool_calls") and "<tool_call>" not in weather[-1]["content"]  # ... as the target called nothing
    assert json.loads(records["weather"]["tools"]) == TOOLS
    assert [m["role"] for m in records["chat"]["messages"]] == ["user", "assistant", "user", "assistant"]
    assert "ANSWER-C" not in records["chat"]["messages"][1]["content"]  # the target's own reply, not the source's
    samples = pq.read_table(workdir / "results/tokens/agentic/0000.parquet").to_pylist()
    assert samples and all(sum(s["loss_mask"]) > 0 for s in samples)


def test_served_reasoning_and_tool_calls_continue_on_the_sources_results_and_train_in_their_serving_context(tmp_path, shared_resources):
    """replies: target through engine.kind openai, against a server whose parsers split reasoning and tool calls
    (factories.AgentServer: get_weather for Oslo to every user turn with tools), up to the token shard (hidden.mode
    online: no extraction). Its Oslo call is the source's first, so the record goes on with RESULT-1; its Oslo call to
    "Bergen and Tromso?" is not, so the record ends there, counted. Every served turn trains, in its serving context."""
    from eyrie.target.model import load_tokenizer

    model = target_with_template(shared_resources / "models" / MODEL_NAME, tmp_path / "served-target", THINKING_TEMPLATE)
    with AgentServer(model=model.name, max_requests=20, max_seconds=300) as server:

        def served(config):
            agentic_config(model)(config)
            config["datasets"]["agentic"].update(replies="target", generation={"max_new_tokens": 16})
            config["engine"] = {"kind": "openai", "openai": {"base_urls": [server.url], "max_in_flight": 1, "max_retries": 0,
                                                             "health_timeout_s": 10, "timeout_s": 30}}
            config["hidden"]["mode"] = "online"

        workdir = make_workdir(tmp_path / "served", shared_resources, served)
        (workdir / "data" / "agentic.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
        snakemake(workdir, "results/tokens/agentic/0000.parquet")  # rc 0: no shard failed
    assert not (workdir / "results/hidden").exists()
    # weather: a call, the answer on RESULT-1, the differing call; chat: two plain turns. Tools go only with the record that has them.
    assert server.sent() == 5 and server.sent("call") == 2 and server.sent("chat") == 2
    assert all((r["tools"] == TOOLS) == (r["fault"] != "chat") for r in server.requests)
    (on_result,) = (r["messages"] for r in server.requests if r["fault"] == "tool")
    assert on_result[-1] == {"role": "tool", "tool_call_id": "c1", "content": "RESULT-1 light rain, 9 C"}
    assert on_result[-2]["tool_calls"] == [AGENT_CALL] and on_result[-2]["reasoning_content"] == AGENT_REPLIES["call"]["reasoning_content"]

    completions = pq.read_table(workdir / "results/completions/agentic/0000.parquet")
    assert json.loads(completions.schema.metadata[b"eyrie"])["stats"]["tool_calls_differ"] == 1
    records = {r["id"]: r for r in completions.to_pylist()}
    weather = records["weather"]["messages"]
    assert [m["role"] for m in weather] == ["system", "user", "assistant", "tool", "assistant", "user", "assistant"]
    assert weather[3]["content"] == "RESULT-1 light rain, 9 C" and weather[5]["content"] == "And in Bergen and Tromso?"
    for call_turn in (weather[2], weather[6]):  # the server's split fields, kept apart: no thinking or call in the content
        assert call_turn["reasoning_content"] == AGENT_REPLIES["call"]["reasoning_content"] and not call_turn["content"]
        assert [c["function"] for c in json.loads(call_turn["tool_calls"])] == [{"name": "get_weather", "arguments": {"city": "Oslo"}}]
    assert (weather[4]["content"], weather[4]["reasoning_content"]) == (AGENT_REPLIES["tool"]["content"], AGENT_REPLIES["tool"]["reasoning_content"])
    chat = records["chat"]["messages"]
    assert [m["role"] for m in chat] == ["user", "assistant", "user", "assistant"]
    assert all((m["content"], m["reasoning_content"]) == (AGENT_REPLIES["chat"]["content"], AGENT_REPLIES["chat"]["reasoning_content"])
               for m in chat[1::2])

    tokens_path = workdir / "results/tokens/agentic/0000.parquet"
    stats = json.loads(pq.read_schema(tokens_path).metadata[b"eyrie"])["stats"]
    samples = pq.read_table(tokens_path).to_pylist()
    assert stats["per_turn_records"] == 2 and stats["turn_samples"] == 5 == len(samples)  # one sample per assistant turn
    assert stats.get("unstable_turns", 0) == 0 and stats["truncated"] == 0
    tokenizer = load_tokenizer(model)
    for sample in samples:
        record_id, _, turn = sample["id"].partition("#")
        record = records[record_id]
        messages = answered_messages([{k: v for k, v in m.items() if v is not None} for m in record["messages"]])
        reply = messages[int(turn)]
        start = sample["loss_mask"].index(1)
        serving = render(tokenizer, messages[: int(turn)], True, parse_tools(record.get("tools")))
        assert sample["input_ids"][:start] == tokenizer(serving, add_special_tokens=False)["input_ids"]  # the context, token for token
        masked = tokenizer.decode([t for t, m in zip(sample["input_ids"], sample["loss_mask"]) if m])
        assert reply["role"] == "assistant" and reply["reasoning_content"] in masked and (reply.get("content") or "") in masked
        assert all(json.dumps(c["function"]["arguments"]) in masked for c in json.loads(reply.get("tool_calls", "[]")))
        assert masked.rstrip().endswith("<|im_end|>")
        # tool results and user turns are context, never labels
        assert not any(m["content"] in masked for m in messages if m["role"] in ("tool", "user") and isinstance(m["content"], str))
