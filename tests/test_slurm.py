"""Cluster submission: the SLURM profiles, the conda envs, and a real run through a real slurmctld.

The first tests need no cluster. The rest run the tiny config through snakemake-executor-plugin-slurm
on the one-node cluster that .ci/slurm_up.sh starts (CI does; see docs/CLUSTER.md), and are skipped
when `sinfo` does not answer.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from conftest import REPO, SNAKEMAKE, TINY_CONFIG, make_workdir, snakemake
from packaging.requirements import Requirement

GPU_RULES = ["regenerate_shard", "extract_hidden", "train_drafter", "benchmark_heldout", "benchmark_humaneval", "benchmark_mtbench"]


# --- without a cluster ---------------------------------------------------------------------------


def dry_run_jobs(workdir: Path, *args: str, env: dict | None = None) -> dict[str, dict]:
    """rule -> {'threads': int, 'resources': {name: value}} for the first job of each rule in a dry run."""
    done = subprocess.run(
        [*SNAKEMAKE, "-d", str(workdir), "-n", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    jobs, rule = {}, None
    for line in done.stdout.splitlines():
        line = line.strip()
        if m := re.match(r"^(?:local)?rule (\w+):$", line):
            rule = m.group(1)
            jobs.setdefault(rule, {"threads": 1, "resources": {}})
        elif rule and line.startswith("threads: "):
            jobs[rule]["threads"] = int(line.split(": ", 1)[1])
        elif rule and line.startswith("resources: "):
            jobs[rule]["resources"] = dict(kv.split("=", 1) for kv in line.split(": ", 1)[1].split(", "))
    return jobs


@pytest.fixture
def plain_workdir(tmp_path):
    """The tiny config without its resources: enough for dry runs."""
    (tmp_path / "config.yaml").write_text(TINY_CONFIG.read_text())
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "local.jsonl").write_text('{"id": "x", "messages": [{"role": "user", "content": "hi"}]}\n')
    return tmp_path


def test_slurm_profile_asks_for_gpus_memory_time_and_takes_site_settings_from_the_environment(plain_workdir):
    env = {"EYRIE_SLURM_ACCOUNT": "proj42", "EYRIE_SLURM_PARTITION": "cpuq", "EYRIE_SLURM_GPU_PARTITION": "gpuq"}
    # `--workflow-profile slurm` is found next to the Snakefile, from any working directory.
    jobs = dry_run_jobs(plain_workdir, "--workflow-profile", "slurm", "report.html", env=env)
    assert set(GPU_RULES) <= set(jobs), sorted(jobs)
    for rule, job in jobs.items():
        res = job["resources"]
        assert res["slurm_account"] == "proj42", rule
        assert int(res["runtime"]) > 0 and int(res["mem_mb"]) >= 1000, rule
        assert job["threads"] <= 8, f"{rule} would ask for {job['threads']} CPUs"
        if rule in GPU_RULES:
            assert res["gpu"] == "1" and res["cpus_per_gpu"] == "8" and res["slurm_partition"] == "gpuq", rule
        else:
            assert "gpu" not in res and res["slurm_partition"] == "cpuq", rule
    assert int(jobs["regenerate_shard"]["resources"]["runtime"]) >= 600


def test_slurm_profile_without_site_settings_leaves_them_to_the_plugin(plain_workdir):
    env = {k: "" for k in ("EYRIE_SLURM_ACCOUNT", "EYRIE_SLURM_PARTITION", "EYRIE_SLURM_GPU_PARTITION")}
    jobs = dry_run_jobs(plain_workdir, "--workflow-profile", str(REPO / "profiles/slurm"), "report.html", env=env)
    for rule, job in jobs.items():
        # Empty = the plugin's own choice: a guessed account, a partition file, the default partition.
        assert job["resources"]["slurm_account"] == "" and job["resources"]["slurm_partition"] == "", rule


def test_training_asks_for_one_gpu_per_data_parallel_rank(plain_workdir):
    config = yaml.safe_load((plain_workdir / "config.yaml").read_text())
    config["train"] = {**config["train"], "processes": 2}
    (plain_workdir / "config.yaml").write_text(yaml.safe_dump(config))
    jobs = dry_run_jobs(plain_workdir, "--workflow-profile", "slurm", "results/drafter")
    assert jobs["train_drafter"]["resources"]["gpu"] == "2" and jobs["train_drafter"]["resources"]["cpus_per_gpu"] == "8"


def test_regeneration_asks_for_no_gpu_when_it_only_talks_to_running_servers(plain_workdir):
    config = yaml.safe_load((plain_workdir / "config.yaml").read_text())
    config["engine"] = {**config.get("engine", {}), "kind": "openai", "openai": {"base_urls": ["http://127.0.0.1:30000"]}}
    (plain_workdir / "config.yaml").write_text(yaml.safe_dump(config))
    jobs = dry_run_jobs(plain_workdir, "--workflow-profile", "slurm", "results/completions/local/0000.parquet")
    regen = jobs["regenerate_shard"]
    assert regen["resources"]["gpu"] == "0" and regen["threads"] == 1
    assert regen["resources"]["server_slots"] == "1"  # `--resources server_slots=N` caps them


def test_lint_passes():
    done = subprocess.run([*SNAKEMAKE, "--lint"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def env_pins(name: str) -> dict[str, str]:
    spec = yaml.safe_load((REPO / "envs" / f"{name}.yaml").read_text())
    assert "conda-forge" in spec["channels"]
    conda = [d for d in spec["dependencies"] if isinstance(d, str)]
    assert "python=3.11" in conda and "pip" in conda
    pins = {}
    for line in next(d for d in spec["dependencies"] if isinstance(d, dict))["pip"]:
        req = Requirement(line)
        (op, version), = [(s.operator, s.version) for s in req.specifier]
        assert op == "==", f"envs/{name}.yaml: {line} is not pinned"
        pins[req.name.lower()] = version
    return pins


def test_conda_envs_are_pinned_and_consistent_with_pyproject():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    cpu, cuda = env_pins("cpu"), env_pins("cuda")
    assert cpu == cuda, "cpu.yaml and cuda.yaml must pin the same versions"
    for line in project["dependencies"]:
        req = Requirement(line)
        if req.name.startswith("snakemake"):
            continue  # snakemake and its plugins run outside the envs, in the submitting install
        assert req.name.lower() in cpu, f"envs/cpu.yaml lacks {req.name} (pyproject.toml: {line})"
        assert req.specifier.contains(cpu[req.name.lower()]), f"envs pin {req.name}=={cpu[req.name.lower()]}, outside {line}"
    assert list(env_pins("sglang")) == ["sglang"]
    # Every rule names one of these envs (one `conda:` line each): --software-deployment-method conda works.
    for smk in (REPO / "rules").glob("*.smk"):
        text = smk.read_text()
        rules = len(re.findall(r"^\s*rule\b", text, re.M))
        envs = re.findall(r'^\s*conda: "\.\./envs/(\w+)\.yaml"$', text, re.M)
        assert len(envs) == rules and set(envs) <= {"cpu", "cuda"}, smk.name


# --- on a real (one-node) SLURM ------------------------------------------------------------------


def slurm_answers() -> bool:
    if not shutil.which("sinfo"):
        return False
    try:
        return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


needs_slurm = pytest.mark.skipif(
    not slurm_answers(), reason="no SLURM cluster answers `sinfo` (CI starts one with .ci/slurm_up.sh)"
)

CI_PROFILE = str(REPO / "profiles" / "ci-slurm")
SLOW_PROMPTS = [{"id": f"slow-{i:02d}", "messages": [{"role": "user", "content": f"Count from {i} to {i + 9}, one number a line."}]} for i in range(16)]
SLOW_SHARD = "local/0000"


def slow_local_shard(config):
    """The tiny config, with the local shard slow enough to be cancelled halfway: one prompt per batch."""
    config["engine"]["max_batch_size"] = 1
    config["datasets"]["local"]["generation"] = {"max_new_tokens": 16, "max_turns": 1}


def squeue_jobs(name_prefix: str) -> list[dict]:
    """This run's jobs, finished ones included (the test cluster keeps them MinJobAge seconds)."""
    out = subprocess.run(
        ["squeue", "-h", "-t", "all", "-o", "%i|%j|%T|%k"], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    jobs = []
    for line in out.splitlines():
        jobid, name, state, comment = line.split("|", 3)
        if name.startswith(name_prefix):
            jobs.append({"id": jobid, "state": state, "comment": comment})
    return jobs


def partial_rows(workdir: Path) -> list[dict]:
    from eyrie.generation.partial import PartialLog

    logs = list((workdir / "results/partial/completions" / SLOW_SHARD).glob("*.jsonl"))
    return list(PartialLog(logs[0]).load().values()) if logs else []


@pytest.fixture(scope="module")
def cancelled_run(tmp_path_factory, shared_resources):
    """The tiny config up to the token shards through SLURM; the slow shard's job is scancel'ed halfway."""
    if not slurm_answers():
        pytest.skip("no SLURM cluster answers `sinfo`")
    workdir = make_workdir(tmp_path_factory.mktemp("slurm"), shared_resources, slow_local_shard, SLOW_PROMPTS)
    config = yaml.safe_load((workdir / "config.yaml").read_text())
    targets = [
        f"results/tokens/{dataset}/{shard:04d}.parquet"
        for dataset, spec in config["datasets"].items()
        for shard in range(spec["shards"])
    ]
    prefix = f"eyrie_ci_{uuid.uuid4().hex[:8]}"
    args = ["--workflow-profile", CI_PROFILE, "--slurm-jobname-prefix", prefix, *targets]
    started = time.time()
    log = open(workdir / "first-run.log", "w")
    first = subprocess.Popen(
        [*SNAKEMAKE, "-d", str(workdir), *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    comment = "rule_regenerate_shard_wildcards_" + SLOW_SHARD.replace("/", "_")
    cancelled = None
    try:
        deadline = time.time() + 600
        while time.time() < deadline and first.poll() is None:
            running = [j for j in squeue_jobs(prefix) if j["comment"] == comment and j["state"] == "RUNNING"]
            if running and len(partial_rows(workdir)) >= 3:
                cancelled = running[0]["id"]
                subprocess.run(["scancel", cancelled], check=True, timeout=30)
                break
            time.sleep(0.5)
        assert cancelled, f"never saw the slow shard running with 3 finished records:\n{(workdir / 'first-run.log').read_text()[-4000:]}"
        first.wait(timeout=600)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, 9)
        log.close()
    return {
        "workdir": workdir,
        "args": args,
        "targets": targets,
        "prefix": prefix,
        "cancelled": cancelled,
        "first_rc": first.returncode,
        "rows_before": partial_rows(workdir),
        "first_seconds": time.time() - started,
    }


@needs_slurm
def test_cancelled_shard_fails_the_run_and_keeps_its_finished_records(cancelled_run):
    workdir = cancelled_run["workdir"]
    assert cancelled_run["first_rc"] != 0, "the run should report the cancelled job"
    assert not (workdir / "results/completions" / f"{SLOW_SHARD}.parquet").exists()
    rows = cancelled_run["rows_before"]
    assert 3 <= len(rows) < len(SLOW_PROMPTS), len(rows)
    # keep-going: the other shards finished all the way to their tokens.
    for target in cancelled_run["targets"]:
        assert (workdir / target).exists() == (SLOW_SHARD not in target), target
    states = {j["id"]: j["state"] for j in squeue_jobs(cancelled_run["prefix"])}
    assert states[cancelled_run["cancelled"]] == "CANCELLED"


@needs_slurm
def test_rerun_resumes_the_cancelled_shard_and_every_job_went_through_slurm(cancelled_run):
    workdir, rows_before = cancelled_run["workdir"], cancelled_run["rows_before"]
    started = time.time()
    snakemake(workdir, *cancelled_run["args"], timeout=900)
    rerun_seconds = time.time() - started

    table = pq.read_table(workdir / "results/completions" / f"{SLOW_SHARD}.parquet")
    ids = table.column("id").to_pylist()
    assert sorted(ids) == sorted(p["id"] for p in SLOW_PROMPTS)  # each prompt exactly once
    stats = json.loads(table.schema.metadata[b"eyrie"])["stats"]
    assert stats["resumed_turns"] == len(rows_before)  # every record finished before the cancel was reused
    by_id = {r["id"]: r for r in table.to_pylist()}
    for row in rows_before:
        assert by_id[row["id"]]["messages"][-1]["content"] == row["reply"]
    for target in cancelled_run["targets"]:
        assert (workdir / target).exists(), target

    # Through SLURM, not locally: one SLURM job per shard and step, as SLURM itself lists them ...
    jobs = squeue_jobs(cancelled_run["prefix"])
    done = [j["comment"] for j in jobs if j["state"] == "COMPLETED"]
    for target in cancelled_run["targets"]:
        dataset, shard = target.split("/")[-2], target.split("/")[-1].split(".")[0]
        for rule in ("regenerate_shard", "extract_hidden"):  # extract_hidden writes the token shard
            assert f"rule_{rule}_wildcards_{dataset}_{shard}" in done, (rule, dataset, shard, jobs)
    assert sum(j["state"] == "CANCELLED" for j in jobs) == 1
    # ... and the plugin's per-job logs, one file per SLURM job id.
    logs = {p.stem for p in (workdir / "logs/slurm").rglob("*.log")}
    assert {j["id"] for j in jobs} <= logs
    print(f"\nSLURM: first run {cancelled_run['first_seconds']:.0f} s, rerun {rerun_seconds:.0f} s, {len(jobs)} jobs")
