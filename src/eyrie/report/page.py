"""Render the page: the collected figures and the drawn plots through templates/report.html.j2.

The template ships as package data (pyproject: report/templates/*.j2). Everything it shows is
escaped unless it is markup this package made (the SVG plots); undefined names are errors, so a
figure the template expects but no collector provides fails loudly in the tests. Numbers are
written by the filters from formats.py: num, pct, size, clip.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2
from markupsafe import Markup

from eyrie.report.formats import clip, fmt_bytes, fmt_num, fmt_pct

TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"
TEMPLATE_NAME = "report.html.j2"


def render(figures: dict[str, Any], plots: dict[str, Markup | None]) -> str:
    """The HTML page for `figures` as returned by `collect`, with `plots` as drawn from them."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATE_DIR),
        autoescape=True,  # explicit: select_autoescape would not match the .j2 suffix
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(num=fmt_num, pct=fmt_pct, clip=clip, size=fmt_bytes)
    return env.get_template(TEMPLATE_NAME).render(f=figures, plots=plots)
