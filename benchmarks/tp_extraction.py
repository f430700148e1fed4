"""Tensor-parallel hidden-state extraction (hidden.tensor_parallel) on two GPUs: equality with one GPU, tok/s, roofline.

Phases (--phases, default both), each worker in its own process so no phase inherits another's GPU memory:
  8b   a random-weight Llama-3.1-8B-shaped target (fits one GPU), saved once as an HF directory, extracted through
       the package's own path (eyrie.target.model.load_model + eyrie.hidden.extract.extract_shard) by one process
       (TP 1) and by two torchrun ranks (TP 2) over the same synthetic token shard. Checks the two caches: the same
       header and manifest byte for byte (content digest aside), the same token rows, states within bf16 rounding,
       and (unless --no-reference) no further from a float32 one-process extraction than the TP 1 cache is.
       Prints tok/s at TP 1 and TP 2 and their ratio.
  70b  a random-weight Llama-3.1-70B-shaped target, ~141 GB in bf16, more than one H200 holds: built straight onto the
       two GPUs, each rank making only its shard (--init transformers: transformers' own from_pretrained with no
       checkpoint, its missing weights initialised on the rank's shard; --init meta: meta-device init, transformers'
       tp plan applied, to_empty on the GPU, then random values), so nothing is downloaded or written; then the
       same extract_shard. Prints tok/s and the ratio to the roofline of both GPUs.
Roofline tok/s = GPUs x --peak-tflops (989, an H200's dense bf16 peak) / (2 x P), P = the parameters of the decoder
layers and the final norm (extraction looks the embeddings up and never computes the LM head; attention's score
FLOPs are left out). tok/s counts real (unpadded) tokens over whole extract_shard calls (forward, device->host
copies, file writes), the median of --repeats after one warm-up; model loading is not timed.

GPU (2 x H200):  python benchmarks/tp_extraction.py --out tp_extraction.json
                 (--phases 8b or --phases 70b to split it over two calls; --workdir on a disk with ~40 GB free)
CPU smoke test:  python benchmarks/tp_extraction.py --small --out /tmp/tp_extraction.json
                 (a tiny shape; 2 gloo ranks, which needs a CPU build of torch; the figures mean nothing)
On a 2-GPU machine without a package index (torch 2.11, transformers 5.17, no PyYAML or xxhash, which eyrie's cache
writer imports): carry their Python 3.12 wheels, made on a CPU machine with
  pip download --no-deps -d .device/tp --python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64 PyYAML==6.0.4 xxhash==4.1.0
and run (one call per phase, where calls are limited to 10 minutes)
  pip install -q --no-index --no-deps --target /tmp/tpsite .device/tp/*.whl && \
  PYTHONPATH=src:/tmp/tpsite python3 benchmarks/tp_extraction.py --phases 8b --out $OUT/tp_8b.json
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
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

TEMPLATE = "0" * 64  # the synthetic shard's template fingerprint; extract_shard only checks that it matches
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                tie_word_embeddings=False)
LLAMA_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                 tie_word_embeddings=False)
TINY = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1000, max_position_embeddings=2048, tie_word_embeddings=False)
TINY_BIG = dict(TINY, num_hidden_layers=10)  # the --small stand-in for the 70B shape
SHAPES = {"llama8b": LLAMA_8B, "llama70b": LLAMA_70B, "tiny": TINY, "tiny_big": TINY_BIG}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    parser.add_argument("--out", help="JSON file for all figures")
    parser.add_argument("--small", action="store_true", help="tiny shapes and shard (CPU smoke test)")
    parser.add_argument("--phases", nargs="+", choices=["8b", "70b"], default=["8b", "70b"])
    parser.add_argument("--ranks", type=int, default=2, help="tensor-parallel ranks (GPUs)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens in the synthetic shard (default 32768; 2048 with --small)")
    parser.add_argument("--batch-tokens", type=int, default=None, help="hidden.batch_tokens (default 16384; 256 with --small)")
    parser.add_argument("--repeats", type=int, default=3, help="timed extract_shard calls per worker (median reported), after one warm-up")
    parser.add_argument("--init", choices=["transformers", "meta"], default="transformers", help="how the 70B phase builds its random shards")
    parser.add_argument("--no-reference", action="store_true", help="skip the float32 one-process extraction of the 8b phase")
    parser.add_argument("--model-dir", default=None, help="8b phase: an HF directory to use instead of saving a random one")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="one GPU's dense bf16 peak (H200 SXM: 989)")
    parser.add_argument("--workdir", default=None, help="where the checkpoint, shard and caches go (default: a new temp dir, removed after)")

    worker = sub.add_parser("worker", help="(internal) one extraction: alone, or as one torchrun rank")
    worker.add_argument("--model-dir", dest="worker_model_dir", default=None)
    worker.add_argument("--random-shape", choices=sorted(SHAPES), default=None)
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

    save = sub.add_parser("save", help="(internal) save a random-weight target as an HF directory")
    save.add_argument("--shape", choices=sorted(SHAPES), required=True)
    save.add_argument("--device", default="cuda")
    save.add_argument("--to", required=True)
    return parser.parse_args(argv)


# --------------------------------------------------------------------------- helpers shared by driver and workers


def matmul_params(model) -> int:
    """Parameters that take part in a matrix product per token: the decoder layers and the final norm (global counts)."""
    return sum(p.numel() for name, p in model.named_parameters() if ".layers." in name or name.endswith("model.norm.weight"))


def write_token_shard(path: Path, total_tokens: int, vocab: int, max_len: int, seed: int = 0) -> None:
    """A token shard in the tokenize stage's layout (TOKENS_SCHEMA + eyrie metadata)."""
    from eyrie.tokens.shards import TOKENS_SCHEMA

    rng = np.random.default_rng(seed)
    rows, done = [], 0
    while done < total_tokens:
        n = int(min(rng.integers(max_len // 8, max_len + 1), total_tokens - done))
        mask = [0] * (n // 3) + [1] * (n - n // 3)  # a prompt, then the reply
        rows.append({"id": f"s{len(rows)}", "dataset": "synthetic", "input_ids": rng.integers(0, vocab, n).astype(np.int32).tolist(),
                     "loss_mask": mask, "n_tokens": n, "n_assistant_tokens": sum(mask), "truncated": False})
        done += n
    meta = {"dataset": "synthetic", "shard": path.stem, "template_sha256": TEMPLATE, "max_seq_len": max_len, "stats": {}}
    pq.write_table(pa.Table.from_pylist(rows, schema=TOKENS_SCHEMA).replace_schema_metadata({b"eyrie": json.dumps(meta).encode()}), path)


# --------------------------------------------------------------------------- workers


def save_random(args) -> None:
    """A random-weight target made on the device (fast) and saved in bf16, with its config, as an HF directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(LlamaConfig(**SHAPES[args.shape])).to(torch.bfloat16)
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


def worker(args) -> None:
    """Extract the shard (warm-up + timed repeats) alone or as one torchrun rank; rank 0 writes the cache and the result."""
    from eyrie.hidden.extract import extract_shard
    from eyrie.target.aux_layers import default_aux_layer_ids
    from eyrie.target.model import load_model

    world = int(os.environ.get("WORLD_SIZE", "1"))
    t0 = time.perf_counter()
    if args.worker_model_dir:  # the package's own loading path, as the extract job runs it
        model = load_model(args.worker_model_dir, dtype=args.model_dtype, device=args.device, tensor_parallel=world)
    else:
        model = random_sharded_target(SHAPES[args.random_shape], args.worker_init, getattr(torch, args.model_dtype), args.device)
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

    def median_seconds(run) -> float | None:
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
    extract_s = median_seconds(lambda: manifest.update(extract(writes=rank == 0)))  # the extract job: rank 0 writes the cache
    forward_s = median_seconds(lambda: extract(writes=False)) if args.worker_repeats else None
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


# --------------------------------------------------------------------------- driver


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
    return re.sub(rb'"eyrie_digest":"xxh3-128:[0-9a-f]{32}"', b'"eyrie_digest":"xxh3-128:' + b"0" * 32 + b'"', head)


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


def main() -> int:
    args = parse_args()
    if args.command == "worker":
        worker(args)
        return 0
    if args.command == "save":
        save_random(args)
        return 0
    if not args.out:
        raise SystemExit("--out is required")
    for module, wheel in (("yaml", "PyYAML"), ("xxhash", "xxhash")):  # an offline machine may lack both; say so before minutes of setup
        try:
            __import__(module)
        except ImportError:
            raise SystemExit(f"{wheel} is missing (eyrie's cache writer imports {module}); see this file's docstring for an offline machine") from None
    device = "cpu" if args.small else "cuda"
    tokens = args.tokens or (2048 if args.small else 32768)
    batch_tokens = args.batch_tokens or (256 if args.small else 16384)
    max_len = 256 if args.small else 2048
    shape_8b, shape_70b = ("tiny", "tiny_big") if args.small else ("llama8b", "llama70b")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="eyrie-tp-"))
    workdir.mkdir(parents=True, exist_ok=True)
    figures = {"torch": torch.__version__, "tokens": tokens, "batch_tokens": batch_tokens, "ranks": args.ranks, "phases": {}}
    print(f"torch {torch.__version__}; writing under {workdir}", flush=True)
    shard = workdir / "tokens.parquet"
    write_token_shard(shard, tokens, SHAPES[shape_8b]["vocab_size"], max_len)
    common = dict(tokens_path=shard, device=device, worker_batch_tokens=batch_tokens, worker_repeats=args.repeats, peak=args.peak_tflops)
    try:
        if "8b" in args.phases:
            model_dir = Path(args.model_dir) if args.model_dir else workdir / "target-8b"
            if not args.model_dir and not (model_dir / "config.json").exists():
                t0 = time.perf_counter()
                run([sys.executable, __file__, "save", f"--shape={shape_8b}", f"--device={device}", f"--to={model_dir}"])
                print(f"random {shape_8b} target saved in {time.perf_counter() - t0:.0f} s", flush=True)
            one = run_worker(1, workdir / "tp1.json", model_dir=model_dir, cache=workdir / "tp1.safetensors", **common)
            two = run_worker(args.ranks, workdir / "tp2.json", model_dir=model_dir, cache=workdir / "tp2.safetensors", **common)
            reference = None
            if not args.no_reference:
                run_worker(1, workdir / "f32.json", model_dir=model_dir, cache=workdir / "f32.safetensors", model_dtype="float32",
                           cache_dtype="float32", **{**common, "worker_repeats": 0})
                reference = workdir / "f32.safetensors"
            checks = compare(workdir / "tp1.safetensors", workdir / "tp2.safetensors", reference)
            figures["phases"]["8b"] = {"tp1": one, "tp2": two, "speedup": two["tokens_per_s"] / one["tokens_per_s"],
                                       "forward_speedup": two["forward_tokens_per_s"] / one["forward_tokens_per_s"], "equality": checks}
            print(f"8b: extract_shard TP 1 {one['tokens_per_s']:,.0f} tok/s, TP {args.ranks} {two['tokens_per_s']:,.0f} tok/s "
                  f"(x{figures['phases']['8b']['speedup']:.2f}); forwards alone {one['forward_tokens_per_s']:,.0f} -> "
                  f"{two['forward_tokens_per_s']:,.0f} tok/s (x{figures['phases']['8b']['forward_speedup']:.2f}); "
                  f"caches equal within bf16: {checks['equal']}", flush=True)
            print(json.dumps(checks, indent=1), flush=True)
        if "70b" in args.phases:
            big = run_worker(args.ranks, workdir / "big.json", random_shape=shape_70b, worker_init=args.init, cache=workdir / "big.safetensors", **common)
            figures["phases"]["70b"] = big
            fits = big["gpu_memory_gib"] is not None and big["weight_gib_bf16"] < big["gpu_memory_gib"]
            print(f"70b: {big['all_params'] / 1e9:.1f}B parameters ({big['weight_gib_bf16']:.0f} GiB in bf16"
                  + (f" against one GPU's {big['gpu_memory_gib']:.0f} GiB: {'fits' if fits else 'does not fit'} one GPU" if big["gpu_memory_gib"] else "")
                  + f"); extract_shard {big['tokens_per_s']:,.0f} tok/s on {args.ranks} ranks = {100 * big['roofline_ratio']:.1f}% of the "
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
