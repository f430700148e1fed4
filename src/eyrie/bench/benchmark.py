"""The honest benchmark: plain greedy and speculative decoding of the same prompts, side by side, in one run.

Each prompt is decoded by the same target in the same process: plain greedy (one token per target
forward, with a KV cache), chain speculative decoding with the drafter (eyrie.decoding.transformers_path)
and, unless bench.ngram is false, the same rounds drafted by prompt lookup (eyrie.decoding.ngram), the
training-free baseline the drafter must beat. All run on the same decoder (bench.decoder): eyrie's
static-cache loop (CUDA graphs on CUDA) when the target is Llama-structured, else transformers' own;
the JSON names the one that ran. The JSON records, per prompt and overall, the measured acceptance
length (the bonus token counts), the per-position acceptance rate, tokens/s of every decoder and
whether the outputs are identical; the n-gram baseline's figures sit in its `ngram` block. Each
setting of bench.sweep (chains and SGLang-style trees, eyrie.bench.sweep) decodes the same prompts
too, and its `sweep` block recommends the fastest lossless one with the SGLang flags that serve it.

An acceptance length near 1.0 means the drafter is not engaged: that is an error, not a result. The
JSON is written first, with the error in it, so nothing measured is lost.
"""

from __future__ import annotations

import contextlib
import os
import platform
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from eyrie.bench.checks import check_drafter_logits, check_template, read_drafter_config
from eyrie.bench.domain_prompts import render_prompt
from eyrie.bench.errors import BenchmarkError, DrafterNotEngagedError, ParityGapError
from eyrie.bench.floor import floor_block
from eyrie.bench.margin import add_margins
from eyrie.bench.ngram_baseline import fastest_ngram, ngram_row
from eyrie.bench.parity import measured_interval, parity, parity_prompts, predict_settings, serve_parity_samples
from eyrie.bench.prompt_files import load_benchmark_prompts
from eyrie.bench.rounds import acceptance_summary, first_divergence, round_fields
from eyrie.bench.sweep import check_sweep, decode_settings, sweep_block, verdicts, warm_up, widest_draft
from eyrie.bench.sweep import label as setting_label  # `label` names the drafter's path in this module
from eyrie.bench.vocab_reach import outside_draft_vocab
from eyrie.core.atomic import write_json_atomically
from eyrie.core.inductor_cache import use_inductor_cache
from eyrie.core.schema import WHEEL_BENCHMARKS, with_defaults


NOT_ENGAGED_CAUSES = (
    "serving with --speculative-algorithm EAGLE instead of EAGLE3 (the EAGLE-1/2 head ignores the aux states)",
    "aux layer ids off by one (eagle_aux_hidden_state_layer_ids are SGLang's: output of layer i = hidden_states[i + 1])",
    "d2t stored as draft->target index instead of offset (SGLang adds it: target id = i + d2t[i])",
    "the chat template differs between training and serving, so the drafter sees unfamiliar token patterns",
    "fc fed the target's final hidden state instead of the 3 concatenated aux states",
)

# The schema's defaults, for callers outside the pipeline (the pipeline passes a validated, complete section).
WARMUP_TOKENS = 8


# --------------------------------------------------------------------------- prompts


def first_turn(prompt: dict) -> list[dict]:
    """What the benchmark asks: an optional leading system message and the first user turn."""
    messages = prompt["messages"]
    system = [m for m in messages[:1] if m["role"] == "system"]
    user = next((m for m in messages if m["role"] == "user"), None)
    if user is None:
        raise BenchmarkError(f"prompt {prompt['id']!r}: has no user turn to benchmark")
    return [{"role": m["role"], "content": m["content"]} for m in system + [user]]


# --------------------------------------------------------------------------- checks


def stop_ids_of(model, tokenizer) -> set[int]:
    """The target's stop tokens: its generation config's eos ids and the tokenizer's eos."""
    configured = model.generation_config.eos_token_id
    stop = set(configured if isinstance(configured, list) else [] if configured is None else [configured])
    if tokenizer.eos_token_id is not None:
        stop.add(tokenizer.eos_token_id)
    return stop


def hardware_description(device) -> str:
    import torch

    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    name = platform.processor() or platform.machine()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        name = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name}, {os.cpu_count()} logical CPUs, {torch.get_num_threads()} torch threads"


# --------------------------------------------------------------------------- measuring


class Phases:
    """Wall seconds of each phase of a benchmark job: printed as each ends (the job's log shows where the time goes
    while it runs) and kept in the JSON (`phase_seconds`)."""

    def __init__(self, name: str):
        self.name, self.seconds = name, {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        yield
        self.seconds[phase] = round(time.perf_counter() - start, 2)
        print(f"bench {self.name}: {phase}: {self.seconds[phase]:.1f} s", flush=True)

    @contextlib.contextmanager
    def part(self, what: str):
        """A part of the running phase, printed as it ends and not kept in the JSON: a warm-up that compiles and tunes
        for minutes (bench.compile_mode) shows which decoder it has reached."""
        start = time.perf_counter()
        yield
        print(f"bench {self.name}:   {what}: {time.perf_counter() - start:.1f} s", flush=True)


def prompt_row(prompt_id: str, prompt_ids: list[int], plain, spec) -> dict:
    return {
        "id": prompt_id,
        "prompt_tokens": len(prompt_ids),
        "new_tokens": len(plain.tokens),
        "spec_new_tokens": len(spec.tokens),
        "greedy_tokens_per_s": len(plain.tokens) / plain.seconds,
        "spec_tokens_per_s": len(spec.tokens) / spec.seconds,
        "greedy_seconds": plain.seconds,
        "spec_seconds": spec.seconds,
        "greedy_forwards": plain.forwards,
        "spec_target_forwards": spec.target_forwards,
        **round_fields(plain, spec),
    }


def summarise(rows: list[dict], draft_tokens: int) -> dict:
    """Aggregates over all prompts: token-weighted, not a mean of per-prompt means."""
    greedy_tps = sum(r["new_tokens"] for r in rows) / sum(r["greedy_seconds"] for r in rows)
    spec_tps = sum(r["spec_new_tokens"] for r in rows) / sum(r["spec_seconds"] for r in rows)
    return {
        **acceptance_summary(rows, draft_tokens),
        "greedy_tokens_per_s": greedy_tps,
        "spec_tokens_per_s": spec_tps,
        "speedup": spec_tps / greedy_tps,
        "prompts": len(rows),
        "new_tokens": sum(r["new_tokens"] for r in rows),
    }


def not_engaged_message(mean: float | None, threshold: float, rounds: int, out_path) -> str:
    causes = "".join(f"\n  - {cause}" for cause in NOT_ENGAGED_CAUSES)
    shown = "none (no verify round ran)" if mean is None else f"{mean:.3f}"
    return (
        f"mean acceptance length {shown} over {rounds} rounds is below bench.min_acceptance_length {threshold}: "
        f"the drafter is not engaged (1.0 means only the target's own token is kept each round). "
        f"Usual causes:{causes}\nThe measurements are in {out_path}, under 'error'."
    )


def load_models(target_dir, drafter_dir_or_model, dtype: str, device: str, template_sha256_expected: str | None, trust_remote_code: bool):
    """(target, tokenizer, drafter, drafter label, template sha256): a mismatched template is refused before the drafter loads."""
    from eyrie.drafter.checkpoint import load_drafter
    from eyrie.drafter.model import Eagle3Drafter
    from eyrie.target.model import load_target

    model, tokenizer = load_target(target_dir, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    in_memory = isinstance(drafter_dir_or_model, Eagle3Drafter)
    label = "the in-memory drafter" if in_memory else str(drafter_dir_or_model)
    drafter_config = None if in_memory else read_drafter_config(drafter_dir_or_model)
    template_sha256 = check_template(tokenizer, target_dir, template_sha256_expected, drafter_config, label)
    if in_memory:
        drafter = drafter_dir_or_model
    else:
        drafter = load_drafter(drafter_dir_or_model, model.get_input_embeddings().weight.detach())
    drafter = drafter.to(device=model.device, dtype=model.dtype).eval()
    return model, tokenizer, drafter, label, template_sha256


def measure(model, drafter, prompts: list[tuple[str, list[int]]], max_new_tokens: int, stop_ids, draft_tokens: int, ngram=None,
            sweep: list = (), greedy_paths: dict | None = None, sweep_prompts: int | None = None,
            phases: Phases | None = None, ngram_draft_tokens: list[int] | None = None, spec_paths: dict | None = None) -> tuple[list[dict], dict[int, list[dict]], list[list[dict]]]:
    """Plain greedy, then speculative, then (given an NgramDecoder) n-gram at each of ngram_draft_tokens (default: the
    drafter's k), then each sweep setting (TreeShapes), on each (id, prompt ids): a row per prompt for the drafter, per
    n-gram draft length (a dict by length) and per setting.

    `model` is a transformers model or a StaticLlama around one (see open_decoder): every decoder uses it.
    They all run back to back on each prompt, so drift over the run hits them alike. greedy_paths, when given,
    receives each prompt's greedy tokens. The sweep decodes the first `sweep_prompts` prompts (None: all).
    """
    from eyrie.decoding.decode import greedy_decode, speculative_decode

    greedy_paths = {} if greedy_paths is None else greedy_paths
    phases = phases or Phases("measure")
    # Warm up every decoder once, so the first timed prompt pays no one-time costs (allocations, kernel choice, graph capture).
    with phases("warm-up (compile, capture)"):
        with phases.part("greedy"):
            greedy_decode(model, prompts[0][1], WARMUP_TOKENS, stop_ids)
        with phases.part(f"chain {draft_tokens}"):
            speculative_decode(model, drafter, prompts[0][1], WARMUP_TOKENS, stop_ids, draft_tokens)
        ngram_rows = {k: [] for k in ngram_draft_tokens or [draft_tokens]} if ngram else {}
        for k in ngram_rows:
            with phases.part(f"n-gram {k}"):
                ngram.decode(prompts[0][1], WARMUP_TOKENS, stop_ids, k)
        for shape in sweep:
            with phases.part(setting_label(shape)):
                warm_up(model, drafter, prompts[0][1], WARMUP_TOKENS, stop_ids, [shape])
    rows, sweep_rows = [], [[] for _ in sweep]
    with phases(f"timed decoding ({len(prompts)} prompts)"):
        _decode_all(model, drafter, prompts, max_new_tokens, stop_ids, draft_tokens, ngram, sweep, greedy_paths, sweep_prompts,
                    rows, ngram_rows, sweep_rows, {} if spec_paths is None else spec_paths)
    return rows, ngram_rows, sweep_rows


def _decode_all(model, drafter, prompts, max_new_tokens, stop_ids, draft_tokens, ngram, sweep, greedy_paths, sweep_prompts,
                rows, ngram_rows, sweep_rows, spec_paths) -> None:
    from eyrie.decoding.decode import greedy_decode, speculative_decode

    for index, (prompt_id, prompt_ids) in enumerate(prompts):
        plain = greedy_decode(model, prompt_ids, max_new_tokens, stop_ids)
        greedy_paths[prompt_id] = plain.tokens
        swept = sweep if sweep_prompts is None or index < sweep_prompts else []
        spec = speculative_decode(model, drafter, prompt_ids, max_new_tokens, stop_ids, draft_tokens)
        spec_paths[prompt_id] = spec.tokens
        rows.append(prompt_row(prompt_id, prompt_ids, plain, spec))
        for k, k_rows in ngram_rows.items():
            k_rows.append(ngram_row(prompt_id, plain, ngram.decode(prompt_ids, max_new_tokens, stop_ids, k)))
        for setting_rows, row in zip(sweep_rows, decode_settings(model, drafter, prompt_id, prompt_ids, plain, max_new_tokens, stop_ids, swept)):
            setting_rows.append(row)


def float32_check(target_dir, drafter_dir_or_model, encoded, cfg: dict, stop_ids, device: str, trust_remote_code: bool, sweep: list = ()) -> dict:
    """Greedy, drafter and every sweep setting's decoding of the same prompts again in float32, untimed: the losslessness verdict.

    Timing runs in the serving dtype (bf16 on GPUs, where an fp32 verify costs up to 3x more); there a
    verify over k + 1 tokens can round differently from one-token decoding and greedy paths part at a
    near-tie, so exact equality is only a fair test in float32. identical/different are the main chain's;
    `sweep` holds each setting's; lossless is true only when the chain and every setting are.
    """
    from eyrie.decoding.decode import greedy_decode, speculative_decode

    model, _, drafter, _, _ = load_models(target_dir, drafter_dir_or_model, "float32", device, None, trust_remote_code)
    engine, _, _ = open_bench_decoder(model, {**cfg, "compile": False}, encoded)  # untimed: not worth compiling
    different, sweep_rows = [], [[] for _ in sweep]
    for index, (prompt_id, prompt_ids) in enumerate(encoded):
        plain = greedy_decode(engine, prompt_ids, cfg["max_new_tokens"], stop_ids)
        spec = speculative_decode(engine, drafter, prompt_ids, cfg["max_new_tokens"], stop_ids, cfg["draft_tokens"]).tokens
        swept = sweep if cfg["sweep_prompts"] is None or index < cfg["sweep_prompts"] else []
        if spec != plain.tokens:
            different.append({"id": prompt_id, "at": first_divergence(plain.tokens, spec)})
        for setting_rows, row in zip(sweep_rows, decode_settings(engine, drafter, prompt_id, prompt_ids, plain, cfg["max_new_tokens"], stop_ids, swept)):
            setting_rows.append(row)
    settings = verdicts(sweep, sweep_rows)
    return {"dtype": "float32", "checked": len(encoded), "identical": len(encoded) - len(different), "different": different,
            "sweep": settings, "lossless": not different and all(s["lossless"] for s in settings)}


def open_bench_decoder(model, cfg: dict, encoded: list[tuple[str, list[int]]], parity_samples: list[dict] = ()):
    """(decoder both measurements use, its label, why the static one was not used or None), sized for every prompt and for
    each parity sample's prompt and reply (eyrie.bench.parity.serve_parity_samples)."""
    from eyrie.decoding.static import open_decoder
    from eyrie.decoding.static_common import needed_capacity

    longest = max(len(ids) for _, ids in encoded)
    widest = widest_draft(cfg["draft_tokens"], cfg.get("sweep"))
    capacity = max([needed_capacity(longest, max(cfg["max_new_tokens"], WARMUP_TOKENS), widest)]
                   + [needed_capacity(len(s["prompt_ids"]), s["reply_tokens"], cfg["draft_tokens"]) for s in parity_samples])
    return open_decoder(model, cfg["decoder"], capacity, compile=cfg["compile"], compile_mode=cfg["compile_mode"])


@dataclass
class _Bench:
    """What the benchmark's phases share: the loaded target and drafter, the encoded prompts and the decoder every
    measurement runs on (decoder, fallback: its label and why the static one did not run)."""

    name: str
    cfg: dict
    phases: Phases
    model: object
    tokenizer: object
    drafter: object
    drafter_label: str
    template_sha256: str
    drafter_dir: str | Path | None  # None: an in-memory drafter
    gated: bool  # the parity gate applies (not a wheel benchmark)
    sweep: list
    encoded: list[tuple[str, list[int]]]
    stop_ids: set[int]
    served_prompts: list[dict]
    engine: object
    decoder: str
    fallback: str | None


@dataclass
class _Measured:
    """The timed decodes: a row per prompt for the drafter, per n-gram draft length and per sweep setting, and greedy's tokens."""

    rows: list[dict]
    ngram_rows_by_k: dict[int, list[dict]]
    sweep_rows: list[list[dict]]
    greedy_paths: dict[str, list[int]]
    spec_paths: dict[str, list[int]]  # each prompt's speculative tokens, whose spans acceptance_by_span reads


def run_benchmark(
    *,
    target_dir,
    drafter_dir_or_model,
    prompts: list[dict],
    benchmark_name: str,
    bench_cfg: dict,
    out_path,
    template_sha256_expected: str | None = None,
    device: str = "auto",
    trust_remote_code: bool = False,
) -> dict:
    """Benchmark the drafter (a directory or an Eagle3Drafter) on prompts ({id, messages}); write out_path and return it."""
    cfg = with_defaults("bench", bench_cfg)
    _check_request(benchmark_name, prompts, cfg)
    bench = _prepare(target_dir, drafter_dir_or_model, prompts, benchmark_name, cfg, template_sha256_expected, device, trust_remote_code)
    measured = _timed_decoding(bench)
    summary = summarise(measured.rows, cfg["draft_tokens"])
    served = _serve_parity_samples(bench)
    floor = _floor(bench)
    concurrency = _concurrency(bench)
    check = _float32_verdict(bench, measured, summary, target_dir, drafter_dir_or_model, device, trust_remote_code)
    result = _result(bench, measured, summary, floor, check, target_dir)
    result["concurrency"] = concurrency  # B requests at once per bench.concurrency (eyrie.bench.concurrency), or off with the reason
    result["acceptance_by_span"] = _acceptance_by_span(bench, measured)
    _warn_of_differences(bench, measured, result, check)
    failure = _judge(bench, measured, result, served, out_path)
    _write_result(result, out_path, failure)
    return result


def _check_request(benchmark_name: str, prompts: list[dict], cfg: dict) -> None:
    """What can be refused before any model loads: no prompts, a sweep setting SGLang could not serve."""
    if not prompts:
        raise BenchmarkError(f"{benchmark_name}: no prompts to benchmark (is the held-out share of this dataset empty?)")
    check_sweep(cfg["sweep"])


def _prepare(target_dir, drafter_dir_or_model, prompts, benchmark_name, cfg, template_sha256_expected, device, trust_remote_code) -> _Bench:
    """Load the target and drafter (their template checked), encode the prompts, check the drafter's logits, and open the decoder."""
    phases = Phases(benchmark_name)
    with phases("load target and drafter"):
        model, tokenizer, drafter, drafter_label, template_sha256 = load_models(
            target_dir, drafter_dir_or_model, cfg["dtype"], device, template_sha256_expected, trust_remote_code
        )
    sweep = check_sweep(cfg["sweep"], drafter.shape.draft_vocab_size)
    encoded = []
    for prompt in prompts:
        text = render_prompt(tokenizer, first_turn(prompt), prompt)  # with the prompt's tools and thinking, where it has them
        encoded.append((prompt["id"], tokenizer(text, add_special_tokens=False)["input_ids"]))
    check_drafter_logits(model, drafter, encoded[0][1], drafter_label)
    drafter_dir = drafter_dir_or_model if isinstance(drafter_dir_or_model, (str, Path)) else None  # else an in-memory drafter
    gated = benchmark_name not in WHEEL_BENCHMARKS
    served_prompts = parity_prompts(drafter_dir, cfg["draft_tokens"], cfg["max_parity_gap"], gated)
    engine, decoder, fallback = open_bench_decoder(model, cfg, encoded, served_prompts)
    return _Bench(benchmark_name, cfg, phases, model, tokenizer, drafter, drafter_label, template_sha256, drafter_dir, gated, sweep, encoded,
                  stop_ids_of(model, tokenizer), served_prompts, engine, decoder, fallback)


def _timed_decoding(bench: _Bench) -> _Measured:
    """Greedy, the drafter, n-gram and every sweep setting on each prompt, timed (measure); the decoder's label updated
    when its graphs failed to capture."""
    from eyrie.decoding.ngram import NgramDecoder

    cfg, engine = bench.cfg, bench.engine
    # The drafter's aux layers: valid for this target, and on transformers' path the verify then costs both the same.
    ngram_decoder = NgramDecoder(engine, aux_layer_ids=list(bench.drafter.shape.aux_layer_ids)) if cfg["ngram"] else None
    greedy_paths, spec_paths = {}, {}
    rows, ngram_rows_by_k, sweep_rows = measure(
        engine, bench.drafter, bench.encoded, cfg["max_new_tokens"], bench.stop_ids, cfg["draft_tokens"], ngram_decoder, bench.sweep, greedy_paths,
        cfg["sweep_prompts"], bench.phases, cfg["ngram_draft_tokens"], spec_paths,
    )
    if getattr(engine, "label", bench.decoder) != bench.decoder:  # graphs are captured on first use: a failed capture shows only now
        bench.decoder, bench.fallback = engine.label, "CUDA graph capture failed, ran eagerly: " + "; ".join(engine.capture_failures[:2])
    return _Measured(rows, ngram_rows_by_k, sweep_rows, greedy_paths, spec_paths)


def _serve_parity_samples(bench: _Bench) -> dict | None:
    """Untimed: the parity gate's like-with-like measurement (eyrie.bench.parity), or None without samples."""
    if not bench.served_prompts:
        return None
    with bench.phases(f"parity ({len(bench.served_prompts)} held-out cache samples)"):
        return serve_parity_samples(bench.engine, bench.drafter, bench.served_prompts, bench.cfg["draft_tokens"], bench.stop_ids)


def _floor(bench: _Bench) -> dict | None:
    """Greedy against a minimal fused step on the same weights (bench.floor: true, or auto on CUDA), or None."""
    cfg, model = bench.cfg, bench.model
    if not (cfg["floor"] is True or (cfg["floor"] == "auto" and model.device.type == "cuda")):
        return None
    with bench.phases("floor"):
        return floor_block(model, bench.engine, *bench.encoded[0], cfg["max_new_tokens"], compile=bool(getattr(bench.engine, "compile", False)))


def _concurrency(bench: _Bench) -> dict:
    """Batched greedy, chains and n-gram at each B of bench.concurrency (eyrie.bench.concurrency); off when the list is empty
    or no static engine runs the target."""
    from eyrie.bench.concurrency import concurrency_block
    from eyrie.decoding.batched_greedy import open_batched_greedy

    cfg = bench.cfg
    if not cfg.get("concurrency"):
        return concurrency_block(bench.model, None, bench.drafter, bench.encoded, cfg, bench.stop_ids)
    if bench.decoder == "transformers":
        return {"batches": sorted(set(cfg["concurrency"])), "off_reason": f"no static engine: {bench.fallback}", "per_batch": []}
    pad_id = bench.tokenizer.pad_token_id if bench.tokenizer.pad_token_id is not None else min(bench.stop_ids)

    def open_engine(model, rows: int):
        # Exactly B rows per load; greedy steps and speculative rounds alike as CUDA graphs on a GPU (eager on a CPU).
        return open_batched_greedy(model, pad_id, bench.stop_ids, rows=rows, row_step=1)

    with bench.phases(f"concurrency (B = {', '.join(map(str, sorted(set(cfg['concurrency']))))})"):
        return concurrency_block(bench.model, open_engine, bench.drafter, bench.encoded, cfg, bench.stop_ids, bench.sweep,
                                 bench.drafter_dir if bench.drafter_dir is not None else None)


def _float32_verdict(bench: _Bench, measured: _Measured, summary: dict, target_dir, drafter_dir_or_model, device, trust_remote_code) -> dict | None:
    """Timed in the serving dtype: losslessness is proved in float32 on the same prompts (float32_check), and the summary
    gains the agreement in the timing dtype; None when the timing ran in float32 already."""
    import torch

    model, rows = bench.model, measured.rows
    if model.dtype == torch.float32:
        return None
    with bench.phases("float32 check"):
        check = float32_check(target_dir, drafter_dir_or_model, bench.encoded, bench.cfg, bench.stop_ids, device, trust_remote_code, bench.sweep)
    add_margins(model, rows, dict(bench.encoded), measured.greedy_paths)  # how near a tie greedy was where each chain decode parted
    margins = [r["margin_at_divergence"] for r in rows if r["margin_at_divergence"] is not None]
    summary["agreement_in_timing_dtype"] = {"dtype": _timing_dtype(model), "identical": sum(r["identical"] for r in rows), "checked": len(rows),
                                            "largest_margin_at_divergence": max(margins, default=None)}
    summary["lossless"] = not check["different"]  # the main chain's; the sweep block holds each setting's
    return check


def _timing_dtype(model) -> str:
    return str(model.dtype).removeprefix("torch.")


def _result(bench: _Bench, measured: _Measured, summary: dict, floor: dict | None, check: dict | None, target_dir) -> dict:
    """The benchmark's JSON: the summary, the fastest n-gram baseline, the sweep block and what ran where (parity comes later)."""
    import torch

    cfg, model, engine, rows = bench.cfg, bench.model, bench.engine, measured.rows
    timing_dtype = _timing_dtype(model)
    ngram, ngram_rows = fastest_ngram(measured.ngram_rows_by_k, summary["greedy_tokens_per_s"]) if measured.ngram_rows_by_k else (None, [])
    speedup_over_ngram = summary["spec_tokens_per_s"] / ngram["tokens_per_s"] if ngram else None
    swept = sweep_block(bench.sweep, measured.sweep_rows, summary, cfg["draft_tokens"], ngram=ngram, speedup_over_ngram=speedup_over_ngram,
                        check=check, timing_dtype=timing_dtype, main_rows=rows, ngram_rows=ngram_rows)
    if swept is not None:
        predict_settings([swept["main"], *swept["settings"]], bench.drafter_dir)
    return {
        "benchmark": bench.name,
        **summary,
        "speedup_over_ngram": speedup_over_ngram,
        "draft_tokens": cfg["draft_tokens"],
        "decoder": bench.decoder,
        "decoder_fallback_reason": bench.fallback,
        # A drafter piece that failed to compile ran eagerly (eyrie.decoding.static_drafter.StaticEagle3): slower, same tokens.
        "drafter_fusion_failure": next((e.fusion_failure for e in getattr(engine, "drafters", {}).values() if e.fusion_failure), None),
        "max_new_tokens": cfg["max_new_tokens"],
        "min_acceptance_length": cfg["min_acceptance_length"],
        "dtype": timing_dtype,
        "device": str(model.device),
        "hardware": hardware_description(model.device),
        "torch": torch.__version__,
        "target": str(target_dir),
        "drafter": bench.drafter_label,
        "template_sha256": bench.template_sha256,
        "error": None,
        "ngram": ngram,
        "outside_draft_vocab": outside_draft_vocab(measured.greedy_paths, bench.drafter.t2d, bench.tokenizer.decode),  # tokens no drafter step could propose
        "floor": floor,  # greedy against a minimal fused step on the same weights (bench.floor), or None
        "sweep": swept,
        "parity": None,
        "float32_check": check,
        "phase_seconds": bench.phases.seconds,  # where the job's wall time went
        "per_prompt": rows,
    }


def _acceptance_by_span(bench: _Bench, measured: _Measured) -> dict:
    """The drafter's acceptance inside thinking, tool-call and answer spans (eyrie.bench.spans), over every prompt."""
    from eyrie.bench.spans import measure_spans

    by_id = {r["id"]: r for r in measured.rows}
    decodes = [(ids, measured.spec_paths[pid], by_id[pid]["acceptance_lengths"]) for pid, ids in bench.encoded]
    try:
        return measure_spans(bench.tokenizer, decodes)
    except ValueError as err:  # a decoder whose rounds do not add up to its tokens: recorded, the measurements still written
        warnings.warn(f"{bench.name}: acceptance per span not measured: {err}")
        return {"error": str(err)}


def _warn_of_differences(bench: _Bench, measured: _Measured, result: dict, check: dict | None) -> None:
    """A warning for each decoder whose output differs from greedy: in float32 when it was checked, else in the timing dtype."""
    if check is not None:
        for label, different in (("the drafter", check["different"]), *((f"sweep setting {s['label']}", s["different"]) for s in check["sweep"])):
            if different:
                warnings.warn(
                    f"{bench.name}: in float32 {label}'s output differs from greedy on {len(different)} prompt(s) "
                    f"({', '.join(d['id'] for d in different[:5])}): that is a bug or an exact near-tie. Recorded as lossless: false."
                )
        return
    timed = [("speculative", measured.rows), *((f"n-gram k = {k}", r) for k, r in measured.ngram_rows_by_k.items()),
             *((f"sweep setting {s['label']}", s["per_prompt"]) for s in (result["sweep"] or {}).get("settings", []))]
    for label, decoded in timed:
        different = [r["id"] for r in decoded if not r["identical"]]
        if different:
            warnings.warn(
                f"{bench.name}: {label} output differs from greedy on {len(different)} prompt(s) ({', '.join(different[:5])}) "
                f"in {result['dtype']}; in float32 that is a bug or an exact near-tie. Recorded as lossless: false."
            )


def _judge(bench: _Bench, measured: _Measured, result: dict, served: dict | None, out_path) -> type[BenchmarkError] | None:
    """The parity block, and the error when the drafter is not engaged or misses its parity gate: recorded in the result,
    the error class returned for _write_result to raise."""
    cfg, mean = bench.cfg, result["mean_acceptance_length"]
    result["parity"] = parity(bench.drafter_dir, mean, cfg["draft_tokens"], cfg["max_parity_gap"], gated=bench.gated,
                              interval=measured_interval(measured.rows), served=served, dataset=bench.name if bench.gated else None)
    if mean is None or mean < cfg["min_acceptance_length"]:
        result["error"] = not_engaged_message(mean, cfg["min_acceptance_length"], result["rounds"], out_path)
        return DrafterNotEngagedError
    if result["parity"]["error"]:
        result["error"] = f"{bench.name}: {result['parity']['error']}"
        return ParityGapError
    return None


def _write_result(result: dict, out_path, failure: type[BenchmarkError] | None) -> None:
    """The JSON first, so that a failing benchmark loses nothing it measured; then the failure, its measurements kept."""
    write_json_atomically(out_path, result)
    if failure is not None:
        # Snakemake deletes a failed job's declared output: keep the measurements beside it.
        kept = Path(out_path).with_name(Path(out_path).stem + ".failed.json")
        write_json_atomically(kept, result)
        raise failure(f"{result['error']} (measurements kept in {kept})")


def run_benchmark_job(*, benchmark: str, prompts_path, drafter_dir, target_dir, bench_cfg: dict, out_path, **kwargs) -> dict:
    """The Snakemake job: load the benchmark's prompts, then run_benchmark (the drafter's config names its template)."""
    cfg = with_defaults("bench", bench_cfg)
    use_inductor_cache(cfg["compile_cache"])  # max-autotune's timings outlive the job: a rerun reuses them
    limit = (cfg.get(benchmark) or {}).get("limit") if benchmark in WHEEL_BENCHMARKS else cfg["prompts_per_dataset"]
    prompts = load_benchmark_prompts(benchmark, prompts_path, limit)
    if not prompts:
        # A small dataset can hash none of its ids into the held-out share: say so, measure nothing.
        result = {"benchmark": benchmark, "prompts": 0, "mean_acceptance_length": None, "error": None,
                  "note": "no held-out prompts: nothing was measured", "per_prompt": []}
        write_json_atomically(out_path, result)
        return result
    return run_benchmark(
        target_dir=target_dir,
        drafter_dir_or_model=drafter_dir,
        prompts=prompts,
        benchmark_name=benchmark,
        bench_cfg=cfg,
        out_path=out_path,
        **kwargs,
    )
