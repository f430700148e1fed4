"""Regeneration with the real default model: batching, multi-turn, resume after a crash."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eyrie.core.batching import batches_by_tokens
from eyrie.generation.conversations import PROMPT_TOO_LONG, settings_key
from eyrie.generation.partial import PartialLog
from eyrie.generation.regenerate import regenerate_shard
from eyrie.generation.transformers_engine import TransformersEngine

SETTINGS = {"max_new_tokens": 10, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_turns": 2, "max_prompt_tokens": 200, "seed": 0}
ENGINE = {"max_batch_tokens": 2048, "max_batch_size": 2}


def test_batches_respect_the_token_budget():
    lengths = [5, 300, 40, 41, 12, 700, 3]
    batches = batches_by_tokens(lengths, 900, extra=100, max_size=3)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for batch in batches:
        assert len(batch) <= 3
        assert len(batch) == 1 or len(batch) * (max(lengths[i] for i in batch) + 100) <= 900


@pytest.fixture(scope="module")
def engine(model_dir):
    import torch

    torch.set_num_threads(2)
    return TransformersEngine(str(model_dir))


def write_prompts(path, prompts):
    rows = [{"id": pid, "dataset": "t", "messages": msgs, "n_user_turns": sum(m["role"] == "user" for m in msgs)} for pid, msgs in prompts]
    pq.write_table(pa.Table.from_pylist(rows), path)


PROMPTS = [
    ("a", [{"role": "user", "content": "Name a fruit."}, {"role": "user", "content": "And a vegetable?"}]),
    ("b", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3+4?"}]),
    ("c", [{"role": "user", "content": "word " * 300}]),
    ("d", [{"role": "user", "content": "Say yes."}, {"role": "user", "content": "x " * 300}, {"role": "user", "content": "never asked"}]),
    ("e", [{"role": "user", "content": "Say no."}]),
]


def run(tmp_path, engine, out_name="c.parquet"):
    return regenerate_shard(
        prompts_path=str(tmp_path / "p.parquet"),
        out_path=str(tmp_path / out_name),
        partial_dir=str(tmp_path / "partial"),
        dataset="t",
        shard="0000",
        settings=SETTINGS,
        engine_settings=ENGINE,
        engine=engine,
        model_fingerprint="fp",
        template_sha256="tpl",
    )


class CrashAfter:
    """The real engine, which dies after n batches, as a killed job would."""

    def __init__(self, engine, batches):
        self.engine, self.left = engine, batches

    def prompt_ids(self, messages):
        return self.engine.prompt_ids(messages)

    def generate(self, prompts, settings):
        if self.left == 0:
            raise KeyboardInterrupt("killed")
        self.left -= 1
        return self.engine.generate(prompts, settings)


def test_multi_turn_and_prompt_too_long(tmp_path, engine):
    write_prompts(tmp_path / "p.parquet", PROMPTS)
    stats = run(tmp_path, engine)
    records = {r["id"]: r for r in pq.read_table(tmp_path / "c.parquet").to_pylist()}
    assert [m["role"] for m in records["a"]["messages"]] == ["user", "assistant", "user", "assistant"]
    assert records["a"]["messages"][2]["content"] == "And a vegetable?"
    assert json.loads(records["a"]["generation"]) == SETTINGS  # each record keeps the settings that made it
    assert records["b"]["messages"][0] == {"role": "system", "content": "Be brief."}
    assert records["c"]["finish_reasons"] == [PROMPT_TOO_LONG] and records["c"]["n_turns"] == 0
    # d: the too-long second turn ends the conversation; its first answer is kept.
    assert records["d"]["finish_reasons"][-1] == PROMPT_TOO_LONG and records["d"]["n_turns"] == 1
    assert stats["finish_reasons"][PROMPT_TOO_LONG] == 2
    for record in records.values():
        for reason, tokens in zip(record["finish_reasons"], record["completion_tokens"]):
            assert reason in ("stop", "length", PROMPT_TOO_LONG)
            assert tokens <= SETTINGS["max_new_tokens"]
            assert (reason == "length") == (tokens == SETTINGS["max_new_tokens"] and reason != "stop")
    meta = json.loads(pq.read_schema(tmp_path / "c.parquet").metadata[b"eyrie"])
    assert meta["settings"] == SETTINGS and meta["template_sha256"] == "tpl"


def test_crash_then_rerun_reuses_finished_turns_and_matches_a_clean_run(tmp_path, engine):
    write_prompts(tmp_path / "p.parquet", PROMPTS)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, CrashAfter(engine, batches=2))
    assert not (tmp_path / "c.parquet").exists()
    log = PartialLog(tmp_path / "partial" / f"{settings_key(SETTINGS, 'fp')}.jsonl")
    finished = log.load()
    assert len(finished) >= 4  # two batches of two, plus the too-long prompt rows

    # A kill can tear the last line; it must be dropped, not crash the rerun.
    with open(log.path, "a") as f:
        f.write('{"id": "a", "tur')
    stats = run(tmp_path, engine)
    assert stats["resumed_turns"] == len(finished)
    resumed = pq.read_table(tmp_path / "c.parquet").to_pylist()
    assert sorted(r["id"] for r in resumed) == sorted(pid for pid, _ in PROMPTS)

    clean_dir = tmp_path / "clean"
    clean_dir.mkdir()
    write_prompts(clean_dir / "p.parquet", PROMPTS)
    run(clean_dir, engine)
    clean = pq.read_table(clean_dir / "c.parquet").to_pylist()
    assert [r["messages"] for r in resumed] == [r["messages"] for r in clean]


def test_an_answered_shard_is_written_from_its_log_without_an_engine(tmp_path, engine):
    """A shard whose turns are all in its resume log (killed while writing, or logs copied from another machine) opens no engine."""
    from eyrie.generation.regenerate import shard_answered

    write_prompts(tmp_path / "p.parquet", PROMPTS)
    answered = lambda: shard_answered(str(tmp_path / "p.parquet"), str(tmp_path / "partial"), SETTINGS, "fp")  # noqa: E731
    assert not answered()
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, CrashAfter(engine, batches=1))
    assert not answered()
    with pytest.raises(ValueError, match="no engine was opened"):
        run(tmp_path, None)
    run(tmp_path, engine, out_name="first.parquet")
    assert answered()
    assert not shard_answered(str(tmp_path / "p.parquet"), str(tmp_path / "partial"), {**SETTINGS, "max_new_tokens": 11}, "fp")

    stats = run(tmp_path, None)
    assert stats["resumed_turns"] == stats["turns"] and stats["run"]["engine"] is None
    first, second = (pq.read_table(tmp_path / name).to_pylist() for name in ("first.parquet", "c.parquet"))
    assert first == second


def test_changed_settings_do_not_reuse_old_turns(tmp_path, engine):
    assert settings_key(SETTINGS, "fp") != settings_key({**SETTINGS, "max_new_tokens": 11}, "fp")
    assert settings_key(SETTINGS, "fp") != settings_key(SETTINGS, "other model")


def test_static_batching_gives_the_padded_engines_greedy_turns(engine):
    """eyrie's static-cache loop answers exactly as transformers' padded generate(), in fp32, and reuses its cache."""
    prompts = [engine.prompt_ids([{"role": "user", "content": text}]) for text in ("Name a fruit.", "What is 3+4? Explain.", "Say no.")]
    settings = {**SETTINGS, "max_new_tokens": 12}
    padded = engine.generate(prompts, settings)
    engine.batching = "static"
    try:
        static = engine.generate(prompts, settings)
        again = engine.generate(prompts[1:], {**settings, "max_new_tokens": 20})  # fewer rows, a bigger budget: regrown
        sampled = engine.generate(prompts[:1], {**settings, "temperature": 0.7, "top_p": 0.9, "top_k": 0, "seed": 1})
    finally:
        engine.batching = "padded"
    assert engine.static is not None and engine.fallback is not None and "sampling" in engine.fallback
    as_tuples = lambda turns: [(t.reply, t.finish_reason, t.completion_tokens, t.prompt_tokens) for t in turns]  # noqa: E731
    assert as_tuples(static) == as_tuples(padded)
    assert as_tuples(again) == as_tuples(engine.generate(prompts[1:], {**settings, "max_new_tokens": 20}))
    assert sampled[0].completion_tokens > 0


def test_continuous_batching_gives_the_padded_engines_greedy_turns(engine):
    """transformers' continuous batching answers exactly as padded batches do, in fp32."""
    prompts = [engine.prompt_ids([{"role": "user", "content": text}]) for text in ("Name a fruit.", "What is 3+4? Explain.", "Say no.")]
    settings = {**SETTINGS, "max_new_tokens": 12}
    padded = engine.generate(prompts, settings)
    assert engine.batching == "padded"
    engine.batching = "continuous"
    try:
        continuous = engine.generate(prompts, settings)
    finally:
        engine.batching = "padded"
    assert [t.reply for t in continuous] == [t.reply for t in padded]
    assert [(t.finish_reason, t.completion_tokens, t.prompt_tokens) for t in continuous] == [
        (t.finish_reason, t.completion_tokens, t.prompt_tokens) for t in padded
    ]
