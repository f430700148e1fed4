"""`eyrie verify`: every file a config plans, checked on disk, and the one `snakemake` command that repairs them.

Snakemake decides what to rebuild from modification times, params and its own records: it does not read
files. A missing intermediate under an up-to-date report.html is never rebuilt for `snakemake report.html`,
and a file changed inside a directory output (results/drafter/) never shows in `snakemake -n`. This check
reads them. Each planned file (eyrie.plan.planned_outputs) is

- missing: not there. The default target (`rule all`, which asks for every planned file) rebuilds it.
- corrupt: cannot be read as its kind, or its bytes differ from the content digest its writer recorded in it
  (eyrie.core.digest); a directory output also when a file its writer wrote is gone or one it did not write
  appeared. Snakemake would not notice: the command forces these (--forcerun).
- stale: older than a planned file it is made from whose content changed since (Snakemake's own rule: a newer input
  with the checksum Snakemake recorded for it reruns nothing), or completions made under other generation settings.
  Snakemake reruns these itself; listed so that the user knows before running it.

- failed turns: a missing completions shard whose resume log holds turns the server failed (rejected, or answered
  with nothing; eyrie.generation.regenerate writes no shard while one is left). The default target's rerun asks
  exactly those again, reusing every saved turn; listed with the server's words.
- stray: a temporary file a killed job left beside its output (`.<name>.<hex>.tmp`, eyrie.core.atomic) under
  results/: it holds no result, only disk space. Listed with the command that removes them; while a Snakemake run
  holds the directory's lock they may be its own, and the listing says to wait.

What is made from a rebuilt file reruns after it (Snakemake's own rule), so the command names only the
files above, not their consumers. Files of hidden.keep: false are expected to be gone once the drafter is
trained. --quick reads only headers and footers (seconds for a whole workspace); the full check hashes every
byte (about one disk read for the xxh3-hashed hidden cache, seconds per GB of sha256 elsewhere).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from eyrie import config as cfg
from eyrie.core.artifacts import read_parquet_metadata
from eyrie.core.digest import kind_of, verify_artifact
from eyrie.core.errors import ArtifactError
from eyrie.plan import Planned, planned_outputs

MISSING, CORRUPT, STALE, STRAY = "missing", "corrupt", "stale", "stray"
TEMPORARY = re.compile(r"^\..+\.[0-9a-f]{8}\.(tmp|old)$")  # eyrie.core.atomic's temporaries beside an output
# What each directory output's writer puts in it (eyrie.drafter.checkpoint, eyrie.drafter.speculators_export).
DIRECTORY_FILES = {
    "results/drafter": {"config.json", "model.safetensors", "training_log.json"},
    "results/drafter-speculators": {"config.json", "model.safetensors"},
}
SNAKEMAKE_TIMESTAMP = ".snakemake_timestamp"  # Snakemake's own marker in every directory() output


@dataclass(frozen=True)
class Finding:
    state: str  # MISSING, CORRUPT or STALE
    path: str
    rule: str
    detail: str = ""
    forcerun_target: str = ""  # what `snakemake --forcerun` names to rewrite it (Planned.forcerun_target)


@dataclass
class Verification:
    workdir: Path
    config_path: Path
    checked: int  # planned files looked at (temporary ones already deleted are not counted)
    findings: list[Finding]
    running: bool = False  # a Snakemake run holds the directory's lock

    @property
    def ok(self) -> bool:
        return not self.findings

    def of(self, state: str) -> list[Finding]:
        return [f for f in self.findings if f.state == state]


# --------------------------------------------------------------------------- one file


def _mtime(path: Path) -> float:
    """The time Snakemake compares: a directory output's timestamp marker if it has one, else the path's own."""
    marker = path / SNAKEMAKE_TIMESTAMP
    return (marker if path.is_dir() and marker.exists() else path).stat().st_mtime


def _readable(path: Path) -> str | None:
    """The quick check (headers and footers only): what keeps `path` from being read as its kind, or None.

    The hook where no content digest is checked (--quick): it opens Parquet footers, safetensors headers and
    JSON, as the stage that reads the file would, and names the file.
    """
    if path.is_dir():
        problems = [p for child in sorted(path.iterdir()) if kind_of(child) and (p := _readable(child))]
        return "; ".join(problems) or None
    kind = kind_of(path)
    try:
        if kind == "parquet":
            read_parquet_metadata(path)
        elif kind == "safetensors":
            from safetensors import safe_open

            try:
                with safe_open(str(path), framework="pt") as handle:
                    handle.keys()
            except Exception as exc:  # safetensors raises its own error types for unreadable headers
                return f"{path}: not a readable safetensors file ({exc})"
        elif kind == "json":
            json.loads(path.read_bytes())
        elif path.stat().st_size == 0:
            return f"{path}: empty"
    except ArtifactError as exc:
        return str(exc)
    except (OSError, ValueError) as exc:
        return f"{path}: not readable {kind or 'file'} ({exc})"
    return None


def _directory_members(path: Path, relative: str) -> str | None:
    """A directory output holds exactly what its writer wrote (plus Snakemake's marker)."""
    expected = DIRECTORY_FILES.get(relative)
    if expected is None:
        return None
    present = {p.name for p in path.iterdir()} - {SNAKEMAKE_TIMESTAMP}
    problems = [f"{path / name}: missing (its writer always writes it)" for name in sorted(expected - present)]
    problems += [f"{path / name}: not written by the pipeline (a stray or replaced file)" for name in sorted(present - expected)]
    return "; ".join(problems) or None


def content_problem(path: Path, relative: str, quick: bool = False) -> str | None:
    """What is wrong with an existing planned file's content, as one line naming the file, or None."""
    if path.is_dir():
        members = _directory_members(path, relative)
        if members:
            return members
    if quick:
        return _readable(path)
    return verify_artifact(path)


def _settings_problem(path: Path, config: dict) -> str | None:
    """Completions made under generation settings other than the config's (Snakemake reruns them: params)."""
    dataset = path.parent.name
    meta = read_parquet_metadata(path)
    settings = meta.get("settings")
    if settings is not None and dataset in config["datasets"] and settings != cfg.generation_settings(config, dataset):
        return "made under other generation settings than the config's"
    return None


# --------------------------------------------------------------------------- the workspace


def verify_workspace(config: dict, workdir: str | Path = ".", config_path: str | Path = "config.yaml", quick: bool = False) -> Verification:
    """Check every planned file of `config` under `workdir`."""
    workdir = Path(workdir)
    planned = planned_outputs(config)
    findings: list[Finding] = []
    present: dict[str, float] = {}
    checked = 0
    failed = _failed_turns(config, workdir)
    for item in planned:
        path = workdir / item.path
        if not path.exists():
            if item.kept:
                findings.append(Finding(MISSING, item.path, item.rule, failed.get(item.path, "")))
                checked += 1
            continue  # a temporary cache shard: gone once the drafter is trained
        checked += 1
        problem = content_problem(path, item.path, quick)
        if problem:
            findings.append(Finding(CORRUPT, item.path, item.rule, problem, item.forcerun_target))
            continue
        present[item.path] = _mtime(path)
        stale = _stale(item, path, present, config, workdir)
        if stale:
            findings.append(Finding(STALE, item.path, item.rule, stale))
    findings += [Finding(STRAY, str(p.relative_to(workdir)), "", f"a killed job's temporary file, {p.stat().st_size:,} bytes")
                 for p in stray_temporaries(workdir)]
    return Verification(workdir, Path(config_path), checked, findings, running=_snakemake_running(workdir))


def stray_temporaries(workdir: Path) -> list[Path]:
    """Temporary files beside outputs under results/ (`.<name>.<hex>.tmp`): what a killed job leaves."""
    results = workdir / "results"
    return sorted(p for p in results.rglob(".*") if p.is_file() and TEMPORARY.match(p.name)) if results.is_dir() else []


def _snakemake_running(workdir: Path) -> bool:
    locks = workdir / ".snakemake" / "locks"
    return locks.is_dir() and any(locks.iterdir())


def _failed_turns(config: dict, workdir: Path) -> dict[str, str]:
    """completions shard -> what its resume log says failed, for shards not written because turns failed."""
    from eyrie.generation.conversations import ERROR, settings_key
    from eyrie.generation.partial import PartialLog, logs_of
    from eyrie.plan import model_dir

    target = workdir / model_dir(config)
    if not (target / "config.json").exists():
        return {}
    from eyrie.target.model import model_fingerprint

    fingerprint = model_fingerprint(target)
    found = {}
    for dataset in sorted(config["datasets"]):
        key = settings_key(cfg.generation_settings(config, dataset), fingerprint)
        for shard in cfg.shard_names(config, dataset):
            output = f"results/completions/{dataset}/{shard}.parquet"
            logs = [] if (workdir / output).exists() else logs_of(workdir / f"results/partial/completions/{dataset}/{shard}", key)
            if not logs:
                continue
            rows = [r for r in PartialLog(logs[0]).read().values() if r["finish_reason"] == ERROR]  # read only: a job may be writing
            if rows:
                first = rows[0]
                found[output] = (f"{len(rows)} turn(s) failed at the server (first: {first['id']} turn {first['turn']}: "
                                 f"{str(first.get('error', ''))[:160]}); the command below asks exactly these again, reusing every saved turn")
    return found


def _stale(item: Planned, path: Path, present: dict[str, float], config: dict, workdir: Path) -> str | None:
    # Planned files come in build order: every input of this one that exists and is sound is in `present`.
    newer = [p for p in item.inputs if p in present and present[p] > present[item.path]]
    # As Snakemake decides: a newer input whose content equals what the output was made from reruns nothing.
    newer = [p for p in newer if not _unchanged_since_made(workdir, item.path, p)]
    if newer:
        more = f" (and {len(newer) - 1} more)" if len(newer) > 1 else ""
        return f"older than {newer[0]}{more}, which it is made from and which changed since: Snakemake reruns it"
    if item.rule == "regenerate_shard":
        return _settings_problem(path, config)
    return None


def _unchanged_since_made(workdir: Path, output: str, input_path: str) -> bool:
    """Whether `input_path` holds what it held when Snakemake made `output`: the sha256 Snakemake recorded for it then
    (.snakemake/metadata/<base64 of the output path>, `input_checksums`, kept for small inputs) equals its sha256 now.
    Without a record (a large input, or a workspace Snakemake did not make) the newer timestamp decides."""
    record = workdir / ".snakemake" / "metadata" / base64.b64encode(output.encode()).decode()
    try:
        recorded = (json.loads(record.read_text()).get("input_checksums") or {}).get(input_path)
    except (OSError, ValueError, AttributeError):
        return False
    if not isinstance(recorded, str) or not recorded.startswith("sha256:"):
        return False
    digest = hashlib.sha256()
    with open(workdir / input_path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest() == recorded.removeprefix("sha256:")


def rebuild_command(result: Verification) -> str | None:
    """The one `snakemake` command that rebuilds exactly what is missing or corrupt (and what is made from it)."""
    if all(f.state == STRAY for f in result.findings):  # nothing to rebuild (stray files are removed, not rebuilt)
        return None
    command = ["snakemake"]
    if result.workdir.resolve() != Path.cwd().resolve():
        command += ["-d", str(result.workdir)]
    if result.config_path.resolve() != (result.workdir / "config.yaml").resolve():
        command += ["--configfile", str(result.config_path)]
    # No target: the default, `rule all`, asks for every planned file, so every missing one is rebuilt. Corrupt files
    # look up to date to Snakemake: --forcerun names them (it comes last: it takes every argument after it).
    command += ["--cores", "all", "--rerun-incomplete"]
    corrupt = list(dict.fromkeys(f.forcerun_target or f.path for f in result.of(CORRUPT)))
    if corrupt:
        command += ["--forcerun", *corrupt]
    return shlex.join(command)


def format_verification(result: Verification) -> str:
    counts = ", ".join(f"{len(result.of(state))} {state}" for state in (MISSING, CORRUPT, STALE, STRAY) if result.of(state))
    lines = [f"{result.workdir} against {result.config_path}: {result.checked} planned files checked, " + (counts or "all sound")]
    for finding in result.findings:
        detail = f": {finding.detail}" if finding.detail else ""
        rule = f" ({finding.rule})" if finding.rule else ""
        lines.append(f"  {finding.state:<8} {finding.path}{rule}{detail}")
    if result.running:
        lines.append("A Snakemake run holds this directory's lock: files it is writing show as missing, and the commands "
                     "below would stop at the lock. Run them once it has ended")
    command = rebuild_command(result)
    if command:
        lines += ["Rebuild them, and everything made from them:", f"  {command}"]
    stray = result.of(STRAY)
    if stray:
        where = f"cd {shlex.quote(str(result.workdir))} && " if result.workdir.resolve() != Path.cwd().resolve() else ""
        lines += ["Remove the temporary files (a rerun of their job writes its output anew):",
                  f"  {where}rm -- {' '.join(shlex.quote(f.path) for f in stray)}"]
    return "\n".join(lines)


def missing_under_report(config: dict, workdir: str | Path = ".", config_paths: tuple[str, ...] = ("config.yaml",)) -> list[str]:
    """Planned files that are gone although report.html was built after the config last changed, by existence only.

    `snakemake report.html` does not rebuild them while report.html is otherwise up to date; the Snakefile warns
    with this list. A file missing because the config grew (new datasets, more shards) is not listed: the config
    is then newer than the report. Costs one stat per planned file.
    """
    workdir = Path(workdir)
    report = workdir / "report.html"
    if not report.exists():
        return []
    built = report.stat().st_mtime
    if any((workdir / p).exists() and (workdir / p).stat().st_mtime > built for p in config_paths):
        return []
    return [p.path for p in planned_outputs(config) if p.kept and p.path != "report.html" and not os.path.exists(workdir / p.path)]
