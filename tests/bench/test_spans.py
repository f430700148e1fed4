import pytest

from eyrie.bench.spans import acceptance_by_span, label_tokens, measure_spans, pick_markers, round_spans

QWEN = {"thinking": ("<think>", "</think>"), "tool_call": ("<tool_call>", "</tool_call>")}


def test_each_token_is_labelled_by_the_span_it_sits_in_markers_included():
    pieces = ["<think>", "\nstep", " one", "</think>", "\n\n", "Call", "<tool_call>", '{"name"', "}", "</tool_call>", "<|im_end|>"]
    assert label_tokens(pieces, QWEN) == ["thinking"] * 4 + ["answer"] * 2 + ["tool_call"] * 4 + ["answer"]


def test_a_think_block_opened_by_the_generation_prompt_labels_the_reply_as_thinking():
    prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert label_tokens(["So", " 2", "</think>", "4"], QWEN, prefix=prompt) == ["thinking", "thinking", "thinking", "answer"]


def test_closed_markers_in_the_prompt_do_not_leak_into_the_reply():
    prompt = "use <tool_call>{...}</tool_call> tags\n<|im_start|>assistant\n"
    assert label_tokens(["The", " answer"], QWEN, prefix=prompt) == ["answer", "answer"]


def test_an_unclosed_tool_call_runs_to_the_end_of_the_reply():
    assert label_tokens(["a", "<tool_call>", "{", '"x'], QWEN) == ["answer", "tool_call", "tool_call", "tool_call"]


def test_a_marker_split_over_tokens_is_found_in_the_joined_text():
    # A tokenizer without an added <think> token spells it in pieces: the first piece opens the span.
    assert label_tokens(["<th", "ink>", "r", "</th", "ink>", "a"], QWEN) == ["thinking"] * 5 + ["answer"]


def test_a_round_counts_for_the_span_of_its_first_new_token():
    labels = ["thinking", "thinking", "thinking", "answer", "answer", "tool_call"]
    # tokens[0] is the prefill's; rounds emit 2 (tokens 1-2), 2 (3-4) and 1 (5)
    assert round_spans(labels, [2, 2, 1]) == ["thinking", "answer", "tool_call"]
    with pytest.raises(ValueError, match="emitted 4 tokens, but 5"):
        round_spans(labels, [2, 2])


def test_mean_acceptance_per_span_is_emitted_tokens_over_rounds():
    first = (["answer", "thinking", "thinking", "thinking", "answer", "answer"], [3, 2])
    second = (["answer", "answer", "answer", "answer"], [1, 2])
    by_span = acceptance_by_span([first, second])
    assert by_span["thinking"] == {"rounds": 1, "mean": 3.0}
    assert by_span["answer"] == {"rounds": 3, "mean": (2 + 1 + 2) / 3}
    assert by_span["tool_call"] == {"rounds": 0, "mean": None}


def test_markers_come_from_what_the_tokenizer_declares_with_think_and_tool_call_as_fallback():
    assert pick_markers("") == QWEN
    kimi = pick_markers("<|tool_calls_section_begin|>\n<think>")
    assert kimi == {"thinking": ("<think>", "</think>"), "tool_call": ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")}
    harmony = pick_markers("<|channel|>\n{{ '<|channel|>analysis' }} {{ '<|channel|>commentary to=functions.' }}")
    assert harmony["thinking"] == ("<|channel|>analysis", "<|end|>")


def test_measure_spans_decodes_each_token_with_a_real_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<think>", "</think>", "<tool_call>", "</tool_call>", "a", "b", "c", "<s>"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<s>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core)
    tokenizer.add_special_tokens({"additional_special_tokens": words[:4]})
    ids = {w: i for i, w in enumerate(words)}
    # prefill "a"; rounds: "<think> b" (thinking), "</think> c" (thinking: the close), "<tool_call> a b" (tool call), "</tool_call>"
    tokens = [ids[w] for w in ["a", "<think>", "b", "</think>", "c", "<tool_call>", "a", "b", "</tool_call>"]]
    result = measure_spans(tokenizer, [([ids["a"]], tokens, [2, 2, 3, 1])])
    assert result["thinking"] == {"rounds": 2, "mean": 2.0}
    assert result["tool_call"] == {"rounds": 2, "mean": 2.0}
    assert result["answer"] == {"rounds": 0, "mean": None}
    assert result["markers"] == {"thinking": ["<think>", "</think>"], "tool_call": ["<tool_call>", "</tool_call>"]}


def test_rounds_that_do_not_add_up_to_the_tokens_are_refused_by_name():
    with pytest.raises(ValueError, match="rounds emitted 3 tokens, but 1 follow"):
        acceptance_by_span([(["answer", "answer"], [3])])
