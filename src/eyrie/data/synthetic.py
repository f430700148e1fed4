"""Synthetic prompts, Magpie-style: for domains the data lacks, the target writes the user turns itself.

The target is given only its chat template's user prefix (the rendered text up to where a user message's
content starts, optionally after a system message) and samples on until its end-of-turn token: what it
wrote is a user prompt. Both are read off the template itself (`user_prefix`, `end_of_turn`), by rendering
a conversation whose user content is a sentinel and cutting there, so any template that writes the content
verbatim works (ChatML, Llama-3, Gemma, ...); one that does not is refused by name.

Samples are screened in order: one that never ended its turn within max_tokens is too long, one with no
text is empty, one shorter than min_chars too short, one whose normalised text (NFKC, case-folded,
whitespace collapsed) was kept before a duplicate. Sampling stops once `count` prompts are kept, or after
max_samples samples. Batch b is drawn under the seed (seed, b), so the same settings on the same model give
the same prompts, and a rerun after a crash gives what one uninterrupted run gives.

FORMAT: ``results/synthetic/<dataset>.parquet`` (written by the synthesize_prompts rule), one record per
kept prompt in the OpenAI shape eyrie.data.sources reads: ``id`` (a hash of the normalised text, so the
held-out split does not move when `count` changes), ``messages`` ([one user turn]) and ``topic``. Its eyrie
metadata holds the settings, the model and template fingerprints, the counts and a few examples
(`read_summary`, which the prompts job copies into the dataset's summary.json for the report).

Resuming: every batch's raw samples are appended to ``<partial_dir>/<settings key>.jsonl`` (fsynced per
batch); a kill loses at most the batch in flight, and samples drawn under other settings or another model
are never reused.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from eyrie.core.artifacts import PARQUET_KEY, check, read_parquet_metadata
from eyrie.core.atomic import write_parquet_atomically
from eyrie.core.errors import ConfigError, ContractError, InputFileError
from eyrie.target.chat_template import render

WRITTEN_BY = "synthesize_prompts"  # the Snakemake rule that writes the file, named in read errors
SYNTHETIC_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ("topic", pa.string()),
])
# The topic is put in a system message by default: the user turn is then the target's own words from its first
# token, a whole prompt in its own style, as Magpie steers its tasks. A user-turn prefix (topic_as: user_prefix)
# forces the first words instead, and every prompt of a topic then opens the same way. The system message is not
# kept with the prompt: the drafter learns the target's replies to plain user turns, which is what it serves.
DEFAULT_TOPIC_TEMPLATES = {
    "system": "You are an AI assistant that helps users with {topic}.",
    "user_prefix": "{topic}: ",
}
MAX_EXAMPLES = 5
EXAMPLE_CHARS = 400
# Two distinct contents: a template that renders the text before them differently is not cut at a stable point.
_SENTINELS = ("EYRIEUSERCONTENTSENTINEL", "EYRIEOTHERCONTENTSENTINEL")


# ---------------------------------------------------------------- the template's user turn


def _render_with(tokenizer, content: str, system: str | None) -> str:
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [{"role": "user", "content": content}]
    try:
        return render(tokenizer, messages, add_generation_prompt=False)
    except Exception as error:  # jinja's TemplateError, or a template's own raise_exception
        with_system = " with a system message" if system is not None else ""
        hint = "; set topic_as: user_prefix, which needs no system message" if system is not None else ""
        raise ContractError(f"the chat template cannot render a user turn{with_system}: {error}{hint}") from error


def _cut_at_sentinel(text: str, sentinel: str) -> tuple[str, str]:
    if text.count(sentinel) != 1:
        raise ContractError(
            f"the chat template writes a user message's content {text.count(sentinel)} times, not once verbatim; "
            "synthetic prompts need a template that does (use a file source for this target)"
        )
    before, _, after = text.partition(sentinel)
    return before, after


def user_prefix(tokenizer, system: str | None = None) -> str:
    """The rendered text up to where a user message's content starts (after `system`, if given)."""
    prefixes = {_cut_at_sentinel(_render_with(tokenizer, s, system), s)[0] for s in _SENTINELS}
    if len(prefixes) != 1:
        raise ContractError("the chat template renders the text before a user message differently for different contents; "
                            "synthetic prompts cannot be cut from it (use a file source for this target)")
    prefix = prefixes.pop()
    if system is not None and system.strip() not in prefix:
        raise ContractError(f"the chat template drops the system message {system!r}; set topic_as: user_prefix to steer by topic")
    return prefix


def end_of_turn(tokenizer) -> str:
    """The special token that closes a user turn in the template (ChatML's <|im_end|>, Llama-3's <|eot_id|>, ...)."""
    _, tail = _cut_at_sentinel(_render_with(tokenizer, _SENTINELS[0], None), _SENTINELS[0])
    special = set(tokenizer.all_special_tokens) | {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    closing = next((t for t in sorted(special, key=len, reverse=True) if t and tail.lstrip().startswith(t)), None)
    if closing is None:
        raise ContractError(
            f"the chat template closes a user turn with {tail[:40]!r}, not with a special token: the target has no token "
            "that ends the prompts it would write (use a file source for this target)"
        )
    return closing


def stop_token_ids(tokenizer, model) -> list[int]:
    """The end-of-turn token and every end-of-sequence token: a sample ends at the first of them."""
    stop = {tokenizer.convert_tokens_to_ids(end_of_turn(tokenizer))}
    configured = model.generation_config.eos_token_id
    stop |= set(configured if isinstance(configured, list) else [configured] if configured is not None else [])
    if tokenizer.eos_token_id is not None:
        stop.add(tokenizer.eos_token_id)
    return sorted(stop)


# ---------------------------------------------------------------- settings


def topic_template(settings: dict) -> str:
    return settings["topic_template"] or DEFAULT_TOPIC_TEMPLATES[settings["topic_as"]]


def max_samples(settings: dict) -> int:
    """Samples drawn at most: the configured cap, or four per prompt asked for."""
    return settings["max_samples"] or 4 * settings["count"]


def check_settings(settings: dict, where: str) -> None:
    """What the schema cannot say; `where` names the config entry (datasets.<name>.source.synthetic)."""
    template = settings["topic_template"]
    if template is not None:
        try:
            template.format(topic="x")
        except (KeyError, IndexError, ValueError) as error:
            raise ConfigError(f"{where}.topic_template: {template!r} is not a template with one {{topic}} field ({error!r}); "
                                 "write literal braces as {{ and }}") from None
    if settings["max_samples"] is not None and settings["max_samples"] < settings["count"]:
        raise ConfigError(f"{where}.max_samples: {settings['max_samples']} is below count {settings['count']}; "
                             "raise max_samples (or set it to null: 4 x count)")


@dataclass(frozen=True)
class Request:
    """What one sample is drawn from: the text the target continues, and what of it belongs to the prompt."""

    topic: str
    prompt: str  # the rendered prefix the target continues
    lead: str  # text of the user turn written for the target (topic_as: user_prefix), kept in the prompt


def requests(tokenizer, settings: dict) -> list[Request]:
    """One request per topic (or one unsteered), in config order; sample i uses request i mod their number."""
    if not settings["topics"]:
        return [Request("", user_prefix(tokenizer), "")]
    template = topic_template(settings)
    made = []
    for topic in settings["topics"]:
        steer = template.format(topic=topic)
        if settings["topic_as"] == "system":
            made.append(Request(topic, user_prefix(tokenizer, system=steer), ""))
        else:
            made.append(Request(topic, user_prefix(tokenizer) + steer, steer))
    return made


# ---------------------------------------------------------------- screening samples


def normalised(text: str) -> str:
    """What two prompts must share to count as duplicates: NFKC, case-folded, whitespace collapsed."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def prompt_id(text: str) -> str:
    return "synthetic:" + hashlib.sha1(normalised(text).encode("utf-8")).hexdigest()[:16]


DROPS = ("too_long", "empty", "too_short", "duplicates")


@dataclass
class Screen:
    """Samples screened in order: the prompts kept and why the others were dropped."""

    count: int
    min_chars: int
    kept: list[dict] = field(default_factory=list)
    dropped: Counter = field(default_factory=Counter)
    samples: int = 0  # drawn
    seen: set[str] = field(default_factory=set)

    @property
    def full(self) -> bool:
        return len(self.kept) >= self.count

    def add(self, request: Request, text: str, finished: bool) -> str:
        """Screen one sample; returns "kept" or the reason it was dropped. Samples after the count are drawn but unused."""
        self.samples += 1
        if self.full:
            return "unused"
        own = text.strip()  # the target's own words
        content = (request.lead + text).strip()
        key = normalised(content)
        reason = ("too_long" if not finished else "empty" if not own else "too_short" if len(own) < self.min_chars
                  else "duplicates" if key in self.seen else "kept")
        if reason == "kept":
            self.seen.add(key)
            self.kept.append({"id": prompt_id(content), "messages": [{"role": "user", "content": content}], "topic": request.topic})
        else:
            self.dropped[reason] += 1
        return reason

    def stats(self) -> dict:
        return {
            "count": self.count,
            "samples": self.samples,
            "kept": len(self.kept),
            **{reason: self.dropped.get(reason, 0) for reason in DROPS},
            "unused": self.samples - len(self.kept) - sum(self.dropped.values()),
        }


# ---------------------------------------------------------------- sampling


def settings_key(settings: dict, model_fingerprint: str, template_sha256: str) -> str:
    """Names the partial log: samples drawn under other settings, another model or template are never reused."""
    payload = json.dumps({"settings": settings, "model": model_fingerprint, "template": template_sha256}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def batch_seed(seed: int, batch: int) -> int:
    return int.from_bytes(hashlib.sha256(f"synthetic:{seed}:{batch}".encode()).digest()[:4], "little")


def sample_batch(model, tokenizer, prompts: list[list[int]], settings: dict, stop_ids: list[int], seed: int) -> list[dict]:
    """One left-padded sampled continuation per prompt, drawn under `seed`: {"text", "finished"} (finished: it reached a stop token)."""
    import torch
    from transformers import GenerationConfig

    torch.manual_seed(seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    generation = GenerationConfig(max_new_tokens=settings["max_tokens"], do_sample=True, temperature=settings["temperature"],
                                  top_p=settings["top_p"], top_k=0, eos_token_id=stop_ids, pad_token_id=pad)
    with torch.inference_mode():
        output = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=generation)
    samples = []
    for row in output[:, width:].tolist():
        stop_at = next((i for i, token in enumerate(row) if token in stop_ids), None)
        tokens = row if stop_at is None else row[:stop_at]
        samples.append({"text": tokenizer.decode(tokens, skip_special_tokens=True), "finished": stop_at is not None})
    return samples


def _load_partial(path: Path) -> list[list[dict]]:
    """The batches logged so far, in order; a torn last line (a kill mid-write) is cut off the file."""
    if not path.exists():
        return []
    raw = path.read_bytes()
    complete = raw.rfind(b"\n") + 1
    if complete < len(raw):
        with open(path, "r+b") as handle:
            handle.truncate(complete)
    batches = []
    for line in raw[:complete].splitlines():
        row = json.loads(line)
        if row["batch"] != len(batches):  # batches are logged in order; anything else is not this run's log
            raise InputFileError(f"{path}: line {len(batches) + 1} holds batch {row['batch']}, expected {len(batches)}; delete the file to start over")
        batches.append(row["samples"])
    return batches


def _append_partial(path: Path, batch: int, samples: list[dict], seconds: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps({"batch": batch, "samples": samples, "seconds": seconds}, ensure_ascii=False) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def progress(settings: dict, tokenizer, log_path: str | Path) -> dict:
    """What a partial log holds, read without touching it (eyrie plan): batches and samples drawn, prompts kept by the
    same screening, and the measured seconds per batch (None for logs written before batches were timed)."""
    path = Path(log_path)
    raw = path.read_bytes() if path.exists() else b""
    rows = [json.loads(line) for line in raw[: raw.rfind(b"\n") + 1].splitlines()]  # a torn last line is not counted
    made, size = requests(tokenizer, settings), settings["batch_size"]
    screen = Screen(settings["count"], settings["min_chars"])
    for row in rows:
        for i, sample in zip(range(row["batch"] * size, (row["batch"] + 1) * size), row["samples"]):
            screen.add(made[i % len(made)], sample["text"], sample["finished"])
    timed = [row["seconds"] for row in rows if "seconds" in row]
    return {"batches": len(rows), "samples": screen.samples, "kept": len(screen.kept), "full": screen.full,
            "seconds_per_batch": sum(timed) / len(timed) if timed else None}


# ---------------------------------------------------------------- the job


def synthesize_prompts(
    *,
    dataset: str,
    settings: dict,
    model,
    tokenizer,
    out_path: str | Path,
    partial_dir: str | Path,
    model_fingerprint: str,
    template_sha256: str,
) -> dict:
    """Sample user prompts from the target until `count` are kept (or max_samples are drawn); write them; return the stats."""
    where = f"datasets.{dataset}.source.synthetic"
    check_settings(settings, where)
    made = requests(tokenizer, settings)
    prompt_ids = [tokenizer(r.prompt, add_special_tokens=False)["input_ids"] for r in made]
    stop_ids = stop_token_ids(tokenizer, model)
    log = Path(partial_dir) / f"{settings_key(settings, model_fingerprint, template_sha256)}.jsonl"
    logged = _load_partial(log)

    screen = Screen(settings["count"], settings["min_chars"])
    limit, size = max_samples(settings), settings["batch_size"]
    batch = 0
    while not screen.full and batch * size < limit:
        indices = range(batch * size, min((batch + 1) * size, limit))
        if batch < len(logged):
            samples = logged[batch]
        else:
            prompts = [prompt_ids[i % len(made)] for i in indices]
            started = time.perf_counter()
            samples = sample_batch(model, tokenizer, prompts, settings, stop_ids, batch_seed(settings["seed"], batch))
            _append_partial(log, batch, samples, time.perf_counter() - started)
        for i, sample in zip(indices, samples):
            screen.add(made[i % len(made)], sample["text"], sample["finished"])
        print(f"synthesize {dataset}: batch {batch}: {screen.samples} samples, {len(screen.kept)}/{screen.count} kept"
              + (" (from the partial log)" if batch < len(logged) else ""), file=sys.stderr)
        batch += 1

    stats = screen.stats()
    if not screen.kept:
        raise InputFileError(
            f"{where}: the target wrote no usable prompt in {stats['samples']} samples "
            f"({', '.join(f'{stats[r]} {r}' for r in DROPS)}); raise max_tokens (too_long), lower min_chars (too_short) "
            "or raise temperature (duplicates)"
        )
    if not screen.full:
        print(f"synthesize {dataset}: only {len(screen.kept)} of {screen.count} prompts kept after {stats['samples']} samples "
              f"({where}.max_samples); writing those", file=sys.stderr)
    metadata = {
        "dataset": dataset,
        "settings": settings,
        "model_fingerprint": model_fingerprint,
        "template_sha256": template_sha256,
        "user_prefix": user_prefix(tokenizer),
        "end_of_turn": end_of_turn(tokenizer),
        "stats": stats,
        "examples": [{"topic": p["topic"], "text": p["messages"][0]["content"][:EXAMPLE_CHARS]} for p in screen.kept[:MAX_EXAMPLES]],
    }
    table = pa.Table.from_pylist(screen.kept, schema=SYNTHETIC_SCHEMA)
    write_parquet_atomically(table.replace_schema_metadata({PARQUET_KEY: json.dumps(metadata, ensure_ascii=False).encode()}), out_path)
    return stats


def read_summary(path: str | Path) -> dict:
    """What the prompts job reports of a synthetic file: counts, topics and examples (its digest checked first)."""
    check(path, "parquet", written_by=WRITTEN_BY)
    meta = read_parquet_metadata(path, written_by=WRITTEN_BY)
    settings = meta.get("settings") or {}
    return {**(meta.get("stats") or {}), "topics": settings.get("topics") or [], "topic_as": settings.get("topic_as"),
            "examples": meta.get("examples") or []}
