"""The benchmark table's acceptance in thinking, tool calls and answer: shown where a benchmark's rounds fell in thinking or a
tool call, absent where every round was answer (the default run's page unchanged) or the JSON predates the split."""

from __future__ import annotations

import json
import re

from eyrie.report.build import collect, write_report

CONFIG = {"model": {"name": "tiny", "path": "/models/tiny"}, "datasets": {}, "generation": {}, "engine": {}}
BENCH = {"prompts": 2, "mean_acceptance_length": 2.5, "acceptance_rate_per_position": [0.8, 0.5], "rounds": 10,
         "greedy_tokens_per_s": 100.0, "spec_tokens_per_s": 180.0, "speedup": 1.8, "lossless": True, "draft_tokens": 4, "new_tokens": 64,
         "max_new_tokens": 32, "dtype": "float32", "device": "cpu", "hardware": "CPU: test machine", "torch": "2.0",
         "per_prompt": [{"id": "a", "identical": True}, {"id": "b", "identical": True}]}
SPLIT = {"thinking": {"rounds": 6, "mean": 3.25}, "tool_call": {"rounds": 0, "mean": None}, "answer": {"rounds": 4, "mean": 1.375},
         "markers": {"thinking": ["<think>", "</think>"], "tool_call": ["<tool_call>", "</tool_call>"]}}


def build(tmp_path, benches: dict[str, dict]):
    paths = []
    for name, extra in benches.items():
        path = tmp_path / "results" / "bench" / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**BENCH, "benchmark": name, **extra}))
        paths.append(str(path))
    out = tmp_path / "report.html"
    write_report(CONFIG, [], [], [], str(out), bench=paths)
    return out.read_text(encoding="utf-8"), collect(CONFIG, [], [], [], bench=paths)


def glance(page: str) -> str:
    start = page.index('<table class="glance">')
    return page[start:page.index("</table>", start)]


def test_the_table_shows_acceptance_per_span_beside_each_benchmark(tmp_path):
    page, figures = build(tmp_path, {"math": {"acceptance_by_span": SPLIT}, "mtbench": {}})
    rows = {r["name"]: r for r in figures["bench"]["rows"]}
    assert rows["math"]["acceptance_by_span"]["thinking"] == {"rounds": 6, "mean": 3.25}
    assert rows["mtbench"]["acceptance_by_span"] is None  # written before the split: no figures invented
    table = glance(page)
    assert "<th>acceptance in thinking</th><th>in tool calls</th><th>in answer</th>" in table
    math_row = re.search(r"<tr><td><a[^>]*>math</a>.*?</tr>", table, re.DOTALL).group(0)
    assert re.findall(r'<td class="n">([^<]*)(?:<span class="muted">\((\d+) rounds\)</span>)?</td>', math_row)[-3:] == [("3.25 ", "6"), ("—", ""), ("1.38 ", "4")]
    mtbench = re.search(r"<tr><td><a[^>]*>mtbench</a>.*?</tr>", table, re.DOTALL).group(0)
    assert mtbench.count("<td class=\"n\">—</td>") == 3


def test_a_run_of_answer_only_shows_no_span_columns(tmp_path):
    answer_only = {"thinking": {"rounds": 0, "mean": None}, "tool_call": {"rounds": 0, "mean": None}, "answer": {"rounds": 10, "mean": 2.5}}
    page, figures = build(tmp_path, {"mtbench": {"acceptance_by_span": answer_only}})
    assert figures["bench"]["rows"][0]["acceptance_by_span"] is None
    assert "acceptance in thinking" not in page
