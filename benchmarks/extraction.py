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

--tensor-parallel N: hidden.tensor_parallel over N GPUs instead, in phases (--phases, default both), each worker in its
own process so that no phase inherits another's GPU memory:
  8b   a random-weight Llama-3.1-8B-shaped target (fits one GPU), saved once as an HF directory, extracted through
       the package's own path (eyrie.target.model.load_model + eyrie.hidden.extract.extract_shard) by one process
       (TP 1) and by N torchrun ranks (TP N) over the same synthetic token shard. Checks the two caches: the same
       header and manifest byte for byte (content digest aside), the same token rows, states within bf16 rounding,
       and (unless --no-reference) no further from a float32 one-process extraction than the TP 1 cache is.
       Prints tok/s at TP 1 and TP N and their ratio.
  70b  a random-weight Llama-3.1-70B-shaped target, ~141 GB in bf16, more than one H200 holds: built straight onto the
       GPUs, each rank making only its shard (--init transformers: transformers' own from_pretrained with no
       checkpoint, its missing weights initialised on the rank's shard; --init meta: meta-device init, transformers'
       tp plan applied, to_empty on the GPU, then random values), so nothing is downloaded or written; then the
       same extract_shard. Prints tok/s and the ratio to the roofline of all the GPUs.
Here the roofline is GPUs x --peak-tflops (989, an H200's dense bf16 peak) / (2 x P); tok/s counts real (unpadded)
tokens over whole extract_shard calls (forward, device->host copies, file writes), the median of --repeats after one
warm-up, at the last --batch-tokens (default 16384); model loading is not timed.

GPU (2 x H200):  python benchmarks/extraction.py --tensor-parallel 2 --out tp_extraction.json
                 (--phases 8b or --phases 70b to split it over two calls; --workdir on a disk with ~40 GB free)
CPU smoke test:  python benchmarks/extraction.py --tensor-parallel 2 --small --out /tmp/tp_extraction.json
                 (tiny shapes; 2 gloo ranks, which needs a CPU build of torch; the figures mean nothing)
On a GPU machine without a package index that lacks PyYAML or xxhash (eyrie's cache writer imports them), carry their
wheels for its Python (`eyrie bundle` packs them; docs/CLUSTER.md) and put them on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from eyrie.hidden.extract import _batch_inputs, _to_device, extract_shard, plan_token_batches
from eyrie.target.aux_layers import default_aux_layer_ids
from eyrie.target.states import _base_model
from eyrie.tokens.shards import TOKENS_SCHEMA

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
# --tensor-parallel's Llama shapes (untied LM heads, as the real ones), by name for its worker processes
LLAMA_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
TP_SHAPES = {"llama8b": LLAMA_8B, "llama70b": LLAMA_70B, "tiny": TINY, "tiny_big": dict(TINY, num_hidden_layers=10)}  # tiny_big: --small's 70b


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON file for all figures (required)")
    parser.add_argument("--small", action="store_true", help="tiny model and shard (CPU smoke test)")
    parser.add_argument("--target", choices=sorted(TARGETS), default="llama-3.1-8b", help="the real target whose shape the random weights take")
    parser.add_argument("--device", default="auto", help="auto | cuda | cpu")
    parser.add_argument("--tokens", type=int, default=None, help="tokens in the synthetic shard (default 32768; 2048 with --small)")
    parser.add_argument("--batch-tokens", type=int, nargs="+", default=None, help="hidden.batch_tokens values (default 4096 16384; 256 1024 with --small)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per variant (median reported), after one warm-up")
    parser.add_argument("--variants", default="", help="comma-separated variant names (without @batch_tokens) to run, e.g. "
                        "extract_bf16+compiled,forward_last_only+compiled (default: all)")
    parser.add_argument("--matmul-size", type=int, default=None, help="n of the n^3 bf16 matmul (default 8192; 256 with --small)")
    parser.add_argument("--tmpdir", default=None, help="where the shard and caches are written (default: the system temp dir)")
    parser.add_argument("--compile", action="store_true", help="after the eager variants (hidden.compile false): extract_bf16 with "
                        "hidden.compile true (each decoder layer compiled in place), then forward_last_only on those layers, at the last --batch-tokens (+compiled)")
    parser.add_argument("--profile", action="store_true", help="after timing: where one forward_last_only and one extract_bf16 run at "
                        "the last --batch-tokens spend their GPU time (matrix products, attention, copies, the rest) against wall time (CUDA)")
    tp = parser.add_argument_group("--tensor-parallel N (see above)")
    tp.add_argument("--tensor-parallel", type=int, default=1, metavar="N", help="extraction over N ranks (GPUs) against one, in phases")
    tp.add_argument("--phases", nargs="+", choices=["8b", "70b"], default=["8b", "70b"])
    tp.add_argument("--init", choices=["transformers", "meta"], default="transformers", help="how the 70b phase builds its random shards")
    tp.add_argument("--no-reference", action="store_true", help="skip the float32 one-process extraction of the 8b phase")
    tp.add_argument("--model-dir", default=None, help="8b phase: an HF directory to use instead of saving a random one")
    tp.add_argument("--peak-tflops", type=float, default=989.0, help="one GPU's dense bf16 peak (H200 SXM: 989)")
    tp.add_argument("--workdir", default=None, help="where the checkpoint, shard and caches go (default: a new temp dir, removed after)")

    sub = parser.add_subparsers(dest="command")
    worker = sub.add_parser("worker", help="(internal, --tensor-parallel) one extraction: alone, or as one torchrun rank")
    worker.add_argument("--model-dir", dest="worker_model_dir", default=None)
    worker.add_argument("--random-shape", choices=sorted(TP_SHAPES), default=None)
    worker.add_argument("--worker-init", choices=["transformers", "meta"], default="transformers")
    worker.add_argument("--tokens-path", required=True)
    worker.add_argument("--cache", required=True)
    worker.add_argument("--model-dtype", default="bfloat16")
    worker.add_argument("--cache-dtype", default="bfloat16")
    worker.add_argument("--device", default="cuda")
    worker.add_argument("--worker-batch-tokens", type=int, required=True)
    worker.add_argument("--worker-repeats", type=int, default=3)
    worker.add_argument("--peak", type=float, default=989.0)
    worker.add_argument("--result", required=True)
    save = sub.add_parser("save", help="(internal, --tensor-parallel) save a random-weight target as an HF directory")
    save.add_argument("--shape", choices=sorted(TP_SHAPES), required=True)
    save.add_argument("--device", default="cuda")
    save.add_argument("--to", required=True)
    args = parser.parse_args(argv)
    if args.command is None and not args.out:
        parser.error("--out is required")
    return args


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


def median_phases(runs: list[dict]) -> dict:
    """Each phase's median over runs (extract_shard's timings: header, forwards, drain, digest, durable)."""
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]} if runs else {}


def disk_rate(directory: Path, nbytes: int, chunk: int = 256 << 20) -> dict:
    """What the disk under `directory` takes: nbytes written in chunks by two threads (os.pwrite, as the cache writer
    writes), then fdatasync. GB/s into the page cache, and to the device (writes + fdatasync), each over all nbytes."""
    import threading

    path = directory / "disk-probe.bin"
    data = memoryview(np.random.default_rng(0).integers(0, 256, chunk, dtype=np.uint8).tobytes())
    chunks = max(1, nbytes // chunk)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        os.ftruncate(fd, chunks * chunk)
        start = time.perf_counter()
        threads = [threading.Thread(target=lambda k=k: [os.pwrite(fd, data, i * chunk) for i in range(k, chunks, 2)]) for k in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        cached = time.perf_counter() - start
        os.fdatasync(fd)
        durable = time.perf_counter() - start
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return {"bytes": chunks * chunk, "page_cache_gb_s": chunks * chunk / cached / 1e9, "durable_gb_s": chunks * chunk / durable / 1e9}


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


def extract_run(model, shard: Path, workdir: Path, batch_tokens: int, dtype: str, aux_ids: list[int], compile: bool = False):
    out = workdir / f"cache-{dtype}-{batch_tokens}.safetensors"
    result = {}

    def run():
        out.unlink(missing_ok=True)  # each run writes a fresh file, as the pipeline does
        synchronize(next(model.parameters()).device)
        timings, start = {}, time.perf_counter()
        result["manifest"] = extract_shard(
            tokens_path=str(shard), out_path=str(out), model=model, model_fingerprint="synthetic",
            template_sha256=TEMPLATE, aux_layer_ids=aux_ids, batch_tokens=batch_tokens, dtype=dtype, compile=compile, progress=False,
            timings=timings,
        )
        # extract_shard's own time, without the deletion of the last run's file above (seconds for tens of GB)
        result.setdefault("call_s", []).append(time.perf_counter() - start)
        result.setdefault("timings", []).append(timings)

    return run, result, out


def main() -> int:
    args = parse_args()
    if args.command == "worker":
        tp_worker(args)
        return 0
    if args.command == "save":
        save_random(args)
        return 0
    if args.tensor_parallel > 1:
        return tensor_parallel(args)
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
        # The disk's own rate at a bf16 cache's size (8H+5 bytes a token): the ceiling on extraction to this disk.
        figures["disk"] = disk_rate(workdir, tokens * (8 * shape["hidden_size"] + 5))
        print(f"disk under {workdir}: {figures['disk']['page_cache_gb_s']:.2f} GB/s into the page cache, "
              f"{figures['disk']['durable_gb_s']:.2f} GB/s to the device (writes + fdatasync, {figures['disk']['bytes'] / 1e9:.2f} GB)", flush=True)
        variants = []
        for bt in batch_sizes:
            variants.append((f"forward_all_hidden@{bt}", lambda bt=bt: (forward_only(model, lengths, bt, device, True), None, None)))
            variants.append((f"forward_last_only@{bt}", lambda bt=bt: (forward_only(model, lengths, bt, device, False), None, None)))
            variants.append((f"extract_bf16@{bt}", lambda bt=bt: extract_run(model, shard, workdir, bt, "bfloat16", aux_ids)))
        variants.append((f"extract_fp8@{batch_sizes[-1]}", lambda: extract_run(model, shard, workdir, batch_sizes[-1], "float8_e4m3fn", aux_ids)))
        if args.compile:  # hidden.compile: the product compiles the layers in place (in its warm-up), the bare forward then runs them
            bt = batch_sizes[-1]
            variants.append((f"extract_bf16+compiled@{bt}", lambda bt=bt: extract_run(model, shard, workdir, bt, "bfloat16", aux_ids, compile=True)))
            variants.append((f"forward_last_only+compiled@{bt}", lambda bt=bt: (forward_only(model, lengths, bt, device, False), None, None)))
        if args.variants:
            wanted = set(args.variants.split(","))
            variants = [(name, make) for name, make in variants if name.rsplit("@", 1)[0] in wanted]
        for name, make in variants:
            try:
                run, result, out = make()
                seconds, times = median_seconds(run, device, args.repeats)
                entry = {"seconds": seconds, "times": times, "tokens_per_s": tokens / seconds}
                if result is not None:
                    entry["bytes_per_token"] = result["manifest"]["bytes_per_token"]
                    entry["file_bytes"] = result["manifest"]["file_bytes"]
                    entry["phases_s"] = median_phases(result["timings"][1:])  # the timed runs, not the warm-up
                    entry["extract_shard_s"] = statistics.median(result["call_s"][1:])
                    entry["extract_shard_tokens_per_s"] = tokens / entry["extract_shard_s"]
                    out.unlink(missing_ok=True)
                if device.type == "cuda":
                    entry["max_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
                figures["variants"][name] = entry
                print(f"{name}: {entry['tokens_per_s']:.0f} tok/s (runs {', '.join(f'{t:.3f}' for t in times)} s)"
                      + (f"; extract_shard alone {entry['extract_shard_s']:.3f} s, the file's time: "
                         f"{', '.join(f'{k} {v:.3f} s' for k, v in entry['phases_s'].items())}" if "phases_s" in entry else ""), flush=True)
            except Exception as exc:  # one failing variant must not cost the others
                figures["errors"][name] = repr(exc)
                print(f"{name}: FAILED", flush=True)
                traceback.print_exc()
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        if args.profile and device.type == "cuda":
            bt, compiled = batch_sizes[-1], "+compiled" if args.compile else ""  # the layers as the last variants left them
            figures["profile"] = {
                f"forward_last_only{compiled}@{bt}": profile_run(forward_only(model, lengths, bt, device, False), figures.get("matmul_flops"), params, tokens),
                f"extract_bf16{compiled}@{bt}": profile_run(extract_run(model, shard, workdir, bt, "bfloat16", aux_ids, compile=args.compile)[0], figures.get("matmul_flops"), params, tokens),
            }
            for name, entry in figures["profile"].items():
                print(f"profile {name}: wall {entry['wall_s']:.3f} s, GPU busy {entry['busy_s']:.3f} s; "
                      + ", ".join(f"{k} {v:.3f} s" for k, v in entry["by_kind_s"].items())
                      + f"; matrix products at {entry['matmul_share_of_peak']:.1%} of the measured matmul rate while they run", flush=True)
                for kernel, seconds in entry["top_kernels"][:8]:
                    print(f"    {seconds:8.4f} s  {kernel}", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    Path(args.out).write_text(json.dumps(figures, indent=2))
    print_table(figures, batch_sizes)
    return 0


KERNEL_KINDS = (  # kernel name patterns, first match wins
    ("matmul", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|matmul", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|softmax", re.I)),
    ("copies", re.compile(r"memcpy|memset|copy", re.I)),
)


def profile_run(run, matmul_flops: float | None, params: float, tokens: int) -> dict:
    """One run under torch.profiler: its wall time, the GPU's busy time by kind of kernel, the costliest kernels, and
    the rate the matrix products reach while they run (2 x params x tokens FLOPs over their own time)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    averages = prof.key_averages()
    kernels = [e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA]
    if not kernels:  # kernels not listed as device events: host ops that launch none directly carry no device time
        kernels = [e for e in averages if e.self_device_time_total > 0 and not e.key.startswith("aten::")]
    by_kernel = {e.key: e.self_device_time_total / 1e6 for e in kernels}
    by_kind = {kind: 0.0 for kind, _ in KERNEL_KINDS} | {"other": 0.0}
    for name, seconds in by_kernel.items():
        by_kind[next((kind for kind, pattern in KERNEL_KINDS if pattern.search(name)), "other")] += seconds
    matmul_rate = 2 * params * tokens / by_kind["matmul"] if by_kind["matmul"] else 0.0
    return {"wall_s": wall, "busy_s": sum(by_kind.values()), "by_kind_s": by_kind,
            "matmul_share_of_peak": matmul_rate / matmul_flops if matmul_flops else 0.0,
            "top_kernels": sorted(by_kernel.items(), key=lambda kv: -kv[1])[:15]}


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
    for name, entry in variants.items():
        phases = entry.get("phases_s")
        if phases and phases.get("forwards"):
            steady = figures["tokens"] / phases["forwards"]
            tail = sum(phases.get(k, 0.0) for k in ("drain", "digest", "durable"))
            whole = entry["extract_shard_tokens_per_s"]
            print(f"{name}: extract_shard alone {whole:.0f} tok/s" + (f" = {100 * whole / roofline:.1f}% of the roofline" if roofline else "")
                  + " (the run's time less the deletion of the previous run's file)")
            print(f"{name}: {steady:.0f} tok/s while the forwards run (writes they waited for included)"
                  + (f" = {100 * steady / roofline:.1f}% of the roofline" if roofline else "")
                  + f"; then {tail:.2f} s a shard to finish the file (writes {phases.get('drain', 0):.2f}, digest "
                  f"{phases.get('digest', 0):.2f}, fsync {phases.get('durable', 0):.2f}), whatever the shard's size")
    disk = figures.get("disk")
    if disk:
        ceiling = disk["durable_gb_s"] * 1e9 / (8 * figures["shape"]["hidden_size"] + 5)
        print(f"the disk's ceiling on a bf16 extraction: {ceiling:.0f} tok/s ({disk['durable_gb_s']:.2f} GB/s durable"
              + (f", {100 * ceiling / roofline:.1f}% of the roofline)" if roofline else ")"))
    for name, error in figures["errors"].items():
        print(f"{name:<28} FAILED: {error[:200]}")
    print("(a) = forward_all_hidden at the same batch_tokens; (b)/(a) is the extract_bf16 row's 'vs (a)'")


# --------------------------------------------------------------------------- --tensor-parallel N: its workers


def save_random(args) -> None:
    """A random-weight target made on the device (fast) and saved in bf16, with its config, as an HF directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(LlamaConfig(**TP_SHAPES[args.shape])).to(torch.bfloat16)
    model.save_pretrained(args.to)


def random_sharded_target(shape: dict, init: str, dtype: torch.dtype, device_type: str):
    """This rank's shard of a random-weight Llama, made on its device only (no checkpoint, nothing downloaded)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    world = int(os.environ.get("WORLD_SIZE", "1"))
    config = LlamaConfig(**shape)
    torch.manual_seed(0)  # the same stream on every rank: the replicated weights (norms) agree
    if init == "transformers":
        # from_pretrained with an empty state dict: every weight is missing and initialised on this rank's shard only.
        parallel = {"distributed_config": DistributedConfig(tp_size=world)} if world > 1 else {"device_map": device_type}
        return LlamaForCausalLM.from_pretrained(None, config=config, state_dict={}, dtype=dtype, **parallel).eval()

    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(device_type, local_rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(dtype)
    if world > 1:
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group("nccl" if device_type == "cuda" else "gloo")
        mesh = torch.distributed.device_mesh.init_device_mesh(device_type, (world,))
        if hasattr(model, "_resolve_parallel_plans"):  # transformers >= 5.2x: the plan from_pretrained applies, expanded
            tp_plan, _, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=world))
            apply_tensor_parallelism(model, mesh, tp_plan)
        else:  # transformers 5.17: it reads model.tp_plan itself
            apply_tensor_parallelism(model, mesh)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.fill_(1.0) if "norm" in name else local.normal_(0.0, config.initializer_range)
        # The rotary inverse frequencies are a non-persistent buffer: to_empty left them undefined.
        model.model.rotary_emb = type(model.model.rotary_emb)(config).to(device)
    return model.eval()


def tp_worker(args) -> None:
    """Extract the shard (warm-up + timed repeats) alone or as one torchrun rank; rank 0 writes the cache and the result."""
    from eyrie.target.model import load_model

    world = int(os.environ.get("WORLD_SIZE", "1"))
    t0 = time.perf_counter()
    if args.worker_model_dir:  # the package's own loading path, as the extract job runs it
        # A transformers-native family's directory (the benchmark's own random checkpoint or --model-dir): no custom code.
        model = load_model(args.worker_model_dir, dtype=args.model_dtype, device=args.device, tensor_parallel=world, trust_remote_code=False)
    else:
        model = random_sharded_target(TP_SHAPES[args.random_shape], args.worker_init, getattr(torch, args.model_dtype), args.device)
    device = next(model.parameters()).device
    rank = torch.distributed.get_rank() if world > 1 else 0
    cuda = device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(device)
        if world > 1:
            torch.distributed.barrier()

    sync()
    load_seconds = time.perf_counter() - t0
    aux_layer_ids = default_aux_layer_ids(model.config.num_hidden_layers)

    def extract(writes: bool):
        """One extract_shard call over the shard; writes False on every rank: the forwards and gathers alone, nothing leaves the device."""
        return extract_shard(tokens_path=args.tokens_path, out_path=args.cache, model=model, model_fingerprint="random", template_sha256=TEMPLATE,
                             aux_layer_ids=aux_layer_ids, batch_tokens=args.worker_batch_tokens, dtype=args.cache_dtype, progress=False, writes=writes)

    def median_of_repeats(run) -> float | None:
        times = []
        for attempt in range(args.worker_repeats + 1):  # the first is the warm-up
            sync()
            start = time.perf_counter()
            run()
            sync()
            if attempt:
                times.append(time.perf_counter() - start)
        return statistics.median(times) if times else None

    manifest = {}
    extract_s = median_of_repeats(lambda: manifest.update(extract(writes=rank == 0)))  # the extract job: rank 0 writes the cache
    forward_s = median_of_repeats(lambda: extract(writes=False)) if args.worker_repeats else None
    peak_gib = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    peaks = [None] * world
    if world > 1:
        torch.distributed.all_gather_object(peaks, peak_gib)
    else:
        peaks = [peak_gib]
    if rank == 0:
        params, all_params = matmul_params(model), sum(p.numel() for p in model.parameters())
        roofline = world * args.peak * 1e12 / (2 * params)
        tok_s = manifest["tokens"] / extract_s if extract_s else None
        forward_tok_s = manifest["tokens"] / forward_s if forward_s else None
        result = {
            "ranks": world, "device": torch.cuda.get_device_name(device) if cuda else "cpu", "model_dtype": args.model_dtype,
            "cache_dtype": args.cache_dtype, "tokens": manifest["tokens"], "batch_tokens": args.worker_batch_tokens,
            "matmul_params": params, "all_params": all_params, "weight_gib_bf16": all_params * 2 / 2**30, "load_seconds": load_seconds,
            "extract_seconds": extract_s, "tokens_per_s": tok_s, "forward_seconds": forward_s, "forward_tokens_per_s": forward_tok_s,
            "roofline_tokens_per_s": roofline, "roofline_ratio": tok_s / roofline if tok_s else None,
            "forward_roofline_ratio": forward_tok_s / roofline if forward_tok_s else None,
            "peak_memory_gib_per_rank": peaks, "gpu_memory_gib": torch.cuda.get_device_properties(device).total_memory / 2**30 if cuda else None,
        }
        Path(args.result).write_text(json.dumps(result, indent=1))
        if tok_s:
            print(f"[worker] {world} rank(s), {args.model_dtype}: {result['tokens']:,} tokens; extract_shard {tok_s:,.0f} tok/s "
                  f"({100 * result['roofline_ratio']:.1f}% of the roofline), forwards alone {forward_tok_s:,.0f} tok/s "
                  f"({100 * result['forward_roofline_ratio']:.1f}%); roofline {roofline:,.0f} tok/s ({world} x {args.peak:g} TFLOP/s, "
                  f"P = {params / 1e9:.2f}B); loaded in {load_seconds:.0f} s; peak memory per rank {peaks} GiB", flush=True)
    if world > 1:
        torch.distributed.destroy_process_group()



# --------------------------------------------------------------------------- --tensor-parallel N: its driver


def run(command: list[str]) -> None:
    from eyrie.core.torchrun import DISTRIBUTED_ENV

    print("$ " + " ".join(command), flush=True)
    subprocess.run(command, check=True, env={**os.environ, **DISTRIBUTED_ENV})


def run_worker(ranks: int, result: Path, **options) -> dict:
    """One worker: in this interpreter for one rank, under torchrun for several; returns its result."""
    launcher = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in options.items() if v is not None]
    run([*launcher, __file__, "worker", f"--result={result}", *flags])
    return json.loads(result.read_text())


def header(path: Path) -> bytes:
    """The safetensors header with the content digest blanked (it is the digest of the values)."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        head = f.read(size)
    return re.sub(rb'"eyrie_digest":"xxh3-128-tree:[0-9a-f]{32}"', b'"eyrie_digest":"xxh3-128:' + b"0" * 32 + b'"', head)


def row_error(x, y):
    """|x - y| relative to each row's largest |x|."""
    x, y = x.float(), y.float()
    return (x - y).abs() / x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-6)


def compare(single: Path, split: Path, reference: Path | None) -> dict:
    """The equality checks of the 8b phase (the CPU test's, tests/hidden/test_tensor_parallel.py)."""
    from safetensors import safe_open

    checks = {"same_header": header(single) == header(split), "same_size": single.stat().st_size == split.stat().st_size}
    with safe_open(str(single), "pt") as a, safe_open(str(split), "pt") as b:
        checks["same_token_rows"] = all(torch.equal(a.get_tensor(n), b.get_tensor(n)) for n in ("offsets", "input_ids", "loss_mask"))
        r = safe_open(str(reference), "pt") if reference else None
        for name in ("aux_hidden", "final_hidden"):
            x, y = a.get_tensor(name), b.get_tensor(name)
            error = row_error(x, y)
            figures = {"max_row_error": float(error.max()), "mean_row_error": float(error.mean()), "share_differing": float((x != y).float().mean())}
            if r is not None:
                truth = r.get_tensor(name)
                single_err, split_err = row_error(truth, x), row_error(truth, y)
                figures.update(single_vs_float32_max=float(single_err.max()), single_vs_float32_mean=float(single_err.mean()),
                               split_vs_float32_max=float(split_err.max()), split_vs_float32_mean=float(split_err.mean()))
                figures["as_close_to_float32"] = bool(split_err.mean() <= 1.25 * single_err.mean() and split_err.max() <= 1.5 * single_err.max())
            figures["within_bf16"] = figures["max_row_error"] <= 2**-4
            checks[name] = figures
    checks["equal"] = all(checks[k] for k in ("same_header", "same_size", "same_token_rows")) and all(
        checks[n]["within_bf16"] and checks[n].get("as_close_to_float32", True) for n in ("aux_hidden", "final_hidden"))
    return checks



def tensor_parallel(args) -> int:
    """--tensor-parallel N: the 8b and 70b phases (see above); rank 0's figures of every worker in --out."""
    for module, wheel in (("yaml", "PyYAML"), ("xxhash", "xxhash")):  # an offline machine may lack both; say so before minutes of setup
        try:
            __import__(module)
        except ImportError:
            raise SystemExit(f"{wheel} is missing (eyrie's cache writer imports {module}); see this file's docstring for a machine without a package index") from None
    device = "cpu" if args.small else "cuda"
    tokens = args.tokens or (2048 if args.small else 32768)
    batch_tokens = args.batch_tokens[-1] if args.batch_tokens else (256 if args.small else 16384)
    max_len = 256 if args.small else 2048
    shape_8b, shape_70b = ("tiny", "tiny_big") if args.small else ("llama8b", "llama70b")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="eyrie-tp-"))
    workdir.mkdir(parents=True, exist_ok=True)
    figures = {"torch": torch.__version__, "tokens": tokens, "batch_tokens": batch_tokens, "ranks": args.tensor_parallel, "phases": {}}
    print(f"torch {torch.__version__}; writing under {workdir}", flush=True)
    shard = workdir / "tokens.parquet"
    write_token_shard(shard, tokens, TP_SHAPES[shape_8b]["vocab_size"], max_len)
    common = dict(tokens_path=shard, device=device, worker_batch_tokens=batch_tokens, worker_repeats=args.repeats, peak=args.peak_tflops)
    try:
        if "8b" in args.phases:
            model_dir = Path(args.model_dir) if args.model_dir else workdir / "target-8b"
            if not args.model_dir and not (model_dir / "config.json").exists():
                t0 = time.perf_counter()
                run([sys.executable, __file__, "save", f"--shape={shape_8b}", f"--device={device}", f"--to={model_dir}"])
                print(f"random {shape_8b} target saved in {time.perf_counter() - t0:.0f} s", flush=True)
            one = run_worker(1, workdir / "tp1.json", model_dir=model_dir, cache=workdir / "tp1.safetensors", **common)
            two = run_worker(args.tensor_parallel, workdir / "tp2.json", model_dir=model_dir, cache=workdir / "tp2.safetensors", **common)
            reference = None
            if not args.no_reference:
                run_worker(1, workdir / "f32.json", model_dir=model_dir, cache=workdir / "f32.safetensors", model_dtype="float32",
                           cache_dtype="float32", **{**common, "worker_repeats": 0})
                reference = workdir / "f32.safetensors"
            checks = compare(workdir / "tp1.safetensors", workdir / "tp2.safetensors", reference)
            figures["phases"]["8b"] = {"tp1": one, "tp2": two, "speedup": two["tokens_per_s"] / one["tokens_per_s"],
                                       "forward_speedup": two["forward_tokens_per_s"] / one["forward_tokens_per_s"], "equality": checks}
            print(f"8b: extract_shard TP 1 {one['tokens_per_s']:,.0f} tok/s, TP {args.tensor_parallel} {two['tokens_per_s']:,.0f} tok/s "
                  f"(x{figures['phases']['8b']['speedup']:.2f}); forwards alone {one['forward_tokens_per_s']:,.0f} -> "
                  f"{two['forward_tokens_per_s']:,.0f} tok/s (x{figures['phases']['8b']['forward_speedup']:.2f}); "
                  f"caches equal within bf16: {checks['equal']}", flush=True)
            print(json.dumps(checks, indent=1), flush=True)
        if "70b" in args.phases:
            big = run_worker(args.tensor_parallel, workdir / "big.json", random_shape=shape_70b, worker_init=args.init, cache=workdir / "big.safetensors", **common)
            figures["phases"]["70b"] = big
            fits = big["gpu_memory_gib"] is not None and big["weight_gib_bf16"] < big["gpu_memory_gib"]
            print(f"70b: {big['all_params'] / 1e9:.1f}B parameters ({big['weight_gib_bf16']:.0f} GiB in bf16"
                  + (f" against one GPU's {big['gpu_memory_gib']:.0f} GiB: {'fits' if fits else 'does not fit'} one GPU" if big["gpu_memory_gib"] else "")
                  + f"); extract_shard {big['tokens_per_s']:,.0f} tok/s on {args.tensor_parallel} ranks = {100 * big['roofline_ratio']:.1f}% of the "
                  f"roofline ({big['roofline_tokens_per_s']:,.0f} tok/s), forwards alone {big['forward_tokens_per_s']:,.0f} tok/s = "
                  f"{100 * big['forward_roofline_ratio']:.1f}%", flush=True)
    finally:
        Path(args.out).write_text(json.dumps(figures, indent=1, default=str))
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"figures in {args.out}", flush=True)
    return 0



if __name__ == "__main__":
    sys.exit(main())
