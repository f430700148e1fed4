"""The in-process engine's reply split as a server's reasoning and tool parsers split it: thinking, Hermes/Qwen JSON
calls (parallel ones too), a generation prompt that opened <think>; what cannot be parsed stays inline, counted."""

from __future__ import annotations

from factories import THINKING_TEMPLATE, byte_tokenizer

from eyrie.generation.conversations import reply_fields
from eyrie.generation.reply_text import opens_thinking, reply_markers, split_reply
from eyrie.target.chat_template import render

QWEN = {"thinking": ("<think>", "</think>"), "tool_call": ("<tool_call>", "</tool_call>")}
OSLO = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
BERGEN = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bergen", "days": 2}}\n</tool_call>'


def call(city, **more):
    return {"type": "function", "function": {"name": "get_weather", "arguments": {"city": city, **more}}}


def test_thinking_is_split_off_and_the_templates_newlines_around_it_go():
    assert split_reply("<think>\nAdd them.\n</think>\n\nIt is 4.", QWEN) == ("It is 4.", {"reasoning_content": "Add them."})
    # the target's own spacing inside the parts stays
    assert split_reply("<think>  a\n\nb </think> 4 ", QWEN) == (" 4 ", {"reasoning_content": "  a\n\nb "})


def test_a_reply_without_markers_is_kept_as_written():
    assert split_reply("  Just text.\n", QWEN) == ("  Just text.\n", {})


def test_a_call_alone_leaves_an_empty_reply_and_the_call_in_reply_fields_shape():
    content, fields = split_reply(OSLO, QWEN)
    assert (content, fields) == ("", {"tool_calls": [call("Oslo")]})
    server = reply_fields({"content": "", "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]})
    assert fields == server  # the row the OpenAI engine stores for the same call


def test_several_blocks_are_parallel_calls_in_order():
    assert split_reply(f"{OSLO}\n{BERGEN}", QWEN) == ("", {"tool_calls": [call("Oslo"), call("Bergen", days=2)]})


def test_thinking_content_and_a_call_each_go_to_their_field():
    text = f"<think>\nI need the tool.\n</think>\n\nLet me check.\n{OSLO}"
    assert split_reply(text, QWEN) == ("Let me check.", {"reasoning_content": "I need the tool.", "tool_calls": [call("Oslo")]})
    # text the target wrote after its calls is kept, on its own line
    assert split_reply(f"Checking.\n{OSLO}\nDone.", QWEN) == ("Checking.\nDone.", {"tool_calls": [call("Oslo")]})


def test_a_generation_prompt_that_opened_think_makes_the_reply_start_in_thinking():
    opened = THINKING_TEMPLATE.replace("<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n<think>\n{% endif %}")
    tokenizer = byte_tokenizer(opened)
    prompt = render(tokenizer, [{"role": "user", "content": "2+2?"}], True)
    closed = render(byte_tokenizer(THINKING_TEMPLATE), [{"role": "user", "content": "2+2?"}], True)
    assert opens_thinking(prompt, QWEN) and not opens_thinking(closed, QWEN)
    assert split_reply("Add them.\n</think>\n\nIt is 4.", QWEN, in_thinking=True) == ("It is 4.", {"reasoning_content": "Add them."})
    # cut by max_new_tokens inside thinking: all of it is reasoning, as SGLang's parser reads it
    assert split_reply("Add them and", QWEN, in_thinking=True) == ("", {"reasoning_content": "Add them and"})
    # a call opened without closing thinking ends it (Qwen3.5 does this; SGLang's qwen3 parser reads it so)
    assert split_reply(f"Need it.\n{OSLO}", QWEN, in_thinking=True) == ("", {"reasoning_content": "Need it.", "tool_calls": [call("Oslo")]})


def test_a_call_that_is_not_name_and_arguments_json_stays_inline_exactly_and_is_counted():
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}\n</tool_call>'  # a brace short
    extra_key = '<tool_call>\n{"name": "f", "arguments": {}, "id": "x"}\n</tool_call>'
    text = f"<think>\nr\n</think>\n\nTry.\n{broken}\n{OSLO}\n{extra_key}"
    content, fields = split_reply(text, QWEN)
    assert content == f"Try.\n{broken}\n{extra_key}"
    assert fields == {"reasoning_content": "r", "tool_calls": [call("Oslo")], "tool_calls_unparsed": 2}
    cut = 'Sure.\n<tool_call>\n{"name": "get_we'  # cut by max_new_tokens
    assert split_reply(cut, QWEN) == (cut, {"tool_calls_unparsed": 1})


def test_another_familys_tool_call_format_stays_inline_and_is_counted():
    kimi = {"tool_call": ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")}
    text = "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>"
    assert split_reply(text, kimi) == (text, {"tool_calls_unparsed": 1})


def test_thinking_that_does_not_open_the_reply_stays_inline():
    assert split_reply("So: <think>x</think> y", QWEN) == ("So: <think>x</think> y", {})


def test_only_markers_the_tokenizer_or_its_template_knows_are_split():
    assert reply_markers(byte_tokenizer(THINKING_TEMPLATE)) == QWEN
    plain = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    markers = reply_markers(byte_tokenizer(plain))
    assert markers == {}  # a template that cannot render reasoning or calls: splitting them off would lose them
    assert split_reply("<think>r</think>a", markers) == ("<think>r</think>a", {})
