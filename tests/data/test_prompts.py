"""From raw records to prompt shards: normalisation, bad records, dedup, hold-out, sharding, limit."""

from __future__ import annotations

import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eyrie.core.errors import BadRecordError, InputFileError
from eyrie.data.prompts import PROMPT_SCHEMA, build_prompts, is_heldout, lost_shards, shard_of, stable_unit
from eyrie.data.sources import RawRecord, iter_file_records


def sharegpt(record_id, *turns):
    return {"id": record_id, "conversations": [{"from": role, "value": text} for role, text in turns]}


def openai(record_id, *turns):
    record = {"messages": [{"role": role, "content": text} for role, text in turns]}
    return record if record_id is None else {"id": record_id, **record}


def write_jsonl(path, lines: list[bytes | dict]) -> None:
    path.write_bytes(b"\n".join(line if isinstance(line, bytes) else json.dumps(line).encode() for line in lines))


def build(tmp_path, records, *, dataset="ds", n_shards=2, heldout_fraction=0.0, out="out", **options):
    """build_prompts into tmp_path/out; returns the summary."""
    directory = tmp_path / out
    return build_prompts(
        dataset=dataset,
        records=records,
        n_shards=n_shards,
        heldout_fraction=heldout_fraction,
        shard_paths=[directory / f"shard_{i:04d}.parquet" for i in range(n_shards)],
        heldout_path=directory / "heldout.parquet",
        summary_path=directory / "summary.json",
        **options,
    )


def read_prompts(tmp_path, out="out", n_shards=2) -> dict[str, list]:
    """All written prompt rows by file name."""
    names = [f"shard_{i:04d}.parquet" for i in range(n_shards)] + ["heldout.parquet"]
    return {name: pq.read_table(tmp_path / out / name).to_pylist() for name in names}


def all_rows(tmp_path, out="out", n_shards=2) -> dict[str, dict]:
    return {row["id"]: row for rows in read_prompts(tmp_path, out, n_shards).values() for row in rows}


# ---------------------------------------------------------------- shapes and files


def test_roles_are_mapped_and_only_system_and_user_turns_are_kept(tmp_path):
    path = tmp_path / "data.jsonl"
    write_jsonl(path, [
        sharegpt("s", ("system", "be kind"), ("human", "q1"), ("gpt", "a1"), ("user", "q2"), ("chatgpt", "a2"),
                 ("Human", "q3"), ("bing", "a3"), ("bard", "a4"), ("model", "a5"), ("assistant", "a6")),
        openai("o", ("user", "hello"), ("assistant", "hi"), ("user", "again")),
    ])
    summary = build(tmp_path, iter_file_records(path))
    rows = all_rows(tmp_path)
    assert rows["s"]["messages"] == [
        {"role": "system", "content": "be kind"}, {"role": "user", "content": "q1"},
        {"role": "user", "content": "q2"}, {"role": "user", "content": "q3"},
    ]
    assert rows["s"]["n_user_turns"] == 3 and rows["s"]["dataset"] == "ds"
    assert rows["o"]["messages"] == [{"role": "user", "content": "hello"}, {"role": "user", "content": "again"}]
    assert summary["roles_seen"] == {"human": 1, "gpt": 1, "user": 3, "chatgpt": 1, "system": 1, "Human": 1, "bing": 1,
                                     "bard": 1, "model": 1, "assistant": 2}


def test_kept_replies_follow_their_user_turns_and_the_conversation_ends_at_the_first_unanswered_one(tmp_path):
    path = tmp_path / "data.jsonl"
    write_jsonl(path, [
        sharegpt("s", ("system", "be kind"), ("human", "q1"), ("gpt", "a1"), ("human", " "), ("gpt", "a2"),
                 ("human", "q3"), ("human", "q4"), ("gpt", "a4")),
        openai("o", ("user", "hello"), ("assistant", "hi"), ("user", "again")),
    ])
    summary = build(tmp_path, iter_file_records(path), keep_replies=True)
    rows = all_rows(tmp_path)
    # a2 answers an empty user turn (dropped), so it is no reply; q3 has none, so the conversation ends before it
    assert rows["s"]["messages"] == [
        {"role": "system", "content": "be kind"}, {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
    ]
    assert rows["o"]["messages"] == [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    assert summary["replies"] == "source"


def test_kept_replies_leave_ids_alone_and_a_record_without_any_is_a_bad_record(tmp_path):
    records = [
        RawRecord("line 1", openai(None, ("user", "same"), ("assistant", "an answer"))),
        RawRecord("line 2", openai(None, ("user", "unanswered"), ("assistant", " "), ("user", "again"), ("assistant", "late"))),
    ]
    with pytest.raises(BadRecordError, match=r"line 2, field 'messages': no user turn with text is followed by an assistant reply"):
        build(tmp_path, records, keep_replies=True)
    summary = build(tmp_path, records, keep_replies=True, on_bad_record="skip")
    assert summary["bad_records"] == {"no_source_reply": 1} and summary["used"] == 1
    build(tmp_path, records[:1], out="prompts_only")
    assert sorted(all_rows(tmp_path)) == sorted(all_rows(tmp_path, "prompts_only"))  # the derived id reads the prompt
    assert "replies" not in json.loads((tmp_path / "prompts_only" / "summary.json").read_text())


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
@pytest.mark.parametrize("shape", ["sharegpt", "openai"])
def test_each_file_type_in_each_shape_gives_the_same_prompts(tmp_path, suffix, shape):
    make = sharegpt if shape == "sharegpt" else openai
    user, assistant = ("human", "gpt") if shape == "sharegpt" else ("user", "assistant")
    records = [make(f"r{i}", (user, f"question {i} ✓"), (assistant, "answer")) for i in range(5)]
    path = tmp_path / f"data{suffix}"
    if suffix == ".jsonl":
        write_jsonl(path, records)
    elif suffix == ".json":
        path.write_text(json.dumps(records, indent=2))
    else:
        pq.write_table(pa.Table.from_pylist(records), path)
    summary = build(tmp_path, iter_file_records(path), fmt=shape)
    assert summary["usable"] == summary["train"] == 5 and summary["source"] == str(path)
    rows = all_rows(tmp_path)
    assert {i: rows[i]["messages"] for i in rows} == {
        f"r{i}": [{"role": "user", "content": f"question {i} ✓"}] for i in range(5)
    }
    assert pq.read_schema(tmp_path / "out" / "shard_0000.parquet").remove_metadata() == PROMPT_SCHEMA


def test_written_files_match_schema_sorted_by_id_and_empty_shards_exist(tmp_path):
    records = [RawRecord(f"line {i}", sharegpt(name, ("human", name))) for i, name in enumerate(["c", "a", "b"])]
    summary = build(tmp_path, records, n_shards=8)
    for name, rows in read_prompts(tmp_path, n_shards=8).items():
        table = pq.read_table(tmp_path / "out" / name)
        assert table.schema.remove_metadata() == PROMPT_SCHEMA
        assert [row["id"] for row in rows] == sorted(row["id"] for row in rows)
    assert sum(summary["shards"].values()) == 3 and list(summary["shards"]) == [f"{i:04d}" for i in range(8)]
    assert 0 in summary["shards"].values()  # three records cannot fill eight shards
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        [f"shard_{i:04d}.parquet" for i in range(8)] + ["heldout.parquet", "summary.json"]
    )  # and no temporary file is left behind
    assert json.loads((tmp_path / "out" / "summary.json").read_text()) == summary


def test_a_shard_is_lost_only_once_the_summary_says_the_prompts_were_written(tmp_path):
    """What the Snakefile declares as the prompts job's outputs: nothing before it ran (or after a kill, which leaves no
    summary), every shard gone since it finished."""
    shards = [str(tmp_path / "out" / f"shard_{i:04d}.parquet") for i in range(2)]
    summary = tmp_path / "out" / "summary.json"
    assert lost_shards(summary, shards) == []
    build(tmp_path, [RawRecord(f"line {i}", sharegpt(name, ("human", name))) for i, name in enumerate("abcdef")])
    assert lost_shards(summary, shards) == []
    (tmp_path / "out" / "shard_0001.parquet").unlink()
    assert lost_shards(summary, shards) == [shards[1]]


def test_a_rebuild_leaves_unchanged_shards_as_they_were_and_rewrites_damaged_or_changed_ones(tmp_path):
    """The prompts job reruns over its old shards (the Snakefile declares them only once lost): one that holds what the
    rebuild would write keeps its bytes and its time, so nothing made from it looks stale; any other is replaced."""
    import os

    records = [RawRecord(f"line {i}", sharegpt(name, ("human", name))) for i, name in enumerate("abcdefgh")]
    build(tmp_path, records, n_shards=3)
    shards = [tmp_path / "out" / f"shard_{i:04d}.parquet" for i in range(3)]
    for shard in shards:
        os.utime(shard, (1_700_000_000, 1_700_000_000))
    damaged = bytearray(shards[1].read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    shards[1].write_bytes(bytes(damaged))
    os.utime(shards[1], (1_700_000_000, 1_700_000_000))
    moved = next(r.data["id"] for r in records if shard_of(r.data["id"], 3) == 2)

    build(tmp_path, [r for r in records if r.data["id"] != moved], n_shards=3)
    assert shards[0].stat().st_mtime == 1_700_000_000  # unchanged
    assert shards[1].stat().st_mtime > 1_700_000_000 and shards[1].read_bytes() != bytes(damaged)  # repaired
    assert shards[2].stat().st_mtime > 1_700_000_000  # lost a record
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted([s.name for s in shards] + ["heldout.parquet", "summary.json"])


def test_summary_has_every_key(tmp_path):
    summary = build(tmp_path, [RawRecord("line 1", sharegpt("a", ("human", "x")))])
    assert list(summary) == ["dataset", "source", "format", "records_read", "bad_records", "bad_examples", "duplicates", "repeated_first_turns",
                             "usable", "limit", "used", "heldout", "train", "shards", "truncation", "roles_seen", "eyrie_digest"]
    assert summary["truncation"] is None and summary["source"] == "<records>"


def test_repeated_first_turns_keep_their_first_record_when_asked(tmp_path):
    """Greedy targets answer one first turn alike: only the first record of each (whitespace and case folded) is kept,
    later turns and the assistant's old replies notwithstanding; a system turn makes another first turn."""
    records = [
        RawRecord("line 1", sharegpt("a", ("human", "Continue"), ("gpt", "x"), ("human", "more"))),
        RawRecord("line 2", sharegpt("b", ("human", "  continue "), ("gpt", "y"), ("human", "other"))),
        RawRecord("line 3", sharegpt("c", ("system", "Be terse."), ("human", "continue"))),
        RawRecord("line 4", sharegpt("d", ("human", "something else"))),
    ]
    kept = build(tmp_path, records, out="on", dedupe_first_turn=True)
    assert kept["repeated_first_turns"] == 1 and kept["usable"] == 3
    ids = {row["id"] for path in (tmp_path / "on").glob("*.parquet") for row in pq.read_table(path).to_pylist()}
    assert ids == {"a", "c", "d"}
    every = build(tmp_path, records, out="off")
    assert every["repeated_first_turns"] is None and every["usable"] == 4


# ---------------------------------------------------------------- ids


def test_missing_id_is_derived_from_the_prompt_and_numbers_become_strings(tmp_path):
    records = [
        RawRecord("line 1", openai(None, ("user", "same"), ("assistant", "one answer"))),
        RawRecord("line 2", openai(None, ("user", "same"), ("assistant", "another answer"))),
        RawRecord("line 3", openai(None, ("user", "different"))),
        RawRecord("line 4", openai(42, ("user", "numbered"))),
    ]
    summary = build(tmp_path, records)
    ids = sorted(all_rows(tmp_path))
    assert summary["duplicates"] == 1  # the same prompt gives the same derived id, whatever the answers were
    assert "42" in ids
    derived = [i for i in ids if i != "42"]
    assert len(derived) == 2 and all(i.startswith("sha1:") and len(i) == len("sha1:") + 16 for i in derived)
    build(tmp_path, records, out="again")
    assert sorted(all_rows(tmp_path, "again")) == ids


def test_duplicates_keep_the_first_and_are_counted(tmp_path):
    records = [RawRecord(f"line {i}", sharegpt("same", ("human", text))) for i, text in enumerate(["first", "second", "third"])]
    summary = build(tmp_path, records + [RawRecord("line 9", sharegpt("other", ("human", "x")))])
    assert summary["duplicates"] == 2 and summary["usable"] == 2
    assert all_rows(tmp_path)["same"]["messages"] == [{"role": "user", "content": "first"}]


def test_empty_user_turns_are_dropped(tmp_path):
    build(tmp_path, [RawRecord("line 1", sharegpt("a", ("human", " \n"), ("gpt", "?"), ("human", "  real  ")))])
    row = all_rows(tmp_path)["a"]
    assert row["messages"] == [{"role": "user", "content": "  real  "}] and row["n_user_turns"] == 1


# ---------------------------------------------------------------- bad records

GOOD = sharegpt("good", ("human", "fine"))
BAD_LINES = {  # kind: (the bad JSONL line, the field the error must name, the id it must name)
    "malformed_json": (b'{"id": "m", "conversations": [', None, None),
    "no_user_turn": (json.dumps(sharegpt("n", ("gpt", "only an answer"), ("human", ""))).encode(), "conversations", "n"),
    "non_string_content": (json.dumps(openai("c", ("user", "q"), ("assistant", "a"), ("user", 5))).encode(),
                           "messages[2].content", "c"),
    "unknown_role": (json.dumps(sharegpt("r", ("human", "q"), ("gpt", "a"), ("human", "q"), ("robot", "beep"))).encode(),
                     "conversations[3].from", "r"),
    "invalid_utf8": (b'{"id": "u", "conversations": [{"from": "human", "value": "caf\xe9"}]}',
                     "conversations[0].value", "u"),
    "misplaced_system": (json.dumps(sharegpt("s", ("human", "q"), ("system", "late"))).encode(), "conversations[1]", "s"),
    "not_an_object": (b'["a", "list"]', None, None),
}


@pytest.mark.parametrize("kind", sorted(BAD_LINES))
def test_bad_record_in_error_mode_names_file_line_id_and_field(tmp_path, kind):
    line, field, record_id = BAD_LINES[kind]
    path = tmp_path / "data.jsonl"
    write_jsonl(path, [GOOD, line, GOOD])
    with pytest.raises(BadRecordError) as raised:
        build(tmp_path, iter_file_records(path), on_bad_record="error")
    message = str(raised.value)
    assert message.startswith(f"{path}: line 2")
    assert raised.value.kind == kind and raised.value.field == field
    if field is not None:
        assert f"field {field!r}" in message
    if record_id is not None:
        assert f"record id {record_id!r}" in message


@pytest.mark.parametrize("kind", sorted(BAD_LINES))
def test_bad_record_in_skip_mode_is_counted(tmp_path, kind):
    path = tmp_path / "data.jsonl"
    write_jsonl(path, [GOOD, BAD_LINES[kind][0], sharegpt("good2", ("human", "fine"))])
    summary = build(tmp_path, iter_file_records(path), on_bad_record="skip")
    assert summary["bad_records"] == {kind: 1}
    assert summary["records_read"] == 3 and summary["usable"] == 2
    assert len(summary["bad_examples"]) == 1 and "line 2" in summary["bad_examples"][0]


def test_skip_mode_counts_every_kind_and_keeps_five_examples(tmp_path):
    path = tmp_path / "data.jsonl"
    write_jsonl(path, [GOOD] + [line for line, _, _ in BAD_LINES.values()] * 2)
    summary = build(tmp_path, iter_file_records(path), on_bad_record="skip")
    assert summary["bad_records"] == {kind: 2 for kind in sorted(BAD_LINES)}
    assert len(summary["bad_examples"]) == 5 and summary["usable"] == 1


def test_bad_record_in_a_json_array_names_the_record(tmp_path):
    path = tmp_path / "data.json"
    text = json.dumps([GOOD, openai("x", ("user", "q"), ("user", None))], indent=2)
    path.write_text(text)
    start = text.index('{\n    "id": "x"')
    where = f"record 1 \\(byte {start}, line {text[:start].count(chr(10)) + 1}\\)"
    with pytest.raises(BadRecordError, match=rf"data\.json: {where}, record id 'x', field 'messages\[1\]\.content'"):
        build(tmp_path, iter_file_records(path))


def test_no_usable_records_is_an_input_file_error(tmp_path):
    path = tmp_path / "data.jsonl"
    write_jsonl(path, [BAD_LINES["no_user_turn"][0], BAD_LINES["malformed_json"][0]])
    with pytest.raises(InputFileError, match=r"data\.jsonl: no usable records .*'no_user_turn': 1.*'malformed_json': 1"):
        build(tmp_path, iter_file_records(path), on_bad_record="skip")


@pytest.mark.parametrize("on_bad_record", ["error", "skip"])
def test_empty_file_is_an_input_file_error_in_both_modes(tmp_path, on_bad_record):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"\n \n")
    with pytest.raises(InputFileError, match=r"data\.jsonl: input file is empty"):
        build(tmp_path, iter_file_records(path), on_bad_record=on_bad_record)


def test_truncated_json_array_is_reported_in_the_summary(tmp_path):
    path = tmp_path / "cut.json"
    text = json.dumps([GOOD, sharegpt("second", ("human", "x")), sharegpt("third", ("human", "y"))], indent=2)
    start_of_third = text.index('{\n    "id": "third"')
    path.write_text(text[: start_of_third + 40])
    summary = build(tmp_path, iter_file_records(path))
    assert summary["usable"] == 2
    assert summary["truncation"] == {"byte_offset": start_of_third, "line": text[:start_of_third].count("\n") + 1,
                                     "records_before": 2}


# ---------------------------------------------------------------- hold-out, shards, limit


def test_assignment_is_a_pure_function_of_the_id():
    assert shard_of("abc", 7) == shard_of("abc", 7) and 0 <= shard_of("abc", 7) < 7
    assert is_heldout("ds", "abc", 1.0) and not is_heldout("ds", "abc", 0.0)
    assert is_heldout("ds", "abc", 0.3) == (stable_unit("ds:holdout:abc") < 0.3)
    units = [stable_unit(f"k{i}") for i in range(2000)]
    assert all(0 <= u < 1 for u in units) and 0.45 < sum(units) / len(units) < 0.55
    shards = [shard_of(f"id{i}", 4) for i in range(2000)]
    assert all(350 < shards.count(s) < 650 for s in range(4))
    held = sum(is_heldout("ds", f"id{i}", 0.1) for i in range(2000))
    assert 140 < held < 260


def test_shuffled_input_writes_identical_files_and_other_records_do_not_move_a_record(tmp_path):
    records = [RawRecord(f"line {i}", sharegpt(f"id{i}", ("human", f"q{i}"))) for i in range(60)]
    shuffled = random.Random(3).sample(records, len(records))
    options = dict(n_shards=3, heldout_fraction=0.2)
    first = build(tmp_path, records, out="ordered", **options)
    second = build(tmp_path, shuffled, out="shuffled", **options)
    names = [f"shard_{i:04d}.parquet" for i in range(3)] + ["heldout.parquet"]
    for name in names:
        assert (tmp_path / "ordered" / name).read_bytes() == (tmp_path / "shuffled" / name).read_bytes()
    assert first["shards"] == second["shards"] and 0 < first["heldout"] < 60
    # half of the records, alone: each still lands where it did
    build(tmp_path, records[::2], out="half", **options)
    where = {out: {row["id"]: name for name, rows in read_prompts(tmp_path, out, 3).items() for row in rows}
             for out in ("ordered", "half")}
    assert all(where["ordered"][record_id] == name for record_id, name in where["half"].items())


def test_limit_keeps_the_first_usable_records_in_file_order_and_still_counts_all(tmp_path):
    path = tmp_path / "data.jsonl"
    lines = [BAD_LINES["unknown_role"][0], sharegpt("z", ("human", "1")), sharegpt("z", ("human", "dup")),
             sharegpt("y", ("human", "2")), sharegpt("x", ("human", "3")), sharegpt("w", ("human", "4"))]
    write_jsonl(path, lines)
    summary = build(tmp_path, iter_file_records(path), limit=2, on_bad_record="skip")
    assert sorted(all_rows(tmp_path)) == ["y", "z"]
    assert (summary["records_read"], summary["usable"], summary["used"], summary["limit"]) == (6, 4, 2, 2)
    assert summary["duplicates"] == 1 and summary["bad_records"] == {"unknown_role": 1}
    assert summary["heldout"] + summary["train"] == 2


def test_invalid_arguments_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="one path per shard"):
        build_prompts(dataset="d", records=[], n_shards=2, heldout_fraction=0, shard_paths=[tmp_path / "a"],
                      heldout_path=tmp_path / "h", summary_path=tmp_path / "s")
    with pytest.raises(ValueError, match="format"):
        build(tmp_path, [], fmt="alpaca")


# ---------------------------------------------------------------- reasoning and tool-calling data

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def agentic_record(record_id="a", **changes):
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}]},
        {"role": "user", "content": "Weather in Oslo and Bergen?"},
        {"role": "assistant", "content": None, "reasoning_content": "Call twice.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Bergen"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
        {"role": "tool", "tool_call_id": "c2", "content": "sun"},
        {"role": "assistant", "content": "Rain, then sun.", "thinking": "Both are in."},
    ]
    record = {"id": record_id, "messages": messages, "tools": TOOLS}
    for path, value in changes.items():
        index, key = path.split(".", 1) if "." in path else (None, path)
        target = record if index is None else record["messages"][int(index)]
        target[key] = value
    return record


@pytest.mark.parametrize("replies", ["target", "source"])
def test_openai_agentic_records_keep_tools_calls_results_and_reasoning_and_the_summary_counts_each_kind(tmp_path, replies):
    summary = build(tmp_path, [RawRecord("line 1", agentic_record())], n_shards=1, keep_replies=replies == "source")
    (row,) = [r for rows in read_prompts(tmp_path, n_shards=1).values() for r in rows]
    messages = row["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool", "assistant"]
    assert messages[0]["content"] == "Be\nbrief."  # text parts joined; developer read as the system turn
    calls = json.loads(messages[2]["tool_calls"])
    assert [c["function"]["arguments"] for c in calls] == [{"city": "Oslo"}, {"city": "Bergen"}]  # JSON text and objects alike
    assert messages[2]["content"] == "" and messages[2]["reasoning_content"] == "Call twice."
    assert messages[3]["tool_call_id"] == "c1" and messages[5]["reasoning_content"] == "Both are in."  # the thinking alias
    assert json.loads(row["tools"]) == TOOLS
    assert summary["agentic"] == {"messages_with_reasoning": 2, "messages_with_tool_calls": 1, "tool_calls": 2,
                                  "tool_results": 2, "records_with_tools": 1}


def test_plain_chat_data_is_written_as_before_without_the_agentic_fields(tmp_path):
    summary = build(tmp_path, [RawRecord("line 1", openai("p", ("user", "hi")))], n_shards=1)
    schema = pq.read_schema(tmp_path / "out" / "shard_0000.parquet")
    assert schema.remove_metadata().equals(PROMPT_SCHEMA) and "agentic" not in summary


def test_sharegpt_function_call_and_observation_turns_are_tool_calls_and_results(tmp_path):
    record = {"id": "g", "tools": json.dumps(TOOLS), "conversations": [
        {"from": "human", "value": "Weather in Oslo?"},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Oslo"}})},
        {"from": "observation", "value": "rain"},
        {"from": "gpt", "value": "Rain."}]}
    build(tmp_path, [RawRecord("line 1", record)], n_shards=1)
    (row,) = read_prompts(tmp_path, n_shards=1)["shard_0000.parquet"]
    assert [m["role"] for m in row["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert json.loads(row["messages"][1]["tool_calls"])[0]["function"] == {"name": "get_weather", "arguments": {"city": "Oslo"}}
    assert json.loads(row["tools"]) == TOOLS


@pytest.mark.parametrize(("changes", "kind", "field"), [
    ({"0.content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "unsupported_content_part", "messages[0].content[0]"),
    ({"2.tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{not json"}}]}, "bad_tool_call",
     "messages[2].tool_calls[0].function.arguments"),
    ({"2.tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]}, "bad_tool_call", "messages[2].tool_calls[0].function.name"),
    ({"3.tool_call_id": "c9"}, "unknown_tool_call_id", "messages[3].tool_call_id"),
    ({"1.reasoning_content": "x"}, "bad_reasoning", "messages[1].reasoning_content"),
    ({"tools": {"not": "a list"}}, "bad_tools", "tools"),
])
def test_bad_agentic_fields_are_named_by_file_record_and_field(tmp_path, changes, kind, field):
    with pytest.raises(BadRecordError) as caught:
        build(tmp_path, [RawRecord("line 7", agentic_record("bad", **changes))], n_shards=1, source_label="data/agentic.jsonl")
    text = str(caught.value)
    assert caught.value.kind == kind and "data/agentic.jsonl" in text and "line 7" in text and "bad" in text and field in text


def test_a_tool_result_without_a_call_before_it_is_a_bad_record(tmp_path):
    record = {"id": "t", "messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "rain"}]}
    summary = build(tmp_path, [RawRecord("line 1", record), RawRecord("line 2", openai("ok", ("user", "hi")))], n_shards=1,
                    on_bad_record="skip")
    assert summary["bad_records"] == {"misplaced_tool_result": 1}
