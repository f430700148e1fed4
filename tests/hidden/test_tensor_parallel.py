"""hidden.tensor_parallel: one target split over ranks by transformers' own tensor parallelism writes the cache one process writes.

transformers 5.24 runs its tensor parallelism on the CPU over gloo when torch is a CPU build (it binds the ranks to the
accelerator torch was built for), so two CPU ranks stand in for two GPUs here; the same test runs on two CUDA GPUs when
there are two. A tiny random Llama target, one token shard: the launcher starts the ranks with torchrun exactly as the
extract job does, and the file they write is held against extract_shard in one process: the same header and manifest
byte for byte, the same token rows, the same states within the rounding of a split matrix product (float32: about 1e-6;
the all-reduce sums the ranks' partial products in another order, so the bits differ).
"""

from __future__ import annotations

import json
import re
import struct

import pyarrow as pa
import pytest
import torch
import yaml
from conftest import TINY_CONFIG
from factories import tiny_llama

from eyrie import config as cfg
from eyrie.core.atomic import write_parquet_atomically
from eyrie.core.errors import ConfigError
from eyrie.hidden.cache import HiddenCacheError
from eyrie.hidden.extract import extract_shard
from eyrie.hidden.parallel import extraction_gpus, launch_tensor_parallel
from eyrie.target.aux_layers import default_aux_layer_ids
from eyrie.target.model import check_tensor_parallel, check_tensor_parallel_device, load_model
from eyrie.tokens.shards import TOKENS_SCHEMA

TEMPLATE, FINGERPRINT = "a" * 64, "f" * 64
V, H, LAYERS = 96, 64, 8
CPU_BUILD = torch.accelerator.current_accelerator() is None
TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A random Llama (4 heads, 2 key-value heads: splits in two) saved as an HF directory, and a token shard of 14 samples."""
    root = tmp_path_factory.mktemp("tp")
    tiny_llama(root / "target", hidden=H, layers=LAYERS, vocab=V, intermediate=128, positions=256, head_dim=H // 4, tie_word_embeddings=False)
    g = torch.Generator().manual_seed(1)
    rows = []
    for k in range(14):
        n = 0 if k == 5 else 6 + (11 * k) % 41  # one empty sample: it needs no forward on any rank
        ids = torch.randint(0, V, (n,), generator=g).tolist()
        rows.append({"id": f"s-{k}", "dataset": "t", "input_ids": ids, "loss_mask": [0] * min(n, 3) + [1] * max(0, n - 3), "n_tokens": n,
                     "n_assistant_tokens": max(0, n - 3), "truncated": False})
    meta = {"template_sha256": TEMPLATE, "max_seq_len": 256, "stats": {}}
    table = pa.Table.from_pylist(rows, schema=TOKENS_SCHEMA).replace_schema_metadata({b"eyrie": json.dumps(meta).encode()})
    write_parquet_atomically(table, root / "tokens.parquet")
    return root


def shard_arguments(root, out, model_dtype="float32", device="cpu", dtype="bfloat16") -> dict:
    """What scripts/extract_hidden.py hands extract_target_shard (and the launcher)."""
    return dict(tokens_path=str(root / "tokens.parquet"), out_path=str(out), model_dir=str(root / "target"),
                model_cfg={"dtype": model_dtype, "device": device, "trust_remote_code": False}, aux_layer_ids=None,
                model_fingerprint=FINGERPRINT, template_sha256=TEMPLATE, batch_tokens=96, dtype=dtype, threads=1)


def one_process(root, out, model_dtype="float32", device="cpu", dtype="bfloat16") -> dict:
    model = load_model(root / "target", dtype=model_dtype, device=device)
    return extract_shard(tokens_path=str(root / "tokens.parquet"), out_path=str(out), model=model, model_fingerprint=FINGERPRINT,
                         template_sha256=TEMPLATE, aux_layer_ids=default_aux_layer_ids(LAYERS), batch_tokens=96, dtype=dtype, progress=False)


def header(path) -> bytes:
    """The safetensors header: every tensor's name, dtype, shape and offsets, and the manifest; the content digest blanked
    (it is the digest of the values, which differ in their last bits)."""
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    return re.sub(rb'"eyrie_digest":"xxh3-128-tree:[0-9a-f]{32}"', b'"eyrie_digest":"xxh3-128:' + b"0" * 32 + b'"', raw[: 8 + size])


def tensors(path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


# --------------------------------------------------------------------------- the same cache

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not CPU_BUILD, reason="transformers puts tensor-parallel ranks on CUDA with a CUDA build of torch")),
    pytest.param("cuda", marks=pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA GPUs")),
]


def row_error(x, y):
    """|x - y| relative to each row's largest |x| (the final norm makes rows O(1); the aux states grow with depth)."""
    x, y = x.float(), y.float()
    return (x - y).abs() / x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-6)


def split_and_single(setup, tmp_path, device, model_dtype, dtype):
    """(one process's cache, two ranks' cache) of the shard, after checking that the two files have the same layout."""
    single, split = tmp_path / f"single-{model_dtype}-{dtype}.safetensors", tmp_path / f"split-{model_dtype}-{dtype}.safetensors"
    manifest = one_process(setup, single, model_dtype, device, dtype)
    launch_tensor_parallel(shard_arguments(setup, split, model_dtype, device, dtype), 2, tmp_path / "launch.json")
    assert header(split) == header(single)  # names, dtypes, shapes, offsets and the manifest, byte for byte
    assert split.stat().st_size == single.stat().st_size == manifest["file_bytes"]
    a, b = tensors(single), tensors(split)
    assert a.keys() == b.keys() == {"aux_hidden", "final_hidden", "input_ids", "loss_mask", "offsets"}
    for name in ("input_ids", "loss_mask", "offsets"):
        assert torch.equal(a[name], b[name]), name
    for name in ("aux_hidden", "final_hidden"):
        assert a[name].dtype == b[name].dtype == getattr(torch, dtype)
    return a, b


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "model_dtype, dtype, tolerance",
    [
        ("float32", "float32", 1e-5),  # measured 6e-7: a few float32 ulps, the all-reduce's other summation order
        ("float32", "bfloat16", 2**-7),  # the CPU default: 0.03% of the stored values one bf16 ulp apart
    ],
)
def test_two_tensor_parallel_ranks_write_the_single_process_cache(setup, tmp_path, device, model_dtype, dtype, tolerance):
    a, b = split_and_single(setup, tmp_path, device, model_dtype, dtype)
    for name in ("aux_hidden", "final_hidden"):
        assert row_error(a[name], b[name]).max() <= tolerance, name


@pytest.mark.parametrize("device", DEVICES)
def test_in_bfloat16_the_split_target_is_as_close_to_float32_as_the_whole_one(setup, tmp_path, device):
    """A bf16 target rounds each rank's partial product before the sum: the states differ from one process's in the last
    bf16 bits (most values, up to ~2% of a row's scale here), but they are no further from the float32 states."""
    a, b = split_and_single(setup, tmp_path, device, "bfloat16", "bfloat16")
    one_process(setup, tmp_path / "reference.safetensors", "float32", device, "float32")
    reference = tensors(tmp_path / "reference.safetensors")
    for name in ("aux_hidden", "final_hidden"):
        single, split = row_error(reference[name], a[name]), row_error(reference[name], b[name])
        assert split.mean() <= 1.25 * single.mean() and split.max() <= 1.5 * single.max(), (name, single.max(), split.max())
        assert row_error(a[name], b[name]).max() <= 2**-4, name


@pytest.mark.skipif(not CPU_BUILD, reason="CPU ranks need a CPU build of torch")
def test_a_failing_rank_fails_the_job_and_nothing_is_written(setup, tmp_path):
    """The launch names the exit code and keeps the ranks' arguments for a rerun by hand; no file appears."""
    arguments = shard_arguments(setup, tmp_path / "out.safetensors")
    arguments["template_sha256"] = "b" * 64  # another template: every rank refuses the shard
    with pytest.raises(HiddenCacheError, match=r"tensor-parallel extraction \(2 ranks under torchrun, hidden.tensor_parallel\) failed with exit code 1"):
        launch_tensor_parallel(arguments, 2, tmp_path / "launch.json")
    assert json.loads((tmp_path / "launch.json").read_text())["tensor_parallel"] == 2
    assert not (tmp_path / "out.safetensors").exists()


# --------------------------------------------------------------------------- what is refused, and when


def test_a_split_that_breaks_heads_is_refused_before_any_rank_starts(setup, tmp_path):
    # 4 attention heads and 2 key-value heads: 3 ranks would each get a part of a head (transformers does not check).
    with pytest.raises(ConfigError, match=r"hidden.tensor_parallel: 3 does not divide the target's num_attention_heads \(4\)"):
        launch_tensor_parallel(shard_arguments(setup, tmp_path / "out.safetensors"), 3, tmp_path / "launch.json")
    assert not (tmp_path / "launch.json").exists()  # refused before torchrun
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(setup / "target")
    check_tensor_parallel(config, 2)
    with pytest.raises(ConfigError, match=r"hidden.tensor_parallel: 4 does not divide the target's num_key_value_heads \(2\)"):
        check_tensor_parallel(config, 4)
    config.base_model_tp_plan = None
    with pytest.raises(ConfigError, match=r"hidden.tensor_parallel: 2: transformers has no tensor-parallel plan for this target \(llama\)"):
        check_tensor_parallel(config, 2)


def test_ranks_go_where_transformers_puts_them(monkeypatch):
    """transformers binds tensor-parallel ranks to the accelerator torch was built for, whatever model.device says."""
    if CPU_BUILD:
        check_tensor_parallel_device("cpu", 2)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
    with pytest.raises(ConfigError, match=r"hidden.tensor_parallel: 2 with model.device cpu: .* puts the ranks on cuda.*CPU build of torch"):
        check_tensor_parallel_device("cpu", 2)


def test_a_target_split_outside_torchrun_is_refused(setup, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match=r"hidden.tensor_parallel: 2, but this process is not one of 2 torchrun ranks \(WORLD_SIZE=1\)"):
        load_model(setup / "target", dtype="float32", device="cpu", tensor_parallel=2)


def tiny_config(model=None, **hidden) -> dict:
    raw = yaml.safe_load(TINY_CONFIG.read_text())
    raw["hidden"] = {**raw.get("hidden", {}), **hidden}
    raw["model"] = {**raw["model"], **(model or {})}
    return raw


def test_the_config_takes_a_positive_whole_tensor_parallel_and_names_the_field_otherwise():
    assert cfg.validate(tiny_config())["hidden"]["tensor_parallel"] == 1
    assert cfg.validate(tiny_config(tensor_parallel=2))["hidden"]["tensor_parallel"] == 2
    assert cfg.validate(tiny_config({"device": "cpu"}, tensor_parallel=2))["hidden"]["tensor_parallel"] == 2  # gloo ranks, CPU builds
    for bad, expected in ((0, "expected a value >= 1, got 0"), (-2, "expected a value >= 1, got -2"), (1.5, "expected type integer, got 1.5"),
                          ("2", 'expected type integer, got "2"'), (True, "expected type integer, got true")):
        with pytest.raises(ConfigError, match=re.escape(f"hidden.tensor_parallel: {expected}")):
            cfg.validate(tiny_config(tensor_parallel=bad))
    with pytest.raises(ConfigError, match=r"hidden.tensor_parallel: 2 splits the target of the extract job, and hidden.mode online has none"):
        cfg.validate(tiny_config(tensor_parallel=2, mode="online"))


def test_each_extraction_job_asks_for_one_gpu_per_rank_and_the_plan_says_so(tmp_path):
    from eyrie.plan import format_cache

    gpus = {(device, n): extraction_gpus(cfg.validate(tiny_config({"device": device}, tensor_parallel=n))) for device in ("cpu", "cuda", "auto") for n in (1, 2)}
    assert gpus == {("cpu", 1): 0, ("cpu", 2): 0, ("cuda", 1): 1, ("cuda", 2): 2, ("auto", 1): 1, ("auto", 2): 2}
    text = format_cache(cfg.validate(tiny_config({"device": "cuda"}, tensor_parallel=2)), tmp_path)
    assert ("  extraction:  3 extract_hidden jobs, each asking for 2 GPUs (model.device cuda, hidden.tensor_parallel 2: "
            "the target split over 2 torchrun ranks)") in text
    assert "extraction:" not in format_cache(cfg.validate(tiny_config(mode="online")), tmp_path)


def test_the_rule_asks_snakemake_and_slurm_for_the_gpus(tmp_path):
    """A dry run through the SLURM profile: gpu=2 per extract_hidden job, 8 CPUs per GPU."""
    import subprocess

    from conftest import SNAKEMAKE

    (tmp_path / "config.yaml").write_text(yaml.safe_dump(tiny_config({"device": "cuda"}, tensor_parallel=2)))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "local.jsonl").write_text('{"id": "x", "messages": [{"role": "user", "content": "hi"}]}\n')
    done = subprocess.run([*SNAKEMAKE, "-d", str(tmp_path), "-n", "--workflow-profile", "slurm", "results/hidden/local/0000.safetensors"],
                          check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    job = done.stdout[done.stdout.index("rule extract_hidden:"):]
    resources = dict(kv.split("=", 1) for kv in job[job.index("resources: ") + 11 :].splitlines()[0].split(", "))
    assert resources["gpu"] == "2" and resources["cpus_per_gpu"] == "8"


@pytest.mark.skipif(not CPU_BUILD, reason="CPU ranks need a CPU build of torch")
def test_the_pipeline_extracts_a_shard_with_three_ranks_as_one_process_does(shared_resources, target, tmp_path):
    """The real Snakefile and script, hidden.tensor_parallel 3 on the default target (9 heads, 3 key-value heads): the
    cache equals one process's extraction of the same token shard; the log holds the ranks' output."""
    from conftest import make_workdir, snakemake

    def split(config):
        config["hidden"] = {**config.get("hidden", {}), "tensor_parallel": 3, "dtype": "float32"}
        config["model"] = {**config["model"], "device": "cpu", "dtype": "float32"}

    workdir = make_workdir(tmp_path / "run", shared_resources, split)
    snakemake(workdir, "results/hidden/local/0000.safetensors")
    model, tokenizer = target
    from eyrie.target.model import model_fingerprint, template_fingerprint

    single = tmp_path / "single.safetensors"
    extract_shard(tokens_path=str(workdir / "results/tokens/local/0000.parquet"), out_path=str(single), model=model,
                  model_fingerprint=model_fingerprint(workdir / "resources/models/SmolLM2-135M-Instruct"), template_sha256=template_fingerprint(tokenizer),
                  aux_layer_ids=default_aux_layer_ids(model.config.num_hidden_layers), batch_tokens=1024, dtype="float32", progress=False)
    written = workdir / "results/hidden/local/0000.safetensors"
    assert header(written) == header(single)
    a, b = tensors(single), tensors(written)
    for name in ("aux_hidden", "final_hidden"):
        assert row_error(a[name], b[name]).max() <= 1e-4, name
    log = (workdir / "logs/hidden/local/0000.log").read_text()
    assert "hidden 0000.parquet: 100%" in log  # rank 0's progress, copied into the job's log
    assert json.loads((workdir / "logs/hidden/local/0000.launch.json").read_text())["tensor_parallel"] == 3
