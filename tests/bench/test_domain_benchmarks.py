"""BFCL and math problems through the benchmark job: prompts rendered with their tools and the template's thinking, and the JSON's
acceptance per span adding up to the run's own rounds and mean."""

from __future__ import annotations

import json

import pytest
from factories import random_target_drafter

from eyrie.bench.benchmark import first_turn, run_benchmark_job
from eyrie.bench.domain_prompts import load_bfcl_prompts, load_math_prompts, render_prompt

CFG = {"draft_tokens": 3, "max_new_tokens": 10, "min_acceptance_length": 1.0, "dtype": "float32", "sweep": [], "ngram": False}
# Qwen3's shape on the default target's own special tokens: tools in a system turn, thinking off unless switched on.
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n"
    "Return calls within <tool_call></tool_call> tags.<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if not (enable_thinking is defined and enable_thinking) %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
BFCL = {"id": "multiple_0", "question": [[{"role": "user", "content": "Area of a circle of radius 3?"}]],
        "function": [{"name": "circle.area", "description": "Area of a circle.", "parameters": {"type": "dict", "properties": {"radius": {"type": "float"}}}},
                     {"name": "square.area", "description": "Area of a square.", "parameters": {"type": "dict", "properties": {"side": {"type": "integer"}}}}]}


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    """These decode token by token: see conftest.one_torch_thread."""


@pytest.fixture(scope="module")
def templated_target(model_dir, tmp_path_factory):
    """The default target's files, its chat template replaced by TEMPLATE (the weights linked, not copied)."""
    out = tmp_path_factory.mktemp("templated-target")
    for path in model_dir.iterdir():
        if path.is_file() and path.name != "chat_template.jinja":
            (out / path.name).symlink_to(path)
    (out / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
    return out


@pytest.fixture(scope="module")
def drafter(target):
    return random_target_drafter(target[0])


def run(tmp_path, benchmark, records, target_dir, drafter):
    prompts_path = tmp_path / f"{benchmark}.jsonl"
    prompts_path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    out = tmp_path / f"{benchmark}.json"
    result = run_benchmark_job(benchmark=benchmark, prompts_path=prompts_path, drafter_dir=drafter, target_dir=target_dir,
                               bench_cfg={**CFG, benchmark: {"package": "p==1", "member": "m", "limit": 1}}, out_path=out, device="cpu")
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    return prompts_path, result


def expected_prompt_tokens(target_dir, prompt) -> int:
    from eyrie.target.model import load_tokenizer

    tokenizer = load_tokenizer(target_dir)
    return len(tokenizer(render_prompt(tokenizer, first_turn(prompt), prompt), add_special_tokens=False)["input_ids"])


def check_spans(result):
    spans = result["acceptance_by_span"]
    assert sum(spans[s]["rounds"] for s in ("thinking", "tool_call", "answer")) == result["rounds"] > 0
    emitted = sum(spans[s]["rounds"] * spans[s]["mean"] for s in ("thinking", "tool_call", "answer") if spans[s]["rounds"])
    assert emitted / result["rounds"] == pytest.approx(result["mean_acceptance_length"])
    assert spans["markers"] == {"thinking": ["<think>", "</think>"], "tool_call": ["<tool_call>", "</tool_call>"]}


def test_bfcl_runs_with_its_tools_in_the_rendered_prompt(tmp_path, templated_target, drafter):
    path, result = run(tmp_path, "bfcl", [BFCL, {**BFCL, "id": "multiple_1"}], templated_target, drafter)
    assert result["benchmark"] == "bfcl" and result["prompts"] == 1 and result["per_prompt"][0]["id"] == "bfcl-multiple_0"
    prompt = load_bfcl_prompts(path)[0]
    with_tools = expected_prompt_tokens(templated_target, prompt)
    assert result["per_prompt"][0]["prompt_tokens"] == with_tools > expected_prompt_tokens(templated_target, {**prompt, "tools": None}) + 40
    check_spans(result)


def test_math_runs_with_the_templates_thinking_switched_on(tmp_path, templated_target, drafter):
    path, result = run(tmp_path, "math", [{"question": "Tom has 3 apples and buys 2. How many?", "answer": "#### 5"}], templated_target, drafter)
    prompt = load_math_prompts(path)[0]
    thinking = expected_prompt_tokens(templated_target, prompt)
    # thinking off would render an empty think block after the generation prompt: more tokens
    assert result["per_prompt"][0]["prompt_tokens"] == thinking < expected_prompt_tokens(templated_target, {**prompt, "thinking": False})
    check_spans(result)
