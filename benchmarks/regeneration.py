"""Regeneration throughput of the in-process engine: padded, continuous and static batching.

Side by side in one process, on the same prompts, through eyrie's own TransformersEngine:
    padded@B      one generate() per batch of B turns (every row runs until the longest ends)
    static@B      the same batches on eyrie's static KV cache, one CUDA graph per decode step
    continuous    generate_batch over all prompts (paged KV cache, CUDA graphs, rows admitted as others end)
Prints completion tokens/s of each and the ratio to the best padded variant; --out keeps every figure.

    python benchmarks/regeneration.py --model resources/models/SmolLM2-135M-Instruct --prompts 512
    python benchmarks/regeneration.py --model DIR --random-weights   # same shape, random weights (max-length replies)
    python benchmarks/regeneration.py --model DIR --small            # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path


def random_weight_copy(model_dir: Path, into: Path, trust_remote_code: bool = False) -> Path:
    """The model's config and tokenizer with random weights: same speed, no checkpoint to carry."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, trust_remote_code=trust_remote_code)
    model.save_pretrained(into)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "chat_template.jinja"):
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, into / name)
    return into


def synthetic_prompts(engine, count: int, seed: int, longest: int) -> list[list[int]]:
    """Chat-formatted prompts of ShareGPT-like lengths (log-uniform 16..longest words)."""
    rng = random.Random(seed)
    words = ["data", "model", "explain", "python", "why", "the", "history", "of", "write", "a", "story", "about", "list", "code"]
    prompts = []
    for _ in range(count):
        n = int(round(16 * (longest / 16) ** rng.random()))
        text = " ".join(rng.choice(words) for _ in range(n))
        prompts.append(engine.prompt_ids([{"role": "user", "content": text}])[: longest + 32])
    return prompts


def measure(engine, prompts, settings, batching: str, batch_size: int) -> dict:
    import torch

    engine.batching = batching
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))  # as the pipeline plans: longest first
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    started = time.perf_counter()
    tokens = stops = 0
    for a in range(0, len(order), batch_size):
        results = engine.generate([prompts[i] for i in order[a : a + batch_size]], settings)
        tokens += sum(r.completion_tokens for r in results)
        stops += sum(r.finish_reason == "stop" for r in results)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    return {"batching": batching, "batch_size": batch_size, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "stopped": stops}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, type=Path, help="an HF model directory (its tokenizer is used)")
    parser.add_argument("--random-weights", action="store_true", help="random weights of the model's shape")
    parser.add_argument("--trust-remote-code", action="store_true", help="let the model directory's own code run (model.trust_remote_code)")
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--longest-prompt", type=int, default=600, help="words in the longest synthetic prompt")
    parser.add_argument("--batch-sizes", default="64,256", help="padded variants")
    parser.add_argument("--static-batch-sizes", default="256", help="static variants ('' for none)")
    parser.add_argument("--continuous-batch", type=int, default=0, help="turns handed to generate_batch at once (0 = all, -1 = skip continuous)")
    parser.add_argument("--small", action="store_true", help="CPU smoke test: 6 prompts, 8 new tokens")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import torch

    from eyrie.generation.transformers_engine import TransformersEngine

    if args.small:
        args.prompts, args.max_new_tokens, args.longest_prompt, args.batch_sizes, args.static_batch_sizes = 6, 8, 40, "3", "3"
    settings = {"max_new_tokens": args.max_new_tokens, "temperature": 0.0, "top_p": 1.0, "top_k": 0}
    with tempfile.TemporaryDirectory(prefix="eyrie-regen-") as tmp:
        model_dir = random_weight_copy(args.model, Path(tmp) / "model", args.trust_remote_code) if args.random_weights else args.model
        engine = TransformersEngine(str(model_dir), trust_remote_code=args.trust_remote_code)
        device = torch.cuda.get_device_name() if engine.device.type == "cuda" else "cpu"
        print(f"torch {torch.__version__}, {device}, model {args.model}{' (random weights)' if args.random_weights else ''}, dtype {engine.model.dtype}")
        prompts = synthetic_prompts(engine, args.prompts, 0, args.longest_prompt)
        print(f"{len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens, up to {args.max_new_tokens} new tokens each", flush=True)
        warm = prompts[:4]
        variants = [("padded", int(b)) for b in args.batch_sizes.split(",")]
        variants += [("static", int(b)) for b in args.static_batch_sizes.split(",") if b]
        variants += [("continuous", args.continuous_batch or len(prompts))] if args.continuous_batch >= 0 else []
        rows = []
        for batching, batch_size in variants:
            try:
                measure(engine, warm, {**settings, "max_new_tokens": 8}, batching, batch_size)  # kernels, graphs, allocator
                row = measure(engine, prompts, settings, batching, batch_size)
                if batching == "static" and engine.fallback:
                    row["ran_padded_because"] = engine.fallback
            except Exception as exc:  # one broken variant must not cost the others
                row = {"batching": batching, "batch_size": batch_size, "error": f"{type(exc).__name__}: {exc}"[:500]}
            rows.append(row)
            print(json.dumps(row), flush=True)

    padded = [r for r in rows if r["batching"] == "padded" and "tokens_per_s" in r]
    best = max(padded, key=lambda r: r["tokens_per_s"]) if padded else None
    result = {"torch": torch.__version__, "device": device, "random_weights": args.random_weights, "prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens, "variants": rows, "baseline": best}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    print("\nregeneration throughput (completion tokens/s)")
    for r in rows:
        name = f"{r['batching']}@{r['batch_size']}"
        if "error" in r:
            print(f"  {name:18s} FAILED {r['error'][:120]}")
            continue
        ratio = f"{r['tokens_per_s'] / best['tokens_per_s']:.2f}x best padded" if best else ""
        print(f"  {name:18s} {r['tokens_per_s']:10.0f} tok/s  {r['tokens']} tokens in {r['seconds']:.1f} s, {r['stopped']} stopped early  {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
