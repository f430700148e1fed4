"""Where a speculative round's time goes, piece by piece: a greedy step, a chain round and tree rounds under torch.profiler.

    python benchmarks/round_profile.py --trees 6,8,32 6,10,48            # on a GPU: random weights, the default target's shape
    python benchmarks/round_profile.py --small --trees 3,2,6 --no-compile  # CPU smoke test

The engine is eyrie's static decoder, compiled as `bench.compile` fuses it, but with CUDA graphs off so that each
kernel shows up on its own: every decoder's step runs several times untimed (compilation), then --rounds steps are
profiled. Each compiled piece (the target's layer pieces, the drafter's pieces, a tree's frontier step, selection and
accept) and the target's attention (its cache writes and SDPA) run inside a named range, and the table gives, per range
and per step, the kernels launched and their summed device time; the remaining eager work (the drafter's cache writes,
buffer updates) is the row "outside the ranges". Inside a CUDA graph a step costs about its kernels' device time plus a
small gap per kernel, so the kernel counts and device times say which piece a shorter round has to come from.
Without CUDA the device columns are empty and the CPU time of each range is shown instead.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
from collections import defaultdict

import torch
from decode_floor import SMALL, SMOLLM2, TOP_K_WAYS, random_drafter, use_top_k

from eyrie.decoding.static import StaticLlama
from eyrie.decoding.static_drafter import StaticEagle3
from eyrie.decoding.static_tree import StaticTree
from eyrie.decoding.tree import TreeShape

WARMUPS = 3  # untimed steps first: each piece compiles on its first call


def labelled(method, label):
    """method, run inside the profiler range `label` (the range's kernels are that piece's)."""

    @functools.wraps(method)
    def run(*args, **kwargs):
        with torch.profiler.record_function(label):
            return method(*args, **kwargs)

    return run


@contextlib.contextmanager
def ranges(engine: StaticLlama):
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
    """Per range (and 'whole step'): kernels and device microseconds per step, CPU microseconds per step."""
    for _ in range(WARMUPS):
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
    return dict(found)


def kernels_under(event) -> list:
    """Kernels (profiler Kernel records: name, device, duration in us) launched by `event` and every CPU op under it."""
    return list(getattr(event, "kernels", [])) + [kernel for child in event.cpu_children for kernel in kernels_under(child)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=20, help="steps profiled per decoder")
    parser.add_argument("--chain", type=int, default=4, help="chain length k (0: none)")
    parser.add_argument("--trees", type=lambda text: tuple(int(v) for v in text.split(",")), nargs="*", default=[(6, 8, 32)], metavar="S,K,N")
    parser.add_argument("--draft-vocab", type=int, default=32000, help="the random drafter's draft vocabulary (the pipeline's: 32000)")
    parser.add_argument("--top-k", choices=sorted(TOP_K_WAYS), help="the tree rounds' top-K, in place of eyrie's default")
    parser.add_argument("--kernels", type=int, default=0, help="print each range's N costliest kernels (name, count and us per step)")
    parser.add_argument("--small", action="store_true", help="a tiny random Llama (CPU smoke test)")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="eager pieces (CPU smoke test)")
    args = parser.parse_args()
    if args.top_k:
        use_top_k(args.top_k)

    from transformers import LlamaConfig, LlamaForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**(SMALL if args.small else SMOLLM2))).to(device=device, dtype=getattr(torch, args.dtype)).eval()
    engine = StaticLlama(model, capacity=512, cuda_graphs=False, compile=args.compile)
    prompt = torch.randint(0, model.config.vocab_size, (args.prompt_tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    eagle = engine.drafter_for(random_drafter(model, args.draft_vocab))
    span = 256
    steps = {"greedy step": engine.step_function(functools.partial(engine._greedy_step, span))}
    with torch.inference_mode():
        if args.chain:
            chain = eagle._rounds_for(args.chain)
            eagle.start(prompt, chain)
            steps[f"chain {args.chain} round"] = engine.step_function(functools.partial(chain._round, span))
        for shape in args.trees:
            tree = StaticTree(eagle, TreeShape(*shape))
            eagle.start(prompt, tree)
            steps[f"tree {shape} round"] = engine.step_function(functools.partial(tree._round, span))
        # Each step keeps decoding from where the last left off; positions stay well inside the first span.
        results = {}
        with ranges(engine):
            for label, step in steps.items():
                engine.position.fill_(args.prompt_tokens)
                results[label] = profile_steps(step, args.rounds)

    print(f"device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, {args.dtype}, compile {args.compile}, "
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


if __name__ == "__main__":
    main()
