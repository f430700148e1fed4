"""The SGLang and vLLM commands that serve the target with the trained drafter, as the drafter section shows them.

The commands themselves are built by eyrie.target.serving (launch_command, vllm_command,
vllm_speculators_command), the one place that knows the engines' flags; this module only chooses
what goes into them: the target directory the pipeline uses, the config's engine.sglang settings,
the drafter's dtype (an explicit --dtype for both engines), and the chain length k the benchmarks
measured (bench.draft_tokens from the config, or the schema's default, before any benchmark ran).
A benchmark's sweep recommends its own (S, K, N): `setting_command` serves that one. The
speculators-format export (results/drafter-speculators) gets its own vLLM command once built.
"""

from __future__ import annotations

import shlex
from typing import Any

from eyrie.core.errors import EyrieError
from eyrie.core.schema import section_defaults
from eyrie.drafter.speculators_export import export_dir_for
from eyrie.report.values import distinct, warn
from eyrie.target.serving import HOST, VLLM_PORT, launch_command, serving_dtype, vllm_command, vllm_speculators_command

SERVE_PORT = 30000  # SGLang's default port, for the command shown on the page


def serve_command(config: dict, drafter_dir: str, bench: dict, warnings: list) -> dict[str, Any]:
    """{serve_command, serve_command_lines, serve_host, serve_port, serve_draft_tokens(_source)}; no command (and a warning) if none can be built."""
    draft_tokens, source = _draft_tokens(config, bench, warnings)
    figures = {
        "serve_command": None,
        "serve_command_lines": None,
        "serve_host": HOST,
        "serve_port": SERVE_PORT,
        "serve_draft_tokens": draft_tokens,
        "serve_draft_tokens_source": source,
    }
    figures.update(_vllm_figures(config, drafter_dir, draft_tokens, warnings))
    try:
        command = _launch_command(config, drafter_dir, draft_tokens, 1, draft_tokens + 1)
    except (EyrieError, OSError, ValueError) as err:
        warn(warnings, "drafter", f"no SGLang command for this drafter: {err}")
        return figures
    return {**figures, "serve_command": shlex.join(command), "serve_command_lines": _continued_lines(command)}


def _vllm_figures(config: dict, drafter_dir: str, draft_tokens: int, warnings: list) -> dict[str, Any]:
    """{serve_vllm_command(_lines), serve_vllm_port, serve_dtype(_source), serve_speculators_dir, serve_vllm_speculators_command(_lines)}."""
    sglang = ((config.get("engine") or {}).get("sglang")) or {}
    export_dir = str(export_dir_for(drafter_dir))
    figures: dict[str, Any] = {"serve_vllm_command": None, "serve_vllm_command_lines": None, "serve_vllm_port": VLLM_PORT, "serve_dtype": None, "serve_dtype_source": None,
                               "serve_speculators_dir": export_dir, "serve_vllm_speculators_command": None, "serve_vllm_speculators_command_lines": None}
    try:
        dtype = serving_dtype(drafter_dir, sglang.get("dtype"))
        command = vllm_command(_target_path(config), drafter_dir, draft_tokens, dtype=dtype, **_split_and_code(config))
    except (EyrieError, OSError, ValueError) as err:
        warn(warnings, "drafter", f"no vLLM command for this drafter: {err}")
        return figures
    explicit = sglang.get("dtype") not in (None, "auto")
    figures.update(serve_dtype=dtype, serve_dtype_source="engine.sglang.dtype from the config" if explicit else "the drafter's own dtype (config.json torch_dtype)",
                   serve_vllm_command=shlex.join(command), serve_vllm_command_lines=_continued_lines(command))
    try:
        speculators = vllm_speculators_command(export_dir, dtype=dtype, **_split_and_code(config))
    except (EyrieError, OSError, ValueError):
        return figures  # not exported (yet): `snakemake results/drafter-speculators` builds it
    return {**figures, "serve_vllm_speculators_command": shlex.join(speculators), "serve_vllm_speculators_command_lines": _continued_lines(speculators)}


def _draft_tokens(config: dict, bench: dict, warnings: list) -> tuple[int, str]:
    """The chain length k to serve with, and where it comes from: serve what was measured."""
    measured = distinct(b.get("draft_tokens") for b in bench["rows"] if b["built"])
    if measured:
        if len(measured) > 1:
            warn(warnings, "drafter", f"the benchmarks used different draft_tokens ({', '.join(map(str, measured))}); the command uses {measured[0]}")
        return int(measured[0]), "the chain length k the benchmarks measured (bench.draft_tokens)"
    configured = (config.get("bench") or {}).get("draft_tokens")
    if configured:
        return int(configured), "bench.draft_tokens from the config (no benchmark measured yet)"
    return int(section_defaults("bench")["draft_tokens"]), "the default chain length (no benchmark measured yet)"


def setting_command(config: dict, drafter_dir: str, setting: dict) -> dict[str, Any]:
    """{command, command_lines, command_error}: the launch command serving one (steps, topk, draft_tokens) setting."""
    try:
        command = _launch_command(config, drafter_dir, setting["steps"], setting["topk"], setting["draft_tokens"])
    except (EyrieError, OSError, ValueError, KeyError, TypeError) as err:
        return {"command": None, "command_lines": None, "command_error": str(err)}
    return {"command": shlex.join(command), "command_lines": _continued_lines(command), "command_error": None}


def adaptive_command(config: dict, drafter_dir: str, adaptive_flags: str) -> dict[str, Any]:
    """{adaptive_command, adaptive_command_lines, adaptive_command_error}: the launch command serving SGLang's adaptive tiers,
    from the benchmark's flags (eyrie.bench.concurrency.sglang_adaptive_flags: initial steps and topk, the tiers' file)
    with the drafter's path and the config's own serving settings; no --speculative-num-draft-tokens (SGLang derives it)."""
    taken = ("--speculative-algorithm", "--speculative-num-steps", "--speculative-eagle-topk")  # _launch_command writes these
    values, rest, words = {}, [], iter(shlex.split(adaptive_flags))
    for word in words:
        if word in taken:
            values[word] = next(words, None)
        else:
            rest.append(word)
    try:
        command = _launch_command(config, drafter_dir, int(values["--speculative-num-steps"]), int(values["--speculative-eagle-topk"]), None, rest)
    except (EyrieError, OSError, ValueError, KeyError, TypeError) as err:
        return {"adaptive_command": None, "adaptive_command_lines": None, "adaptive_command_error": str(err)}
    return {"adaptive_command": shlex.join(command), "adaptive_command_lines": _continued_lines(command), "adaptive_command_error": None}


def _launch_command(config: dict, drafter_dir: str, steps: int, topk: int, draft_tokens: int | None, extra: list[str] = ()) -> list[str]:
    """SGLang serving the drafter with --speculative-num-steps, --speculative-eagle-topk, --speculative-num-draft-tokens
    (None: left to SGLang), then `extra` flags."""
    sglang = ((config.get("engine") or {}).get("sglang")) or {}
    speculative = {"algorithm": "EAGLE3", "draft_model_path": drafter_dir, "num_steps": steps, "eagle_topk": topk, "num_draft_tokens": draft_tokens}
    return launch_command(
        _serving_model_path(config),
        SERVE_PORT,
        python="python",  # portable: run it with the interpreter that has sglang installed
        tp_size=_split_and_code(config)["tp_size"],
        dtype=sglang.get("dtype"),
        mem_fraction_static=sglang.get("mem_fraction_static"),
        context_length=sglang.get("context_length"),
        speculative=speculative,
        trust_remote_code=_split_and_code(config)["trust_remote_code"],
        extra_args=[*(sglang.get("extra_args") or ()), *extra],
    )


def _split_and_code(config: dict) -> dict:
    """{tp_size, trust_remote_code} for either engine: engine.sglang.tp_size splits the served target in both, and
    model.trust_remote_code lets both run the target's own code."""
    sglang = ((config.get("engine") or {}).get("sglang")) or {}
    return {"tp_size": int(sglang.get("tp_size") or 1), "trust_remote_code": bool((config.get("model") or {}).get("trust_remote_code"))}


def _continued_lines(command: list[str]) -> str:
    """The same command for reading: one option per line, joined by shell line continuations (still pastes as is)."""
    groups: list[list[str]] = []
    for arg in command:
        if arg.startswith("--") or not groups:
            groups.append([arg])
        else:
            groups[-1].append(arg)
    return " \\\n    ".join(shlex.join(group) for group in groups)


def _target_path(config: dict) -> str:
    """The target directory the pipeline uses (rules/common.smk model_dir)."""
    model = config.get("model") or {}
    return str(model.get("path") or f"resources/models/{model.get('name') or 'unknown'}")


def _serving_model_path(config: dict) -> str:
    """The target directory the pipeline uses (rules/common.smk model_dir), unless engine.sglang.model_path names another."""
    model = config.get("model") or {}
    sglang = ((config.get("engine") or {}).get("sglang")) or {}
    return str(sglang.get("model_path") or model.get("path") or f"resources/models/{model.get('name') or 'unknown'}")
