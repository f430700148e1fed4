"""The front half of the page as plain dicts: prompts (the datasets table), completions, tokens.

Reads the prepare stage's summary.json files and the completion and token Parquet shards
(only the columns the page counts, plus each shard's eyrie metadata), and sums them per shard,
per dataset and overall. Each file is checked against its content digest first (eyrie.core.digest).
An input that cannot be read, or no longer matches its digest, becomes a warning in its section
naming the file and the command that rebuilds it, never an exception: the page still shows
everything else.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from eyrie.core.artifacts import ArtifactError, check, parquet_metadata, read_json
from eyrie.tokens.shards import WRITTEN_BY as TOKENS_WRITTEN_BY
from eyrie.report.formats import fmt_num
from eyrie.report.values import distinct, rate, share, warn

LENGTH_HINT_SHARE = 0.20  # above this share of turns cut at max_new_tokens, the drafter learns from clipped answers
HISTOGRAM_BINS = 40

COMPLETION_COLUMNS = ("n_turns", "finish_reason", "finish_reasons", "prompt_tokens", "completion_tokens", "seconds")
TOKEN_COLUMNS = ("n_tokens", "n_assistant_tokens", "truncated")


# ---------------------------------------------------------------- reading inputs


def read_summaries(paths: Iterable[str], warnings: list) -> dict[str, dict]:
    """{dataset: summary} from the prepare stage's summary.json files; one that cannot be read is a warning."""
    summaries = {}
    for path in paths:
        try:
            summary = read_json(path, written_by=f"build_prompts_{Path(path).parent.name}")
        except ArtifactError as err:
            warn(warnings, "datasets", f"could not read prompt summary {err}")
            continue
        if not isinstance(summary, dict):
            warn(warnings, "datasets", f"prompt summary {path} is not a JSON object")
            continue
        summaries[str(summary.get("dataset") or Path(path).parent.name)] = summary
    return summaries


def read_completions(paths: Iterable[str], warnings: list) -> list[dict]:
    """The completion shards that can be read (see _read_shard)."""
    return [s for p in paths if (s := _read_shard(p, COMPLETION_COLUMNS, "regeneration", warnings, "regenerate_shard"))]


def read_tokens(paths: Iterable[str], warnings: list) -> list[dict]:
    """The token shards that can be read (see _read_shard)."""
    return [s for p in paths if (s := _read_shard(p, TOKEN_COLUMNS, "tokens", warnings, TOKENS_WRITTEN_BY))]


def _read_shard(path: str, columns: Iterable[str], section: str, warnings: list, written_by: str) -> dict | None:
    """One Parquet shard as {dataset, shard, meta, columns, records}; None (and a warning) if unreadable or not as written."""
    try:
        check(path, "parquet", written_by=written_by)
    except ArtifactError as err:
        warn(warnings, section, f"could not read {err}")
        return None
    try:
        parquet = pq.ParquetFile(path)
        present = set(parquet.schema_arrow.names)
        table = parquet.read(columns=[c for c in columns if c in present])
    except (OSError, ValueError, pa.ArrowException) as err:
        warn(warnings, section, f"could not read {path}: {err}")
        return None
    meta = _shard_metadata(parquet.schema_arrow.metadata, path, section, warnings)
    return {
        "path": str(path),
        "dataset": str(meta.get("dataset") or Path(path).parent.name),
        "shard": str(meta.get("shard") or Path(path).stem),
        "meta": meta,
        "columns": table.to_pydict(),
        "records": table.num_rows,
    }


def _shard_metadata(schema_metadata: dict | None, path: str, section: str, warnings: list) -> dict:
    """The shard's eyrie metadata; {} (and a warning) when it has none or it is broken."""
    try:
        meta = parquet_metadata(schema_metadata, path)
    except ArtifactError as err:
        warn(warnings, section, str(err))
        return {}
    if not meta:
        warn(warnings, section, f"{path} has no eyrie metadata; settings and template are unknown for it")
    return meta


def _first_record(path: str) -> dict | None:
    """The first conversation of a completion shard, read alone so big shards stay cheap."""
    try:
        parquet = pq.ParquetFile(path)
        for group in range(parquet.num_row_groups):
            table = parquet.read_row_group(group, columns=["id", "messages"])
            if table.num_rows:
                return table.slice(0, 1).to_pylist()[0]
    except (OSError, ValueError, KeyError, pa.ArrowException):
        return None
    return None


def dataset_order(config: dict, summaries: dict, *shard_lists: list[dict]) -> list[str]:
    """Config order first, then any dataset found only in the inputs."""
    names = list((config.get("datasets") or {}).keys())
    found = list(summaries) + [s["dataset"] for shards in shard_lists for s in shards]
    return names + sorted({n for n in found if n not in names})


def expected_shards(config: dict, dataset: str) -> int | None:
    """How many shards the config asks for `dataset`; None for a dataset the config does not name."""
    entry = (config.get("datasets") or {}).get(dataset)
    return int(entry.get("shards", 1)) if isinstance(entry, dict) else None


# ---------------------------------------------------------------- datasets table


def datasets_section(order: list[str], summaries: dict) -> dict[str, Any]:
    """The datasets table: what the prepare stage read, skipped and kept, per dataset and in total."""
    rows = [_dataset_row(name, summaries.get(name)) for name in order]
    keys = ("records_read", "bad_total", "duplicates", "usable", "used", "heldout", "train")
    total = {k: sum(r[k] or 0 for r in rows if r["built"]) for k in keys}
    return {"rows": rows, "total": total}


def _dataset_row(name: str, summary: dict | None) -> dict[str, Any]:
    if summary is None:
        return {"name": name, "built": False, **{k: None for k in ("records_read", "bad_total", "duplicates", "usable", "used", "heldout", "train")}}
    bad = {str(k): int(v) for k, v in (summary.get("bad_records") or {}).items()}
    truncation = summary.get("truncation")
    return {
        "name": name,
        "built": True,
        "source": str(summary.get("source") or ""),
        "format": str(summary.get("format") or ""),
        "records_read": summary.get("records_read"),
        "truncation": truncation,
        "truncation_note": _truncation_note(truncation),
        "bad_records": bad,
        "bad_total": sum(bad.values()),
        "bad_examples": [str(e) for e in summary.get("bad_examples") or []],
        "duplicates": summary.get("duplicates"),
        "repeated_first_turns": summary.get("repeated_first_turns"),  # None: not deduplicated by first turn
        "usable": summary.get("usable"),
        "limit": summary.get("limit"),
        "used": summary.get("used"),
        "heldout": summary.get("heldout"),
        "train": summary.get("train"),
        "shards": {str(k): int(v) for k, v in sorted((summary.get("shards") or {}).items())},
        "roles_seen": {str(k): int(v) for k, v in (summary.get("roles_seen") or {}).items()},
        # messages with reasoning, with tool calls, tool calls, tool results, records with tools (eyrie.data.prompts)
        "agentic": {str(k): int(v) for k, v in (summary.get("agentic") or {}).items()},
        "synthetic": _synthetic(summary.get("synthetic")),
        "rework": _rework(summary.get("rework")),
    }


SYNTHETIC_DROPS = ("duplicates", "empty", "too_short", "too_long")


def _synthetic(made: Any) -> dict[str, Any] | None:
    """How the target wrote a synthetic dataset's prompts (eyrie.data.synthetic): samples, kept, drops, examples."""
    if not isinstance(made, dict):
        return None

    def count(key: str) -> int:
        return int(made.get(key) or 0)

    return {
        "count": count("count"),
        "samples": count("samples"),
        "kept": count("kept"),
        "dropped": {key: count(key) for key in SYNTHETIC_DROPS if count(key)},
        "unused": count("unused"),
        "topics": [str(t) for t in made.get("topics") or []],
        "topic_as": str(made.get("topic_as") or ""),
        "examples": [{"topic": str(e.get("topic") or ""), "text": str(e.get("text") or "")}
                     for e in made.get("examples") or [] if isinstance(e, dict)],
    }


def _rework(counts: Any) -> dict[str, int] | None:
    """What a rework dataset made of its source's replies (eyrie.data.rework.ReworkCounts)."""
    if not isinstance(counts, dict):
        return None
    return {key: int(counts.get(key) or 0) for key in ("records_read", "made", "heldout_skipped", "without_text", "instructions")}


def _truncation_note(truncation: dict | None) -> str | None:
    if not truncation:
        return None
    where = f"byte {fmt_num(truncation.get('byte_offset'))} (line {fmt_num(truncation.get('line'))})"
    recovered = fmt_num(truncation.get("records_before"))
    return f"the file is truncated: it breaks at {where}; {recovered} records before the break were recovered"


# ---------------------------------------------------------------- completions (regeneration)


def regeneration_section(order: list[str], shards: list[dict], config: dict, warnings: list) -> dict[str, Any]:
    """The completions section: per shard, per dataset and overall sums, finish reasons, turn lengths, a sample."""
    by_dataset = _group(shards)
    datasets = [_completion_dataset(n, by_dataset[n], config, warnings) for n in order if n in by_dataset]
    shard_rows = [_completion_shard_row(s) for n in order for s in by_dataset.get(n, [])]
    _warn_fingerprints(shards, warnings)
    return {"datasets": datasets, "shards": shard_rows, "total": _completion_total(datasets)}


def _group(shards: list[dict]) -> dict[str, list[dict]]:
    grouped: dict[str, list[dict]] = {}
    for shard in sorted(shards, key=lambda s: s["shard"]):
        grouped.setdefault(shard["dataset"], []).append(shard)
    return grouped


def _completion_shard_row(shard: dict) -> dict[str, Any]:
    cols = shard["columns"]
    completion = sum(sum(turns or []) for turns in cols.get("completion_tokens", []))
    seconds = float(sum(s or 0.0 for s in cols.get("seconds", [])))
    return {
        "dataset": shard["dataset"],
        "shard": shard["shard"],
        "records": shard["records"],
        "turns": int(sum(n or 0 for n in cols.get("n_turns", []))),
        "completion_tokens": int(completion),
        "prompt_tokens": int(sum(sum(turns or []) for turns in cols.get("prompt_tokens", []))),
        "generation_seconds": seconds,
        "tokens_per_second": rate(completion, seconds),
        "resumed_turns": int((shard["meta"].get("stats") or {}).get("resumed_turns") or 0),
    }


def _completion_dataset(name: str, shards: list[dict], config: dict, warnings: list) -> dict[str, Any]:
    rows = [_completion_shard_row(s) for s in shards]
    sums = {k: sum(r[k] for r in rows) for k in ("records", "turns", "completion_tokens", "prompt_tokens", "generation_seconds", "resumed_turns")}
    reasons = _finish_reasons(shards)
    settings, settings_source = _effective_settings(name, shards, config, warnings)
    lengths = _turn_lengths(shards)
    length_share = share(reasons.get("length", 0), sum(reasons.values()))
    return {
        "name": name,
        **sums,
        "shards": len(shards),
        "shards_expected": expected_shards(config, name),
        "empty_shards": [r["shard"] for r in rows if r["records"] == 0],
        "tokens_per_second": rate(sums["completion_tokens"], sums["generation_seconds"]),
        "finish_reasons": reasons,
        "length_share": length_share,
        "length_hint": _length_hint(length_share, reasons.get("length", 0), settings.get("max_new_tokens")),
        "lengths": _length_stats(lengths),
        "histogram": _histogram(lengths, settings.get("max_new_tokens")),
        "settings": settings,
        "settings_source": settings_source,
        "replies": settings.get("replies", "target"),
        "model_fingerprint": distinct(s["meta"].get("model_fingerprint") for s in shards),
        "answered_by": distinct(answered_by(s["meta"]) for s in shards),
        # Why engine.batching: static ran padded instead (TransformersEngine.fallback): what made regeneration slower.
        "batching_fallback": distinct(((s["meta"].get("stats") or {}).get("run") or {}).get("batching_fallback") for s in shards),
        "template_sha256": distinct(s["meta"].get("template_sha256") for s in shards),
        "templates_by_shard": {s["shard"]: s["meta"].get("template_sha256") for s in shards},
        "sample": _sample(shards),
    }


def answered_by(meta: dict) -> str | None:
    """What answered a completions shard: the engine, and for a server the model it served (eyrie.generation.openai_engine's
    identity); a shard whose turns all came from its resume log says so."""
    served = meta.get("served") or {}
    engine = ((meta.get("stats") or {}).get("run") or {}).get("engine") or served.get("engine")
    if served.get("model"):
        return f"{engine or 'openai'}: {served['model']}"
    return engine or ("resume log" if meta.get("stats") else None)


def _completion_total(datasets: list[dict]) -> dict[str, Any]:
    keys = ("records", "turns", "completion_tokens", "prompt_tokens", "generation_seconds", "resumed_turns")
    total: dict[str, Any] = {k: sum(d[k] for d in datasets) for k in keys}
    reasons: Counter = Counter()
    for dataset in datasets:
        reasons.update(dataset["finish_reasons"])
    total["tokens_per_second"] = rate(total["completion_tokens"], total["generation_seconds"])
    total["finish_reasons"] = dict(reasons.most_common())
    total["length_share"] = share(reasons.get("length", 0), sum(reasons.values()))
    return total


def _finish_reasons(shards: list[dict]) -> dict[str, int]:
    """Per turn when the shard has finish_reasons, else per record from finish_reason."""
    counts: Counter = Counter()
    for shard in shards:
        cols = shard["columns"]
        if "finish_reasons" in cols:
            counts.update(str(r) for turns in cols["finish_reasons"] for r in turns or [])
        else:
            counts.update(str(r) for r in cols.get("finish_reason", []) if r is not None)
    return dict(counts.most_common())


def _turn_lengths(shards: list[dict]) -> list[int]:
    """Completion tokens of every generated turn; turns skipped as prompt_too_long are not lengths."""
    lengths = []
    for shard in shards:
        cols = shard["columns"]
        reasons = cols.get("finish_reasons") or [None] * shard["records"]
        for tokens, why in zip(cols.get("completion_tokens", []), reasons):
            tokens = tokens or []
            why = why if why and len(why) == len(tokens) else [None] * len(tokens)
            lengths += [int(t) for t, r in zip(tokens, why) if r != "prompt_too_long"]
    return lengths


def _length_stats(lengths: list[int]) -> dict[str, Any]:
    if not lengths:
        return {"turns": 0, "mean": None, "median": None, "p90": None, "max": None}
    values = np.asarray(lengths)
    return {
        "turns": len(lengths),
        "mean": float(values.mean()),
        "median": float(np.median(values)),
        "p90": float(np.percentile(values, 90)),
        "max": int(values.max()),
    }


def _histogram(lengths: list[int], cap: Any) -> dict[str, Any]:
    if not lengths:
        return {"edges": [], "counts": [], "cap": cap}
    top = max(max(lengths), int(cap) if isinstance(cap, int) else 0, 1)
    counts, edges = np.histogram(lengths, bins=min(HISTOGRAM_BINS, top), range=(0, top))
    return {"edges": [float(e) for e in edges], "counts": [int(c) for c in counts], "cap": cap}


def _length_hint(share: float | None, cut: int, max_new_tokens: Any) -> str | None:
    if share is None or share <= LENGTH_HINT_SHARE:
        return None
    now = f" (now {max_new_tokens})" if max_new_tokens is not None else ""
    return (
        f"{share:.0%} of turns ({cut:,}) stopped at the length limit: "
        f"consider raising generation.max_new_tokens{now}, or the drafter trains on clipped answers."
    )


def _effective_settings(name: str, shards: list[dict], config: dict, warnings: list) -> tuple[dict, str]:
    """The settings the shards were generated with; the config's when no shard says."""
    recorded = [s["meta"]["settings"] for s in shards if isinstance(s["meta"].get("settings"), dict)]
    configured = _configured_settings(config, name)
    if not recorded:
        return configured, "config (no shard recorded its settings)"
    if len({json.dumps(r, sort_keys=True) for r in recorded}) > 1:
        warn(warnings, "regeneration", f"{name}: completion shards were generated with different settings")
    used = dict(sorted(recorded[0].items()))
    # replies is recorded only where a dataset keeps its source's (eyrie.config.generation_settings): compared both ways.
    changed = [k for k in configured if k in used and configured[k] != used[k]]
    if configured.get("replies", "target") != used.get("replies", "target"):
        changed.append("replies")
        used.setdefault("replies", "target")
        configured.setdefault("replies", "target")
    if changed:
        diff = ", ".join(f"{k}: made with {used[k]!r}, config now {configured[k]!r}" for k in changed)
        warn(warnings, "regeneration", f"{name}: config no longer matches the completions ({diff}); a rerun regenerates them")
    return used, "completion shards"


def _configured_settings(config: dict, dataset: str) -> dict:
    settings = dict(config.get("generation") or {})
    spec = (config.get("datasets") or {}).get(dataset) or {}
    settings.update(spec.get("generation") or {})
    if spec.get("replies") == "source":
        settings["replies"] = "source"
    return dict(sorted(settings.items()))


def _sample(shards: list[dict]) -> dict | None:
    """One regenerated conversation to eyeball, clipped per message."""
    for shard in shards:
        record = _first_record(shard["path"]) if shard["records"] else None
        if record:
            messages = [{"role": str(m.get("role")), "content": str(m.get("content") or "")} for m in record.get("messages") or []]
            return {"id": str(record.get("id")), "shard": shard["shard"], "messages": messages}
    return None


def _warn_fingerprints(shards: list[dict], warnings: list) -> None:
    prints = distinct(s["meta"].get("model_fingerprint") for s in shards)
    if len(prints) > 1:
        warn(warnings, "regeneration", f"completion shards come from different models (fingerprints {', '.join(prints)})")


# ---------------------------------------------------------------- tokens


def tokens_section(order: list[str], shards: list[dict], config: dict) -> dict[str, Any]:
    """The tokens section: token and assistant-token counts, truncations and drops, per dataset and overall."""
    by_dataset = _group(shards)
    datasets = [_token_dataset(n, by_dataset[n], config) for n in order if n in by_dataset]
    keys = ("records", "tokens", "assistant_tokens", "truncated", "dropped_total")
    total: dict[str, Any] = {k: sum(d[k] for d in datasets) for k in keys}
    total["assistant_share"] = share(total["assistant_tokens"], total["tokens"])
    return {"datasets": datasets, "total": total}


def _token_dataset(name: str, shards: list[dict], config: dict) -> dict[str, Any]:
    tokens = sum(sum(n or 0 for n in s["columns"].get("n_tokens", [])) for s in shards)
    assistant = sum(sum(n or 0 for n in s["columns"].get("n_assistant_tokens", [])) for s in shards)
    dropped: Counter = Counter()
    for shard in shards:
        dropped.update({str(k): int(v) for k, v in ((shard["meta"].get("stats") or {}).get("dropped") or {}).items()})
    return {
        "name": name,
        "shards": len(shards),
        "shards_expected": expected_shards(config, name),
        "empty_shards": [s["shard"] for s in shards if s["records"] == 0],
        "records": sum(s["records"] for s in shards),
        "tokens": int(tokens),
        "assistant_tokens": int(assistant),
        "assistant_share": share(assistant, tokens),
        "truncated": int(sum(sum(bool(t) for t in s["columns"].get("truncated", [])) for s in shards)),
        "dropped": dict(dropped.most_common()),
        "dropped_total": sum(dropped.values()),
        "per_turn": _per_turn(shards),
        "max_seq_len": distinct(s["meta"].get("max_seq_len") for s in shards),
        "template_sha256": distinct(s["meta"].get("template_sha256") for s in shards),
        "templates_by_shard": {s["shard"]: s["meta"].get("template_sha256") for s in shards},
    }


PER_TURN_KEYS = ("per_turn_records", "turn_samples", "per_turn_tokens", "per_turn_tokens_as_one_sample", "unstable_turns")


def _per_turn(shards: list[dict]) -> dict[str, Any] | None:
    """Samples of conversations the template renders unstably, one per assistant turn (eyrie.target.chat_template), and
    what they cost the hidden-state cache; None where there are none."""
    totals = {k: sum(int((s["meta"].get("stats") or {}).get(k) or 0) for s in shards) for k in PER_TURN_KEYS}
    if not totals["per_turn_records"] and not totals["unstable_turns"]:
        return None
    examples = [e for s in shards for e in (s["meta"].get("stats") or {}).get("unstable_examples") or []][:5]
    return {**totals, "unstable_examples": examples}
