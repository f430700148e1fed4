"""How far eyrie's static decoder is from the hardware's floor, side by side in one process.

    python benchmarks/decode_floor.py --dtypes bfloat16 float32 --tokens 256      # on a GPU
    python benchmarks/decode_floor.py --small --tokens 16 --no-compile           # CPU smoke test

Two engines side by side in one call (an earlier commit's src/ unpacked in /tmp/base):

    PYTHONPATH=/tmp/base/src python benchmarks/decode_floor.py --no-floor --compiled-only --out base.json ...
    PYTHONPATH=src python benchmarks/decode_floor.py --no-floor --compiled-only --against base.json ...

Two top-K ways of the tree rounds the same way: `--top-k two-stage --out a.json`, then `--top-k ranked --against a.json`.

The target is a random-weight model of the default target's shape (SmolLM2-135M: hidden 576, 30 layers,
9 heads / 3 KV heads, vocab 49152; `--small` shrinks it). Three greedy decoders run on the same weights:

  floor            a minimal static-KV-cache Llama step written here (one attention over the whole cache,
                   no spans, no hidden-state capture) whose whole step is fused by torch.compile
                   (inductor's default mode, as the static decoder's compile option) and captured as one
                   CUDA graph: what a lean engine does per token at this shape;
  static           eyrie.decoding.static.StaticLlama, one CUDA graph per step (bench.decoder: static);
  static-compiled  the same with compile=True (each step fused by inductor, then captured).

Each prints ms/token (median of --repeats runs of --tokens tokens after a --prompt-token prefill) and
its ratio to the floor; the three must produce the same tokens in float32 (bf16 may drift at near-ties,
so there agreement up to the first divergence is printed instead). With --drafter-k K the static
decoders also run speculative rounds with a random drafter and print ms per round; --trees S,K,N ... times
SGLang-style tree rounds the same way (eyrie.decoding.static_tree).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from eyrie.bench.rounds import first_divergence
from eyrie.decoding.decode import greedy_decode, speculative_decode, tree_decode
from eyrie.decoding.floor import FloorDecoder
from eyrie.decoding.static import StaticLlama, open_engine
from eyrie.decoding.static_common import needed_capacity
from eyrie.decoding.topk import ranked_top_k, two_stage_top_k

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30,
               vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
WARMUPS = 2  # untimed runs first: compilation, autotuning and graph capture happen in them
SMALL = dict(SMOLLM2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=8, vocab_size=512)


TOP_K_WAYS = {"torch": lambda values, k: values.topk(k, dim=-1), "two-stage": two_stage_top_k, "ranked": ranked_top_k}


def use_top_k(way: str) -> None:
    """The tree rounds' top-K over the draft vocabulary becomes TOP_K_WAYS[way] (StaticEagle3._top looks it up at call time)."""
    import eyrie.decoding.static_drafter

    eyrie.decoding.static_drafter.top_k = TOP_K_WAYS[way]


def random_drafter(model, k_vocab: int = 32000):  # the pipeline's draft vocabulary (draft_vocab_size)
    from eyrie.drafter.model import DrafterShape, Eagle3Drafter
    from eyrie.target.aux_layers import default_aux_layer_ids

    config = model.config
    shape = DrafterShape.from_target(config, min(k_vocab, config.vocab_size), default_aux_layer_ids(config.num_hidden_layers))
    embed = model.get_input_embeddings().weight.detach()
    d2t = torch.zeros(shape.draft_vocab_size, dtype=torch.long)
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[: shape.draft_vocab_size] = True
    drafter = Eagle3Drafter(shape, embed.float().cpu(), d2t, t2d)
    return drafter.to(device=model.device, dtype=model.dtype).eval()


def memory_floor_ms(model, device) -> float:
    """The least one batch-1 token costs: reading its weights once (decoder and norm, routed experts at experts_per_token /
    experts, the LM head) at the device's measured copy bandwidth (a 1 GiB device-to-device copy, read + write)."""
    from extraction import active_matmul_params

    a = torch.empty(2**30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    bandwidth = 2 * a.numel() / statistics.median(times)
    weight_bytes = model.dtype.itemsize * (active_matmul_params(model) + model.get_output_embeddings().weight.numel())
    return 1000 * weight_bytes / bandwidth


def run(dtype_name: str, args) -> list[dict]:
    from transformers import LlamaConfig, LlamaForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    if args.target:  # a real target's shape (extraction.py's configs), on the static engine that runs its family
        from extraction import TARGETS, build_target

        model = build_target(TARGETS[args.target], torch.device(device), dtype)
    else:
        model = LlamaForCausalLM(LlamaConfig(**(SMALL if args.small else SMOLLM2))).to(device=device, dtype=dtype).eval()
    prompt = torch.randint(0, model.config.vocab_size, (args.prompt_tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    capacity = needed_capacity(len(prompt), args.tokens, args.drafter_k)
    graphs = device == "cuda"
    rows = []

    floor_tokens, floor_ms = None, float("nan")
    if args.target and type(model).__name__ != "LlamaForCausalLM":  # the fused floor is a Llama step: the memory floor instead
        floor_ms = memory_floor_ms(model, device)
        rows.append({"dtype": dtype_name, "decoder": "memory-floor", "ms_per_token": floor_ms, "ratio_to_floor": 1.0,
                     "first_divergence_from_floor": None, "capture_failures": []})
    elif args.floor:
        floor = FloorDecoder(model, capacity, compile=args.compile, graphs=graphs)
        floor_runs = [floor.decode(prompt, args.tokens) for _ in range(args.repeats + WARMUPS)][WARMUPS:]
        floor_tokens = floor_runs[0][0]
        floor_ms = 1000 * statistics.median(s for _, s in floor_runs) / (args.tokens - 1)
        rows.append({"dtype": dtype_name, "decoder": "floor" + ("-compiled" if args.compile else ""), "ms_per_token": floor_ms,
                     "ratio_to_floor": 1.0, "first_divergence_from_floor": None, "capture_failures": floor.failures})

    for compile in [True] if args.compiled_only else ([False, True] if args.compile else [False]):
        engine = open_engine(model, capacity=capacity, cuda_graphs=graphs, compile=compile) if args.target else \
            StaticLlama(model, capacity=capacity, cuda_graphs=graphs, compile=compile)
        results = [greedy_decode(engine, prompt, args.tokens, set()) for _ in range(args.repeats + WARMUPS)][WARMUPS:]
        # greedy_decode times the prefill too: subtract a prefill-only run's time
        prefill = statistics.median(greedy_decode(engine, prompt, 1, set()).seconds for _ in range(3))
        ms = 1000 * (statistics.median(r.seconds for r in results) - prefill) / (args.tokens - 1)
        row = {"dtype": dtype_name, "decoder": engine.label, "ms_per_token": ms, "ratio_to_floor": ms / floor_ms,
               "first_divergence_from_floor": None if floor_tokens is None else first_divergence(results[0].tokens, floor_tokens),
               "capture_failures": engine.capture_failures}
        if args.drafter_k:
            drafter = random_drafter(model, args.draft_vocab)
            spec = [speculative_decode(engine, drafter, prompt, args.tokens, set(), args.drafter_k) for _ in range(args.repeats + WARMUPS)][WARMUPS:]
            best = min(spec, key=lambda r: r.seconds)
            row["ms_per_round"] = 1000 * (best.seconds - prefill) / best.rounds
            row["round_in_greedy_steps"] = row["ms_per_round"] / ms
            row["spec_lossless"] = best.tokens == results[0].tokens
        for steps, topk, draft_tokens in args.trees:  # what one tree round costs, in greedy steps
            drafter = drafter if args.drafter_k else random_drafter(model, args.draft_vocab)
            runs = [tree_decode(engine, drafter, prompt, args.tokens, set(), steps, topk, draft_tokens) for _ in range(args.repeats + WARMUPS)][WARMUPS:]
            best = min(runs, key=lambda r: r.seconds)
            row.setdefault("trees", []).append({"steps": steps, "topk": topk, "draft_tokens": draft_tokens,
                                                "ms_per_round": 1000 * (best.seconds - prefill) / best.rounds,
                                                "round_in_greedy_steps": 1000 * (best.seconds - prefill) / best.rounds / ms,
                                                "lossless": best.tokens == results[0].tokens})
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--draft-vocab", type=int, default=32000, help="the random drafter's draft vocabulary (the pipeline's "
                        "32000; at 4096 PyTorch's top-K takes another path)")
    parser.add_argument("--drafter-k", type=int, default=4, help="speculative rounds of this chain length with a random drafter (0: none)")
    parser.add_argument("--trees", type=lambda text: tuple(int(v) for v in text.split(",")), nargs="*", default=[],
                        metavar="S,K,N", help="also time tree rounds of these SGLang (steps, topk, draft tokens), e.g. 5,4,8 8,10,64")
    parser.add_argument("--small", action="store_true", help="a tiny random Llama (CPU smoke test)")
    parser.add_argument("--target", choices=["llama-3.1-8b", "qwen3-8b", "qwen3-30b-a3b", "gpt-oss-20b"],
                        help="a real target's shape (random weights) on eyrie.decoding.static.open_engine; a non-Llama target "
                             "is measured against the memory floor (memory_floor_ms), not the fused Llama floor")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="skip the compiled variants (CPU smoke test)")
    parser.add_argument("--no-floor", dest="floor", action="store_false", help="skip the floor (an engine-against-engine comparison)")
    parser.add_argument("--compiled-only", action="store_true", help="time only the compiled static decoder")
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--against", help="rows an earlier run wrote with --out (e.g. the previous engine's source on PYTHONPATH, "
                                          "in the same call): print this run's ms over that one's, row by row")
    parser.add_argument("--top-k", choices=sorted(TOP_K_WAYS), help="the tree rounds' top-K over the draft vocabulary, in "
                        "place of eyrie's default (eyrie.decoding.topk): run once per way, --out then --against, to compare them")
    args = parser.parse_args()
    if args.top_k:
        use_top_k(args.top_k)
    rows = [row for dtype in args.dtypes for row in run(dtype, args)]
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__, "rows": rows}, f, indent=1)
    print(f"{'dtype':9} {'decoder':28} {'ms/token':>9} {'x floor':>8} {'diverges at':>11} {'ms/round':>9} {'round/step':>10}")
    for r in rows:
        print(f"{r['dtype']:9} {r['decoder']:28} {r['ms_per_token']:9.3f} {r['ratio_to_floor']:8.2f} {str(r['first_divergence_from_floor']):>11} "
              f"{r.get('ms_per_round', float('nan')):9.3f} {r.get('round_in_greedy_steps', float('nan')):10.2f}"
              + (f"  lossless {r['spec_lossless']}" if "spec_lossless" in r else "")
              + ("" if not r["capture_failures"] else f"  CAPTURE FAILED: {r['capture_failures'][:1]}"))
        for t in r.get("trees", []):
            print(f"{'':9} {'  tree ' + str((t['steps'], t['topk'], t['draft_tokens'])):28} {'':9} {'':8} {'':11} "
                  f"{t['ms_per_round']:9.3f} {t['round_in_greedy_steps']:10.2f}  lossless {t['lossless']}")
    if args.against:
        with open(args.against) as f:
            print_against(rows, json.load(f)["rows"])


def print_against(rows: list[dict], base_rows: list[dict]) -> None:
    """Each timing of `rows` over the same timing in `base_rows` (same dtype and decoder; trees by shape)."""
    base = {(r["dtype"], r["decoder"]): r for r in base_rows}
    print("\nthis run over --against, ms (ratio < 1: faster now)")
    for r in rows:
        b = base.get((r["dtype"], r["decoder"]))
        if b is None:
            continue
        pairs = [("greedy token", r["ms_per_token"], b["ms_per_token"])]
        if "ms_per_round" in r and "ms_per_round" in b:
            pairs.append(("chain round", r["ms_per_round"], b["ms_per_round"]))
        base_trees = {(t["steps"], t["topk"], t["draft_tokens"]): t for t in b.get("trees", [])}
        for t in r.get("trees", []):
            shape = (t["steps"], t["topk"], t["draft_tokens"])
            if shape in base_trees:
                pairs.append((f"tree {shape}", t["ms_per_round"], base_trees[shape]["ms_per_round"]))
        for label, now, then in pairs:
            print(f"{r['dtype']:9} {r['decoder']:22} {label:22} {then:8.3f} -> {now:8.3f} ms  x{now / then:.3f}")


if __name__ == "__main__":
    main()
