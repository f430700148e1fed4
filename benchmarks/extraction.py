"""Hidden-state extraction speed against the matmul roofline, on a random-weight Llama-3.1-8B-shaped target.

Variants, each over the same synthetic token shard and measured side by side in this process:
  forward_all_hidden  the decoder forward with output_hidden_states=True (all 33 states kept): the compute floor
                      of the original approach, nothing leaves the device
  forward_last_only   the decoder forward returning only last_hidden_state: the compute floor of any approach
  extract_bf16        eyrie.hidden.extract.extract_shard (hooks, device->host copies, file writes), bfloat16 cache
  extract_fp8         the same with hidden.dtype float8_e4m3fn
each at several hidden.batch_tokens. Roofline tokens/s = measured bf16 matmul FLOP/s / (2 x P), P = the
parameters of the decoder layers and the final norm (no embedding table, no LM head: extraction does a
lookup in the one and never computes the other); attention's score/value FLOPs are left out of P.

For a mixture-of-experts target P counts the ACTIVE parameters per token: the routed experts' weights times
experts_per_token / experts (every other layer weight, the router's included, in full).

GPU (H200):  python benchmarks/extraction.py --out extraction.json
             python benchmarks/extraction.py --target qwen3-30b-a3b --out extraction_qwen3_moe.json
CPU smoke:   python benchmarks/extraction.py --small --out /tmp/extraction.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from eyrie.tokens.shards import TOKENS_SCHEMA
from eyrie.hidden.extract import _batch_inputs, _to_device, extract_shard, plan_token_batches
from eyrie.target.aux_layers import default_aux_layer_ids
from eyrie.target.states import _base_model

TEMPLATE = "0" * 64  # the synthetic shard's template fingerprint; extract_shard only checks that it matches
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
# Real targets' shapes, from their published config.json (random weights: speed does not depend on them).
QWEN3_8B = dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
                rms_norm_eps=1e-6, tie_word_embeddings=False)
QWEN3_30B_A3B = dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                     num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                     rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
GPT_OSS_20B = dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
                   num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
                   layer_types=["sliding_attention", "full_attention"] * 12, attention_bias=True, swiglu_limit=7.0,
                   vocab_size=201088, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
                   rope_theta=150000.0, rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                                      "truncate": False, "original_max_position_embeddings": 4096})
TARGETS = {"llama-3.1-8b": dict(LLAMA_8B, model_type="llama"), "qwen3-8b": QWEN3_8B, "qwen3-30b-a3b": QWEN3_30B_A3B, "gpt-oss-20b": GPT_OSS_20B}
TINY = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1000, max_position_embeddings=2048)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file for all figures")
    parser.add_argument("--small", action="store_true", help="tiny model and shard (CPU smoke test)")
    parser.add_argument("--target", choices=sorted(TARGETS), default="llama-3.1-8b", help="the real target whose shape the random weights take")
    parser.add_argument("--device", default="auto", help="auto | cuda | cpu")
    parser.add_argument("--tokens", type=int, default=None, help="tokens in the synthetic shard (default 32768; 2048 with --small)")
    parser.add_argument("--batch-tokens", type=int, nargs="+", default=None, help="hidden.batch_tokens values (default 4096 16384; 256 1024 with --small)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per variant (median reported), after one warm-up")
    parser.add_argument("--matmul-size", type=int, default=None, help="n of the n^3 bf16 matmul (default 8192; 256 with --small)")
    parser.add_argument("--tmpdir", default=None, help="where the shard and caches are written (default: the system temp dir)")
    return parser.parse_args()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def build_target(shape: dict, device: torch.device, dtype: torch.dtype):
    """Random weights, created directly on the device in dtype (no slow CPU init of 8B parameters)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(shape)
    model_type = fields.pop("model_type", "llama")
    # Llama in sdpa as before; the others in the attention transformers picks for them, as eyrie's load_model leaves it
    config = AutoConfig.for_model(model_type, **fields, **({"attn_implementation": "sdpa"} if model_type == "llama" else {}))
    with torch.device(device):
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        except TypeError:  # transformers versions that still call it torch_dtype
            model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    return model.to(device=device, dtype=dtype).eval()


def matmul_params(model) -> int:
    """Parameters that take part in a matrix product per token: decoder layers and the final norm."""
    base = _base_model(model)
    return sum(p.numel() for p in base.layers.parameters()) + sum(p.numel() for p in base.norm.parameters())


def active_matmul_params(model) -> float:
    """matmul_params with each routed expert's weights counted at experts_per_token / experts: what one token multiplies."""
    config = model.config
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if not experts:
        return float(matmul_params(model))
    share = config.num_experts_per_tok / experts
    base = _base_model(model)
    routed = sum(p.numel() for name, p in base.layers.named_parameters() if ".experts." in f".{name}")
    return matmul_params(model) - routed + share * routed


def median_seconds(run, device: torch.device, repeats: int) -> tuple[float, list[float]]:
    run()  # warm-up: kernel choice, allocator, pinned-memory pool, page cache
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def matmul_flops(n: int, device: torch.device, dtype: torch.dtype, repeats: int = 10) -> float:
    """Measured FLOP/s of one n x n x n product (CUDA events on GPU)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            a @ b
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
        else:
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times)


def write_token_shard(path: Path, total_tokens: int, vocab: int, max_len: int, seed: int = 0) -> list[int]:
    """A token shard in the tokenize stage's layout (TOKENS_SCHEMA + eyrie metadata); returns the sample lengths."""
    rng = np.random.default_rng(seed)
    lengths, rows = [], []
    while sum(lengths) < total_tokens:
        n = int(min(rng.integers(max_len // 8, max_len + 1), total_tokens - sum(lengths)))
        ids = rng.integers(0, vocab, n).astype(np.int32).tolist()
        mask = [0] * (n // 3) + [1] * (n - n // 3)  # a prompt, then the reply
        rows.append({"id": f"s{len(rows)}", "dataset": "synthetic", "input_ids": ids, "loss_mask": mask,
                     "n_tokens": n, "n_assistant_tokens": sum(mask), "truncated": False})
        lengths.append(n)
    meta = {"dataset": "synthetic", "shard": path.stem, "template_sha256": TEMPLATE, "max_seq_len": max_len, "stats": {}}
    table = pa.Table.from_pylist(rows, schema=TOKENS_SCHEMA).replace_schema_metadata({b"eyrie": json.dumps(meta).encode()})
    pq.write_table(table, path)
    return lengths


def forward_only(model, lengths: list[int], batch_tokens: int, device: torch.device, all_hidden: bool):
    """The decoder forward over the shard's batches (same batching and padding as extract_shard), nothing copied out."""
    base = _base_model(model)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    ids = torch.randint(0, model.config.vocab_size, (int(offsets[-1]),), dtype=torch.int32)
    batches = plan_token_batches(lengths, batch_tokens)

    def run():
        with torch.inference_mode():
            for batch in batches:
                x, _, _ = _batch_inputs(batch, np.asarray(lengths), offsets, ids)
                out = base(input_ids=_to_device(x, device), output_hidden_states=all_hidden, use_cache=False, return_dict=True)
                del out

    return run


def extract_run(model, shard: Path, workdir: Path, batch_tokens: int, dtype: str, aux_ids: list[int]):
    out = workdir / f"cache-{dtype}-{batch_tokens}.safetensors"
    result = {}

    def run():
        out.unlink(missing_ok=True)  # each run writes a fresh file, as the pipeline does
        result["manifest"] = extract_shard(
            tokens_path=str(shard), out_path=str(out), model=model, model_fingerprint="synthetic",
            template_sha256=TEMPLATE, aux_layer_ids=aux_ids, batch_tokens=batch_tokens, dtype=dtype, progress=False,
        )

    return run, result, out


def main() -> None:
    args = parse_args()
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else ("cpu" if args.device == "auto" else args.device))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # CPU bf16 matmuls are emulated: not a roofline
    shape = TINY if args.small else TARGETS[args.target]
    tokens = args.tokens or (2048 if args.small else 32768)
    batch_sizes = args.batch_tokens or ([256, 1024] if args.small else [4096, 16384])
    matmul_n = args.matmul_size or (256 if args.small else 8192)
    max_len = 256 if args.small else 2048
    print(f"torch {torch.__version__}, device {device_name(device)}, dtype {dtype}", flush=True)

    figures = {"torch": torch.__version__, "device": device_name(device), "dtype": str(dtype), "shape": shape,
               "tokens": tokens, "batch_tokens": batch_sizes, "variants": {}, "errors": {}}
    try:
        figures["matmul_flops"] = matmul_flops(matmul_n, device, dtype)
        print(f"matmul {matmul_n}^3 {dtype}: {figures['matmul_flops'] / 1e12:.4g} TFLOP/s", flush=True)
    except Exception as exc:
        figures["errors"]["matmul"] = repr(exc)
        traceback.print_exc()

    t0 = time.perf_counter()
    model = build_target(shape, device, dtype)
    synchronize(device)
    params = active_matmul_params(model)
    figures.update(build_seconds=time.perf_counter() - t0, matmul_params=params, decoder_params=matmul_params(model),
                   all_params=sum(p.numel() for p in model.parameters()), target=None if args.small else args.target,
                   attn_implementation=getattr(model.config, "_attn_implementation", None),
                   experts_implementation=getattr(model.config, "_experts_implementation", None))
    if "matmul_flops" in figures:
        figures["roofline_tokens_per_s"] = figures["matmul_flops"] / (2 * params)
    print(f"target built in {figures['build_seconds']:.1f}s: {params / 1e6:.1f}M active decoder+norm parameters per token "
          f"(all {figures['decoder_params'] / 1e6:.1f}M; attention {figures['attn_implementation']}, experts {figures['experts_implementation']}) "
          f"(of {figures['all_params'] / 1e6:.1f}M; embeddings and LM head left out of the roofline)", flush=True)
    aux_ids = default_aux_layer_ids(shape["num_hidden_layers"])

    workdir = Path(tempfile.mkdtemp(prefix="eyrie-extraction-", dir=args.tmpdir))
    print(f"writing under {workdir}", flush=True)
    try:
        shard = workdir / "tokens.parquet"
        lengths = write_token_shard(shard, tokens, shape["vocab_size"], max_len)
        figures["samples"] = len(lengths)
        variants = []
        for bt in batch_sizes:
            variants.append((f"forward_all_hidden@{bt}", lambda bt=bt: (forward_only(model, lengths, bt, device, True), None, None)))
            variants.append((f"forward_last_only@{bt}", lambda bt=bt: (forward_only(model, lengths, bt, device, False), None, None)))
            variants.append((f"extract_bf16@{bt}", lambda bt=bt: extract_run(model, shard, workdir, bt, "bfloat16", aux_ids)))
        variants.append((f"extract_fp8@{batch_sizes[-1]}", lambda: extract_run(model, shard, workdir, batch_sizes[-1], "float8_e4m3fn", aux_ids)))
        for name, make in variants:
            try:
                run, result, out = make()
                seconds, times = median_seconds(run, device, args.repeats)
                entry = {"seconds": seconds, "times": times, "tokens_per_s": tokens / seconds}
                if result is not None:
                    entry["bytes_per_token"] = result["manifest"]["bytes_per_token"]
                    entry["file_bytes"] = result["manifest"]["file_bytes"]
                    out.unlink(missing_ok=True)
                if device.type == "cuda":
                    entry["max_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
                figures["variants"][name] = entry
                print(f"{name}: {entry['tokens_per_s']:.0f} tok/s (runs {', '.join(f'{t:.3f}' for t in times)} s)", flush=True)
            except Exception as exc:  # one failing variant must not cost the others
                figures["errors"][name] = repr(exc)
                print(f"{name}: FAILED", flush=True)
                traceback.print_exc()
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    Path(args.out).write_text(json.dumps(figures, indent=2))
    print_table(figures, batch_sizes)


def print_table(figures: dict, batch_sizes: list[int]) -> None:
    roofline = figures.get("roofline_tokens_per_s")
    variants = figures["variants"]
    print()
    if roofline:
        print(f"roofline {roofline:.0f} tok/s = {figures['matmul_flops'] / 1e12:.4g} TFLOP/s / (2 x {figures['matmul_params'] / 1e6:.1f}M active params per token)")
    print(f"{'variant':<28}{'tok/s':>10}{'% roofline':>12}{'vs (a)':>8}{'B/token':>10}")
    for name, entry in variants.items():
        bt = name.rsplit("@", 1)[1]
        floor = variants.get(f"forward_all_hidden@{bt}", {}).get("tokens_per_s")
        share = f"{100 * entry['tokens_per_s'] / roofline:.1f}%" if roofline else "n/a"
        ratio = f"{entry['tokens_per_s'] / floor:.2f}" if floor else "n/a"
        size = f"{entry['bytes_per_token']:.0f}" if "bytes_per_token" in entry else ""
        print(f"{name:<28}{entry['tokens_per_s']:>10.0f}{share:>12}{ratio:>8}{size:>10}")
    for name, error in figures["errors"].items():
        print(f"{name:<28} FAILED: {error[:200]}")
    print("(a) = forward_all_hidden at the same batch_tokens; (b)/(a) is the extract_bf16 row's 'vs (a)'")


if __name__ == "__main__":
    main()
