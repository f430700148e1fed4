"""How big the hidden-state cache will be before it is written, and whether the disk holds it.

A cache shard (eyrie.hidden.cache.storage_specs) stores per token the aux states [3H] and the final
state [H] in hidden.dtype, an int32 input id and an int8 loss-mask byte; float8 adds a float32 scale
per token and H-wide block (3 aux + 1 final). So a token costs 8H+5 bytes in bfloat16 (32,773 at
H = 4096), 16H+5 in float32 and 4H+21 in float8_e4m3fn (16,405 at H = 4096). Per sample the file adds
an int64 offset and the sample's id in the header's manifest; per shard, the header itself. These
fractions of a byte per token are bounded here, not computed, so a shard's figure is an upper bound
by at most a few KiB (tests/hidden/test_size.py holds it against files extraction wrote).

`estimate_cache` is `eyrie plan`'s "hidden-state cache" section: tokens measured from the token
shards that exist, estimated from the prompts and the config's plan guesses for the rest, times the
bytes per token, against the free space of the filesystem results/ lives on. `ensure_room` is the
extract job's refusal to start a shard the disk cannot hold.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from eyrie.core.artifacts import ArtifactError, read_parquet_metadata, read_safetensors_manifest
from eyrie.core.disk import free_space, human_bytes
from eyrie.core.schema import load_schema
from eyrie.tokens.shards import WRITTEN_BY as TOKENS_WRITTEN_BY
from eyrie.hidden.cache import HiddenCacheError, is_fp8, storage_specs
from eyrie.hidden.fp8 import FP8_NAME

# Bytes per element of every dtype storage_specs lays out (tests hold it equal to torch's element sizes).
ITEM_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "int64": 8, "int32": 4, "int8": 1}
HEADER_BYTES = 4096  # a header's fixed part: tensor entries, manifest fields, digest, padding (about 1.5 KiB measured)
ID_HEADER_BYTES = 2 * (64 + 4)  # a sample id of up to 64 characters in the manifest, JSON-escaped twice in the header
MARGIN_BYTES = 64 * 2**20  # left free beside a shard: logs, the other outputs of the job, the filesystem's own needs
HEADROOM = 0.10  # `eyrie plan` advises when the cache would leave less than this share of the free space


class CacheTooLargeError(HiddenCacheError):
    """The disk cannot hold the hidden-state cache (or the shard about to be written)."""


# --------------------------------------------------------------------------- bytes


def bytes_per_token(hidden_size: int, dtype: str) -> int:
    """Stored bytes per token at this width and hidden.dtype: 8H+5 in bfloat16, 4H+21 in float8_e4m3fn."""
    # One sample of one token, offsets left out (they are per sample): what the file adds per token.
    per_token = [(dtype_name, shape) for name, dtype_name, shape in storage_specs(dtype, 0, 1, int(hidden_size)) if name != "offsets"]
    return sum(ITEM_BYTES[dtype_name] * math.prod(shape) for dtype_name, shape in per_token)


def shard_bytes(hidden_size: int, dtype: str, samples: int, tokens: int, manifest: dict | None = None) -> int:
    """A shard file's size, bounded above by a few KiB: states and offsets exactly, the header bounded.

    With the manifest extraction will write, the header is bounded by it (its JSON escaped once more);
    without it, by HEADER_BYTES plus ID_HEADER_BYTES per sample.
    """
    if manifest is not None:
        header = HEADER_BYTES + 2 * len(json.dumps(manifest))
    else:
        header = HEADER_BYTES + samples * ID_HEADER_BYTES
    return 8 + header + 8 * (samples + 1) + tokens * bytes_per_token(hidden_size, dtype)


# --------------------------------------------------------------------------- what a config will produce


def target_hidden_size(model_dir: str | Path) -> int | None:
    """The target's hidden size from its config.json (the text model's for a multimodal one); None if not readable."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    size = text.get("hidden_size", config.get("hidden_size"))
    return size if isinstance(size, int) and size > 0 else None


def token_shard_counts(path: str | Path) -> tuple[int, int]:
    """(samples, tokens) of a token shard, from its footer (the tokenize job's stats) or else its n_tokens column."""
    stats = read_parquet_metadata(path, written_by=TOKENS_WRITTEN_BY).get("stats") or {}
    samples = pq.read_metadata(str(path)).num_rows
    if isinstance(stats.get("tokens"), int):
        return samples, stats["tokens"]
    n_tokens = pq.read_table(str(path), columns=["n_tokens"]).column("n_tokens")
    return samples, int(sum(n or 0 for n in n_tokens.to_pylist()))


def online_mode_exists() -> bool:
    """Whether this schema has hidden.mode (states computed during training, no cache)."""
    return "mode" in load_schema()["properties"]["hidden"]["properties"]


@dataclass
class ShardCount:
    dataset: str
    shard: str
    samples: float | None  # None: unknown (no prompts built and no limit)
    tokens: float | None
    measured: bool  # counted from its token shard; otherwise estimated
    samples_from: str = "its token shard"


@dataclass
class CacheEstimate:
    """`eyrie plan`'s hidden-state cache figures; sizes are None while the tokens or the hidden size are unknown."""

    dtype: str
    keep: bool
    online: bool  # hidden.mode: online, no cache at all
    hidden_size: int | None
    hidden_size_from: str
    counts: list[ShardCount]
    tokens_basis: str
    written_bytes: int  # cache shards already on disk (they take no more space)
    free_bytes: int
    free_path: Path

    @property
    def tokens(self) -> float | None:
        return None if any(c.tokens is None for c in self.counts) else sum(c.tokens for c in self.counts)

    @property
    def bytes_per_token(self) -> int | None:
        return None if self.hidden_size is None else bytes_per_token(self.hidden_size, self.dtype)

    def total_bytes(self, dtype: str | None = None) -> int | None:
        """The whole cache in hidden.dtype, or in `dtype` for the what-if of another storage dtype."""
        if self.hidden_size is None or self.tokens is None:
            return None
        return sum(shard_bytes(self.hidden_size, dtype or self.dtype, math.ceil(c.samples), math.ceil(c.tokens)) for c in self.counts)

    @property
    def to_write(self) -> int | None:
        total = self.total_bytes()
        return None if total is None else max(0, total - self.written_bytes)

    @property
    def fits(self) -> bool | None:
        """Whether what is left to write leaves at least HEADROOM of the free space free, and the extract jobs'
        MARGIN_BYTES beside the last shard (`has_room`, what each job checks); None when unknown."""
        if self.to_write is None:
            return None
        return self.to_write <= (1 - HEADROOM) * self.free_bytes and (self.to_write == 0 or has_room(self.to_write, self.free_bytes))


def estimate_cache(config: dict, workdir: str | Path, shards: list[tuple[str, str]], model_dir: str | Path) -> CacheEstimate:
    """The cache a config will write: tokens per shard (measured or estimated), bytes per token, free space.

    shards: every (dataset, shard) the config plans; model_dir: the target's directory (its config.json gives H).
    """
    workdir = Path(workdir)
    hidden = config["hidden"]
    counts = [_measured(workdir, d, s) for d, s in shards]
    measured = [c for c in counts if c.measured]
    per_sample, per_sample_basis = _tokens_per_sample(config, measured)
    for c in counts:
        if not c.measured:
            c.samples, c.samples_from = _expected_samples(workdir, config, c.dataset, c.shard)
            c.tokens = None if c.samples is None else c.samples * per_sample
    tokens_basis = _tokens_basis(counts, per_sample_basis)

    written, manifest_size = 0, None
    for d, s in shards:
        path = workdir / f"results/hidden/{d}/{s}.safetensors"
        if path.exists():
            written += path.stat().st_size
            if manifest_size is None:
                manifest_size = _manifest_hidden_size(path)
    size, size_from = target_hidden_size(workdir / model_dir), f"{model_dir}/config.json"
    if size is None and manifest_size is not None:
        size, size_from = manifest_size, "the cache shards already written"
    elif size is None:
        size_from = f"until the target is at {model_dir} (its config.json gives the hidden size)"
    free, where = free_space(workdir / "results" / "hidden")
    return CacheEstimate(
        dtype=hidden["dtype"],
        keep=hidden.get("keep", True),
        online=hidden.get("mode") == "online",
        hidden_size=size,
        hidden_size_from=size_from,
        counts=counts,
        tokens_basis=tokens_basis,
        written_bytes=written,
        free_bytes=free,
        free_path=where,
    )


def _measured(workdir: Path, dataset: str, shard: str) -> ShardCount:
    path = workdir / f"results/tokens/{dataset}/{shard}.parquet"
    if path.exists():
        try:
            samples, tokens = token_shard_counts(path)
            return ShardCount(dataset, shard, samples, tokens, True)
        except (ArtifactError, OSError):
            pass  # unreadable: estimated like a shard not built yet (eyrie verify names it)
    return ShardCount(dataset, shard, None, None, False)


def _manifest_hidden_size(path: Path) -> int | None:
    try:
        size = read_safetensors_manifest(path, "eyrie hidden-state cache").get("hidden_size")
    except ArtifactError:
        return None
    return size if isinstance(size, int) else None


def _tokens_per_sample(config: dict, measured: list[ShardCount]) -> tuple[float, str]:
    """Tokens per sample for a shard not tokenized yet: the mean of those that are, else the plan guesses."""
    samples = sum(c.samples for c in measured)
    if samples:
        mean = sum(c.tokens for c in measured) / samples
        return mean, f"{mean:,.0f} tokens per sample (the mean of the token shards)"
    plan, cap = config["plan"], config["tokenize"]["max_seq_len"]
    guess = plan["guess_prompt_tokens"] + plan["guess_completion_tokens"]
    capped = f", capped at tokenize.max_seq_len {cap:,}" if guess > cap else ""
    return min(guess, cap), (
        f"{min(guess, cap):,.0f} tokens per sample (plan.guess_prompt_tokens {plan['guess_prompt_tokens']:,.0f} "
        f"+ plan.guess_completion_tokens {plan['guess_completion_tokens']:,.0f}{capped})"
    )


def _expected_samples(workdir: Path, config: dict, dataset: str, shard: str) -> tuple[float | None, str]:
    """(samples, where from) of a shard not tokenized yet: its prompt shard's rows, else limit x (1 - held-out share) / shards."""
    prompts = workdir / f"results/prompts/{dataset}/{shard}.parquet"
    if prompts.exists():
        try:
            return pq.read_metadata(str(prompts)).num_rows, "the prompt shards"
        except OSError:
            pass
    spec = config["datasets"][dataset]
    if spec["limit"] is None:
        return None, "unknown"
    return spec["limit"] * (1 - spec["heldout_fraction"]) / spec["shards"], f"datasets.{dataset}.limit"


def _tokens_basis(counts: list[ShardCount], per_sample_basis: str) -> str:
    measured = sum(c.measured for c in counts)
    if measured == len(counts):
        return f"measured: {measured} of {len(counts)} token shards"
    unknown = sorted({c.dataset for c in counts if c.tokens is None})
    if unknown:
        return f"unknown: {', '.join(unknown)} has no limit and no prompt shards yet ({measured} of {len(counts)} token shards measured)"
    estimated = [c for c in counts if not c.measured]
    head = f"measured from {measured} of {len(counts)} token shards, the other {len(estimated)} estimated:" if measured else (
        "estimated, no token shard yet:"
    )
    sources = ", ".join(sorted({c.samples_from for c in estimated}))
    return f"{head} {sum(c.samples for c in estimated):,.0f} samples ({sources}) x {per_sample_basis}"


# --------------------------------------------------------------------------- advice and refusal


def remedies(dtype: str, keep: bool | None = True, fp8_bytes: int | None = None, current_bytes: int | None = None) -> list[str]:
    """What shrinks the cache or makes room, for the plan's advice and the extract job's refusal."""
    steps = []
    if not is_fp8(dtype):
        sizes = f" ({human_bytes(fp8_bytes)} instead of {human_bytes(current_bytes)})" if fp8_bytes and current_bytes else ""
        steps.append(f"set hidden.dtype: {FP8_NAME}: about half the bytes{sizes}, float32 scales per token and layer block")
    if keep is not False:
        steps.append(
            "set hidden.keep: false: the cache is deleted once the drafter is trained "
            "(frees the disk for the benchmark and later runs; the whole cache must still fit while training)"
        )
    if online_mode_exists():
        steps.append("set hidden.mode: online: the states are computed while training and no cache is written")
    steps.append("run in a working directory on a larger filesystem (snakemake -d DIR), or free space there")
    return steps


def advice(estimate: CacheEstimate) -> str | None:
    """None when the cache fits with HEADROOM to spare (or its size is unknown); else what to change."""
    if estimate.online or estimate.fits is not False:
        return None
    left = estimate.free_bytes - estimate.to_write
    short = [f"less than {HEADROOM:.0%} headroom"] if estimate.to_write > (1 - HEADROOM) * estimate.free_bytes else []
    if not has_room(estimate.to_write, estimate.free_bytes):  # the jobs themselves would refuse it
        short.append(f"less than the {human_bytes(MARGIN_BYTES)} margin each extract_hidden job keeps beside its shard: the jobs would refuse it")
    verdict = (
        f"does not fit: {human_bytes(estimate.to_write)} still to write, {human_bytes(estimate.free_bytes)} free"
        if left < 0
        else f"leaves {human_bytes(left)} ({left / max(1, estimate.free_bytes):.0%} of the free space), {' and '.join(short)}"
    )
    steps = remedies(estimate.dtype, estimate.keep, estimate.total_bytes(FP8_NAME), estimate.total_bytes())
    return f"the cache {verdict}; to make room, any of:\n" + "\n".join(f"    - {step}" for step in steps)


def format_estimate(estimate: CacheEstimate) -> str:
    """`eyrie plan`'s "hidden-state cache" section."""
    e = estimate
    head = f"hidden-state cache (hidden.dtype {e.dtype}, hidden.keep {str(e.keep).lower()}):"
    if e.online:
        return f"{head}\n  hidden.mode online: no cache is written, the target's states are computed while training"
    tokens = "unknown" if e.tokens is None else f"{e.tokens:,.0f}" if all(c.measured for c in e.counts) else f"~{e.tokens:,.0f}"
    bpt = e.bytes_per_token
    lines = [
        head,
        f"  tokens:      {tokens} ({e.tokens_basis})",
        f"  bytes/token: unknown {e.hidden_size_from}" if bpt is None else f"  bytes/token: {bpt:,} (H = {e.hidden_size:,} from {e.hidden_size_from})",
    ]
    total = e.total_bytes()
    if total is not None:
        written = f"; {human_bytes(e.written_bytes)} of it written already" if e.written_bytes else ""
        lines.append(f"  cache size:  {human_bytes(total)} ({total:,} bytes, headers and offsets included{written})")
    else:
        lines.append("  cache size:  unknown until the tokens and the hidden size are known")
    lines.append(f"  free space:  {human_bytes(e.free_bytes)} on the filesystem of {e.free_path}")
    if e.fits:
        lines.append(f"  fits: {human_bytes(e.free_bytes - e.to_write)} stays free")
    elif (text := advice(e)) is not None:
        lines.append(f"  {text}")
    return "\n".join(lines)


def has_room(needed: int, free_bytes: int) -> bool:
    """Whether `needed` bytes can be written with MARGIN_BYTES to spare: the extract job's check, and the plan's."""
    return needed + MARGIN_BYTES <= free_bytes


def ensure_room(out_path: str | Path, needed: int, dtype: str) -> None:
    """Refuse (CacheTooLargeError, before any byte is written) a shard of `needed` bytes the disk cannot hold with MARGIN_BYTES to spare."""
    free_bytes, where = free_space(Path(out_path).parent)
    if has_room(needed, free_bytes):
        return
    steps = "; ".join(remedies(dtype, keep=None))
    raise CacheTooLargeError(
        f"{out_path}: this hidden-state cache shard needs {human_bytes(needed)} ({needed:,} bytes) plus a "
        f"{human_bytes(MARGIN_BYTES)} margin, but {where} has {human_bytes(free_bytes)} ({free_bytes:,} bytes) free; "
        f"nothing was written. `eyrie plan` shows the whole cache's size. To make room, any of: {steps}; then rerun the job"
    )


def ensure_shard_fits(tokens_path: str | Path, out_path: str | Path, hidden_size: int | None, dtype: str) -> None:
    """The extract job's early check, before the target is loaded: the token shard's counts x bytes per token."""
    if hidden_size is None:
        return  # extract_shard checks again once the model gives the width
    samples, tokens = token_shard_counts(tokens_path)
    ensure_room(out_path, shard_bytes(hidden_size, dtype, samples, tokens), dtype)
