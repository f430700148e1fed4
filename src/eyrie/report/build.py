"""Render one self-contained HTML page of what the pipeline has built so far.

`collect` turns the stage outputs (prompt summaries, completion shards, token
shards, the draft vocabulary, hidden-state cache headers, the drafter directory
and the benchmark JSONs) and the config into a plain dict of numbers;
`write_report` draws the plots from that dict, renders templates/report.html.j2
and writes the page atomically. Nothing on the page needs the network, and the
page never shows a number that no stage measured: a stage whose output is
missing is listed as "not built yet". Safetensors files are read by their
header only (the vocabulary's `counts`, one int64 per target token, excepted).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import io
import json
import os
import platform
import re
import shlex
import subprocess
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable

import jinja2
import matplotlib
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from markupsafe import Markup
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

import eyrie
from eyrie.core.atomic import write_text_atomically

REPO_ROOT = Path(eyrie.__file__).resolve().parents[2]
TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"
TEMPLATE_NAME = "report.html.j2"

PACKAGES = ("torch", "transformers", "safetensors", "snakemake", "datasets", "pyarrow", "pandas", "eyrie")
STAGE_NAMES = ("prompts", "completions", "tokens", "draft vocab", "hidden states", "drafter", "benchmark")
MANIFEST_KEY = "manifest"  # eyrie.data.vocab and eyrie.hidden.cache keep their JSON manifest under this metadata key
SERVE_PORT = 30000  # SGLang's default port, for the command shown on the page
DEFAULT_DRAFT_TOKENS = 4  # schemas/config.schema.yaml bench.draft_tokens
PLOT_POINTS = 400  # curves are thinned to about this many points: enough to read, light enough to embed
ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
FP8_DTYPE = "float8_e4m3fn"
LENGTH_HINT_SHARE = 0.20  # above this share of turns cut at max_new_tokens, the drafter learns from clipped answers
HISTOGRAM_BINS = 40
SAMPLE_CHARS = 1500  # enough of a message to judge it, short enough to keep the page light

COMPLETION_COLUMNS = ("n_turns", "finish_reason", "finish_reasons", "prompt_tokens", "completion_tokens", "seconds")
TOKEN_COLUMNS = ("n_tokens", "n_assistant_tokens", "truncated")


# ---------------------------------------------------------------- entry points


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
    write_text_atomically(out_path, render(figures))


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
    """The plain dict of figures the template renders (no plots, no markup)."""
    warnings: list[dict[str, str]] = []
    summaries = _read_summaries(prompt_summaries, warnings)
    completion_shards = [s for p in completions if (s := _read_shard(p, COMPLETION_COLUMNS, "regeneration", warnings))]
    token_shards = [s for p in tokens if (s := _read_shard(p, TOKEN_COLUMNS, "tokens", warnings))]
    order = _dataset_order(config, summaries, completion_shards, token_shards)
    regeneration = _regeneration(order, completion_shards, config, warnings)
    token_figures = _tokens(order, token_shards, config)
    _warn_template_mismatch(regeneration, token_figures, warnings)

    hidden_paths = [str(p) for p in hidden or []]
    bench_paths = [str(p) for p in bench or []]
    vocab_figures = _vocab(vocab, warnings)
    hidden_figures = _hidden(hidden_paths, order, warnings)
    bench_figures = _bench(bench_paths, warnings)
    drafter_figures = _drafter(drafter, config, bench_figures, warnings)
    consistency = _consistency(token_figures, vocab_figures, hidden_figures, drafter_figures, bench_figures, warnings)
    return {
        "model": _model(config),
        "generated_at": datetime.now().astimezone().isoformat(timespec="seconds"),
        "stages": _stages(config, summaries, completion_shards, token_shards, vocab_figures, hidden_figures, drafter_figures, bench_figures),
        "warnings": warnings,
        "datasets": _datasets(order, summaries),
        "regeneration": regeneration,
        "tokens": token_figures,
        "vocab": vocab_figures,
        "hidden": hidden_figures,
        "drafter": drafter_figures,
        "bench": bench_figures,
        "consistency": consistency,
        "provenance": _provenance(config),
    }


def render(figures: dict[str, Any]) -> str:
    """The HTML page for `figures` as returned by `collect`."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATE_DIR),
        autoescape=True,  # explicit: select_autoescape would not match the .j2 suffix
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(num=_fmt_num, pct=_fmt_pct, clip=_clip, size=_fmt_bytes)
    return env.get_template(TEMPLATE_NAME).render(f=figures, plots=_plots(figures))


# ---------------------------------------------------------------- reading inputs


def _read_summaries(paths: Iterable[str], warnings: list) -> dict[str, dict]:
    summaries = {}
    for path in paths:
        try:
            summary = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            _warn(warnings, "datasets", f"could not read prompt summary {path}: {err}")
            continue
        if not isinstance(summary, dict):
            _warn(warnings, "datasets", f"prompt summary {path} is not a JSON object")
            continue
        summaries[str(summary.get("dataset") or Path(path).parent.name)] = summary
    return summaries


def _read_shard(path: str, columns: Iterable[str], section: str, warnings: list) -> dict | None:
    """One Parquet shard as {dataset, shard, meta, columns, records}; None (and a warning) if unreadable."""
    try:
        parquet = pq.ParquetFile(path)
        present = set(parquet.schema_arrow.names)
        table = parquet.read(columns=[c for c in columns if c in present])
    except (OSError, ValueError, pa.ArrowException) as err:
        _warn(warnings, section, f"could not read {path}: {err}")
        return None
    meta = _eyrie_metadata(parquet.schema_arrow.metadata, path, section, warnings)
    return {
        "path": str(path),
        "dataset": str(meta.get("dataset") or Path(path).parent.name),
        "shard": str(meta.get("shard") or Path(path).stem),
        "meta": meta,
        "columns": table.to_pydict(),
        "records": table.num_rows,
    }


def _eyrie_metadata(metadata: dict | None, path: str, section: str, warnings: list) -> dict:
    raw = (metadata or {}).get(b"eyrie")
    if raw is None:
        _warn(warnings, section, f"{path} has no eyrie metadata; settings and template are unknown for it")
        return {}
    try:
        meta = json.loads(raw)
    except ValueError as err:
        _warn(warnings, section, f"{path}: eyrie metadata is not JSON: {err}")
        return {}
    return meta if isinstance(meta, dict) else {}


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


def _dataset_order(config: dict, summaries: dict, *shard_lists: list[dict]) -> list[str]:
    """Config order first, then any dataset found only in the inputs."""
    names = list((config.get("datasets") or {}).keys())
    found = list(summaries) + [s["dataset"] for shards in shard_lists for s in shards]
    return names + sorted({n for n in found if n not in names})


# ---------------------------------------------------------------- header


def _model(config: dict) -> dict[str, str]:
    model = config.get("model") or {}
    gguf = model.get("gguf") or {}
    source = model.get("path") or (f"{gguf.get('package')} : {gguf.get('member')}" if gguf else "unknown")
    return {"name": str(model.get("name") or "unknown"), "source": str(source)}


def _stages(
    config: dict, summaries: dict, completion_shards: list, token_shards: list,
    vocab: dict | None, hidden: dict, drafter: dict | None, bench: dict,
) -> list[dict]:
    configured = list((config.get("datasets") or {}).keys())
    expected_shards = sum(_expected_shards(config, name) or 0 for name in configured)
    measured = [b for b in bench["rows"] if b["built"]]
    errors = sum(1 for b in measured if b["error"])
    details = {
        "prompts": (bool(summaries), f"{len(summaries)} of {len(configured)} datasets"),
        "completions": (bool(completion_shards), f"{len(completion_shards)} of {expected_shards} shards"),
        "tokens": (bool(token_shards), f"{len(token_shards)} of {expected_shards} shards"),
        "draft vocab": (vocab is not None, f"{_fmt_num((vocab or {}).get('draft_vocab_size'))} tokens, {_fmt_pct((vocab or {}).get('coverage'))} coverage"),
        "hidden states": (bool(hidden["shards"]), f"{len(hidden['shards'])} of {hidden['expected']} shards"),
        "drafter": (drafter is not None, f"{_fmt_num(((drafter or {}).get('metrics') or {}).get('steps'))} training steps"),
        "benchmark": (bool(measured), f"{len(measured)} of {len(bench['rows'])} benchmarks" + (f", {errors} with an error" if errors else "")),
    }
    return [{"name": name, "built": details[name][0], "detail": details[name][1]} for name in STAGE_NAMES]


def _expected_shards(config: dict, dataset: str) -> int | None:
    entry = (config.get("datasets") or {}).get(dataset)
    return int(entry.get("shards", 1)) if isinstance(entry, dict) else None


# ---------------------------------------------------------------- datasets table


def _datasets(order: list[str], summaries: dict) -> dict[str, Any]:
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
        "usable": summary.get("usable"),
        "limit": summary.get("limit"),
        "used": summary.get("used"),
        "heldout": summary.get("heldout"),
        "train": summary.get("train"),
        "shards": {str(k): int(v) for k, v in sorted((summary.get("shards") or {}).items())},
        "roles_seen": {str(k): int(v) for k, v in (summary.get("roles_seen") or {}).items()},
    }


def _truncation_note(truncation: dict | None) -> str | None:
    if not truncation:
        return None
    where = f"byte {_fmt_num(truncation.get('byte_offset'))} (line {_fmt_num(truncation.get('line'))})"
    recovered = _fmt_num(truncation.get("records_before"))
    return f"the file is truncated: it breaks at {where}; {recovered} records before the break were recovered"


# ---------------------------------------------------------------- regeneration


def _regeneration(order: list[str], shards: list[dict], config: dict, warnings: list) -> dict[str, Any]:
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
        "tokens_per_second": _rate(completion, seconds),
        "resumed_turns": int((shard["meta"].get("stats") or {}).get("resumed_turns") or 0),
    }


def _completion_dataset(name: str, shards: list[dict], config: dict, warnings: list) -> dict[str, Any]:
    rows = [_completion_shard_row(s) for s in shards]
    sums = {k: sum(r[k] for r in rows) for k in ("records", "turns", "completion_tokens", "prompt_tokens", "generation_seconds", "resumed_turns")}
    reasons = _finish_reasons(shards)
    settings, settings_source = _effective_settings(name, shards, config, warnings)
    lengths = _turn_lengths(shards)
    share = _share(reasons.get("length", 0), sum(reasons.values()))
    return {
        "name": name,
        **sums,
        "shards": len(shards),
        "shards_expected": _expected_shards(config, name),
        "empty_shards": [r["shard"] for r in rows if r["records"] == 0],
        "tokens_per_second": _rate(sums["completion_tokens"], sums["generation_seconds"]),
        "finish_reasons": reasons,
        "length_share": share,
        "length_hint": _length_hint(share, reasons.get("length", 0), settings.get("max_new_tokens")),
        "lengths": _length_stats(lengths),
        "histogram": _histogram(lengths, settings.get("max_new_tokens")),
        "settings": settings,
        "settings_source": settings_source,
        "model_fingerprint": _distinct(s["meta"].get("model_fingerprint") for s in shards),
        "template_sha256": _distinct(s["meta"].get("template_sha256") for s in shards),
        "templates_by_shard": {s["shard"]: s["meta"].get("template_sha256") for s in shards},
        "sample": _sample(shards),
    }


def _completion_total(datasets: list[dict]) -> dict[str, Any]:
    keys = ("records", "turns", "completion_tokens", "prompt_tokens", "generation_seconds", "resumed_turns")
    total: dict[str, Any] = {k: sum(d[k] for d in datasets) for k in keys}
    reasons: Counter = Counter()
    for dataset in datasets:
        reasons.update(dataset["finish_reasons"])
    total["tokens_per_second"] = _rate(total["completion_tokens"], total["generation_seconds"])
    total["finish_reasons"] = dict(reasons.most_common())
    total["length_share"] = _share(reasons.get("length", 0), sum(reasons.values()))
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
        _warn(warnings, "regeneration", f"{name}: completion shards were generated with different settings")
    used = dict(sorted(recorded[0].items()))
    changed = [k for k in configured if k in used and configured[k] != used[k]]
    if changed:
        diff = ", ".join(f"{k}: made with {used[k]!r}, config now {configured[k]!r}" for k in changed)
        _warn(warnings, "regeneration", f"{name}: config no longer matches the completions ({diff}); a rerun regenerates them")
    return used, "completion shards"


def _configured_settings(config: dict, dataset: str) -> dict:
    settings = dict(config.get("generation") or {})
    settings.update(((config.get("datasets") or {}).get(dataset) or {}).get("generation") or {})
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
    prints = _distinct(s["meta"].get("model_fingerprint") for s in shards)
    if len(prints) > 1:
        _warn(warnings, "regeneration", f"completion shards come from different models (fingerprints {', '.join(prints)})")


# ---------------------------------------------------------------- tokens


def _tokens(order: list[str], shards: list[dict], config: dict) -> dict[str, Any]:
    by_dataset = _group(shards)
    datasets = [_token_dataset(n, by_dataset[n], config) for n in order if n in by_dataset]
    keys = ("records", "tokens", "assistant_tokens", "truncated", "dropped_total")
    total: dict[str, Any] = {k: sum(d[k] for d in datasets) for k in keys}
    total["assistant_share"] = _share(total["assistant_tokens"], total["tokens"])
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
        "shards_expected": _expected_shards(config, name),
        "empty_shards": [s["shard"] for s in shards if s["records"] == 0],
        "records": sum(s["records"] for s in shards),
        "tokens": int(tokens),
        "assistant_tokens": int(assistant),
        "assistant_share": _share(assistant, tokens),
        "truncated": int(sum(sum(bool(t) for t in s["columns"].get("truncated", [])) for s in shards)),
        "dropped": dict(dropped.most_common()),
        "dropped_total": sum(dropped.values()),
        "max_seq_len": _distinct(s["meta"].get("max_seq_len") for s in shards),
        "template_sha256": _distinct(s["meta"].get("template_sha256") for s in shards),
        "templates_by_shard": {s["shard"]: s["meta"].get("template_sha256") for s in shards},
    }


def _warn_template_mismatch(regeneration: dict, token_figures: dict, warnings: list) -> None:
    """Shards that disagree on the chat template mean the tokens do not match what was generated."""
    generated = {d["name"]: d for d in regeneration["datasets"]}
    for dataset in regeneration["datasets"]:
        _warn_shards_disagree(dataset["name"], "completion", dataset["templates_by_shard"], warnings)
    for dataset in token_figures["datasets"]:
        _warn_shards_disagree(dataset["name"], "token", dataset["templates_by_shard"], warnings)
        made = generated.get(dataset["name"])
        if made and made["template_sha256"] and dataset["template_sha256"] and set(made["template_sha256"]) != set(dataset["template_sha256"]):
            _warn(
                warnings, "tokens",
                f"{dataset['name']}: completions were made with template_sha256 {_short(made['template_sha256'])} "
                f"but tokens use {_short(dataset['template_sha256'])}",
            )


def _warn_shards_disagree(name: str, stage: str, by_shard: dict[str, Any], warnings: list) -> None:
    if len({v for v in by_shard.values() if v}) > 1:
        listing = ", ".join(f"{shard}: {_short([sha])}" for shard, sha in by_shard.items())
        _warn(warnings, "tokens", f"{name}: {stage} shards disagree on template_sha256 ({listing})")


# ---------------------------------------------------------------- draft vocabulary


def _safetensors_manifest(path: str, section: str, warnings: list, tensor: str | None = None) -> tuple[dict, Any] | None:
    """(manifest, the named tensor or None) from a safetensors file's header; None (and a warning) if unreadable.

    safe_open maps the file and parses the header only; no tensor is read unless one is named.
    """
    from safetensors import safe_open

    try:
        with safe_open(path, framework="np") as handle:
            metadata = handle.metadata() or {}
            array = handle.get_tensor(tensor) if tensor and tensor in handle.keys() else None
    except Exception as err:  # safetensors raises its own error types for a bad header
        _warn(warnings, section, f"could not read {path}: {type(err).__name__}: {err}")
        return None
    if MANIFEST_KEY not in metadata:
        _warn(warnings, section, f"{path} has no eyrie manifest in its metadata; it was not written by eyrie")
        return None
    try:
        manifest = json.loads(metadata[MANIFEST_KEY])
    except ValueError as err:
        _warn(warnings, section, f"{path}: the manifest is not JSON: {err}")
        return None
    if not isinstance(manifest, dict):
        _warn(warnings, section, f"{path}: the manifest is not a JSON object")
        return None
    return manifest, array


def _vocab(path: str | None, warnings: list) -> dict[str, Any] | None:
    if not path or not Path(path).exists():
        return None
    read = _safetensors_manifest(str(path), "vocab", warnings, tensor="counts")
    if read is None:
        return None
    manifest, counts = read
    size, requested = manifest.get("draft_vocab_size"), manifest.get("requested_draft_vocab_size")
    clipped = bool(manifest.get("clipped"))
    note = None
    if clipped:
        note = (
            f"only {_fmt_num(manifest.get('distinct_assistant_tokens'))} distinct assistant tokens were seen, "
            f"fewer than the requested draft_vocab_size {_fmt_num(requested)}; the draft vocabulary holds all of them "
            "(more data, or a smaller drafter.draft_vocab_size, removes this note)"
        )
    return {
        "path": str(path),
        "draft_vocab_size": size,
        "requested_draft_vocab_size": requested,
        "target_vocab_size": manifest.get("target_vocab_size"),
        "assistant_tokens": manifest.get("assistant_tokens"),
        "distinct_assistant_tokens": manifest.get("distinct_assistant_tokens"),
        "coverage": manifest.get("coverage"),
        "clipped": clipped,
        "clipped_note": note,
        "template_sha256": manifest.get("template_sha256"),
        "shards": manifest.get("shards"),
        "curve": _coverage_curve(counts, size),
    }


def _coverage_curve(counts: Any, draft_vocab_size: Any) -> dict[str, list] | None:
    """Cumulative share of assistant tokens covered by the k most frequent ids, at about PLOT_POINTS k."""
    if counts is None:
        return None
    values = np.sort(np.asarray(counts, dtype=np.int64).ravel())[::-1]
    values = values[values > 0]
    if not values.size:
        return None
    cumulative = np.cumsum(values) / values.sum()
    ranks = np.unique(np.geomspace(1, values.size, PLOT_POINTS).round().astype(np.int64))
    if isinstance(draft_vocab_size, int) and 1 <= draft_vocab_size <= values.size:
        ranks = np.union1d(ranks, [draft_vocab_size])
    return {"sizes": [int(k) for k in ranks], "coverage": [float(cumulative[k - 1]) for k in ranks], "distinct": int(values.size)}


# ---------------------------------------------------------------- hidden-state cache


HIDDEN_AGREE = (
    ("aux_layer_ids", "aux layer ids"),
    ("capture_indices", "capture indices"),
    ("num_hidden_layers", "number of target layers"),
    ("hidden_size", "hidden size"),
    ("dtype", "dtype"),
    ("template_sha256", "template_sha256"),
    ("target_model_fingerprint", "target model fingerprint"),
)


def _hidden(paths: list[str], order: list[str], warnings: list) -> dict[str, Any]:
    shards = []
    for path in paths:
        if not Path(path).exists():
            continue
        read = _safetensors_manifest(path, "hidden", warnings)
        if read is None:
            continue
        manifest = read[0]
        file_bytes = manifest.get("file_bytes") or Path(path).stat().st_size
        tokens = int(manifest.get("tokens") or 0)
        shards.append({
            "dataset": Path(path).parent.name,
            "shard": Path(path).stem,
            "samples": int(manifest.get("samples") or 0),
            "tokens": tokens,
            "assistant_tokens": int(manifest.get("assistant_tokens") or 0),
            "file_bytes": int(file_bytes),
            "bytes_per_token": _rate(file_bytes, tokens),
            **{key: manifest.get(key) for key, _ in HIDDEN_AGREE},
        })
    figures: dict[str, Any] = {"expected": len(paths), "shards": shards, "datasets": [], "total": None}
    if not shards:
        return figures
    for key, label in HIDDEN_AGREE:
        values = _distinct(json.dumps(s[key]) for s in shards)
        figures[key] = [json.loads(v) for v in values]
        if len(values) > 1:
            listing = ", ".join(f"{s['dataset']}/{s['shard']}: {_show(s[key])}" for s in shards)
            _warn(warnings, "hidden", f"hidden-state shards disagree on the {label} ({listing}); a drafter cannot train on a mixed cache")
    for ids, capture in {(json.dumps(s["aux_layer_ids"]), json.dumps(s["capture_indices"])) for s in shards}:
        ids, capture = json.loads(ids), json.loads(capture)
        if isinstance(ids, list) and capture != [int(i) + 1 for i in ids]:
            _warn(warnings, "hidden", f"capture indices {capture} are not the aux layer ids {ids} plus one: the cache does not follow SGLang's convention (output of layer i = output_hidden_states[i + 1])")
    names = [n for n in order if any(s["dataset"] == n for s in shards)] + sorted({s["dataset"] for s in shards} - set(order))
    figures["datasets"] = [_hidden_sum(n, [s for s in shards if s["dataset"] == n]) for n in names]
    figures["total"] = _hidden_sum("overall", shards)
    figures["reference"] = _bytes_reference(figures["hidden_size"], figures["dtype"], figures["total"]["bytes_per_token"])
    return figures


def _hidden_sum(name: str, shards: list[dict]) -> dict[str, Any]:
    sums = {k: sum(s[k] for s in shards) for k in ("samples", "tokens", "assistant_tokens", "file_bytes")}
    return {"name": name, "shards": len(shards), **sums, "bytes_per_token": _rate(sums["file_bytes"], sums["tokens"])}


def _bytes_reference(sizes: list, dtypes: list, measured: float | None) -> dict[str, Any] | None:
    """Bytes per token of the payload alone: aux 3H + final H states, int32 input id, int8 loss mask (8H+5 in bf16)."""
    if len(sizes) != 1 or not isinstance(sizes[0], int):
        return None
    h = sizes[0]
    dtype = dtypes[0] if len(dtypes) == 1 else None
    bf16 = 8 * h + 5
    if dtype == FP8_DTYPE:  # 1 byte per state element plus a float32 scale per token for each of the 4 H-wide blocks
        own, formula = 4 * h + 16 + 5, "4H+21"
    else:
        element = ELEMENT_BYTES.get(dtype)
        own, formula = (4 * h * element + 5, f"{4 * element}H+5") if element else (None, None)
    return {
        "hidden_size": h,
        "bf16": bf16,
        "dtype": dtype,
        "own": own,
        "formula": formula,
        "overhead": (measured / own - 1) if measured and own else None,
        "vs_bf16": (measured / bf16) if measured else None,
    }


# ---------------------------------------------------------------- drafter


def _drafter(path: str | None, config: dict, bench: dict, warnings: list) -> dict[str, Any] | None:
    if not path or not Path(path).exists():
        return None
    directory = Path(path)
    try:
        model_config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
        if not isinstance(model_config, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as err:
        _warn(warnings, "drafter", f"could not read {directory / 'config.json'}: {err}")
        return None
    own = model_config.get("eyrie") if isinstance(model_config.get("eyrie"), dict) else {}
    if not own:
        _warn(warnings, "drafter", f"{directory / 'config.json'} has no eyrie block: template, target and training metrics are unknown")
    metrics = own.get("metrics") if isinstance(own.get("metrics"), dict) else {}
    log = _training_log(directory / "training_log.json", warnings)
    eagle = model_config.get("eagle_config") if isinstance(model_config.get("eagle_config"), dict) else {}
    weights = directory / "model.safetensors"
    accuracy = metrics.get("accuracy_per_step") or (log["acc_per_step_last"] if log else None) or []
    losses = metrics.get("loss_per_step") or (log["loss_per_step_last"] if log else None) or []
    ttt_steps = max(len(accuracy), len(losses)) or (own.get("drafter") or {}).get("ttt_steps")
    if not weights.is_file():
        _warn(warnings, "drafter", f"{directory} has no model.safetensors: SGLang cannot load this drafter")
    figures = {
        "path": str(directory),
        "architectures": [str(a) for a in model_config.get("architectures") or []],
        "hidden_size": model_config.get("hidden_size"),
        "target_hidden_size": model_config.get("target_hidden_size"),
        "draft_vocab_size": model_config.get("draft_vocab_size"),
        "vocab_size": model_config.get("vocab_size"),
        "max_position_embeddings": model_config.get("max_position_embeddings"),
        "torch_dtype": model_config.get("torch_dtype"),
        "aux_layer_ids": eagle.get("eagle_aux_hidden_state_layer_ids"),
        "weights_bytes": weights.stat().st_size if weights.is_file() else None,
        "template_sha256": own.get("template_sha256"),
        "target_fingerprint": own.get("target_fingerprint"),
        "train": own.get("train") if isinstance(own.get("train"), dict) else {},
        "ttt_steps": ttt_steps,
        "metrics": {k: metrics.get(k) for k in ("steps", "samples", "tokens", "seconds", "tokens_per_second", "loss", "over_steps")},
        "final": [{"step": j, "accuracy": accuracy[j] if j < len(accuracy) else None, "loss": losses[j] if j < len(losses) else None} for j in range(ttt_steps or 0)],
        "final_source": "config.json eyrie.metrics (about the last epoch)" if metrics.get("accuracy_per_step") else "the last training-log entry",
        "log": log,
    }
    figures.update(_serve_command(config, str(directory), bench, warnings))
    return figures


def _training_log(path: Path, warnings: list) -> dict[str, Any] | None:
    """training_log.json as columns, thinned to about PLOT_POINTS entries for the plots."""
    if not path.is_file():
        _warn(warnings, "drafter", f"{path} is missing: no training curves")
        return None
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        _warn(warnings, "drafter", f"could not read {path}: {err}")
        return None
    entries = [e for e in entries if isinstance(e, dict) and isinstance(e.get("step"), (int, float))] if isinstance(entries, list) else []
    if not entries:
        return None
    keep = sorted(set(np.linspace(0, len(entries) - 1, min(len(entries), PLOT_POINTS)).round().astype(int).tolist()))
    shown = [entries[i] for i in keep]
    steps = max(len(e.get("acc_per_step") or []) for e in entries)

    def column(key: str, j: int) -> list:
        return [_number((e.get(key) or [])[j]) if j < len(e.get(key) or []) else None for e in shown]

    last = entries[-1]
    return {
        "entries": len(entries),
        "shown": len(shown),
        "step": [e["step"] for e in shown],
        "loss": [_number(e.get("loss")) for e in shown],
        "lr": [_number(e.get("lr")) for e in shown],
        "tokens_per_second": [_number(e.get("tokens_per_second")) for e in shown],
        "loss_per_step": [column("loss_per_step", j) for j in range(steps)],
        "acc_per_step": [column("acc_per_step", j) for j in range(steps)],
        "acc_per_step_last": [_number(a) for a in last.get("acc_per_step") or []],
        "loss_per_step_last": [_number(a) for a in last.get("loss_per_step") or []],
        "first_loss": _number(entries[0].get("loss")),
        "last_loss": _number(last.get("loss")),
        "last_step": last["step"],
    }


def _serve_command(config: dict, drafter_dir: str, bench: dict, warnings: list) -> dict[str, Any]:
    """The SGLang command that serves the target with this drafter, built by eyrie.target.serving.launch_command."""
    from eyrie.core.errors import EyrieError
    from eyrie.target.serving import HOST, launch_command

    sglang = ((config.get("engine") or {}).get("sglang")) or {}
    measured = _distinct(b.get("draft_tokens") for b in bench["rows"] if b["built"])
    if measured:
        draft_tokens, source = int(measured[0]), "the chain length k the benchmarks measured (bench.draft_tokens)"
        if len(measured) > 1:
            _warn(warnings, "drafter", f"the benchmarks used different draft_tokens ({', '.join(map(str, measured))}); the command uses {measured[0]}")
    else:
        configured = (config.get("bench") or {}).get("draft_tokens")
        draft_tokens = int(configured or DEFAULT_DRAFT_TOKENS)
        source = "bench.draft_tokens from the config (no benchmark measured yet)" if configured else "the default chain length (no benchmark measured yet)"
    speculative = {"algorithm": "EAGLE3", "draft_model_path": drafter_dir, "num_steps": draft_tokens, "eagle_topk": 1, "num_draft_tokens": draft_tokens + 1}
    try:
        command = launch_command(
            _serving_model_path(config),
            SERVE_PORT,
            python="python",  # portable: run it with the interpreter that has sglang installed
            tp_size=int(sglang.get("tp_size") or 1),
            dtype=sglang.get("dtype"),
            mem_fraction_static=sglang.get("mem_fraction_static"),
            context_length=sglang.get("context_length"),
            speculative=speculative,
            extra_args=sglang.get("extra_args") or (),
        )
    except (EyrieError, OSError, ValueError) as err:
        _warn(warnings, "drafter", f"no SGLang command for this drafter: {err}")
        return {"serve_command": None, "serve_command_lines": None, "serve_host": HOST, "serve_port": SERVE_PORT, "serve_draft_tokens": draft_tokens, "serve_draft_tokens_source": source}
    return {
        "serve_command": shlex.join(command),
        "serve_command_lines": _continued_lines(command),
        "serve_host": HOST,
        "serve_port": SERVE_PORT,
        "serve_draft_tokens": draft_tokens,
        "serve_draft_tokens_source": source,
    }


def _continued_lines(command: list[str]) -> str:
    """The same command for reading: one option per line, joined by shell line continuations (still pastes as is)."""
    groups: list[list[str]] = []
    for arg in command:
        if arg.startswith("--") or not groups:
            groups.append([arg])
        else:
            groups[-1].append(arg)
    return " \\\n    ".join(shlex.join(group) for group in groups)


def _serving_model_path(config: dict) -> str:
    """The target directory the pipeline uses (rules/common.smk model_dir), unless engine.sglang.model_path names another."""
    model = config.get("model") or {}
    sglang = ((config.get("engine") or {}).get("sglang")) or {}
    return str(sglang.get("model_path") or model.get("path") or f"resources/models/{model.get('name') or 'unknown'}")


# ---------------------------------------------------------------- benchmarks


def _bench(paths: list[str], warnings: list) -> dict[str, Any]:
    rows = [_bench_row(p, warnings) for p in paths]
    for i, row in enumerate(rows):
        row["anchor"] = f"bench-{i + 1}"  # names come from the files and may repeat; anchors must not
    measured = [r for r in rows if r["built"] and r["measured"]]
    return {"rows": rows, "measured": [r["name"] for r in measured]}


def _bench_row(path: str, warnings: list) -> dict[str, Any]:
    name = Path(path).stem
    if not Path(path).exists():
        return {"name": name, "path": path, "built": False, "measured": False, "error": None}
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as err:
        _warn(warnings, "bench", f"could not read {path}: {err}")
        return {"name": name, "path": path, "built": False, "measured": False, "error": None}
    name = str(data.get("benchmark") or name)
    per_prompt = [p for p in data.get("per_prompt") or [] if isinstance(p, dict)]
    prompts = int(data.get("prompts") if data.get("prompts") is not None else len(per_prompt))
    identical = sum(1 for p in per_prompt if p.get("identical"))
    divergences = [{"id": str(p.get("id")), "at": p.get("first_divergence")} for p in per_prompt if not p.get("identical")]
    speedup = _number(data.get("speedup"))
    rates = [_number(r) for r in data.get("acceptance_rate_per_position") or []]
    row = {
        "name": name,
        "path": path,
        "built": True,
        "measured": prompts > 0 and _number(data.get("mean_acceptance_length")) is not None,
        "prompts": prompts,
        "mean_acceptance_length": _number(data.get("mean_acceptance_length")) if prompts else None,
        "acceptance_rate_per_position": rates if prompts else [],
        "rounds": data.get("rounds"),
        "greedy_tokens_per_s": _number(data.get("greedy_tokens_per_s")) if prompts else None,
        "spec_tokens_per_s": _number(data.get("spec_tokens_per_s")) if prompts else None,
        "speedup": speedup if prompts else None,
        "slower": bool(prompts and speedup is not None and speedup < 1),
        "lossless": data.get("lossless") if prompts else None,
        "identical": identical,
        "checked": len(per_prompt),
        "divergences": divergences,
        "new_tokens": data.get("new_tokens"),
        "draft_tokens": data.get("draft_tokens"),
        "max_new_tokens": data.get("max_new_tokens"),
        "min_acceptance_length": data.get("min_acceptance_length"),
        "dtype": data.get("dtype"),
        "decoder": data.get("decoder"),
        "decoder_fallback_reason": data.get("decoder_fallback_reason"),
        "device": data.get("device"),
        "hardware": data.get("hardware"),
        "torch": data.get("torch"),
        "template_sha256": data.get("template_sha256"),
        "error": str(data["error"]) if data.get("error") else None,
        "per_prompt": [
            {k: p.get(k) for k in ("id", "prompt_tokens", "new_tokens", "acceptance_length_mean", "rounds", "greedy_tokens_per_s", "spec_tokens_per_s", "identical", "first_divergence")}
            for p in per_prompt
        ],
    }
    if row["error"]:
        _warn(warnings, "bench", f"{name}: the benchmark reported an error: {row['error']}")
    if prompts and row["lossless"] is False:
        where = ", ".join(f"{d['id']} at new token {d['at']}" for d in divergences[:5]) or "no per-prompt detail"
        _warn(warnings, "bench", f"{name}: speculative output differs from plain greedy on {len(divergences)} of {row['checked']} prompts ({where}); speculative decoding must be lossless")
    return row


# ---------------------------------------------------------------- agreement across stages


def _consistency(tokens: dict, vocab: dict | None, hidden: dict, drafter: dict | None, bench: dict, warnings: list) -> dict[str, Any]:
    """The chat template (and target) each stage was built with: all must equal the tokens' template."""
    token_templates = _distinct(sha for d in tokens["datasets"] for sha in d["template_sha256"])
    rows = [{"stage": "tokens", "template_sha256": token_templates}]
    if vocab is not None:
        rows.append({"stage": "draft vocab", "template_sha256": _distinct([vocab["template_sha256"]])})
    if hidden["shards"]:
        rows.append({"stage": "hidden states", "template_sha256": hidden["template_sha256"]})
    if drafter is not None:
        rows.append({"stage": "drafter", "template_sha256": _distinct([drafter["template_sha256"]])})
    for b in bench["rows"]:
        if b["built"]:
            rows.append({"stage": f"benchmark {b['name']}", "template_sha256": _distinct([b["template_sha256"]])})
    for row in rows:
        row["agrees"] = None if not token_templates or not row["template_sha256"] else set(row["template_sha256"]) == set(token_templates)
        if row["agrees"] is False:
            section = {"draft vocab": "vocab", "hidden states": "hidden", "drafter": "drafter"}.get(row["stage"], "bench")
            _warn(
                warnings, section,
                f"{row['stage']}: template_sha256 {_short(row['template_sha256'])} differs from the tokens' {_short(token_templates)}; "
                "a drafter trained on one chat template loses acceptance silently under another",
            )
    if drafter is not None:
        _warn_drafter_mismatch(vocab, hidden, drafter, warnings)
    return {"templates": rows}


def _warn_drafter_mismatch(vocab: dict | None, hidden: dict, drafter: dict, warnings: list) -> None:
    if hidden["shards"] and drafter["aux_layer_ids"] is not None and hidden["aux_layer_ids"] != [drafter["aux_layer_ids"]]:
        _warn(warnings, "drafter", f"the drafter's eagle_aux_hidden_state_layer_ids {drafter['aux_layer_ids']} differ from the hidden-state cache's {_show(hidden['aux_layer_ids'])}: SGLang would feed it other layers than it was trained on")
    if hidden["shards"] and drafter["target_fingerprint"] and hidden["target_model_fingerprint"] != [drafter["target_fingerprint"]]:
        _warn(warnings, "drafter", f"the drafter was trained for target {_short([drafter['target_fingerprint']])}, the hidden-state cache comes from {_short(hidden['target_model_fingerprint'])}")
    if vocab is not None and drafter["draft_vocab_size"] is not None and drafter["draft_vocab_size"] != vocab["draft_vocab_size"]:
        _warn(warnings, "drafter", f"the drafter's draft_vocab_size {drafter['draft_vocab_size']} differs from the draft vocabulary's {vocab['draft_vocab_size']}")
    if drafter["architectures"] and drafter["architectures"] != ["LlamaForCausalLMEagle3"]:
        _warn(warnings, "drafter", f"config.json architectures is {drafter['architectures']}, not ['LlamaForCausalLMEagle3']: SGLang's EAGLE3 loader expects that one")


# ---------------------------------------------------------------- provenance


def _provenance(config: dict) -> dict[str, Any]:
    """Where and with what the report was made; deliberately no environment variables."""
    return {
        "config_yaml": _config_yaml(config),
        "packages": _package_versions(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "gpu": _gpu_name(),
        "git_commit": _git_commit(),
        "repo_root": str(REPO_ROOT),
    }


def _config_yaml(config: dict) -> str:
    try:
        return yaml.safe_dump(config, sort_keys=False, allow_unicode=True, default_flow_style=False)
    except yaml.YAMLError:
        return json.dumps(config, indent=2, default=str)  # a config with non-YAML values still shows


def _package_versions() -> dict[str, str]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def _gpu_name() -> str:
    if importlib.util.find_spec("torch") is None:
        return "unknown (torch not installed)"
    try:
        import torch

        if torch.cuda.is_available():
            return ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    except Exception as err:  # a broken CUDA setup must not stop the report
        return f"unknown ({type(err).__name__})"
    return "none (CUDA not available)"


def _git_commit() -> str:
    if not (REPO_ROOT / ".git").exists():
        return "unknown"
    try:
        head = _git("rev-parse", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head} (with uncommitted changes)" if dirty else head


def _git(*args: str) -> str:
    done = subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, timeout=10, check=True)
    return done.stdout.strip()


# ---------------------------------------------------------------- plots


def _plots(figures: dict[str, Any]) -> dict[str, Markup | None]:
    regeneration = figures["regeneration"]
    drafter = figures["drafter"] or {}
    measured = [b for b in figures["bench"]["rows"] if b["built"] and b["measured"]]
    return {
        "tokens_per_second": _tokens_per_second_plot(regeneration["shards"]),
        "turn_lengths": _turn_length_plot(regeneration["datasets"]),
        "vocab_coverage": _coverage_plot(figures["vocab"]),
        "training": _training_plot(drafter.get("log")),
        "bench_acceptance": _acceptance_plot(measured),
        "bench_positions": _positions_plot(measured),
        "bench_throughput": _throughput_plot(measured),
    }


def _coverage_plot(vocab: dict | None) -> Markup | None:
    curve = (vocab or {}).get("curve")
    if not curve:
        return None
    fig = _figure(6.0, 2.8)
    ax = fig.add_subplot()
    ax.plot(curve["sizes"], [c * 100 for c in curve["coverage"]], color="C0")
    size, coverage = vocab["draft_vocab_size"], vocab["coverage"]
    if isinstance(size, int) and coverage is not None:
        ax.axvline(size, color="#b00", linestyle="--", linewidth=1)
        ax.plot([size], [coverage * 100], "o", color="#b00")
        ax.text(0.98, 0.06, f"draft vocabulary {size:,}: {coverage * 100:.1f}% covered", transform=ax.transAxes,
                ha="right", va="bottom", fontsize=8, color="#b00", bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85})
    log_scale = curve["distinct"] > 10
    if log_scale:
        ax.set_xscale("log")
    ax.set_xlim(1, max(curve["distinct"], 2) * (1.3 if log_scale else 1.05))  # room to see the line at the last size
    ax.set_ylim(0, 101)
    ax.set_xlabel("draft vocabulary size (most frequent assistant tokens)")
    ax.set_ylabel("assistant tokens covered (%)")
    ax.grid(alpha=0.3)
    return _svg(fig)


def _training_plot(log: dict | None) -> Markup | None:
    if not log or not log["step"]:
        return None
    marker = "o" if log["shown"] <= 12 else None
    steps = log["step"]
    n = len(log["loss_per_step"])
    colours = [matplotlib.colormaps["viridis"](j / max(n - 1, 1) * 0.9) for j in range(n)]
    fig = _figure(10.5, 3.4)
    loss_ax, acc_ax = fig.subplots(1, 2)
    for j, values in enumerate(log["loss_per_step"]):
        loss_ax.plot(steps, _nan(values), color=colours[j], linewidth=1, marker=marker, markersize=3, label=f"step {j}")
    loss_ax.plot(steps, _nan(log["loss"]), color="#222", linewidth=2, marker=marker, markersize=3, label="total (weighted)")
    finite = [v for v in log["loss"] + [x for values in log["loss_per_step"] for x in values] if v is not None and v > 0]
    if finite and max(finite) / min(finite) > 20:  # early losses dwarf the rest: a log scale keeps the tail readable
        loss_ax.set_yscale("log")
    loss_ax.set_title("loss", fontsize=10, loc="left")
    loss_ax.set_xlabel("optimizer step")
    loss_ax.grid(alpha=0.3)
    for j, values in enumerate(log["acc_per_step"]):
        acc_ax.plot(steps, [v * 100 if v is not None else np.nan for v in values], color=colours[j], linewidth=1, marker=marker, markersize=3, label=f"step {j}")
    acc_ax.set_title("accuracy per TTT step (%)", fontsize=10, loc="left")
    acc_ax.set_xlabel("optimizer step")
    acc_ax.set_ylim(0, 100)
    acc_ax.grid(alpha=0.3)
    loss_ax.legend(fontsize=7, ncol=2)
    for ax in (loss_ax, acc_ax):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return _svg(fig)


def _bench_labels(rows: list[dict]) -> list[str]:
    return [f"{r['name']}\n(error)" if r["error"] else r["name"] for r in rows]


def _acceptance_plot(rows: list[dict]) -> Markup | None:
    if not rows:
        return None
    fig = _figure(min(max(3.6, 0.9 * len(rows) + 1.6), 7.0), 2.9)
    ax = fig.add_subplot()
    values = [r["mean_acceptance_length"] for r in rows]
    bars = ax.bar(range(len(rows)), values, color=["#c62828" if r["error"] else "C0" for r in rows], width=0.6)
    ax.bar_label(bars, labels=[f"{v:.2f}" for v in values], fontsize=8, padding=2)
    ax.axhline(1.0, color="#666", linestyle=":", linewidth=1)
    top = max(max(values), max(1 + (r["draft_tokens"] or 0) for r in rows))
    ax.set_ylim(0, top * 1.08)
    ax.set_xticks(range(len(rows)), _bench_labels(rows), fontsize=8)
    ax.set_ylabel("mean acceptance length\n(tokens per target forward)", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return _svg(fig)


def _positions_plot(rows: list[dict]) -> Markup | None:
    drawn = [r for r in rows if r["acceptance_rate_per_position"]]
    if not drawn:
        return None
    fig = _figure(3.8, 2.9)
    ax = fig.add_subplot()
    for i, row in enumerate(drawn):
        rates = row["acceptance_rate_per_position"]
        ax.plot(range(1, len(rates) + 1), [r * 100 if r is not None else np.nan for r in rates], marker="o", markersize=4,
                color=f"C{i % 10}", linestyle="--" if row["error"] else "-", label=row["name"] + (" (error)" if row["error"] else ""))
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted (% of rounds)", fontsize=8)
    ax.set_ylim(0, 100)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return _svg(fig)


def _throughput_plot(rows: list[dict]) -> Markup | None:
    if not rows:
        return None
    fig = _figure(min(max(3.8, 1.2 * len(rows) + 1.6), 7.0), 2.9)
    ax = fig.add_subplot()
    x = np.arange(len(rows))
    greedy = [r["greedy_tokens_per_s"] or 0.0 for r in rows]
    spec = [r["spec_tokens_per_s"] or 0.0 for r in rows]
    ax.bar(x - 0.2, greedy, width=0.4, color="#9e9e9e", label="plain greedy")
    bars = ax.bar(x + 0.2, spec, width=0.4, color="C0", label="speculative")
    ax.bar_label(bars, labels=[f"{r['speedup']:.2f}×" if r["speedup"] is not None else "" for r in rows], fontsize=8, padding=2)
    ax.set_ylim(0, max(greedy + spec + [1e-9]) * 1.18)
    ax.set_xticks(x, _bench_labels(rows), fontsize=8)
    ax.set_ylabel("new tokens / s", fontsize=8)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    return _svg(fig)


def _nan(values: list) -> list[float]:
    return [np.nan if v is None else v for v in values]


def _tokens_per_second_plot(shards: list[dict]) -> Markup | None:
    if not shards:
        return None
    names = sorted({s["dataset"] for s in shards}, key=[s["dataset"] for s in shards].index)
    colours = {n: f"C{i % 10}" for i, n in enumerate(names)}
    fig = _figure(min(max(4.0, 0.45 * len(shards) + 2.0), 11.0), 2.8)
    ax = fig.add_subplot()
    heights = [s["tokens_per_second"] or 0.0 for s in shards]
    ax.bar(range(len(shards)), heights, color=[colours[s["dataset"]] for s in shards])
    for x, shard in enumerate(shards):
        if shard["tokens_per_second"] is None:
            ax.annotate("empty", (x, 0), ha="center", va="bottom", fontsize=8, color="#666")
    ax.set_xticks(range(len(shards)), [f"{s['dataset']}/{s['shard']}" for s in shards], rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("completion tokens / s")
    ax.grid(axis="y", alpha=0.3)
    return _svg(fig)


def _turn_length_plot(datasets: list[dict]) -> Markup | None:
    drawn = [d for d in datasets if d["histogram"]["counts"]]
    if not drawn:
        return None
    fig = _figure(7.0, 1.2 + 1.6 * len(drawn))
    for i, dataset in enumerate(drawn):
        ax = fig.add_subplot(len(drawn), 1, i + 1)
        histogram = dataset["histogram"]
        ax.stairs(histogram["counts"], histogram["edges"], fill=True, color=f"C{i % 10}", alpha=0.8)
        if isinstance(histogram["cap"], int):
            ax.axvline(histogram["cap"], color="#b00", linestyle="--", linewidth=1, label="max_new_tokens")
            ax.legend(fontsize=7, loc="upper center")
        ax.set_title(dataset["name"], fontsize=9, loc="left")
        ax.set_ylabel("turns", fontsize=8)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts of turns are whole numbers
    ax.set_xlabel("completion tokens per turn")
    return _svg(fig)


def _figure(width: float, height: float) -> Figure:
    """A figure bound to the Agg canvas directly: no pyplot, no global backend switch, no display."""
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _svg(fig: Figure) -> Markup:
    buffer = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none"}):  # text stays text: smaller, and uses the page font
        fig.savefig(buffer, format="svg", metadata={"Date": None})
    svg = buffer.getvalue()
    svg = svg[svg.index("<svg"):]  # drop the XML prolog and DOCTYPE, invalid inside HTML
    return Markup(re.sub(r"<metadata>.*?</metadata>\s*", "", svg, flags=re.S))


# ---------------------------------------------------------------- small helpers


def _warn(warnings: list, section: str, text: str) -> None:
    warnings.append({"section": section, "text": text})


def _rate(tokens: float, seconds: float) -> float | None:
    return tokens / seconds if seconds > 0 else None


def _share(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def _distinct(values: Iterable[Any]) -> list:
    """Distinct non-empty values in first-seen order."""
    return list(dict.fromkeys(v for v in values if v not in (None, "")))


def _number(value: Any) -> float | int | None:
    """A JSON number as is; anything else (None, text, NaN) as None, so no made-up figure reaches the page."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return None if isinstance(value, float) and not np.isfinite(value) else value


def _show(value: Any) -> str:
    """A manifest value for a warning: hashes shortened, lists as JSON."""
    if isinstance(value, str):
        return value[:12] if len(value) > 16 else value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return _short(value)
    return json.dumps(value)


def _short(hashes: Iterable[Any]) -> str:
    """12-character prefixes: enough to tell hashes apart on a page."""
    return ", ".join(str(h)[:12] for h in hashes)


def _fmt_num(value: Any, digits: int = 1) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    return f"{value:,}" if isinstance(value, int) else f"{value:,.{digits}f}"


def _fmt_bytes(value: Any) -> str:
    """Bytes in binary units, e.g. 637.0 KiB; the exact count stays in the tables next to it."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.1f} {unit}"
        value /= 1024
    return f"{value:,.1f} TiB"  # unreachable; keeps type checkers content


def _fmt_pct(value: float | None) -> str:
    return "—" if value is None else f"{value * 100:.1f}%"


def _clip(text: str, limit: int = SAMPLE_CHARS) -> str:
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit]}… [{len(text) - limit:,} more characters]"
