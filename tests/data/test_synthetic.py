"""Synthetic prompts: the user prefix and end of turn read off real chat templates, screening, seeds, resuming, config errors."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from factories import tiny_llama, word_tokenizer

from eyrie import config as cfg
from eyrie.core.digest import verify
from eyrie.core.errors import ConfigError, ContractError, InputFileError
from eyrie.core.schema import load_schema
from eyrie.data import synthetic
from eyrie.data.dataset_prompts import build_prompts_for_dataset
from eyrie.data.synthetic import Request, Screen, end_of_turn, normalised, stop_token_ids, synthesize_prompts, user_prefix
from eyrie.plan import planned_outputs

# SmolLM2-135M-Instruct's template (ChatML, with a default system message when the conversation has none).
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n'"
    " + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Meta-Llama-3-8B-Instruct's template: the BOS written by the template, content trimmed, turns closed by <|eot_id|>.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
WORDS = "what how can you write a python function that adds two numbers is the sum of and to kindly explain why my code list sort".split()
SETTINGS = {"count": 3, "topics": [], "topic_as": "system", "topic_template": None, "temperature": 1.0, "top_p": 1.0,
            "max_tokens": 10, "min_chars": 1, "max_samples": 64, "batch_size": 8, "seed": 0}


def chatml_tokenizer():
    return word_tokenizer(CHATML, ["<|im_start|>", "<|im_end|>"], words=WORDS, eos="<|im_end|>")


def llama3_tokenizer():
    # eos is <|end_of_text|> as in the base tokenizer: the end of a user turn must come from the template, not eos
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    return word_tokenizer(LLAMA3, specials, words=WORDS, eos="<|end_of_text|>", bos="<|begin_of_text|>")


def llama_over(tokenizer, seed: int = 0):
    """A random float32 2-layer Llama of width 32 over the tokenizer's vocabulary, its eos the tokenizer's."""
    return tiny_llama(seed=seed, hidden=32, layers=2, vocab=len(tokenizer), intermediate=64, positions=256, eos_token_id=tokenizer.eos_token_id,
                      bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id)


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    """The model is tiny: one thread is fastest on a shared machine."""


def synthesize(tmp_path, tokenizer, model, name="out", **changes):
    settings = {**SETTINGS, **changes}
    out = tmp_path / f"{name}.parquet"
    stats = synthesize_prompts(dataset="syn", settings=settings, model=model, tokenizer=tokenizer, out_path=out,
                               partial_dir=tmp_path / f"partial-{name}", model_fingerprint="m" * 64, template_sha256="t" * 64)
    return stats, out


def prompts_of(path) -> list[str]:
    return [r["messages"][0]["content"] for r in pq.read_table(path).to_pylist()]


# ---------------------------------------------------------------- the template's user turn


def test_chatml_user_prefix_with_its_default_system_message_and_with_a_steering_one():
    tokenizer = chatml_tokenizer()
    assert user_prefix(tokenizer) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\n"
    )
    assert user_prefix(tokenizer, system="Help with Python.") == "<|im_start|>system\nHelp with Python.<|im_end|>\n<|im_start|>user\n"
    assert end_of_turn(tokenizer) == "<|im_end|>"


def test_llama3_user_prefix_keeps_the_templates_bos_and_its_turn_ends_with_eot_not_eos():
    tokenizer = llama3_tokenizer()
    assert user_prefix(tokenizer) == "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n"
    assert user_prefix(tokenizer, system="Help with maths.") == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nHelp with maths.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
    )
    assert end_of_turn(tokenizer) == "<|eot_id|>"
    model = llama_over(tokenizer)
    ids = tokenizer.convert_tokens_to_ids(["<|eot_id|>", "<|end_of_text|>"])
    assert stop_token_ids(tokenizer, model) == sorted(ids)


def test_the_user_prefix_rendered_is_what_the_template_puts_before_a_real_message():
    for tokenizer in (chatml_tokenizer(), llama3_tokenizer()):
        whole = tokenizer.apply_chat_template([{"role": "user", "content": "how can you sort my list"}], tokenize=False)
        assert whole.startswith(user_prefix(tokenizer) + "how can you sort my list" + end_of_turn(tokenizer))


@pytest.mark.parametrize("template, problem", [
    ("{% for m in messages if m.role != 'system' %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}", "drops the system message"),
    (("{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
      "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"), "System role not supported"),
    ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{{ m.content }}<|im_end|>{% endfor %}", "2 times"),
])
def test_templates_that_cannot_be_cut_are_refused_with_the_fix(template, problem):
    tokenizer = word_tokenizer(template, ["<|im_start|>", "<|im_end|>"], words=WORDS, eos="<|im_end|>")
    with pytest.raises(ContractError, match=problem) as error:
        user_prefix(tokenizer, system="Help with Python.")
    assert "topic_as: user_prefix" in str(error.value) or "file source" in str(error.value)


def test_a_template_whose_user_turn_ends_in_plain_text_is_refused():
    llama2 = "{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }} [/INST]{% else %}{{ m.content }}</s>{% endif %}{% endfor %}"
    tokenizer = word_tokenizer(llama2, ["</s>"], words=WORDS, eos="</s>")
    with pytest.raises(ContractError, match=r"closes a user turn with ' \[/INST\]', not with a special token.*file source"):
        end_of_turn(tokenizer)


# ---------------------------------------------------------------- screening


def test_screening_drops_duplicates_by_normalised_text_and_empty_short_and_unfinished_samples():
    screen = Screen(count=2, min_chars=5)
    plain, steered = Request("", "p", ""), Request("maths", "p", "maths: ")
    assert screen.add(plain, "  Hello   World ", True) == "kept"
    assert screen.add(plain, "hello world\n", True) == "duplicates"
    assert screen.add(plain, "ＨＥＬＬＯ world", True) == "duplicates"  # NFKC: full-width letters are the same text
    assert screen.add(plain, "   ", True) == "empty"
    assert screen.add(plain, "hi", True) == "too_short"
    assert screen.add(plain, "a long prompt cut off before its end", False) == "too_long"
    assert screen.add(steered, "hi", True) == "too_short"  # the topic's own words do not count towards min_chars
    assert screen.add(steered, "what is 2+2?", True) == "kept"
    assert screen.add(plain, "one more after the count", True) == "unused"
    assert [p["messages"][0]["content"] for p in screen.kept] == ["Hello   World", "maths: what is 2+2?"]
    assert screen.kept[1]["topic"] == "maths" and screen.kept[0]["id"] == synthetic.prompt_id("hello world")
    stats = screen.stats()
    assert stats == {"count": 2, "samples": 9, "kept": 2, "too_long": 1, "empty": 1, "too_short": 2, "duplicates": 2, "unused": 1}
    assert normalised("A\tB\n c") == "a b c"


# ---------------------------------------------------------------- the job


def test_the_same_seed_writes_the_same_file_and_another_seed_other_prompts(tmp_path):
    tokenizer = chatml_tokenizer()
    model = llama_over(tokenizer)
    stats, first = synthesize(tmp_path, tokenizer, model, "first", topics=["python", "sums"])
    _, again = synthesize(tmp_path, tokenizer, model, "again", topics=["python", "sums"])
    _, other = synthesize(tmp_path, tokenizer, model, "other", topics=["python", "sums"], seed=1)
    assert first.read_bytes() == again.read_bytes()
    assert prompts_of(first) != prompts_of(other)
    assert stats["kept"] == 3 == len(prompts_of(first)) and stats["samples"] == 8  # one batch was enough
    assert sum(stats[k] for k in ("kept", "too_long", "empty", "too_short", "duplicates", "unused")) == stats["samples"]
    assert verify(first) is not None  # the content digest is recorded
    meta = json.loads(pq.read_schema(first).metadata[b"eyrie"])
    assert meta["stats"] == stats and meta["end_of_turn"] == "<|im_end|>" and meta["user_prefix"] == user_prefix(tokenizer)
    assert {r["topic"] for r in pq.read_table(first).to_pylist()} <= {"python", "sums"}


def kill_after_two_batches(monkeypatch, tmp_path, tokenizer, model, name, settings):
    """A job killed as it starts its third batch, and the line the kill tore in its partial log: the log's path."""
    real, calls = synthetic.sample_batch, []

    def dies_after_two(*args, **kwargs):
        if len(calls) == 2:
            raise KeyboardInterrupt("killed")
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(synthetic, "sample_batch", dies_after_two)
    with pytest.raises(KeyboardInterrupt):
        synthesize(tmp_path, tokenizer, model, name, **settings)
    monkeypatch.setattr(synthetic, "sample_batch", real)
    log = next((tmp_path / f"partial-{name}").iterdir())
    with open(log, "ab") as handle:
        handle.write(b'{"batch": 2, "samp')  # a line torn by the kill
    return log


def test_a_run_killed_after_two_batches_resumes_to_what_one_uninterrupted_run_writes(tmp_path, monkeypatch):
    tokenizer = llama3_tokenizer()
    model = llama_over(tokenizer)
    settings = {"count": 40, "max_samples": 40, "batch_size": 8, "min_chars": 1}  # five batches, short of the count
    _, whole = synthesize(tmp_path, tokenizer, model, "whole", **settings)

    real, calls = synthetic.sample_batch, []
    kill_after_two_batches(monkeypatch, tmp_path, tokenizer, model, "resumed", settings)
    assert not (tmp_path / "resumed.parquet").exists()
    monkeypatch.setattr(synthetic, "sample_batch", lambda *a, **k: calls.append(1) or real(*a, **k))
    stats, resumed = synthesize(tmp_path, tokenizer, model, "resumed", **settings)
    assert len(calls) == 3 and stats["samples"] == 40  # batches 2, 3 and 4 drawn again, 0 and 1 read from the log
    assert resumed.read_bytes() == whole.read_bytes()


def test_progress_reads_a_partial_log_as_the_job_would_screen_it_without_touching_it(tmp_path, monkeypatch):
    """eyrie plan's view of a killed job: the batches it drew, what the screening keeps of them (as a job that stopped
    there writes), and seconds per batch; the torn line a kill leaves is not counted, nor cut off the file."""
    from eyrie.data.synthetic import progress

    tokenizer = chatml_tokenizer()
    model = llama_over(tokenizer)
    settings = {"count": 40, "max_samples": 40, "batch_size": 8, "min_chars": 1, "topics": ["python", "sums"]}
    two_batches, _ = synthesize(tmp_path, tokenizer, model, "two", **{**settings, "count": 16, "max_samples": 16})
    log = kill_after_two_batches(monkeypatch, tmp_path, tokenizer, model, "killed", settings)
    before = log.read_bytes()
    done = progress({**SETTINGS, **settings}, tokenizer, log)
    assert log.read_bytes() == before
    assert (done["batches"], done["samples"], done["kept"], done["full"]) == (2, 16, two_batches["kept"], False)
    assert done["seconds_per_batch"] > 0
    assert progress({**SETTINGS, **settings}, tokenizer, tmp_path / "none.jsonl") == {
        "batches": 0, "samples": 0, "kept": 0, "full": False, "seconds_per_batch": None}


def test_no_usable_sample_stops_with_the_counts_and_what_to_change(tmp_path):
    tokenizer = chatml_tokenizer()
    with pytest.raises(InputFileError, match=r"datasets.syn.source.synthetic: the target wrote no usable prompt in 8 samples.*raise max_tokens"):
        synthesize(tmp_path, tokenizer, llama_over(tokenizer), max_tokens=1, min_chars=1000, max_samples=8, count=1)


def test_the_prompts_job_reads_a_synthetic_file_and_reports_how_it_was_made(tmp_path):
    tokenizer = chatml_tokenizer()
    stats, made = synthesize(tmp_path, tokenizer, llama_over(tokenizer), count=6)
    spec = cfg.validate({"model": {"name": "m", "path": "model"},
                         "datasets": {"syn": {"source": {"synthetic": {"count": 6}}, "shards": 2, "heldout_fraction": 0.3}}})["datasets"]["syn"]
    out = tmp_path / "prompts"
    summary = build_prompts_for_dataset(dataset="syn", spec=spec, source_path=str(made), shard_paths=[str(out / "0000.parquet"), str(out / "0001.parquet")],
                                        heldout_path=str(out / "heldout.parquet"), summary_path=str(out / "summary.json"))
    assert summary["used"] == 6 == summary["train"] + summary["heldout"] and summary["format"] == "auto"
    assert summary["synthetic"]["kept"] == stats["kept"] and summary["synthetic"]["samples"] == stats["samples"]
    assert len(summary["synthetic"]["examples"]) == 5
    assert json.loads((out / "summary.json").read_text())["synthetic"] == summary["synthetic"]


# ---------------------------------------------------------------- config


def config_with(synthetic_source, **dataset):
    return {"model": {"name": "m", "path": "model"}, "datasets": {"gen": {"source": {"synthetic": synthetic_source}, **dataset}}}


def test_defaults_come_from_the_schema():
    source = cfg.validate(config_with({"count": 10}))["datasets"]["gen"]["source"]["synthetic"]
    defaults = {k: v["default"] for k, v in load_schema()["$defs"]["synthetic"]["properties"].items() if "default" in v}
    assert source == {"count": 10, **defaults}
    assert source["topics"] == [] and source["topic_as"] == "system" and source["temperature"] == 1.0


@pytest.mark.parametrize("source, extra, message", [
    ({}, {}, "datasets.gen.source.synthetic: 'count' is a required property"),
    ({"count": 5, "temperature": 0}, {}, "datasets.gen.source.synthetic.temperature: expected a value > 0"),
    ({"count": 5, "topic_template": "about code"}, {}, r"datasets.gen.source.synthetic.topic_template: expected text matching"),
    ({"count": 5, "topic_template": "{topic} and {other}"}, {}, r"datasets.gen.source.synthetic.topic_template: .* one \{topic\} field"),
    ({"count": 5, "max_samples": 4}, {}, "datasets.gen.source.synthetic.max_samples: 4 is below count 5"),
    ({"count": 5, "topic_as": "prefix"}, {}, r"datasets.gen.source.synthetic.topic_as: expected one of \['system', 'user_prefix'\]"),
    ({"count": 5, "topcs": ["x"]}, {}, "Additional properties are not allowed.*allowed keys here: batch_size, count"),
    ({"count": 5}, {"format": "sharegpt"}, "datasets.gen.format: a synthetic source is written in the openai shape"),
])
def test_bad_synthetic_settings_are_refused_naming_the_key(source, extra, message):
    with pytest.raises(ConfigError, match=message):
        cfg.validate(config_with(source, **extra))


def test_a_synthetic_dataset_plans_its_file_before_its_prompts():
    config = cfg.validate({**config_with({"count": 4}, shards=2), "bench": {"humaneval": None, "mtbench": None}})
    planned = planned_outputs(config)
    assert planned[0].path == "results/synthetic/gen.parquet" and planned[0].rule == "synthesize_prompts"
    prompts = [p for p in planned if p.rule == "build_prompts_gen"]
    assert len(prompts) == 4 and all(p.inputs == ("results/synthetic/gen.parquet",) for p in prompts)
