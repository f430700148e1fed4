"""Data-parallel drafter training: 1 GPU vs 2 GPUs (torchrun + DDP) on the same global batches.

First N steps in this process on one device (each step's global batch of --rows rows), then the
same N steps under `torchrun --nproc_per_node 2` (this script with --worker), each rank taking
its rows of every step's batch exactly as train_drafter does (eyrie.training.distributed.rank_share +
train_step + DistributedDataParallel). Prints the two loss curves side by side with their max
abs difference and the scaling efficiency = 2-GPU tokens/s / (2 x 1-GPU tokens/s).

    python benchmarks/train_ddp.py --out train_ddp.json                  # 2x H200, ~3 min
    python benchmarks/train_ddp.py --small --out /tmp/ddp.json           # CPU, gloo

Everything it launches gets NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_throughput import LLAMA_8B, SMALL, VARIANTS, build, random_batch, timed_step  # noqa: E402

from eyrie.training.distributed import data_parallel, rank_share  # noqa: E402

LAUNCH_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def global_batch(args, dims, target_head, draft_ids, device, dtype, step: int) -> dict:
    """Step `step`'s global batch: the same random rows in every process (seeded per step)."""
    return random_batch(dims, args.rows, args.seq_len, target_head, draft_ids, device, dtype, args.seed + 1000 + step)


def take_rows(batch: dict, rows: list[int]) -> dict:
    picked = {k: v[rows] for k, v in batch.items() if torch.is_tensor(v)}
    picked["tokens"] = int(picked["lengths"].sum())
    return picked


def run_steps(args, rank: int, world: int, device) -> dict:
    """N training steps on this rank's share; figures over all ranks (as rank 0 logs them)."""
    cuda = torch.device(device).type == "cuda"
    dims = SMALL if args.small else LLAMA_8B
    variant = VARIANTS[args.variant]
    objective, optimizer, target_head, draft_ids, t2d = build(dims, variant, device, args.ttt_steps, args.seed)
    if world > 1:
        objective = data_parallel(objective, device)
    dtype = torch.bfloat16 if cuda else torch.float32
    losses, times, tokens = [], [], 0
    for step in range(args.warmup + args.steps):
        batch = global_batch(args, dims, target_head, draft_ids, device, dtype, step)
        rows, weight = rank_share(list(range(args.rows)), rank, world)
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


def worker(args) -> int:
    """One torchrun rank: join the group, train, rank 0 writes --worker-out."""
    rank, world, local_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available() and not args.small
    if cuda:
        torch.cuda.set_device(local_rank)
    device = f"cuda:{local_rank}" if cuda else "cpu"
    torch.distributed.init_process_group("nccl" if cuda else "gloo")
    try:
        figures = run_steps(args, rank, world, device)
        if rank == 0:
            Path(args.worker_out).write_text(json.dumps(figures))
    finally:
        torch.distributed.destroy_process_group()
    return 0


def launch_ranks(args, nproc: int, out_path: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), str(Path(__file__).resolve()),
               "--worker", "--worker-out", str(out_path), "--out", str(out_path) + ".unused"] + forwarded_args(args)
    env = {**os.environ, **LAUNCH_ENV}
    if args.small:
        env["OMP_NUM_THREADS"] = "1"
    print(f"launching: {' '.join(command)}", flush=True)
    return subprocess.run(command, env=env, timeout=args.timeout, stdout=sys.stdout, stderr=sys.stderr)


def forwarded_args(args) -> list[str]:
    out = ["--variant", args.variant, "--seq-len", str(args.seq_len), "--rows", str(args.rows), "--ttt-steps", str(args.ttt_steps),
           "--warmup", str(args.warmup), "--steps", str(args.steps), "--seed", str(args.seed)]
    return out + (["--small"] if args.small else [])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="tiny shapes, CPU and gloo")
    parser.add_argument("--variant", default="flex+chunked", choices=list(VARIANTS))
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per row (default 2048; 64 with --small)")
    parser.add_argument("--rows", type=int, default=2, help="rows of each step's global batch")
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=360, help="seconds allowed to the torchrun launch")
    parser.add_argument("--out", required=True, help="JSON file for all figures")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.seq_len = args.seq_len or (64 if args.small else 2048)
    for key, value in LAUNCH_ENV.items():
        os.environ.setdefault(key, value)
    if args.worker:
        return worker(args)

    cuda = torch.cuda.is_available() and not args.small
    device = "cuda:0" if cuda else "cpu"
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name() if cuda else 'cpu'}, GPUs {torch.cuda.device_count() if cuda else 0}, "
          f"variant {args.variant}, global batch {args.rows} x {args.seq_len}, TTT steps {args.ttt_steps}", flush=True)
    report = {"torch": torch.__version__, "variant": args.variant, "rows": args.rows, "seq_len": args.seq_len}
    try:
        report["one"] = run_steps(args, 0, 1, device)
    except Exception as exc:
        traceback.print_exc()
        report["one"] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    if cuda:
        torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory() as tmp:
        out_path = Path(tmp) / "ranks.json"
        try:
            done = launch_ranks(args, args.nproc, out_path)
            report["many"] = json.loads(out_path.read_text()) if out_path.is_file() else {"error": f"torchrun exited {done.returncode} without figures"}
        except Exception as exc:
            traceback.print_exc()
            report["many"] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)

    one, many = report["one"], report["many"]
    print(f"\n{'step':>4} {'1 rank loss':>14} {f'{args.nproc} ranks loss':>14} {'abs diff':>10}")
    if "losses" in one and "losses" in many:
        diffs = [abs(a - b) for a, b in zip(one["losses"], many["losses"])]
        for i, (a, b, d) in enumerate(zip(one["losses"], many["losses"], diffs)):
            print(f"{i:>4} {a:>14.6f} {b:>14.6f} {d:>10.2e}")
        efficiency = many["tokens_per_second"] / (args.nproc * one["tokens_per_second"])
        report["max_abs_loss_diff"], report["scaling_efficiency"] = max(diffs), efficiency
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"max abs loss diff {max(diffs):.2e}")
        print(f"tok/s: 1 rank {one['tokens_per_second']:.0f}, {args.nproc} ranks {many['tokens_per_second']:.0f}; "
              f"scaling efficiency {efficiency:.2f} (1.00 = linear)")
        if one.get("peak_gib") is not None:
            print(f"peak GiB: 1 rank {one['peak_gib']:.2f}, rank 0 of {args.nproc} {many['peak_gib']:.2f}")
        return 0
    print(f"FAILED: 1 rank: {one.get('error', 'ok')}; {args.nproc} ranks: {many.get('error', 'ok')}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
