"""Where a parity gap comes from: training's simulation and the served chain on the very same tokens.

The benchmark's parity gate compares the served chain acceptance with training's prediction on held-out
cache samples. A gap has two kinds of cause: the drafter is served differently from how it was trained
(a bug: both numbers on the same tokens then differ), or the benchmark's sequences are unlike the cached
ones (both numbers on the same tokens then agree, and the cache's prediction was the wrong yardstick).
This script separates them: it decodes held-out prompts with the served chain (k drafts per round), then
runs training's own simulation (eyrie.training.acceptance.batch_counts) on the decoded sequences, with the
target's states computed as extraction computes them, and prints both per position.

    python benchmarks/parity_probe.py --workdir <pipeline dir> --dataset sharegpt --prompts 4 --max-new-tokens 128

--second-turn also answers each prompt's second user turn after the target's own first reply (as regeneration
builds a two-turn sample) and reports both turns apart: the benchmark serves first turns only, while the held-out
cache samples that training predicts from hold both. --eval-samples 0.05 serves, instead of the benchmark's
held-out prompts, the training shards' prompts that training held out (train.eval_fraction 0.05): the prompts
behind training's prediction, so the two sample sets can be told apart from the two code paths.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from eyrie.bench.benchmark import first_turn, load_heldout_prompts, load_models, stop_ids_of
from eyrie.decoding.decode import speculative_decode
from eyrie.target.aux_layers import capture_indices
from eyrie.target.chat_template import render
from eyrie.target.states import TargetStates
from eyrie.training.acceptance import ROWS, acceptance_summary, batch_counts
from eyrie.training.inputs import padded_batch


def served(model, drafter, prompts, max_new_tokens, stop_ids, k):
    """Per prompt: (prompt ids, new tokens, SpecResult) of the served chain."""
    return [(ids, (r := speculative_decode(model, drafter, ids, max_new_tokens, stop_ids, k)).tokens, r) for ids in prompts]


def simulated(model, drafter, sequences, steps: int) -> dict:
    """Training's simulation on (prompt ids, new tokens): loss mask on the new tokens, states as extraction computes them."""
    capture = capture_indices(list(drafter.shape.aux_layer_ids), model.config.num_hidden_layers)
    lm_head = model.get_output_embeddings().weight.detach().float()
    draft_ids = (torch.arange(drafter.d2t.numel()) + drafter.d2t.cpu()).to(model.device)
    totals = torch.zeros(len(ROWS), steps, dtype=torch.int64)
    drafter_f32 = drafter.float()
    for prompt, new in sequences:
        ids = torch.tensor([prompt + new], device=model.device)
        keep = torch.arange(ids.shape[1], device=model.device)
        with torch.no_grad(), TargetStates(model, capture) as target:
            aux, final = target.states(ids, keep)
        mask = torch.zeros_like(ids, dtype=torch.bool)
        mask[0, len(prompt):] = True
        batch = padded_batch(aux.float()[None], final.float()[None], ids, mask, torch.tensor([ids.shape[1]]), model.device)
        totals += batch_counts(drafter_f32, batch, target_lm_head=lm_head, draft_ids=draft_ids, t2d=drafter.t2d.to(model.device),
                               steps=steps, attention="eager", use_bf16=False).cpu()
    return acceptance_summary(totals.tolist(), source="served sequences", samples=len(sequences))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True, help="a pipeline directory: resources/models/<model>, results/drafter, results/prompts")
    parser.add_argument("--model", default=None, help="the target's directory (default: the one under resources/models)")
    parser.add_argument("--dataset", default="sharegpt")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--any-template", action="store_true", help="skip the check that the target's template is the drafter's")
    parser.add_argument("--second-turn", action="store_true", help="also serve each prompt's second user turn and report the turns apart")
    parser.add_argument("--eval-samples", type=float, metavar="FRACTION",
                        help="serve the training shards' prompts that training holds out at this train.eval_fraction (the samples its "
                             "prediction walks, by the same id rule) instead of the benchmark's held-out prompts")
    args = parser.parse_args()
    work = Path(args.workdir)
    target_dir = args.model or str(next((work / "resources" / "models").iterdir()))
    if args.any_template:  # a target converted elsewhere (another transformers) can differ in its special tokens only
        from eyrie.drafter.checkpoint import load_drafter
        from eyrie.target.model import load_target

        model, tokenizer = load_target(target_dir, dtype=args.dtype, device=args.device, trust_remote_code=False)
        drafter = load_drafter(work / "results" / "drafter", model.get_input_embeddings().weight.detach()).to(model.device, model.dtype).eval()
    else:
        model, tokenizer, drafter, _, _ = load_models(target_dir, work / "results" / "drafter", args.dtype, args.device, None, False)
    prompts = (eval_sample_prompts(work / "results" / "prompts" / args.dataset, args.eval_samples, args.prompts) if args.eval_samples
               else load_heldout_prompts(work / "results" / "prompts" / args.dataset / "heldout.parquet", args.prompts))
    encoded = [tokenizer(render(tokenizer, first_turn(p), add_generation_prompt=True), add_special_tokens=False)["input_ids"] for p in prompts]
    runs = served(model, drafter, encoded, args.max_new_tokens, stop_ids_of(model, tokenizer), args.k)
    recorded = json.loads((work / "results" / "drafter" / "config.json").read_text()).get("eyrie", {}).get("simulated_acceptance", {})
    out = {"first turn": compared(model, drafter, runs, args.k)}
    if args.second_turn:
        seconds = second_turns(tokenizer, prompts, runs)
        later = served(model, drafter, seconds, args.max_new_tokens, stop_ids_of(model, tokenizer), args.k)
        out["second turn"] = compared(model, drafter, later, args.k)
        out["both turns"] = compared(model, drafter, runs + later, args.k)
    forms = ("length", "conditional_length", "walked_length", "walked_first_turn_length", "per_step_accuracy")
    out["training_prediction"] = {k: recorded.get(k) for k in forms}
    print(json.dumps(out, indent=1))


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
    encoded = []
    for prompt, (_, reply, _) in zip(prompts, firsts):
        users = [m for m in prompt["messages"] if m["role"] == "user"]
        if len(users) < 2:
            continue
        messages = first_turn(prompt) + [
            {"role": "assistant", "content": tokenizer.decode(reply, skip_special_tokens=True)},
            {"role": "user", "content": users[1]["content"]},
        ]
        encoded.append(tokenizer(render(tokenizer, messages, add_generation_prompt=True), add_special_tokens=False)["input_ids"])
    return encoded

if __name__ == "__main__":
    main()
