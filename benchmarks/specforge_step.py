"""SpecForge's own EAGLE-3 drafter training step, timed at train_throughput.py's shape, for
`python benchmarks/train_throughput.py --specforge benchmarks/specforge_step.py`, which runs it as

    python specforge_step.py --seq-len L --batch B --ttt-steps T --warmup W --steps S --seed N [--cpu-smoke]

and reads its last stdout line that starts with "{" (tokens_per_second, median_step_s, ms_per_step, peak_gib, ...).

SpecForge is an external tool, never part of eyrie: its wheel (specforge==0.2.0, whose training path is that of
github.com/sgl-project/SpecForge a6b6b023) is fetched with `pip download --no-deps` into the ignored `.specforge/`
(--specforge-root) and imported from there, never installed. A machine without the index needs that folder carried.

At train_throughput.py's --shape, --draft-vocab and --prompt-share, one timed step is one call of SpecForge's trainer
step, built as its offline EAGLE-3 run builds it, with its config's defaults (flex attention, bf16, lr 1e-4,
max_grad_norm 0.5, cosine schedule, loss weights 0.8**i): LlamaForCausalLMEagle3 (AutoDraftModel.from_config,
freeze_embedding, t2d/d2t buffers), OnlineEagle3Model (its TTT loop, target distribution through t2d, triton
LogSoftmaxLoss), the frozen TargetHead, BF16Optimizer (fp32 master AdamW), Eagle3TrainStrategy, and
TrainerCore(...).train_step(batch): forward_loss, backward, optimizer step and its metric reduction. --fsdp-sharding
none (the default) leaves the model unwrapped, SpecForge's fastest on one GPU; its SHARD_GRAD_OP (FSDP1 over a
one-rank group) is there to compare. The inputs are train_throughput.py's: random_vocab, random_target_head and
random_batch with the same seeds, built once on the device (no data loader is timed).

--cpu-smoke: a tiny shape on the CPU, to check the harness runs. Flex attention has no backward there (SpecForge's
sdpa backend instead), FSDP1 needs an accelerator (unwrapped), and triton's kernels cannot run: the loss is SpecForge's
reference specforge.core.loss._compute_loss (the same math), imported against a stand-in `triton` module where none
is installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

from train_throughput import SHAPES, SMALL, host_syncs, random_batch, random_target_head, random_vocab

REPO = Path(__file__).resolve().parents[1]
SPECFORGE_REQUIREMENT = "specforge==0.2.0"

def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b", help="train_throughput.py's shapes")
    p.add_argument("--draft-vocab", type=int, help="a draft vocabulary of this size instead of the shape's")
    p.add_argument("--prompt-share", type=float, default=0.0, help="share of each row outside the loss mask (as train_throughput.py's)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shape on CPU (1 warm-up, 2 steps at most)")
    p.add_argument("--attention-backend", default=None, choices=["flex_attention", "sdpa"],
                   help="SpecForge's training.attention_backend (default flex_attention, its default; with --cpu-smoke: "
                        "sdpa, since flex attention has no backward on CPU)")
    p.add_argument("--fsdp-sharding", default="none", choices=["SHARD_GRAD_OP", "FULL_SHARD", "NO_SHARD", "none"],
                   help="none (default): no wrapper (FSDPTrainingBackend.prepare_model(wrap=False)), SpecForge's fastest on "
                        "one GPU; else its training.fsdp_sharding over a one-rank group (NO_SHARD: DDP). CPU smoke: none only")
    p.add_argument("--total-steps", type=int, default=10000, help="the cosine schedule's horizon (no effect on speed)")
    p.add_argument("--specforge-root", type=Path, default=REPO / ".specforge",
                   help=f"where {SPECFORGE_REQUIREMENT}'s wheel is unpacked (fetched there when missing)")
    return p.parse_args()


def log(msg: str) -> None:
    print(msg, flush=True)


def ensure_specforge(root: Path) -> str:
    """root holding SpecForge's unpacked wheel (fetched with pip download --no-deps when missing, unpacked beside root
    and renamed into place, so a cut fetch leaves nothing half there), put first on sys.path; its version as the wheel
    names it."""
    if not (root / "specforge" / "__init__.py").exists():
        import shutil
        import zipfile

        from eyrie.core.fetch import download_wheel

        log(f"specforge: fetching {SPECFORGE_REQUIREMENT} into {root}")
        root.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".specforge-", dir=root.parent) as tmp:
            with zipfile.ZipFile(download_wheel(SPECFORGE_REQUIREMENT, Path(tmp) / "wheel")) as wheel:
                wheel.extractall(Path(tmp) / "unpacked")
            shutil.rmtree(root, ignore_errors=True)
            (Path(tmp) / "unpacked").rename(root)
    sys.path.insert(0, str(root))
    versions = sorted(p.name.removesuffix(".dist-info") for p in root.glob("specforge-*.dist-info"))
    return versions[-1] if versions else "unknown"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    args = parse_args()
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit("specforge_step.py: --steps must be >= 1 and --warmup >= 0")
    cpu = args.cpu_smoke
    if cpu:
        args.warmup, args.steps = min(args.warmup, 1), max(1, min(args.steps, 2))
        if args.fsdp_sharding != "none":
            raise SystemExit("--cpu-smoke: FSDP1 needs an accelerator; leave --fsdp-sharding at none")
        if args.attention_backend is None:
            args.attention_backend = "sdpa"
            log("specforge: CPU smoke uses attention_backend sdpa: flex attention has no backward on CPU")
    if args.attention_backend is None:
        args.attention_backend = "flex_attention"
    specforge_version = ensure_specforge(args.specforge_root.resolve())
    # What SpecForge's cli._bootstrap_single_process_env sets for a one-process run; NVLink multicast off, as train_throughput sets it.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ["FSDP_SHARDING"] = args.fsdp_sharding if args.fsdp_sharding != "none" else "SHARD_GRAD_OP"
    if cpu:
        os.environ["SPECFORGE_DEVICE"] = "cpu"  # specforge.utils.get_device_type / get_local_device
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here needs the network
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

    import torch
    import torch.distributed as dist

    if not cpu and not torch.cuda.is_available():
        raise SystemExit("specforge_step.py: no CUDA device (use --cpu-smoke for the CPU smoke test)")
    device = torch.device("cpu") if cpu else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats()
    dims = dict(SMALL if cpu else SHAPES[args.shape])
    if args.draft_vocab:
        dims["draft_vocab"] = args.draft_vocab
    B, L, T, H = args.batch, args.seq_len, args.ttt_steps, dims["hidden"]
    dtype = torch.bfloat16  # SpecForge's model.torch_dtype default

    if cpu and importlib.util.find_spec("triton") is None:
        import_loss_with_triton_stub()
    # SpecForge imports (every third-party import they reach: torch, triton, transformers, huggingface_hub,
    # safetensors, typing_extensions; flash_attn is tried and optional; nothing else at import time).
    from transformers import LlamaConfig

    from specforge.algorithms.eagle3 import model as eagle3_model_module
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.algorithms.eagle3.providers import build_step
    from specforge.core import loss as specforge_loss
    from specforge.modeling.auto import AutoDraftModel
    from specforge.modeling.draft.llama3_eagle import LlamaFlexAttention, get_rope_config
    from specforge.modeling.target.target_head import TargetHead
    from specforge.optimizer import BF16Optimizer
    from specforge.training.backend import FSDPTrainingBackend, ParallelConfig
    from specforge.training.controller import TrainerCore
    from specforge.training.strategies.base import Eagle3TrainStrategy, StepContext

    loss_impl = "specforge.core.loss.LogSoftmaxLoss (triton kernels)"
    if not cpu and not hasattr(specforge_loss.triton, "Config"):
        raise RuntimeError(f"specforge.core.loss did not get the real triton: {specforge_loss.triton!r}")
    if cpu:
        class _ReferenceLoss:  # CPU only: SpecForge's own reference for its triton kernels' math
            @staticmethod
            def apply(logits, target_p, position_mask):
                return specforge_loss._compute_loss(logits, target_p, position_mask)

        eagle3_model_module.LogSoftmaxLoss = _ReferenceLoss
        loss_impl = "specforge.core.loss._compute_loss (CPU reference; triton kernels need CUDA)"

    dist.init_process_group(backend="gloo" if cpu else "nccl", rank=0, world_size=1)
    try:
        versions = {"torch": torch.__version__}
        for name in ("transformers", "triton"):
            mod = sys.modules.get(name)
            versions[name] = getattr(mod, "__version__", None) if mod is not None else None
        log(f"{specforge_version} on {torch.cuda.get_device_name(device) if not cpu else 'cpu'}: "
            f"shape {dims}, B={B}, L={L}, TTT {T}, {args.attention_backend}, fsdp {args.fsdp_sharding}, versions {versions}")

        # ---- the draft model: as model_providers.build_eagle3_draft builds it --------------------------------
        draft_config = LlamaConfig(
            architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_act="silu",
            hidden_size=H, intermediate_size=dims["intermediate"], num_attention_heads=dims["heads"],
            num_key_value_heads=dims["kv_heads"], head_dim=dims["head_dim"], num_hidden_layers=1,
            max_position_embeddings=2048 if L + T <= 2048 + 20 else L + T,  # configs/llama3-8B-eagle3.json: 2048
            rms_norm_eps=1e-5, vocab_size=dims["vocab"],
            draft_vocab_size=dims["draft_vocab"], pad_token_id=0, bos_token_id=128000 if not cpu else 1,
            eos_token_id=128001 if not cpu else 2, tie_word_embeddings=False, rope_theta=500000.0,
            initializer_range=0.02, pretraining_tp=1,
        )
        if get_rope_config(draft_config)[0] != 500000.0:
            raise RuntimeError(f"rope theta not taken: {get_rope_config(draft_config)}")
        torch.manual_seed(args.seed)
        with torch.device(device):  # initialise on the device (SpecForge inits on CPU, then .to(device))
            draft_model = AutoDraftModel.from_config(draft_config, attention_backend=args.attention_backend, torch_dtype=dtype)
        draft_ids, d2t, t2d = random_vocab(dims, args.seed)
        draft_model.d2t.copy_(d2t)  # as _load_vocab_mapping / process_token_dict_to_mappings leave them
        draft_model.t2d.copy_(t2d)
        draft_model.freeze_embedding()
        draft_model = draft_model.to(device=device, dtype=dtype)
        if args.attention_backend == "flex_attention" and not isinstance(draft_model.midlayer.self_attn, LlamaFlexAttention):
            raise RuntimeError(f"expected LlamaFlexAttention, got {type(draft_model.midlayer.self_attn).__name__}")

        # ---- the training model + frozen target head: model_providers.build_eagle3_model (offline mode) -----
        model = OnlineEagle3Model(
            draft_model=draft_model, length=T, attention_backend=args.attention_backend,
            lk_loss_type=None, kl_scale=1.0, kl_decay=1.0,
        ).to(device=device, dtype=dtype)
        with tempfile.TemporaryDirectory() as target_dir:  # TargetHead reads the target's config.json
            LlamaConfig(hidden_size=H, vocab_size=dims["vocab"], intermediate_size=dims["intermediate"],
                        num_attention_heads=dims["heads"], num_key_value_heads=dims["kv_heads"],
                        head_dim=dims["head_dim"], num_hidden_layers=2).save_pretrained(target_dir)
            with torch.device(device):
                target_head = TargetHead(target_dir)
        with torch.no_grad():  # instead of TargetHead.load_weights: eyrie's random head (rows of norm ~1)
            target_head.fc.weight.copy_(random_target_head(dims, device, torch.float32, args.seed))
        target_head.freeze_weights()
        target_head = target_head.eval().to(device=device, dtype=dtype)  # as TargetHead.from_pretrained

        # ---- backend, optimizer, strategy, core: trainer.Trainer.__init__ ----------------------------------
        def optimizer_factory(draft_module):  # assembly._ConfiguredOptimizerFactory.__call__
            return BF16Optimizer(draft_module, lr=1e-4, max_grad_norm=0.5, warmup_ratio=0.015,
                                 lr_scheduler="cosine", total_steps=args.total_steps, offload_master=False)

        parallel = ParallelConfig.from_distributed(tp_size=1, sp_ulysses_size=1, sp_ring_size=1)
        backend = FSDPTrainingBackend(parallel, optimizer_factory=optimizer_factory)
        wrapped = backend.prepare_model(model, wrap=args.fsdp_sharding != "none", optimizer_target=model.draft_model)
        strategy = build_step(wrapped, target_head=target_head, compact_teacher=False, compact_teacher_chunk_size=None)
        if not isinstance(strategy, Eagle3TrainStrategy):
            raise RuntimeError(f"unexpected strategy {type(strategy).__name__}")
        core = TrainerCore(strategy, backend, accumulation_steps=1)
        strategy.trainable_module().train()  # TrainerController._fit
        trainable = sum(p.numel() for p in model.draft_model.parameters() if p.requires_grad)
        log(f"specforge built: wrapper {backend._wrapper_kind}, {trainable / 1e6:.1f}M trainable parameters, "
            f"{type(model.draft_model.midlayer.self_attn).__name__}, loss {loss_impl}")

        batch = specforge_batch(random_batch(dims, B, L, target_head.fc.weight, draft_ids, device, dtype, args.seed + 1, args.prompt_share), args.seed + 1)

        # ---- timing ---------------------------------------------------------------------------------------
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            build_peak_gib = torch.cuda.max_memory_allocated() / 2**30  # building's transients (fp32 inits) included
            torch.cuda.reset_peak_memory_stats()  # model + optimizer stay allocated, so the peak includes them
            resident_gib = torch.cuda.memory_allocated() / 2**30
            log(f"specforge resident after build: {resident_gib:.2f} GiB (build peak {build_peak_gib:.2f} GiB)")
        step_s, losses = [], []
        for i in range(args.warmup + args.steps):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            result = core.train_step(batch, ctx=StepContext(global_step=i, total_steps=args.total_steps))
            if cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
            if not result.optimizer_stepped:
                raise RuntimeError("TrainerCore.train_step did not step the optimizer")
            losses.append(float(result.loss))
            warm = i < args.warmup
            if not warm:
                step_s.append(elapsed)
            log(f"specforge {'warmup' if warm else 'step'} {i}: {elapsed * 1000:.1f} ms, loss {result.loss:.4f}, "
                f"acc {result.metrics.get('acc', float('nan')):.3f}, grad_norm {result.grad_norm}"
                + (f", peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB" if cuda else ""))
        median_s = statistics.median(step_s)
        peak_gib = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
        syncs = None
        if cuda:  # one more step, untimed: the host syncs it makes, by source line (as train_throughput.host_syncs)
            syncs = host_syncs(lambda: core.train_step(
                batch, ctx=StepContext(global_step=args.warmup + args.steps, total_steps=args.total_steps)))
            log(f"specforge: {sum(syncs.values())} host syncs in one step: {dict(syncs.most_common())}")
        out = {
            "tokens_per_second": B * L / median_s,
            "median_step_s": median_s,
            "ms_per_step": median_s * 1000,
            "step_ms": [s * 1000 for s in step_s],
            "step_times_s": step_s,
            "peak_gib": peak_gib,
            "peak_gib_incl_build": max(peak_gib, build_peak_gib) if cuda else None,
            "resident_gib_before_steps": resident_gib if cuda else None,
            "host_syncs": None if syncs is None else sum(syncs.values()),
            "host_sync_sites": None if syncs is None else dict(syncs),
            "losses": losses,
            "attention_backend": args.attention_backend,
            "attention_module": type(model.draft_model.midlayer.self_attn).__name__,
            "loss_impl": loss_impl,
            "fsdp": backend._wrapper_kind + ("" if args.fsdp_sharding == "none" else f" {args.fsdp_sharding}"),
            "dtype": str(dtype),
            "specforge": specforge_version,
            "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "versions": versions,
            "shape": dims,
            "seq_len": L,
            "batch": B,
            "ttt_steps": T,
            "warmup": args.warmup,
            "trainable_params": trainable,
            "cpu_smoke": cpu,
        }
    finally:
        dist.destroy_process_group()
    print(json.dumps(out), flush=True)
    return 0


def import_loss_with_triton_stub() -> None:
    """CPU smoke without triton: import specforge.core.loss (triton at its top level, for kernels never launched here)
    against a stand-in registered as sys.modules["triton"] only for that import. torch.compile's own imports come first,
    so torch has already found no triton and never sees the stand-in."""
    import types

    import torch

    torch.compile(lambda x: x, dynamic=None)  # the imports torch.compile's decorator makes (nothing runs)
    torch.compile(lambda x: x, dynamic=True)

    language = types.ModuleType("triton.language")
    language.constexpr = type("constexpr", (), {})  # the kernels' annotations; no kernel is launched
    triton = types.ModuleType("triton")
    triton.language = language
    triton.jit = lambda fn=None, **_options: fn if fn is not None else (lambda kernel: kernel)
    sys.modules["triton"], sys.modules["triton.language"] = triton, language
    try:
        importlib.import_module("specforge.core.loss")
    finally:
        del sys.modules["triton"], sys.modules["triton.language"]
    log("specforge: no triton here; specforge.core.loss imported against a stand-in (its kernels cannot run)")


def specforge_batch(batch: dict, seed: int):
    """train_throughput.random_batch's batch as SpecForge's offline loader delivers one (eagle3 normalize_offline_sample
    + collator): input_ids, attention_mask, loss_mask [B, L] long (the last position out, as its normaliser leaves it),
    target = the target's final states, hidden_state = the 3 aux states concatenated; target_repr "hidden_state"."""
    import torch

    from specforge.runtime.contracts import TrainBatch

    loss_mask = batch["loss_mask"].long()
    loss_mask[:, -1] = 0
    tensors = {"input_ids": batch["input_ids"], "attention_mask": torch.ones_like(loss_mask), "loss_mask": loss_mask,
               "target": batch["final"], "hidden_state": batch["aux"]}
    return TrainBatch(sample_ids=[f"random-{seed}-{i}" for i in range(loss_mask.shape[0])], strategy="eagle3", tensors=tensors,
                      metadata={"target_repr": "hidden_state"})


if __name__ == "__main__":
    sys.exit(main())
