"""Where the drafter loses to prompt lookup: does it copy what its context already holds?

Decode mode (any machine; CPU fp32 is fine for a few prompts): decodes held-out prompts with a chain and, per round,
sets the drafter's accepted length beside what prompt lookup (eyrie's n-gram baseline, k = 8) would accept at the
same position of the same greedy text.

    python benchmarks/copy_probe.py decode --target W/resources/models/SmolLM2-135M-Instruct \
        --drafter W/results/drafter --heldout W/results/prompts/sharegpt/heldout.parquet --ids 1giY8Cd_62,1Etq8vj_30 --steps 6

A drafter trained on the H200 was checked against the bf16 conversion of its target, and a CPU conversion is float32,
so this mode loads both without the benchmark's fingerprint check: it is a probe, not a benchmark.

What-if mode (a benchmark's JSON): the sweep setting's tokens/s over the n-gram's, had the drafter accepted at least
what prompt lookup accepted on each prompt (capped), each prompt's seconds per round kept.

    python benchmarks/copy_probe.py what-if --bench results/bench/sharegpt.json --setting "tree 6-8-32" --cap 6.5
"""

from __future__ import annotations

import argparse
import json


def lookup_accepts(sequence: list[int], position: int, k: int = 8) -> int:
    """The tokens a prompt-lookup round starting at `position` (sequence[:position] known) would emit: its drafts
    that match sequence[position:], plus the bonus token."""
    from eyrie.decoding.ngram import lookup

    proposed = lookup(sequence[:position], k) or []
    accepted = 0
    for guess, truth in zip(proposed, sequence[position:]):
        if guess != truth:
            break
        accepted += 1
    return accepted + 1


def decode(args) -> None:
    import pyarrow.parquet as pq
    import torch

    from eyrie.bench.benchmark import first_turn, stop_ids_of
    from eyrie.decoding.decode import speculative_decode
    from eyrie.drafter.checkpoint import load_drafter
    from eyrie.target.chat_template import render
    from eyrie.target.model import load_target

    model, tokenizer = load_target(args.target, dtype="float32", device="cpu", trust_remote_code=False)
    drafter = load_drafter(args.drafter, model.get_input_embeddings().weight.detach()).to(dtype=torch.float32).eval()
    prompts = {row["id"]: row for row in pq.read_table(args.heldout).to_pylist()}
    for prompt_id in args.ids.split(","):
        prompt_ids = tokenizer(render(tokenizer, first_turn(prompts[prompt_id]), add_generation_prompt=True), add_special_tokens=False)["input_ids"]
        result = speculative_decode(model, drafter, prompt_ids, args.max_new_tokens, stop_ids_of(model, tokenizer), args.steps)
        sequence, position, pairs = prompt_ids + result.tokens, len(prompt_ids), []
        for accepted in result.acceptance_lengths:
            pairs.append((accepted, lookup_accepts(sequence, position)))
            position += accepted
        copying = [(a, n) for a, n in pairs if n >= 4]
        print(f"{prompt_id}: {len(prompt_ids)} prompt tokens, {len(result.tokens)} new; chain {args.steps} accepted "
              f"{sum(a for a, _ in pairs) / len(pairs):.2f}, prompt lookup at the same positions {sum(n for _, n in pairs) / len(pairs):.2f}")
        if copying:
            print(f"  rounds where prompt lookup accepts >= 4: {len(copying)} of {len(pairs)}; there the drafter "
                  f"{sum(a for a, _ in copying) / len(copying):.2f}, prompt lookup {sum(n for _, n in copying) / len(copying):.2f}")
        print("  per round, drafter/lookup:", " ".join(f"{a}/{n}" for a, n in pairs))
        print("  reply:", repr(tokenizer.decode(result.tokens)[:400]))


def what_if(args) -> None:
    report = json.load(open(args.bench))
    setting = next(s for s in report["sweep"]["settings"] if s["label"] == args.setting)
    ngram = {row["id"]: row for row in report["ngram"]["per_prompt"]}
    tokens = seconds = seconds_if = ngram_tokens = ngram_seconds = 0.0
    for row in setting["per_prompt"]:
        accepted = max(row["acceptance_length_mean"], min(ngram[row["id"]]["acceptance_length_mean"], args.cap))
        tokens += row["new_tokens"]
        seconds += row["seconds"]
        seconds_if += row["seconds"] * row["acceptance_length_mean"] / accepted  # as many rounds fewer, each as long
        ngram_tokens += ngram[row["id"]]["new_tokens"]
        ngram_seconds += ngram[row["id"]]["seconds"]
    baseline = ngram_tokens / ngram_seconds
    print(f"{args.setting} over the n-gram: {tokens / seconds / baseline:.3f} measured; {tokens / seconds_if / baseline:.3f} had it "
          f"accepted at least what prompt lookup did on each prompt (capped at {args.cap})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = parser.add_subparsers(dest="mode", required=True)
    d = modes.add_parser("decode")
    d.add_argument("--target", required=True)
    d.add_argument("--drafter", required=True)
    d.add_argument("--heldout", required=True)
    d.add_argument("--ids", required=True, help="comma-separated held-out prompt ids")
    d.add_argument("--steps", type=int, default=6)
    d.add_argument("--max-new-tokens", type=int, default=256)
    w = modes.add_parser("what-if")
    w.add_argument("--bench", required=True)
    w.add_argument("--setting", required=True, help='a sweep label, e.g. "tree 6-8-32"')
    w.add_argument("--cap", type=float, default=6.5)
    args = parser.parse_args()
    decode(args) if args.mode == "decode" else what_if(args)


if __name__ == "__main__":
    main()
