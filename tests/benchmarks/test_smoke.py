"""Every kept benchmark runs at its smallest size on the CPU (in this process, through runpy, or as a subprocess where
it launches ranks or Snakemake), so that a benchmark cannot rot unseen; those that read a finished pipeline run or a
real model directory have their arguments and setup checked. benchmarks/README.md lists exactly the scripts here.
"""

from __future__ import annotations

import json
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"

# script: its smallest CPU run ({out} is a JSON file in the test's directory)
TINY_RUNS = {
    "decode_floor.py": "--small --tokens 8 --no-compile --dtypes float32 --repeats 1 --drafter-k 2 --draft-vocab 64 --trees 2,2,4 --out {out}",
    "round_profile.py": "--small --trees 2,2,4 --no-compile --rounds 2 --chain 2 --prompt-tokens 8 --draft-vocab 64 --dtype float32",
    "train_throughput.py": "--small --variants baseline,flex+chunked --warmup 1 --steps 1 --seq-len 32 --ttt-steps 2 --out {out}",
    "extraction.py": "--small --tokens 256 --batch-tokens 128 --repeats 1 --matmul-size 64 --out {out}",
}
SUBPROCESS_RUNS = {  # they start ranks (torchrun, gloo) or Snakemake themselves
    "train_ddp.py": "--small --steps 1 --warmup 0 --rows 2 --ttt-steps 2 --seq-len 16 --out {out}",
    "dag_scale.py": "--shards 2",
}
# They read a finished pipeline run, a real model directory or two GPUs: their arguments are parsed and their usage shown.
ARGUMENTS_ONLY = {
    "parity_probe.py": ["--workdir"],
    "recipe_ablation.py": ["workdir", "--setting"],
    "copy_probe.py": ["decode", "steps"],
    "tree_shapes.py": ["--shapes", "--bench"],
    "tp_extraction.py": ["--phases", "--small"],
    "regeneration.py": ["--model", "--small"],
}


def test_the_readme_lists_every_script_and_the_smoke_test_covers_each():
    scripts = {path.name for path in BENCHMARKS.glob("*.py")}
    listed = set(re.findall(r"^\| `([a-z_]+\.py)` \|", (BENCHMARKS / "README.md").read_text(), re.MULTILINE))
    covered = set(TINY_RUNS) | set(SUBPROCESS_RUNS) | set(ARGUMENTS_ONLY)
    retired = set(re.findall(r"^\| `([a-z_]+\.py)` \|", (BENCHMARKS / "README.md").read_text().split("## Retired")[1], re.MULTILINE))
    assert scripts == covered == listed - retired
    assert not scripts & retired  # a retired probe is gone from the tree


@pytest.mark.parametrize("script", sorted(TINY_RUNS))
def test_benchmark_runs_at_its_smallest_size(script, tmp_path, monkeypatch, capsys):
    out = tmp_path / "figures.json"
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # round_profile reads decode_floor's shapes
    monkeypatch.setattr(sys, "argv", [script, *TINY_RUNS[script].format(out=out).split()])
    try:
        runpy.run_path(str(BENCHMARKS / script), run_name="__main__")
    except SystemExit as exit:
        assert exit.code in (0, None), f"{script} exited {exit.code}"
    printed = capsys.readouterr().out
    assert printed.strip(), f"{script} printed nothing"
    if "{out}" in TINY_RUNS[script]:
        figures = json.loads(out.read_text())
        assert figures, f"{script} wrote no figures"


@pytest.mark.parametrize("script", sorted(SUBPROCESS_RUNS))
def test_benchmark_that_starts_processes_runs_at_its_smallest_size(script, tmp_path):
    out = tmp_path / "figures.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(BENCHMARKS / script), *SUBPROCESS_RUNS[script].format(out=out).split()],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.strip()
    if "{out}" in SUBPROCESS_RUNS[script]:
        assert json.loads(out.read_text())


@pytest.mark.parametrize("script", sorted(ARGUMENTS_ONLY))
def test_benchmark_on_a_pipeline_run_parses_its_arguments(script, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as exit:
        runpy.run_path(str(BENCHMARKS / script), run_name="__main__")
    assert exit.value.code == 0
    usage = capsys.readouterr().out
    for word in ARGUMENTS_ONLY[script]:
        assert word in usage, f"{script} --help does not mention {word}"
