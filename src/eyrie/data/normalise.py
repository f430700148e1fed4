"""One raw record read as a prompt: its turns as messages, or a BadRecord naming the file, the record and the field.

A prompt is the leading system turn (if any) plus the user turns in order; the
assistant turns are dropped because the target model regenerates them, unless the dataset
keeps its source's replies (`replies: source`): then each user turn is followed by the reply
the source gives it, and the conversation ends before the first user turn without one.
A conversation with tool results keeps its assistant turns either way: the source's tool calls
are what its tool results answer (regeneration compares the target's calls with them).

Agentic and reasoning data (OpenAI messages): record-level ``tools``; assistant ``tool_calls``
(content null or text; arguments as JSON text or objects, stored as objects; parallel calls);
``tool`` messages with ``tool_call_id``; ``reasoning_content`` (alias ``thinking``); content as
a list of parts, whose text parts are joined with newlines (any other part is a bad record);
``developer`` read as the system turn. ShareGPT's function-calling variant: ``function_call``
turns (a JSON call) and ``observation`` turns (its result), with ``tools`` as JSON text.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from eyrie.data.sources import BadRecord, RawRecord

# per shape: the key holding the turns, then each turn's role key and content key
SHAPES = {
    "sharegpt": ("conversations", "from", "value"),
    "openai": ("messages", "role", "content"),
}
ROLE_MAP = {
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "assistant": "assistant", "model": "assistant",
    "system": "system", "developer": "system",
    "tool": "tool", "function": "tool", "ipython": "tool", "observation": "tool",
    "function_call": "assistant",  # ShareGPT's function-calling variant: the turn's value is one JSON call
}

_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class Prompt:
    id: str
    messages: list[dict]  # role and content, plus reasoning_content / tool_calls / tool_call_id / name where present
    n_user_turns: int
    tools: list | None = None


class _Problem(Exception):
    """What is wrong inside a record; normalise_record adds the file, location and id."""

    def __init__(self, kind: str, problem: str, field: str | None = None):
        super().__init__(problem)
        self.kind, self.problem, self.field = kind, problem, field


def shape_of(data: dict, fmt: str) -> str:
    """The record's shape (a key of SHAPES): `fmt` itself, or for auto the first shape whose turn list it holds."""
    if fmt != "auto":
        return fmt
    for shape, (turns_key, _, _) in SHAPES.items():
        if turns_key in data:
            return shape
    raise _Problem("no_turn_list", "has neither a 'conversations' list (sharegpt) nor a 'messages' list (openai)")


def _check_text(value: str, field: str) -> None:
    """Lone surrogates mark invalid UTF-8 in the file (or a broken \\ud800-style escape); neither can be written out."""
    found = _SURROGATE.search(value)
    if found is None:
        return
    code = ord(found.group())
    if 0xDC80 <= code <= 0xDCFF:
        raise _Problem("invalid_utf8", f"invalid UTF-8: byte 0x{code - 0xDC00:02X} at character {found.start()}", field)
    raise _Problem("invalid_utf8", f"lone UTF-16 surrogate \\u{code:04x} at character {found.start()}", field)


def _raw_id(data: dict) -> str | None:
    """The record's own id as a string, or None when it has none (then one is derived from the content)."""
    value = data.get("id")
    if value is None or value == "":
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise _Problem("bad_id", f"id must be a string or a number, got {type(value).__name__}", "id")
    text = str(value)
    _check_text(text, "id")
    return text


def _derived_id(messages: list[dict[str, str]]) -> str:
    canonical = json.dumps(messages, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return "sha1:" + hashlib.sha1(canonical.encode("utf-8")).hexdigest()[:16]


def _role_of(turn: Any, shape: str, where: str) -> str:
    _, role_key, _ = SHAPES[shape]
    if not isinstance(turn, dict):
        raise _Problem("not_an_object", f"a turn must be a JSON object, got {type(turn).__name__}", where)
    raw_role = turn.get(role_key)
    role = ROLE_MAP.get(raw_role.strip().lower()) if isinstance(raw_role, str) else None
    if role is None:
        raise _Problem("unknown_role", f"unknown role {raw_role!r}; known roles: {', '.join(ROLE_MAP)}", f"{where}.{role_key}")
    return role


def _text_of(content: Any, where: str, allow_null: bool) -> str:
    """A turn's text: a string, a list of text parts (joined with newlines), or None where the turn may have none."""
    if content is None and allow_null:
        return ""
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if not isinstance(part, dict) or kind != "text" or not isinstance(part.get("text"), str):
                raise _Problem("unsupported_content_part", f"content part {k} is {kind!r}; only text parts "
                               "({'type': 'text', 'text': ...}) are read", f"{where}[{k}]")
            texts.append(part["text"])
        content = "\n".join(texts)
    if not isinstance(content, str):
        raise _Problem("non_string_content", f"content must be a string, got {'nothing' if content is None else type(content).__name__}", where)
    _check_text(content, where)
    return content


def _content_of(turn: dict, shape: str, where: str, allow_null: bool = False) -> str:
    _, _, content_key = SHAPES[shape]
    if content_key not in turn and not allow_null:
        raise _Problem("non_string_content", "content must be a string, got nothing", f"{where}.{content_key}")
    return _text_of(turn.get(content_key), f"{where}.{content_key}", allow_null)


def _json_value(value: Any, where: str, kind: str) -> Any:
    """JSON text decoded, anything else as it is."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as error:
        raise _Problem(kind, f"not valid JSON: {error.msg} (column {error.colno})", where) from None


def _tool_call(call: Any, where: str) -> dict:
    """One call as {"id"?, "type": "function", "function": {"name", "arguments": object}}; OpenAI's shape or a bare
    {"name", "arguments"} (ShareGPT's function_call)."""
    if not isinstance(call, dict):
        raise _Problem("bad_tool_call", f"a tool call must be a JSON object, got {type(call).__name__}", where)
    function, fwhere = (call.get("function"), f"{where}.function") if "function" in call else (call, where)
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"].strip():
        raise _Problem("bad_tool_call", "a tool call needs a function with a non-empty string name", f"{fwhere}.name")
    _check_text(function["name"], f"{fwhere}.name")
    arguments = _json_value(function.get("arguments", {}), f"{fwhere}.arguments", "bad_tool_call")
    if not isinstance(arguments, dict):
        raise _Problem("bad_tool_call", f"arguments must be a JSON object (or its JSON text), got {type(arguments).__name__}", f"{fwhere}.arguments")
    _check_text(json.dumps(arguments, ensure_ascii=False), f"{fwhere}.arguments")
    out = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if call.get("id") is not None:
        if not isinstance(call["id"], str):
            raise _Problem("bad_tool_call", f"a tool call id must be a string, got {type(call['id']).__name__}", f"{where}.id")
        out["id"] = call["id"]
    return out


def _tool_calls_of(turn: dict, raw_role: str, shape: str, where: str) -> list[dict] | None:
    if shape == "sharegpt" and raw_role == "function_call":
        return [_tool_call(_json_value(turn.get("value"), f"{where}.value", "bad_tool_call"), f"{where}.value")]
    calls = turn.get("tool_calls")
    if calls is None:
        return None
    if not isinstance(calls, list) or not calls:
        raise _Problem("bad_tool_call", "tool_calls must be a non-empty list", f"{where}.tool_calls")
    return [_tool_call(call, f"{where}.tool_calls[{k}]") for k, call in enumerate(calls)]


def _reasoning_of(turn: dict, where: str) -> str | None:
    values = {key: turn[key] for key in ("reasoning_content", "thinking") if turn.get(key) is not None}
    if len(set(map(str, values.values()))) > 1:
        raise _Problem("bad_reasoning", "reasoning_content and thinking differ; give one", f"{where}.thinking")
    for key, value in values.items():
        return _text_of(value, f"{where}.{key}", allow_null=False) or None
    return None


def _message_of(turn: dict, role: str, shape: str, where: str) -> dict:
    """One turn as a message: role and content, plus the assistant's reasoning and calls or a tool result's id."""
    raw_role = str(turn.get(SHAPES[shape][1])).strip().lower()
    calls = _tool_calls_of(turn, raw_role, shape, where) if role == "assistant" else None
    if shape == "sharegpt" and raw_role == "function_call":
        content = ""
    else:
        content = _content_of(turn, shape, where, allow_null=role == "assistant")
    message = {"role": role, "content": content}
    reasoning = _reasoning_of(turn, where)
    if reasoning is not None:
        if role != "assistant":
            raise _Problem("bad_reasoning", f"only an assistant turn has reasoning, not a {role} turn", f"{where}.reasoning_content")
        message["reasoning_content"] = reasoning
    if calls is not None:
        message["tool_calls"] = calls
    if role == "tool":
        for key in ("tool_call_id", "name"):
            value = turn.get(key)
            if value is not None:
                if not isinstance(value, str):
                    raise _Problem("bad_tool_result", f"{key} must be a string, got {type(value).__name__}", f"{where}.{key}")
                message[key] = value
    return message


def _has_reply(message: dict) -> bool:
    return bool(message["content"].strip() or message.get("tool_calls") or (message.get("reasoning_content") or "").strip())


def _prompt_messages(turns: list, shape: str, keep_replies: bool = False) -> list[dict]:
    """System turn (only if first) plus the non-empty user turns; assistant turns are left for regeneration.

    keep_replies: each user turn (or the tool results of a call) is followed by the assistant turn that answers it
    (its text, reasoning or tool calls), and the messages end before the first user turn that has none (a later reply
    would answer a question the conversation lost). A conversation with tool results keeps its replies either way.
    A tool result must follow an assistant turn with tool calls (or another result); its tool_call_id, where given,
    must name one of that turn's calls."""
    turns_key = SHAPES[shape][0]
    parsed = []
    for index, turn in enumerate(turns):
        where = f"{turns_key}[{index}]"
        role = _role_of(turn, shape, where)
        parsed.append((where, role, _message_of(turn, role, shape, where)))
        if role == "system" and index > 0:
            raise _Problem("misplaced_system", "a system turn may only come first", where)
    keep_replies = keep_replies or any(role == "tool" for _, role, _ in parsed)
    messages = []
    awaiting_reply = closed = asked = False
    open_calls: list[dict] | None = None  # the calls of the last assistant turn, while its results come
    for where, role, message in parsed:
        if role == "tool":
            if open_calls is None:
                raise _Problem("misplaced_tool_result", "a tool result must follow an assistant turn with tool_calls", where)
            ids = {call.get("id") for call in open_calls} - {None}
            if message.get("tool_call_id") is not None and ids and message["tool_call_id"] not in ids:
                raise _Problem("unknown_tool_call_id", f"tool_call_id {message['tool_call_id']!r} names none of the calls "
                               f"before it ({', '.join(sorted(ids))})", f"{where}.tool_call_id")
        elif role != "assistant" or not message.get("tool_calls"):
            open_calls = None
        if role == "assistant" and message.get("tool_calls"):
            open_calls = message["tool_calls"]
        if closed:
            continue  # every turn is still checked, none is kept
        if role == "system":
            messages.append(message)
        elif role == "user" and message["content"].strip():
            asked = True
            if keep_replies and awaiting_reply:  # two user turns in a row: the first has no reply
                closed = True
                continue
            messages.append(message)
            awaiting_reply = keep_replies
        elif role == "assistant" and awaiting_reply and _has_reply(message):
            messages.append(message)
            awaiting_reply = False
        elif role == "tool" and messages and (messages[-1]["role"] == "tool" or messages[-1].get("tool_calls")):
            messages.append(message)
            awaiting_reply = True
        elif role == "tool" and keep_replies and not closed:
            closed = True  # the call it answers was not kept (no reply before it): what follows lost its context
    while awaiting_reply and messages and messages[-1]["role"] in ("user", "tool"):
        messages.pop()  # the last question or tool results kept have no reply
        awaiting_reply = bool(messages) and messages[-1]["role"] == "tool"
    if not any(message["role"] == "user" for message in messages):
        if asked:  # only keep_replies drops a user turn with text
            raise _Problem("no_source_reply", "no user turn with text is followed by an assistant reply with text (replies: source)", turns_key)
        raise _Problem("no_user_turn", "no user turn with text", turns_key)
    return messages


def _tools_of(data: dict) -> list | None:
    tools = data.get("tools")
    if tools is None or tools == "" or tools == []:
        return None
    tools = _json_value(tools, "tools", "bad_tools")
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise _Problem("bad_tools", "tools must be a list of JSON objects (or its JSON text)", "tools")
    _check_text(json.dumps(tools, ensure_ascii=False), "tools")
    return tools


def _normalise(data: Any, fmt: str, keep_replies: bool = False) -> Prompt:
    if not isinstance(data, dict):
        raise _Problem("not_an_object", f"a record must be a JSON object, got {type(data).__name__}")
    record_id = _raw_id(data)
    shape = shape_of(data, fmt)
    turns_key = SHAPES[shape][0]
    turns = data.get(turns_key)
    if not isinstance(turns, list):
        got = "nothing" if turns_key not in data else type(turns).__name__
        raise _Problem("no_turn_list", f"expected a list of turns ({shape} format), got {got}", turns_key)
    messages = _prompt_messages(turns, shape, keep_replies)
    tools = _tools_of(data)
    n_user_turns = sum(message["role"] == "user" for message in messages)
    # A derived id reads the prompt alone, so keeping the replies does not move a record between shards or splits.
    prompt_only = [m for m in messages if m["role"] != "assistant"]
    return Prompt(record_id or _derived_id(prompt_only), messages, n_user_turns, tools)


def _id_for_messages(data: Any) -> str | None:
    """The record's id as written, only to name the record in an error message."""
    try:
        return _raw_id(data) if isinstance(data, dict) else None
    except _Problem:
        return None


def normalise_record(record: RawRecord, fmt: str, file: str, keep_replies: bool = False) -> Prompt:
    """The prompt in a raw record; raises BadRecord naming the file, the location, the id and the field."""
    if record.error is not None:
        raise record.error
    try:
        return _normalise(record.data, fmt, keep_replies)
    except _Problem as problem:
        raise BadRecord(problem.kind, file, record.location, problem.problem,
                        record_id=_id_for_messages(record.data), field=problem.field) from None
