"""Write report.html: one self-contained HTML page of what the pipeline has built so far.

`write_report` is the report job (scripts/write_report.py runs it): `collect` reads the config
and every stage output that exists into a plain dict of numbers, part by part in the order the
page shows them; the plots are drawn from that dict, the template renders both, and the page is
written atomically. Nothing on the page needs the network, and the page never shows a number
that no stage measured: a stage whose output is missing is listed as "not built yet", and an
output that cannot be read is a warning in its section, never a crash.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Iterable

from eyrie.core.atomic import write_text_atomically
from eyrie.report.collect_data import (
    dataset_order,
    datasets_section,
    read_completions,
    read_summaries,
    read_tokens,
    regeneration_section,
    tokens_section,
)
from eyrie.report.collect_model import bench_section, drafter_section, hidden_section, vocab_section
from eyrie.report.consistency import across_stages, completions_against_tokens
from eyrie.report.header import model_header, stages_header
from eyrie.report.page import render
from eyrie.report.plots import draw
from eyrie.report.provenance import provenance


def write_report(
    config: dict,
    prompt_summaries: list[str],
    completions: list[str],
    tokens: list[str],
    out_path: str,
    *,
    vocab: str | None = None,
    hidden: list[str] | None = None,
    drafter: str | None = None,
    bench: list[str] | None = None,
) -> None:
    """Write the HTML report for whatever stage outputs exist to `out_path`.

    vocab: the draft vocabulary (.safetensors); hidden: hidden-state cache shards (.safetensors);
    drafter: the drafter directory (config.json, training_log.json); bench: benchmark JSONs.
    A path that does not exist is a stage not built yet; one that exists but cannot be read is a warning.
    """
    figures = collect(config, prompt_summaries, completions, tokens, vocab=vocab, hidden=hidden, drafter=drafter, bench=bench)
    write_text_atomically(out_path, render(figures, draw(figures)))


def collect(
    config: dict,
    prompt_summaries: Iterable[str],
    completions: Iterable[str],
    tokens: Iterable[str],
    *,
    vocab: str | None = None,
    hidden: Iterable[str] | None = None,
    drafter: str | None = None,
    bench: Iterable[str] | None = None,
) -> dict[str, Any]:
    """The plain dict of figures the template renders (no plots, no markup): the page's table of contents."""
    warnings: list[dict[str, str]] = []
    summaries = read_summaries(prompt_summaries, warnings)
    completion_shards = read_completions(completions, warnings)
    token_shards = read_tokens(tokens, warnings)
    order = dataset_order(config, summaries, completion_shards, token_shards)
    regeneration = regeneration_section(order, completion_shards, config, warnings)
    token_figures = tokens_section(order, token_shards, config)
    completions_against_tokens(regeneration, token_figures, warnings)

    vocab_figures = vocab_section(vocab, warnings)
    hidden_figures = hidden_section([str(p) for p in hidden or []], order, warnings)
    hidden_figures["mode"] = (config.get("hidden") or {}).get("mode", "offline")  # online: the training job ran the target, no cache
    bench_figures = bench_section([str(p) for p in bench or []], warnings, config, drafter)
    drafter_figures = drafter_section(drafter, config, bench_figures, warnings)  # after bench: it serves the k the benchmarks measured
    consistency = across_stages(token_figures, vocab_figures, hidden_figures, drafter_figures, bench_figures, warnings)
    return {
        "model": model_header(config),
        "generated_at": datetime.now().astimezone().isoformat(timespec="seconds"),
        "stages": stages_header(config, summaries, completion_shards, token_shards, vocab_figures, hidden_figures, drafter_figures, bench_figures),
        "warnings": warnings,
        "datasets": datasets_section(order, summaries),
        "regeneration": regeneration,
        "tokens": token_figures,
        "vocab": vocab_figures,
        "hidden": hidden_figures,
        "drafter": drafter_figures,
        "bench": bench_figures,
        "consistency": consistency,
        "provenance": provenance(config),
    }
