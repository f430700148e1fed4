"""Both serving commands, parsed by the engines' own argument code.

SGLang's: its ServerArgs parser (the sglang_parser fixture of tests/conftest.py). vLLM's: vLLM
0.33.0 does not install on a CPU machine within CI's budget (torch 2.14.0 and CUDA kernels), so its command is
checked against vLLM's own source read from its wheel: each flag must be a field of EngineArgs or FrontendArgs
(vLLM's CLI is generated from them: --speculative-config, --dtype, --host, --port, --tensor-parallel-size; a bool
field's flag, --trust-remote-code, stands bare), the --speculative-config JSON keys fields of SpeculativeConfig, its
method one of SpeculativeMethod's values, the dtype one of ModelDType's. tests/drafter/test_speculators_export.py runs
vLLM's config classes on the drafter itself.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from factories import sglang_argv
from target.engine_sources import class_fields, literal_values, vllm_file

from eyrie.core.errors import ConfigError
from eyrie.report.serve import serve_command
from eyrie.target.serving import launch_command, serving_dtype, vllm_command, vllm_speculators_command


def write_drafter(path: Path, **extra) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 2048, "torch_dtype": "bfloat16", **extra}
    (path / "config.json").write_text(json.dumps(config))
    return path


def eagle3(drafter: Path, k: int = 4) -> dict:
    return {"algorithm": "EAGLE3", "draft_model_path": str(drafter), "num_steps": k, "eagle_topk": 1, "num_draft_tokens": k + 1}


def test_sglang_serves_the_drafter_in_its_own_dtype(tmp_path, sglang_parser):
    parser, _ = sglang_parser
    drafter = write_drafter(tmp_path / "drafter")
    args = parser.parse_args(sglang_argv(launch_command("/models/target", 30000, speculative=eagle3(drafter))))
    assert args.dtype == "bfloat16"  # not SGLang's auto: a float32-config target would be served in float16
    args = parser.parse_args(sglang_argv(launch_command("/models/target", 30000, dtype="float16", speculative=eagle3(drafter))))
    assert args.dtype == "float16"  # an explicit choice wins
    args = parser.parse_args(sglang_argv(launch_command("/models/target", 30000)))
    assert args.dtype == "auto"  # no drafter, no opinion
    # The README tells users to add --enable-metrics to read sglang:spec_accept_length: SGLang's parser takes it.
    args = parser.parse_args(sglang_argv(launch_command("/models/target", 30000, speculative=eagle3(drafter), extra_args=["--enable-metrics"])))
    assert args.enable_metrics is True


def vllm_flags(command: list[str]) -> tuple[str, dict[str, str | bool]]:
    """(the served model, {field name: value}) of `vllm serve MODEL --flag value ... --bare-flag ...`; a flag with no
    value (the next word is another flag, or none follows) reads True, as vLLM's BooleanOptionalAction sets it."""
    assert command[:2] == ["vllm", "serve"]
    model, rest = command[2], command[3:]
    flags: dict[str, str | bool] = {}
    at = 0
    while at < len(rest):
        flag = rest[at]
        assert flag.startswith("--"), rest
        bare = at + 1 == len(rest) or rest[at + 1].startswith("--")
        flags[flag[2:].replace("-", "_")] = True if bare else rest[at + 1]
        at += 1 if bare else 2
    return model, flags


def check_against_vllm(command: list[str]) -> dict:
    """Every flag a field of vLLM's EngineArgs or FrontendArgs, every value one vLLM accepts; returns the flags."""
    arg_utils, config_speculative = vllm_file("engine/arg_utils.py"), vllm_file("config/speculative.py")
    fields = set(class_fields(arg_utils, "EngineArgs")) | set(class_fields(vllm_file("entrypoints/common/cli_args.py"), "FrontendArgs"))
    assert "--speculative-config" in arg_utils  # added by hand to the CLI, beside the generated flags
    _, flags = vllm_flags(command)
    assert set(flags) <= fields, f"not vLLM flags: {sorted(set(flags) - fields)}"
    engine_fields = class_fields(arg_utils, "EngineArgs")
    bare = sorted(name for name, value in flags.items() if value is True)
    # vLLM's CLI gives a bool field a --flag/--no-flag pair (BooleanOptionalAction): only those may stand bare.
    assert all(engine_fields.get(name) == "bool" for name in bare), {name: engine_fields.get(name) for name in bare}
    if "dtype" in flags:
        assert flags["dtype"] in literal_values(vllm_file("config/model.py"), "ModelDType")
    if "speculative_config" in flags:
        speculative = json.loads(flags["speculative_config"])
        assert set(speculative) <= set(class_fields(config_speculative, "SpeculativeConfig"))
        assert speculative["method"] in literal_values(config_speculative, "SpeculativeMethod")
        assert isinstance(speculative["num_speculative_tokens"], int) and speculative["num_speculative_tokens"] > 0  # Field(gt=0)
    return flags


def test_vllm_command_is_made_of_vllms_own_fields(tmp_path):
    drafter = write_drafter(tmp_path / "drafter")
    command = vllm_command("resources/models/SmolLM2-135M-Instruct", str(drafter), 4, tp_size=2)
    model, flags = vllm_flags(command)
    assert model == "resources/models/SmolLM2-135M-Instruct"
    assert json.loads(flags["speculative_config"]) == {"method": "eagle3", "model": str(drafter), "num_speculative_tokens": 4}
    assert (flags["host"], flags["port"], flags["dtype"], flags["tensor_parallel_size"]) == ("127.0.0.1", "8000", "bfloat16", "2")
    check_against_vllm(command)
    # The method is spelt out: vLLM would otherwise guess it from "eagle3" in the path, and results/drafter has none.
    assert "eagle3" not in str(drafter)


def test_both_engines_read_trust_remote_code_and_the_split_from_the_printed_commands(tmp_path, monkeypatch, sglang_parser):
    """model.trust_remote_code and engine.sglang.tp_size 8 (a Kimi-K2 on one node) reach every command the report prints,
    parsed by SGLang's own parser and checked against vLLM's fields; with trust_remote_code off the flag is absent."""
    parser, _ = sglang_parser
    monkeypatch.chdir(tmp_path)
    write_drafter(Path("results/drafter"))
    write_drafter(Path("results/drafter-speculators"), architectures=["Eagle3Speculator"], speculators_model_type="eagle3", torch_dtype=None,
                  dtype="bfloat16")
    for trust in (True, False):
        config = {"model": {"name": "Kimi-K2", "path": "/models/Kimi-K2", "trust_remote_code": trust}, "engine": {"sglang": {"tp_size": 8}},
                  "bench": {"draft_tokens": 3}}
        warnings: list = []
        figures = serve_command(config, "results/drafter", {"rows": []}, warnings)
        assert warnings == []
        sglang = shlex.split(figures["serve_command"])
        args = parser.parse_args(sglang_argv(sglang))
        assert (args.model_path, args.tp_size, args.trust_remote_code, args.speculative_algorithm) == ("/models/Kimi-K2", 8, trust, "EAGLE3")
        assert ("--trust-remote-code" in sglang) is trust
        for vllm in (shlex.split(figures["serve_vllm_command"]), shlex.split(figures["serve_vllm_speculators_command"])):
            flags = check_against_vllm(vllm)
            assert flags["tensor_parallel_size"] == "8" and flags.get("trust_remote_code", False) is trust
            assert ("--trust-remote-code" in vllm) is trust


def test_vllm_command_refuses_what_is_not_an_eagle3_drafter(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        vllm_command("/m", str(tmp_path / "missing"), 4)
    eagle1 = write_drafter(tmp_path / "eagle1", architectures=["LlamaForCausalLMEagle"])
    with pytest.raises(ConfigError, match="EAGLE-1 drafter"):
        vllm_command("/m", str(eagle1), 4)
    with pytest.raises(ConfigError, match="speculators_model_type"):
        vllm_speculators_command(str(write_drafter(tmp_path / "plain")))


def test_serving_dtype_reads_either_layout(tmp_path):
    assert serving_dtype(write_drafter(tmp_path / "a")) == "bfloat16"
    assert serving_dtype(write_drafter(tmp_path / "b", torch_dtype=None, dtype="float32")) == "float32"
    assert serving_dtype(write_drafter(tmp_path / "c"), "float16") == "float16"
    assert serving_dtype(write_drafter(tmp_path / "d", torch_dtype=None)) is None


def test_the_report_prints_both_engines_commands_with_the_users_paths(tmp_path, monkeypatch, sglang_parser):
    parser, _ = sglang_parser
    monkeypatch.chdir(tmp_path)
    write_drafter(Path("results/drafter"))
    config = {"model": {"name": "SmolLM2-135M-Instruct", "path": None}, "bench": {"draft_tokens": 3}}
    warnings: list = []
    figures = serve_command(config, "results/drafter", {"rows": []}, warnings)
    assert warnings == []
    sglang = shlex.split(figures["serve_command"])
    args = parser.parse_args(sglang_argv(sglang))
    assert (args.model_path, args.speculative_draft_model_path, args.dtype) == ("resources/models/SmolLM2-135M-Instruct", "results/drafter", "bfloat16")
    assert (args.speculative_algorithm, args.speculative_num_steps, args.speculative_num_draft_tokens) == ("EAGLE3", 3, 4)
    vllm = shlex.split(figures["serve_vllm_command"])
    assert vllm_flags(vllm)[0] == "resources/models/SmolLM2-135M-Instruct"
    assert json.loads(check_against_vllm(vllm)["speculative_config"]) == {"method": "eagle3", "model": "results/drafter", "num_speculative_tokens": 3}
    assert shlex.split(figures["serve_vllm_command_lines"].replace("\\\n", " ")) == vllm  # the readable form pastes as the same command
    assert figures["serve_speculators_dir"] == "results/drafter-speculators" and figures["serve_vllm_speculators_command"] is None

    write_drafter(Path("results/drafter-speculators"), architectures=["Eagle3Speculator"], speculators_model_type="eagle3", torch_dtype=None,
                  dtype="bfloat16")
    figures = serve_command(config, "results/drafter", {"rows": []}, warnings)
    speculators = shlex.split(figures["serve_vllm_speculators_command"])
    assert vllm_flags(speculators)[0] == "results/drafter-speculators"
    assert check_against_vllm(speculators)["dtype"] == "bfloat16"
