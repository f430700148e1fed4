"""The report's "Speed at concurrency": a benchmark JSON's concurrency block drawn (speedup against B), the recommendation
per B with its SGLang flags, SGLang's adaptive tiers and vLLM's batch-aware schedule; the reason when it is off; and
JSONs written before the block existed still build."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

from eyrie.bench.concurrency import (NO_SPECULATION, OFF_REASON, sglang_adaptive_config, sglang_adaptive_flags, sglang_flags, vllm_flags,
                                     vllm_schedule)
from eyrie.report.build import collect, write_report

CONFIG = {"model": {"name": "tiny", "path": "/models/tiny"}, "datasets": {}, "generation": {}, "engine": {}}
BATCH_1 = {"benchmark": "mtbench", "prompts": 2, "mean_acceptance_length": 2.5, "acceptance_rate_per_position": [0.8, 0.5], "rounds": 10,
           "greedy_tokens_per_s": 100.0, "spec_tokens_per_s": 180.0, "speedup": 1.8, "lossless": True, "draft_tokens": 4, "new_tokens": 64,
           "max_new_tokens": 32, "dtype": "float32", "device": "cpu", "hardware": "CPU: test machine", "torch": "2.0",
           "per_prompt": [{"id": "a", "identical": True}, {"id": "b", "identical": True}]}
# (B, greedy tokens/s, {label: (speedup, lossless)}): the chain wins at 1, the short chain at 4, the n-gram at 16, nothing at 64
MEASURED = [(1, 100.0, {"chain 4": (1.8, True), "chain 2": (1.5, True), "n-gram 4": (1.2, True)}),
            (4, 380.0, {"chain 4": (1.2, True), "chain 2": (1.4, True), "n-gram 4": (1.1, True)}),
            (16, 1400.0, {"chain 4": (0.9, True), "chain 2": (1.3, False), "n-gram 4": (1.05, True)}),
            (64, 5000.0, {"chain 4": (0.6, True), "chain 2": (0.8, True), "n-gram 4": (0.95, True)})]


def concurrency_block() -> dict:
    """A block as eyrie.bench.concurrency writes it, its recommendation and flags made by that module's own functions."""
    per_batch = []
    for batch, greedy, settings in MEASURED:
        rows = []
        for label, (speedup, lossless) in settings.items():
            kind, k = label.rsplit(" ", 1)
            rows.append({"label": label, "kind": "chain" if kind == "chain" else "ngram", "draft_tokens": int(k), "steps": int(k), "topk": 1,
                         "tokens_per_s": greedy * speedup,
                         "speedup": speedup, "lossless": lossless, "rows": batch, "float32_identical_rows": batch if lossless else batch - 1})
        winners = [r for r in rows if r["lossless"] and r["speedup"] > 1]
        best = max(winners, key=lambda r: r["tokens_per_s"], default=None)
        chain = max([r for r in winners if r["kind"] == "chain"], key=lambda r: r["tokens_per_s"], default=None)
        per_batch.append({"batch": batch, "engine_rows": batch, "waves": -(-2 // batch), "distinct_prompts": 2, "greedy": {"tokens_per_s": greedy}, "settings": rows,
                          "recommended": None if best is None else {k: best[k] for k in ("label", "kind", "draft_tokens", "speedup")},
                          "chain": None if chain is None else {k: chain[k] for k in ("label", "kind", "draft_tokens", "speedup")},
                          "recommendation": NO_SPECULATION if best is None else best["label"], "sglang_flags": sglang_flags(best)})
    schedule = vllm_schedule(per_batch)
    adaptive = sglang_adaptive_config(per_batch)
    return {"batches": [1, 4, 16, 64], "off_reason": None, "settings": ["chain 4", "chain 2", "n-gram 4"], "per_batch": per_batch,
            "lossless_dtype": "float32", "vllm_schedule": schedule, "vllm_flags": vllm_flags(schedule, "/drafters/d"),
            "sglang_adaptive_config": adaptive, "sglang_adaptive_flags": sglang_adaptive_flags(adaptive)}


def report(tmp_path: Path, **extra) -> tuple[str, dict]:
    path = tmp_path / "results" / "bench" / "mtbench.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**BATCH_1, **extra}))
    out = tmp_path / "report.html"
    write_report(CONFIG, [], [], [], str(out), bench=[str(path)])
    return out.read_text(encoding="utf-8"), collect(CONFIG, [], [], [], bench=[str(path)])


def section(page: str) -> str:
    start = page.index("<h4>Speed at concurrency</h4>")
    return page[start:page.index("<details><summary>per-prompt numbers", start)]


def test_a_concurrency_block_renders_its_plot_recommendations_and_flags(tmp_path):
    block = concurrency_block()
    page, figures = report(tmp_path, concurrency=block)
    part = section(page)
    svg = part[part.index("<svg"):part.index("</svg>")]
    for label in ("chain 4", "chain 2", "n-gram 4", "batched greedy", "concurrent requests B", "speedup over batched greedy"):
        assert f">{label}<" in svg or label in svg
    assert all(f">{b}<" in svg for b in ("1", "4", "16", "64"))  # the measured B as the log axis' ticks
    rows = re.findall(r"<tr><td class=\"n\">(\d+).*?<strong>(.*?)</strong>.*?</tr>", part, flags=re.S)
    assert rows == [("1", "chain 4"), ("4", "chain 2"), ("16", "n-gram 4"), ("64", NO_SPECULATION)]  # chain 2 is lossy at 16
    text = html.unescape(part)
    for entry in block["per_batch"][:3]:
        assert f"<code>{entry['sglang_flags']}</code>" in text
    assert "--speculative-num-steps 2 --speculative-eagle-topk 1 --speculative-num-draft-tokens 3" in text
    assert "none: serve without speculation" in text  # B = 64
    assert "1.40×" in text and "(2 distinct prompts)" in text  # B = 4, 16 and 64 repeat the two prompts
    assert "(2 waves: every prompt)" in text  # B = 1 decodes both, one after the other
    assert block["sglang_adaptive_flags"] in text and "write this to <code>sglang-adaptive.json</code>" in text
    shown = text[text.index('<pre class="cmd">') + len('<pre class="cmd">'):text.index("</pre>", text.index('<pre class="cmd">'))]
    assert json.loads(shown) == {"1": {"candidate_steps": [4]}, "4": {"candidate_steps": [2]}, "16": {"candidate_steps": [0]}, "64": {"candidate_steps": [0]}}
    assert block["vllm_flags"] in text and "num_speculative_tokens_per_batch_size" in text
    warnings = [w["text"] for w in figures["warnings"] if w["section"] == "bench"]
    assert warnings == ["mtbench: at B = 16, chain 2 differs from batched greedy on 1 of 16 rows; speculative decoding must be lossless"]
    curves = {c["label"]: [p["speedup"] for p in c["points"]] for c in figures["bench"]["rows"][0]["concurrency"]["curves"]}
    assert curves == {label: [settings[label][0] for _, _, settings in MEASURED] for label in ("chain 4", "chain 2", "n-gram 4")}


def test_with_the_drafter_the_adaptive_tiers_come_as_a_whole_launch_command_sglang_reads(tmp_path, sglang_parser):
    import shlex

    from factories import sglang_argv

    drafter = tmp_path / "results" / "drafter"
    drafter.mkdir(parents=True)
    (drafter / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], "torch_dtype": "bfloat16"}))
    path = tmp_path / "results" / "bench" / "mtbench.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({**BATCH_1, "concurrency": concurrency_block()}))
    out = tmp_path / "report.html"
    write_report(CONFIG, [], [], [], str(out), drafter=str(drafter), bench=[str(path)])
    text = html.unescape(section(out.read_text(encoding="utf-8")))
    assert "and launch SGLang with it:" in text and "with <code>--speculative-draft-model-path</code>" not in text
    shown = text[text.index("python -m sglang.launch_server"):]
    command = shlex.split(shown[:shown.index("</pre>")].replace("\\\n", " "))
    parser, _ = sglang_parser
    args = parser.parse_args(sglang_argv(command))
    assert (args.model_path, args.speculative_draft_model_path, args.speculative_algorithm) == ("/models/tiny", str(drafter), "EAGLE3")
    assert (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens) == (4, 1, None)
    assert args.speculative_adaptive and args.speculative_adaptive_config == "sglang-adaptive.json" and args.dtype == "bfloat16"


def test_a_load_timed_on_more_rows_than_its_requests_is_a_warning(tmp_path):
    block = concurrency_block()
    block["per_batch"][0]["engine_rows"] = 64  # B = 1 decoded beside 63 dummy rows: 64 rows' work, not one request's
    _, figures = report(tmp_path, concurrency=block)
    warnings = [w["text"] for w in figures["warnings"] if w["section"] == "bench"]
    assert "mtbench: B = 1 was timed on an engine of 64 rows, not 1: its figures are those of 64 rows' work" in warnings


def test_no_chain_anywhere_shows_no_schedule(tmp_path):
    block = concurrency_block()
    for entry in block["per_batch"]:
        entry["recommended"], entry["recommendation"], entry["sglang_flags"] = None, NO_SPECULATION, ""
    block.update(vllm_schedule=None, vllm_flags=None, sglang_adaptive_config=None, sglang_adaptive_flags=None)
    part = section(report(tmp_path, concurrency=block)[0])
    assert part.count(f"<strong>{NO_SPECULATION}</strong>") == 4 and "<svg" in part
    assert "No chain beats batched greedy at any measured B" in part and "speculative-adaptive" not in part


def test_off_shows_the_reason_in_one_line(tmp_path):
    off = {"batches": [], "off_reason": OFF_REASON, "per_batch": [], "vllm_schedule": None, "vllm_flags": None}
    part = section(report(tmp_path, concurrency=off)[0])
    assert part.strip().splitlines()[1:] == [f'<p class="muted">Not measured: {html.escape(OFF_REASON)}.</p>']


def test_a_json_from_before_the_block_still_builds(tmp_path):
    page, figures = report(tmp_path)
    assert figures["bench"]["rows"][0]["concurrency"] is None and figures["bench"]["rows"][0]["measured"]
    assert "Speed at concurrency" not in page and "mtbench" in page
