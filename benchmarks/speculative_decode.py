"""Batch-1 decode speed, side by side in one process: transformers' greedy, eyrie's static-cache greedy
(eager and CUDA graphs), and EAGLE-3 speculative decoding on each.

    # a pipeline working directory (target, trained drafter, held-out prompts):
    python benchmarks/speculative_decode.py --workdir W --prompts 8 --out spec.json
    # explicit directories (prompts: --heldout PARQUET, else a few built-in questions):
    python benchmarks/speculative_decode.py --target DIR --drafter DIR --prompts 8 --out spec.json
    # CPU smoke test: a random tiny Llama and a random drafter built here
    python benchmarks/speculative_decode.py --small --out /tmp/spec.json

Each variant decodes every prompt --repeats times (prompt-major, variants interleaved, so drift hits
all alike); a prompt's time is the median of its repeats, tokens/s is total tokens over total time.
A failing variant prints its error and the others go on. The last lines are the table: tokens/s, the
ratio to the strongest greedy variant, acceptance length, and agreement with transformers' greedy
output (identical prompts, and matched tokens up to the first divergence: bf16 may drift at near-ties).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
from pathlib import Path

import torch

from eyrie.bench.benchmark import (
    WARMUP_TOKENS,
    first_divergence,
    first_turn,
    load_benchmark_prompts,
    load_models,
    stop_ids_of,
)
from eyrie.decoding.decode import greedy_decode, speculative_decode
from eyrie.decoding.static import StaticLlama
from eyrie.decoding.static_common import needed_capacity
from eyrie.target.chat_template import render

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
BUILT_IN_QUESTIONS = [
    "Write a Python function that reverses a string.",
    "Explain what a hash table is in three sentences.",
    "What is the capital of France, and why is it famous?",
    "Write a haiku about the sea.",
    "List five prime numbers and explain why they are prime.",
    "How do I read a file line by line in Python?",
    "Summarise the plot of Romeo and Juliet.",
    "What are the benefits of regular exercise?",
]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, help="pipeline working directory: resources/models/MODEL, results/drafter, results/prompts/DATASET")
    parser.add_argument("--model-name", default=DEFAULT_MODEL, help="model directory name under WORKDIR/resources/models")
    parser.add_argument("--dataset", help="held-out prompts of this dataset (default: the first under WORKDIR/results/prompts)")
    parser.add_argument("--target", type=Path, help="HF target directory (overrides --workdir's)")
    parser.add_argument("--drafter", type=Path, help="trained drafter directory (overrides --workdir's); 'random': an untrained one (acceptance ~1, measures overhead only)")
    parser.add_argument("--heldout", type=Path, help="a heldout.parquet to take prompts from (overrides --workdir's)")
    parser.add_argument("--prompts", type=int, default=8, help="number of prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--draft-tokens", type=int, default=4, help="chain length k")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats of the static variants")
    parser.add_argument("--hf-repeats", type=int, default=1, help="timed repeats of transformers' variants (slow: ~40 tok/s on an H200)")
    parser.add_argument("--dtype", default=None, help="bfloat16, float32, or both comma-separated (default: bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--variants", default=None, help="comma-separated subset of: " + ", ".join(name for name, *_ in VARIANTS))
    parser.add_argument("--small", action="store_true", help="random tiny Llama + random drafter built here (CPU smoke test)")
    parser.add_argument("--out", type=Path, required=True, help="JSON file for every figure")
    return parser.parse_args(argv)


# --------------------------------------------------------------------------- inputs


def tiny_models(dtype, device):
    """A random Llama (GQA, 6 layers) and a random EAGLE-3 drafter over its whole vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eyrie.drafter.model import DrafterShape, Eagle3Drafter

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=6, vocab_size=512, max_position_embeddings=1024)
    model = LlamaForCausalLM(config).eval()
    shape = DrafterShape.from_target(config, config.vocab_size, [0, 2, 3])
    identity = torch.zeros(config.vocab_size, dtype=torch.long), torch.ones(config.vocab_size, dtype=torch.bool)
    drafter = Eagle3Drafter(shape, model.get_input_embeddings().weight, *identity).eval()
    return model.to(device=device, dtype=dtype), drafter.to(device=device, dtype=dtype)


def small_inputs(args, dtype, device):
    model, drafter = tiny_models(dtype, device)
    generator = torch.Generator().manual_seed(1)
    prompts = [(f"random-{i}", torch.randint(0, 512, (16 + 4 * i,), generator=generator).tolist()) for i in range(args.prompts)]
    return model, drafter, prompts, set(), "tiny random Llama (6 layers, hidden 64)", "random drafter"


def workdir_paths(args):
    """(target dir, drafter dir, heldout parquet or None, dataset name) from --workdir and the explicit overrides."""
    target, drafter, heldout, dataset = args.target, args.drafter, args.heldout, args.dataset
    if args.workdir is not None:
        target = target or args.workdir / "resources" / "models" / args.model_name
        drafter = drafter or args.workdir / "results" / "drafter"
        if heldout is None:
            prompt_dirs = sorted(p for p in (args.workdir / "results" / "prompts").glob("*") if (p / "heldout.parquet").is_file())
            chosen = [p for p in prompt_dirs if p.name == dataset] if dataset else prompt_dirs[:1]
            if not chosen:
                raise SystemExit(f"{args.workdir}/results/prompts: no {dataset or '*'}/heldout.parquet; run the prompts stage or pass --heldout")
            heldout, dataset = chosen[0] / "heldout.parquet", chosen[0].name
    if target is None or drafter is None:
        raise SystemExit("give --workdir W, or --target DIR and --drafter DIR, or --small")
    return target, drafter, heldout, dataset or (heldout.parent.name if heldout else "built-in")


def random_drafter(model):
    """An untrained drafter for the real target: every speed path runs, nearly nothing is accepted."""
    from eyrie.drafter.model import DrafterShape, Eagle3Drafter
    from eyrie.target.aux_layers import default_aux_layer_ids

    torch.manual_seed(0)
    vocab, draft_vocab = model.config.vocab_size, min(32000, model.config.vocab_size)
    kept = torch.sort(torch.randperm(vocab)[:draft_vocab]).values
    target_to_draft = torch.zeros(vocab, dtype=torch.bool)
    target_to_draft[kept] = True
    shape = DrafterShape.from_target(model.config, draft_vocab, default_aux_layer_ids(model.config.num_hidden_layers))
    embeddings = model.get_input_embeddings().weight.detach().cpu()
    drafter = Eagle3Drafter(shape, embeddings, kept - torch.arange(draft_vocab), target_to_draft)
    return drafter.to(device=model.device, dtype=model.dtype).eval()


def real_inputs(args, dtype_name, device):
    from eyrie.target.model import load_target

    target_dir, drafter_dir, heldout, dataset = workdir_paths(args)
    if str(drafter_dir) == "random":
        model, tokenizer = load_target(target_dir, dtype=dtype_name, device=device)
        drafter, drafter_label = random_drafter(model), "random untrained drafter"
    else:
        model, tokenizer, drafter, drafter_label, _ = load_models(target_dir, drafter_dir, dtype_name, device, None, False)
    if heldout is not None:
        prompts = load_benchmark_prompts(dataset, heldout, args.prompts)
    else:
        prompts = [{"id": f"q{i}", "messages": [{"role": "user", "content": q}]} for i, q in enumerate(BUILT_IN_QUESTIONS[: args.prompts])]
    encoded = []
    for prompt in prompts:
        text = render(tokenizer, first_turn(prompt), add_generation_prompt=True)
        encoded.append((prompt["id"], tokenizer(text, add_special_tokens=False)["input_ids"]))
    return model, drafter, encoded, stop_ids_of(model, tokenizer), f"{target_dir} (prompts: {dataset})", drafter_label


# --------------------------------------------------------------------------- variants


# (name, engine, speculative): engine "hf" is the transformers model itself, "eager"/"graphs" a StaticLlama.
VARIANTS = [
    ("hf_greedy", "hf", False),
    ("static_greedy_eager", "eager", False),
    ("static_greedy_graphs", "graphs", False),
    ("hf_spec", "hf", True),
    ("static_spec_eager", "eager", True),
    ("static_spec_graphs", "graphs", True),
]


def open_engines(model, wanted: set[str], capacity: int, errors: dict):
    engines = {"hf": model}
    for kind in sorted({"eager", "graphs"} & wanted):
        if kind == "graphs" and model.device.type != "cuda":
            errors[kind] = "skipped: CUDA graphs need a CUDA device"
            continue
        try:
            engines[kind] = StaticLlama(model, capacity=capacity, cuda_graphs=kind == "graphs")
        except Exception as error:  # noqa: BLE001 -- the others still run
            traceback.print_exc()
            errors[kind] = f"{type(error).__name__}: {error}"
    return engines


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_once(engine, speculative: bool, drafter, prompt_ids, max_new_tokens, stop_ids, k, device):
    """(result, seconds): synchronised wall time around one decode."""
    sync(device)
    start = time.perf_counter()
    if speculative:
        result = speculative_decode(engine, drafter, prompt_ids, max_new_tokens, stop_ids, k)
    else:
        result = greedy_decode(engine, prompt_ids, max_new_tokens, stop_ids)
    sync(device)
    return result, time.perf_counter() - start


def measure_variants(variants, engines, drafter, prompts, args, stop_ids, device):
    """{variant: {"results": [per prompt last result], "seconds": [[repeats] per prompt], "error": str | None}}."""
    state = {name: {"results": [None] * len(prompts), "seconds": [[] for _ in prompts], "error": None} for name, *_ in variants}
    for name, kind, speculative in variants:  # warm-up: graph capture, kernel choice, allocations
        if kind not in engines:
            continue
        try:
            run_once(engines[kind], speculative, drafter, prompts[0][1], WARMUP_TOKENS, stop_ids, args.draft_tokens, device)
        except Exception as error:  # noqa: BLE001 -- one failing variant must not cost the others
            traceback.print_exc()
            state[name]["error"] = f"{type(error).__name__}: {error}"
    for repeat in range(max(args.repeats, args.hf_repeats)):
        for index, (_, prompt_ids) in enumerate(prompts):
            for name, kind, speculative in variants:
                entry = state[name]
                if kind not in engines or entry["error"] or repeat >= (args.hf_repeats if kind == "hf" else args.repeats):
                    continue
                try:
                    result, seconds = run_once(engines[kind], speculative, drafter, prompt_ids, args.max_new_tokens, stop_ids, args.draft_tokens, device)
                except Exception as error:  # noqa: BLE001 -- one failing variant must not cost the others
                    traceback.print_exc()
                    entry["error"] = f"{type(error).__name__}: {error}"
                    continue
                entry["results"][index] = result
                entry["seconds"][index].append(seconds)
        print(f"  repeat {repeat + 1} done", flush=True)
    return state


def agreement(tokens_per_prompt, reference_per_prompt) -> dict:
    """Identical prompts, and the share of reference tokens matched before the first divergence."""
    matched = identical = total = 0
    for tokens, reference in zip(tokens_per_prompt, reference_per_prompt):
        divergence = first_divergence(tokens, reference)
        identical += divergence is None
        matched += len(reference) if divergence is None else divergence
        total += len(reference)
    return {"identical_prompts": identical, "matched_token_share": matched / total if total else None}


def summarise(variants, state, engines_errors, prompts) -> dict:
    summary = {}
    for name, kind, speculative in variants:
        entry = state[name]
        error = entry["error"] or engines_errors.get(kind)
        done = all(result is not None for result in entry["results"])
        if error or not done:
            summary[name] = {"error": error or "not measured"}
            continue
        seconds = [statistics.median(times) for times in entry["seconds"]]
        tokens = [result.tokens for result in entry["results"]]
        row = {
            "decoder": "transformers" if kind == "hf" else f"static{'-cudagraph' if kind == 'graphs' else ''}",
            "speculative": speculative,
            "tokens_per_s": sum(map(len, tokens)) / sum(seconds),
            "new_tokens": sum(map(len, tokens)),
            "seconds_per_prompt": seconds,
            "tokens": tokens,
            "error": None,
        }
        if speculative:
            lengths = [length for result in entry["results"] for length in result.acceptance_lengths]
            row["mean_acceptance_length"] = sum(lengths) / len(lengths) if lengths else None
            row["rounds"] = len(lengths)
        summary[name] = row
    greedy = [name for name, _, speculative in variants if not speculative and summary[name]["error"] is None]
    reference = "hf_greedy" if "hf_greedy" in greedy else (greedy[0] if greedy else None)
    best = max(greedy, key=lambda name: summary[name]["tokens_per_s"], default=None)
    for name, kind, speculative in variants:
        row = summary[name]
        if row["error"] is not None:
            continue
        row["ratio_vs_best_greedy"] = row["tokens_per_s"] / summary[best]["tokens_per_s"] if best else None
        row["agreement_vs"] = reference
        row.update(agreement(row["tokens"], summary[reference]["tokens"]) if reference else {})
        same_engine_greedy = {"hf": "hf_greedy", "eager": "static_greedy_eager", "graphs": "static_greedy_graphs"}[kind]
        if speculative and summary.get(same_engine_greedy, {}).get("error", "x") is None:
            row["identical_to_same_engine_greedy"] = agreement(row["tokens"], summary[same_engine_greedy]["tokens"])["identical_prompts"]
    return {"variants": summary, "best_greedy": best, "agreement_reference": reference, "prompts": len(prompts)}


def table(dtype_name: str, result: dict) -> list[str]:
    lines = [(f"dtype {dtype_name}: {result['prompts']} prompts; ratios vs the strongest greedy ({result['best_greedy']}); "
             f"agreement vs {result['agreement_reference']}"),
             f"{'variant':<22}{'tok/s':>10}{'ratio':>8}{'accept':>8}{'identical':>11}{'matched':>9}"]
    for name, row in result["variants"].items():
        if row["error"] is not None:
            lines.append(f"{name:<22}  ERROR {row['error'][:90]}")
            continue
        accept = row.get("mean_acceptance_length")
        lines.append(
            f"{name:<22}{row['tokens_per_s']:>10.1f}{row['ratio_vs_best_greedy']:>8.2f}"
            f"{(f'{accept:.2f}' if accept else '-'):>8}{row['identical_prompts']:>6}/{result['prompts']:<4}{row['matched_token_share']:>9.3f}"
        )
    return lines


def run_dtype(args, dtype_name: str, device: torch.device, wanted_variants) -> dict:
    if args.small:
        model, drafter, prompts, stop_ids, target_label, drafter_label = small_inputs(args, getattr(torch, dtype_name), device)
    else:
        model, drafter, prompts, stop_ids, target_label, drafter_label = real_inputs(args, dtype_name, str(device))
    capacity = needed_capacity(max(len(ids) for _, ids in prompts), max(args.max_new_tokens, WARMUP_TOKENS), args.draft_tokens)
    engine_errors = {}
    engines = open_engines(model, {kind for _, kind, _ in wanted_variants}, capacity, engine_errors)
    print(f"dtype {dtype_name}: target {target_label}, drafter {drafter_label}, {len(prompts)} prompts "
          f"({min(len(p) for _, p in prompts)}-{max(len(p) for _, p in prompts)} tokens), cache capacity {capacity}", flush=True)
    state = measure_variants(wanted_variants, engines, drafter, prompts, args, stop_ids, device)
    result = summarise(wanted_variants, state, engine_errors, prompts)
    result.update({"dtype": dtype_name, "target": target_label, "drafter": drafter_label, "prompt_ids": [i for i, _ in prompts],
                   "prompt_tokens": [len(p) for _, p in prompts], "cache_capacity": capacity})
    del engines, model, drafter
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else ("cpu" if args.device == "auto" else args.device))
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    dtypes = (args.dtype or ("bfloat16" if device.type == "cuda" else "float32")).split(",")
    wanted = set(args.variants.split(",")) if args.variants else {name for name, *_ in VARIANTS}
    unknown = wanted - {name for name, *_ in VARIANTS}
    if unknown:
        raise SystemExit(f"--variants: unknown {sorted(unknown)}; known: {', '.join(name for name, *_ in VARIANTS)}")
    variants = [v for v in VARIANTS if v[0] in wanted]
    header = (f"torch {torch.__version__}, device {device_name}, max_new_tokens {args.max_new_tokens}, k {args.draft_tokens}, "
              f"repeats {args.repeats} (hf {args.hf_repeats}), threads {torch.get_num_threads()}")
    print(header, flush=True)
    report = {"torch": torch.__version__, "device": device_name, "args": {k: str(v) for k, v in vars(args).items()}, "runs": {}}
    lines = [header]
    for dtype_name in dtypes:
        try:
            result = run_dtype(args, dtype_name, device, variants)
        except Exception as error:  # noqa: BLE001 -- e.g. a model that does not load: the other dtype may still run
            traceback.print_exc()
            result = {"error": f"{type(error).__name__}: {error}"}
            lines.append(f"dtype {dtype_name}: ERROR {result['error'][:200]}")
        else:
            lines += table(dtype_name, result)
        report["runs"][dtype_name] = result
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))  # after each dtype: nothing measured is lost
    print("\n" + "\n".join(lines))
    print(f"figures: {args.out}")


if __name__ == "__main__":
    main()
