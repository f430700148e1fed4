"""Integrity: every artifact carries a content digest that its reader checks, every unreadable artifact is an
error naming the file, its writer and the command that rebuilds it, and a non-finite value is an error, never a result.

Most cases build small artifacts with the stages' own writers; the headline case (a cache shard with 200 KB overwritten
by 0xFF) runs training as its own process, as Snakemake's job would, and the last test runs it through the real Snakefile.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from factories import llama_config, tiny_drafter, tiny_llama, tiny_target_dir
from safetensors.torch import save_file

from eyrie.core.artifacts import ArtifactError, read_parquet
from eyrie.core.atomic import write_json_atomically, write_parquet_atomically
from eyrie.core.digest import DigestMismatchError, verify, verify_artifact
from eyrie.hidden.cache import FORMAT, SafetensorsWriter, storage_specs

TEMPLATE = "a" * 64
FINGERPRINT = "f" * 64
H, LAYERS, V = 64, 8, 120  # 512 bytes of states per token: a 1,000-token shard holds 200 KB to overwrite


@pytest.fixture(autouse=True)
def one_thread(one_torch_thread):
    """Tiny models: one thread is fastest on a busy machine."""


# --------------------------------------------------------------------------- builders


def make_target(path: Path) -> Path:
    """A tiny Llama target: config.json and the tensors training reads (embeddings, LM head, final norm)."""
    return tiny_target_dir(path, hidden=H, layers=LAYERS, vocab=V, intermediate=128, norm_noise=0)


def write_vocab(path: Path) -> Path:
    from eyrie.tokens.vocab import write_draft_vocab

    ids = torch.arange(V, dtype=torch.int64).numpy()
    write_draft_vocab(path, ids, torch.ones(V, dtype=torch.int64).numpy(), {"draft_vocab_size": V, "target_vocab_size": V, "template_sha256": TEMPLATE})
    return path


def write_cache(path: Path, samples: int = 20, length: int = 50, seed: int = 0, legacy: bool = False, scale: float = 1.0) -> Path:
    """A cache shard as extraction writes it (eyrie.hidden.cache's writer: manifest and xxh3-128-tree digest in the header),
    or, with legacy, as eyrie wrote them before digests (safetensors' own writer, manifest only)."""
    T = samples * length
    ids = torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(0), dtype=torch.int64).to(torch.int32)  # the same tokens whatever the seed
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(T, dtype=torch.int8)
    offsets = torch.arange(0, T + 1, length, dtype=torch.int64)
    aux, final = scale * torch.randn(T, 3 * H, generator=g), scale * torch.randn(T, H, generator=g)
    aux_ids = [1, LAYERS // 2 - 1, LAYERS - 4]
    manifest = {
        "format": FORMAT, "aux_layer_ids": aux_ids, "capture_indices": [i + 1 for i in aux_ids], "num_hidden_layers": LAYERS,
        "hidden_size": H, "target_model_fingerprint": FINGERPRINT, "template_sha256": TEMPLATE, "dtype": "bfloat16",
        "samples": samples, "tokens": T, "assistant_tokens": T, "ids": [f"conv-{k}" for k in range(samples)],
    }
    tensors = {"offsets": offsets, "aux_hidden": aux.to(torch.bfloat16), "final_hidden": final.to(torch.bfloat16), "input_ids": ids, "loss_mask": mask}
    if legacy:
        save_file(tensors, str(path), metadata={"manifest": json.dumps(manifest)})
        return path
    writer = SafetensorsWriter(path, storage_specs("bfloat16", samples, T, H), manifest)
    for name, values in tensors.items():
        writer.write_rows(name, 0, values)
    writer.close()
    return path


def overwrite_with_ff(path: Path, count: int = 200_000) -> None:
    """A corruption: `count` bytes in the middle of the file replaced by 0xFF, the size unchanged."""
    data = bytearray(path.read_bytes())
    start = len(data) // 3
    data[start : start + count] = b"\xff" * count
    path.write_bytes(bytes(data))


def train_args(tmp_path: Path, cache: Path, **train) -> dict:
    return {
        "hidden_paths": [str(cache)], "vocab_path": str(write_vocab(tmp_path / "vocab.safetensors")), "target_dir": str(make_target(tmp_path / "target")),
        "out_dir": str(tmp_path / "drafter"), "state_dir": str(tmp_path / "state"), "drafter_cfg": {"ttt_steps": 2},
        "train_cfg": {"epochs": 1, "batch_tokens": 400, "dtype": "float32", "device": "cpu", "log_every": 1, "eval_fraction": 0, **train},
        "template_sha256": TEMPLATE, "target_fingerprint": FINGERPRINT, "progress": False,
    }


def train_in_a_process(tmp_path: Path, arguments: dict) -> subprocess.CompletedProcess:
    """Training as its own process (`python -m eyrie.training.train ARGS.json`): the exit status a Snakemake job would see."""
    (tmp_path / "args.json").write_text(json.dumps(arguments))
    return subprocess.run([sys.executable, "-m", "eyrie.training.train", str(tmp_path / "args.json")], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)


# --------------------------------------------------------------------------- the headline case: 200 KB of 0xFF in a cache shard


def test_a_cache_shard_overwritten_with_ff_stops_training_with_a_named_error_and_no_drafter(tmp_path):
    cache = write_cache(tmp_path / "0000.safetensors")
    assert verify(cache).startswith("xxh3-128-tree:")
    overwrite_with_ff(cache)
    done = train_in_a_process(tmp_path, train_args(tmp_path, cache))
    assert done.returncode != 0
    error = done.stderr.strip().splitlines()[-1]
    assert "HiddenCacheError" in error and f"{cache}: its content does not match the digest recorded when it was written" in error
    assert f"written by the extract_hidden job; rebuild it (in the workflow's directory): snakemake --cores all --force {cache}" in error
    assert not (tmp_path / "drafter").exists()


def test_the_same_damage_in_a_cache_without_a_digest_stops_at_the_first_non_finite_step(tmp_path):
    """A cache written before digests (or damaged before it was hashed) still never trains a NaN drafter: the first
    non-finite step stops the run, naming the step, the batch's samples, their shard and which of them hold NaN."""
    cache = write_cache(tmp_path / "0000.safetensors", legacy=True)
    overwrite_with_ff(cache)
    done = train_in_a_process(tmp_path, train_args(tmp_path, cache))
    assert done.returncode != 0
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith("eyrie.training.errors.NonFiniteError: train: step 1 (epoch 1) has a non-finite loss or gradient")
    assert "no drafter written" in error and f"The step's batch: {cache}: conv-" in error
    assert "The cached states of conv-" in error and f"in {cache} are not finite: the cache is corrupt" in error
    assert f"snakemake --cores all --force {cache}" in error
    assert not (tmp_path / "drafter").exists()


def test_a_non_finite_gradient_from_finite_data_is_called_divergence(tmp_path, monkeypatch):
    import eyrie.training.train as train_module
    from eyrie.training.errors import NonFiniteError

    real_step = train_module.train_step
    steps = []

    def diverge_at_2(*args, **kwargs):
        result = real_step(*args, **kwargs)
        steps.append(result)
        return {**result, "grad_norm": float("inf")} if len(steps) == 2 else result

    monkeypatch.setattr(train_module, "train_step", diverge_at_2)
    cache = write_cache(tmp_path / "0000.safetensors")
    with pytest.raises(NonFiniteError, match=r"step 2 \(epoch 1\) .*gradient norm inf.*cached states are finite, so training diverged"):
        train_module.train_drafter(**train_args(tmp_path, cache))
    assert all(isinstance(r["grad_norm"], float) for r in steps) and not (tmp_path / "drafter").exists()


# --------------------------------------------------------------------------- resume identity covers the data


def test_a_re_extracted_cache_with_the_same_manifest_starts_training_over(tmp_path):
    from eyrie.hidden.cache import read_manifest
    from eyrie.training.train import train_drafter

    class Crash(RuntimeError):
        pass

    def crash_at_2(step):
        if step == 2:
            raise Crash

    cache = write_cache(tmp_path / "0000.safetensors", seed=0)
    arguments = train_args(tmp_path, cache)
    with pytest.raises(Crash):
        train_drafter(**arguments, save_every_steps=1, on_step=crash_at_2)
    first_manifest = read_manifest(cache)
    write_cache(cache, seed=1)  # re-extracted: the same samples, tokens, target and layers, other values
    assert read_manifest(cache) == first_manifest
    assert train_drafter(**arguments)["resumed_from_step"] == 0
    # Control: killed and rerun on an unchanged cache, training resumes.
    again = {**arguments, "state_dir": str(tmp_path / "state-again")}
    with pytest.raises(Crash):
        train_drafter(**again, save_every_steps=1, on_step=crash_at_2)
    assert train_drafter(**again)["resumed_from_step"] == 2


# --------------------------------------------------------------------------- readers name the file, its writer and the fix


def truncate(path: Path, keep: float = 0.5) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return path


def completions_shard(path: Path) -> Path:
    from eyrie.generation.conversations import COMPLETIONS_SCHEMA

    row = {"id": "a", "dataset": "local", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
           "n_turns": 1, "finish_reason": "stop", "finish_reasons": ["stop"], "prompt_tokens": [3], "completion_tokens": [2],
           "seconds": 0.1, "generation": "{}"}
    table = pa.Table.from_pylist([row] * 50, schema=COMPLETIONS_SCHEMA).replace_schema_metadata({b"eyrie": json.dumps({"template_sha256": TEMPLATE}).encode()})
    write_parquet_atomically(table, path)
    return path


def tokens_shard(path: Path) -> Path:
    from eyrie.tokens.shards import TOKENS_SCHEMA

    rows = [{"id": f"s{k}", "dataset": "local", "input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1], "n_tokens": 4, "n_assistant_tokens": 2,
             "truncated": False} for k in range(50)]
    table = pa.Table.from_pylist(rows, schema=TOKENS_SCHEMA).replace_schema_metadata({b"eyrie": json.dumps({"template_sha256": TEMPLATE}).encode()})
    write_parquet_atomically(table, path)
    return path


def trained_drafter(tmp_path: Path) -> Path:
    from eyrie.drafter.checkpoint import checkpoint_tensors, write_checkpoint

    model = tiny_drafter(llama_config(hidden=32, layers=8, vocab=50, intermediate=64, positions=128, head_dim=8), seed=None)
    write_checkpoint(tmp_path / "drafter", model.shape.sglang_config(), checkpoint_tensors(model), [{"step": 1}])
    return tmp_path / "drafter"


def test_a_truncated_completions_shard_names_the_file_and_the_job_that_rebuilds_it(tmp_path):
    from eyrie.tokens.tokenize import tokenize_shard

    shard = truncate(completions_shard(tmp_path / "0000.parquet"))
    with pytest.raises(ArtifactError, match=rf"{shard}: not a readable Parquet file .*cut short.*written by the regenerate_shard job; .*--force {shard}"):
        tokenize_shard(completions_path=str(shard), out_path=str(tmp_path / "tokens.parquet"), tokenizer=None, template_sha256=TEMPLATE, max_seq_len=64)


@pytest.mark.parametrize("reader", ["read_tokens", "shard_template", "build_draft_vocab"])
def test_a_truncated_tokens_shard_names_the_file_and_the_job_that_rebuilds_it(tmp_path, reader):
    from eyrie.tokens.build_vocab import build_draft_vocab
    from eyrie.tokens.shards import read_tokens, shard_template

    shard = truncate(tokens_shard(tmp_path / "0000.parquet"))
    read = {"read_tokens": lambda: read_tokens(shard, RuntimeError), "shard_template": lambda: shard_template(shard),
            "build_draft_vocab": lambda: build_draft_vocab([str(shard)], 10, 4, str(tmp_path / "vocab.safetensors"))}[reader]
    with pytest.raises(ArtifactError, match=rf"{shard}: not a readable Parquet file .*written by the extract_hidden \(tokenize_shard with hidden.mode online\) job; .*--force {shard}"):
        read()


def test_a_truncated_drafter_model_safetensors_names_the_file_and_the_drafter_to_rebuild(tmp_path):
    from eyrie.drafter.checkpoint import CheckpointError, load_drafter

    directory = trained_drafter(tmp_path)
    truncate(directory / "model.safetensors", 0.7)
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: not a readable safetensors file \(.*cut short\).*train_drafter job; .*--force {directory} "):
        load_drafter(directory, torch.randn(50, 32))
    assert verify_artifact(directory).startswith(f"{directory / 'model.safetensors'}: not a readable safetensors file")


@pytest.mark.parametrize("reader", ["load_drafter", "read_simulated_acceptance", "benchmark"])
def test_an_invalid_drafter_config_json_names_the_file(tmp_path, reader):
    from eyrie.bench.checks import read_drafter_config
    from eyrie.drafter.checkpoint import CheckpointError, load_drafter, read_simulated_acceptance

    directory = trained_drafter(tmp_path)
    (directory / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"], ')
    read = {"load_drafter": lambda: load_drafter(directory, torch.randn(50, 32)), "read_simulated_acceptance": lambda: read_simulated_acceptance(directory),
            "benchmark": lambda: read_drafter_config(directory)}[reader]
    with pytest.raises(CheckpointError, match=rf"{directory / 'config.json'}: not readable JSON \(.*\); written by the train_drafter job; .*--force {directory} "):
        read()


# --------------------------------------------------------------------------- digests: every kind, checked by its reader


def flip_a_byte(path: Path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x01
    path.write_bytes(bytes(data))


def test_every_writer_records_a_digest_its_reader_checks(tmp_path):
    from eyrie.generation.conversations import load_conversations
    from eyrie.hidden.cache import HiddenCacheError, load_hidden
    from eyrie.tokens.shards import read_tokens
    from eyrie.tokens.vocab import VocabError, load_draft_vocab

    prompts = tmp_path / "prompts" / "local" / "0000.parquet"
    write_parquet_atomically(pa.table({"id": ["a"] * 40, "messages": [[{"role": "user", "content": "hello there"}]] * 40}), prompts)
    tokens = tokens_shard(tmp_path / "tokens.parquet")
    vocab = write_vocab(tmp_path / "vocab.safetensors")
    cache = write_cache(tmp_path / "hidden.safetensors", samples=2, length=10)
    summary = tmp_path / "summary.json"
    write_json_atomically(summary, {"dataset": "local", "used": 40})
    for path in (prompts, tokens, vocab, cache, summary):
        assert verify(path).split(":")[0] in ("sha256", "xxh3-128-tree") and verify_artifact(path, require_digest=True) is None

    flip_a_byte(prompts)
    with pytest.raises(DigestMismatchError, match=rf"{prompts}: its content does not match .*build_prompts_local job"):
        load_conversations(str(prompts), max_turns=1)
    flip_a_byte(tokens, 0.3)
    with pytest.raises(DigestMismatchError, match=rf"{tokens}: its content does not match .*extract_hidden \(tokenize_shard with hidden.mode online\) job"):
        read_tokens(tokens, RuntimeError)
    flip_a_byte(vocab, 0.9)
    with pytest.raises(VocabError, match=rf"{vocab}: its content does not match .*build_draft_vocab job"):
        load_draft_vocab(vocab)
    flip_a_byte(cache, 0.9)
    with pytest.raises(HiddenCacheError, match=rf"{cache}: its content does not match .*extract_hidden job"):
        load_hidden(cache)
    summary.write_text(summary.read_text().replace("40", "41"))
    assert "does not match the digest" in verify_artifact(summary)


def test_a_digest_covers_the_metadata_too(tmp_path):
    """The template fingerprint in a token shard's footer is hashed with the rows: changing it is a mismatch, not a new contract."""
    shard = tokens_shard(tmp_path / "tokens.parquet")
    data = shard.read_bytes()
    shard.write_bytes(data.replace(TEMPLATE.encode(), b"b" * 64))
    with pytest.raises(DigestMismatchError):
        read_parquet(shard)


def test_verify_artifact_reports_files_without_a_digest_only_when_asked(tmp_path):
    legacy = write_cache(tmp_path / "legacy.safetensors", samples=2, length=10, legacy=True)
    assert verify_artifact(legacy) is None
    assert "records no content digest" in verify_artifact(legacy, require_digest=True)
    assert verify_artifact(tmp_path / "absent.parquet") == f"{tmp_path / 'absent.parquet'}: missing"
    (tmp_path / "log.json").write_text("[1, 2]")  # a JSON list has no field: never reported as undigested
    assert verify_artifact(tmp_path / "log.json", require_digest=True) is None


def test_a_cache_left_incomplete_by_a_failed_write_never_verifies(tmp_path):
    path = tmp_path / "cut.safetensors"
    writer = SafetensorsWriter(path, storage_specs("bfloat16", 1, 4, 8), {"tokens": 4, "samples": 1})
    writer.write_rows("offsets", 0, torch.tensor([0, 4]))
    writer.close()  # the states were never written: the placeholder stays
    with pytest.raises(DigestMismatchError):
        verify(path)


# --------------------------------------------------------------------------- the benchmark refuses a drafter with non-finite logits


def test_the_benchmark_refuses_a_drafter_whose_logits_are_not_finite():
    from eyrie.bench.checks import check_drafter_logits
    from eyrie.bench.errors import NonFiniteDrafterError

    target = tiny_llama(hidden=32, layers=8, vocab=50, intermediate=64, positions=128, head_dim=8)
    drafter = tiny_drafter(target.config, seed=None, embeddings=target.get_input_embeddings().weight.detach())
    check_drafter_logits(target, drafter, [1, 2, 3, 4, 5], "results/drafter")  # finite: nothing to say
    with torch.no_grad():
        drafter.midlayer.mlp.down_proj.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteDrafterError, match=r"results/drafter: the drafter's logits on the first prompt hold \d+ non-finite values"):
        check_drafter_logits(target, drafter, [1, 2, 3, 4, 5], "results/drafter")


# --------------------------------------------------------------------------- through the real Snakefile


@pytest.mark.e2e
def test_the_issues_case_through_the_snakefile_is_a_named_error_and_no_drafter(tmp_path, shared_resources):
    from conftest import make_workdir, snakemake

    workdir = make_workdir(tmp_path / "run", shared_resources)
    snakemake(workdir, "results/hidden/local/0000.safetensors", "results/hidden/sharegpt/0000.safetensors", "results/hidden/sharegpt/0001.safetensors",
              "results/vocab/draft_vocab.safetensors")
    shard = workdir / "results/hidden/sharegpt/0000.safetensors"
    overwrite_with_ff(shard, min(200_000, shard.stat().st_size // 2))
    done = snakemake(workdir, "results/drafter", "--rerun-triggers", "mtime", check=False)  # only the damage differs from the first run
    assert done.returncode != 0
    log = (workdir / "logs/train/drafter.log").read_text()
    assert "results/hidden/sharegpt/0000.safetensors: its content does not match the digest recorded when it was written" in log
    assert "snakemake --cores all --force results/hidden/sharegpt/0000.safetensors" in log
    assert not (workdir / "results/drafter").exists()
