"""Render one self-contained HTML page of what the pipeline has built so far.

`collect` turns the stage outputs (prompt summaries, completion shards, token
shards) and the config into a plain dict of numbers; `write_report` draws the
plots from that dict, renders templates/report.html.j2 and writes the page
atomically. Nothing on the page needs the network, and the page never shows a
number that no stage measured: later stages are listed as "not built yet".
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import io
import json
import os
import platform
import re
import subprocess
import tempfile
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

REPO_ROOT = Path(eyrie.__file__).resolve().parents[2]
TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"
TEMPLATE_NAME = "report.html.j2"

PACKAGES = ("torch", "transformers", "snakemake", "datasets", "pyarrow", "pandas", "eyrie")
LATER_STAGES = ("draft vocab", "hidden states", "drafter", "benchmark")
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
) -> None:
    """Write the HTML report for whatever stage outputs exist to `out_path`."""
    figures = collect(config, prompt_summaries, completions, tokens)
    _write_atomically(Path(out_path), render(figures))


def collect(
    config: dict,
    prompt_summaries: Iterable[str],
    completions: Iterable[str],
    tokens: Iterable[str],
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
    return {
        "model": _model(config),
        "generated_at": datetime.now().astimezone().isoformat(timespec="seconds"),
        "stages": _stages(config, summaries, completion_shards, token_shards),
        "warnings": warnings,
        "datasets": _datasets(order, summaries),
        "regeneration": regeneration,
        "tokens": token_figures,
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
    env.filters.update(num=_fmt_num, pct=_fmt_pct, clip=_clip)
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


def _stages(config: dict, summaries: dict, completion_shards: list, token_shards: list) -> list[dict]:
    configured = list((config.get("datasets") or {}).keys())
    expected_shards = sum(_expected_shards(config, name) or 0 for name in configured)
    prompts_detail = f"{len(summaries)} of {len(configured)} datasets"
    stages = [
        {"name": "prompts", "built": bool(summaries), "detail": prompts_detail},
        {"name": "completions", "built": bool(completion_shards), "detail": f"{len(completion_shards)} of {expected_shards} shards"},
        {"name": "tokens", "built": bool(token_shards), "detail": f"{len(token_shards)} of {expected_shards} shards"},
    ]
    return stages + [{"name": name, "built": False, "detail": "not built yet"} for name in LATER_STAGES]


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
    return {
        "tokens_per_second": _tokens_per_second_plot(regeneration["shards"]),
        "turn_lengths": _turn_length_plot(regeneration["datasets"]),
    }


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


def _short(hashes: Iterable[Any]) -> str:
    """12-character prefixes: enough to tell hashes apart on a page."""
    return ", ".join(str(h)[:12] for h in hashes)


def _fmt_num(value: Any, digits: int = 1) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    return f"{value:,}" if isinstance(value, int) else f"{value:,.{digits}f}"


def _fmt_pct(value: float | None) -> str:
    return "—" if value is None else f"{value * 100:.1f}%"


def _clip(text: str, limit: int = SAMPLE_CHARS) -> str:
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit]}… [{len(text) - limit:,} more characters]"


def _write_atomically(path: Path, text: str) -> None:
    """Readers (and a killed job) see the old page or the new one, never half a page."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a report is meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
