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
                   (max-autotune-no-cudagraphs, as the benchmark's floor on CUDA: --floor-mode) and captured
                   as one CUDA graph: what a lean engine does per token at this shape;
  static           eyrie.decoding.static.StaticLlama, one CUDA graph per step (bench.decoder: static);
  static-compiled  the same with compile=True (each step fused by inductor, then captured).

Each prints ms/token (median of --repeats runs of --tokens tokens after a --prompt-token prefill) and
its ratio to the floor; the three must produce the same tokens in float32 (bf16 may drift at near-ties,
so there agreement up to the first divergence is printed instead). With --drafter-k K the static
decoders also run speculative rounds with a random drafter and print ms per round; --trees S,K,N ... times
SGLang-style tree rounds the same way (eyrie.decoding.static_tree).

--batches B ...: in place of the above, batched greedy, the chain (the random drafter at --drafter-k), each --trees
shape and prompt lookup decoding B prompts at once on the batched static engine (eyrie.decoding.batched_speculative, CUDA graphs per batch
width on a GPU): ms a greedy step, ms a round and the round in greedy steps (the acceptance a setting needs to break
even at that load), and whether the graphed rounds give the eager rounds' tokens.

    python benchmarks/decode_floor.py --dtypes bfloat16 --batches 1 4 16 64 --tokens 128 --drafter-k 4 --trees 6,10,48 --repeats 2

--compile-mode MODE: torch.compile's mode for the static decoder's pieces (bench.compile_mode: default or
max-autotune-no-cudagraphs); --floor-mode the floor's (default max-autotune-no-cudagraphs, as the benchmark's floor on
CUDA). Each row gives its build time (compiling, tuning and capturing); TORCHINDUCTOR_CACHE_DIR keeps the tuning.

--profile-round: where a round's time goes, piece by piece, instead of the timings above. A greedy step, a chain round
(--drafter-k) and tree rounds (--trees) run under torch.profiler on the static decoder, compiled as `bench.compile`
fuses it (--no-compile: eager), but with CUDA graphs off so that each kernel shows up on its own: every step runs
several times untimed (compilation), then --rounds steps are profiled. Each compiled piece (the target's layer pieces,
the drafter's pieces, a tree's frontier step, selection and accept) and the target's attention (its cache writes and
SDPA) run inside a named range, and the table gives, per range and per step, the kernels launched and their summed
device time; the remaining eager work (the drafter's cache writes, buffer updates) is the row "outside the ranges".
Inside a CUDA graph a step costs about its kernels' device time plus a small gap per kernel, so the kernel counts and
device times say which piece a shorter round has to come from. Without CUDA the device columns are empty and the CPU
time of each range is shown instead.

    python benchmarks/decode_floor.py --profile-round --dtypes bfloat16 --prompt-tokens 64 --trees 6,8,32 6,10,48 --kernels 8
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import time
from collections import defaultdict

import torch

from eyrie.bench.rounds import first_divergence
from eyrie.decoding.decode import greedy_decode, speculative_decode, tree_decode
from eyrie.decoding.floor import FloorDecoder
from eyrie.decoding.static import StaticLlama, open_engine
from eyrie.decoding.static_common import AUTOTUNED, COMPILE_MODES, needed_capacity
from eyrie.decoding.static_drafter import StaticEagle3
from eyrie.decoding.static_tree import StaticTree
from eyrie.decoding.topk import ranked_top_k, two_stage_top_k
from eyrie.decoding.tree import TreeShape

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30,
               vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
WARMUPS = 2  # untimed runs first: compilation, autotuning and graph capture happen in them
SMALL = dict(SMOLLM2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=8, vocab_size=512)
PROFILE_WARMUPS = 3  # --profile-round: untimed steps first, each piece compiles on its first call
PROFILE_CAPACITY, PROFILE_SPAN = 512, 256  # the profiled steps' cache; positions stay well inside the first span


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


def random_target(dtype_name: str, args):
    """(model, prompt): the random-weight target this run measures on this machine's device, and its random prompt."""
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
    return model, prompt


def run(dtype_name: str, args) -> list[dict]:
    model, prompt = random_target(dtype_name, args)
    device = model.device.type
    capacity = needed_capacity(len(prompt), args.tokens, args.drafter_k)
    graphs = device == "cuda"
    rows = []

    floor_tokens, floor_ms = None, float("nan")
    if args.target and type(model).__name__ != "LlamaForCausalLM":  # the fused floor is a Llama step: the memory floor instead
        floor_ms = memory_floor_ms(model, device)
        rows.append({"dtype": dtype_name, "decoder": "memory-floor", "ms_per_token": floor_ms, "ratio_to_floor": 1.0,
                     "first_divergence_from_floor": None, "capture_failures": []})
    elif args.floor:
        built = time.perf_counter()
        floor = FloorDecoder(model, capacity, compile=args.compile, graphs=graphs, mode=args.floor_mode)
        floor_runs = [floor.decode(prompt, args.tokens) for _ in range(args.repeats + WARMUPS)]
        build_seconds = time.perf_counter() - built - sum(s for _, s in floor_runs)
        floor_runs = floor_runs[WARMUPS:]
        floor_tokens = floor_runs[0][0]
        floor_ms = 1000 * statistics.median(s for _, s in floor_runs) / (args.tokens - 1)
        rows.append({"dtype": dtype_name, "decoder": "floor" + (("-compiled" if args.floor_mode == "default" else "-autotuned") if args.compile else ""), "ms_per_token": floor_ms,
                     "ratio_to_floor": 1.0, "first_divergence_from_floor": None, "capture_failures": floor.failures,
                     "build_seconds": build_seconds})

    for compile in [True] if args.compiled_only else ([False, True] if args.compile else [False]):
        built = time.perf_counter()
        engine = open_engine(model, capacity=capacity, cuda_graphs=graphs, compile=compile, compile_mode=args.compile_mode) if args.target else \
            StaticLlama(model, capacity=capacity, cuda_graphs=graphs, compile=compile, compile_mode=args.compile_mode)
        results = [greedy_decode(engine, prompt, args.tokens, set()) for _ in range(args.repeats + WARMUPS)]
        build_seconds = time.perf_counter() - built - sum(r.seconds for r in results)
        results = results[WARMUPS:]
        # greedy_decode times the prefill too: subtract a prefill-only run's time
        prefill = statistics.median(greedy_decode(engine, prompt, 1, set()).seconds for _ in range(3))
        ms = 1000 * (statistics.median(r.seconds for r in results) - prefill) / (args.tokens - 1)
        row = {"dtype": dtype_name, "decoder": engine.label, "ms_per_token": ms, "ratio_to_floor": ms / floor_ms,
               "first_divergence_from_floor": None if floor_tokens is None else first_divergence(results[0].tokens, floor_tokens),
               "capture_failures": engine.capture_failures, "build_seconds": build_seconds}
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


def run_batches(dtype_name: str, args) -> list[dict]:
    """--batches: batched greedy, the chain (a random drafter at --drafter-k), each --trees shape and prompt lookup at
    each B on the batched static engine, CUDA graphs per batch width on a GPU: ms per greedy step, ms per round and the
    round in greedy steps (the acceptance a setting needs to break even), and whether the graphed rounds give the eager
    rounds' tokens."""
    from eyrie.bench.concurrency import decoders_for, settings_of
    from eyrie.decoding.batched_greedy import open_batched_greedy
    from eyrie.decoding.graphs import free_unused_graphs
    from eyrie.decoding.tree import TreeShape

    model, prompt = random_target(dtype_name, args)
    drafter = random_drafter(model, args.draft_vocab)
    graphs = model.device.type == "cuda"
    settings = settings_of(max(args.drafter_k, 1), [TreeShape(*t) for t in args.trees], ngram=True)
    rows = []
    for batch in args.batches:
        g = torch.Generator().manual_seed(batch)
        prompts = [torch.randint(0, model.config.vocab_size, (args.prompt_tokens // 2 + (7 * i) % args.prompt_tokens,), generator=g).tolist()
                   for i in range(batch)]
        engine = open_batched_greedy(model, 0, set(), rows=batch, cuda_graphs=graphs)
        started = time.perf_counter()
        decoders = decoders_for(engine, drafter, settings, prompts, args.tokens)
        prepare_s = time.perf_counter() - started  # every setting's round graphs captured: the benchmark pays this per B
        sync = torch.cuda.synchronize if graphs else (lambda: None)
        engine.generate(prompts, args.tokens)
        times = []
        for _ in range(args.repeats):
            sync()
            start = time.perf_counter()
            engine.generate(prompts, args.tokens)
            sync()
            times.append(time.perf_counter() - start)
        step_ms = 1000 * statistics.median(times) / args.tokens
        row = {"dtype": dtype_name, "batch": batch, "rows": engine.rows, "greedy_ms_per_step": step_ms, "capture_failures": engine.capture_failures,
               "prepare_seconds": prepare_s, "settings": {}}
        eager = open_batched_greedy(model, 0, set(), rows=batch, cuda_graphs=False)
        for setting, decoder in zip(settings, decoders):
            decoder.generate(prompts, 8, set(), setting["steps"])
            runs = [decoder.generate(prompts, args.tokens, set(), setting["steps"]) for _ in range(args.repeats)]
            best = min(runs, key=lambda r: r.seconds)
            reference = decoders_for(eager, drafter, [setting], prompts, args.tokens)[0].generate(prompts, args.tokens, set(), setting["steps"])
            row["settings"][setting["label"]] = {"ms_per_round": 1000 * best.seconds / best.rounds,
                                                 "round_in_greedy_steps": best.seconds / best.rounds * 1000 / step_ms,
                                                 "graphs_match_eager": best.tokens == reference.tokens}
        rows.append(row)
        print(f"{dtype_name:9} B {batch:3}  greedy {step_ms:7.3f} ms/step (rounds captured in {prepare_s:.1f} s);  " + ";  ".join(
              f"{label} {r['ms_per_round']:.3f} ms/round = {r['round_in_greedy_steps']:.2f} steps{'' if r['graphs_match_eager'] else ' (GRAPHS DIFFER FROM EAGER)'}"
              for label, r in row["settings"].items())
              + (f"  CAPTURE FAILED: {engine.capture_failures[:1]}" if engine.capture_failures else "")
              + (f"  (peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB)" if graphs else ""), flush=True)
        del engine, eager, decoders
        free_unused_graphs()
    return rows


def labelled(method, label):
    """method, run inside the profiler range `label` (the range's kernels are that piece's)."""

    @functools.wraps(method)
    def run(*args, **kwargs):
        with torch.profiler.record_function(label):
            return method(*args, **kwargs)

    return run


@contextlib.contextmanager
def ranges(engine):
    """Name the pieces of every step: the target's layer pieces and attention, the drafter's and the trees' pieces."""
    saved = []

    def wrap(owner, name, label):
        saved.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, labelled(getattr(owner, name), label))

    for name in ("_project", "_finish", "_attend", "_head", "_fused_project", "_fused_finish", "_fused_head"):  # the fused ones run while fusing
        if hasattr(engine, name):
            wrap(engine, name, f"target {name.replace('_fused', '').strip('_')}")
    original_piece = StaticEagle3.piece
    StaticEagle3.piece = lambda self, name, *args, owner=None: labelled(original_piece, f"piece {name}")(self, name, *args, owner=owner)
    try:
        yield
    finally:
        StaticEagle3.piece = original_piece
        for owner, name, value in saved:
            if value is None:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


def profile_steps(step, steps: int) -> dict[str, dict]:
    """Per range (and 'whole step'): kernels and device microseconds per step, CPU microseconds per step, and per kernel
    name its [launches, device microseconds] per step."""
    for _ in range(PROFILE_WARMUPS):
        step()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            with torch.profiler.record_function("whole step"):
                step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    found = defaultdict(lambda: {"kernels": 0.0, "device_us": 0.0, "cpu_us": 0.0, "by_kernel": defaultdict(lambda: [0.0, 0.0])})
    for event in prof.events():
        if event.name == "whole step" or event.name.startswith(("target ", "piece ")):
            row = found[event.name]
            row["cpu_us"] += event.cpu_time_total / steps
            kernels = kernels_under(event)
            row["kernels"] += len(kernels) / steps
            row["device_us"] += sum(kernel.duration for kernel in kernels) / steps  # busy time, not the range's span
            for kernel in kernels:
                row["by_kernel"][kernel.name][0] += 1 / steps
                row["by_kernel"][kernel.name][1] += kernel.duration / steps
    return {name: {**row, "by_kernel": dict(row["by_kernel"])} for name, row in found.items()}


def kernels_under(event) -> list:
    """Kernels (profiler Kernel records: name, device, duration in us) launched by `event` and every CPU op under it."""
    return list(getattr(event, "kernels", [])) + [kernel for child in event.cpu_children for kernel in kernels_under(child)]


def profile_round(dtype_name: str, args) -> dict[str, dict]:
    """--profile-round: per step label (greedy step, chain round, each tree's round), profile_steps' ranges."""
    model, prompt = random_target(dtype_name, args)
    opened = open_engine if args.target else StaticLlama
    engine = opened(model, capacity=PROFILE_CAPACITY, cuda_graphs=False, compile=args.compile, compile_mode=args.compile_mode)
    eagle = engine.drafter_for(random_drafter(model, args.draft_vocab))
    steps = {"greedy step": engine.step_function(functools.partial(engine._greedy_step, PROFILE_SPAN))}
    with torch.inference_mode():
        if args.drafter_k:
            chain = eagle._rounds_for(args.drafter_k)
            eagle.start(prompt, chain)
            steps[f"chain {args.drafter_k} round"] = engine.step_function(functools.partial(chain._round, PROFILE_SPAN))
        for shape in args.trees:
            tree = StaticTree(eagle, TreeShape(*shape))
            eagle.start(prompt, tree)
            steps[f"tree {shape} round"] = engine.step_function(functools.partial(tree._round, PROFILE_SPAN))
        results = {}
        with ranges(engine):
            for label, step in steps.items():  # each step keeps decoding from where the last left off
                engine.position.fill_(len(prompt))
                results[label] = profile_steps(step, args.rounds)
    return results


def profile_batched_rounds(dtype_name: str, args) -> dict[str, dict]:
    """--profile-round with --batches: each setting's batched round at each B (an engine of exactly B rows, eager), its
    drafting, the target's verify and a tree's path move as ranges (profile_steps)."""
    from eyrie.bench.concurrency import decoders_for, settings_of
    from eyrie.decoding.batched_greedy import open_batched_greedy
    from eyrie.decoding.tree import TreeShape

    model, prompt = random_target(dtype_name, args)
    drafter = random_drafter(model, args.draft_vocab)
    settings = settings_of(max(args.drafter_k, 1), [TreeShape(*t) for t in args.trees], ngram=False)
    results = {}
    for batch in args.batches:
        engine = open_batched_greedy(model, 0, set(), rows=batch, cuda_graphs=False, row_step=1)
        prompts = [prompt] * batch
        engine.move_row_slots = labelled(engine.move_row_slots, "piece move path")
        for setting, decoder in zip(settings, decoders_for(engine, drafter, settings, prompts, args.tokens)):
            decoder.drafts.draft = labelled(decoder.drafts.draft, "piece draft")
            decoder._run = labelled(decoder._run, "target verify")
            with torch.inference_mode():
                decoder.generate(prompts, 2, set(), setting["steps"])  # buffers and state of a started decode
                pair = next(iter(decoder.rounds))
                results[f"B {batch}: {setting['label']} round"] = profile_steps(decoder.rounds[pair], args.rounds)
        del engine
    return results


def print_profile(dtype_name: str, results: dict[str, dict], args) -> None:
    print(f"device {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}, {dtype_name}, compile {args.compile}, "
          f"no CUDA graphs; per step: kernels, device us, CPU us")
    for label, found in results.items():
        whole = found.get("whole step", {"kernels": 0, "device_us": 0.0, "cpu_us": 0.0})
        print(f"\n{label}: {whole['kernels']:.0f} kernels, {whole['device_us']:.1f} us on the device, {whole['cpu_us']:.0f} us CPU")
        named = sorted(((k, v) for k, v in found.items() if k != "whole step"), key=lambda kv: (-kv[1]["device_us"], -kv[1]["cpu_us"]))
        inside = {"kernels": 0.0, "device_us": 0.0}
        for name, row in named:  # no range runs inside another, so they add up
            print(f"  {name:24} {row['kernels']:7.1f} {row['device_us']:9.1f} {row['cpu_us']:9.0f}")
            costliest = sorted(row["by_kernel"].items(), key=lambda item: -item[1][1])[: args.kernels]
            for kernel, (count, us) in costliest:
                print(f"      {count:5.1f} {us:8.1f}  {kernel[:100]}")
            inside["kernels"] += row["kernels"]
            inside["device_us"] += row["device_us"]
        print(f"  {'outside the ranges':24} {whole['kernels'] - inside['kernels']:7.1f} {whole['device_us'] - inside['device_us']:9.1f}")


def machine() -> dict:
    return {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__}


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
    parser.add_argument("--batches", type=int, nargs="*", default=[], help="in place of the timings above: batched greedy, the "
                        "chain and prompt lookup at each of these batch sizes (run_batches)")
    parser.add_argument("--small", action="store_true", help="a tiny random Llama (CPU smoke test)")
    parser.add_argument("--target", choices=["llama-3.1-8b", "qwen3-8b", "qwen3-30b-a3b", "gpt-oss-20b"],
                        help="a real target's shape (random weights) on eyrie.decoding.static.open_engine; a non-Llama target "
                             "is measured against the memory floor (memory_floor_ms), not the fused Llama floor")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="skip the compiled variants (CPU smoke test)")
    parser.add_argument("--no-floor", dest="floor", action="store_false", help="skip the floor (an engine-against-engine comparison)")
    parser.add_argument("--compiled-only", action="store_true", help="time only the compiled static decoder")
    parser.add_argument("--compile-mode", choices=COMPILE_MODES, default="default", help="torch.compile's mode for the static "
                        "decoder's pieces (bench.compile_mode)")
    parser.add_argument("--floor-mode", choices=COMPILE_MODES, default=AUTOTUNED, help="torch.compile's mode for the floor "
                        "(default: autotuned, as the benchmark's floor on CUDA)")
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--against", help="rows an earlier run wrote with --out (e.g. the previous engine's source on PYTHONPATH, "
                                          "in the same call): print this run's ms over that one's, row by row")
    parser.add_argument("--top-k", choices=sorted(TOP_K_WAYS), help="the tree rounds' top-K over the draft vocabulary, in "
                        "place of eyrie's default (eyrie.decoding.topk): run once per way, --out then --against, to compare them")
    parser.add_argument("--profile-round", action="store_true", help="where a round's time goes, range by range, in place of the "
                        "timings (see above); --drafter-k is the chain profiled, --trees the trees; --out writes the ranges; with --batches: each "
                        "setting's batched round at each B (drafting, the target's verify, a tree's path move)")
    parser.add_argument("--rounds", type=int, default=20, help="--profile-round: steps profiled per decoder")
    parser.add_argument("--kernels", type=int, default=0, help="--profile-round: print each range's N costliest kernels "
                        "(name, count and us per step)")
    args = parser.parse_args()
    if args.top_k:
        use_top_k(args.top_k)
    if args.profile_round:  # batched rounds at each B of --batches, else batch 1's steps and rounds
        profiled = profile_batched_rounds if args.batches else profile_round
        profiles = {}
        for dtype in args.dtypes:
            profiles[dtype] = profiled(dtype, args)
            print_profile(dtype, profiles[dtype], args)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({**machine(), "batches": args.batches, "compile": args.compile, "profiles": profiles}, f, indent=1)
        return
    if args.batches:
        rows = [row for dtype in args.dtypes for row in run_batches(dtype, args)]
        if args.out:
            with open(args.out, "w") as f:
                json.dump({**machine(), "batches": rows}, f, indent=1)
        return
    rows = [row for dtype in args.dtypes for row in run(dtype, args)]
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**machine(), "rows": rows}, f, indent=1)
    print(f"{'dtype':9} {'decoder':28} {'ms/token':>9} {'x floor':>8} {'diverges at':>11} {'ms/round':>9} {'round/step':>10}")
    for r in rows:
        print(f"{r['dtype']:9} {r['decoder']:28} {r['ms_per_token']:9.3f} {r['ratio_to_floor']:8.2f} {r['first_divergence_from_floor']!s:>11} "
              f"{r.get('ms_per_round', float('nan')):9.3f} {r.get('round_in_greedy_steps', float('nan')):10.2f}"
              + (f"  lossless {r['spec_lossless']}" if "spec_lossless" in r else "")
              + f"  built in {r.get('build_seconds', float('nan')):.0f} s"
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
