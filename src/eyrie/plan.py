"""`eyrie plan`: per dataset and shard, what regeneration has done, what is left, and how long that takes.

Throughput and reply length come from finished work (final shards and partial logs);
before anything ran they come from the config's `plan` guesses, and the output says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq

from eyrie import config as cfg
from eyrie.generate import settings_key
from eyrie.partial import PartialLog


@dataclass
class ShardPlan:
    dataset: str
    shard: str
    prompts: int | None  # None: prompt shards not built yet
    prompts_done: int
    turns_done: int
    completion_tokens: int
    seconds: float
    state: str


def _prompt_turns(path: Path, max_turns: int) -> list[int] | None:
    if not path.exists():
        return None
    return [min(n, max_turns) for n in pq.read_table(path, columns=["n_user_turns"]).column(0).to_pylist()]


def _final_shard(path: Path, settings: dict) -> tuple[dict | None, bool]:
    """The stats of a finished shard and whether it was made with the current settings."""
    if not path.exists():
        return None, False
    meta = json.loads((pq.read_schema(path).metadata or {}).get(b"eyrie", b"{}"))
    return meta.get("stats"), meta.get("settings") == settings


def plan_shard(workdir: Path, config: dict, dataset: str, shard: str, model_fp: str | None) -> ShardPlan:
    settings = cfg.generation_settings(config, dataset)
    turns = _prompt_turns(workdir / f"results/prompts/{dataset}/{shard}.parquet", settings["max_turns"])
    prompts = None if turns is None else len(turns)
    stats, current = _final_shard(workdir / f"results/completions/{dataset}/{shard}.parquet", settings)
    if stats is not None and current:
        return ShardPlan(dataset, shard, prompts, stats["records"], stats["turns"], stats["completion_tokens"], stats["generation_seconds"], "done")

    rows = {}
    if model_fp is not None:
        log = workdir / f"results/partial/completions/{dataset}/{shard}/{settings_key(settings, model_fp)}.jsonl"
        rows = PartialLog(log).load() if log.exists() else {}
    by_prompt: dict[str, list[dict]] = {}
    for row in rows.values():
        by_prompt.setdefault(row["id"], []).append(row)
    prompts_done = sum(
        1 for turns_of in by_prompt.values() if any(r["finish_reason"] == "prompt_too_long" for r in turns_of) or len(turns_of) >= settings["max_turns"]
    )
    state = "stale (settings changed)" if stats is not None else ("partial" if rows else ("waiting for prompts" if prompts is None else "not started"))
    return ShardPlan(
        dataset,
        shard,
        prompts,
        prompts_done,
        len(rows),
        sum(r["completion_tokens"] for r in rows.values()),
        sum(r["seconds"] for r in rows.values()),
        state,
    )


def expected_prompts(config: dict, dataset: str) -> float | None:
    """Before prompts exist: limit x (1 - held-out share) / shards, or unknown without a limit."""
    spec = config["datasets"][dataset]
    if spec["limit"] is None:
        return None
    return spec["limit"] * (1 - spec["heldout_fraction"]) / spec["shards"]


def build_plan(config: dict, workdir: str | Path = ".") -> tuple[pd.DataFrame, dict]:
    workdir = Path(workdir)
    model_dir = workdir / (config["model"]["path"] or f"resources/models/{config['model']['name']}")
    model_fp = None
    if (model_dir / "config.json").exists():
        from eyrie.model import model_fingerprint

        model_fp = model_fingerprint(model_dir)
    shards = [plan_shard(workdir, config, d, s, model_fp) for d in sorted(config["datasets"]) for s in cfg.shard_names(config, d)]

    measured_turns = sum(s.turns_done for s in shards)
    measured_seconds = sum(s.seconds for s in shards)
    measured_tokens = sum(s.completion_tokens for s in shards)
    if measured_turns and measured_seconds > 0:
        rate = measured_tokens / measured_seconds
        tokens_per_prompt = {
            d: measured_tokens / max(1, sum(s.prompts_done for s in shards)) for d in config["datasets"]
        }
        basis = f"measured on {measured_turns} finished turns ({measured_tokens} tokens in {measured_seconds:.0f} s)"
    else:
        rate = config["plan"]["guess_tokens_per_second"]
        tokens_per_prompt = {d: config["plan"]["guess_completion_tokens"] for d in config["datasets"]}
        basis = "guessed from the config's plan section: nothing has been generated yet"

    rows = []
    for s in shards:
        prompts = s.prompts if s.prompts is not None else expected_prompts(config, s.dataset)
        left = None if prompts is None else max(0.0, prompts - s.prompts_done)
        tokens_left = None if left is None else left * tokens_per_prompt[s.dataset]
        rows.append(
            {
                "dataset": s.dataset,
                "shard": s.shard,
                "state": s.state,
                "prompts": "?" if prompts is None else (f"~{prompts:.0f}" if s.prompts is None else prompts),
                "done": s.prompts_done,
                "left": "?" if left is None else round(left),
                "tokens_left": None if tokens_left is None else round(tokens_left),
                "hours_left": None if tokens_left is None else tokens_left / rate / 3600,
            }
        )
    table = pd.DataFrame(rows)
    summary = {"tokens_per_second": rate, "basis": basis, "hours_left": table["hours_left"].sum(min_count=1)}
    return table, summary


def format_plan(table: pd.DataFrame, summary: dict) -> str:
    shown = table.copy()
    shown["hours_left"] = shown["hours_left"].map(lambda h: "?" if pd.isna(h) else f"{h:.2f}")
    shown["tokens_left"] = shown["tokens_left"].map(lambda t: "?" if pd.isna(t) else f"{int(t):,}")
    per_dataset = table.groupby("dataset")["hours_left"].sum(min_count=1)
    lines = [shown.to_string(index=False), ""]
    for dataset, hours in per_dataset.items():
        lines.append(f"{dataset}: {'unknown (no limit and no prompts built yet)' if pd.isna(hours) else f'{hours:.2f} h'} of regeneration left")
    total = summary["hours_left"]
    known = "unknown" if pd.isna(total) else f"{total:.2f} h"
    if not pd.isna(total) and table["hours_left"].isna().any():
        known = f"at least {known} (some shards unknown until their prompts are built)"
    lines.append(f"total: {known} at {summary['tokens_per_second']:.1f} tokens/s, {summary['basis']}")
    return "\n".join(lines)
