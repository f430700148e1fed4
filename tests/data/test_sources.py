"""Reading raw records: JSONL, JSON arrays (also cut-off ones), Parquet and Hugging Face datasets."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eyrie.core.errors import InputFileError
from eyrie.data.sources import RawRecord, iter_file_records, iter_hf_records, read_source

SHAREGPT = [
    {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
    {"id": "b", "conversations": [{"from": "human", "value": "héllo wörld ✓"}]},
    {"id": "c", "conversations": [{"from": "human", "value": "third"}]},
]


def write_jsonl(path, lines: list[bytes | dict]) -> None:
    path.write_bytes(b"\n".join(line if isinstance(line, bytes) else json.dumps(line).encode() for line in lines))


def test_jsonl_yields_one_record_per_line_and_skips_blank_lines(tmp_path):
    path = tmp_path / "data.jsonl"
    write_jsonl(path, [SHAREGPT[0], b"", b"   ", SHAREGPT[1]])
    records = list(iter_file_records(path))
    assert [r.location for r in records] == ["line 1", "line 4"]
    assert [r.data for r in records] == SHAREGPT[:2]


def test_malformed_jsonl_line_is_a_bad_record_and_reading_continues(tmp_path):
    path = tmp_path / "data.jsonl"
    write_jsonl(path, [SHAREGPT[0], b'{"id": "x", "conversations": [', SHAREGPT[1]])
    first, bad, last = iter_file_records(path)
    assert first.data == SHAREGPT[0] and last.data == SHAREGPT[1]
    assert bad.data is None and bad.error.kind == "malformed_json"
    assert str(path) in str(bad.error) and "line 2" in str(bad.error) and "malformed JSON" in str(bad.error)


def test_invalid_utf8_survives_decoding_as_lone_surrogates(tmp_path):
    path = tmp_path / "data.jsonl"
    write_jsonl(path, [b'{"id": "x", "conversations": [{"from": "human", "value": "bad \xff byte"}]}'])
    (record,) = iter_file_records(path)
    assert record.data["conversations"][0]["value"] == "bad \udcff byte"


def test_json_array_records_carry_record_byte_and_line(tmp_path):
    path = tmp_path / "data.json"
    text = json.dumps(SHAREGPT, indent=2, ensure_ascii=False)  # non-ASCII: bytes and characters differ
    path.write_text(text, encoding="utf-8")
    reader = iter_file_records(path)
    records = list(reader)
    assert [r.data for r in records] == SHAREGPT
    start = text.index('{\n    "id": "c"')
    byte = len(text[:start].encode("utf-8"))
    assert records[2].location == f"record 2 (byte {byte}, line {text[:start].count(chr(10)) + 1})"
    assert reader.truncation is None


def test_truncated_json_array_recovers_complete_records_and_reports_the_cut(tmp_path):
    path = tmp_path / "cut.json"
    text = json.dumps(SHAREGPT, indent=2, ensure_ascii=False)
    start_of_third = text.index('{\n    "id": "c"')
    path.write_bytes(text[: start_of_third + 30].encode("utf-8"))  # cut inside the third record
    reader = iter_file_records(path)
    records = list(reader)
    assert [r.data["id"] for r in records] == ["a", "b"]
    assert reader.truncation is not None
    assert reader.truncation.line == text[:start_of_third].count("\n") + 1
    assert reader.truncation.byte_offset == len(text[:start_of_third].encode("utf-8"))
    assert reader.truncation.records_before == 2


def test_unclosed_json_array_after_a_complete_record_is_a_truncation(tmp_path):
    path = tmp_path / "cut.json"
    path.write_text("[" + json.dumps(SHAREGPT[0]) + ",\n")
    reader = iter_file_records(path)
    assert len(list(reader)) == 1
    assert reader.truncation.records_before == 1 and reader.truncation.line == 2


def test_malformed_record_inside_json_array_is_skipped_and_reading_continues(tmp_path):
    path = tmp_path / "data.json"
    text = '[{"id": "a", "x": [1, 2,]},\n {"id": "b"}, nul, {"id": "c"}]'
    path.write_text(text)
    reader = iter_file_records(path)
    records = list(reader)
    assert [r.error.kind if r.error else r.data["id"] for r in records] == ["malformed_json", "b", "malformed_json", "c"]
    assert records[2].location == f"record 2 (byte {text.index('nul')}, line 2)"
    assert "malformed JSON: Expecting value (line 2, column" in str(records[2].error)
    assert reader.truncation is None


def test_json_file_must_hold_an_array(tmp_path):
    path = tmp_path / "data.json"
    path.write_text(json.dumps(SHAREGPT[0]))
    with pytest.raises(InputFileError, match=r"data\.json: expected a top-level JSON array"):
        list(iter_file_records(path))


def test_parquet_rows_become_dicts(tmp_path):
    path = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist(SHAREGPT), path)
    records = list(iter_file_records(path))
    assert [r.location for r in records] == ["row 0", "row 1", "row 2"]
    assert [r.data for r in records] == SHAREGPT


@pytest.mark.parametrize("name,content", [("a.jsonl", b""), ("b.json", b" \n\t "), ("c.parquet", b""), ("d.jsonl", b"\n\n")])
def test_empty_file_is_an_input_file_error_naming_it(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(InputFileError, match=f"{name}: input file is empty"):
        list(iter_file_records(path))


def test_missing_file_and_unknown_extension_fail_at_once(tmp_path):
    with pytest.raises(InputFileError, match=r"nope\.jsonl: input file not found"):
        iter_file_records(tmp_path / "nope.jsonl")
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(InputFileError, match=r"data\.csv: unsupported file type '\.csv'; supported: \.jsonl, \.json, \.parquet"):
        iter_file_records(tmp_path / "data.csv")


@pytest.fixture(scope="module")
def saved_dataset_dict(tmp_path_factory):
    datasets = pytest.importorskip("datasets")
    directory = tmp_path_factory.mktemp("hf") / "saved"
    openai = [{"id": f"m{i}", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(3)]
    datasets.DatasetDict({
        "train": datasets.Dataset.from_list(SHAREGPT),
        "test": datasets.Dataset.from_list(openai),
    }).save_to_disk(str(directory))
    return directory


def test_hf_save_to_disk_directory_yields_rows_of_the_split(saved_dataset_dict):
    reader = iter_hf_records(saved_dataset_dict, "train")
    records = list(reader)
    assert [r.location for r in records] == ["row 0", "row 1", "row 2"]
    assert [r.data for r in records] == SHAREGPT
    assert reader.truncation is None and "[split train]" in reader.label
    assert [r.data["id"] for r in read_source("hf", saved_dataset_dict, split="test")] == ["m0", "m1", "m2"]


def test_hf_missing_split_names_the_available_ones(saved_dataset_dict):
    with pytest.raises(InputFileError, match=r"no split 'validation'; available splits: test, train"):
        iter_hf_records(saved_dataset_dict, "validation")


def test_read_source_picks_the_reader_by_kind(tmp_path):
    path = tmp_path / "data.jsonl"
    write_jsonl(path, SHAREGPT)
    assert [r.data for r in read_source("file", path)] == SHAREGPT
    assert isinstance(next(read_source("file", path)), RawRecord)
    with pytest.raises(ValueError, match="unknown source kind"):
        read_source("ftp", path)


def test_hf_path_that_is_neither_saved_nor_loadable_is_an_input_file_error(tmp_path):
    pytest.importorskip("datasets")
    with pytest.raises(InputFileError, match=r"missing: cannot load the dataset"):
        iter_hf_records(tmp_path / "missing", "train")
