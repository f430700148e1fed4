"""How a value is written for a person: numbers, percentages, byte sizes, clipped text, shortened hashes.

Used both by the collectors (for notes and warnings written into the figures) and, as Jinja
filters, by the template (see page.py), so one number reads the same everywhere on the page.
"""

from __future__ import annotations

import json
from typing import Any, Iterable

from eyrie.core.disk import human_bytes

SAMPLE_CHARS = 1500  # enough of a message to judge it, short enough to keep the page light


def show(value: Any) -> str:
    """A manifest value for a warning: hashes shortened, lists as JSON."""
    if isinstance(value, str):
        return value[:12] if len(value) > 16 else value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return short(value)
    return json.dumps(value)


def short(hashes: Iterable[Any]) -> str:
    """12-character prefixes: enough to tell hashes apart on a page."""
    return ", ".join(str(h)[:12] for h in hashes)


def fmt_num(value: Any, digits: int = 1) -> str:
    """Thousands separators; floats with `digits` decimals; a dash for a missing value."""
    if value is None:
        return "—"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    return f"{value:,}" if isinstance(value, int) else f"{value:,.{digits}f}"


def fmt_bytes(value: Any) -> str:
    """Bytes in binary units, e.g. 637.0 KiB (eyrie.core.disk.human_bytes); the exact count stays in the tables next to it."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "—"
    return human_bytes(value)


def fmt_pct(value: float | None) -> str:
    """A share (0..1) as a percentage with one decimal; a dash for a missing value."""
    return "—" if value is None else f"{value * 100:.1f}%"


def clip(text: str, limit: int = SAMPLE_CHARS) -> str:
    """Text cut to `limit` characters, saying how much more there was."""
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit]}… [{len(text) - limit:,} more characters]"
