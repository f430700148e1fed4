"""Turns of agentic conversations: a turn's input is a user message or the source's tool results; the target's
reasoning and tool calls are kept; a reply calling other tools than the source's ends the conversation before the
source's results; the OpenAI request carries tools and JSON-text arguments; the in-process engine splits its decoded
reply as a server's parsers would."""

from __future__ import annotations

import json

from factories import AGENT_REPLIES, THINKING_TEMPLATE, AgentServer, byte_tokenizer

from eyrie.generation.conversations import (
    TOOL_CALLS_DIFFER,
    Conversation,
    make_row,
    openai_messages,
    reply_fields,
    split_turns,
    to_record,
    turn_key,
)
from eyrie.generation.reply_text import reply_markers
from eyrie.generation.transformers_engine import TransformersEngine

CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Oslo?"},
    {"role": "assistant", "content": "", "reasoning_content": "Call it.", "tool_calls": json.dumps([CALL])},
    {"role": "tool", "content": "rain", "tool_call_id": "c1"},
    {"role": "assistant", "content": "Rain."},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "Welcome."},
    {"role": "user", "content": "Bye"},
    {"role": "assistant", "content": "Bye."},
]


def conversation(max_turns=2):
    system, inputs, replies = split_turns(MESSAGES, max_turns)
    return Conversation("a", system, [turn_key(i) for i in inputs], replies=replies, inputs=inputs, tools=[{"type": "function"}])


def test_turns_are_split_at_assistant_replies_and_max_turns_counts_user_turns():
    system, inputs, replies = split_turns(MESSAGES, 2)
    assert system == MESSAGES[:1]
    assert [[m["role"] for m in i] for i in inputs] == [["user"], ["tool"], ["user"]]
    assert [r["content"] for r in replies] == ["", "Rain.", "Welcome."]
    assert turn_key([{"role": "user", "content": "Oslo?"}]) == "Oslo?"  # plain turns keep the partial log's old key


def test_a_reply_calling_the_sources_tools_continues_on_the_sources_results():
    c = conversation()
    row = make_row(c, 0, "tool_calls", "", 5, 3, 0.1, reasoning_content="Mine.", tool_calls=[{**CALL, "id": "other"}])
    assert "ends_conversation" not in row
    c.answered.append(row)
    prompt = c.messages(upto_turn=1)
    assert prompt[-1] == MESSAGES[3] and prompt[-2]["reasoning_content"] == "Mine."  # the target's reasoning, the source's result


def test_a_reply_calling_other_tools_ends_the_conversation_keeping_the_reply():
    c = conversation()
    other = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    c.answered.append(make_row(c, 0, "tool_calls", "", 5, 3, 0.1, tool_calls=[other]))
    assert c.answered[0]["ends_conversation"] == TOOL_CALLS_DIFFER and c.ended
    record = to_record(c, "ds", {})
    assert [m["role"] for m in record["messages"]] == ["system", "user", "assistant"] and record["tools"]
    assert json.loads(record["messages"][-1]["tool_calls"]) == [other]


def test_a_servers_split_reply_keeps_reasoning_and_calls_and_requests_carry_json_text_arguments():
    message = {"content": None, "reasoning": "think", "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}
    assert reply_fields(message) == {"reasoning_content": "think",
                                     "tool_calls": [{"id": "x", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}
    assert reply_fields({"content": "<think>raw</think>text"}) == {}  # nothing split: the raw text is the reply
    (sent,) = openai_messages([MESSAGES[2]])
    assert sent["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}' and sent["reasoning_content"] == "Call it."


# ---------------------------------------------------------------- a weather conversation, in both engines' tests

WEATHER_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def weather_record(rid: str, city: str, follow_up: bool = False) -> dict:
    """The source asks get_weather for `city`, answers on its result and, with `follow_up`, is thanked and says bye."""
    source_call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}
    messages = [
        {"role": "user", "content": f"Rain in {city}?"},
        {"role": "assistant", "content": None, "tool_calls": [source_call]},
        {"role": "tool", "tool_call_id": "c1", "content": f"RESULT {city}: rain"},
        {"role": "assistant", "content": "Yes."}]
    if follow_up:
        messages += [{"role": "user", "content": "Thanks"}, {"role": "assistant", "content": "Bye."}]
    return {"id": rid, "tools": WEATHER_TOOLS, "messages": messages}


# ---------------------------------------------------------------- against a local server with reasoning and tool parsers


def test_the_openai_engine_sends_tools_and_keeps_the_reasoning_and_calls_its_server_splits_off(tmp_path):
    import pyarrow.parquet as pq

    from eyrie.data.prompts import build_prompts
    from eyrie.data.sources import RawRecord
    from eyrie.generation.openai_engine import OpenAIEngine
    from eyrie.generation.regenerate import regenerate_shard

    prompts = tmp_path / "prompts" / "0000.parquet"
    build_prompts(dataset="t", records=[RawRecord("line 1", weather_record("oslo", "Oslo")), RawRecord("line 2", weather_record("paris", "Paris"))],
                  n_shards=1, heldout_fraction=0.0, shard_paths=[prompts], heldout_path=tmp_path / "h.parquet",
                  summary_path=tmp_path / "s.json")
    with AgentServer(max_requests=10, max_seconds=120) as server:
        engine = OpenAIEngine([server.url], max_in_flight=1, max_retries=0, health_timeout_s=10, timeout_s=30)
        settings = {"max_new_tokens": 16, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_turns": 2, "max_prompt_tokens": 200, "seed": 0}
        stats = regenerate_shard(prompts_path=str(prompts), out_path=str(tmp_path / "c.parquet"), partial_dir=str(tmp_path / "partial"),
                                 dataset="t", shard="0000", settings=settings, engine_settings={"max_batch_tokens": 2048, "max_batch_size": 4},
                                 engine=engine, model_fingerprint="fp", template_sha256="tpl")
    assert all(r["tools"] == WEATHER_TOOLS for r in server.requests)
    records = {r["id"]: r for r in pq.read_table(tmp_path / "c.parquet").to_pylist()}
    oslo = records["oslo"]["messages"]
    assert [m["role"] for m in oslo] == ["user", "assistant", "tool", "assistant"]  # the call matched: asked on the source's result
    assert oslo[1]["reasoning_content"] == AGENT_REPLIES["call"]["reasoning_content"]
    assert json.loads(oslo[1]["tool_calls"])[0]["function"]["arguments"] == {"city": "Oslo"}
    assert oslo[2]["content"] == "RESULT Oslo: rain"
    assert (oslo[3]["content"], oslo[3]["reasoning_content"]) == (AGENT_REPLIES["tool"]["content"], AGENT_REPLIES["tool"]["reasoning_content"])
    resent = next(r for r in server.requests if r["fault"] == "tool")
    assert resent["messages"][1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'  # JSON text on the wire
    # Paris: the target called for Oslo, so the source's Paris result answers nothing it asked: the conversation ends.
    assert [m["role"] for m in records["paris"]["messages"]] == ["user", "assistant"] and stats["tool_calls_differ"] == 1


# ---------------------------------------------------------------- the in-process engine, its reply split as a server's


class ScriptedTarget(TransformersEngine):
    """TransformersEngine's own prompt rendering, generate and reply parsing, over a byte tokenizer with the Qwen3-style
    template; in place of a model, `write(prompt text)` says what the target generates."""

    def __init__(self, write):  # no model to load: the tokenizer and the parsing are the engine's own
        self.tokenizer = byte_tokenizer(THINKING_TEMPLATE)
        self.batching, self.stop_ids = "padded", {self.tokenizer.eos_token_id}
        self.markers = reply_markers(self.tokenizer)
        self.write, self.prompts = write, []

    def _padded(self, prompts, settings):
        texts = [self.tokenizer.decode(p) for p in prompts]
        self.prompts += texts
        return [self.tokenizer(self.write(t), add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id] for t in texts]


MALFORMED = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Berlin"\n</tool_call>'  # a brace short


def write_as_target(prompt: str) -> str:
    """Calls get_weather for the city asked (for Oslo whatever is asked, in a malformed block for Berlin), answers a
    tool result, and says goodbye to a thanks."""
    last = prompt.rsplit("<|im_start|>user\n", 1)[-1]
    if "<tool_response>" in last:
        return "<think>\nThe tool says rain.\n</think>\n\nIt rains."
    if "Thanks" in last:
        return "<think>\nPolite.\n</think>\n\nWelcome."
    if "Berlin" in last:
        return MALFORMED
    return '<think>\nI need the tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def test_the_in_process_engine_splits_its_target_reply_so_a_call_like_the_sources_continues(tmp_path):
    import pyarrow.parquet as pq

    from eyrie.data.prompts import build_prompts
    from eyrie.data.sources import RawRecord
    from eyrie.generation.regenerate import regenerate_shard

    prompts = tmp_path / "prompts" / "0000.parquet"
    records = [RawRecord(f"line {i}", weather_record(city.lower(), city, follow_up=True)) for i, city in enumerate(["Oslo", "Paris", "Berlin"])]
    build_prompts(dataset="t", records=records, n_shards=1, heldout_fraction=0.0, shard_paths=[prompts],
                  heldout_path=tmp_path / "h.parquet", summary_path=tmp_path / "s.json")
    engine = ScriptedTarget(write_as_target)
    settings = {"max_new_tokens": 200, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_turns": 2, "max_prompt_tokens": 4000, "seed": 0}
    stats = regenerate_shard(prompts_path=str(prompts), out_path=str(tmp_path / "c.parquet"), partial_dir=str(tmp_path / "partial"),
                             dataset="t", shard="0000", settings=settings, engine_settings={"max_batch_tokens": 100_000, "max_batch_size": 4},
                             engine=engine, model_fingerprint="fp", template_sha256="tpl")

    done = {r["id"]: r for r in pq.read_table(tmp_path / "c.parquet").to_pylist()}
    oslo = done["oslo"]["messages"]
    assert [m["role"] for m in oslo] == ["user", "assistant", "tool", "assistant", "user", "assistant"]  # the same call: continued
    assert (oslo[1]["content"], oslo[1]["reasoning_content"]) == ("", "I need the tool.")
    assert json.loads(oslo[1]["tool_calls"]) == [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]
    assert (oslo[2]["content"], oslo[3]["content"], oslo[5]["content"]) == ("RESULT Oslo: rain", "It rains.", "Welcome.")
    # After the next user turn the template drops the earlier turns' thinking, as it would a server's split reply.
    thanks = next(p for p in engine.prompts if "Thanks" in p and "RESULT Oslo" in p)
    assert "I need the tool." not in thanks and "The tool says rain." not in thanks and '"city": "Oslo"' in thanks
    # Paris: the target called for Oslo, so the source's Paris result answers nothing it asked.
    assert [m["role"] for m in done["paris"]["messages"]] == ["user", "assistant"]
    # Berlin: the malformed block is kept inline as generated, counted, and the conversation ends (no call was made).
    berlin = done["berlin"]["messages"]
    assert [m["role"] for m in berlin] == ["user", "assistant"] and berlin[1]["content"] == MALFORMED
    assert stats["tool_calls_differ"] == 2 and stats["run"]["tool_calls_unparsed"] == 1
