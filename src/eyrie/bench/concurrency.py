"""The benchmark JSON's `concurrency` block: greedy, the drafter's chain(s) and prompt lookup decoding B requests at
once (eyrie.decoding.batched_speculative) for each B of bench.concurrency, and the setting recommended per load.

Per B: every prompt, in waves of B (ceil(P / B) batches; the last wave, or a load larger than P, filled by repeating
prompts from the first: `waves` and `distinct_prompts` say so), mixed lengths as they come, decoded by batched greedy
and by each setting on the same engine, so every load's figures cover the same prompts. Figures, summed over the
waves: output tok/s in total and per request (total / B), mean acceptance (tokens emitted per row-round, the bonus counted), speedup over batched
greedy at that B, and losslessness: each row's tokens equal that row's greedy tokens, in float32 (timed in another
dtype, the decodes run again on a float32 copy, as the batch-1 benchmark's float32 check does).

The recommendation per B is the fastest lossless setting that beats greedy, else "no speculation", with its serving
flags: SGLang's for a launch at that load, SGLang's adaptive tiers (--speculative-adaptive, candidate steps per batch
size) and vLLM's `num_speculative_tokens_per_batch_size` schedule, both from the fastest lossless chain at each load
(0 drafts where no chain beats greedy).
The sweep's trees are batched too (eyrie.decoding.batched_tree): EAGLE's maintainers advise no trees above batch 1,
and the figures per B say where that holds for this drafter; the schedules above take the best chain at each load.
"""

from __future__ import annotations

import copy
import json
import shlex
import time

from eyrie.bench.sweep import label
from eyrie.decoding.batched_speculative import BatchedSpeculative, trimmed
from eyrie.decoding.batched_tree import TreeDrafts
from eyrie.decoding.graphs import free_unused_graphs
from eyrie.decoding.tree import TreeShape
from eyrie.target.serving import eagle3_flags

NO_SPECULATION = "no speculation"
WARMUP_TOKENS = 4
ADAPTIVE_CONFIG_FILE = "sglang-adaptive.json"  # where the user writes sglang_adaptive_config: SGLang reads the tiers from a file
OFF_REASON = "bench.concurrency is empty: batched decoding is off (on the CPU default it would add minutes to a 15-minute run)"


def settings_of(draft_tokens: int, sweep: list, ngram: bool) -> list[dict]:
    """{label, kind, draft_tokens, steps, topk}: the main chain, the sweep's chains and trees, the n-gram at the main k.
    draft_tokens is k for a chain or the n-gram (k + 1 rows verified), SGLang's N for a tree (N rows verified)."""
    is_chain = {s: label(s).startswith("chain") for s in sweep}
    ks = [draft_tokens] + [s.steps for s in sweep if is_chain[s]]
    chains = [{"label": f"chain {k}", "kind": "chain", "draft_tokens": k, "steps": k, "topk": 1} for k in dict.fromkeys(ks)]
    trees = [{"label": label(s), "kind": "tree", "draft_tokens": s.draft_tokens, "steps": s.steps, "topk": s.topk}
             for s in dict.fromkeys(sweep) if not is_chain[s]]
    ngrams = [{"label": f"n-gram {draft_tokens}", "kind": "ngram", "draft_tokens": draft_tokens, "steps": draft_tokens, "topk": 1}] if ngram else []
    return chains + trees + ngrams


def verify_rows(setting: dict) -> int:
    return setting["draft_tokens"] if setting["kind"] == "tree" else setting["draft_tokens"] + 1


def prompt_waves(encoded: list[tuple[str, list[int]]], batch: int) -> list[list[list[int]]]:
    """Batches of `batch` prompts that decode every prompt at least once: ceil(P / B) of them, filled in order,
    wrapping to the first prompts."""
    count = max(1, -(-len(encoded) // batch))
    return [[encoded[(wave * batch + i) % len(encoded)][1] for i in range(batch)] for wave in range(count)]


def _greedy(engine, prompts, max_new_tokens: int, stop_ids):
    start = time.perf_counter()
    rows = engine.generate(prompts, max_new_tokens)
    return [trimmed(r, stop_ids) for r in rows], time.perf_counter() - start


def decoders_for(engine, drafter, settings: list[dict], prompts, max_new_tokens: int, width: int | None = None) -> list[BatchedSpeculative]:
    """One decoder per setting, with the engine grown to the largest setting's cache first and each setting's round
    graphs captured (BatchedSpeculative.prepare): nothing is allocated or captured inside a timed decode. width: the
    longest prompt any batch of this size will bring (default: the longest of `prompts`)."""
    width = width or max(len(p) for p in prompts)
    decoders = []
    for setting in settings:
        if setting["kind"] == "tree":
            drafts = TreeDrafts(engine, drafter, TreeShape(setting["steps"], setting["topk"], setting["draft_tokens"]))
        else:
            drafts = drafter if setting["kind"] == "chain" else "ngram"
        decoders.append(BatchedSpeculative(engine, drafts))
    slots = [d.needed_slots(width, max_new_tokens, s["steps"])[0] for d, s in zip(decoders, settings)]
    engine.reserve(len(prompts), max([width + max_new_tokens] + slots), max_new_tokens)
    for decoder, setting in zip(decoders, settings):
        decoder.prepare(len(prompts), width, max_new_tokens, setting["steps"])
    return decoders


def measure_batch(engine, drafter, settings: list[dict], waves: list[list[list[int]]], max_new_tokens: int, stop_ids) -> tuple[dict, list[dict]]:
    """(greedy's figures, each setting's) at B = len(waves[0]), summed over the waves, each decoder warmed up once untimed first."""
    width = max(len(p) for wave in waves for p in wave)
    decoders = decoders_for(engine, drafter, settings, waves[0], max_new_tokens, width)
    _greedy(engine, waves[0], WARMUP_TOKENS, stop_ids)
    greedy_paths, greedy_seconds = [], 0.0
    for prompts in waves:
        tokens, seconds = _greedy(engine, prompts, max_new_tokens, stop_ids)
        greedy_paths.append(tokens)
        greedy_seconds += seconds
    batch, total = len(waves[0]), sum(len(t) for tokens in greedy_paths for t in tokens)
    greedy = {"tokens_per_s": total / greedy_seconds, "per_request_tokens_per_s": total / greedy_seconds / batch, "new_tokens": total,
              "seconds": greedy_seconds}
    rows = []
    for setting, decoder in zip(settings, decoders):
        decoder.generate(waves[0], WARMUP_TOKENS, stop_ids, setting["steps"])
        produced = seconds = rounds = row_rounds = emitted = identical = 0
        for prompts, greedy_tokens in zip(waves, greedy_paths):
            result = decoder.generate(prompts, max_new_tokens, stop_ids, setting["steps"])
            produced += sum(len(t) for t in result.tokens)
            seconds += result.seconds
            rounds += result.rounds
            row_rounds += sum(len(lengths) for lengths in result.acceptance_lengths)
            emitted += sum(sum(lengths) for lengths in result.acceptance_lengths)
            identical += sum(a == b for a, b in zip(result.tokens, greedy_tokens))
        tokens_per_s = produced / seconds
        rows.append({**setting, "tokens_per_s": tokens_per_s, "per_request_tokens_per_s": tokens_per_s / batch, "new_tokens": produced,
                     "seconds": seconds, "rounds": rounds, "round_ms": 1000 * seconds / max(rounds, 1),
                     "mean_acceptance_length": emitted / row_rounds if row_rounds else None,
                     "speedup": tokens_per_s / greedy["tokens_per_s"],
                     "identical_rows": identical, "rows": batch * len(waves)})
    return greedy, rows


def float32_identical(model, drafter, settings: list[dict], waves: list[list[list[int]]], max_new_tokens: int, stop_ids, open_engine) -> list[int]:
    """Per setting: rows (over all waves) whose float32 tokens equal float32 batched greedy's (a float32 copy of the target and drafter)."""
    model32, drafter32 = copy.deepcopy(model).float(), copy.deepcopy(drafter).float()
    # Graphed on a GPU as the timed decodes are: eagerly, launch-bound float32 rounds made this check most of the block.
    engine = open_engine(model32, len(waves[0]))
    width = max(len(p) for wave in waves for p in wave)
    greedy = [_greedy(engine, prompts, max_new_tokens, stop_ids)[0] for prompts in waves]
    decoders = decoders_for(engine, drafter32, settings, waves[0], max_new_tokens, width)
    return [sum(a == b for prompts, reference in zip(waves, greedy)
                for a, b in zip(d.generate(prompts, max_new_tokens, stop_ids, s["steps"]).tokens, reference))
            for s, d in zip(settings, decoders)]


def recommend(rows: list[dict]) -> dict | None:
    """The fastest lossless setting that beats greedy (speedup > 1), or None: no speculation at this load."""
    winners = [r for r in rows if r["lossless"] and r["speedup"] > 1.0]
    return max(winners, key=lambda r: r["tokens_per_s"], default=None)


def sglang_flags(best: dict | None) -> str:
    """SGLang's launch flags for one load (the drafter's path aside): an EAGLE-3 chain or tree, NGRAM, or none."""
    if best is None:
        return ""
    if best["kind"] == "ngram":
        return shlex.join(["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(best["draft_tokens"] + 1)])
    return shlex.join(eagle3_flags(best["steps"], best["topk"], verify_rows(best)))


def vllm_schedule(per_batch: list[dict]) -> list[list[int]] | None:
    """vLLM's num_speculative_tokens_per_batch_size for the chain: [start, end, k] ranges, each measured B from itself to the
    next one less one (the first from 1; vLLM carries the last past its end), k = that load's fastest lossless chain's
    (`chain`), 0 without one; None when no chain wins at any load (serve without speculation)."""
    if not any(p["chain"] for p in per_batch):
        return None
    schedule = []
    for index, entry in enumerate(per_batch):
        k = entry["chain"]["draft_tokens"] if entry["chain"] else 0
        start = 1 if index == 0 else entry["batch"]
        end = per_batch[index + 1]["batch"] - 1 if index + 1 < len(per_batch) else entry["batch"]
        schedule.append([start, end, k])
    return schedule


def vllm_flags(schedule: list[list[int]] | None, drafter_dir: str = "<drafter>") -> str | None:
    """`--speculative-config` for vLLM's batch-aware chain: num_speculative_tokens the schedule's largest k."""
    if schedule is None:
        return None
    config = {"method": "eagle3", "model": str(drafter_dir), "num_speculative_tokens": max(k for _, _, k in schedule),
              "num_speculative_tokens_per_batch_size": schedule}
    return shlex.join(["--speculative-config", json.dumps(config)])


def sglang_adaptive_config(per_batch: list[dict]) -> dict | None:
    """SGLang's --speculative-adaptive-config from the recommendation per load: one tier per measured B (the first keyed
    "1"; SGLang routes a batch to the largest tier at or below it, so a tier holds from its B to the next), its
    candidate_steps that load's fastest lossless chain's k alone (`chain`), so SGLang serves what was measured there
    instead of probing others, and [0] (no drafting) where no chain wins; None when none wins at any load."""
    if not any(p["chain"] for p in per_batch):
        return None
    tiers = {}
    for index, entry in enumerate(per_batch):
        tiers[str(1 if index == 0 else entry["batch"])] = {"candidate_steps": [entry["chain"]["draft_tokens"] if entry["chain"] else 0]}
    return tiers


def sglang_adaptive_flags(adaptive: dict | None, config_path: str = ADAPTIVE_CONFIG_FILE) -> str | None:
    """SGLang's launch flags for the adaptive tiers written to config_path (the drafter's path aside); its initial
    --speculative-num-steps the largest k (each single-candidate tier starts at its own), draft tokens derived by SGLang."""
    if adaptive is None:
        return None
    steps = max(s for tier in adaptive.values() for s in tier["candidate_steps"])
    return shlex.join(["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", str(steps), "--speculative-eagle-topk", "1",
                       "--speculative-adaptive", "--speculative-adaptive-config", str(config_path)])


def concurrency_block(model, open_engine, drafter, encoded, cfg: dict, stop_ids, sweep: list = (), drafter_dir=None) -> dict:
    """The `concurrency` block: {batches, settings, per_batch [{batch, engine_rows, waves, distinct_prompts, greedy, settings,
    recommended, chain, sglang_flags}], vllm_schedule, vllm_flags, off_reason}. open_engine(model, rows): a BatchedRows of
    exactly `rows` rows on `model` (open_batched_greedy with row_step 1), opened per load: B requests compute B rows."""
    import torch

    batches = sorted(set(cfg.get("concurrency") or []))
    block = {"batches": batches, "off_reason": None,
             "lossless_dtype": "float32", "per_batch": [], "vllm_schedule": None, "vllm_flags": None,
             "sglang_adaptive_config": None, "sglang_adaptive_flags": None}
    if not batches:
        block["off_reason"] = OFF_REASON
        return block
    settings = settings_of(cfg["draft_tokens"], sweep, cfg.get("ngram", True))
    block["settings"] = [s["label"] for s in settings]
    capture_failures = []
    for batch in batches:
        waves = prompt_waves(encoded, batch)
        started = time.perf_counter()
        engine = open_engine(model, batch)
        greedy, rows = measure_batch(engine, drafter, settings, waves, cfg["max_new_tokens"], stop_ids)
        engine_rows = engine.rows
        capture_failures += engine.capture_failures
        del engine
        free_unused_graphs()  # this load's engine and decoders, before the float32 copies load
        measured = time.perf_counter()
        if model.dtype == torch.float32:
            identical = [r["identical_rows"] for r in rows]
        else:
            identical = float32_identical(model, drafter, settings, waves, cfg["max_new_tokens"], stop_ids, open_engine)
        checked = time.perf_counter()
        free_unused_graphs()  # this B's decoders and float32 copies
        for row, same in zip(rows, identical):
            row["lossless"] = same == row["rows"]
            row["float32_identical_rows"] = same
        print(f"concurrency B = {batch} ({len(waves)} waves): greedy {greedy['tokens_per_s']:.0f} tok/s; "
              + ", ".join(f"{r['label']} {r['speedup']:.2f}x" + ("" if r["lossless"] else f" (NOT lossless: {r['float32_identical_rows']}/{r['rows']} rows)")
                          for r in rows)
              + f"; measured in {measured - started:.1f} s, float32 check {checked - measured:.1f} s", flush=True)
        best, chain = recommend(rows), recommend([r for r in rows if r["kind"] == "chain"])
        keys = ("label", "kind", "draft_tokens", "steps", "topk", "speedup")
        block["per_batch"].append({"batch": batch, "engine_rows": engine_rows, "waves": len(waves),
                                   "distinct_prompts": min(batch * len(waves), len(encoded)), "greedy": greedy, "settings": rows,
                                   "recommended": None if best is None else {k: best[k] for k in keys},
                                   "chain": None if chain is None else {k: chain[k] for k in keys},  # the schedules' chain at this load
                                   "recommendation": NO_SPECULATION if best is None else best["label"],
                                   "sglang_flags": sglang_flags(best)})
    block["capture_failures"] = list(dict.fromkeys(capture_failures))  # steps or rounds that ran eagerly, and why
    block["vllm_schedule"] = vllm_schedule(block["per_batch"])
    block["vllm_flags"] = vllm_flags(block["vllm_schedule"], drafter_dir or "<drafter>")
    block["sglang_adaptive_config"] = sglang_adaptive_config(block["per_batch"])
    block["sglang_adaptive_flags"] = sglang_adaptive_flags(block["sglang_adaptive_config"])
    return block
