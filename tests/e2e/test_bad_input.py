"""Bad input through the real Snakefile: a clear error naming file, line and field, or a counted skip.

Only the prompts stage runs here (no model needed), so each case costs a few seconds.
"""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import snakemake

pytestmark = pytest.mark.e2e

GOOD = '{"id": "ok-1", "messages": [{"role": "user", "content": "Hello?"}]}\n'
CASES = {
    # name: (file contents as bytes, what the error names, skip-mode counter)
    "malformed_json": (GOOD.encode() + b'{"id": "bad", "messages": [\n', ["line 2", "malformed JSON"], "malformed_json"),
    "no_user_turn": (GOOD.encode() + b'{"id": "nouser", "messages": [{"role": "assistant", "content": "hi"}]}\n', ["line 2", "nouser", "messages"], "no_user_turn"),
    "non_string_content": (GOOD.encode() + b'{"id": "num", "messages": [{"role": "user", "content": 42}]}\n', ["line 2", "num", "messages[0].content"], "non_string_content"),
    "unknown_role": (GOOD.encode() + b'{"id": "role", "messages": [{"role": "robot", "content": "beep"}, {"role": "user", "content": "x"}]}\n', ["line 2", "role", "messages[0].role"], "unknown_role"),
    "invalid_utf8": (GOOD.encode() + b'{"id": "utf", "messages": [{"role": "user", "content": "caf\xe9"}]}\n', ["line 2", "utf", "messages[0].content"], "invalid_utf8"),
}


def workdir_with(tmp_path, contents: bytes, on_bad_record: str):
    config = {
        "model": {"name": "unused", "path": "unused-model"},
        "datasets": {
            "good": {"source": {"file": "data/good.jsonl"}, "heldout_fraction": 0.0},
            "bad": {"source": {"file": "data/bad.jsonl"}, "heldout_fraction": 0.0, "on_bad_record": on_bad_record},
        },
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "good.jsonl").write_text(GOOD)
    (tmp_path / "data" / "bad.jsonl").write_bytes(contents)
    return tmp_path


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_record_stops_with_a_message_naming_file_line_and_field(tmp_path, case):
    contents, named, _ = CASES[case]
    workdir = workdir_with(tmp_path, contents, "error")
    snakemake(workdir, "results/prompts/good/summary.json")
    done = snakemake(workdir, "--keep-going", "results/prompts/good/summary.json", "results/prompts/bad/summary.json", check=False)
    assert done.returncode != 0
    log = (workdir / "logs/prompts/bad.log").read_text()
    assert "data/bad.jsonl" in log
    for text in named:
        assert text in log, f"{text!r} not in the error:\n{log[-2000:]}"
    # Nothing already produced is lost: the good dataset's prompts stay.
    assert (workdir / "results/prompts/good/0000.parquet").exists()
    assert not (workdir / "results/prompts/bad/summary.json").exists()


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_record_is_counted_when_the_dataset_says_skip(tmp_path, case):
    contents, _, counter = CASES[case]
    workdir = workdir_with(tmp_path, contents, "skip")
    snakemake(workdir, "results/prompts/bad/summary.json")
    summary = json.loads((workdir / "results/prompts/bad/summary.json").read_text())
    assert summary["bad_records"] == {counter: 1}
    assert summary["used"] == 1


def test_empty_file_is_an_error_even_in_skip_mode(tmp_path):
    workdir = workdir_with(tmp_path, b"", "skip")
    done = snakemake(workdir, "results/prompts/bad/summary.json", check=False)
    assert done.returncode != 0
    log = (workdir / "logs/prompts/bad.log").read_text()
    assert "data/bad.jsonl" in log and "empty" in log
