"""Where the drafter loses to prompt lookup: does it copy what its context already holds?

Decode mode (any machine; CPU fp32 is fine for a few prompts): decodes held-out prompts with a chain and, per round,
sets the drafter's accepted length beside what prompt lookup (eyrie's n-gram baseline, k = 8) would accept at the
same position of the same greedy text.

    python benchmarks/copy_probe.py decode --target W/resources/models/SmolLM2-135M-Instruct \
        --drafter W/results/drafter --heldout W/results/prompts/sharegpt/heldout.parquet --ids 1giY8Cd_62,1Etq8vj_30 --steps 6

A drafter trained on the H200 was checked against the bf16 conversion of its target, and a CPU conversion is float32,
so this mode loads both without the benchmark's fingerprint check: it is a probe, not a benchmark.

Steps mode (the same arguments): each prompt's greedy reply teacher-forced through the drafter's TTT steps, as
training's evaluation walks it, with each step's accuracy split between the labels prompt lookup would draft from the
tokens before them and the rest. A drafter that copies is right on nearly every copyable label at every step.

    python benchmarks/copy_probe.py steps --target ... --drafter ... --heldout ... --ids 1giY8Cd_62 --steps 7

Vocab mode (the same arguments): each greedy reply walked round by round with a chain of --steps, each step the
drafter's teacher-forced prediction (this reproduces the served chain), as is and as if every reply token outside
the draft vocabulary had been drafted right: what a vocabulary holding the tokens the target copies would buy at most.

    python benchmarks/copy_probe.py vocab --target ... --drafter ... --heldout ... --ids 1giY8Cd_62,1Etq8vj_30 --steps 6 [--misses 20]

What-if mode (a benchmark's JSON): the sweep setting's tokens/s over the n-gram's, had the drafter accepted at least
what prompt lookup accepted on each prompt (capped), each prompt's seconds per round kept.

    python benchmarks/copy_probe.py what-if --bench results/bench/sharegpt.json --setting "tree 6-8-32" --cap 6.5
"""

from __future__ import annotations

import argparse
import json

LOOKUP_K = 8  # the n-gram baseline's fastest draft length on all three H200 benchmarks


def _models(args):
    """(target, tokenizer, drafter) in float32 on the CPU, without the benchmark's fingerprint check (see above)."""
    import torch

    from eyrie.drafter.checkpoint import load_drafter
    from eyrie.target.model import load_target

    model, tokenizer = load_target(args.target, dtype="float32", device="cpu", trust_remote_code=False)
    drafter = load_drafter(args.drafter, model.get_input_embeddings().weight.detach()).to(dtype=torch.float32).eval()
    return model, tokenizer, drafter


def render_prompt(tokenizer, messages) -> str:
    from eyrie.target.chat_template import render

    return render(tokenizer, messages, add_generation_prompt=True)


def decode(args) -> None:
    import pyarrow.parquet as pq

    from eyrie.bench.benchmark import first_turn, stop_ids_of
    from eyrie.decoding.decode import speculative_decode
    from eyrie.decoding.ngram import lookup_runs

    model, tokenizer, drafter = _models(args)
    prompts = {row["id"]: row for row in pq.read_table(args.heldout).to_pylist()}
    for prompt_id in args.ids.split(","):
        prompt_ids = tokenizer(render_prompt(tokenizer, first_turn(prompts[prompt_id])), add_special_tokens=False)["input_ids"]
        result = speculative_decode(model, drafter, prompt_ids, args.max_new_tokens, stop_ids_of(model, tokenizer), args.steps)
        runs = lookup_runs(prompt_ids + result.tokens, LOOKUP_K)  # runs[e]: prompt lookup's accepted drafts, knowing tokens up to e
        position, pairs = len(prompt_ids), []
        for accepted in result.acceptance_lengths:
            pairs.append((accepted, runs[position - 1] + 1))  # the round emits its accepted drafts and the bonus token
            position += accepted
        copying = [(a, n) for a, n in pairs if n >= 4]
        print(f"{prompt_id}: {len(prompt_ids)} prompt tokens, {len(result.tokens)} new; chain {args.steps} accepted "
              f"{sum(a for a, _ in pairs) / len(pairs):.2f}, prompt lookup at the same positions {sum(n for _, n in pairs) / len(pairs):.2f}")
        if copying:
            print(f"  rounds where prompt lookup accepts >= 4: {len(copying)} of {len(pairs)}; there the drafter "
                  f"{sum(a for a, _ in copying) / len(copying):.2f}, prompt lookup {sum(n for _, n in copying) / len(copying):.2f}")
        print("  per round, drafter/lookup:", " ".join(f"{a}/{n}" for a, n in pairs))
        print("  reply:", repr(tokenizer.decode(result.tokens)[:400]))


def steps(args) -> None:
    import pyarrow.parquet as pq
    import torch

    from eyrie.bench.benchmark import first_turn, stop_ids_of
    from eyrie.decoding.decode import greedy_decode
    from eyrie.decoding.ngram import lookup_runs
    from eyrie.target.aux_layers import capture_indices
    from eyrie.target.states import TargetStates
    from eyrie.training.inputs import padded_batch
    from eyrie.training.objective import needed_targets, step_targets, target_distribution, ttt_hidden

    model, tokenizer, drafter = _models(args)
    prompts = {row["id"]: row for row in pq.read_table(args.heldout).to_pylist()}
    capture = capture_indices(list(drafter.shape.aux_layer_ids), model.config.num_hidden_layers)
    draft_ids = torch.nonzero(drafter.t2d).squeeze(1)
    for prompt_id in args.ids.split(","):
        prompt_ids = tokenizer(render_prompt(tokenizer, first_turn(prompts[prompt_id])), add_special_tokens=False)["input_ids"]
        reply = greedy_decode(model, prompt_ids, args.max_new_tokens, stop_ids_of(model, tokenizer)).tokens
        ids = torch.tensor([prompt_ids + reply])
        with torch.no_grad(), TargetStates(model, capture) as target:
            aux, final = target.states(ids, torch.arange(ids.shape[1]))
        mask = torch.zeros_like(ids, dtype=torch.bool)
        mask[0, len(prompt_ids):] = True
        batch = padded_batch(aux[None], final[None], ids, mask, torch.tensor([ids.shape[1]]), "cpu")
        runs = lookup_runs(ids[0].tolist(), 1)  # runs[e] = 1: prompt lookup, knowing tokens up to e, drafts token e + 1
        print(f"{prompt_id}: {len(prompt_ids)} prompt tokens, {len(reply)} new; per TTT step, accuracy on labels prompt lookup would draft / the rest")
        with torch.no_grad():
            _, row, arg = target_distribution(batch["final"], needed_targets(batch["loss_mask"], batch["lengths"]), model.lm_head.weight,
                                              draft_ids, drafter.t2d)
            outs = ttt_hidden(drafter, batch["aux"], batch["input_ids"], batch["lengths"], args.steps, attention="eager")
            for j, out in enumerate(outs):
                valid, _, target_arg = step_targets(j, row, arg, batch["loss_mask"], batch["lengths"])
                hit = torch.zeros_like(valid)
                hit[valid] = drafter.head(out[valid]).argmax(-1) == target_arg[valid]
                # step j at t predicts token t + 2 + j, which prompt lookup drafts from the tokens up to t + 1 + j
                label_copyable = torch.tensor([t + 2 + j < len(runs) and runs[t + 1 + j] >= 1 for t in range(ids.shape[1])])[None, :]
                cells = []
                for where in (valid & label_copyable, valid & ~label_copyable):
                    cells.append(f"{hit[where].float().mean().item():.2f} ({int(where.sum())})" if where.any() else "n/a (0)")
                print(f"  step {j}: {cells[0]} / {cells[1]}")


def vocab(args) -> None:
    import pyarrow.parquet as pq
    import torch

    from eyrie.bench.benchmark import first_turn, stop_ids_of
    from eyrie.decoding.decode import greedy_decode
    from eyrie.target.aux_layers import capture_indices
    from eyrie.target.states import TargetStates
    from eyrie.training.acceptance import walk_rounds
    from eyrie.training.inputs import padded_batch
    from eyrie.training.objective import ttt_hidden

    model, tokenizer, drafter = _models(args)
    prompts = {row["id"]: row for row in pq.read_table(args.heldout).to_pylist()}
    capture = capture_indices(list(drafter.shape.aux_layer_ids), model.config.num_hidden_layers)
    totals = {"as is": [0, 0], "outside drafted right": [0, 0]}  # rounds, tokens emitted
    outside_total = tokens_total = 0
    for prompt_id in args.ids.split(","):
        prompt_ids = tokenizer(render_prompt(tokenizer, first_turn(prompts[prompt_id])), add_special_tokens=False)["input_ids"]
        reply = greedy_decode(model, prompt_ids, args.max_new_tokens, stop_ids_of(model, tokenizer)).tokens
        ids = torch.tensor([prompt_ids + reply])
        length = ids.shape[1]
        with torch.no_grad(), TargetStates(model, capture) as target:
            aux, final = target.states(ids, torch.arange(length))
        mask = torch.zeros_like(ids, dtype=torch.bool)
        mask[0, len(prompt_ids):] = True
        batch = padded_batch(aux[None], final[None], ids, mask, torch.tensor([length]), "cpu")
        with torch.no_grad():
            outs = ttt_hidden(drafter, batch["aux"], batch["input_ids"], batch["lengths"], args.steps, attention="eager")
            drafts = [drafter.draft_ids_to_target(drafter.head(out[0]).argmax(-1)) for out in outs]
        hit = torch.zeros(args.steps, length, dtype=torch.bool)
        outside = torch.zeros(args.steps, length, dtype=torch.bool)
        for j, draft in enumerate(drafts):
            label_at = torch.arange(length) + 2 + j  # step j at t drafts token t + 2 + j
            exists = label_at < length
            label = ids[0, label_at.clamp(max=length - 1)]
            hit[j] = exists & (draft == label)
            outside[j] = exists & ~drafter.t2d[label]
        # Rounds start on the reply, the first drafting from the prompt's last position, as training's walk does.
        starts = [len(prompt_ids) - 1 <= t and t + 2 < length for t in range(length)]
        runs = {name: torch.cumprod(h.long(), 0).sum(0).tolist()  # consecutive hits from step 0 at each position
                for name, h in zip(totals, (hit, hit | outside))}
        rows = {name: walk_rounds(name_runs, starts, args.steps) for name, name_runs in runs.items()}
        for name, (rounds, emitted) in rows.items():
            totals[name] = [totals[name][0] + rounds, totals[name][1] + emitted]
        if args.misses:
            _print_misses(tokenizer, drafter, ids[0], drafts, runs["as is"], len(prompt_ids), args)
        n_outside = sum(1 for token in reply if not drafter.t2d[token])
        outside_total, tokens_total = outside_total + n_outside, tokens_total + len(reply)
        print(f"{prompt_id}: {len(reply)} new tokens, {n_outside} outside the draft vocabulary; walked chain {args.steps} "
              + ", ".join(f"{name} {emitted / rounds:.2f}" for name, (rounds, emitted) in rows.items()))
    print(f"all: {outside_total} of {tokens_total} new tokens outside the draft vocabulary; walked chain {args.steps} "
          + ", ".join(f"{name} {emitted / rounds:.3f} ({rounds} rounds)" for name, (rounds, emitted) in totals.items()))


def _print_misses(tokenizer, drafter, ids, drafts, runs, prompt_length: int, args) -> None:
    """The first --misses rounds' ends, walked as is: what the round accepted, the token it missed and what was drafted."""
    shown, t = [], prompt_length - 1
    while t + 2 < len(ids) and len(shown) < args.misses:
        accepted = min(args.steps, runs[t])
        if accepted < args.steps and t + 2 + accepted < len(ids):
            want, got = (int(x) for x in (ids[t + 2 + accepted], drafts[accepted][t]))
            outside = "" if drafter.t2d[want] else " (outside the vocabulary)"
            shown.append(f"{tokenizer.decode(ids[t + 2 : t + 2 + accepted])!r} then {tokenizer.convert_ids_to_tokens(want)!r}{outside}, "
                         f"drafted {tokenizer.convert_ids_to_tokens(got)!r} at step {accepted}")
        t += accepted + 1
    print("  first misses:\n    " + "\n    ".join(shown))


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
    for mode, default_steps in (("decode", 6), ("steps", 7), ("vocab", 6)):
        d = modes.add_parser(mode)
        d.add_argument("--target", required=True)
        d.add_argument("--drafter", required=True)
        d.add_argument("--heldout", required=True)
        d.add_argument("--ids", required=True, help="comma-separated held-out prompt ids")
        d.add_argument("--steps", type=int, default=default_steps, help="decode, vocab: the chain's drafts; steps: TTT steps")
        d.add_argument("--max-new-tokens", type=int, default=256)
        if mode == "vocab":
            d.add_argument("--misses", type=int, default=0, help="print each prompt's first N round-ending misses")
    w = modes.add_parser("what-if")
    w.add_argument("--bench", required=True)
    w.add_argument("--setting", required=True, help='a sweep label, e.g. "tree 6-8-32"')
    w.add_argument("--cap", type=float, default=6.5)
    args = parser.parse_args()
    {"decode": decode, "steps": steps, "vocab": vocab, "what-if": what_if}[args.mode](args)


if __name__ == "__main__":
    main()
