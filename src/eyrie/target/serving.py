"""How the target is served by SGLang: the launch command, built here and nowhere else.

`launch_command` turns settings (the config's engine.sglang section for regeneration; the trained
drafter's EAGLE3 settings for serving) into `python -m sglang.launch_server ...`, on 127.0.0.1 by
default, and refuses a drafter/algorithm mismatch before any GPU time is spent: serving an
EAGLE-3 drafter with `--speculative-algorithm EAGLE` silently gives acceptance 1.0.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from eyrie.core.errors import ConfigError

HOST = "127.0.0.1"
EAGLE3_ARCHITECTURES = {"LlamaForCausalLMEagle3"}
EAGLE1_ARCHITECTURES = {"LlamaForCausalLMEagle"}


def check_speculative(speculative: dict) -> None:
    """Refuse an algorithm that does not fit the drafter, before launch (SGLang itself would load it wrongly or late)."""
    algorithm = str(speculative.get("algorithm") or "").upper()
    draft = speculative.get("draft_model_path")
    if algorithm in ("EAGLE", "EAGLE3"):
        if not draft:
            raise ConfigError(f"speculative algorithm {algorithm} needs draft_model_path (the drafter directory)")
        config_path = Path(draft) / "config.json"
        if not config_path.is_file():
            raise ConfigError(f"speculative draft_model_path {draft}: no config.json there; point it at the drafter directory (results/drafter/)")
        architectures = set(json.loads(config_path.read_text()).get("architectures") or [])
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
    extra_args: list[str] | tuple[str, ...] = (),
) -> list[str]:
    """The one place where an SGLang server command line is built (regeneration and serving benchmarks alike).

    speculative: {algorithm, draft_model_path, num_steps, eagle_topk, num_draft_tokens} or None.
    """
    command = [python or sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path), "--host", host, "--port", str(port)]
    if tp_size != 1:
        command += ["--tp-size", str(tp_size)]
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


def command_from_config(sglang: dict, model_path: str, port: int) -> list[str]:
    """launch_command from the config's engine.sglang section."""
    return launch_command(
        sglang.get("model_path") or model_path,
        port,
        python=sglang.get("python"),
        tp_size=sglang.get("tp_size", 1),
        dtype=sglang.get("dtype"),
        mem_fraction_static=sglang.get("mem_fraction_static"),
        context_length=sglang.get("context_length"),
        speculative=sglang.get("speculative"),
        extra_args=sglang.get("extra_args") or (),
    )
