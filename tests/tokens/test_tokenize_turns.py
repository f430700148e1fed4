"""Every assistant turn trained in the context serving renders: per-turn samples under a template that drops past
thinking, one shared sample where history renders stably, each sample's context compared token for token with the
serving template's rendering, and the mask over thinking, tool calls, answer and end-of-turn token, never tool results."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from factories import THINKING_TEMPLATE, TOOLS_TEMPLATE, byte_tokenizer

from eyrie.core.artifacts import PARQUET_KEY
from eyrie.core.atomic import write_parquet_atomically
from eyrie.generation.conversations import completions_schema
from eyrie.target.chat_template import render, stored_messages, tokenize_record
from eyrie.tokens.tokenize import tokenize_shard

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
CALL2 = {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Bergen"}}}
AGENTIC = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo and Bergen?"},
    {"role": "assistant", "content": "", "reasoning_content": "I should call the tool twice.", "tool_calls": [CALL, CALL2]},
    {"role": "tool", "content": "RESULT-OSLO rain", "tool_call_id": "c1"},
    {"role": "tool", "content": "RESULT-BERGEN sun", "tool_call_id": "c2"},
    {"role": "assistant", "content": "Rain in Oslo, sun in Bergen.", "reasoning_content": "Both results are in."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You are welcome.", "reasoning_content": "A polite close."},
]
TEMPLATES = {"thinking": THINKING_TEMPLATE, "tools": TOOLS_TEMPLATE}


def masked_text(tokenizer, sample) -> str:
    return tokenizer.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m])


def unmasked_text(tokenizer, sample) -> str:
    return tokenizer.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if not m])


def turn_starts(sample) -> list[int]:
    return [i for i, m in enumerate(sample.loss_mask) if m and (i == 0 or not sample.loss_mask[i - 1])]


def test_a_template_that_drops_past_thinking_gets_one_sample_per_assistant_turn_in_its_serving_context():
    tokenizer = byte_tokenizer(THINKING_TEMPLATE)
    record = tokenize_record(tokenizer, AGENTIC, 10_000, TOOLS)
    assert record.per_turn and not record.unstable_turns and record.reasoning_dropped == 0
    assert [s.turn for s in record.samples] == [2, 5, 7]
    for sample in record.samples:
        context = render(tokenizer, AGENTIC[: sample.turn], True, TOOLS)
        expected = tokenizer(context, add_special_tokens=False)["input_ids"]
        (start,) = turn_starts(sample)  # one trained turn, after its whole context
        assert sample.input_ids[:start] == expected  # token for token what a server is sent before this turn
        message = AGENTIC[sample.turn]
        trained = masked_text(tokenizer, sample)
        assert trained.startswith("<think>\n" + message["reasoning_content"]) and trained.endswith("<|im_end|>")
        assert message["content"] in trained
    first, second, third = record.samples
    assert '"city": "Oslo"' in masked_text(tokenizer, first) and '"city": "Bergen"' in masked_text(tokenizer, first)
    assert "RESULT-OSLO" in unmasked_text(tokenizer, second) and "RESULT-OSLO" not in masked_text(tokenizer, second)
    # The last turn's context is rendered as serving renders it: the earlier turns' thinking dropped.
    assert "I should call the tool twice." not in tokenizer.decode(third.input_ids)
    assert "A polite close." in masked_text(tokenizer, third)


def test_a_template_that_renders_history_stably_shares_one_sample_whose_contexts_are_the_serving_ones():
    tokenizer = byte_tokenizer(TOOLS_TEMPLATE)
    record = tokenize_record(tokenizer, AGENTIC, 10_000, TOOLS)
    assert not record.per_turn and len(record.samples) == 1
    (sample,) = record.samples
    starts = turn_starts(sample)
    assistant = [j for j, m in enumerate(AGENTIC) if m["role"] == "assistant"]
    assert len(starts) == len(assistant)
    for start, j in zip(starts, assistant):
        expected = tokenizer(render(tokenizer, AGENTIC[:j], True, TOOLS), add_special_tokens=False)["input_ids"]
        assert sample.input_ids[:start] == expected
    trained = masked_text(tokenizer, sample)
    for message in AGENTIC:
        if message["role"] == "assistant":
            assert message["reasoning_content"] in trained and message["content"] in trained
        if message["role"] == "tool":
            assert message["content"] not in trained and message["content"] in unmasked_text(tokenizer, sample)
    assert trained.count("<|im_end|>") == 3 and trained.count("<tool_call>") == 2


def test_the_default_chatml_layout_is_one_sample_with_the_mask_it_always_had():
    chatml = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tokenizer = byte_tokenizer(chatml)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "more"}, {"role": "assistant", "content": "sure"}]
    (sample,) = tokenize_record(tokenizer, messages, 10_000).samples
    assert sample.turn is None and masked_text(tokenizer, sample) == "hello<|im_end|>sure<|im_end|>"


def test_a_turn_whose_rendering_does_not_start_with_its_context_is_counted_not_trained():
    # A template that writes the number of messages first: no context is a prefix of any later rendering.
    counting = ("{{ messages | length }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tokenizer = byte_tokenizer(counting)
    record = tokenize_record(tokenizer, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], 10_000)
    assert record.per_turn and record.unstable_turns == [1] and record.samples == []


def write_completions(path, records):
    rows = [{"id": r["id"], "dataset": "agentic", "messages": stored_messages(r["messages"]), "n_turns": 1, "finish_reason": "stop",
             "finish_reasons": ["stop"], "prompt_tokens": [1], "completion_tokens": [1], "seconds": 0.0, "generation": "{}",
             "tools": json.dumps(TOOLS)} for r in records]
    table = pa.Table.from_pylist(rows, schema=completions_schema(rows))
    table = table.replace_schema_metadata({PARQUET_KEY: json.dumps({"dataset": "agentic", "shard": "0000"}).encode()})
    write_parquet_atomically(table, path)


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_the_token_shard_counts_per_turn_samples_and_warns_of_a_cut(tmp_path, template, capsys):


    tokenizer = byte_tokenizer(TEMPLATES[template])
    write_completions(tmp_path / "c.parquet", [{"id": "a", "messages": AGENTIC}])
    longest = max(len(s.input_ids) for s in tokenize_record(tokenizer, AGENTIC, 10_000, TOOLS).samples)
    cut = longest - 3  # the longest sample loses its last tokens, keeping the rest of its turn
    stats = tokenize_shard(completions_path=str(tmp_path / "c.parquet"), out_path=str(tmp_path / "t.parquet"), tokenizer=tokenizer,
                           template_sha256="x", max_seq_len=cut)
    rows = pq.read_table(tmp_path / "t.parquet").to_pylist()
    if template == "thinking":
        assert stats["per_turn_records"] == 1 and stats["turn_samples"] == 3 and [r["id"] for r in rows] == ["a#2", "a#5", "a#7"]
    else:  # a stable template that renders all reasoning: the stats a plain chat shard always had
        assert "per_turn_records" not in stats and [r["id"] for r in rows] == ["a"]
    assert stats.get("unstable_turns", 0) == 0 and stats["truncated"] == 1 and max(r["n_tokens"] for r in rows) == cut
    assert f"1 sample(s) cut at tokenize.max_seq_len = {cut}" in capsys.readouterr().err
    metadata = json.loads(pq.read_schema(tmp_path / "t.parquet").metadata[PARQUET_KEY])
    assert metadata["stats"] == stats


def test_the_plan_line_shows_what_per_turn_samples_cost_the_cache(tmp_path):
    from eyrie.tokens.shards import per_turn_cost

    write_completions(tmp_path / "c.parquet", [{"id": "a", "messages": AGENTIC}])
    for name, template in TEMPLATES.items():
        tokenize_shard(completions_path=str(tmp_path / "c.parquet"), out_path=str(tmp_path / f"{name}.parquet"),
                       tokenizer=byte_tokenizer(template), template_sha256="x", max_seq_len=10_000)
    assert per_turn_cost([tmp_path / "tools.parquet", tmp_path / "missing.parquet"]) is None  # a stable template costs nothing
    stats = json.loads(pq.read_schema(tmp_path / "thinking.parquet").metadata[PARQUET_KEY])["stats"]
    assert stats["per_turn_tokens"] > stats["per_turn_tokens_as_one_sample"] > 0  # contexts repeated per turn
    line = per_turn_cost([tmp_path / "thinking.parquet"])
    assert "3 from 1 conversations" in line and f"{stats['per_turn_tokens']:,} tokens in the cache" in line
    assert f"{stats['per_turn_tokens'] / stats['per_turn_tokens_as_one_sample']:.2f}x" in line


def test_reasoning_and_tool_calls_a_template_does_not_render_are_counted():
    chatml = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    record = tokenize_record(byte_tokenizer(chatml), AGENTIC, 10_000, TOOLS)
    assert not record.per_turn and record.reasoning_dropped == 3 and record.tool_calls_dropped == 1
