"""A benchmark's speed at concurrency as plain dicts: its JSON's `concurrency` block (eyrie.bench.concurrency), read
for the page's "Speed at concurrency" part.

Absent from JSONs written before the block existed (None: the page shows nothing for it); off with its reason when
bench.concurrency is empty. Per B: greedy's tokens/s, each setting's speedup over batched greedy and losslessness,
and the recommended setting with its SGLang flags; for the whole run vLLM's batch-aware --speculative-config and
SGLang's adaptive tiers (the JSON the user writes to the file its flags name), when a chain is recommended anywhere.
A setting that is not lossless at some B is a warning, as at batch 1; so is a load timed on an engine of more rows than
B requests (its figures would be those of the larger batch's work).
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from eyrie.report.values import number, warn

ADAPTIVE_FLAG = "--speculative-adaptive-config"


def concurrency_figures(data: Any, name: str, warnings: list) -> dict[str, Any] | None:
    """{off_reason, batches, settings, per_batch, curves, vllm_flags, adaptive_config_json, adaptive_file, adaptive_flags,
    adaptive_command(_lines, _error)}."""
    if not isinstance(data, dict):
        return None
    off = data.get("off_reason")
    figures: dict[str, Any] = {"off_reason": str(off) if off else None, "batches": [], "settings": [], "per_batch": [], "curves": [],
                               "lossless_dtype": data.get("lossless_dtype"), "vllm_flags": data.get("vllm_flags"),
                               "adaptive_config_json": None, "adaptive_file": None, "adaptive_flags": data.get("sglang_adaptive_flags"),
                               # the whole launch command, added by the bench section where the drafter's directory is known
                               "adaptive_command": None, "adaptive_command_lines": None, "adaptive_command_error": None}
    entries = [e for e in data.get("per_batch") or [] if isinstance(e, dict) and isinstance(e.get("batch"), int)]
    if off or not entries:
        figures["off_reason"] = figures["off_reason"] or "no batch size was measured"
        return figures
    labels = [str(s) for s in data.get("settings") or []]
    curves: dict[str, list] = {label: [] for label in labels}
    for entry in sorted(entries, key=lambda e: e["batch"]):
        rows = [r for r in entry.get("settings") or [] if isinstance(r, dict)]
        for row in rows:
            label = str(row.get("label"))
            curves.setdefault(label, []).append({"batch": entry["batch"], "speedup": number(row.get("speedup")), "lossless": row.get("lossless")})
            if row.get("lossless") is False:
                warn(warnings, "bench", f"{name}: at B = {entry['batch']}, {label} differs from batched greedy on "
                                        f"{row.get('rows', 0) - (row.get('float32_identical_rows') or 0)} of {row.get('rows')} rows; "
                                        "speculative decoding must be lossless")
        if isinstance(entry.get("engine_rows"), int) and entry["engine_rows"] != entry["batch"]:
            warn(warnings, "bench", f"{name}: B = {entry['batch']} was timed on an engine of {entry['engine_rows']} rows, not "
                                    f"{entry['batch']}: its figures are those of {entry['engine_rows']} rows' work")
        best = entry.get("recommended") if isinstance(entry.get("recommended"), dict) else None
        greedy = entry.get("greedy") if isinstance(entry.get("greedy"), dict) else {}
        figures["per_batch"].append({"batch": entry["batch"], "distinct_prompts": entry.get("distinct_prompts"), "waves": entry.get("waves"),
                                     "greedy_tokens_per_s": number(greedy.get("tokens_per_s")),
                                     "recommendation": str(entry.get("recommendation") or "no speculation"),
                                     "speedup": number(best.get("speedup")) if best else None,
                                     "tokens_per_s": next((number(r.get("tokens_per_s")) for r in rows if best and r.get("label") == best.get("label")), None),
                                     "sglang_flags": str(entry.get("sglang_flags") or "")})
    figures["batches"] = [e["batch"] for e in figures["per_batch"]]
    figures["settings"] = list(curves)
    figures["curves"] = [{"label": label, "points": points} for label, points in curves.items()]
    adaptive = data.get("sglang_adaptive_config")
    if isinstance(adaptive, dict) and figures["adaptive_flags"]:
        figures["adaptive_config_json"] = json.dumps(adaptive, indent=1)
        flags = shlex.split(figures["adaptive_flags"])
        figures["adaptive_file"] = flags[flags.index(ADAPTIVE_FLAG) + 1] if ADAPTIVE_FLAG in flags[:-1] else None
    return figures
