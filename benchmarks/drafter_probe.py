"""Probes of a finished pipeline run's drafter: where it loses to prompt lookup, where a parity gap comes from, which
tree shapes could beat the sweep's. Each reads the run's target, drafter and prompts (CPU float32 is fine for a few
prompts) and, with --out, writes its figures as JSON.

copy: does the drafter copy what its context already holds? Its modes:

  decode   decodes held-out prompts with a chain and, per round, sets the drafter's accepted length beside what prompt
           lookup (eyrie's n-gram baseline, k = 8) would accept at the same position of the same greedy text.

    python benchmarks/drafter_probe.py copy decode --target W/resources/models/SmolLM2-135M-Instruct \\
        --drafter W/results/drafter --heldout W/results/prompts/sharegpt/heldout.parquet --ids 1giY8Cd_62,1Etq8vj_30 --steps 6

  steps    each prompt's greedy reply teacher-forced through the drafter's TTT steps, as training's evaluation walks
           it, with each step's accuracy split between the labels prompt lookup would draft from the tokens before
           them and the rest. A drafter that copies is right on nearly every copyable label at every step.
  vocab    each greedy reply walked round by round with a chain of --steps, each step the drafter's teacher-forced
           prediction (this reproduces the served chain), as is and as if every reply token outside the draft
           vocabulary had been drafted right: what a vocabulary holding the tokens the target copies would buy at most.
           (--misses N prints each prompt's first N round-ending misses.)
  what-if  (a benchmark's JSON) the sweep setting's tokens/s over the n-gram's, had the drafter accepted at least what
           prompt lookup accepted on each prompt (capped), each prompt's seconds per round kept.

    python benchmarks/drafter_probe.py copy what-if --bench results/bench/sharegpt.json --setting "tree 6-8-32" --cap 6.5

A drafter trained on the H200 was checked against the bf16 conversion of its target, and a CPU conversion is float32,
so copy and trees load both without the benchmark's fingerprint check: they are probes, not benchmarks.

parity: training's simulation and the served chain on the very same tokens. The benchmark's parity gate compares the
served chain acceptance with training's prediction on held-out cache samples. A gap has two kinds of cause: the
drafter is served differently from how it was trained (a bug: both numbers on the same tokens then differ), or the
benchmark's sequences are unlike the cached ones (both numbers on the same tokens then agree, and the cache's
prediction was the wrong yardstick). This decodes held-out prompts with the served chain (k drafts per round), then
runs training's own simulation (eyrie.training.acceptance.batch_counts) on the decoded sequences, with the target's
states computed as extraction computes them, and prints both per position.

    python benchmarks/drafter_probe.py parity --workdir <pipeline dir> --dataset sharegpt --prompts 4 --max-new-tokens 128

--second-turn also answers each prompt's second user turn after the target's own first reply (as regeneration builds
a two-turn sample) and reports both turns apart: the benchmark serves first turns only, while the held-out cache
samples that training predicts from hold both. --eval-samples 0.05 serves, instead of the benchmark's held-out
prompts, the training shards' prompts that training held out (train.eval_fraction 0.05): the prompts behind
training's prediction, so the two sample sets can be told apart from the two code paths.

trees: which tree shapes could beat the sweep's. A tree's speed is its acceptance (tokens a round) over its round's
time. Acceptance depends on the drafter and the prompts, not on the machine, so it is measured here (float32, eyrie's
own static decoder, the benchmark's prompts); the round's time cannot be. Within one GPU benchmark the sweep's
settings give a round's time each (acceptance / tokens per second); a line through them, ms = a + b * steps +
c * draft_tokens, predicts the others. Shapes outside the measured ones' range (steps, draft tokens or topk) are
extrapolations, and the table says so. The measured shapes come first, with the GPU's acceptance beside this
machine's; every decode is checked against plain greedy (the probe stops on a difference). --prompts-file is the file
the benchmark read its prompts from (a held-out parquet, MT-bench's question.jsonl, HumanEval.jsonl.gz). A benchmark
with fewer than three timed sweep settings (the CPU default's) gives no round-time line: the table then has each
shape's acceptance and the seconds its decodes took here, which on a CPU are its time.

    python benchmarks/drafter_probe.py trees --target W/resources/models/SmolLM2-135M-Instruct --drafter W/results/drafter \\
        --prompts-file W/results/prompts/sharegpt/heldout.parquet --bench W/results/bench/sharegpt.json \\
        --shapes 6,10,48 8,10,64 10,10,64 8,16,96 [--prompts 16] [--max-new-tokens 256]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

LOOKUP_K = 8  # the n-gram baseline's fastest draft length on all three H200 benchmarks


# --------------------------------------------------------------------------- shared by the probes


def load_unchecked(target: str | Path, drafter: str | Path, dtype: str = "float32", device: str = "cpu"):
    """(target, tokenizer, drafter) without the benchmark's fingerprint and template checks (see above)."""
    from eyrie.drafter.checkpoint import load_drafter
    from eyrie.target.model import load_target

    model, tokenizer = load_target(target, dtype=dtype, device=device, trust_remote_code=False)
    loaded = load_drafter(drafter, model.get_input_embeddings().weight.detach()).to(model.device, model.dtype).eval()
    return model, tokenizer, loaded


def encode(tokenizer, messages: list[dict]) -> list[int]:
    """The conversation rendered by the target's chat template up to the assistant's turn, as the benchmark encodes it."""
    from eyrie.target.chat_template import render

    return tokenizer(render(tokenizer, messages, add_generation_prompt=True), add_special_tokens=False)["input_ids"]


def heldout_by_id(path: str) -> dict[str, dict]:
    import pyarrow.parquet as pq

    return {row["id"]: row for row in pq.read_table(path).to_pylist()}


def teacher_forced_batch(model, drafter, prompt_ids: list[int], reply: list[int]):
    """(ids [1, T], training's padded batch) of prompt + reply, the reply in the loss mask, states as extraction takes them."""
    import torch

    from eyrie.target.aux_layers import capture_indices
    from eyrie.target.states import TargetStates
    from eyrie.training.inputs import padded_batch

    capture = capture_indices(list(drafter.shape.aux_layer_ids), model.config.num_hidden_layers)
    ids = torch.tensor([prompt_ids + reply], device=model.device)
    with torch.no_grad(), TargetStates(model, capture) as target:
        aux, final = target.states(ids, torch.arange(ids.shape[1], device=model.device))
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[0, len(prompt_ids):] = True
    return ids, padded_batch(aux.float()[None], final.float()[None], ids, mask, torch.tensor([ids.shape[1]]), model.device)


# --------------------------------------------------------------------------- copy


def copy_decode(args) -> dict:
    from eyrie.bench.benchmark import first_turn, stop_ids_of
    from eyrie.decoding.decode import speculative_decode
    from eyrie.decoding.ngram import lookup_runs

    model, tokenizer, drafter = load_unchecked(args.target, args.drafter)
    prompts = heldout_by_id(args.heldout)
    rows = []
    for prompt_id in args.ids.split(","):
        prompt_ids = encode(tokenizer, first_turn(prompts[prompt_id]))
        result = speculative_decode(model, drafter, prompt_ids, args.max_new_tokens, stop_ids_of(model, tokenizer), args.steps)
        runs = lookup_runs(prompt_ids + result.tokens, LOOKUP_K)  # runs[e]: prompt lookup's accepted drafts, knowing tokens up to e
        position, pairs = len(prompt_ids), []
        for accepted in result.acceptance_lengths:
            pairs.append((accepted, runs[position - 1] + 1))  # the round emits its accepted drafts and the bonus token
            position += accepted
        copying = [(a, n) for a, n in pairs if n >= 4]
        row = {"id": prompt_id, "prompt_tokens": len(prompt_ids), "new_tokens": len(result.tokens), "rounds": len(pairs),
               "drafter_accepted": sum(a for a, _ in pairs) / len(pairs), "lookup_accepted": sum(n for _, n in pairs) / len(pairs),
               "copying_rounds": len(copying), "per_round": pairs}
        rows.append(row)
        print(f"{prompt_id}: {len(prompt_ids)} prompt tokens, {len(result.tokens)} new; chain {args.steps} accepted "
              f"{row['drafter_accepted']:.2f}, prompt lookup at the same positions {row['lookup_accepted']:.2f}")
        if copying:
            print(f"  rounds where prompt lookup accepts >= 4: {len(copying)} of {len(pairs)}; there the drafter "
                  f"{sum(a for a, _ in copying) / len(copying):.2f}, prompt lookup {sum(n for _, n in copying) / len(copying):.2f}")
        print("  per round, drafter/lookup:", " ".join(f"{a}/{n}" for a, n in pairs))
        print("  reply:", repr(tokenizer.decode(result.tokens)[:400]))
    return {"steps": args.steps, "lookup_k": LOOKUP_K, "prompts": rows}


def copy_steps(args) -> dict:
    import torch

    from eyrie.bench.benchmark import first_turn, stop_ids_of
    from eyrie.decoding.decode import greedy_decode
    from eyrie.decoding.ngram import lookup_runs
    from eyrie.training.objective import needed_targets, step_targets, target_distribution, ttt_hidden

    model, tokenizer, drafter = load_unchecked(args.target, args.drafter)
    prompts = heldout_by_id(args.heldout)
    draft_ids = torch.nonzero(drafter.t2d).squeeze(1)
    rows = []
    for prompt_id in args.ids.split(","):
        prompt_ids = encode(tokenizer, first_turn(prompts[prompt_id]))
        reply = greedy_decode(model, prompt_ids, args.max_new_tokens, stop_ids_of(model, tokenizer)).tokens
        ids, batch = teacher_forced_batch(model, drafter, prompt_ids, reply)
        runs = lookup_runs(ids[0].tolist(), 1)  # runs[e] = 1: prompt lookup, knowing tokens up to e, drafts token e + 1
        print(f"{prompt_id}: {len(prompt_ids)} prompt tokens, {len(reply)} new; per TTT step, accuracy on labels prompt lookup would draft / the rest")
        per_step = []
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
                cells = {}
                for name, where in (("copyable", valid & label_copyable), ("other", valid & ~label_copyable)):
                    cells[name] = {"accuracy": hit[where].float().mean().item() if where.any() else None, "labels": int(where.sum())}
                per_step.append(cells)
                print(f"  step {j}: " + " / ".join("n/a (0)" if c["accuracy"] is None else f"{c['accuracy']:.2f} ({c['labels']})"
                                                   for c in cells.values()))
        rows.append({"id": prompt_id, "prompt_tokens": len(prompt_ids), "new_tokens": len(reply), "per_step": per_step})
    return {"steps": args.steps, "prompts": rows}


def copy_vocab(args) -> dict:
    import torch

    from eyrie.bench.benchmark import first_turn, stop_ids_of
    from eyrie.decoding.decode import greedy_decode
    from eyrie.training.acceptance import walk_rounds
    from eyrie.training.objective import ttt_hidden

    model, tokenizer, drafter = load_unchecked(args.target, args.drafter)
    prompts = heldout_by_id(args.heldout)
    totals = {"as is": [0, 0], "outside drafted right": [0, 0]}  # rounds, tokens emitted
    outside_total = tokens_total = 0
    rows = []
    for prompt_id in args.ids.split(","):
        prompt_ids = encode(tokenizer, first_turn(prompts[prompt_id]))
        reply = greedy_decode(model, prompt_ids, args.max_new_tokens, stop_ids_of(model, tokenizer)).tokens
        ids, batch = teacher_forced_batch(model, drafter, prompt_ids, reply)
        length = ids.shape[1]
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
        walked = {name: walk_rounds(name_runs, starts, args.steps) for name, name_runs in runs.items()}
        for name, (rounds, emitted) in walked.items():
            totals[name] = [totals[name][0] + rounds, totals[name][1] + emitted]
        if args.misses:
            _print_misses(tokenizer, drafter, ids[0], drafts, runs["as is"], len(prompt_ids), args)
        n_outside = sum(1 for token in reply if not drafter.t2d[token])
        outside_total, tokens_total = outside_total + n_outside, tokens_total + len(reply)
        rows.append({"id": prompt_id, "new_tokens": len(reply), "outside_vocab": n_outside,
                     "walked": {name: emitted / rounds for name, (rounds, emitted) in walked.items()}})
        print(f"{prompt_id}: {len(reply)} new tokens, {n_outside} outside the draft vocabulary; walked chain {args.steps} "
              + ", ".join(f"{name} {emitted / rounds:.2f}" for name, (rounds, emitted) in walked.items()))
    print(f"all: {outside_total} of {tokens_total} new tokens outside the draft vocabulary; walked chain {args.steps} "
          + ", ".join(f"{name} {emitted / rounds:.3f} ({rounds} rounds)" for name, (rounds, emitted) in totals.items()))
    return {"steps": args.steps, "prompts": rows, "outside_vocab": outside_total, "new_tokens": tokens_total,
            "walked": {name: {"length": emitted / rounds, "rounds": rounds} for name, (rounds, emitted) in totals.items()}}


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


def copy_what_if(args) -> dict:
    report = json.loads(Path(args.bench).read_text())
    settings = {s["label"]: s for s in (report.get("sweep") or {}).get("settings", [])}
    if args.setting not in settings:
        raise SystemExit(f"{args.bench}: no sweep setting {args.setting!r} (its settings: {', '.join(settings) or 'none'})")
    ngram = {row["id"]: row for row in report["ngram"]["per_prompt"]}
    tokens = seconds = seconds_if = ngram_tokens = ngram_seconds = 0.0
    for row in settings[args.setting]["per_prompt"]:
        accepted = max(row["acceptance_length_mean"], min(ngram[row["id"]]["acceptance_length_mean"], args.cap))
        tokens += row["new_tokens"]
        seconds += row["seconds"]
        seconds_if += row["seconds"] * row["acceptance_length_mean"] / accepted  # as many rounds fewer, each as long
        ngram_tokens += ngram[row["id"]]["new_tokens"]
        ngram_seconds += ngram[row["id"]]["seconds"]
    baseline = ngram_tokens / ngram_seconds
    figures = {"setting": args.setting, "cap": args.cap, "measured_over_ngram": tokens / seconds / baseline,
               "what_if_over_ngram": tokens / seconds_if / baseline}
    print(f"{args.setting} over the n-gram: {figures['measured_over_ngram']:.3f} measured; {figures['what_if_over_ngram']:.3f} had it "
          f"accepted at least what prompt lookup did on each prompt (capped at {args.cap})")
    return figures


# --------------------------------------------------------------------------- parity


def parity(args) -> dict:
    from eyrie.bench.benchmark import first_turn, load_models, stop_ids_of
    from eyrie.bench.prompt_files import load_heldout_prompts

    work = Path(args.workdir)
    target_dir = args.model or str(next((work / "resources" / "models").iterdir()))
    if args.any_template:  # a target converted elsewhere (another transformers) can differ in its special tokens only
        model, tokenizer, drafter = load_unchecked(target_dir, work / "results" / "drafter", args.dtype, args.device)
    else:
        model, tokenizer, drafter, _, _ = load_models(target_dir, work / "results" / "drafter", args.dtype, args.device, None, False)
    prompts = (eval_sample_prompts(work / "results" / "prompts" / args.dataset, args.eval_samples, args.prompts) if args.eval_samples
               else load_heldout_prompts(work / "results" / "prompts" / args.dataset / "heldout.parquet", args.prompts))
    runs = served(model, drafter, [encode(tokenizer, first_turn(p)) for p in prompts], args.max_new_tokens, stop_ids_of(model, tokenizer), args.k)
    recorded = json.loads((work / "results" / "drafter" / "config.json").read_text()).get("eyrie", {}).get("simulated_acceptance", {})
    out = {"first turn": compared(model, drafter, runs, args.k)}
    if args.second_turn:
        later = served(model, drafter, second_turns(tokenizer, prompts, runs), args.max_new_tokens, stop_ids_of(model, tokenizer), args.k)
        out["second turn"] = compared(model, drafter, later, args.k)
        out["both turns"] = compared(model, drafter, runs + later, args.k)
    forms = ("length", "conditional_length", "walked_length", "walked_first_turn_length", "per_step_accuracy")
    out["training_prediction"] = {k: recorded.get(k) for k in forms}
    print(json.dumps(out, indent=1))
    return out


def served(model, drafter, prompts, max_new_tokens, stop_ids, k):
    """Per prompt: (prompt ids, new tokens, SpecResult) of the served chain."""
    from eyrie.decoding.decode import speculative_decode

    return [(ids, (r := speculative_decode(model, drafter, ids, max_new_tokens, stop_ids, k)).tokens, r) for ids in prompts]


def simulated(model, drafter, sequences, steps: int) -> dict:
    """Training's simulation on (prompt ids, new tokens): loss mask on the new tokens, states as extraction computes them."""
    import torch

    from eyrie.training.acceptance import ROWS, acceptance_summary, batch_counts

    lm_head = model.get_output_embeddings().weight.detach().float()
    draft_ids = (torch.arange(drafter.d2t.numel()) + drafter.d2t.cpu()).to(model.device)
    totals = torch.zeros(len(ROWS), steps, dtype=torch.int64)
    drafter_f32 = drafter.float()
    for prompt, new in sequences:
        _, batch = teacher_forced_batch(model, drafter, prompt, new)
        totals += batch_counts(drafter_f32, batch, target_lm_head=lm_head, draft_ids=draft_ids, t2d=drafter.t2d.to(model.device),
                               steps=steps, attention="eager", use_bf16=False).cpu()
    return acceptance_summary(totals.tolist(), source="served sequences", samples=len(sequences))


def compared(model, drafter, runs, k: int) -> dict:
    """The served chain's acceptance over these runs beside training's simulation on the same tokens."""
    rounds = sum(r.rounds for _, _, r in runs)
    sim = simulated(model, drafter, [(p, t) for p, t, _ in runs], k)
    return {
        "served": {"length": sum(sum(r.acceptance_lengths) for _, _, r in runs) / rounds, "rounds": rounds, "prompts": len(runs),
                   "rate_per_position": [sum(r.accepted_per_position[j] for _, _, r in runs) / rounds for j in range(k)]},
        "simulated_on_served_tokens": {key: sim[key] for key in ("length", "conditional_length", "walked_length", "walked_rounds",
                                                                  "per_step_accuracy", "conditional_accuracy", "positions_per_step")},
    }


def eval_sample_prompts(prompts_dir: Path, fraction: float, limit: int) -> list[dict]:
    """The first `limit` (by id) of the shard prompts training holds out at train.eval_fraction `fraction`: the same id rule
    over the prompts' ids (the cache's samples are those of them with trainable tokens, so a few may differ)."""
    from eyrie.core.artifacts import read_parquet
    from eyrie.training.holdout import held_out_indices

    written_by = f"build_prompts_{prompts_dir.name}"  # the project's reader: digest checked, errors name the file
    rows = [row for path in sorted(prompts_dir.glob("[0-9]*.parquet"))
            for row in read_parquet(path, ["id", "messages"], written_by=written_by).to_pylist()]
    held = [rows[k] for k in held_out_indices([row["id"] for row in rows], fraction)]
    return sorted(held, key=lambda row: row["id"])[:limit]


def second_turns(tokenizer, prompts: list[dict], firsts) -> list[list[int]]:
    """For each prompt with a second user turn: the conversation up to it, encoded, after the target's own first reply."""
    from eyrie.bench.benchmark import first_turn

    encoded = []
    for prompt, (_, reply, _) in zip(prompts, firsts):
        users = [m for m in prompt["messages"] if m["role"] == "user"]
        if len(users) < 2:
            continue
        encoded.append(encode(tokenizer, first_turn(prompt) + [
            {"role": "assistant", "content": tokenizer.decode(reply, skip_special_tokens=True)},
            {"role": "user", "content": users[1]["content"]},
        ]))
    return encoded


# --------------------------------------------------------------------------- trees


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


def trees(args) -> dict:
    """The shapes' acceptance, decoded without gradients (nothing here trains)."""
    import torch

    with torch.no_grad():
        return _trees(args)


def _trees(args) -> dict:
    from eyrie.bench.benchmark import first_turn, stop_ids_of
    from eyrie.bench.prompt_files import load_benchmark_prompts
    from eyrie.decoding.decode import greedy_decode, tree_decode
    from eyrie.decoding.static import open_decoder

    bench = json.loads(Path(args.bench).read_text())
    bench["sweep"] = bench.get("sweep") or {"settings": []}  # a benchmark run without a sweep
    line = round_model(bench) if timed_settings(bench) >= 3 else None
    (a, b, c), measured = line or ((None, None, None), [])
    gpu = {(s["steps"], s["topk"], s["draft_tokens"]): s for s in bench["sweep"]["settings"]}
    shapes = list(dict.fromkeys([*gpu, *args.shapes]))
    ids = [p["id"] for p in bench["per_prompt"]][: args.prompts]
    max_new_tokens = args.max_new_tokens or bench["max_new_tokens"]
    if line:
        print(f"round time on the GPU: {a:.3f} + {b:.3f} * steps + {c:.5f} * draft_tokens ms, from "
              + ", ".join(f"({s}, {n}): {ms:.3f}" for s, n, ms in measured))
    else:
        print(f"{args.bench}: {timed_settings(bench)} timed sweep settings, fewer than a round-time line needs: acceptance and seconds here only")

    model, tokenizer, drafter = load_unchecked(args.target, args.drafter)
    prompts = {row["id"]: row for row in load_benchmark_prompts(bench["benchmark"], args.prompts_file)}
    missing = [i for i in ids if i not in prompts]
    if missing:
        raise SystemExit(f"{args.prompts_file}: the benchmark's prompts {missing[:5]} are not in it")
    stop = stop_ids_of(model, tokenizer)
    encoded = [encode(tokenizer, first_turn(prompts[i])) for i in ids]
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
    figures = {"decoder": label, "prompts": len(ids), "max_new_tokens": max_new_tokens, "round_time_line": line and [a, b, c], "shapes": rows}

    if not line:
        print(f"\n{label} here, {len(ids)} prompts x {max_new_tokens} tokens, every decode lossless")
        print("| shape | acceptance | the benchmark's own (its sweep prompts) | rounds | seconds |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(f"| ({', '.join(map(str, r['shape']))}) | {r['cpu_acceptance']:.3f} | {r['bench_acceptance'] or float('nan'):.3f} | "
                  f"{r['rounds']} | {r['cpu_seconds']:.1f} |")
        return figures

    # The CPU's float32 replies are not the GPU's bf16 ones: scale by the measured shapes' GPU (the benchmark's) / CPU acceptance.
    pairs = [(r["bench_acceptance"], r["cpu_acceptance"]) for r in rows if r["bench_acceptance"]]
    scale = sum(g for g, _ in pairs) / sum(x for _, x in pairs)
    ngram_tokens_per_s = bench["ngram"]["tokens_per_s"]
    print(f"\n{label} on the CPU, {len(ids)} prompts x {max_new_tokens} tokens; GPU / CPU acceptance over the measured shapes {scale:.3f}")
    print("| shape | CPU acceptance | GPU acceptance | ms a round (GPU, the line) | tok/s (measured or predicted) | over the n-gram |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        # A measured shape keeps its own figures; the others get the scaled CPU acceptance over the line's round time.
        measured_setting = gpu.get(tuple(r["shape"]))
        r["tokens_per_s"] = measured_setting["tokens_per_s"] if measured_setting else \
            1000 * r["cpu_acceptance"] * scale / r["predicted_ms_per_round"]
        r["over_ngram"] = r["tokens_per_s"] / ngram_tokens_per_s
        shape = "(" + ", ".join(map(str, r["shape"])) + ")"
        print(f"| {shape} | {r['cpu_acceptance']:.3f} | {r['bench_acceptance'] or float('nan'):.3f} | "
              f"{r['predicted_ms_per_round']:.3f}{' (extrapolated)' if r['extrapolated'] else ''} | {r['tokens_per_s']:.0f} | "
              f"{r['over_ngram']:.3f} |")
    return figures


# --------------------------------------------------------------------------- the command line


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    probes = parser.add_subparsers(dest="probe", required=True)

    copy = probes.add_parser("copy", help="where the drafter loses to prompt lookup").add_subparsers(dest="mode", required=True)
    for mode, default_steps in (("decode", 6), ("steps", 7), ("vocab", 6)):
        d = copy.add_parser(mode)
        d.add_argument("--target", required=True)
        d.add_argument("--drafter", required=True)
        d.add_argument("--heldout", required=True)
        d.add_argument("--ids", required=True, help="comma-separated held-out prompt ids")
        d.add_argument("--steps", type=int, default=default_steps, help="decode, vocab: the chain's drafts; steps: TTT steps")
        d.add_argument("--max-new-tokens", type=int, default=256)
        d.add_argument("--out", type=Path, help="write the figures as JSON here")
        if mode == "vocab":
            d.add_argument("--misses", type=int, default=0, help="print each prompt's first N round-ending misses")
    w = copy.add_parser("what-if")
    w.add_argument("--bench", required=True)
    w.add_argument("--setting", required=True, help='a sweep label, e.g. "tree 6-8-32"')
    w.add_argument("--cap", type=float, default=6.5)
    w.add_argument("--out", type=Path, help="write the figures as JSON here")

    p = probes.add_parser("parity", help="training's simulation and the served chain on the very same tokens")
    p.add_argument("--workdir", required=True, help="a pipeline directory: resources/models/<model>, results/drafter, results/prompts")
    p.add_argument("--model", default=None, help="the target's directory (default: the one under resources/models)")
    p.add_argument("--dataset", default="sharegpt")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="auto")
    p.add_argument("--any-template", action="store_true", help="skip the check that the target's template is the drafter's")
    p.add_argument("--second-turn", action="store_true", help="also serve each prompt's second user turn and report the turns apart")
    p.add_argument("--eval-samples", type=float, metavar="FRACTION",
                   help="serve the training shards' prompts that training holds out at this train.eval_fraction (the samples its "
                        "prediction walks, by the same id rule) instead of the benchmark's held-out prompts")
    p.add_argument("--out", type=Path, help="write the figures as JSON here")

    t = probes.add_parser("trees", help="other tree shapes: acceptance measured here, round time predicted from a GPU run's sweep")
    t.add_argument("--target", required=True)
    t.add_argument("--drafter", required=True)
    t.add_argument("--prompts-file", "--heldout", dest="prompts_file", required=True,
                   help="the benchmark's prompts: a held-out parquet, MT-bench's question.jsonl or HumanEval.jsonl.gz")
    t.add_argument("--bench", required=True, help="a benchmark's JSON: its prompts, and from a GPU run its sweep's round times and its n-gram")
    t.add_argument("--shapes", nargs="+", type=parse_shape, required=True, help="steps,topk,draft_tokens ...")
    t.add_argument("--prompts", type=int, default=None, help="the first N of the benchmark's prompts (default: all)")
    t.add_argument("--max-new-tokens", type=int, default=None, help="default: the benchmark's")
    t.add_argument("--out", type=Path, help="write the figures as JSON here")

    args = parser.parse_args(argv)
    run = {"parity": parity, "trees": trees}.get(args.probe) or \
        {"decode": copy_decode, "steps": copy_steps, "vocab": copy_vocab, "what-if": copy_what_if}[getattr(args, "mode", None)]
    figures = run(args)
    if args.out:
        args.out.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
