"""Fault injection on the real Snakefile (tiny config): a kill inside every stage's job, and damage to every kind of artifact.

Each case starts from a copy of one complete reference run (conftest's complete_run, which benchmarks one held-out
prompt), injects one fault and recovers the way the README says: after a kill `snakemake --unlock && snakemake
--cores all --rerun-incomplete`; after damage, the command `eyrie verify` prints. Then every planned file must hold
what the reference holds (timings aside), and `eyrie verify` must find nothing wrong. A damaged artifact is named by
`eyrie verify` before anything reads it.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import SNAKEMAKE, copy_of, snakemake
from factories import content, eyrie_verify, without_timings

pytestmark = pytest.mark.e2e

# Every job kind of the pipeline, in build order; a forced rerun of one reruns it and everything after it.
STAGES = ["build_prompts_sharegpt", "regenerate_shard", "extract_hidden", "build_draft_vocab",
          "train_drafter", "benchmark_heldout", "write_report"]
# One artifact of every kind, damaged in place (same size, same mtime: Snakemake cannot see it).
DAMAGED = ["results/prompts/sharegpt/0000.parquet", "results/completions/sharegpt/0001.parquet",
           "results/tokens/local/0000.parquet", "results/vocab/draft_vocab.safetensors",
           "results/hidden/sharegpt/0000.safetensors", "results/drafter/model.safetensors", "results/bench/sharegpt.json"]
# What may differ between two runs of the same benchmark: wall-clock figures and what follows from them (the fastest
# setting, and the flags and commands that serve it).
BENCH_TIMING_WORDS = ("speedup", "floor", "recommend", "fastest", "best", "flags", "command")
# Bookkeeping of a resumed job: how many requests a shard took over from its partial log, and how the job ran (a shard
# whose every turn came from its log opens no engine: stats.run says engine None).
RESUME_WORDS = ("resumed",)
RESUME_KEYS = ("run",)
KILL_AFTER_S = 3.0  # into the stage's first job: past Python's start-up for the jobs that take longer, or into the next job


@pytest.fixture(scope="module")
def reference(complete_run):
    return complete_run, snapshot(complete_run)


def dropping(value, words, keys=()):
    """value without the dict keys that contain any of words or are one of keys, at every depth."""
    if isinstance(value, dict):
        return {k: dropping(v, words, keys) for k, v in value.items() if k not in keys and not any(word in k.lower() for word in words)}
    if isinstance(value, (list, tuple)):
        return type(value)(dropping(v, words, keys) for v in value)
    return value


def bench_content(path: Path) -> dict:
    """A benchmark JSON without its timings: acceptance, tokens and verdicts, per prompt too."""
    return dropping(without_timings(json.loads(path.read_text())), BENCH_TIMING_WORDS)


def in_any_workdir(text: str, *workdirs: Path) -> str:
    """text with each workdir's absolute path written as <workdir>: the speculators export names its target by absolute
    path (so it resolves from anywhere), and each case recovers a copy of the reference in a directory of its own, so
    an export the case did not rebuild still names the reference's directory."""
    for workdir in workdirs:
        text = text.replace(str(workdir.resolve()), "<workdir>").replace(str(workdir), "<workdir>")
    return text


def snapshot(workdir: Path, copied_from: Path | None = None) -> dict[str, object]:
    """Every planned file's content, timings aside (report.html: that it exists); copied_from: the run workdir copies."""
    from eyrie.config import load
    from eyrie.plan import planned_outputs

    held = {}
    for planned in planned_outputs(load(workdir / "config.yaml")):
        path = workdir / planned.path
        if not path.exists():
            held[planned.path] = None
        elif path.is_dir():
            held[planned.path] = {p.name: content(p) if p.suffix == ".safetensors" else without_timings(json.loads(in_any_workdir(p.read_text(), *[d for d in (workdir, copied_from) if d])))
                                  for p in sorted(path.iterdir()) if p.suffix in (".safetensors", ".json")}
        elif path.suffix in (".parquet", ".safetensors"):
            held[planned.path] = dropping(content(path), RESUME_WORDS, RESUME_KEYS)
        elif path.name == "report.html":
            held[planned.path] = True
        elif path.parent.name == "bench":
            held[planned.path] = bench_content(path)
        else:
            held[planned.path] = without_timings(json.loads(path.read_text())) if path.suffix == ".json" else path.read_bytes()
    return held


def assert_restored(workdir: Path, reference: tuple[Path, dict[str, object]]) -> None:
    copied_from, expected = reference
    actual = snapshot(workdir, copied_from)
    differing = [path for path in expected if actual.get(path) != expected[path]]
    assert not differing, f"not as an uninterrupted run left them: {differing}"
    check = eyrie_verify(workdir)
    assert check.returncode == 0, check.stdout


def kill_inside(workdir: Path, stage: str) -> None:
    """`snakemake --forcerun <stage>`, killed with SIGKILL (the whole process group) KILL_AFTER_S into that stage's first job."""
    process = subprocess.Popen(
        [*SNAKEMAKE, "-d", str(workdir), "--cores", "1", "report.html", "--forcerun", stage],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    deadline, started = time.time() + 600, False
    for line in process.stdout:
        if line.strip() in (f"rule {stage}:", f"localrule {stage}:"):
            started = True
            break
        if time.time() > deadline:
            break
    assert started, f"the forced rerun never started {stage}"
    time.sleep(KILL_AFTER_S)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()


@pytest.mark.parametrize("stage", STAGES)
def test_a_kill_inside_each_stage_is_recovered_to_the_same_files(reference, tmp_path, stage):
    workdir = copy_of(reference[0], tmp_path / "w")
    kill_inside(workdir, stage)
    snakemake(workdir, "--unlock")
    snakemake(workdir, "--rerun-incomplete")  # README: snakemake --unlock && snakemake --cores all --rerun-incomplete
    assert_restored(workdir, reference)


@pytest.mark.parametrize("relative", DAMAGED)
def test_damage_to_each_kind_of_artifact_is_named_and_the_printed_command_restores_it(reference, tmp_path, relative):
    workdir = copy_of(reference[0], tmp_path / "w")
    path = workdir / relative
    stat = path.stat()
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = b"\xff" * min(64, len(data) - middle)
    path.write_bytes(bytes(data))
    os.utime(path, (stat.st_atime, stat.st_mtime))

    found = eyrie_verify(workdir)
    assert found.returncode == 1, found.stdout
    named = relative if not relative.startswith("results/drafter/") else "results/drafter"
    assert any(line.strip().startswith("corrupt") and named in line for line in found.stdout.splitlines()), found.stdout
    command = shlex.split(found.stdout.strip().splitlines()[-1])
    assert command[:3] == ["snakemake", "-d", str(workdir)], found.stdout
    done = subprocess.run([*SNAKEMAKE, *command[1:]], check=False, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    assert_restored(workdir, reference)


def test_a_deleted_prompt_shard_is_warned_about_planned_by_the_default_target_and_rebuilt(reference, tmp_path):
    """A dataset's prompts job writes every shard but declares to Snakemake only those lost since it ran (planning stays
    linear in the shard count), so a deleted one must still be seen: warned about for report.html, which needs no job
    (as for every intermediate), and rebuilt by the default target, the README's recovery command."""
    workdir = copy_of(reference[0], tmp_path / "w")
    (workdir / "results/prompts/sharegpt/0001.parquet").unlink()

    preview = snakemake(workdir, "-n", "report.html")
    assert "Nothing to be done" in preview.stdout + preview.stderr
    assert "that report.html was built from are gone: results/prompts/sharegpt/0001.parquet" in preview.stdout + preview.stderr
    planned = snakemake(workdir, "-n").stdout  # the default target: every planned file
    assert "build_prompts_sharegpt:" in planned and "results/prompts/sharegpt/0001.parquet" in planned
    assert "regenerate_shard:" in planned

    snakemake(workdir, "--rerun-incomplete")  # README: snakemake --cores all --rerun-incomplete
    assert_restored(workdir, reference)
    again = snakemake(workdir, "-n")
    assert "Nothing to be done" in again.stdout + again.stderr
