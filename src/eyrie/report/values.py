"""Small rules every section collector shares, so a figure on the page is measured or absent, never made up.

A warning is a {section, text} record that the template shows in that section (and counts in
the header); rates and shares of nothing are None rather than 0 or a division error; a value
read from JSON counts as a number only if it is a finite int or float.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np


def warn(warnings: list, section: str, text: str) -> None:
    """Record a warning for the template to show in `section`."""
    warnings.append({"section": section, "text": text})


def rate(tokens: float, seconds: float) -> float | None:
    """Tokens (or bytes) per second (or per token); None over nothing."""
    return tokens / seconds if seconds > 0 else None


def share(part: float, whole: float) -> float | None:
    """part / whole; None when the whole is zero."""
    return part / whole if whole else None


def distinct(values: Iterable[Any]) -> list:
    """Distinct non-empty values in first-seen order."""
    return list(dict.fromkeys(v for v in values if v not in (None, "")))


def number(value: Any) -> float | int | None:
    """A JSON number as is; anything else (None, text, NaN) as None, so no made-up figure reaches the page."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return None if isinstance(value, float) and not np.isfinite(value) else value
