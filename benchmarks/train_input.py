"""Training's input path at the pipeline's drafter shape: what reading the cache costs a step, side by side.

The H200 run trained at 45-48K tok/s from an fp8 cache and 85-87K from a bf16 one; on the CPU, dequantizing
a 16K-token fp8 batch on the host took 431 ms against 45 ms for copying its stored bytes. This script writes
a real cache shard (eyrie.hidden.cache's format, the pipeline's H 576, sample lengths like ShareGPT replies,
final states that point into the draft vocabulary so positions are trained) and runs the same train_step
over the same batches three ways in one process:

    device batches      every batch built on the device beforehand: the step's compute alone (the ceiling)
    host dequant        the path before this change: rows dequantized to float on the host, padded, copied,
                        in line with the step (eyrie.hidden.cache.read_state_rows per sample)
    stored, ahead       HiddenCache.load copies the stored bytes (fp8 + scales) in a background thread while
                        the previous step computes (eyrie.core.ahead.loaded_ahead); to_device dequantizes there

It prints tok/s for each and the ratios against the ceiling and against the old path, for fp8 and bf16 caches.

    python benchmarks/train_input.py --out train_input.json                 # H200, ~1-2 min
    python benchmarks/train_input.py --small --steps 3 --out /tmp/ti.json   # CPU smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_throughput import PIPELINE, SMALL, VARIANTS, build, sync  # noqa: E402

from eyrie.core.ahead import loaded_ahead  # noqa: E402
from eyrie.core.batching import batches_by_tokens  # noqa: E402
from eyrie.hidden.cache import convert_cache, read_state_rows  # noqa: E402
from eyrie.training.inputs import HiddenCache, padded_batch  # noqa: E402
from eyrie.training.objective import train_step  # noqa: E402


def write_cache(path: Path, dims: dict, lengths: list[int], target_head, draft_ids, seed: int) -> None:
    """A bf16 cache shard of these sample lengths whose final states point at draft-vocabulary tokens."""
    g = torch.Generator().manual_seed(seed)
    H, T = dims["hidden"], sum(lengths)
    tokens = draft_ids.cpu()[torch.randint(0, draft_ids.numel(), (T,), generator=g)]
    row = target_head.cpu()[tokens].float()
    final = 10.0 * row / row.norm(dim=-1, keepdim=True) ** 2 + torch.randn(T, H, generator=g)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths), 0)
    mask = torch.ones(T, dtype=torch.int8)
    mask[offsets[:-1]] = 0
    tensors = {"aux_hidden": torch.randn(T, 3 * H, generator=g).to(torch.bfloat16), "final_hidden": final.to(torch.bfloat16),
               "input_ids": tokens.to(torch.int32), "loss_mask": mask, "offsets": offsets}
    manifest = {"format": "eyrie-hidden/1", "aux_layer_ids": [1, 15, 26], "capture_indices": [2, 16, 27], "num_hidden_layers": 30,
                "hidden_size": H, "target_model_fingerprint": "f" * 64, "template_sha256": "a" * 64, "dtype": "bfloat16",
                "samples": len(lengths), "tokens": T, "ids": [f"s{k}" for k in range(len(lengths))]}
    save_file(tensors, str(path), metadata={"manifest": json.dumps(manifest)})


def host_dequant(cache: HiddenCache, refs, device, dtype) -> dict:
    """The input path before HiddenCache.load: float rows on the host, padded, then one copy to the device."""
    ids, mask, lengths = cache.tokens(refs)
    B, L = ids.shape
    aux_w, final_w = cache.widths[refs[0][0]]
    aux, final = torch.zeros(B, L, aux_w, dtype=dtype), torch.zeros(B, L, final_w, dtype=dtype)
    for row, (s, a, n) in enumerate(refs):
        handle = cache._handles[s]
        aux[row, :n] = read_state_rows(handle, "aux_hidden", a, a + n, cache.fp8[s]).to(dtype)
        final[row, :n] = read_state_rows(handle, "final_hidden", a, a + n, cache.fp8[s]).to(dtype)
    return padded_batch(aux, final, ids, mask, lengths, device)


def run_steps(name: str, batches, objective, optimizer, head, draft_ids, t2d, device, *, warmup: int) -> dict:
    """Step times of train_step over `batches` (an iterator of device batches, built however the variant builds them)."""
    times, tokens = [], []
    sync(device)
    t0 = time.perf_counter()
    for i, batch in enumerate(batches):
        train_step(objective, optimizer, batch, target_lm_head=head, draft_ids=draft_ids, t2d=t2d, max_grad_norm=0.5,
                   use_bf16=torch.device(device).type == "cuda")
        sync(device)  # train_step's loss.item() syncs anyway; this puts the whole step in its own interval
        now = time.perf_counter()
        if i >= warmup:
            times.append(now - t0)
            tokens.append(batch["tokens"])
        t0 = now
    out = {"tokens_per_second": sum(tokens) / sum(times), "median_step_s": statistics.median(times), "steps": len(times)}
    print(f"  {name}: {out['tokens_per_second']:,.0f} tok/s, median step {out['median_step_s'] * 1000:.0f} ms over {len(times)} steps", flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="tiny shapes for a CPU smoke test")
    parser.add_argument("--batch-tokens", type=int, default=16384, help="train.batch_tokens (configs/h200.yaml: 16384)")
    parser.add_argument("--steps", type=int, default=24, help="batches in the cache (each variant runs them all)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dims = SMALL if args.small else PIPELINE
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    objective, optimizer, head, draft_ids, t2d = build(dims, VARIANTS["flex+chunked"], device, args.ttt_steps, args.seed)
    g = torch.Generator().manual_seed(args.seed)
    # ShareGPT replies: 60-1,000 tokens, most a few hundred (the H200 run: 22M tokens over 10,782 samples x 4 epochs).
    lengths, total = [], 0
    while total < args.steps * args.batch_tokens * 0.9:
        n = int(torch.randint(60, 1000, (1,), generator=g))
        lengths.append(n)
        total += n
    results = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "dims": dims, "samples": len(lengths), "tokens": total}
    with tempfile.TemporaryDirectory() as tmp:
        bf16_path, fp8_path = Path(tmp) / "bf16.safetensors", Path(tmp) / "fp8.safetensors"
        write_cache(bf16_path, dims, lengths, head, draft_ids, args.seed)
        convert_cache(bf16_path, fp8_path, "float8_e4m3fn")
        for label, path in (("fp8", fp8_path), ("bf16", bf16_path)):
            cache = HiddenCache([str(path)])
            samples, _, _ = cache.samples(10**9)
            batches = [[samples[k] for k in b] for b in batches_by_tokens([n for _, _, n in samples], args.batch_tokens)]
            print(f"{label} cache: {len(samples)} samples, {total:,} tokens, {len(batches)} batches of <= {args.batch_tokens}", flush=True)
            # Load every variant once before timing: the first touch of the file's pages is the disk's, not the path's.
            for refs in batches:
                cache.load(refs)
            on_device = [cache.batch(refs, device, dtype) for refs in batches]
            timed = {"device batches": iter(on_device)}
            timed["host dequant"] = (host_dequant(cache, refs, device, dtype) for refs in batches)
            runs = {}
            with contextlib.closing(loaded_ahead(cache.load, batches)) as loads:
                timed["stored, ahead"] = (cache.to_device(loaded, device, dtype) for loaded in loads)
                for name, stream in timed.items():
                    runs[name] = run_steps(f"{label} {name}", stream, objective, optimizer, head, draft_ids, t2d, device, warmup=args.warmup)
            del on_device
            ceiling, old, new = (runs[k]["tokens_per_second"] for k in ("device batches", "host dequant", "stored, ahead"))
            runs["stored_ahead_over_host_dequant"] = new / old
            runs["stored_ahead_over_ceiling"] = new / ceiling
            runs["host_dequant_over_ceiling"] = old / ceiling
            print(f"{label}: stored, ahead / host dequant = {new / old:.2f}x; of the ceiling: {new / ceiling:.1%} "
                  f"(was {old / ceiling:.1%})", flush=True)
            results[label] = runs
    Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
