"""How the target is served by SGLang or vLLM: the launch commands, built here and nowhere else.

`launch_command` turns settings (the config's engine.sglang section for regeneration; the trained
drafter's EAGLE3 settings for serving) into `python -m sglang.launch_server ...`, on 127.0.0.1 by
default, and refuses a drafter/algorithm mismatch before any GPU time is spent: serving an
EAGLE-3 drafter with `--speculative-algorithm EAGLE` silently gives acceptance 1.0. Serving a drafter
passes an explicit `--dtype`, the drafter's own (config.json torch_dtype) unless one is given: SGLang's
`auto` serves a float32-config target (the default's) in float16 beside a bfloat16 drafter.

`vllm_command` is vLLM's `vllm serve <target> --speculative-config '{"method": "eagle3", ...}'`: without
the method vLLM runs the directory as an ordinary draft model (it guesses EAGLE-3 only from "eagle3" in
the path); `vllm_speculators_command` serves the speculators-format export, which names its own target.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from eyrie.core.errors import ConfigError

HOST = "127.0.0.1"
VLLM_PORT = 8000  # vLLM's default port
EAGLE3_ARCHITECTURES = {"LlamaForCausalLMEagle3"}
EAGLE1_ARCHITECTURES = {"LlamaForCausalLMEagle"}


def _drafter_config(draft) -> dict:
    config_path = Path(draft) / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"speculative draft_model_path {draft}: no config.json there; point it at the drafter directory (results/drafter/)")
    try:
        config = json.loads(config_path.read_text())
    except ValueError as err:
        raise ConfigError(f"{config_path}: not JSON ({err})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{config_path}: expected a JSON object")
    return config


def serving_dtype(draft_model_path, dtype: str | None = None) -> str | None:
    """The --dtype to serve a drafter with: `dtype` when given (not auto), else the drafter's torch_dtype, else None."""
    if dtype and dtype != "auto":
        return dtype
    config = _drafter_config(draft_model_path)
    written = config.get("torch_dtype") or config.get("dtype")  # SGLang's layout writes torch_dtype, the speculators export dtype
    return str(written) if written else None


def check_speculative(speculative: dict) -> None:
    """Refuse an algorithm that does not fit the drafter, before launch (SGLang itself would load it wrongly or late)."""
    algorithm = str(speculative.get("algorithm") or "").upper()
    draft = speculative.get("draft_model_path")
    if algorithm in ("EAGLE", "EAGLE3"):
        if not draft:
            raise ConfigError(f"speculative algorithm {algorithm} needs draft_model_path (the drafter directory)")
        architectures = set(_drafter_config(draft).get("architectures") or [])
        if architectures & EAGLE3_ARCHITECTURES and algorithm != "EAGLE3":
            raise ConfigError(
                f"speculative algorithm {speculative.get('algorithm')!r} does not fit the drafter at {draft}: its config.json has "
                f"architectures {sorted(architectures)}, an EAGLE-3 drafter; use --speculative-algorithm EAGLE3 "
                "(EAGLE would load it as an EAGLE-1 head and ignore the fused aux hidden states)"
            )
        if architectures & EAGLE1_ARCHITECTURES and algorithm != "EAGLE":
            raise ConfigError(f"speculative algorithm {algorithm} does not fit the EAGLE-1 drafter at {draft} (architectures {sorted(architectures)}); use EAGLE")


def launch_command(
    model_path: str,
    port: int,
    *,
    python: str | None = None,
    host: str = HOST,
    tp_size: int = 1,
    dtype: str | None = None,
    mem_fraction_static: float | None = None,
    context_length: int | None = None,
    served_model_name: str | None = None,
    api_key: str | None = None,
    speculative: dict | None = None,
    trust_remote_code: bool = False,
    extra_args: list[str] | tuple[str, ...] = (),
) -> list[str]:
    """The one place where an SGLang server command line is built (regeneration and serving benchmarks alike).

    speculative: {algorithm, draft_model_path, num_steps, eagle_topk, num_draft_tokens} or None.
    """
    command = [python or sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path), "--host", host, "--port", str(port)]
    if tp_size != 1:
        command += ["--tp-size", str(tp_size)]
    if trust_remote_code:  # model.trust_remote_code: the target's own code (Kimi-K2), which the engine refuses to run otherwise
        command += ["--trust-remote-code"]
    if speculative and str(speculative.get("algorithm") or "").upper() in ("EAGLE", "EAGLE3") and speculative.get("draft_model_path"):
        dtype = serving_dtype(speculative["draft_model_path"], dtype)  # the drafter's, not SGLang's auto
    if dtype and dtype != "auto":
        command += ["--dtype", dtype]
    if mem_fraction_static is not None:
        command += ["--mem-fraction-static", str(mem_fraction_static)]
    if context_length is not None:
        command += ["--context-length", str(context_length)]
    if served_model_name:
        command += ["--served-model-name", served_model_name]
    if api_key:
        command += ["--api-key", api_key]
    if speculative:
        check_speculative(speculative)
        command += ["--speculative-algorithm", str(speculative["algorithm"]).upper(), "--speculative-draft-model-path", str(speculative["draft_model_path"])]
        for key, flag in (("num_steps", "--speculative-num-steps"), ("eagle_topk", "--speculative-eagle-topk"), ("num_draft_tokens", "--speculative-num-draft-tokens")):
            if speculative.get(key) is not None:
                command += [flag, str(speculative[key])]
    return command + [str(a) for a in extra_args]


def vllm_command(
    model_path: str,
    drafter_dir: str,
    num_speculative_tokens: int,
    port: int = VLLM_PORT,
    *,
    host: str = HOST,
    dtype: str | None = None,
    tp_size: int = 1,
    trust_remote_code: bool = False,
    executable: str = "vllm",
) -> list[str]:
    """`vllm serve <target> --speculative-config '{"method": "eagle3", "model": <drafter>, "num_speculative_tokens": k}'`.

    vLLM reads the drafter's top-level eagle_aux_hidden_state_layer_ids (eyrie.drafter.checkpoint writes them in
    vLLM's convention); "method" is spelt out because vLLM detects EAGLE-3 only from "eagle3" in the path.
    """
    check_speculative({"algorithm": "EAGLE3", "draft_model_path": drafter_dir})
    if int(num_speculative_tokens) < 1:
        raise ConfigError(f"num_speculative_tokens must be at least 1, got {num_speculative_tokens}")
    speculative = {"method": "eagle3", "model": str(drafter_dir), "num_speculative_tokens": int(num_speculative_tokens)}
    command = [executable, "serve", str(model_path), "--host", host, "--port", str(port)] + _vllm_common(tp_size, trust_remote_code)
    dtype = serving_dtype(drafter_dir, dtype)
    if dtype:
        command += ["--dtype", dtype]
    return command + ["--speculative-config", json.dumps(speculative)]


def vllm_speculators_command(export_dir: str, port: int = VLLM_PORT, *, host: str = HOST, dtype: str | None = None,
                             tp_size: int = 1, trust_remote_code: bool = False, executable: str = "vllm") -> list[str]:
    """`vllm serve <speculators export>`: vLLM finds the target (speculators_config.verifier) and k in the export itself."""
    kind = _drafter_config(export_dir).get("speculators_model_type")
    if kind != "eagle3":
        raise ConfigError(f"{export_dir}/config.json: speculators_model_type is {kind!r}, not an EAGLE-3 speculators export")
    command = [executable, "serve", str(export_dir), "--host", host, "--port", str(port)] + _vllm_common(tp_size, trust_remote_code)
    dtype = serving_dtype(export_dir, dtype)
    if dtype:
        command += ["--dtype", dtype]
    return command


def _vllm_common(tp_size: int, trust_remote_code: bool) -> list[str]:
    """vLLM's flags for the target's split and its own code, as launch_command gives SGLang's."""
    flags = ["--tensor-parallel-size", str(tp_size)] if tp_size != 1 else []
    return flags + (["--trust-remote-code"] if trust_remote_code else [])


def command_from_config(sglang: dict, model_path: str, port: int, trust_remote_code: bool = False) -> list[str]:
    """launch_command from the config's engine.sglang section (and model.trust_remote_code)."""
    return launch_command(
        sglang.get("model_path") or model_path,
        port,
        python=sglang.get("python"),
        tp_size=sglang.get("tp_size", 1),
        dtype=sglang.get("dtype"),
        mem_fraction_static=sglang.get("mem_fraction_static"),
        context_length=sglang.get("context_length"),
        speculative=sglang.get("speculative"),
        trust_remote_code=trust_remote_code,
        extra_args=sglang.get("extra_args") or (),
    )


def eagle3_flags(steps: int, topk: int, draft_tokens: int) -> list[str]:
    """SGLang's EAGLE-3 drafting flags for one (S, K, N) setting, the drafter's path aside: what the benchmark recommends."""
    return [
        "--speculative-algorithm", "EAGLE3",
        "--speculative-num-steps", str(steps),
        "--speculative-eagle-topk", str(topk),
        "--speculative-num-draft-tokens", str(draft_tokens),
    ]
