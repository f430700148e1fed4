"""A dataset that keeps its source's replies: the regenerate job answers each turn with them, through the same shard
files and resume log as a generating engine."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eyrie.generation.conversations import PROMPT_TOO_LONG, settings_key
from eyrie.generation.partial import PartialLog
from eyrie.generation.regenerate import regenerate_shard
from eyrie.generation.source_replies import SourceReplies, SourceRepliesError

SETTINGS = {"max_new_tokens": 12, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_turns": 2, "max_prompt_tokens": 120,
            "seed": 0, "replies": "source"}
LONG_REPLY = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen"
PROMPTS = [
    ("a", [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "A pear."},
           {"role": "user", "content": "Count."}, {"role": "assistant", "content": LONG_REPLY},
           {"role": "user", "content": "past max_turns"}, {"role": "assistant", "content": "never read"}]),
    ("b", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3+4?"}, {"role": "assistant", "content": "7"},
           {"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "too late"}]),
]


def write_prompts(path, prompts):
    rows = [{"id": pid, "dataset": "t", "messages": msgs, "n_user_turns": sum(m["role"] == "user" for m in msgs)} for pid, msgs in prompts]
    pq.write_table(pa.Table.from_pylist(rows), path)


def run(tmp_path, tokenizer, prompts_path, out="out.parquet"):
    return regenerate_shard(
        prompts_path=str(prompts_path), out_path=str(tmp_path / out), partial_dir=str(tmp_path / "partial"), dataset="t",
        shard="0000", settings=SETTINGS, engine_settings={}, engine=SourceReplies(tokenizer), model_fingerprint="m",
        template_sha256="t",
    )


def test_each_turn_is_the_source_reply_cut_to_max_new_tokens_and_long_prompts_end_the_conversation(tmp_path, tokenizer):
    write_prompts(tmp_path / "p.parquet", PROMPTS)
    stats = run(tmp_path, tokenizer, tmp_path / "p.parquet")
    records = {r["id"]: r for r in pq.read_table(tmp_path / "out.parquet").to_pylist()}

    a = records["a"]
    assert [m["role"] for m in a["messages"]] == ["user", "assistant", "user", "assistant"]  # max_turns 2
    assert a["messages"][1]["content"] == "A pear." and a["finish_reasons"] == ["stop", "length"]
    cut = a["messages"][3]["content"]
    assert LONG_REPLY.startswith(cut) and cut != LONG_REPLY
    assert a["completion_tokens"][1] == 12 == len(tokenizer(cut, add_special_tokens=False)["input_ids"])
    assert a["completion_tokens"][0] == len(tokenizer("A pear.", add_special_tokens=False)["input_ids"])

    b = records["b"]
    assert b["finish_reasons"] == ["stop", PROMPT_TOO_LONG] and b["n_turns"] == 1
    assert [m["content"] for m in b["messages"]] == ["Be brief.", "What is 3+4?", "7"]
    assert stats["turns"] == 4 and stats["tokens_per_second"] is None and stats["run"]["engine"] == "source"


def test_a_rerun_reuses_the_log_and_writes_the_same_records(tmp_path, tokenizer):
    write_prompts(tmp_path / "p.parquet", PROMPTS)
    run(tmp_path, tokenizer, tmp_path / "p.parquet")
    log = PartialLog(tmp_path / "partial" / f"{settings_key(SETTINGS, 'm')}.jsonl")
    assert len(log.load()) == 4
    stats = run(tmp_path, tokenizer, tmp_path / "p.parquet", out="again.parquet")
    assert stats["resumed_turns"] == 4
    assert pq.read_table(tmp_path / "again.parquet").to_pylist() == pq.read_table(tmp_path / "out.parquet").to_pylist()


def test_prompts_built_without_their_replies_are_refused_naming_the_prompt(tmp_path, tokenizer):
    write_prompts(tmp_path / "p.parquet", [("q", [{"role": "user", "content": "no reply kept"}])])
    with pytest.raises(SourceRepliesError, match="prompt 'q'.*replies: source"):
        run(tmp_path, tokenizer, tmp_path / "p.parquet")
