"""Drafter training throughput and peak memory: the old path vs flex attention + chunked loss + fused weight gradients.

Runs eyrie.training.objective.train_step (the code train_drafter runs each step) on random features at the
Llama-3.1-8B drafter shape (H 4096, 32/8 heads, head_dim 128, intermediate 14336, draft vocab
32000, target vocab 128256), L=2048, batch 1, 7 TTT steps, bf16 autocast, side by side in one
process:

    baseline      eager attention + unchunked loss, float32 frozen embeddings and target head,
                  foreach AdamW (the lean RMSNorm backward is shared)
    flex+chunked  flex attention (compiled) + chunked loss, bf16 frozen tensors, fused AdamW
    +recompute    the same with train.recompute_mlp
    +compiled     flex+chunked with train.compile: the layer's elementwise work (casts, RMSNorms,
                  rotary, residual adds, SiLU * up) fused by torch.compile (eyrie.training.compiled_layers)
    flex+fused-loss  flex+chunked with train.fused_loss: each loss chunk's elementwise work fused by
                  torch.compile (eyrie.training.draft_loss.LossChunks); +compiled: with train.compile too;
                  the weight gradients through plain autograd (train.fused_weight_grads: false)
    flex+fused-loss+fused-wgrad  flex+fused-loss with train.fused_weight_grads (eyrie.training.weight_grads):
                  each trained matrix cast once a step, each use's weight gradient added to the step's sum by
                  its own product
    ...+fused-wgrad-fp32  the same with train.fused_weight_grads: float32 (the layer's sums in float32)
    ...+fused-norms  flex+fused-loss or flex+fused-loss+fused-wgrad with train.fused_norms: each RMSNorm's
                  forward and backward math fused by torch.compile (eyrie.drafter.rms_norm.NormKernels);
                  flex+fused-loss+fused-wgrad+fused-norms is what train_drafter runs on CUDA by default
    ...+small-loss-chunks, ...+unstacked-qkv  that default with the loss in chunks of 2^25 logits, or with q, k and v as
                  three products: what the fused loss's 2^26-logit chunks and StepWeights.stacked_linear each buy

Each: tokens/s (median step time after warm-up; flex attention and train.compile compile in the
first warm-up step, so no timed step includes compile time), peak memory
(torch.cuda.max_memory_allocated, reset between variants; model + optimizer + step) and, on CUDA, the host
syncs of one more step (torch.cuda.set_sync_debug_mode, by the line that made them), then ratios against
SpecForge's trainer: measured in the same call with --specforge benchmarks/specforge_step.py (SpecForge's own step at
the same shape and inputs, its wheel fetched into an ignored folder; run in a process of its own after eyrie's
variants), else the figures recorded for it on one H200 (16-19K tok/s, 13 GiB with flex attention).
One summary line per variant, SpecForge's too.

    python benchmarks/train_throughput.py --out train_throughput.json            # H200, ~2-4 min
    python benchmarks/train_throughput.py --variants flex+fused-loss+fused-wgrad,flex+fused-loss+fused-wgrad+fused-norms \
        --warmup 2 --steps 6 --specforge benchmarks/specforge_step.py --out tt.json   # H200: norms eager, the default, SpecForge
    python benchmarks/train_throughput.py --small --variants flex+fused-loss,flex+fused-loss+fused-wgrad --out /tmp/tt.json  # CPU smoke test
    python benchmarks/train_throughput.py --shape pipeline --batch 32 --seq-len 512 \
        --variants flex+chunked,flex+fused-loss --profile flex+fused-loss --out tt_pipeline.json  # the pipeline's drafter (H 576)

Each variant's line also gives its matrix-product FLOPs per token (forward and backward, every TTT step: fc,
q/k/v/o, MLP, the draft head, the target head's distribution and attention over the row) and the TFLOP/s that
implies, against the dense bf16 peak of an H100 or H200 SXM (989 TFLOP/s, the same for both): the roofline ratio at that shape.

--processes N: data-parallel training, one process against N (torchrun + DDP) on the same global batches of --batch
rows, one variant (the first of --variants; flex+chunked by default). First the steps in this process on one device,
then the same steps under `torchrun --nproc_per_node N` (this script with --worker), each rank taking its rows of
every step's batch exactly as train_drafter does (eyrie.training.distributed.rank_share + train_step +
DistributedDataParallel). Prints the two loss curves side by side with their max abs difference and the scaling
efficiency = N-process tokens/s / (N x 1-process tokens/s). Everything it launches gets NCCL_NVLS_ENABLE=0 and
TORCH_SYMM_MEM_DISABLE_MULTICAST=1.

    python benchmarks/train_throughput.py --processes 2 --batch 4 --steps 5 --out train_ddp.json   # 2x H200, ~3 min
    python benchmarks/train_throughput.py --processes 2 --small --out /tmp/ddp.json                 # CPU, gloo
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

from eyrie.drafter.model import DrafterShape, Eagle3Drafter
from eyrie.training import weight_grads
from eyrie.training.distributed import data_parallel, rank_share
from eyrie.training.draft_loss import LossChunks
from eyrie.training.objective import TTTObjective, train_step
from eyrie.training.optimizer import make_optimizer

SPECFORGE_TOKENS_PER_S = (16000.0, 19000.0)
SPECFORGE_PEAK_GIB = 13.0
LLAMA_8B = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, draft_vocab=32000, vocab=128256)
# The pipeline's drafter on the default target (SmolLM2-135M-Instruct), draft vocabulary as configs/h200.yaml's run
# built it (every conversation and 3,000 synthetic prompts). The 12,000-conversation run's 26,641 (--draft-vocab 26641)
# was not a multiple of 8, and its head's products ran 1.39x slower; build_vocab now pads.
PIPELINE = dict(hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536, draft_vocab=30952, vocab=49152)
# Qwen3-8B's drafter (H 4096, 32/8 heads, head_dim 128, its MLP width 12288, vocab 151936), as SpecForge's
# configs/qwen3-8b-eagle3.json and eyrie's DrafterShape.from_target give it.
QWEN3_8B = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=12288, draft_vocab=32000, vocab=151936)
SHAPES = {"llama-8b": LLAMA_8B, "qwen3-8b": QWEN3_8B, "pipeline": PIPELINE}
SMALL = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, draft_vocab=200, vocab=500)
VARIANTS = {
    "baseline": dict(attention="eager", chunked_loss=False, recompute_mlp=False, frozen_bf16=False, fused_adam=False, compile=False),
    "flex+chunked": dict(attention="flex", chunked_loss=True, recompute_mlp=False, frozen_bf16=True, fused_adam=None, compile=False),
    "flex+chunked+recompute": dict(attention="flex", chunked_loss=True, recompute_mlp=True, frozen_bf16=True, fused_adam=None, compile=False),
    "flex+chunked+compiled": dict(attention="flex", chunked_loss=True, recompute_mlp=False, frozen_bf16=True, fused_adam=None, compile=True),
    "flex+fused-loss": dict(attention="flex", chunked_loss=True, recompute_mlp=False, frozen_bf16=True, fused_adam=None, compile=False,
                            fused_loss=True),
    "flex+fused-loss+compiled": dict(attention="flex", chunked_loss=True, recompute_mlp=False, frozen_bf16=True, fused_adam=None,
                                     compile=True, fused_loss=True),
    # train.prompt_label_weight: the prompts' positions trained too (with --prompt-share, the pipeline's mix of prompt and reply)
    "flex+fused-loss+prompts": dict(attention="flex", chunked_loss=True, recompute_mlp=False, frozen_bf16=True, fused_adam=None,
                                    compile=False, fused_loss=True, prompt_label_weight=1.0),
    # train.fused_weight_grads (eyrie.training.weight_grads.settle's values): "compute" (the CUDA default), and float32 sums
    "flex+fused-loss+fused-wgrad": dict(attention="flex", chunked_loss=True, recompute_mlp=False, frozen_bf16=True, fused_adam=None,
                                        compile=False, fused_loss=True, fused_weight_grads="compute"),
    "flex+fused-loss+fused-wgrad-fp32": dict(attention="flex", chunked_loss=True, recompute_mlp=False, frozen_bf16=True, fused_adam=None,
                                             compile=False, fused_loss=True, fused_weight_grads="float32"),
    # train.fused_norms: the RMSNorms' math through torch.compile; with fused-wgrad, the CUDA default
    "flex+fused-loss+fused-norms": dict(attention="flex", chunked_loss=True, recompute_mlp=False, frozen_bf16=True, fused_adam=None,
                                        compile=False, fused_loss=True, fused_norms=True),
    "flex+fused-loss+fused-wgrad+fused-norms": dict(attention="flex", chunked_loss=True, recompute_mlp=False, frozen_bf16=True,
                                                    fused_adam=None, compile=False, fused_loss=True, fused_weight_grads="compute",
                                                    fused_norms=True),
    # train.fused_pointwise: the rotary on q and k and SiLU * up through torch.compile
    "flex+fused-loss+fused-wgrad+fused-norms+fused-pointwise": dict(attention="flex", chunked_loss=True, recompute_mlp=False, frozen_bf16=True,
                                                                 fused_adam=None, compile=False, fused_loss=True, fused_weight_grads="compute",
                                                                 fused_norms=True, fused_pointwise=True),
    # the default with one of its pieces as it was: the loss in chunks of 2^25 logits (two a step at 2,048 rows), and q, k
    # and v as three products (eyrie.training.weight_grads.StepWeights.stacked_linear makes them one)
    "flex+fused-loss+fused-wgrad+fused-norms+small-loss-chunks": dict(attention="flex", chunked_loss=True, recompute_mlp=False,
                                                                      frozen_bf16=True, fused_adam=None, compile=False, fused_loss=True,
                                                                      fused_weight_grads="compute", fused_norms=True, loss_chunk_elements=1 << 25),
    "flex+fused-loss+fused-wgrad+fused-norms+unstacked-qkv": dict(attention="flex", chunked_loss=True, recompute_mlp=False, frozen_bf16=True,
                                                                  fused_adam=None, compile=False, fused_loss=True, fused_weight_grads="compute",
                                                                  fused_norms=True, stacked_products=False),
    # and train.compile's pieces (rotary, SiLU * up, residual adds, the norms inside them) on top: what fusing the rest buys
    "flex+fused-loss+fused-wgrad+compiled": dict(attention="flex", chunked_loss=True, recompute_mlp=False, frozen_bf16=True,
                                                 fused_adam=None, compile=True, fused_loss=True, fused_weight_grads="compute",
                                                 fused_norms=True),
}


HOPPER_BF16_DENSE_TFLOPS = 989.0  # H100 SXM and H200: the same tensor cores, the same dense bf16 peak
LAUNCH_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}  # --processes: what every launch gets


def flops_per_token(dims: dict, ttt_steps: int, seq_len: int) -> float:
    """Matrix-product FLOPs one trained token costs (forward 2, backward 4 per multiply-add; the target head and the
    frozen paths forward only): fc once, then per TTT step q/k/v over 2H inputs, o, the gated MLP, the draft head and
    causal attention over half the row on average; and once, the target's distribution over the full vocabulary
    (target_distribution computes it once per position, for every TTT step). The draft head's logits recomputed in
    the chunked loss's backward are not counted."""
    H, I, h, kvh, hd = dims["hidden"], dims["intermediate"], dims["heads"], dims["kv_heads"], dims["head_dim"]
    trained = 3 * H * H  # fc
    per_step = 2 * H * (h + 2 * kvh) * hd + h * hd * H + 3 * H * I + H * dims["draft_vocab"]
    attention = 2 * h * hd * (seq_len / 2)  # QK^T and PV, per token, over the visible half on average
    target_head = H * dims["vocab"]
    return 6 * (trained + ttt_steps * (per_step + attention)) + 2 * target_head


def drafter_shape(dims: dict) -> DrafterShape:
    return DrafterShape(
        hidden_size=dims["hidden"], intermediate_size=dims["intermediate"], num_attention_heads=dims["heads"],
        num_key_value_heads=dims["kv_heads"], head_dim=dims["head_dim"], rms_norm_eps=1e-5, vocab_size=dims["vocab"],
        draft_vocab_size=dims["draft_vocab"], target_hidden_size=dims["hidden"], max_position_embeddings=131072,
        aux_layer_ids=[1, 15, 28], rope_theta=500000.0,
    )


def random_vocab(dims: dict, seed: int):
    """(draft_ids sorted [Vd], d2t, t2d) of a random draft vocabulary."""
    g = torch.Generator().manual_seed(seed)
    draft_ids = torch.randperm(dims["vocab"], generator=g)[: dims["draft_vocab"]].sort().values
    t2d = torch.zeros(dims["vocab"], dtype=torch.bool)
    t2d[draft_ids] = True
    return draft_ids, draft_ids - torch.arange(draft_ids.numel()), t2d


def random_target_head(dims: dict, device, dtype, seed: int) -> torch.Tensor:
    """Rows of norm ~1, as in real LM heads: logits of unit-RMS states come out O(1)."""
    g = torch.Generator(device=device).manual_seed(seed)
    head = torch.randn(dims["vocab"], dims["hidden"], generator=g, device=device, dtype=torch.float32) / dims["hidden"] ** 0.5
    return head.to(dtype)


def random_batch(dims: dict, rows: int, length: int, target_head, draft_ids, device, dtype, seed: int, prompt_share: float = 0.0) -> dict:
    """Random aux states and tokens; final states point at draft-vocab tokens so most positions are trained
    (as with real data, where the draft vocab covers most target argmaxes). Each row's first prompt_share of its
    tokens (at least 2) are its prompt, outside the loss mask."""
    g = torch.Generator(device=device).manual_seed(seed)
    H = dims["hidden"]
    pick = torch.randint(0, draft_ids.numel(), (rows, length), generator=g, device=device)
    token_ids = draft_ids.to(device)[pick]  # (B, L) target ids inside the draft vocab
    # Unit-RMS states whose logit for the chosen token is ~10 (the other 128K logits ~N(0, 1)).
    row = target_head[token_ids].float()
    final = 10.0 * row / row.norm(dim=-1, keepdim=True) ** 2 + torch.randn(rows, length, H, generator=g, device=device)
    aux = torch.randn(rows, length, 3 * H, generator=g, device=device)
    loss_mask = torch.ones(rows, length, dtype=torch.bool)
    loss_mask[:, : max(2, int(prompt_share * length))] = False
    lengths = torch.full((rows,), length, dtype=torch.long)
    return {
        "aux": aux.to(dtype), "final": final.to(dtype), "input_ids": token_ids, "loss_mask": loss_mask.to(device),
        "lengths": lengths.to(device), "tokens": rows * length,
        "loss_mask_host": loss_mask, "lengths_host": lengths,  # as the pipeline's loader keeps them (eyrie.training.inputs)
    }


def build(dims: dict, variant: dict, device, ttt_steps: int, seed: int):
    """(objective, optimizer, target head, draft ids, t2d) on device, as train_drafter sets them up."""
    cuda = torch.device(device).type == "cuda"
    frozen = torch.bfloat16 if (variant["frozen_bf16"] and cuda) else torch.float32
    draft_ids, d2t, t2d = random_vocab(dims, seed)
    target_head = random_target_head(dims, device, frozen, seed)
    torch.manual_seed(seed)
    with torch.device(device):  # initialise on the device: 424M parameters at the 8B shape
        model = Eagle3Drafter(drafter_shape(dims), torch.empty(0, dims["hidden"]), d2t, t2d)
    model.embed_weight = torch.randn(dims["vocab"], dims["hidden"], device=device, dtype=frozen) * 0.02  # frozen, bf16 or fp32 as train_drafter
    with torch.no_grad():
        model.lm_head.weight.copy_(target_head[draft_ids.to(device)].float())
    optimizer = make_optimizer(model, 1e-4, 0.0, fused=variant["fused_adam"])
    objective = TTTObjective(model, ttt_steps, 0.8, attention=variant["attention"], chunked_loss=variant["chunked_loss"],
                             recompute_mlp=variant["recompute_mlp"], compile=variant["compile"], fused_loss=variant.get("fused_loss", False),
                             prompt_label_weight=variant.get("prompt_label_weight", 0.0), fused_weight_grads=variant.get("fused_weight_grads"),
                             fused_norms=variant.get("fused_norms", False), fused_pointwise=variant.get("fused_pointwise", False),
                             stacked_products=variant.get("stacked_products", True))
    if "loss_chunk_elements" in variant:
        objective.loss_chunks = LossChunks(fused=objective.loss_chunks.fused, chunk_elements=variant["loss_chunk_elements"])
    return objective, optimizer, target_head, draft_ids.to(device), t2d.to(device)


def _compiled_graphs() -> int | None:
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # private counters: absent or renamed in some torch versions
        return None


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def one_step(objective, optimizer, batch: dict, target_head, draft_ids, t2d, device) -> dict:
    """train_step as train_drafter runs it (bf16 autocast on CUDA)."""
    return train_step(objective, optimizer, batch, target_lm_head=target_head, draft_ids=draft_ids, t2d=t2d,
                      max_grad_norm=0.5, use_bf16=torch.device(device).type == "cuda")


def timed_step(objective, optimizer, batch: dict, target_head, draft_ids, t2d, device) -> tuple[dict, float]:
    """(train_step's result, its seconds), the device synchronised on both sides."""
    sync(device)
    t0 = time.perf_counter()
    result = one_step(objective, optimizer, batch, target_head, draft_ids, t2d, device)
    sync(device)
    return result, time.perf_counter() - t0


def measure(name: str, variant: dict, args, dims: dict, device) -> dict:
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    objective, optimizer, target_head, draft_ids, t2d = build(dims, variant, device, args.ttt_steps, args.seed)
    data_dtype = torch.bfloat16 if cuda else torch.float32
    batch = random_batch(dims, args.batch, args.seq_len, target_head, draft_ids, device, data_dtype, args.seed + 1, args.prompt_share)
    times, losses = [], []
    deadline = time.perf_counter() + args.max_seconds
    for i in range(args.warmup + args.steps):
        result, elapsed = timed_step(objective, optimizer, batch, target_head, draft_ids, t2d, device)
        losses.append(result["loss"])
        if i >= args.warmup:
            times.append(elapsed)
        print(f"  {name} step {i}{' (warm-up)' if i < args.warmup else ''}: {elapsed * 1000:.0f} ms, loss {result['loss']:.4f}, "
              f"compiled graphs {_compiled_graphs()}", flush=True)
        if i >= args.warmup and time.perf_counter() > deadline:
            print(f"  {name}: time cap {args.max_seconds}s reached after {len(times)} measured steps", flush=True)
            break
    compiled = objective.compiled
    if compiled is not None and compiled.error is not None:  # the figures are then eager ones
        print(f"  {name}: train.compile FELL BACK TO EAGER: {compiled.error}", flush=True)
    if objective.loss_chunks.error is not None:
        print(f"  {name}: train.fused_loss FELL BACK TO EAGER: {objective.loss_chunks.error}", flush=True)
    if objective.norm_kernels.error is not None:
        print(f"  {name}: train.fused_norms FELL BACK TO EAGER: {objective.norm_kernels.error}", flush=True)
    if variant.get("fused_weight_grads") and weight_grads.fallback_reason is not None:  # the same sums, slower
        print(f"  {name}: train.fused_weight_grads FELL BACK TO FLOAT32 COPIES: {weight_grads.fallback_reason}", flush=True)
    syncs = host_syncs(functools.partial(one_step, objective, optimizer, batch, target_head, draft_ids, t2d, device)) if cuda else None
    if syncs is not None:
        print(f"  {name}: {sum(syncs.values())} host syncs in one step: {dict(syncs.most_common())}", flush=True)
    if cuda and name in args.profile.split(","):
        profile_steps(name, functools.partial(timed_step, objective, optimizer, batch, target_head, draft_ids, t2d, device), args.profile_dir)
    step_s = statistics.median(times)
    out = {
        "tokens_per_second": batch["tokens"] / step_s,
        "median_step_s": step_s,
        "step_times_s": times,
        "losses": losses,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "positions_trained_step0": result["stats"][0][2],
        "dynamo_unique_graphs": _compiled_graphs(),  # cumulative; growing every step would mean flex recompiles
        "compile_fallback": None if compiled is None else compiled.error,  # set: train.compile ran eagerly
        "fused_loss_fallback": objective.loss_chunks.error,  # set: train.fused_loss ran eagerly
        "fused_norms_fallback": objective.norm_kernels.error,  # set: train.fused_norms ran eagerly
        "fused_weight_grads_fallback": weight_grads.fallback_reason if variant.get("fused_weight_grads") else None,
        "host_syncs": None if syncs is None else sum(syncs.values()),  # CUDA: in one step, by torch.cuda.set_sync_debug_mode
        "host_sync_sites": None if syncs is None else dict(syncs),
    }
    del objective, optimizer, target_head, batch
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def host_syncs(step) -> collections.Counter:
    """The CUDA host syncs one step makes (nonzero, .tolist(), .item(), copies to the host), counted by the source line
    that made each: torch.cuda.set_sync_debug_mode's warnings. The device is synchronised before and after, outside."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))


def profile_steps(name: str, step, folder: str = "", count: int = 2) -> None:
    """Where one step's time goes: the top kernels by GPU time and the top host ops by their own CPU time; with folder,
    every kernel's row in <folder>/<name, + as _>.kernels.txt and the timeline of host ops and kernels in
    <folder>/<name>.trace.json.gz (chrome://tracing or Perfetto: where the GPU waits for the host)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(count):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    print(f"== profile {name} ({count} steps)")
    print(events.table(sort_by="self_cuda_time_total", row_limit=22, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
    with tempfile.TemporaryDirectory() as scratch:
        trace = Path(folder or scratch) / f"{name.replace('+', '_')}.trace.json"
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
        print_gpu_gaps(json.loads(trace.read_text())["traceEvents"], count)
        if folder:
            (Path(folder) / f"{name.replace('+', '_')}.kernels.txt").write_text(
                events.table(sort_by="self_cuda_time_total", row_limit=-1, max_name_column_width=120))
            with open(trace, "rb") as raw, gzip.open(f"{trace}.gz", "wb") as packed:
                shutil.copyfileobj(raw, packed)
            trace.unlink()


def print_gpu_gaps(events: list[dict], count: int, shown: int = 12) -> None:
    """Where the GPU waits for the host, from a chrome trace's events: the idle time between device activities a step,
    summed by the host op whose launch ended each wait (the outermost autograd node, custom Function or compiled
    region around the launch, else the innermost op), and the longest waits."""
    device = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    if not device:
        return
    launches = {e["args"]["correlation"]: e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ops_by_thread = collections.defaultdict(list)
    for e in events:
        if e.get("cat") == "cpu_op":
            ops_by_thread[e["tid"]].append(e)

    def launcher(kernel) -> str:
        launch = launches.get(kernel.get("args", {}).get("correlation"))
        if launch is None:
            return "?"
        around = sorted((o for o in ops_by_thread[launch["tid"]] if o["ts"] <= launch["ts"] <= o["ts"] + o.get("dur", 0)), key=lambda o: o["ts"])
        names = [o["name"] for o in around]
        outer = [n for n in names if n.startswith(("autograd::engine", "Torch-Compiled Region", "Optimizer.")) or n[:1] == "_"]
        return (outer[0] if outer else names[-1]) if names else "?"

    gaps, by_op, busy_until = [], collections.Counter(), device[0]["ts"] + device[0].get("dur", 0)
    for before, kernel in zip(device, device[1:]):
        gap = kernel["ts"] - busy_until
        if gap > 0:
            op = launcher(kernel)
            gaps.append((gap, kernel["name"], op, before["name"]))
            by_op[op] += gap
        busy_until = max(busy_until, kernel["ts"] + kernel.get("dur", 0))
    span = (busy_until - device[0]["ts"]) / 1e3 / count
    print(f"GPU idle between kernels: {sum(g[0] for g in gaps) / 1e3 / count:.2f} ms a step of {span:.2f} ms ({len(gaps) / count:.0f} gaps a step)")
    print("  by the host op that launched the next kernel (ms a step):")
    for op, total in by_op.most_common(shown):
        print(f"  {total / 1e3 / count:7.3f}  {op[:100]}")
    print("  the longest:")
    for gap, name, op, before in sorted(gaps, reverse=True)[:shown]:
        print(f"  {gap / 1e3:7.3f} ms before {name[:60]} (launched in {op[:60]}), after {before[:50]}")


# --------------------------------------------------------------------------- --processes N: data-parallel training


def take_rows(batch: dict, rows: list[int]) -> dict:
    picked = {k: v[rows] for k, v in batch.items() if torch.is_tensor(v)}
    picked["tokens"] = int(picked["lengths"].sum())
    return picked


def run_steps(args, dims: dict, rank: int, world: int, device) -> dict:
    """The steps on this rank's share of every global batch (the same random rows in every process, seeded per step);
    figures over all ranks (as rank 0 logs them)."""
    cuda = torch.device(device).type == "cuda"
    objective, optimizer, target_head, draft_ids, t2d = build(dims, VARIANTS[args.variant], device, args.ttt_steps, args.seed)
    if world > 1:
        objective = data_parallel(objective, device)
    dtype = torch.bfloat16 if cuda else torch.float32
    losses, times, tokens = [], [], 0
    for step in range(args.warmup + args.steps):
        batch = random_batch(dims, args.batch, args.seq_len, target_head, draft_ids, device, dtype, args.seed + 1000 + step, args.prompt_share)
        rows, weight = rank_share(list(range(args.batch)), rank, world)
        batch = take_rows(batch, rows)
        batch["weight"] = weight
        result, elapsed = timed_step(objective, optimizer, batch, target_head, draft_ids, t2d, device)
        losses.append(result["loss"])
        if step >= args.warmup:
            times.append(elapsed)
            tokens = result["tokens"]
        if rank == 0:
            print(f"  world {world} step {step}: {elapsed * 1000:.0f} ms, loss {result['loss']:.5f}", flush=True)
    step_s = statistics.median(times)
    return {"losses": losses, "median_step_s": step_s, "tokens_per_second": tokens / step_s, "step_times_s": times,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}


def worker(args, dims: dict) -> int:
    """One torchrun rank: join the group, train, rank 0 writes --worker-out."""
    rank, world, local_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available() and not args.small
    if cuda:
        torch.cuda.set_device(local_rank)
    device = f"cuda:{local_rank}" if cuda else "cpu"
    torch.distributed.init_process_group("nccl" if cuda else "gloo")
    try:
        figures = run_steps(args, dims, rank, world, device)
        if rank == 0:
            Path(args.worker_out).write_text(json.dumps(figures))
    finally:
        torch.distributed.destroy_process_group()
    return 0


def launch_ranks(args, out_path: Path) -> subprocess.CompletedProcess:
    forwarded = ["--variants", args.variant, "--shape", args.shape, "--seq-len", str(args.seq_len), "--batch", str(args.batch),
                 "--ttt-steps", str(args.ttt_steps), "--warmup", str(args.warmup), "--steps", str(args.steps), "--seed", str(args.seed),
                 "--prompt-share", str(args.prompt_share), "--processes", str(args.processes)]
    forwarded += (["--draft-vocab", str(args.draft_vocab)] if args.draft_vocab else []) + (["--small"] if args.small else [])
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.processes),
               str(Path(__file__).resolve()), "--worker", "--worker-out", str(out_path), "--out", str(out_path) + ".unused", *forwarded]
    env = {**os.environ, **LAUNCH_ENV}
    if args.small:
        env["OMP_NUM_THREADS"] = "1"
    print(f"launching: {' '.join(command)}", flush=True)
    return subprocess.run(command, env=env, timeout=args.timeout, stdout=sys.stdout, stderr=sys.stderr)


def data_parallel_report(args, dims: dict) -> int:
    """One process against --processes ranks on the same global batches: loss curves, tokens/s, scaling efficiency."""
    cuda = torch.cuda.is_available() and not args.small
    device = "cuda:0" if cuda else "cpu"
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name() if cuda else 'cpu'}, GPUs {torch.cuda.device_count() if cuda else 0}, "
          f"variant {args.variant}, global batch {args.batch} x {args.seq_len}, TTT steps {args.ttt_steps}", flush=True)
    report = {"torch": torch.__version__, "variant": args.variant, "shape": dims, "rows": args.batch, "seq_len": args.seq_len, "processes": args.processes}
    try:
        report["one"] = run_steps(args, dims, 0, 1, device)
    except Exception as exc:
        traceback.print_exc()
        report["one"] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    if cuda:
        torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory() as tmp:
        out_path = Path(tmp) / "ranks.json"
        try:
            done = launch_ranks(args, out_path)
            report["many"] = json.loads(out_path.read_text()) if out_path.is_file() else {"error": f"torchrun exited {done.returncode} without figures"}
        except Exception as exc:
            traceback.print_exc()
            report["many"] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)

    one, many = report["one"], report["many"]
    print(f"\n{'step':>4} {'1 process loss':>14} {f'{args.processes} ranks loss':>14} {'abs diff':>10}")
    if "losses" in one and "losses" in many:
        diffs = [abs(a - b) for a, b in zip(one["losses"], many["losses"])]
        for i, (a, b, d) in enumerate(zip(one["losses"], many["losses"], diffs)):
            print(f"{i:>4} {a:>14.6f} {b:>14.6f} {d:>10.2e}")
        efficiency = many["tokens_per_second"] / (args.processes * one["tokens_per_second"])
        report["max_abs_loss_diff"], report["scaling_efficiency"] = max(diffs), efficiency
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"max abs loss diff {max(diffs):.2e}")
        print(f"tok/s: 1 process {one['tokens_per_second']:.0f}, {args.processes} ranks {many['tokens_per_second']:.0f}; "
              f"scaling efficiency {efficiency:.2f} (1.00 = linear)")
        if one.get("peak_gib") is not None:
            print(f"peak GiB: 1 process {one['peak_gib']:.2f}, rank 0 of {args.processes} {many['peak_gib']:.2f}")
        return 0
    print(f"FAILED: 1 process: {one.get('error', 'ok')}; {args.processes} ranks: {many.get('error', 'ok')}")
    return 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="tiny shapes for a CPU smoke test")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b", help="the drafter's shape (pipeline: the default target's, H 576)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per row (default 2048; 64 with --small)")
    parser.add_argument("--batch", "--rows", type=int, default=None, help="rows a step (default 1; with --processes: the global "
                        "batch, default 2)")
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=3, help="steps before timing (flex and train.compile compile here)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per variant")
    parser.add_argument("--max-seconds", type=float, default=45.0, help="stop timing a variant after this long")
    parser.add_argument("--variants", help=f"comma-separated subset of {', '.join(VARIANTS)} (default: all; with --processes: "
                        "flex+chunked)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", default="", help="comma-separated variants to profile for 2 steps after timing (CUDA)")
    parser.add_argument("--profile-dir", default="", help="with --profile: write every kernel's row of each profile to DIR/<variant, + as _>.kernels.txt")
    parser.add_argument("--draft-vocab", type=int, default=None, help="draft vocabulary size (default the shape's)")
    parser.add_argument("--prompt-share", type=float, default=0.0,
                        help="share of each row that is prompt, outside the loss mask (the GPU config's data: ~0.27)")
    parser.add_argument("--processes", type=int, default=1, help="N > 1: one process against N data-parallel ranks (see above)")
    parser.add_argument("--timeout", type=int, default=360, help="seconds allowed to the torchrun launch (--processes) or to --specforge")
    parser.add_argument("--specforge", help="SpecForge's harness (benchmarks/specforge_step.py) to run after "
                        "eyrie's variants at the same shape, in its own process; its line joins the summary and the ratios use it")
    parser.add_argument("--out", required=True, help="JSON file for all figures")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    dims = dict(SMALL if args.small else SHAPES[args.shape])
    if args.draft_vocab:
        dims["draft_vocab"] = args.draft_vocab
    args.seq_len = args.seq_len or (64 if args.small else 2048)
    args.batch = args.batch or (2 if args.processes > 1 else 1)
    if args.processes > 1:
        args.variant = args.variants.split(",")[0] if args.variants else "flex+chunked"
        if args.variant not in VARIANTS:
            parser.error(f"--variants: {args.variant!r} is not one of {', '.join(VARIANTS)}")
        for key, value in LAUNCH_ENV.items():
            os.environ.setdefault(key, value)
        return worker(args, dims) if args.worker else data_parallel_report(args, dims)
    device = "cuda" if torch.cuda.is_available() and not args.small else "cpu"
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"torch {torch.__version__}, device {device_name}, shape {dims}, L={args.seq_len}, batch {args.batch}, TTT steps {args.ttt_steps}", flush=True)

    results = {}
    for name in (args.variants or ",".join(VARIANTS)).split(","):
        print(f"== {name}", flush=True)
        try:
            results[name] = measure(name, VARIANTS[name], args, dims, device)
        except Exception as exc:  # one failing variant must not cost the others
            traceback.print_exc()
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        gc.collect()  # outside the except: the traceback's frames (and their GPU tensors) are gone by now
        if device == "cuda":
            torch.cuda.empty_cache()
    specforge = run_specforge(args) if args.specforge else None
    report = {"torch": torch.__version__, "device": device_name, "shape": dims, "seq_len": args.seq_len, "batch": args.batch,
              "ttt_steps": args.ttt_steps, "variants": results,
              "specforge": specforge or {"recorded": {"tokens_per_second": SPECFORGE_TOKENS_PER_S, "peak_gib": SPECFORGE_PEAK_GIB}}}
    flops = flops_per_token(dims, args.ttt_steps, args.seq_len)
    report["flops_per_token"] = flops
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)

    print(f"\n{flops / 1e9:.2f} GFLOP per trained token (matrix products, forward and backward)")
    for name, r in results.items():
        if "tokens_per_second" in r:
            achieved = r["tokens_per_second"] * flops / 1e12
            print(f"{name:<34} {achieved:>7.1f} TFLOP/s = {achieved / HOPPER_BF16_DENSE_TFLOPS:.1%} of the H100/H200 dense bf16 peak")
    print()
    summary_lines(results, specforge)
    return 0 if all("error" not in r for r in results.values()) and (specforge is None or "error" not in specforge) else 1


def run_specforge(args) -> dict:
    """SpecForge's trainer on the same shape, in a process of its own (its harness: --specforge, a script that prints its
    figures as its last JSON line; its folder goes on PYTHONPATH). Its figures, or {"error": ...}."""
    script = Path(args.specforge).resolve()
    command = [sys.executable, str(script), "--shape", args.shape, "--prompt-share", str(args.prompt_share), "--seq-len", str(args.seq_len),
               "--batch", str(args.batch), "--ttt-steps", str(args.ttt_steps), "--warmup", str(args.warmup), "--steps", str(args.steps),
               "--seed", str(args.seed)] + (["--draft-vocab", str(args.draft_vocab)] if args.draft_vocab else []) + (["--cpu-smoke"] if args.small else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(script.parent), os.environ.get("PYTHONPATH")]))}
    print(f"== specforge: {' '.join(command)}", flush=True)
    try:
        done = subprocess.run(command, env=env, timeout=args.timeout, stdout=subprocess.PIPE, stderr=sys.stderr, text=True)
    except subprocess.TimeoutExpired:
        return {"error": f"no figures within --timeout {args.timeout} s"}
    sys.stdout.write(done.stdout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": f"exited {done.returncode}" + ("" if lines else " without a JSON line")}
    return json.loads(lines[-1])


def summary_lines(results: dict, specforge: dict | None) -> None:
    """One line per variant (and SpecForge's): tok/s, ms a step, peak GiB, host syncs, and each against SpecForge's
    trainer: measured in this call, else the figures recorded for it (16-19K tok/s, 13 GiB)."""
    measured = specforge is not None and "tokens_per_second" in specforge
    sf_tps = specforge["tokens_per_second"] if measured else SPECFORGE_TOKENS_PER_S[1]
    sf_peak = (specforge.get("peak_gib") if measured else SPECFORGE_PEAK_GIB) or None
    against = "measured here" if measured else f"recorded: {SPECFORGE_TOKENS_PER_S[1]:.0f} tok/s, {SPECFORGE_PEAK_GIB} GiB"
    first = next((r["tokens_per_second"] for r in results.values() if "tokens_per_second" in r), None)
    print(f"{'variant':<34} {'tok/s':>8} {'ms/step':>8} {'peak GiB':>9} {'syncs':>6} {'x 1st':>6} {'x SF':>6} {'GiB/SF':>7}   "
          f"(1st = the first variant; SF = SpecForge, {against})")
    rows = list(results.items()) + ([("specforge", specforge)] if specforge is not None else [])
    for name, r in rows:
        if "error" in r:
            print(f"{name:<34} FAILED: {r['error'][:160]}")
            continue
        tps, peak, syncs = r["tokens_per_second"], r.get("peak_gib"), r.get("host_syncs")
        print(f"{name:<34} {tps:>8.0f} {r['median_step_s'] * 1000:>8.1f} {'-' if peak is None else f'{peak:.2f}':>9} "
              f"{'-' if syncs is None else syncs:>6} {tps / first:>6.2f} {tps / sf_tps:>6.2f} "
              f"{'-' if peak is None or sf_peak is None else f'{peak / sf_peak:.2f}':>7}")


if __name__ == "__main__":
    sys.exit(main())
