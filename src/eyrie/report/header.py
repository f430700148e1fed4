"""The page's header: which model, and for each pipeline stage whether it is built and how far.

A stage whose output is missing is listed as "not built yet"; the page never shows a number
that no stage measured.
"""

from __future__ import annotations

from eyrie.report.collect_data import expected_shards
from eyrie.report.formats import fmt_num, fmt_pct

STAGE_NAMES = ("prompts", "completions", "tokens", "draft vocab", "hidden states", "drafter", "benchmark")


def model_header(config: dict) -> dict[str, str]:
    """The target's name and where it comes from (a directory, or a GGUF package member)."""
    model = config.get("model") or {}
    gguf = model.get("gguf") or {}
    source = model.get("path") or (f"{gguf.get('package')} : {gguf.get('member')}" if gguf else "unknown")
    return {"name": str(model.get("name") or "unknown"), "source": str(source)}


def stages_header(
    config: dict, summaries: dict, completion_shards: list, token_shards: list,
    vocab: dict | None, hidden: dict, drafter: dict | None, bench: dict,
) -> list[dict]:
    """One line per pipeline stage: built or not, and how far (shards, tokens, steps, benchmarks)."""
    configured = list((config.get("datasets") or {}).keys())
    shards_expected = sum(expected_shards(config, name) or 0 for name in configured)
    measured = [b for b in bench["rows"] if b["built"]]
    errors = sum(1 for b in measured if b["error"])
    details = {
        "prompts": (bool(summaries), f"{len(summaries)} of {len(configured)} datasets"),
        "completions": (bool(completion_shards), f"{len(completion_shards)} of {shards_expected} shards"),
        "tokens": (bool(token_shards), f"{len(token_shards)} of {shards_expected} shards"),
        "draft vocab": (vocab is not None, f"{fmt_num((vocab or {}).get('draft_vocab_size'))} tokens, {fmt_pct((vocab or {}).get('coverage'))} coverage"),
        "hidden states": (
            (drafter is not None, "computed in the training job (hidden.mode online), no cache")
            if hidden.get("mode") == "online"
            else (bool(hidden["shards"]), f"{len(hidden['shards'])} of {hidden['expected']} shards")
        ),
        "drafter": (drafter is not None, f"{fmt_num(((drafter or {}).get('metrics') or {}).get('steps'))} training steps"),
        "benchmark": (bool(measured), f"{len(measured)} of {len(bench['rows'])} benchmarks" + (f", {errors} with an error" if errors else "")),
    }
    return [{"name": name, "built": details[name][0], "detail": details[name][1]} for name in STAGE_NAMES]
