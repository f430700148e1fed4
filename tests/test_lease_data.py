"""The lease's regeneration hand-over: collect.sh (COLLECT_DATA=1) brings the resume logs back (regeneration's and
synthesis's), restore_data.sh puts them back.

A machine lost between calls, or a later lease, must get back exactly the logs regeneration wrote, and a piece
damaged on the way must stop the call rather than resume from a corrupt log.
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
H200 = REPO / "benchmarks" / "h200"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("sha256sum") is None, reason="needs bash and coreutils")


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
    workdir = tmp_path / "lease1"
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


def test_resume_logs_come_back_byte_for_byte(regenerated: Path, tmp_path: Path):
    out = tmp_path / "out"
    _collect(regenerated, out)
    assert sorted(p.name for p in out.glob("data.*")) == ["data.sha256", "data.tgz.00"]

    fresh = tmp_path / "lease2"
    result = _restore(fresh, out)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "restored 4 resume logs" in result.stdout  # three shards' and synthesis's
    assert _logs(fresh) == _logs(regenerated)
    assert any("synthetic" in path for path in _logs(fresh))
    assert not (fresh / "results" / "partial" / "train").exists()


def test_a_damaged_piece_stops_the_restore(regenerated: Path, tmp_path: Path):
    out = tmp_path / "out"
    _collect(regenerated, out)
    # The same archive with one log changed: it unpacks, but its sha256 no longer matches.
    log = regenerated / "results" / "partial" / "completions" / "rework" / "0000" / "ae676134927f3c46.jsonl"
    log.write_text(log.read_text().replace('"r1"', '"r9"'))
    (out / "data.tgz.00").unlink()
    subprocess.run(f"tar czf - results/partial/completions | split -b 15M -d - {out}/data.tgz.", shell=True, cwd=regenerated, check=True)

    result = _restore(tmp_path / "lease2", out)
    assert result.returncode != 0
    assert "do not match their sha256" in result.stdout
