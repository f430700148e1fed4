"""The HTML report: self-contained, escaped, and its numbers equal the inputs' sums."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from factories import (
    REPORT_BENCH, REPORT_DROPPED, REPORT_HIDDEN, REPORT_HIDDEN_SHARDS, REPORT_SHA, REPORT_VOCAB_COUNTS, REPORT_XSS, report_back_half, report_config, report_inputs, report_summary, save_report_safetensors,
)

from eyrie.report.build import collect, write_report

SHA_B = "b" * 64


def _write(tmp_path: Path, **kwargs) -> str:
    config, summaries, completions, tokens = report_inputs(tmp_path, **kwargs)
    out = tmp_path / "out" / "report.html"
    write_report(config, summaries, completions, tokens, str(out))
    return out.read_text(encoding="utf-8")


@pytest.fixture
def html(tmp_path) -> str:
    return _write(tmp_path)


def test_writes_one_self_contained_page(html, tmp_path):
    assert html.startswith("<!doctype html>")
    assert "<script" not in html.lower()
    for tag in re.findall(r"<(?:link|img|iframe|source|object|embed|audio|video)\b[^>]*>", html, flags=re.I):
        assert "http" not in tag.lower(), tag
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", html, flags=re.I)
    assert not re.search(r"@import|url\(\s*['\"]?https?:", html)
    assert "<svg" in html and "<?xml" not in html  # plots are inline
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["report.html"]  # no temp file left behind


def test_header_says_what_is_built(html):
    assert "eyrie report" in html and "tiny-llama" in html
    assert "prompts: 2 of 2 datasets" in html
    assert "completions: 4 of 4 shards" in html
    for stage in ("draft vocab", "hidden states", "drafter", "benchmark"):
        assert f"{stage}: not built yet" in html
    assert "No speedup or acceptance length has been measured" in html


def test_datasets_section(html):
    assert "the file is truncated: it breaks at byte 123,456 (line 789); 780 records before the break were recovered" in html
    assert "skipped 3 bad records: missing_value&nbsp;2, unknown_role&nbsp;1" in html
    assert "0001:&nbsp;0&nbsp;(empty)" in html
    assert "783" in html


def test_regeneration_numbers(html):
    assert "103.5" in html  # chat: 414 completion tokens / 4.0 s
    assert "111.0" in html  # sharegpt: 222 / 2.0 s
    assert "106.0" in html  # overall: 636 / 6.0 s
    assert "75.0%" in html  # sharegpt: 3 of 4 turns hit the length limit
    assert "consider raising generation.max_new_tokens (now 64)" in html
    assert html.count('class="hint"') == 1  # chat's 1 of 6 is under the threshold


def test_a_dataset_that_kept_its_source_replies_says_so_and_a_config_that_no_longer_does_is_warned(tmp_path):
    config, summaries, completions, tokens = report_inputs(tmp_path, kept_replies=("sharegpt",))
    config["datasets"]["sharegpt"]["replies"] = "source"
    write_report(config, summaries, completions, tokens, str(tmp_path / "kept.html"))
    page = (tmp_path / "kept.html").read_text(encoding="utf-8")
    assert "<strong>sharegpt:</strong> the source's own replies, kept as they are" in page and "WARNING" not in page
    assert "<strong>chat:</strong> the source's own replies" not in page
    config["datasets"]["sharegpt"]["replies"] = "target"
    write_report(config, summaries, completions, tokens, str(tmp_path / "changed.html"))
    assert "replies: made with &#39;source&#39;, config now &#39;target&#39;" in (tmp_path / "changed.html").read_text(encoding="utf-8")


def test_tokens_numbers_and_no_warning_when_templates_agree(html):
    assert "1,210" in html  # all tokens
    assert "52.6%" in html  # 636 assistant of 1,210
    assert "no_assistant&nbsp;2" in html
    assert "aaaaaaaaaaaa" in html
    assert "WARNING" not in html


def test_warns_when_a_token_shard_disagrees_on_the_template(tmp_path):
    html = _write(tmp_path, token_templates={("sharegpt", "0001"): SHA_B})
    assert "WARNING" in html
    assert "sharegpt: token shards disagree on template_sha256" in html
    assert "sharegpt: completions were made with template_sha256" in html


def test_warns_when_tokens_and_completions_use_different_templates(tmp_path):
    html = _write(tmp_path, token_templates={("chat", "0000"): SHA_B, ("chat", "0001"): SHA_B})
    assert "chat: completions were made with template_sha256" in html
    assert "disagree" not in html


def test_user_text_is_escaped(html):
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "&lt;b&gt;bold &amp; &#34;quoted&#34;&lt;/b&gt;" in html
    assert "<b>bold" not in html


def test_provenance_has_no_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("EYRIE_TEST_SECRET", "s3cr3t-value-9f2c")
    html = _write(tmp_path)
    assert "s3cr3t-value-9f2c" not in html
    assert "git commit" in html and "pyarrow" in html
    assert "max_batch_tokens: 8192" in html  # the config as YAML


def test_collect_totals_equal_input_sums(tmp_path):
    config, summaries, completions, tokens = report_inputs(tmp_path)
    figures = collect(config, summaries, completions, tokens)
    comp = pa.concat_tables(pq.read_table(p) for p in completions)
    toks = pa.concat_tables(pq.read_table(p) for p in tokens)
    regen, tok = figures["regeneration"]["total"], figures["tokens"]["total"]
    assert regen["records"] == comp.num_rows == 6
    assert regen["turns"] == sum(comp["n_turns"].to_pylist())
    assert regen["completion_tokens"] == sum(sum(t) for t in comp["completion_tokens"].to_pylist()) == 636
    assert regen["prompt_tokens"] == sum(sum(t) for t in comp["prompt_tokens"].to_pylist())
    assert regen["generation_seconds"] == pytest.approx(sum(comp["seconds"].to_pylist()))
    assert regen["tokens_per_second"] == pytest.approx(636 / 6.0)
    assert sum(regen["finish_reasons"].values()) == sum(len(r) for r in comp["finish_reasons"].to_pylist())
    assert sum(d["records"] for d in figures["regeneration"]["datasets"]) == regen["records"]
    assert tok["records"] == toks.num_rows
    assert tok["tokens"] == sum(toks["n_tokens"].to_pylist())
    assert tok["assistant_tokens"] == sum(toks["n_assistant_tokens"].to_pylist())
    assert tok["truncated"] == sum(toks["truncated"].to_pylist()) == 1
    assert tok["dropped_total"] == sum(sum(d.values()) for d in REPORT_DROPPED.values())
    assert figures["datasets"]["total"]["records_read"] == sum(report_summary(d)["records_read"] for d in ("chat", "sharegpt"))
    assert figures["datasets"]["total"]["bad_total"] == 3
    lengths = {d["name"]: d["lengths"]["turns"] for d in figures["regeneration"]["datasets"]}
    assert lengths == {"chat": 4, "sharegpt": 4}  # chat's prompt_too_long turn is not a length
    assert [d["name"] for d in figures["regeneration"]["datasets"]] == ["chat", "sharegpt"]
    assert figures["regeneration"]["datasets"][0]["empty_shards"] == ["0001"]
    json.dumps(figures)  # plain data only


def test_renders_with_nothing_built(tmp_path):
    out = tmp_path / "report.html"
    write_report(report_config(), [], [], [], str(out))
    html = out.read_text()
    assert "Completions not built yet." in html and "Tokens not built yet." in html
    assert "prompts not built yet" in html


def test_a_synthetic_dataset_shows_what_the_target_wrote_kept_and_dropped_with_escaped_examples(tmp_path):
    config, summaries, completions, tokens = report_inputs(tmp_path)
    made = {"count": 10, "samples": 16, "kept": 9, "too_long": 3, "empty": 1, "too_short": 0, "duplicates": 2, "unused": 1,
            "topics": ["Python functions"], "topic_as": "system", "examples": [{"topic": "Python functions", "text": f"How do I {REPORT_XSS}?"}]}
    summary = json.loads(Path(summaries[0]).read_text())
    Path(summaries[0]).write_text(json.dumps({**summary, "synthetic": made}))
    out = tmp_path / "report.html"
    write_report(config, summaries, completions, tokens, str(out))
    html = out.read_text()
    assert "synthetic prompts written by the target: 16 generated, 9 kept of 10 asked, dropped: duplicates&nbsp;2, empty&nbsp;1, too_long&nbsp;3" in html
    assert "short of the count" in html and "steered by topic (system): Python functions" in html
    assert "How do I &lt;script&gt;alert(1)&lt;/script&gt;?" in html and f"How do I {REPORT_XSS}" not in html
    assert collect(config, summaries, completions, tokens)["datasets"]["rows"][1]["synthetic"] is None  # a file dataset has none


def test_a_rework_dataset_says_how_many_replies_it_handed_back_and_what_it_skipped(tmp_path):
    config, summaries, completions, tokens = report_inputs(tmp_path)
    summary = json.loads(Path(summaries[0]).read_text())
    counts = {"records_read": 1200, "made": 1000, "heldout_skipped": 24, "without_text": 176, "instructions": 8}
    Path(summaries[0]).write_text(json.dumps({**summary, "rework": counts}))
    out = tmp_path / "report.html"
    write_report(config, summaries, completions, tokens, str(out))
    html = out.read_text()
    used = collect(config, summaries, completions, tokens)["datasets"]["rows"][0]["used"]
    assert (f"rework prompts: 1,000 made from the source's replies (each handed back to the target after one of 8 instructions to "
            f"proofread, format or quote it; {used:,} used); 24 records skipped as held out by another dataset's benchmark; 176 without a reply") in html
    assert collect(config, summaries, completions, tokens)["datasets"]["rows"][1]["rework"] is None  # a dataset without the option


def test_unreadable_inputs_are_reported_not_fatal(tmp_path):
    config, summaries, completions, tokens = report_inputs(tmp_path)
    broken = tmp_path / "results" / "completions" / "chat" / "0002.parquet"
    broken.write_bytes(b"not parquet")
    bad_json = tmp_path / "bad_summary.json"
    bad_json.write_text("{")
    out = tmp_path / "report.html"
    out.write_text("old page")
    write_report(config, summaries + [str(bad_json)], completions + [str(broken), str(tmp_path / "missing.parquet")], tokens, str(out))
    html = out.read_text()
    assert "could not read" in html and "0002.parquet" in html and "missing.parquet" in html
    assert "103.5" in html  # the readable shards still count




def _write_full(root: Path, **kwargs) -> str:
    config, summaries, completions, tokens = report_inputs(root)
    out = root / "out" / "report.html"
    write_report(config, summaries, completions, tokens, str(out), **report_back_half(root, **kwargs))
    return out.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def full_html(tmp_path_factory) -> str:
    return _write_full(tmp_path_factory.mktemp("full"))


def test_full_report_header_lists_every_stage(full_html):
    assert "draft vocab: 8 tokens, 100.0% coverage" in full_html
    assert "hidden states: 3 of 4 shards" in full_html
    assert "drafter: 50 training steps" in full_html
    assert "benchmark: 3 of 4 benchmarks, 1 with an error" in full_html
    assert "not built yet" not in full_html.split("<nav>")[0].split("Not built yet")[0]  # every stage built
    assert "No speedup or acceptance length has been measured" not in full_html
    assert "<script" not in full_html.lower() and full_html.count("<svg") >= 7  # vocab, training, 3 bench, 2 front half


def test_full_report_vocab(full_html):
    assert "coverage (assistant tokens inside the draft vocabulary)" in full_html
    assert "<strong>100.0%</strong>" in full_html
    assert ("only 6 distinct assistant tokens were seen, fewer than the requested draft_vocab_size 8; the draft vocabulary holds all of "
            "them, padded with 2 never-seen ids to 8 rows") in full_html
    assert "Cumulative coverage by vocabulary size" in full_html


def test_vocab_section_says_how_many_ids_came_from_prompts(tmp_path):
    """drafter.draft_vocab_from_prompts: the page counts the ids read in prompts but never written, and a clipped
    vocabulary's note counts them among the seen."""
    import torch

    from eyrie.report.collect_model import vocab_section

    counts = torch.tensor(REPORT_VOCAB_COUNTS, dtype=torch.int64)
    kept = torch.arange(len(REPORT_VOCAB_COUNTS) - 8, len(REPORT_VOCAB_COUNTS))
    t2d = torch.zeros(len(REPORT_VOCAB_COUNTS), dtype=torch.bool)
    t2d[kept] = True
    manifest = {"draft_vocab_size": 8, "requested_draft_vocab_size": 10, "target_vocab_size": len(REPORT_VOCAB_COUNTS), "assistant_tokens": 100,
                "distinct_assistant_tokens": 6, "coverage": 1.0, "template_sha256": REPORT_SHA, "clipped": True, "unseen_padding": 0,
                "shards": 4, "from_prompts": True, "prompt_only_ids": 2}
    path = save_report_safetensors(tmp_path / "v.safetensors", {"d2t": kept - torch.arange(8), "t2d": t2d, "counts": counts, "draft_ids": kept}, manifest)
    section = vocab_section(path, [])
    assert section["from_prompts"] is True and section["prompt_only_ids"] == 2
    assert section["clipped_note"].startswith("only 6 distinct assistant tokens and 2 more read in prompts were seen, fewer than")


def test_full_report_says_which_reply_tokens_the_draft_vocabulary_lacks(full_html):
    assert ("12 of the 640 greedy reply tokens (1.9%, in 1 prompts) lie outside the draft vocabulary, so no drafter step could "
            "propose them (most often <code> dove</code> ×9, <code>28</code> ×3)") in full_html
    assert "drafter.draft_vocab_from_prompts" in full_html


def test_full_report_hidden_cache(full_html):
    tokens, total_bytes = 820 + 330 + 60, 440_000 + 178_000 + 34_000
    assert f"{tokens:,}" in full_html and f"{total_bytes:,}" in full_html
    assert f"{total_bytes / tokens:,.1f} bytes per token" in full_html  # 538.8
    assert "636.7 KiB on disk for 1,210 tokens" in full_html
    assert "8H+5 = 517 bytes for H = 64" in full_html
    assert "<code>[1, 3, 4]</code>" in full_html and "<code>[2, 4, 5]</code>" in full_html
    assert "hidden-state shards disagree" not in full_html


def test_hidden_section_shows_the_free_space_at_report_time(tmp_path, monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(2**40, 0, 10 * 2**30))
    html = _write_full(tmp_path / "full")
    free = 10 * 2**30 / (440_000 + 178_000 + 34_000)
    assert f"10.0 GiB free on the filesystem of <code>{tmp_path / 'full' / 'results' / 'hidden'}/" in html and f"{free:.1f}× this cache" in html
    out = tmp_path / "empty" / "report.html"
    write_report(report_config(), [], [], [], str(out))
    assert "Hidden states not built yet. 10.0 GiB free on the filesystem of" in out.read_text()


def test_full_report_drafter(full_html, tmp_path_factory):
    assert "61.2%" in full_html and "50.3%" in full_html and "39.1%" in full_html  # final accuracy per TTT step
    assert "accuracy per TTT step" in full_html
    assert "5 log entries" in full_html and "loss 4.0000 at the first entry, 2.1000 at step 50" in full_html
    assert re.search(
        r"python -m sglang\.launch_server --model-path /models/tiny-llama --host 127\.0\.0\.1 --port 30000 --dtype bfloat16 "
        r"--speculative-algorithm EAGLE3 --speculative-draft-model-path \S+/results/drafter "
        r"--speculative-num-steps 4 --speculative-eagle-topk 1 --speculative-num-draft-tokens 5</pre>", full_html)
    assert "binds to <code>127.0.0.1</code>" in full_html and "change <code>--host</code> deliberately" in full_html
    assert "4.2 KiB (4,321 bytes)" in full_html
    assert ("where prompt lookup would have 3 or more drafts accepted (41 round starts of 12 held-out samples), the drafter accepts "
            "<strong>1.30</strong> drafts a round with a chain of 3, prompt lookup <strong>5.90</strong> with 8: the drafter does not copy") in full_html


def test_full_report_benchmarks(full_html):
    assert "<strong>2.37</strong>" in full_html and "1.01" in full_html
    assert "0.83×" in full_html and "0.52×" in full_html
    assert "Speculation is slower here:" in full_html and "43.5 tokens/s with the drafter against 52.4 without" in full_html
    assert "the drafter is not engaged" in full_html
    assert "yes: identical on 2 of 2 prompts" in full_html
    assert "identical on 3 of 4 prompts" in full_html and "<code>HumanEval/2</code> at new token 17" in full_html
    assert "no held-out prompts: nothing was measured for chat" in full_html
    assert "71.0%" in full_html  # acceptance at position 1
    assert full_html.count('class="warning"') == 1 + 2  # the header's count, the error, the divergence
    assert "2 problems found" in full_html


def test_full_report_shows_the_ngram_baseline_beside_the_drafter(full_html):
    glance = full_html.split("<nav>")[0]
    assert "<th>n-gram acceptance length</th><th>tokens/s n-gram</th><th>speedup over n-gram</th>" in glance
    assert "1.42" in glance and "40.1" in glance and "1.08×" in glance
    assert "the training-free n-gram (prompt lookup) baseline with the same k" in glance
    section = full_html.split('<section id="bench">')[1]
    sharegpt = section.split('id="bench-1"')[1].split('id="bench-2"')[0]
    assert "<td>EAGLE-3 drafter</td>" in sharegpt
    assert "<td>n-gram (prompt lookup, n = 3..1, k = 4: the fastest of k = 4 (40.1 tokens/s), k = 8 (37.2 tokens/s))</td>" in sharegpt
    assert "1: 30.5%" in sharegpt.replace("&nbsp;", " ")  # the n-gram's acceptance at position 1
    assert "0.77×" in sharegpt  # the n-gram's speedup over greedy
    assert "Drafter over the n-gram baseline: <strong>1.08×</strong> in tokens/s (43.5 against 40.1); 2.37 against 1.42 tokens per target forward" in sharegpt
    assert "1.57" in sharegpt and "41.3" in sharegpt  # per prompt
    assert "slower than the n-gram baseline" not in full_html
    humaneval = section.split('id="bench-2"')[1].split('id="bench-3"')[0]
    assert "n-gram" not in humaneval  # its JSON predates the baseline: the drafter's figures alone


def test_full_report_puts_the_measured_acceptance_beside_trainings_prediction(full_html):
    section = full_html.split('<section id="bench">')[1]
    sharegpt = section.split('id="bench-1"')[1].split('id="bench-2"')[0]
    assert ("Train-to-serve parity: measured acceptance length <strong>2.37</strong> (95% interval over its prompts 2.20–2.55) "
            "against <strong>2.60</strong> predicted by "
            "training (its decoder&#39;s rounds replayed over every turn) for k = 4 on 12 held-out cache samples: 8.8% below the prediction "
            "(the benchmark fails beyond 15.0%)") in sharegpt
    assert ("On this benchmark's own prompts: 2.37 measured against 2.50 walked over the 9 held-out cache samples of sharegpt "
            "(5.2% apart; other prompts, so recorded, not judged).") in sharegpt
    humaneval = section.split('id="bench-2"')[1].split('id="bench-3"')[0]
    assert "Train-to-serve parity" not in humaneval  # its JSON predates the gate
    assert "losslessness checked in float32 on the same prompts (2 of 2 identical); in bfloat16, 1 of 2 identical to greedy" in sharegpt
    assert "top two logits were at most 0.071 apart" in sharegpt
    assert ("Plain greedy (fused in max-autotune-no-cudagraphs mode) ran at 1.716 ms per token, <strong>1.16×</strong> a minimal "
            "autotuned (max-autotune-no-cudagraphs), graphed Llama step") in sharegpt
    assert "a minimal fused" not in humaneval
    assert "losslessness checked in float32" not in humaneval  # timed in float32 (or written before the check existed)


def test_report_without_any_ngram_block_renders_as_before(tmp_path):
    html = _write_full(tmp_path, ngram={"sharegpt": None})
    assert "n-gram" not in html
    assert "<strong>2.37</strong>" in html and "0.83×" in html and "yes: identical on 2 of 2 prompts" in html
    assert "<td>EAGLE-3 drafter</td>" in html


def test_ngram_faster_than_the_drafter_is_a_hint_and_a_divergence_is_a_warning(tmp_path):
    block = {**REPORT_BENCH["sharegpt"]["ngram"], "tokens_per_s": 50.0, "lossless": False,
             "per_prompt": [{"id": "s9", "identical": False, "first_divergence": 5}, {"id": "s8", "identical": True, "first_divergence": None}]}
    html = _write_full(tmp_path, ngram={"sharegpt": block})
    assert "The drafter is slower than the n-gram baseline here:" in html and "43.5 tokens/s with the drafter against 50.0 with prompt lookup" in html
    assert "0.87× <strong class=\"slow\">(slower)</strong>" in html
    assert "sharegpt: n-gram output differs from plain greedy on 1 of 2 prompts (s9 at new token 5)" in html
    assert "First divergence of the n-gram decode: <code>s9</code> at new token 5" in html


def test_full_report_shows_the_sweep_and_the_sglang_command_of_its_recommendation(full_html):
    section = full_html.split('<section id="bench">')[1]
    sharegpt = section.split('id="bench-1"')[1].split('id="bench-2"')[0]
    assert "<h4>Drafting settings</h4>" in sharegpt and "<th>speedup over n-gram</th>" in sharegpt
    rows = sharegpt.split("<h4>Drafting settings</h4>")[1].split("</table>")[0].split("<tr")[2:]
    assert [re.search(r"<td>(?:<strong>)?([^<]+)", r).group(1) for r in rows] == ["chain 4 (bench.draft_tokens)", "chain 3", "tree 5-4-8"]
    assert rows[2].startswith(' class="best"><td><strong>tree 5-4-8</strong> ★ recommended</td><td class="n">5, 4, 8</td>')
    assert "recommended" not in rows[0] + rows[1]
    tree = rows[2].replace("&nbsp;", " ")
    assert "2.91" in tree and "1: 80.0%, 2: 55.0%, 3: 30.0%, 4: 20.0%, 5: 6.0%" in tree and "47.9" in tree
    assert ("At the recommended setting the n-gram baseline was faster on <strong>1 of 2</strong> prompts: <code>s9</code> "
            "(0.94×; acceptance 2.80 against the n-gram's 1.57).") in sharegpt
    assert "0.91× <strong class=\"slow\">(slower)</strong>" in tree and "1.19×" in tree and "yes: identical on 2 of 2 prompts" in tree
    assert '<span class="muted">(0.85–0.97)</span>' in tree and "muted" not in rows[1].split("yes")[0]  # the interval where recorded
    assert '1.19× <span class="muted">(1.08–1.31)</span>' in tree  # and the n-gram ratio's
    assert "On these prompts it is not measurably faster than chain 4 (bench.draft_tokens)" in sharegpt
    assert "2.37" in rows[0] and "1: 71.0%" in rows[0].replace("&nbsp;", " ")  # the main chain's own figures
    assert "losslessness checked in float32" in sharegpt
    assert ("SGLang flags: <code>--speculative-algorithm EAGLE3 --speculative-num-steps 5 --speculative-eagle-topk 4 "
            "--speculative-num-draft-tokens 8</code>") in sharegpt
    assert re.search(
        r"<pre class=\"cmd\">python -m sglang\.launch_server --model-path /models/tiny-llama --host 127\.0\.0\.1 --port 30000 "
        r"--dtype bfloat16 --speculative-algorithm EAGLE3 --speculative-draft-model-path \S+/results/drafter "
        r"--speculative-num-steps 5 --speculative-eagle-topk 4 --speculative-num-draft-tokens 8</pre>", sharegpt)
    humaneval = section.split('id="bench-2"')[1].split('id="bench-3"')[0]
    assert "Drafting settings" not in humaneval  # its JSON predates the sweep
    serve = full_html.split('id="serve"')[1].split('<section id="bench">')[0]
    assert '<a href="#bench-1">sharegpt</a>: tree 5-4-8' in serve


def test_a_sweep_setting_that_changes_the_output_is_a_warning_and_never_recommended(tmp_path):
    block = json.loads(json.dumps(REPORT_BENCH["sharegpt"]["sweep"]))
    tree = block["settings"][1]
    tree.update(lossless=False, different=[{"id": "s8", "at": 11}])
    block["best"] = {**block["main"], "main_chain": True}
    block["sglang_flags"] = "--speculative-algorithm EAGLE3 --speculative-num-steps 4 --speculative-eagle-topk 1 --speculative-num-draft-tokens 5"
    html = _write_full(tmp_path, sweep={"sharegpt": block})
    assert "sharegpt: sweep setting tree 5-4-8 output differs from plain greedy on 1 of 2 prompts (s8 at new token 11)" in html
    assert "First divergence with tree 5-4-8: <code>s8</code> at new token 11" in html
    assert '<tr class="best"><td><strong>chain 4 (bench.draft_tokens)</strong> ★ recommended' in html and "the main chain itself" in html
    assert "<strong class=\"slow\">no</strong>: identical on 1 of 2 prompts" in html
    assert html.count('class="best"') == 1


def test_a_sweep_without_any_lossless_setting_recommends_nothing(tmp_path):
    block = {**REPORT_BENCH["sharegpt"]["sweep"], "best": None, "sglang_flags": None}
    html = _write_full(tmp_path, sweep={"sharegpt": block})
    assert "No setting is recommended:" in html and 'class="best"' not in html and "SGLang flags:" not in html


def test_report_without_any_sweep_block_renders_as_before(tmp_path):
    html = _write_full(tmp_path, sweep={"sharegpt": None})
    assert "Drafting settings" not in html and "recommended" not in html
    assert "<strong>2.37</strong>" in html and "<td>EAGLE-3 drafter</td>" in html and "yes: identical on 2 of 2 prompts" in html


def test_the_sweep_table_sets_training_prediction_beside_the_settings_training_walked(tmp_path):
    block = json.loads(json.dumps(REPORT_BENCH["sharegpt"]["sweep"]))
    block["settings"][0]["predicted"] = {"length": 2.5, "gap": 1 - 2.2 / 2.5, "form": "walked_first_turn_length", "eval_samples": 12}
    block["main"]["predicted"] = {"length": 2.2, "gap": 1 - 2.37 / 2.2, "form": "walked_first_turn_length", "eval_samples": 12}
    html = _write_full(tmp_path, sweep={"sharegpt": block})
    table = html.split("<h4>Drafting settings</h4>")[1].split("</table>")[0]
    assert "<th>training predicted</th>" in table
    main, chain, tree = table.split("<tr")[2:]
    assert '2.20 <span class="muted">(7.7% above)</span>' in main and '2.50 <span class="muted">(12.0% below)</span>' in chain
    assert '<td class="n">—</td>' in tree  # a tree training did not walk
    assert "the one-step trees (1, N, N)" in html.split("<h4>Drafting settings</h4>")[1]
    assert "training predicted" not in _write_full(tmp_path / "before", sweep={"sharegpt": REPORT_BENCH["sharegpt"]["sweep"]})  # JSONs without it


def test_warns_when_hidden_shards_disagree_and_drafter_template_differs(tmp_path):
    html = _write_full(
        tmp_path,
        hidden_override={("sharegpt", "0001"): {"aux_layer_ids": [2, 4, 5], "capture_indices": [3, 5, 6], "target_model_fingerprint": "d" * 64}},
        drafter_template=SHA_B,
    )
    assert "hidden-state shards disagree on the aux layer ids" in html
    assert "sharegpt/0001: [2, 4, 5]" in html
    assert "hidden-state shards disagree on the target model fingerprint" in html
    assert "drafter: template_sha256 bbbbbbbbbbbb differs from the tokens&#39; aaaaaaaaaaaa" in html
    assert "the drafter&#39;s eagle_aux_hidden_state_layer_ids [1, 3, 4] differ from the hidden-state cache&#39;s" in html
    assert "<strong class=\"slow\">NO</strong>" in html


def test_collect_back_half_is_plain_data(tmp_path):
    config, summaries, completions, tokens = report_inputs(tmp_path)
    figures = collect(config, summaries, completions, tokens, **report_back_half(tmp_path))
    json.dumps(figures)
    assert figures["hidden"]["total"]["tokens"] == sum(n[1] for n in REPORT_HIDDEN_SHARDS.values())
    assert figures["hidden"]["reference"]["bf16"] == 8 * REPORT_HIDDEN + 5
    assert figures["vocab"]["curve"]["coverage"][-1] == pytest.approx(1.0)
    assert figures["vocab"]["curve"]["sizes"][0] == 1 and figures["vocab"]["curve"]["coverage"][0] == pytest.approx(0.5)
    rows = {b["name"]: b for b in figures["bench"]["rows"]}
    assert rows["sharegpt"]["slower"] and not rows["sharegpt"]["error"]
    assert rows["sharegpt"]["ngram"]["tokens_per_s"] == 40.1 and rows["sharegpt"]["ngram"]["identical"] == 2
    assert rows["sharegpt"]["speedup_over_ngram"] == pytest.approx(43.5 / 40.1) and not rows["sharegpt"]["slower_than_ngram"]
    assert rows["humaneval"]["ngram"] is None and rows["humaneval"]["speedup_over_ngram"] is None
    sweep = rows["sharegpt"]["sweep"]
    assert sweep["best"]["label"] == "tree 5-4-8" and sweep["best"]["recommended"] and sweep["command_error"] is None
    assert [r["label"] for r in sweep["rows"]] == ["chain 4 (bench.draft_tokens)", "chain 3", "tree 5-4-8"] and sweep["rows"][0]["main"]
    assert sweep["ngram_faster"] == {"count": 1, "of": 2, "worst": [{"id": "s9", "acceptance": 2.8, "ngram_acceptance": 1.57, "ratio": 39.0 / 41.3}]}
    assert rows["humaneval"]["sweep"] is None
    assert rows["humaneval"]["error"] and rows["humaneval"]["identical"] == 3
    assert rows["chat"]["built"] and not rows["chat"]["measured"] and rows["chat"]["speedup"] is None
    assert not rows["missing"]["built"]
    assert figures["drafter"]["log"]["acc_per_step"][2][0] is None  # no positions at step 2 in the first window


def test_back_half_paths_that_do_not_exist_are_not_built(tmp_path):
    config, summaries, completions, tokens = report_inputs(tmp_path)
    out = tmp_path / "report.html"
    missing = tmp_path / "nothing"
    write_report(config, summaries, completions, tokens, str(out), vocab=str(missing / "v.safetensors"), hidden=[str(missing / "h.safetensors")],
                 drafter=str(missing / "drafter"), bench=[str(missing / "sharegpt.json")])
    html = out.read_text()
    for stage in ("draft vocab", "hidden states", "drafter", "benchmark"):
        assert f"{stage}: not built yet" in html
    assert "Draft vocabulary not built yet." in html and "Drafter not built yet." in html
    assert "No speedup or acceptance length has been measured" in html
    assert "WARNING" not in html


def test_foreign_and_broken_artifacts_are_warnings_that_name_the_file(tmp_path):
    import torch
    from safetensors.torch import save_file

    config, summaries, completions, tokens = report_inputs(tmp_path)
    kwargs = report_back_half(tmp_path)
    Path(kwargs["vocab"]).write_bytes(b"not safetensors")
    foreign = kwargs["hidden"][0]
    save_file({"x": torch.zeros(1)}, foreign, metadata={"other": "1"})  # a safetensors file eyrie did not write
    bad_meta = tmp_path / "results" / "completions" / "chat" / "0003.parquet"
    pq.write_table(pa.table({"n_turns": [1]}).replace_schema_metadata({b"eyrie": b"{not json"}), bad_meta)
    out = tmp_path / "report.html"
    write_report(config, summaries, completions + [str(bad_meta)], tokens, str(out), **kwargs)
    html = out.read_text()
    assert "draft_vocab.safetensors: not a readable safetensors file" in html
    assert f"{foreign}: not an eyrie hidden-state cache (no manifest in its metadata)" in html
    assert "0003.parquet: its eyrie metadata is not JSON" in html
    assert "Draft vocabulary not built yet." in html and "hidden states: 2 of 4 shards" in html


def test_serve_command_uses_the_schema_default_before_any_benchmark(tmp_path):
    from eyrie.core.schema import section_defaults

    config, summaries, completions, tokens = report_inputs(tmp_path)
    kwargs = {**report_back_half(tmp_path), "bench": []}
    drafter = collect(config, summaries, completions, tokens, **kwargs)["drafter"]
    k = section_defaults("bench")["draft_tokens"]
    assert drafter["serve_draft_tokens"] == k and "default" in drafter["serve_draft_tokens_source"]
    assert f"--speculative-num-steps {k} --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}" in drafter["serve_command"]
