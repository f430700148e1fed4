"""Recovery on the real Snakefile (tiny config): every lost, corrupt or deliberately dropped file, after a complete run.

Snakemake rebuilds a missing intermediate only for a job that must run; an up-to-date report.html needs none,
so `snakemake report.html` says "Nothing to be done" with token shards gone. The documented command runs the
default target, which asks for every planned file; `eyrie verify` finds what Snakemake cannot see (a file
changed inside the drafter directory) and prints the command that forces it.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from conftest import SNAKEMAKE, copy_of, snakemake
from factories import content, eyrie_verify

pytestmark = pytest.mark.e2e



@pytest.fixture(scope="module")
def built(tmp_path_factory, complete_run):
    """A copy of the test run's complete run, which this module's tests damage in turn."""
    return copy_of(complete_run, tmp_path_factory.mktemp("recovery") / "run")


def kill_a_forced_rerun_of_tokenization(workdir: Path, tokens: list[Path]) -> None:
    """`snakemake -R extract_hidden` (each job tokenizes its shard first), killed as soon as Snakemake has deleted the first
    old token shard to rebuild it."""
    process = subprocess.Popen(
        [*SNAKEMAKE, "-d", str(workdir), "--cores", "1", "report.html", "--forcerun", "extract_hidden"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    deadline = time.time() + 300
    while time.time() < deadline and process.poll() is None and all(p.exists() for p in tokens):
        time.sleep(0.02)
    assert process.poll() is None, "the forced rerun ended before a token shard was deleted"
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def test_the_documented_command_restores_every_lost_file_as_it_was(built):
    tokens = sorted(built.glob("results/tokens/*/*.parquet"))
    hidden_shard = built / "results/hidden/sharegpt/0001.safetensors"
    originals = {p: content(p) for p in [*tokens, hidden_shard]}

    # A forced rerun killed mid-way (Snakemake deletes a job's old outputs before it starts), then files deleted by hand.
    kill_a_forced_rerun_of_tokenization(built, tokens)
    for path in [*built.glob("results/tokens/*/0000.parquet"), hidden_shard]:
        path.unlink(missing_ok=True)
    lost = [p for p in originals if not p.exists()]
    assert len(lost) >= 3

    snakemake(built, "--unlock")
    # The failure this fixes: for report.html alone there is nothing to do. The Snakefile now says what is gone.
    preview = snakemake(built, "-n", "report.html")
    assert "Nothing to be done" in preview.stdout + preview.stderr
    assert "that report.html was built from are gone" in preview.stdout + preview.stderr
    assert "missing" in eyrie_verify(built).stdout

    snakemake(built, "--rerun-incomplete")  # README: snakemake --unlock && snakemake --cores all --rerun-incomplete
    for path, before in originals.items():
        assert path.exists(), path
        assert content(path) == before, f"{path} differs from the original"
    check = eyrie_verify(built)
    assert check.returncode == 0, check.stdout
    again = snakemake(built, "-n", "report.html")
    assert "Nothing to be done" in again.stdout + again.stderr


def test_a_changed_file_in_the_drafter_directory_is_found_and_rebuilt_by_the_printed_command(built):
    from safetensors.torch import load_file

    weights = built / "results/drafter/model.safetensors"
    original = load_file(str(weights))
    stat = weights.stat()
    data = bytearray(weights.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 256] = b"\xff" * 256
    weights.write_bytes(bytes(data))
    os.utime(weights, (stat.st_atime, stat.st_mtime))

    # Snakemake sees a directory output by its timestamp: the change does not show in a preview.
    assert "Nothing to be done" in snakemake(built, "-n", "report.html").stdout
    found = eyrie_verify(built)
    assert found.returncode == 1
    assert "corrupt  results/drafter (train_drafter)" in found.stdout and "model.safetensors" in found.stdout
    command = shlex.split(found.stdout.strip().splitlines()[-1])
    assert command[:3] == ["snakemake", "-d", str(built)] and command[-2:] == ["--forcerun", "results/drafter"]

    done = subprocess.run([*SNAKEMAKE, *command[1:]], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    assert "rule train_drafter" in done.stdout + done.stderr
    # Sound again. Not compared with the original: retraining from the saved state is training's contract, not this one's.
    assert load_file(str(weights)).keys() == original.keys()
    assert eyrie_verify(built).returncode == 0
    assert "Nothing to be done" in snakemake(built, "-n", "report.html").stdout


def test_hidden_keep_false_drops_the_cache_after_training_without_a_rebuild(built):
    config_path = built / "config.yaml"
    original = config_path.read_text()
    config = yaml.safe_load(original)
    config["hidden"]["keep"] = False
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    try:
        # Switching the flag changes no cache content: nothing is extracted or trained again.
        jobs = snakemake(built, "-n", "--quiet", "rules").stdout
        assert "extract_hidden" not in jobs and "train_drafter" not in jobs
        for shard in built.glob("results/hidden/*/*.safetensors"):
            shard.unlink()  # what Snakemake does to a temp() cache once the drafter is trained
        jobs = snakemake(built, "-n", "--quiet", "rules").stdout
        assert "extract_hidden" not in jobs and "train_drafter" not in jobs
        assert eyrie_verify(built).returncode == 0

        # A change that retrains extracts the cache first, and deletes it again after training.
        config["train"]["epochs"] = 2
        config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        preview = snakemake(built, "-n").stdout
        assert "rule extract_hidden" in preview and "rule train_drafter" in preview
        assert "Would remove temporary output results/hidden/sharegpt/0000.safetensors" in preview
    finally:
        config_path.write_text(original)  # the last test of this module: the cache is not built back
