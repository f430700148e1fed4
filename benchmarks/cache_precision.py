"""Does a float8 hidden-state cache train as good a drafter as the bfloat16 one?

Given a finished pipeline working directory W (W/config.yaml, W/results/hidden/<dataset>/<shard>.safetensors
in bfloat16, W/results/vocab/draft_vocab.safetensors, the target under W/resources/models/ or model.path),
this re-stores every cache shard as float8_e4m3fn with eyrie.hidden.cache.convert_cache (extract_shard's own
quantizer) in a temp dir, trains two drafters with eyrie.training.train.train_drafter from the same seed and the
settings in W/config.yaml (one per cache), benchmarks both with eyrie.bench.benchmark.run_benchmark on W's held-out
prompts, and prints bytes/token and acceptance length of both and the relative change (target: within 2%).

GPU:        python benchmarks/cache_precision.py --workdir W --out cache_precision.json
CPU smoke:  python benchmarks/cache_precision.py --workdir W --small --out /tmp/cache_precision.json
            (W: a finished run of tests/configs/tiny.yaml, e.g. the e2e test's working directory)
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
import traceback
from pathlib import Path

import torch

from eyrie import config as eyrie_config
from eyrie.bench.benchmark import load_heldout_prompts, run_benchmark
from eyrie.hidden.cache import convert_cache, read_manifest
from eyrie.hidden.fp8 import FP8_NAME
from eyrie.target.model import load_tokenizer, model_fingerprint, template_fingerprint
from eyrie.training.train import train_drafter

TOLERANCE = 0.02  # the largest acceptable relative change in acceptance length


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True, type=Path, help="a finished pipeline working directory")
    parser.add_argument("--epochs", type=float, default=None, help="train both drafters for this many epochs instead of the workdir's train.epochs")
    parser.add_argument("--out", required=True, help="JSON file for all figures")
    parser.add_argument("--small", action="store_true", help="CPU smoke mode: train and benchmark on the CPU, at most 2 prompts per dataset")
    parser.add_argument("--tmpdir", default=None, help="where the fp8 caches and drafters go (default: the system temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (fp8 caches, drafters, benchmark JSONs)")
    return parser.parse_args()


class Workdir:
    """Where a finished pipeline run keeps what this benchmark reads."""

    def __init__(self, root: Path):
        self.root = root.resolve()
        self.config = eyrie_config.load(self.root / "config.yaml")
        model = self.config["model"]
        self.target = self.root / (model["path"] or f"resources/models/{model['name']}")
        self.vocab = self.root / "results" / "vocab" / "draft_vocab.safetensors"
        self.caches = sorted((self.root / "results" / "hidden").glob("*/*.safetensors"))
        if not self.caches:
            raise SystemExit(f"{self.root}/results/hidden: no cache shards; run the pipeline there first (snakemake results/drafter)")
        for path in (self.target, self.vocab):
            if not path.exists():
                raise SystemExit(f"{path}: missing; run the pipeline in {self.root} first")

    def heldout(self) -> dict[str, Path]:
        """dataset -> held-out prompts file, for the datasets that have one."""
        found = {name: self.root / "results" / "prompts" / name / "heldout.parquet" for name in self.config["datasets"]}
        return {name: path for name, path in found.items() if path.is_file()}


def bytes_per_token(paths: list[Path]) -> float:
    manifests = [read_manifest(p) for p in paths]
    return sum(m["file_bytes"] for m in manifests) / max(1, sum(m["tokens"] for m in manifests))


def make_fp8_copies(caches: list[Path], hidden_root: Path, out_root: Path) -> list[Path]:
    copies = []
    for path in caches:
        dtype = read_manifest(path)["dtype"]
        if dtype == FP8_NAME:
            raise SystemExit(f"{path}: already float8; this benchmark needs the bfloat16 (or float32) caches of hidden.dtype: bfloat16")
        copy = out_root / path.relative_to(hidden_root)
        convert_cache(path, copy, FP8_NAME)
        copies.append(copy)
    return copies


def train(work: Workdir, caches: list[Path], out_dir: Path, train_cfg: dict) -> dict:
    tokenizer = load_tokenizer(work.target, work.config["model"]["trust_remote_code"])
    return train_drafter(
        hidden_paths=[str(p) for p in caches],
        vocab_path=str(work.vocab),
        target_dir=str(work.target),
        out_dir=str(out_dir),
        state_dir=str(out_dir.with_name(out_dir.name + "-state")),
        drafter_cfg=work.config["drafter"],
        train_cfg=train_cfg,
        template_sha256=template_fingerprint(tokenizer),
        target_fingerprint=model_fingerprint(work.target),
        progress=True,
    )


def benchmark(work: Workdir, drafter_dir: Path, out_root: Path, label: str, small: bool, device: str) -> dict:
    """Acceptance length over every held-out dataset (round-weighted, as eyrie.bench.benchmark.summarise does within one)."""
    bench_cfg = {k: v for k, v in work.config["bench"].items() if k != "humaneval"}
    bench_cfg["min_acceptance_length"] = 0.0  # compare, do not gate
    if small:
        bench_cfg["prompts_per_dataset"] = min(2, bench_cfg["prompts_per_dataset"])
    per_dataset = {}
    for name, path in work.heldout().items():
        prompts = load_heldout_prompts(path, bench_cfg["prompts_per_dataset"])
        if not prompts:
            continue
        result = run_benchmark(
            target_dir=work.target, drafter_dir_or_model=drafter_dir, prompts=prompts, benchmark_name=name,
            bench_cfg=bench_cfg, out_path=out_root / f"bench-{label}-{name}.json", device=device,
            trust_remote_code=work.config["model"]["trust_remote_code"],
        )
        per_dataset[name] = {k: result[k] for k in ("mean_acceptance_length", "rounds", "prompts", "acceptance_rate_per_position", "lossless")}
    rounds = sum(d["rounds"] for d in per_dataset.values())
    emitted = sum(d["mean_acceptance_length"] * d["rounds"] for d in per_dataset.values() if d["rounds"])
    return {"acceptance_length": emitted / rounds if rounds else None, "rounds": rounds, "per_dataset": per_dataset}


def main() -> None:
    args = parse_args()
    work = Workdir(args.workdir)
    device = "cpu" if args.small else work.config["model"]["device"]
    train_cfg = dict(work.config["train"], **({"device": "cpu"} if args.small else {}))
    if args.epochs is not None:  # both drafters alike: a shorter, still side-by-side comparison
        train_cfg["epochs"] = args.epochs
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() and device != "cpu" else "cpu"
    print(f"torch {torch.__version__}, device {gpu}; workdir {work.root}; {len(work.caches)} cache shards", flush=True)

    tmp = Path(tempfile.mkdtemp(prefix="eyrie-cache-precision-", dir=args.tmpdir))
    figures = {"torch": torch.__version__, "device": gpu, "workdir": str(work.root), "train": train_cfg, "variants": {}, "errors": {}}
    try:
        t0 = time.perf_counter()
        fp8_caches = make_fp8_copies(work.caches, work.root / "results" / "hidden", tmp / "hidden-fp8")
        figures["convert_seconds"] = time.perf_counter() - t0
        for label, caches in (("bfloat16", work.caches), (FP8_NAME, fp8_caches)):
            entry = {"bytes_per_token": bytes_per_token(caches), "dtype": read_manifest(caches[0])["dtype"]}
            figures["variants"][label] = entry
            try:
                summary = train(work, caches, tmp / f"drafter-{label}", train_cfg)
                entry["train"] = {k: summary[k] for k in ("steps", "tokens", "seconds", "final_loss", "final_accuracy_per_step")}
                entry.update(benchmark(work, tmp / f"drafter-{label}", tmp, label, args.small, device))
                print(f"{label}: acceptance length {entry['acceptance_length']}, final loss {summary['final_loss']}", flush=True)
            except Exception as exc:  # the other variant's figures are still worth having
                figures["errors"][label] = repr(exc)
                print(f"{label}: FAILED", flush=True)
                traceback.print_exc()
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    base, fp8 = figures["variants"].get("bfloat16", {}), figures["variants"].get(FP8_NAME, {})
    if base.get("acceptance_length") and fp8.get("acceptance_length") is not None:
        figures["relative_acceptance_change"] = fp8["acceptance_length"] / base["acceptance_length"] - 1
        figures["within_tolerance"] = abs(figures["relative_acceptance_change"]) <= TOLERANCE
    Path(args.out).write_text(json.dumps(figures, indent=2))
    print_table(figures)


def print_table(figures: dict) -> None:
    print()
    print(f"{'cache':<16}{'bytes/token':>12}{'vs bf16':>9}{'acceptance':>12}{'final loss':>12}")
    base = figures["variants"].get("bfloat16", {})
    for label, entry in figures["variants"].items():
        size = entry["bytes_per_token"] / base["bytes_per_token"] if base.get("bytes_per_token") else float("nan")
        accept = entry.get("acceptance_length")
        loss = (entry.get("train") or {}).get("final_loss")
        print(f"{label:<16}{entry['bytes_per_token']:>12.1f}{size:>9.3f}{accept if accept is None else round(accept, 4)!s:>12}"
              f"{loss if loss is None else round(loss, 4)!s:>12}")
    for label, error in figures["errors"].items():
        print(f"{label:<16} FAILED: {error[:200]}")
    if "relative_acceptance_change" in figures:
        verdict = "within" if figures["within_tolerance"] else "OUTSIDE"
        print(f"acceptance length change fp8 vs bf16: {100 * figures['relative_acceptance_change']:+.2f}% ({verdict} +-{100 * TOLERANCE:.0f}%)")
    else:
        print("acceptance length change fp8 vs bf16: n/a (a variant failed or measured no rounds)")


if __name__ == "__main__":
    main()
