"""The regenerate job: answer one prompt shard with the target, turn by turn, resumable at any moment.

Multi-turn conversations are answered on the target's own earlier replies. Each finished
turn goes to a PartialLog as soon as its batch (in-process engine) or its request (server
engines) ends; the declared Parquet output is written once, atomically, when every turn of
every prompt is done. Which engine answered does not show in the output's schema.

Engines come in two shapes:
- batch engines (`TransformersEngine`): `prompt_ids(messages)` and `generate(prompts, settings)`;
  this module plans the batches and writes the log;
- conversation engines (`OpenAIEngine`): `regenerate(conversations, settings, log, progress)`,
  which answer every pending turn themselves (concurrently) with the same semantics: turn t+1
  is sent only after turn t finished, on the model's own reply, and each row goes to `log`.

The completions schema, the partial-log row and each request's identity (settings key, seed)
belong to eyrie.generation.conversations.

A server engine first says what it serves (`identify()`: the served model, checked against
model.path); that identity names the resume log beside the settings key, so turns a different
served model answered are never reused, and it is recorded in the shard's metadata (`served`).

Failed turns (a server's rejection other than a prompt over its context, a reply that stayed
empty: error rows) are never written into a shard. The job saves every other turn and then
fails, naming them (`FailedTurns`): the shard stays missing, so a plain rerun (no --forcerun) runs
the job again, which reuses every saved turn and asks exactly the failed ones again (`resume`
drops error rows). `eyrie verify` lists them meanwhile. So nothing failed is trained on, and
nothing fails silently: Snakemake's "Nothing to be done" means every turn has a real answer.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pyarrow as pa
from tqdm import tqdm

from eyrie.core.artifacts import PARQUET_KEY
from eyrie.core.atomic import write_parquet_atomically
from eyrie.core.batching import batches_by_tokens
from eyrie.core.errors import EyrieError
from eyrie.generation.conversations import (
    ENDS_CONVERSATION,
    ERROR,
    PROMPT_TOO_LONG,
    REPLY_FIELDS,
    Conversation,
    completions_schema,
    empty_reply,
    load_conversations,
    make_row,
    settings_key,
    stable_seed,
    to_record,
)
from eyrie.generation.partial import PartialLog, log_path

MAX_ERROR_EXAMPLES = 20


class FailedTurns(EyrieError):
    """Turns a server failed (rejected, or answered with nothing): the shard is not written, a rerun asks them again."""


def resume(conversations: list[Conversation], done: dict[tuple[str, int], dict]) -> int:
    """Attach finished turns from the log; a turn whose user text changed since is not reused.

    Error rows and rows with an empty reply (said_nothing) are not reused: that turn is asked again (the log keeps
    the newest row per turn). An engine that accepts empty replies logs them as finished ('stop'); reused, they would be trained on.
    """
    reused = 0
    for conversation in conversations:
        for turn, user in enumerate(conversation.users):
            row = done.get((conversation.id, turn))
            if row is None or row["user"] != user or row["finish_reason"] == ERROR or said_nothing(row):
                break
            conversation.answered.append(row)
            reused += 1
            if row["finish_reason"] == PROMPT_TOO_LONG:
                break
    return reused


def said_nothing(row: dict) -> bool:
    """Whether a logged turn's reply is empty as a server's reply is judged (conversations.empty_reply): no text,
    reasoning or tool call. A prompt_too_long row is empty by design: it ends the conversation, it is not a reply."""
    if row["finish_reason"] in ENDS_CONVERSATION:
        return False
    return empty_reply({"content": row.get("reply"), **{key: row.get(key) for key in REPLY_FIELDS}})


def shard_stats(records: list[dict], reused_turns: int, conversations: list[Conversation] | None = None, run: dict | None = None) -> dict:
    """Counts, throughput and errors of a finished shard (stored in the Parquet metadata).

    generation_seconds sums the rows' `seconds`; each engine attributes time so that this sum is
    the wall time spent generating (a batch's time split over its turns by tokens; a server
    engine's busy wall time booked to each row as it finishes), so tokens_per_second is honest
    under any concurrency. `run` holds this run's facts (engine, wall and busy seconds, ...).
    """
    finish_reasons: dict[str, int] = {}
    for record in records:
        for reason in record["finish_reasons"]:
            finish_reasons[reason] = finish_reasons.get(reason, 0) + 1
    completion_tokens = sum(sum(r["completion_tokens"]) for r in records)
    seconds = sum(r["seconds"] for r in records)
    rows = [row for c in conversations or [] for row in c.answered]
    errors = [row for row in rows if row["finish_reason"] == ERROR]
    latencies = sorted(row["latency"] for row in rows if row.get("latency") is not None)
    return {
        "records": len(records),
        "turns": sum(len(r["finish_reasons"]) for r in records),
        "completion_tokens": completion_tokens,
        "prompt_tokens": sum(sum(r["prompt_tokens"]) for r in records),
        "generation_seconds": seconds,
        "tokens_per_second": completion_tokens / seconds if seconds > 0 else None,
        "finish_reasons": finish_reasons,
        "resumed_turns": reused_turns,
        "errors": len(errors),
        "error_examples": [{"id": r["id"], "turn": r["turn"], "error": r.get("error", "")} for r in errors[:MAX_ERROR_EXAMPLES]],
        "latency_seconds": _summary(latencies),
        "run": run or {},
        # Conversations ended after a reply whose tool calls are not the source's (its results answer other calls).
        **({"tool_calls_differ": ended} if (ended := sum(bool(row.get("ends_conversation")) for row in rows)) else {}),
    }


def _summary(values: list[float]) -> dict | None:
    if not values:
        return None
    pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
    return {"n": len(values), "mean": sum(values) / len(values), "p50": pick(0.5), "p90": pick(0.9), "max": values[-1]}


def _resumed(prompts_path: str, partial_dir: str, settings: dict, model_fingerprint: str,
             served: str | None = None) -> tuple[list[Conversation], PartialLog, int]:
    """The shard's conversations with the finished turns of its resume log attached, the log, and how many were reused.

    served: the identity key of the model a server serves (None: answered in process); it names the log too."""
    conversations = load_conversations(prompts_path, settings["max_turns"])
    log = PartialLog(log_path(partial_dir, settings_key(settings, model_fingerprint), served))
    return conversations, log, resume(conversations, log.load())  # this job owns the log: load() repairs a torn tail


def shard_answered(prompts_path: str, partial_dir: str, settings: dict, model_fingerprint: str) -> bool:
    """Whether the resume log already holds every turn of the shard as `resume` reuses it (no error, no empty reply): then
    it needs no engine (no model load, no server)."""
    conversations, _, _ = _resumed(prompts_path, partial_dir, settings, model_fingerprint)
    return all(c.ended for c in conversations)


def regenerate_shard(
    *,
    prompts_path: str,
    out_path: str,
    partial_dir: str,
    dataset: str,
    shard: str,
    settings: dict,
    engine_settings: dict,
    engine,
    model_fingerprint: str,
    template_sha256: str,
) -> dict:
    """Answer every turn of every prompt in the shard; returns the shard's stats.

    engine may be None when shard_answered said every turn is in the resume log. Raises FailedTurns (after saving
    every answered turn, writing no shard) when turns failed.
    """
    served = engine.identify() if hasattr(engine, "identify") else None  # before any request: what answers
    conversations, log, reused = _resumed(prompts_path, partial_dir, settings, model_fingerprint, served["key"] if served else None)
    if engine is None and not all(c.ended for c in conversations):
        raise ValueError(f"{prompts_path}: turns are left to answer and no engine was opened")

    progress = ShardProgress(conversations, f"regenerate {dataset}/{shard}")
    try:
        if engine is None:  # every turn resumed
            run = {"engine": None, "wall_seconds": 0.0, "busy_seconds": 0.0}
        elif hasattr(engine, "regenerate"):
            run = engine.regenerate(conversations, settings, log, progress)
        else:
            run = _regenerate_in_batches(conversations, settings, engine_settings, engine, log, progress)
    finally:
        progress.close()

    failed = [row for c in conversations for row in c.answered if row["finish_reason"] == ERROR]
    if failed:
        raise FailedTurns(failed_turns_message(f"{dataset}/{shard}", failed, log.path, out_path))
    records = [to_record(c, dataset, settings) for c in conversations]
    stats = shard_stats(records, reused, conversations, run)
    metadata = {
        "dataset": dataset,
        "shard": shard,
        "settings": settings,
        "model_fingerprint": model_fingerprint,
        "template_sha256": template_sha256,
        "stats": stats,
    }
    if served is not None:
        metadata["served"] = served
    table = pa.Table.from_pylist(records, schema=completions_schema(records))
    table = table.replace_schema_metadata({PARQUET_KEY: json.dumps(metadata).encode()})
    write_parquet_atomically(table, out_path)
    too_long = [r for c in conversations for r in c.answered if r["finish_reason"] == PROMPT_TOO_LONG and r.get("error")]
    if too_long:
        print(f"regenerate {dataset}/{shard}: {len(too_long)} prompt(s) refused by the server as over its context, kept as "
              f"{PROMPT_TOO_LONG!r} (first: {too_long[0]['error'][:200]})", file=sys.stderr)
    return stats


def failed_turns_message(shard: str, failed: list[dict], log: Path, out_path: str) -> str:
    """What FailedTurns says: how many, the first few with the server's words, and how to ask them again."""
    shown = "; ".join(f"{r['id']} turn {r['turn']}: {str(r.get('error', ''))[:200]}" for r in failed[:5])
    more = f" (and {len(failed) - 5} more)" if len(failed) > 5 else ""
    return (
        f"regenerate {shard}: {len(failed)} turn(s) failed (the server rejected them or answered with nothing): {shown}{more}. "
        f"Nothing failed is kept as data: {out_path} is not written; every answered turn is saved in {log}. "
        "Fix the server (or the prompt), then rerun snakemake as before (no --forcerun): the job asks exactly these turns again"
    )


class ShardProgress:
    """A tqdm bar over the turns left, with requests in flight, tokens/s and the ETA of the shard."""

    def __init__(self, conversations: list[Conversation], desc: str):
        self.conversations = conversations
        remaining = sum(len(c.users) - len(c.answered) for c in conversations if not c.ended)
        self.bar = tqdm(
            total=remaining,
            desc=desc,
            unit="turn",
            file=sys.stderr,
            mininterval=0.5 if sys.stderr.isatty() else 10,
            dynamic_ncols=True,
        )
        self.tokens = 0
        self.errors = 0
        self.finished = sum(c.ended for c in conversations)

    def turn_done(self, conversation: Conversation, row: dict) -> None:
        """One finished turn (already appended to conversation.answered); an ended conversation skips its later turns."""
        self.tokens += row["completion_tokens"]
        self.errors += row["finish_reason"] == ERROR
        skipped = 0
        if conversation.ended:
            self.finished += 1
            skipped = len(conversation.users) - row["turn"] - 1
        self.bar.update(1 + skipped)

    def show(self, busy_seconds: float, in_flight: int | None = None) -> None:
        parts = [f"prompts {self.finished}/{len(self.conversations)}"]
        if in_flight is not None:
            parts.append(f"in flight {in_flight}")
        if busy_seconds > 0:
            parts.append(f"{self.tokens / busy_seconds:.1f} tok/s")
        if self.errors:
            parts.append(f"errors {self.errors}")
        self.bar.set_postfix_str(", ".join(parts), refresh=False)

    def close(self) -> None:
        self.bar.close()


def _regenerate_in_batches(conversations, settings, engine_settings, engine, log, progress) -> dict:
    """The batch-engine loop: all pending turns of one round, sorted into token-budget batches."""
    wall_started = time.perf_counter()
    busy_seconds, unparsed = 0.0, 0
    while pending := [c for c in conversations if not c.ended]:
        requests = [(c, len(c.answered)) for c in pending]
        # The record's tools only where it has them: an engine need not know of tools to answer plain chat.
        prompt_ids = [engine.prompt_ids(c.messages(upto_turn=turn), *([c.tools] if c.tools else [])) for c, turn in requests]

        too_long = [i for i, ids in enumerate(prompt_ids) if len(ids) > settings["max_prompt_tokens"]]
        if too_long:
            rows = [_row(requests[i], PROMPT_TOO_LONG, "", len(prompt_ids[i]), 0, 0.0) for i in too_long]
            log.append(rows)
            for i, row in zip(too_long, rows):
                requests[i][0].answered.append(row)
                progress.turn_done(requests[i][0], row)
        fitting = [i for i in range(len(requests)) if i not in set(too_long)]

        lengths = [len(prompt_ids[i]) for i in fitting]
        for batch in batches_by_tokens(lengths, engine_settings["max_batch_tokens"], extra=settings["max_new_tokens"], max_size=engine_settings["max_batch_size"]):
            members = [fitting[b] for b in batch]
            if settings["temperature"] > 0:
                import torch

                torch.manual_seed(stable_seed(settings["seed"], requests[members[0]][0].id, requests[members[0]][1]))
            started = time.perf_counter()
            results = engine.generate([prompt_ids[i] for i in members], settings)
            elapsed = time.perf_counter() - started
            batch_tokens = sum(r.completion_tokens for r in results) or 1
            rows = [
                # Each turn carries its share of the batch time, so sums over any subset give throughput.
                _row(requests[i], r.finish_reason, r.reply, r.prompt_tokens, r.completion_tokens, elapsed * r.completion_tokens / batch_tokens, latency=elapsed,
                     **r.extra)
                for i, r in zip(members, results)
            ]
            log.append(rows)
            for i, row in zip(members, rows):
                requests[i][0].answered.append(row)
                progress.turn_done(requests[i][0], row)
            busy_seconds += elapsed
            unparsed += sum(row.get("tool_calls_unparsed", 0) for row in rows)
            progress.show(busy_seconds)
    return {
        "engine": "transformers",
        "wall_seconds": time.perf_counter() - wall_started,
        "busy_seconds": busy_seconds,
        "max_batch_size": engine_settings["max_batch_size"],
        **({"batching_fallback": engine.fallback} if getattr(engine, "fallback", None) else {}),  # why batching: static ran padded
        # Tool-call blocks this run kept inline in the reply text: not the JSON calls the parser reads.
        **({"tool_calls_unparsed": unparsed} if unparsed else {}),
    }


def _row(request, finish_reason: str, reply: str, prompt_tokens: int, completion_tokens: int, seconds: float, **extra) -> dict:
    conversation, turn = request
    return make_row(conversation, turn, finish_reason, reply, prompt_tokens, completion_tokens, seconds, **extra)
