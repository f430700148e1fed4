"""What many tests build: workspaces and the readers that compare them (tiny targets, drafters and tokenizers join here).

Test modules import from here, never from each other.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
from conftest import REPO

from eyrie import config as cfg
from eyrie.plan import planned_outputs

TIMING_WORDS = ("second", "time", "elapsed", "per_s", "date", "digest")  # what may differ between two runs of the same job


def without_timings(value):
    if isinstance(value, dict):
        return {k: without_timings(v) for k, v in value.items() if not any(word in k.lower() for word in TIMING_WORDS)}
    if isinstance(value, list):
        return [without_timings(v) for v in value]
    return value


def content(path: Path):
    """What a file holds, timings aside: rows and eyrie metadata of a Parquet shard, tensors and manifest of a safetensors file."""
    if path.suffix == ".parquet":
        table = pq.read_table(path)
        meta = json.loads((table.schema.metadata or {}).get(b"eyrie", b"{}"))
        return table.replace_schema_metadata(None).to_pylist(), without_timings(meta)
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        manifest = json.loads((handle.metadata() or {}).get("manifest", "{}"))
    return {name: (t.dtype, t.shape, t.float().sum().item(), t.view(-1)[:64].tolist()) for name, t in tensors.items()}, without_timings(manifest)


def eyrie_verify(workdir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eyrie.cli", "verify", "-d", str(workdir)], capture_output=True, text=True, timeout=600)


def plans_of(workdir) -> tuple[set, set, set]:
    """(path, rule) of every result, as Snakemake's own DAG has them (`--summary`) and as eyrie.plan lists them, and
    those of eyrie.plan's that no job declares while nothing is lost (a dataset's prompt shards: Planned.declared_through)."""
    done = subprocess.run(  # noqa: PLW1510 -- the return code is asserted below
        [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(workdir), "--cores", "1", "--summary"],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split("\t") for line in done.stdout.splitlines()[1:] if "\t" in line]
    snakemake_plans = {(row[0], row[2]) for row in rows if not row[0].startswith("resources/")}
    planned = planned_outputs(cfg.load(workdir / "config.yaml"))
    return snakemake_plans, {(p.path, p.rule) for p in planned}, {(p.path, p.rule) for p in planned if p.declared_through}
