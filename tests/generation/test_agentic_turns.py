"""Turns of agentic conversations: a turn's input is a user message or the source's tool results; the target's
reasoning and tool calls are kept; a reply calling other tools than the source's ends the conversation before the
source's results; the OpenAI request carries tools and JSON-text arguments."""

from __future__ import annotations

import json

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
