"""hidden.compile: the target's decoder layers compiled during extraction give the eager cache's states; a compile that
fails before the first batch leaves extraction eager with a warning, one that fails later stops it naming the setting;
auto compiles nothing on a CPU, nor does a tensor-parallel rank; the job script hands the setting on."""

from __future__ import annotations

import json
import runpy
import warnings
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pytest
import torch
from factories import tiny_llama

import eyrie.hidden.extract as extract_module
import eyrie.target.model as target_model
import eyrie.tokens.tokenize as tokenize_module
from eyrie.core.atomic import write_parquet_atomically
from eyrie.hidden.cache import HiddenCacheError, load_hidden, read_manifest
from eyrie.hidden.extract import extract_shard
from eyrie.tokens.shards import TOKENS_SCHEMA

TEMPLATE = "t" * 64
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "extract_hidden.py"
SHAPE = {"hidden": 64, "layers": 4, "vocab": 128, "intermediate": 128, "positions": 64}
# Two batches of two rows at 32 tokens: no one-row batch, whose size-1 specialisation would compile a second graph.
LENGTHS = [16, 15, 9, 8]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    yield
    torch._dynamo.reset()  # no compiled graph of these tiny layers outlives its test


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return write_tokens(tmp_path_factory.mktemp("compile") / "tokens.parquet", LENGTHS)


def write_tokens(path: Path, lengths: list[int]) -> Path:
    """A token shard of random ids, as eyrie.tokens.tokenize writes one."""
    generator = torch.Generator().manual_seed(3)
    rows = []
    for k, n in enumerate(lengths):
        mask = [0] * (n // 2) + [1] * (n - n // 2)
        rows.append({"id": f"s{k}", "dataset": "d", "input_ids": torch.randint(0, SHAPE["vocab"], (n,), generator=generator).tolist(),
                     "loss_mask": mask, "n_tokens": n, "n_assistant_tokens": sum(mask), "truncated": False})
    meta = {"template_sha256": TEMPLATE, "max_seq_len": 64, "stats": {}}
    write_parquet_atomically(pa.Table.from_pylist(rows, schema=TOKENS_SCHEMA).replace_schema_metadata({b"eyrie": json.dumps(meta).encode()}), path)
    return path


def extract(model, tokens, out: Path, **kwargs) -> dict:
    return extract_shard(tokens_path=str(tokens), out_path=str(out), model=model, model_fingerprint="f" * 64, template_sha256=TEMPLATE,
                         aux_layer_ids=[0, 1, 2], batch_tokens=32, dtype="float32", progress=False, **kwargs)


def states(path: Path) -> tuple:
    tensors, _ = load_hidden(path)
    return tensors["aux_hidden"], tensors["final_hidden"]


def compiled_layers(model) -> list[bool]:
    return [layer._compiled_call_impl is not None for layer in model.model.layers]


def test_compiled_layers_give_the_eager_caches_states_and_compile_once_per_model(tmp_path, tokens, monkeypatch):
    model = tiny_llama(**SHAPE)
    eager = extract(model, tokens, tmp_path / "eager.safetensors", compile=False)
    compiled = extract(model, tokens, tmp_path / "compiled.safetensors", compile=True)
    assert eager["compiled"] is False and compiled["compiled"] is True and read_manifest(tmp_path / "compiled.safetensors")["compiled"] is True
    assert compiled_layers(model) == [True] * SHAPE["layers"]
    for ran_compiled, ran_eagerly in zip(states(tmp_path / "compiled.safetensors"), states(tmp_path / "eager.safetensors")):
        torch.testing.assert_close(ran_compiled, ran_eagerly, rtol=1e-5, atol=1e-5)

    def compile_again(layers):
        raise AssertionError("the layers were compiled a second time")

    monkeypatch.setattr(extract_module, "_compile_each", compile_again)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the compile_again failure would come back as a warning
        again = extract(model, tokens, tmp_path / "again.safetensors", compile=True)
    assert again["compiled"] is True
    torch.testing.assert_close(states(tmp_path / "again.safetensors"), states(tmp_path / "compiled.safetensors"), rtol=0, atol=0)


def failing_backend(graph, example_inputs):
    raise RuntimeError("inductor cannot lower this op")


def compile_raises(layers):
    raise RuntimeError("inductor cannot lower this op")


def compile_for_a_failing_forward(layers):
    for layer in layers:
        layer.compile(dynamic=True, backend=failing_backend)  # compiling happens at the first call, which fails


@pytest.mark.parametrize("compile_each", [compile_raises, compile_for_a_failing_forward], ids=["compiling raises", "the first compiled forward raises"])
def test_a_failed_compile_warns_and_extraction_goes_on_eagerly(tmp_path, tokens, monkeypatch, compile_each):
    model = tiny_llama(**SHAPE)
    eager = extract(model, tokens, tmp_path / "eager.safetensors", compile=False)
    monkeypatch.setattr(extract_module, "_compile_each", compile_each)
    with pytest.warns(RuntimeWarning, match=r"(?s)hidden.compile: .*extraction goes on eagerly.*inductor cannot lower this op"):
        manifest = extract(model, tokens, tmp_path / "fallback.safetensors", compile=True)
    assert manifest["compiled"] is False and read_manifest(tmp_path / "fallback.safetensors")["compiled"] is False
    assert compiled_layers(model) == [False] * SHAPE["layers"]
    assert manifest["tokens"] == eager["tokens"] == sum(LENGTHS)
    torch.testing.assert_close(states(tmp_path / "fallback.safetensors"), states(tmp_path / "eager.safetensors"), rtol=0, atol=0)


@pytest.mark.parametrize("setting, tensor_parallel", [("auto", False), (True, True)], ids=["auto on a CPU", "true on a tensor-parallel rank"])
def test_no_compile_is_attempted_where_the_setting_resolves_to_off(tmp_path, tokens, monkeypatch, setting, tensor_parallel):
    attempts = []
    monkeypatch.setattr(extract_module, "_compile_each", attempts.append)
    monkeypatch.setattr(extract_module, "_tensor_parallel", lambda: tensor_parallel)
    model = tiny_llama(**SHAPE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manifest = extract(model, tokens, tmp_path / "cache.safetensors", compile=setting)
    assert attempts == [] and manifest["compiled"] is False and compiled_layers(model) == [False] * SHAPE["layers"]
    assert not [w for w in caught if "hidden.compile" in str(w.message)]


def test_an_unknown_setting_is_refused_with_the_choices(tmp_path, tokens):
    with pytest.raises(HiddenCacheError, match=r"hidden.compile must be auto, true or false, got 'yes'"):
        extract(tiny_llama(**SHAPE), tokens, tmp_path / "cache.safetensors", compile="yes")
    assert not (tmp_path / "cache.safetensors").exists()


@pytest.mark.parametrize("setting", ["auto", True, False])
def test_the_job_script_hands_hidden_compile_from_the_config_to_extraction(tmp_path, tokens, monkeypatch, setting):
    target_dir = tmp_path / "target"
    tiny_llama(target_dir, **SHAPE)
    handed = {}
    monkeypatch.setattr(target_model, "load_tokenizer", lambda *args: None)  # tokenizing is not under test
    monkeypatch.setattr(target_model, "template_fingerprint", lambda tokenizer: TEMPLATE)
    monkeypatch.setattr(tokenize_module, "tokenize_shard", lambda **kw: None)
    monkeypatch.setattr(extract_module, "extract_target_shard", lambda **kw: handed.update(kw))
    snakemake = SimpleNamespace(
        log=[str(tmp_path / "logs" / "0001.log")], threads=torch.get_num_threads(), config={"hidden": {"tensor_parallel": 1, "compile": setting}},
        input=SimpleNamespace(model=str(target_dir), completions=str(tmp_path / "completions.parquet")),
        output=SimpleNamespace(tokens=str(tokens), hidden=str(tmp_path / "hidden" / "0001.safetensors")),
        params=SimpleNamespace(model={"dtype": "float32", "device": "cpu", "trust_remote_code": False}, max_seq_len=64, aux_layer_ids=None,
                               hidden={"batch_tokens": 32, "dtype": "float32"}),
    )
    runpy.run_path(str(SCRIPT), init_globals={"snakemake": snakemake})
    assert handed["compile"] == setting and handed["batch_tokens"] == 32


def compile_without_inductor(layers):
    for layer in layers:
        layer.compile(dynamic=True, backend="eager")  # traced by dynamo, run as traced: seconds, not inductor's tens


def test_compile_false_after_a_compiled_extraction_runs_the_same_model_eagerly(tmp_path, tokens, monkeypatch):
    model = tiny_llama(**SHAPE)
    eager = extract(model, tokens, tmp_path / "eager.safetensors", compile=False)
    monkeypatch.setattr(extract_module, "_compile_each", compile_without_inductor)
    assert extract(model, tokens, tmp_path / "compiled.safetensors", compile=True)["compiled"] is True
    assert compiled_layers(model) == [True] * SHAPE["layers"]
    assert extract(model, tokens, tmp_path / "eager-again.safetensors", compile=False)["compiled"] is False
    assert compiled_layers(model) == [False] * SHAPE["layers"] and eager["compiled"] is False
    torch.testing.assert_close(states(tmp_path / "eager-again.safetensors"), states(tmp_path / "eager.safetensors"), rtol=0, atol=0)


def test_a_compiled_layer_failing_on_a_later_batch_stops_extraction_naming_the_setting_that_avoids_it(tmp_path, monkeypatch):
    tokens = tmp_path / "tokens.parquet"
    write_tokens(tokens, [30, 9, 8])  # a one-row batch first, compiled for one row: the two-row batch after it compiles a second graph
    compiles = []

    def backend(graph, example_inputs):
        compiles.append(graph)
        if len(compiles) > 1:
            raise RuntimeError("cannot compile this shape")
        return graph.forward

    def compile_once_then_fail(layers):
        for layer in layers:
            layer.compile(dynamic=True, backend=backend)

    monkeypatch.setattr(extract_module, "_compile_each", compile_once_then_fail)
    with pytest.raises(HiddenCacheError, match=r"(?s)compiled decoder layers failed on a batch of 2 x 9 tokens.*cannot compile this shape.*"
                                               r"hidden.compile: false extracts eagerly"):
        extract(tiny_llama(**SHAPE), tokens, tmp_path / "cache.safetensors", compile=True)
    assert len(compiles) == 2 and not (tmp_path / "cache.safetensors").exists()


def test_auto_compiles_on_cuda_only_a_shard_big_enough_to_repay_the_compile(monkeypatch):
    monkeypatch.setattr(extract_module, "_tensor_parallel", lambda: False)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    small = 2 * 135e6 * 1e6  # SmolLM2-135M, a million tokens
    large = 2 * 7e9 * 8e6  # an 8B target's decoder, eight million tokens
    assert not extract_module._compiles("auto", cuda, small) and extract_module._compiles("auto", cuda, large)
    assert not extract_module._compiles("auto", cpu, large)
    assert extract_module._compiles(True, cpu, small) and not extract_module._compiles(False, cuda, large)
