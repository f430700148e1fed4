"""TTT flex attention alone at the pipeline's drafter shape: forward and forward + backward per call.

A training profile at H 576 (32 rows x 512 tokens, docs/PERFORMANCE.md) put flex attention's forward at 3.3 ms a
call against 0.78 ms for its backward. This times eyrie.training.ttt_attention's call (the compiled flex
attention over the concatenated key blocks with the cached TTT BlockMask) under compile settings side by side:

    python benchmarks/ttt_flex.py --rows 32 --length 512 --blocks 1 7        # H200, ~2 min
    python benchmarks/ttt_flex.py --small                                    # CPU smoke test (forward only)

Variants: dynamic=True (the code), dynamic=False (one compile per shape), and dynamic=False with the rows (batch
dimension) marked dynamic: one compile per sequence length and block count, whatever the rows.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from eyrie.training.ttt_attention import ttt_block_mask

# The fifteenth session's H200 call (32 x 512, ms forward / forward + backward): dynamic 1.39 / 1.78 over one key block
# and 6.40 / 7.80 over seven; static 1.00 / 1.44 and 3.60 / 4.58. A 64 x 64 tile variant ran 13-53 ms (it did not take
# the compiled kernel) and is gone. Static compiles once per length and block count; rows dynamic only would not.
VARIANTS = {
    "dynamic (the code)": dict(dynamic=True, rows_dynamic=False),
    "static": dict(dynamic=False, rows_dynamic=False),
    "static, rows dynamic": dict(dynamic=False, rows_dynamic=True),
}


def time_calls(fn, repeats: int, cuda: bool) -> float:
    """Median seconds of fn() over repeats calls, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 7], help="key blocks (TTT step j + 1)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.small
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    B, L = (2, 64) if args.small else (args.rows, args.length)
    heads, kv_heads, head_dim = 9, 3, 64
    from torch.nn.attention.flex_attention import flex_attention

    results = {}
    for name, variant in VARIANTS.items():
        compiled = torch.compile(flex_attention, dynamic=variant["dynamic"]) if cuda else flex_attention
        for blocks in args.blocks:
            g = torch.Generator(device=device).manual_seed(blocks)
            q = torch.randn(B, heads, L, head_dim, device=device, dtype=dtype, generator=g, requires_grad=cuda)
            k = torch.randn(B, kv_heads, blocks * L, head_dim, device=device, dtype=dtype, generator=g, requires_grad=cuda)
            v = torch.randn(B, kv_heads, blocks * L, head_dim, device=device, dtype=dtype, generator=g, requires_grad=cuda)
            mask = ttt_block_mask(L, blocks, device)
            if variant["rows_dynamic"]:
                for tensor in (q, k, v):
                    torch._dynamo.mark_dynamic(tensor, 0)

            def forward():
                with torch.no_grad():
                    return compiled(q, k, v, block_mask=mask, scale=head_dim**-0.5, enable_gqa=True)

            def both():
                out = compiled(q, k, v, block_mask=mask, scale=head_dim**-0.5, enable_gqa=True)
                out.sum().backward()

            try:
                t0 = time.perf_counter()
                fwd = time_calls(forward, args.repeats, cuda)
                full = time_calls(both, args.repeats, cuda) if cuda else float("nan")  # flex has no CPU backward
                row = {"forward_ms": fwd * 1e3, "forward_backward_ms": full * 1e3, "with_compile_s": time.perf_counter() - t0}
            except Exception as exc:  # noqa: BLE001 -- one variant failing must not cost the others
                row = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            results[f"{name} | {blocks} blocks"] = row
            print(f"{name:<24} {blocks} blocks: {row}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": B, "length": L, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
