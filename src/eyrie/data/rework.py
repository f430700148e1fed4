"""Rework prompts: hand the target a text to work on, so that its replies copy from their prompt.

A dataset with a `rework` entry reads its source file as usual but makes one prompt per record from the
record's own assistant reply (the first one between min_chars and max_chars), put after an instruction that
makes a reply reproduce it: proofread it, format it, quote from it. The target's regenerated replies then copy
long stretches of their prompt, as replies to pasted documents, search results and code do in real traffic,
and the drafter learns to copy from its context. Why: on the H200 run, prompt lookup beat the drafter by about
2x on the held-out ShareGPT prompts that quote a list or repeat a sentence, and those four of sixteen held
the drafter's whole shortfall against the n-gram (`benchmarks/drafter_probe.py copy`; docs/RESULTS.md).

A record held out by the dataset named in `skip_heldout_of` gives no prompt: its reply is never trained on,
so that dataset's benchmark stays unseen. Which instruction a record gets depends on its id alone.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable
from dataclasses import asdict, dataclass

from eyrie.data.normalise import ROLE_MAP, SHAPES, normalise_record, shape_of
from eyrie.data.prompts import is_heldout, stable_unit
from eyrie.data.sources import BadRecord, RawRecord

# Each asks for the text back, whole or in part, as a user pasting a document would.
DEFAULT_INSTRUCTIONS = (
    "Proofread the following text and reply with the corrected text only.",
    "Fix the grammar and spelling of the following text, changing nothing else.",
    "Rewrite the following text in Markdown, keeping its wording.",
    "Format the following text as a bulleted list, keeping its wording.",
    "Repeat the following text exactly, then summarize it in one sentence.",
    "Quote the three most important sentences of the following text word for word, and say why each matters.",
    "Here is a draft. Return it with any mistakes fixed.",
    "Copy the following text, marking every name and number in bold.",
)


@dataclass
class ReworkCounts:
    """What the rework pass did with the source's records; in the prompts summary, for the report."""

    records_read: int = 0
    made: int = 0
    heldout_skipped: int = 0  # held out by skip_heldout_of's dataset
    without_text: int = 0  # no assistant reply within the length bounds
    instructions: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def instructions_of(settings: dict) -> tuple[str, ...]:
    return tuple(settings["instructions"]) or DEFAULT_INSTRUCTIONS


def rework_records(records: Iterable[RawRecord], settings: dict, *, fmt: str, file: str, heldout_of: tuple[str, float] | None,
                   counts: ReworkCounts) -> Generator[RawRecord, None, object]:
    """One openai-shaped record per usable source record: {"id": "rework:<source id>", "messages": [the user turn]}.
    Returns what `records` says of its file's truncation (a RecordReader's `truncation`), once exhausted.

    heldout_of: (dataset, heldout_fraction) whose held-out ids give no prompt. A record that cannot be read is passed
    on with its error, so the prompts job counts or raises it (on_bad_record) naming its file, location and field.
    """
    instructions = instructions_of(settings)
    counts.instructions = len(instructions)
    for record in records:
        counts.records_read += 1
        try:
            source = normalise_record(record, fmt, file)
        except BadRecord as error:  # its message names the source's shape, not the reworked one
            yield RawRecord(record.location, record.data, error=error)
            continue
        if heldout_of is not None and is_heldout(heldout_of[0], source.id, heldout_of[1]):
            counts.heldout_skipped += 1
            continue
        text = first_reply(record.data, fmt, settings["min_chars"], settings["max_chars"])
        if text is None:
            counts.without_text += 1
            continue
        instruction = instructions[int(stable_unit(f"rework:{source.id}") * len(instructions))]
        counts.made += 1
        yield RawRecord(record.location, {"id": f"rework:{source.id}", "messages": [{"role": "user", "content": f"{instruction}\n\n{text}"}]})
    return getattr(records, "truncation", None)


def first_reply(data: dict, fmt: str, min_chars: int, max_chars: int) -> str | None:
    """The record's first assistant reply whose stripped text is min_chars..max_chars long, stripped; else None.
    `data` is a record normalise_record read, so its shape is known and its contents are text."""
    turns_key, role_key, content_key = SHAPES[shape_of(data, fmt)]
    for turn in data.get(turns_key) or ():
        role = turn.get(role_key) if isinstance(turn, dict) else None
        content = turn.get(content_key) if isinstance(turn, dict) else None
        if isinstance(role, str) and ROLE_MAP.get(role.strip().lower()) == "assistant" and isinstance(content, str):
            text = content.strip()
            if min_chars <= len(text) <= max_chars:
                return text
    return None
