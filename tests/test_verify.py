"""`eyrie verify` finds every missing, corrupt or stale file a config plans, and prints the command that repairs them.

The workspace here is written by the pipeline's own writers (eyrie.core.atomic, the drafter checkpoint), so the
digests checked are the ones real runs record; tests/e2e/test_recovery.py runs the printed command on a real build.
"""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pytest
import torch
import yaml
from conftest import TINY_CONFIG
from factories import plans_of

from eyrie import cli
from eyrie import config as cfg
from eyrie.core.atomic import write_json_atomically, write_parquet_atomically, write_safetensors_atomically
from eyrie.drafter.checkpoint import checkpoint_tensors, write_checkpoint
from eyrie.drafter.model import DrafterShape, Eagle3Drafter
from eyrie.plan import planned_outputs
from eyrie.verify import CORRUPT, MISSING, STALE, missing_under_report, rebuild_command, verify_workspace

CONFIG = {
    "model": {"name": "m", "path": "model"},
    "datasets": {"d": {"source": {"file": "data.jsonl"}, "shards": 2, "heldout_fraction": 0.1}},
    "bench": {"humaneval": None, "mtbench": None},
}


def tiny_drafter(directory):
    shape = DrafterShape(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                         vocab_size=50, draft_vocab_size=10, target_hidden_size=32, max_position_embeddings=128, aux_layer_ids=[1, 14, 26])
    torch.manual_seed(0)
    t2d = torch.zeros(50, dtype=torch.bool)
    t2d[:10] = True
    model = Eagle3Drafter(shape, torch.randn(50, 32), torch.zeros(10, dtype=torch.int64), t2d)
    write_checkpoint(directory, shape.sglang_config(), checkpoint_tensors(model), [{"step": 1, "loss": 2.0}])


def parquet(path, metadata=None):
    table = pa.table({"id": ["a", "b"], "n": [1, 2]})
    if metadata is not None:
        table = table.replace_schema_metadata({b"eyrie": json.dumps(metadata).encode()})
    write_parquet_atomically(table, path)


def safetensors(path):
    write_safetensors_atomically({"x": torch.arange(4096, dtype=torch.float32)}, path, {"manifest": json.dumps({"samples": 2})})


def build_workspace(root, config):
    """Every planned file, each written by the pipeline's own writers, one second apart in build order."""
    settings = cfg.generation_settings(config, "d")
    for i, planned in enumerate(planned_outputs(config)):
        path = root / planned.path
        path.parent.mkdir(parents=True, exist_ok=True)
        if planned.path == "results/drafter":
            tiny_drafter(path)
        elif planned.path == "results/drafter-speculators":
            path.mkdir()
            write_json_atomically(path / "config.json", {"speculators_model_type": "eagle3"})
            safetensors(path / "model.safetensors")
        elif path.suffix == ".parquet":
            parquet(path, {"settings": settings} if planned.rule == "regenerate_shard" else None)
        elif path.suffix == ".safetensors":
            safetensors(path)
        elif path.suffix == ".json":
            write_json_atomically(path, {"name": planned.path})
        else:
            path.write_text("<html>report</html>")
        stamp = 1_700_000_000 + i
        for member in [path, *path.glob("*")]:
            os.utime(member, (stamp, stamp))
    (root / "config.yaml").write_text(json.dumps(config))
    os.utime(root / "config.yaml", (1_600_000_000, 1_600_000_000))
    return root


@pytest.fixture
def config():
    return cfg.validate(CONFIG)


@pytest.fixture
def workspace(tmp_path, config):
    return build_workspace(tmp_path, config)


def damage(path, data: bytes):
    """Replace a file's bytes, keeping its modification time: what a bad disk or a cut copy leaves, unseen by Snakemake."""
    stat = path.stat()
    path.write_bytes(data)
    os.utime(path, (stat.st_atime, stat.st_mtime))


def flip_bytes(path, at_fraction=0.6, count=64):
    """Overwrite bytes in the middle of the file, keeping its size."""
    data = bytearray(path.read_bytes())
    at = int(len(data) * at_fraction)
    data[at : at + count] = b"\xff" * count
    damage(path, bytes(data))


def test_a_sound_workspace_passes(workspace, config, capsys):
    result = verify_workspace(config, workspace, workspace / "config.yaml")
    assert result.ok, result.findings
    assert result.checked == len(planned_outputs(config))
    assert cli.main(["verify", "-d", str(workspace)]) == 0
    assert "all sound" in capsys.readouterr().out


def test_missing_corrupt_and_stale_files_are_named_with_the_command_that_rebuilds_them(workspace, config, capsys):
    (workspace / "results/tokens/d/0000.parquet").unlink()
    flip_bytes(workspace / "results/hidden/d/0001.safetensors")
    stale = workspace / "results/completions/d/0001.parquet"
    os.utime(workspace / "results/prompts/d/0001.parquet", (stale.stat().st_mtime + 5,) * 2)

    result = verify_workspace(config, workspace, workspace / "config.yaml")
    found = {(f.state, f.path) for f in result.findings}
    assert found == {
        (MISSING, "results/tokens/d/0000.parquet"),
        (CORRUPT, "results/hidden/d/0001.safetensors"),
        (STALE, "results/completions/d/0001.parquet"),
    }
    corrupt = result.of(CORRUPT)[0]
    assert "0001.safetensors" in corrupt.detail and "digest" in corrupt.detail and corrupt.rule == "extract_hidden"
    # No target: the default target (every planned file) rebuilds what is missing; corrupt files are forced.
    command = rebuild_command(result)
    assert command.endswith("--cores all --rerun-incomplete --forcerun results/hidden/d/0001.safetensors")
    assert command.startswith(f"snakemake -d {workspace}")

    assert cli.main(["verify", "-d", str(workspace)]) == 1
    out = capsys.readouterr().out
    assert "1 missing, 1 corrupt, 1 stale" in out and command in out


def test_a_newer_input_with_the_content_snakemake_recorded_is_not_stale(workspace, config):
    """Snakemake's own rule: a rewritten input whose checksum equals the one recorded when the output was made (small
    inputs, .snakemake/metadata) reruns nothing, so verify must not call the output stale (a killed forced rerun leaves this)."""
    import base64
    import hashlib

    prompts, completions = "results/prompts/d/0001.parquet", "results/completions/d/0001.parquet"
    os.utime(workspace / prompts, ((workspace / completions).stat().st_mtime + 5,) * 2)
    record = workspace / ".snakemake" / "metadata" / base64.b64encode(completions.encode()).decode()
    record.parent.mkdir(parents=True, exist_ok=True)

    def recorded(checksum):
        record.write_text(json.dumps({"rule": "regenerate_shard", "input_checksums": {prompts: f"sha256:{checksum}"}}))
        return [(f.state, f.path) for f in verify_workspace(config, workspace).findings]

    assert recorded(hashlib.sha256((workspace / prompts).read_bytes()).hexdigest()) == []
    assert recorded("0" * 64) == [(STALE, completions)]  # the content changed since: Snakemake reruns it


def test_a_changed_file_inside_the_drafter_directory_is_caught(workspace, config):
    """Snakemake sees a directory output by its timestamp only: `snakemake -n` never shows this."""
    drafter = workspace / "results/drafter"
    flip_bytes(drafter / "model.safetensors")
    assert [(f.state, f.path) for f in verify_workspace(config, workspace).findings] == [(CORRUPT, "results/drafter")]

    tiny_drafter(drafter)  # sound again
    log = json.loads((drafter / "training_log.json").read_text())
    (drafter / "training_log.json").write_text(json.dumps(log + [{"step": 2, "loss": 0.1}]))  # valid JSON, other content
    findings = verify_workspace(config, workspace).findings
    assert [f.path for f in findings] == ["results/drafter"] and "training_log.json" in findings[0].detail

    tiny_drafter(drafter)
    (drafter / "pytorch_model.bin").write_bytes(b"not ours")
    assert "pytorch_model.bin: not written by the pipeline" in verify_workspace(config, workspace).findings[0].detail
    (drafter / "pytorch_model.bin").unlink()
    (drafter / "training_log.json").unlink()
    assert "training_log.json: missing" in verify_workspace(config, workspace).findings[0].detail


def test_quick_reads_headers_and_footers_only(workspace, config):
    flip_bytes(workspace / "results/hidden/d/0000.safetensors")  # tensor bytes: only the digest sees them
    truncated = workspace / "results/tokens/d/0001.parquet"
    damage(truncated, truncated.read_bytes()[:-100])
    quick = verify_workspace(config, workspace, quick=True)
    assert [(f.state, f.path) for f in quick.findings] == [(CORRUPT, "results/tokens/d/0001.parquet")]
    assert "not a readable Parquet file" in quick.findings[0].detail
    full = {f.path for f in verify_workspace(config, workspace).findings}
    assert full == {"results/tokens/d/0001.parquet", "results/hidden/d/0000.safetensors"}


def test_completions_made_under_other_settings_are_stale(workspace, config):
    config["datasets"]["d"]["generation"] = {"max_new_tokens": 7}
    findings = verify_workspace(config, workspace).findings
    assert {(f.state, f.path) for f in findings} == {(STALE, "results/completions/d/0000.parquet"), (STALE, "results/completions/d/0001.parquet")}
    assert "generation settings" in findings[0].detail


def test_a_temporary_cache_may_be_gone(workspace, config):
    """hidden.keep: false: the shards are deleted after training; nothing is missing and the drafter is not stale."""
    config["hidden"]["keep"] = False
    for shard in (workspace / "results/hidden/d").iterdir():
        shard.unlink()
    result = verify_workspace(config, workspace)
    assert result.ok, result.findings
    assert result.checked == len(planned_outputs(config)) - 2


def test_an_online_workspace_has_no_cache_and_a_changed_token_shard_makes_the_drafter_stale(tmp_path):
    """hidden.mode online: the drafter is made from the token shards, so a newer token shard is what makes it stale."""
    config = cfg.validate({**CONFIG, "hidden": {"mode": "online"}})
    workspace = build_workspace(tmp_path, config)
    assert not (workspace / "results" / "hidden").exists()
    result = verify_workspace(config, workspace)
    assert result.ok, result.findings
    os.utime(workspace / "results/tokens/d/0000.parquet")
    assert "results/drafter" in {f.path for f in verify_workspace(config, workspace).findings if f.state == STALE}


def test_the_snakefile_warns_only_for_files_gone_since_the_report(workspace, config):
    assert missing_under_report(config, workspace) == []
    (workspace / "results/tokens/d/0000.parquet").unlink()
    assert missing_under_report(config, workspace) == ["results/tokens/d/0000.parquet"]
    os.utime(workspace / "config.yaml")  # the config changed after the report: new files are still to come, not lost
    assert missing_under_report(config, workspace) == []


@pytest.mark.parametrize("mode", ["offline", "online"])
def test_planned_outputs_are_what_snakemake_plans(tmp_path, mode):
    """eyrie.plan's list and the rules agree: the paths and rules Snakemake's own DAG has for the tiny config (hidden.mode online: no cache)."""
    raw = yaml.safe_load(TINY_CONFIG.read_text())
    raw["hidden"]["mode"] = mode
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "local.jsonl").write_text('{"id": "x", "messages": [{"role": "user", "content": "hi"}]}\n')
    snakemake_plans, planned, undeclared = plans_of(tmp_path)
    assert undeclared and snakemake_plans == planned - undeclared
    assert any(rule == "extract_hidden" for _, rule in planned) == (mode == "offline")


def test_a_corrupt_prompt_shard_is_forced_through_the_summary_its_prompts_job_declares(workspace, config):
    """Prompt shards are not declared outputs once built (rules/common.smk), so --forcerun must name the summary."""
    flip_bytes(workspace / "results/prompts/d/0000.parquet")
    flip_bytes(workspace / "results/tokens/d/0000.parquet")
    command = rebuild_command(verify_workspace(config, workspace))
    assert command.endswith("--forcerun results/prompts/d/summary.json results/tokens/d/0000.parquet")


def test_failed_turns_are_listed_with_the_servers_words_and_the_command_that_asks_them_again(workspace, config, capsys):
    """A shard whose turns the server failed is not written (eyrie.generation.regenerate); verify reads its resume log
    (never writing it: the bytes stay) and says what failed and that the default command asks those turns again."""
    from eyrie.generation.conversations import settings_key
    from eyrie.generation.partial import PartialLog, log_path
    from eyrie.target.model import model_fingerprint

    (workspace / "model").mkdir()
    (workspace / "model/config.json").write_text("{}")
    (workspace / "results/completions/d/0001.parquet").unlink()
    key = settings_key(cfg.generation_settings(config, "d"), model_fingerprint(workspace / "model"))
    log = PartialLog(log_path(workspace / "results/partial/completions/d/0001", key, "abc123"))
    row = {"user": "u", "prompt_tokens": 3, "completion_tokens": 0, "seconds": 0.1}
    log.append([{**row, "id": "p1", "turn": 0, "reply": "fine", "finish_reason": "stop"},
                {**row, "id": "p2", "turn": 0, "reply": "", "finish_reason": "error", "error": "HTTP 400: content filter said no"}])
    with open(log.path, "ab") as f:
        f.write(b'{"id": "p3", "tu')  # a job may be writing right now
    before = log.path.read_bytes()
    result = verify_workspace(config, workspace, workspace / "config.yaml")
    assert log.path.read_bytes() == before
    missing = {f.path: f for f in result.of(MISSING)}
    assert "1 turn(s) failed at the server (first: p2 turn 0: HTTP 400: content filter said no)" in missing["results/completions/d/0001.parquet"].detail
    assert cli.main(["verify", "-d", str(workspace)]) == 1
    text = capsys.readouterr().out
    assert "content filter said no" in text and "asks exactly these again" in text and "--forcerun" not in text


def test_stray_temporary_files_under_results_are_listed_with_the_command_that_removes_them(workspace, config, capsys):
    from eyrie.verify import STRAY, format_verification

    stray = workspace / "results/hidden/d/.0001.safetensors.0123abcd.tmp"
    stray.write_bytes(b"\0" * 4096)
    (workspace / "results/hidden/d/.notes.txt").write_text("not ours")  # another hidden file: not a temporary
    result = verify_workspace(config, workspace, workspace / "config.yaml")
    assert [(f.state, f.path) for f in result.findings] == [(STRAY, "results/hidden/d/.0001.safetensors.0123abcd.tmp")]
    assert "4,096 bytes" in result.findings[0].detail and rebuild_command(result) is None
    text = format_verification(result)
    assert "1 stray" in text and "rm -- results/hidden/d/.0001.safetensors.0123abcd.tmp" in text and "snakemake" not in text
    (workspace / ".snakemake/locks").mkdir(parents=True)
    (workspace / ".snakemake/locks/0.input.lock").write_text("")
    assert "holds this directory's lock" in format_verification(verify_workspace(config, workspace, workspace / "config.yaml"))
