"""The DAG at scale: how long `snakemake -n report.html` takes before anything runs, at 100, 1,000 and 10,000 shards.

Each size is a fresh working directory holding the tiny config with one local dataset split into N shards (two jobs
per shard: regenerate, then extract, which tokenizes first; three before 8c70d46) and nothing built, so the dry run
plans every job; no data is read.
Two figures per run: the whole command as a user waits for it, and the DAG alone, which is the command less
Snakemake's start-up (`snakemake --version`, timed the same way: Python, imports, plugin discovery).

    python benchmarks/dag_scale.py                                   # this checkout: 100, 1,000, 10,000 shards
    python benchmarks/dag_scale.py --before /tmp/eyrie-before        # and another checkout's Snakefile, rules/ and src/
    python benchmarks/dag_scale.py --shards 1000 --repeat 3          # one size, best of three
    python benchmarks/dag_scale.py --stub-scontrol                   # as on a machine whose SLURM answers at once
    python benchmarks/dag_scale.py --shards 1000 --profile /tmp/dag.prof   # cProfile of one dry run

--stub-scontrol puts an `scontrol` that fails at once first on PATH. snakemake-executor-plugin-slurm runs
`scontrol show config` when it is imported, on every Snakemake start; where SLURM's client is installed and
configured but no controller answers (the CI machine between SLURM tests), that call waits ~9 s. On a login node
whose controller answers, or a machine without SLURM, it costs milliseconds; the stub shows that case here.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
TINY_CONFIG = REPO / "tests" / "configs" / "tiny.yaml"


def scale_workdir(root: Path, shards: int) -> Path:
    """The tiny config with one local dataset of `shards` shards and nothing built."""
    workdir = root / f"shards-{shards}"
    (workdir / "data").mkdir(parents=True, exist_ok=True)
    config = yaml.safe_load(TINY_CONFIG.read_text())
    config["datasets"] = {"local": {"source": {"file": "data/local.jsonl"}, "shards": shards, "heldout_fraction": 0.05}}
    (workdir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    (workdir / "data" / "local.jsonl").write_text('{"id": "x", "messages": [{"role": "user", "content": "hi"}]}\n')
    return workdir


def environment(checkout: Path, stub_dir: Path | None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(checkout / "src"), os.environ.get("PYTHONPATH")]))}
    if stub_dir is not None:
        env["PATH"] = f"{stub_dir}{os.pathsep}{env['PATH']}"
    return env


def timed(command: list[str], env: dict[str, str], cwd: Path | None = None) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return seconds, done.stdout + done.stderr


def startup(env: dict[str, str], repeat: int) -> float:
    return min(timed([sys.executable, "-m", "snakemake", "--version"], env)[0] for _ in range(repeat))


def dry_run(checkout: Path, workdir: Path, env: dict[str, str], profile: str | None = None) -> tuple[float, int]:
    """Seconds of one `snakemake -n report.html` (parse, DAG, needrun, the job listing) and the jobs it plans."""
    prefix = [sys.executable, "-m", "cProfile", "-o", profile] if profile else [sys.executable]
    seconds, out = timed([*prefix, "-m", "snakemake", "-s", str(checkout / "Snakefile"), "-d", str(workdir), "-n", "report.html"], env)
    jobs = re.search(r"^total\s+(\d+)", out, re.MULTILINE)
    return seconds, int(jobs.group(1)) if jobs else -1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--repeat", type=int, default=1, help="dry runs per size and checkout; the fastest counts")
    parser.add_argument("--before", type=Path, help="another checkout (Snakefile, rules/, src/) to time beside this one")
    parser.add_argument("--stub-scontrol", action="store_true", help="an scontrol that fails at once first on PATH (see above)")
    parser.add_argument("--profile", help="write a cProfile of this checkout's first dry run of the first size here")
    args = parser.parse_args()

    checkouts = {"after": REPO, "before": args.before.resolve()} if args.before else {"this checkout": REPO}
    with tempfile.TemporaryDirectory(prefix="eyrie-dag-") as tmp:
        stub_dir = None
        if args.stub_scontrol:
            stub_dir = Path(tmp) / "bin"
            stub_dir.mkdir()
            (stub_dir / "scontrol").write_text("#!/bin/sh\nexit 1\n")
            (stub_dir / "scontrol").chmod(0o755)
        envs = {name: environment(checkout, stub_dir) for name, checkout in checkouts.items()}
        base = startup(envs[next(iter(checkouts))], max(2, args.repeat))
        print(f"snakemake -n report.html, nothing built, {os.cpu_count()} cores; Snakemake's start-up: {base:.1f} s"
              + (" (scontrol stubbed)" if stub_dir else ""))
        print(f"{'shards':>7} {'jobs':>7}  " + "  ".join(f"{name + ': total / DAG (s)':>28}" for name in reversed(checkouts)))
        profile = args.profile
        for shards in args.shards:
            cells, jobs = [], 0
            for name in reversed(checkouts):  # "before" first when there is one
                workdir = scale_workdir(Path(tmp) / name.replace(" ", "-"), shards)
                runs = []
                for _ in range(args.repeat):
                    seconds, jobs = dry_run(checkouts[name], workdir, envs[name], profile if name != "before" else None)
                    if name != "before":
                        profile = None
                    runs.append(seconds)
                total = min(runs)
                cells.append(f"{total:>18.1f} / {max(0.0, total - base):>6.1f}")
            print(f"{shards:>7,} {jobs:>7,}  " + "  ".join(f"{c:>28}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
