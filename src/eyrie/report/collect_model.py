"""The back half of the page as plain dicts: draft vocabulary, hidden-state cache, drafter, benchmarks.

Safetensors artifacts are read by their header alone through eyrie.core.artifacts (the
vocabulary's `counts`, one int64 per target token, excepted: it draws the coverage curve); the
drafter directory by its config.json and training_log.json; each benchmark by its JSON. A path
that does not exist is a stage not built yet; one that exists but cannot be read, or that a
stage wrote inconsistently, is a warning in its section, never an exception. JSON artifacts (the
drafter's config.json, the training log through the digest config.json records, each benchmark) are
checked against their content digests (eyrie.core.digest): a mismatch is such a warning too.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import numpy as np

from eyrie.core.artifacts import ArtifactError, read_json, read_safetensors_manifest
from eyrie.core.digest import verify_recorded_files
from eyrie.core.disk import free_space
from eyrie.core.schema import WHEEL_BENCHMARKS
from eyrie.report.concurrency_section import concurrency_figures
from eyrie.report.formats import fmt_num, show
from eyrie.report.serve import adaptive_command, serve_command, setting_command
from eyrie.report.values import distinct, number, rate, warn
from eyrie.target.serving import eagle3_flags

PLOT_POINTS = 400  # curves are thinned to about this many points: enough to read, light enough to embed
ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
FP8_DTYPE = "float8_e4m3fn"


# ---------------------------------------------------------------- draft vocabulary


def vocab_section(path: str | None, warnings: list) -> dict[str, Any] | None:
    """The draft vocabulary: its manifest's figures and the coverage curve; None when not built (or unreadable: a warning)."""
    if not path or not Path(path).exists():
        return None
    try:
        manifest = read_safetensors_manifest(path, "eyrie draft vocabulary")
        counts = _read_counts(str(path))
    except ArtifactError as err:
        warn(warnings, "vocab", str(err))
        return None
    size, requested = manifest.get("draft_vocab_size"), manifest.get("requested_draft_vocab_size")
    clipped = bool(manifest.get("clipped"))
    note = None
    if clipped:
        seen = (f"{fmt_num(manifest.get('distinct_assistant_tokens'))} distinct assistant tokens"
                + (f" and {fmt_num(manifest.get('prompt_only_ids'))} more read in prompts" if manifest.get("from_prompts") else ""))
        note = (
            f"only {seen} were seen, "
            f"fewer than the requested draft_vocab_size {fmt_num(requested)}; the draft vocabulary holds all of them"
            + (f", padded with {fmt_num(manifest['unseen_padding'])} never-seen ids to {fmt_num(size)} rows"
               if manifest.get("unseen_padding") else "")
            + " (more data, or a smaller drafter.draft_vocab_size, removes this note)"
        )
    return {
        "path": str(path),
        "draft_vocab_size": size,
        "requested_draft_vocab_size": requested,
        "target_vocab_size": manifest.get("target_vocab_size"),
        "assistant_tokens": manifest.get("assistant_tokens"),
        "distinct_assistant_tokens": manifest.get("distinct_assistant_tokens"),
        "from_prompts": bool(manifest.get("from_prompts")),
        "prompt_only_ids": manifest.get("prompt_only_ids"),
        "coverage": manifest.get("coverage"),
        "clipped": clipped,
        "clipped_note": note,
        "template_sha256": manifest.get("template_sha256"),
        "shards": manifest.get("shards"),
        "curve": _coverage_curve(counts, size),
    }


def _read_counts(path: str) -> Any:
    """The vocabulary's `counts` (one int64 per target token), the one tensor the report reads; None if absent."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="np") as handle:
            return handle.get_tensor("counts") if "counts" in handle.keys() else None
    except Exception as err:  # safetensors raises its own error types for a bad file
        raise ArtifactError(f"{path}: could not read its counts ({type(err).__name__}: {err})") from None


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


def hidden_section(paths: list[str], order: list[str], warnings: list) -> dict[str, Any]:
    """The hidden-state cache: per-shard manifests summed per dataset, the settings every shard must share, bytes per token,
    and the free space at report time on the filesystem it lives on."""
    shards = []
    for path in paths:
        if not Path(path).exists():
            continue
        try:
            manifest = read_safetensors_manifest(path, "eyrie hidden-state cache")
        except ArtifactError as err:
            warn(warnings, "hidden", str(err))
            continue
        file_bytes = manifest.get("file_bytes") or Path(path).stat().st_size
        tokens = int(manifest.get("tokens") or 0)
        shards.append({
            "dataset": Path(path).parent.name,
            "shard": Path(path).stem,
            "samples": int(manifest.get("samples") or 0),
            "tokens": tokens,
            "assistant_tokens": int(manifest.get("assistant_tokens") or 0),
            "file_bytes": int(file_bytes),
            "bytes_per_token": rate(file_bytes, tokens),
            **{key: manifest.get(key) for key, _ in HIDDEN_AGREE},
        })
    # The disk at report time: what a rerun, a larger dataset or another dtype has to fit in.
    free_bytes, free_path = free_space(Path(paths[0]).parent if paths else Path("results/hidden"))
    figures: dict[str, Any] = {"expected": len(paths), "shards": shards, "datasets": [], "total": None, "free_bytes": free_bytes, "free_path": str(free_path)}
    if not shards:
        return figures
    for key, label in HIDDEN_AGREE:
        values = distinct(json.dumps(s[key]) for s in shards)
        figures[key] = [json.loads(v) for v in values]
        if len(values) > 1:
            listing = ", ".join(f"{s['dataset']}/{s['shard']}: {show(s[key])}" for s in shards)
            warn(warnings, "hidden", f"hidden-state shards disagree on the {label} ({listing}); a drafter cannot train on a mixed cache")
    for ids, capture in {(json.dumps(s["aux_layer_ids"]), json.dumps(s["capture_indices"])) for s in shards}:
        ids, capture = json.loads(ids), json.loads(capture)
        if isinstance(ids, list) and capture != [int(i) + 1 for i in ids]:
            warn(warnings, "hidden", f"capture indices {capture} are not the aux layer ids {ids} plus one: the cache does not follow SGLang's convention (output of layer i = output_hidden_states[i + 1])")
    names = [n for n in order if any(s["dataset"] == n for s in shards)] + sorted({s["dataset"] for s in shards} - set(order))
    figures["datasets"] = [_hidden_sum(n, [s for s in shards if s["dataset"] == n]) for n in names]
    figures["total"] = _hidden_sum("overall", shards)
    figures["reference"] = _bytes_reference(figures["hidden_size"], figures["dtype"], figures["total"]["bytes_per_token"])
    return figures


def _hidden_sum(name: str, shards: list[dict]) -> dict[str, Any]:
    sums = {k: sum(s[k] for s in shards) for k in ("samples", "tokens", "assistant_tokens", "file_bytes")}
    return {"name": name, "shards": len(shards), **sums, "bytes_per_token": rate(sums["file_bytes"], sums["tokens"])}


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


def drafter_section(path: str | None, config: dict, bench: dict, warnings: list) -> dict[str, Any] | None:
    """The drafter: config.json, its eyrie block's metrics, the training log and the SGLang command; None when not built."""
    if not path or not Path(path).exists():
        return None
    directory = Path(path)
    try:
        model_config = read_json(directory / "config.json", written_by="train_drafter", rebuild=directory)
        if not isinstance(model_config, dict):
            raise ArtifactError(f"{directory / 'config.json'}: not a JSON object")
    except ArtifactError as err:
        warn(warnings, "drafter", f"could not read {err}")
        return None
    own = model_config.get("eyrie") if isinstance(model_config.get("eyrie"), dict) else {}
    if not own:
        warn(warnings, "drafter", f"{directory / 'config.json'} has no eyrie block: template, target and training metrics are unknown")
    metrics = own.get("metrics") if isinstance(own.get("metrics"), dict) else {}
    log = _training_log(directory / "training_log.json", warnings, model_config)
    eagle = model_config.get("eagle_config") if isinstance(model_config.get("eagle_config"), dict) else {}
    weights = directory / "model.safetensors"
    accuracy = metrics.get("accuracy_per_step") or (log["acc_per_step_last"] if log else None) or []
    losses = metrics.get("loss_per_step") or (log["loss_per_step_last"] if log else None) or []
    ttt_steps = max(len(accuracy), len(losses)) or (own.get("drafter") or {}).get("ttt_steps")
    if not weights.is_file():
        warn(warnings, "drafter", f"{directory} has no model.safetensors: SGLang cannot load this drafter")
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
        "copying": _copy_slice(own.get("simulated_acceptance")),  # not "copy": templates would read dict.copy
    }
    figures.update(serve_command(config, str(directory), bench, warnings))
    return figures


def _copy_slice(simulated) -> dict[str, Any] | None:
    """Training's copy slice (eyrie.training.acceptance): where prompt lookup would copy, the written drafter's accepted
    drafts at its longest chain beside prompt lookup's; None when not recorded or empty."""
    copy = simulated.get("copy") if isinstance(simulated, dict) else None
    if not isinstance(copy, dict) or not number(copy.get("positions")) or not isinstance(copy.get("drafter_accepted"), list):
        return None
    drafter = copy["drafter_accepted"]
    return {"positions": number(copy["positions"]), "k": len(drafter), "drafter": number(drafter[-1]) if drafter else None,
            "lookup": number(copy.get("lookup_accepted")), "lookup_k": number(copy.get("lookup_k")),
            "min_lookup_drafts": number(copy.get("min_lookup_drafts")), "eval_samples": number(simulated.get("eval_samples"))}


def _training_log(path: Path, warnings: list, config: dict) -> dict[str, Any] | None:
    """training_log.json as columns, thinned to about PLOT_POINTS entries for the plots; config: the drafter's config.json."""
    if not path.is_file():
        warn(warnings, "drafter", f"{path} is missing: no training curves")
        return None
    try:
        entries = read_json(path, written_by="train_drafter", rebuild=path.parent)
        verify_recorded_files(path.parent, config)  # the log's digest lives in config.json
    except ArtifactError as err:
        warn(warnings, "drafter", f"could not read {err}")
        return None
    entries = [e for e in entries if isinstance(e, dict) and isinstance(e.get("step"), (int, float))] if isinstance(entries, list) else []
    if not entries:
        return None
    keep = sorted(set(np.linspace(0, len(entries) - 1, min(len(entries), PLOT_POINTS)).round().astype(int).tolist()))
    shown = [entries[i] for i in keep]
    steps = max(len(e.get("acc_per_step") or []) for e in entries)

    def column(key: str, j: int) -> list:
        return [number((e.get(key) or [])[j]) if j < len(e.get(key) or []) else None for e in shown]

    last = entries[-1]
    return {
        "entries": len(entries),
        "shown": len(shown),
        "step": [e["step"] for e in shown],
        "loss": [number(e.get("loss")) for e in shown],
        "lr": [number(e.get("lr")) for e in shown],
        "tokens_per_second": [number(e.get("tokens_per_second")) for e in shown],
        "loss_per_step": [column("loss_per_step", j) for j in range(steps)],
        "acc_per_step": [column("acc_per_step", j) for j in range(steps)],
        "acc_per_step_last": [number(a) for a in last.get("acc_per_step") or []],
        "loss_per_step_last": [number(a) for a in last.get("loss_per_step") or []],
        "first_loss": number(entries[0].get("loss")),
        "last_loss": number(last.get("loss")),
        "last_step": last["step"],
    }


# ---------------------------------------------------------------- benchmarks


def bench_section(paths: list[str], warnings: list, config: dict | None = None, drafter: str | None = None) -> dict[str, Any]:
    """The benchmarks: one row per JSON (not built when missing), with a unique anchor each.

    config and drafter (the drafter directory) go into the SGLang command serving a sweep's recommended setting.
    """
    rows = [_bench_row(p, warnings, config or {}, drafter) for p in paths]
    for i, row in enumerate(rows):
        row["anchor"] = f"bench-{i + 1}"  # names come from the files and may repeat; anchors must not
    measured = [r for r in rows if r["built"] and r["measured"]]
    return {"rows": rows, "measured": [r["name"] for r in measured]}


def _bench_row(path: str, warnings: list, config: dict, drafter: str | None) -> dict[str, Any]:
    name = Path(path).stem
    if not Path(path).exists():
        return {"name": name, "path": path, "built": False, "measured": False, "error": None}
    try:
        data = read_json(path, written_by=f"benchmark_{'heldout' if name not in WHEEL_BENCHMARKS else name}")
        if not isinstance(data, dict):
            raise ArtifactError(f"{path}: not a JSON object")
    except ArtifactError as err:
        warn(warnings, "bench", f"could not read {err}")
        return {"name": name, "path": path, "built": False, "measured": False, "error": None}
    name = str(data.get("benchmark") or name)
    per_prompt = [p for p in data.get("per_prompt") or [] if isinstance(p, dict)]
    prompts = int(data.get("prompts") if data.get("prompts") is not None else len(per_prompt))
    identical = sum(1 for p in per_prompt if p.get("identical"))
    divergences = [{"id": str(p.get("id")), "at": p.get("first_divergence")} for p in per_prompt if not p.get("identical")]
    speedup = number(data.get("speedup"))
    rates = [number(r) for r in data.get("acceptance_rate_per_position") or []]
    row = {
        "name": name,
        "path": path,
        "built": True,
        "measured": prompts > 0 and number(data.get("mean_acceptance_length")) is not None,
        "prompts": prompts,
        "mean_acceptance_length": number(data.get("mean_acceptance_length")) if prompts else None,
        "acceptance_rate_per_position": rates if prompts else [],
        "rounds": data.get("rounds"),
        "greedy_tokens_per_s": number(data.get("greedy_tokens_per_s")) if prompts else None,
        "spec_tokens_per_s": number(data.get("spec_tokens_per_s")) if prompts else None,
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
    # The n-gram baseline: absent from JSONs written before it existed, and null when bench.ngram is false.
    ngram = _ngram_figures(data["ngram"]) if prompts and isinstance(data.get("ngram"), dict) else None
    row["ngram"] = ngram
    row["speedup_over_ngram"] = number(data.get("speedup_over_ngram")) if ngram else None
    row["slower_than_ngram"] = row["speedup_over_ngram"] is not None and row["speedup_over_ngram"] < 1
    row["parity"] = _parity_figures(data.get("parity"))
    check = data.get("float32_check")  # present when the run was timed in another dtype than float32
    row["float32_check"] = {k: check.get(k) for k in ("identical", "checked")} if isinstance(check, dict) else None
    floor = data.get("floor")  # bench.floor: greedy against a minimal fused step; absent from older JSONs
    row["floor"] = floor if isinstance(floor, dict) and floor.get("error") is None and number(floor.get("ratio")) else None
    outside = data.get("outside_draft_vocab")  # greedy reply tokens the drafter cannot propose; absent from older JSONs
    row["outside_draft_vocab"] = outside if prompts and isinstance(outside, dict) and number(outside.get("fraction")) is not None else None
    agreement = data.get("agreement_in_timing_dtype")  # with float32_check: the timing dtype's own agreement with greedy
    row["timing_agreement"] = agreement if isinstance(agreement, dict) else None
    # The sweep over drafting settings: absent from JSONs written before it existed, and null when bench.sweep is empty.
    sweep = data.get("sweep") if prompts and isinstance(data.get("sweep"), dict) else None
    row["sweep"] = _sweep_figures(sweep, row, config, drafter or data.get("drafter"), warnings) if sweep else None
    row["concurrency"] = concurrency_figures(data.get("concurrency"), name, warnings)  # B requests at once; absent from older JSONs
    if row["concurrency"] and row["concurrency"]["adaptive_flags"] and (drafter or data.get("drafter")):
        row["concurrency"].update(adaptive_command(config, drafter or data.get("drafter"), row["concurrency"]["adaptive_flags"]))
    row["acceptance_by_span"] = _span_figures(data.get("acceptance_by_span")) if prompts else None
    by_id = {p["id"]: p for p in (ngram or {}).get("per_prompt", [])}
    for p in row["per_prompt"]:
        p["ngram"] = by_id.get(str(p["id"]))
    if row["error"]:
        warn(warnings, "bench", f"{name}: the benchmark reported an error: {row['error']}")
    if prompts and row["lossless"] is False:
        where = ", ".join(f"{d['id']} at new token {d['at']}" for d in divergences[:5]) or "no per-prompt detail"
        warn(warnings, "bench", f"{name}: speculative output differs from plain greedy on {len(divergences)} of {row['checked']} prompts ({where}); speculative decoding must be lossless")
    if ngram and ngram["lossless"] is False:
        where = ", ".join(f"{d['id']} at new token {d['at']}" for d in ngram["divergences"][:5]) or "no per-prompt detail"
        warn(warnings, "bench", f"{name}: n-gram output differs from plain greedy on {len(ngram['divergences'])} of {ngram['checked']} prompts ({where}); speculative decoding must be lossless")
    return row


def _span_figures(data) -> dict[str, Any] | None:
    """Acceptance inside thinking, tool-call and answer spans (eyrie.bench.spans), or None where no round fell in thinking or a
    tool call (a reply of answer only says nothing the mean does not) or the JSON predates the split."""
    if not isinstance(data, dict):
        return None
    spans = {span: data.get(span) if isinstance(data.get(span), dict) else {} for span in ("thinking", "tool_call", "answer")}
    figures = {span: {"rounds": int(s.get("rounds") or 0), "mean": number(s.get("mean"))} for span, s in spans.items()}
    return figures if figures["thinking"]["rounds"] or figures["tool_call"]["rounds"] else None


def _sweep_figures(data: dict, bench: dict, config: dict, drafter_dir: str | None, warnings: list) -> dict[str, Any]:
    """A benchmark's sweep block: the main chain and each setting side by side, the recommended one and the command serving it."""
    best = data.get("best") if isinstance(data.get("best"), dict) else None
    main = data.get("main") if isinstance(data.get("main"), dict) else None
    rows = []
    if main:  # the main chain's acceptance per position and losslessness are the benchmark's own
        rows.append(_sweep_setting(main, True, bench["acceptance_rate_per_position"], bench["lossless"], bench["divergences"], bench["checked"], best))
    for setting in data.get("settings") or []:
        if not isinstance(setting, dict):
            continue
        checked = len([p for p in setting.get("per_prompt") or [] if isinstance(p, dict)])
        different = [{"id": str(d.get("id")), "at": d.get("at")} for d in setting.get("different") or [] if isinstance(d, dict)]
        rates = [number(r) for r in setting.get("acceptance_rate_per_depth") or []]
        figures = _sweep_setting(setting, False, rates, setting.get("lossless"), different, checked, best)
        rows.append(figures)
        if figures["lossless"] is False:
            where = ", ".join(f"{d['id']} at new token {d['at']}" for d in different[:5]) or "no per-prompt detail"
            warn(warnings, "bench", f"{bench['name']}: sweep setting {figures['label']} output differs from plain greedy on {len(different)} of {checked} "
                                    f"prompts ({where}); speculative decoding must be lossless")
    figures = {"rows": rows, "lossless_checked_in": data.get("lossless_checked_in"), "prompts": number(data.get("prompts")),
               "best": None, "within_noise": None, "sglang_flags": None, "ngram_faster": None,
               "command": None, "command_lines": None, "command_error": None}
    if best and all(isinstance(best.get(key), int) for key in ("steps", "topk", "draft_tokens")):
        figures["best"] = next((r for r in rows if r["recommended"]), None) or _sweep_setting(best, bool(best.get("main_chain")), [], True, [], None, best)
        measured = next((s for s in data.get("settings") or [] if isinstance(s, dict) and s.get("label") == best.get("label")), None)
        figures["ngram_faster"] = _ngram_faster(measured, bench.get("ngram"))
        tied = best.get("within_noise")
        figures["within_noise"] = [str(label) for label in tied] if isinstance(tied, list) else None
        figures["sglang_flags"] = str(data.get("sglang_flags") or shlex.join(eagle3_flags(best["steps"], best["topk"], best["draft_tokens"])))
        if drafter_dir:
            figures.update(setting_command(config, str(drafter_dir), best))
    return figures


def _ngram_faster(setting: dict | None, ngram: dict | None, shown: int = 5) -> dict[str, Any] | None:
    """The prompts on which the n-gram outran a sweep setting: {"count", "of", "worst"} (the `shown` slowest, with both
    acceptance lengths and the setting's tokens/s over the n-gram's), or None without per-prompt figures for both."""
    if not setting or not ngram:
        return None
    theirs = {p["id"]: p for p in ngram.get("per_prompt") or []}
    pairs = []
    for mine in setting.get("per_prompt") or []:
        other = theirs.get(str(mine.get("id"))) if isinstance(mine, dict) else None
        if other is None:
            continue
        ours, its = number(mine.get("tokens_per_s")), number(other.get("tokens_per_s"))
        if ours and its:
            pairs.append({"id": str(mine.get("id")), "acceptance": number(mine.get("acceptance_length_mean")),
                          "ngram_acceptance": other.get("acceptance_length_mean"), "ratio": ours / its})
    if not pairs:
        return None
    slower = sorted((p for p in pairs if p["ratio"] < 1), key=lambda p: p["ratio"])
    return {"count": len(slower), "of": len(pairs), "worst": slower[:shown]}


def _interval(data) -> list[float] | None:
    """A recorded [low, high], or None: absent (runs before it was recorded) or malformed."""
    valid = isinstance(data, list) and len(data) == 2 and all(number(v) is not None for v in data)
    return [number(v) for v in data] if valid else None


def _sweep_setting(data: dict, main: bool, rates: list, lossless, different: list, checked: int | None, best: dict | None) -> dict[str, Any]:
    """One row of the sweep table: a setting (or the main chain) as measured, and whether it is the recommended one."""
    setting = {key: data.get(key) for key in ("steps", "topk", "draft_tokens")}
    speedup, over_ngram = number(data.get("speedup")), number(data.get("speedup_over_ngram"))
    valid = all(isinstance(v, int) for v in setting.values())
    return {
        "speedup_interval": _interval(data.get("speedup_interval")),  # 95% over prompts, paired with greedy
        "speedup_over_ngram_interval": _interval(data.get("speedup_over_ngram_interval")),  # the same, with the n-gram
        "label": str(data.get("label") or "?"),
        **setting,
        "main": main,
        "mean_acceptance_length": number(data.get("mean_acceptance_length")),
        "acceptance_rate_per_depth": rates,
        "tokens_per_s": number(data.get("tokens_per_s")),
        "speedup": speedup,
        "slower": speedup is not None and speedup < 1,
        "speedup_over_ngram": over_ngram,
        "slower_than_ngram": over_ngram is not None and over_ngram < 1,
        "lossless": lossless,
        "identical": None if checked is None else checked - len(different),
        "checked": checked,
        "divergences": different,
        "flags": shlex.join(eagle3_flags(*setting.values())) if valid else None,
        "recommended": bool(best) and main == bool(best.get("main_chain")) and all(best.get(k) == v for k, v in setting.items()),
        "predicted": _predicted(data.get("predicted")),
    }


def _predicted(data) -> dict[str, Any] | None:
    """Training's walk for a sweep setting (eyrie.bench.parity.predict_settings); None for settings it did not walk
    and JSONs written before it was recorded."""
    if not isinstance(data, dict) or number(data.get("length")) is None:
        return None
    return {"length": number(data["length"]), "gap": number(data.get("gap"))}


def _parity_figures(data) -> dict[str, Any] | None:
    """Training's predicted acceptance for the benchmark's k beside the measured one; None for JSONs without it."""
    if not isinstance(data, dict) or number(data.get("simulated")) is None:
        return None
    keys = ("k", "simulated", "form", "measured", "gap", "max_gap", "judged", "not_judged_because", "source", "eval_samples")
    figures = {key: data.get(key) for key in keys}
    interval = data.get("interval")  # the measurement's 95% interval over its prompts; absent before it was recorded
    valid = isinstance(interval, list) and len(interval) == 2 and all(number(v) is not None for v in interval)
    figures["interval"] = [number(v) for v in interval] if valid else None
    own = data.get("heldout_prompts")  # the benchmark's own prompts beside a like-with-like judgement; absent before it
    figures["heldout_prompts"] = ({**{key: number(own.get(key)) for key in ("measured", "simulated", "gap", "eval_samples")},
                                   "dataset": own.get("dataset") if isinstance(own.get("dataset"), str) else None}
                                  if isinstance(own, dict) and number(own.get("measured")) is not None else None)
    return figures


def _ngram_figures(data: dict) -> dict[str, Any]:
    """The n-gram baseline's block of a benchmark JSON, as the drafter's figures are read."""
    per_prompt = [p for p in data.get("per_prompt") or [] if isinstance(p, dict)]
    speedup = number(data.get("speedup"))
    lengths = [entry for entry in data.get("by_draft_tokens") or [] if isinstance(entry, dict)]  # absent before it was recorded
    return {
        "max_ngram": data.get("max_ngram"),
        "min_ngram": data.get("min_ngram"),
        "draft_tokens": data.get("draft_tokens"),
        "by_draft_tokens": [{"draft_tokens": e.get("draft_tokens"), "tokens_per_s": number(e.get("tokens_per_s")),
                             "mean_acceptance_length": number(e.get("mean_acceptance_length"))} for e in lengths],
        "mean_acceptance_length": number(data.get("mean_acceptance_length")),
        "acceptance_rate_per_position": [number(r) for r in data.get("acceptance_rate_per_position") or []],
        "rounds": data.get("rounds"),
        "new_tokens": data.get("new_tokens"),
        "tokens_per_s": number(data.get("tokens_per_s")),
        "speedup": speedup,
        "slower": speedup is not None and speedup < 1,
        "lossless": data.get("lossless"),
        "identical": sum(1 for p in per_prompt if p.get("identical")),
        "checked": len(per_prompt),
        "divergences": [{"id": str(p.get("id")), "at": p.get("first_divergence")} for p in per_prompt if not p.get("identical")],
        "per_prompt": [{"id": str(p.get("id")), "acceptance_length_mean": number(p.get("acceptance_length_mean")), "tokens_per_s": number(p.get("tokens_per_s"))} for p in per_prompt],
    }
