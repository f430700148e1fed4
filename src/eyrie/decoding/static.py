"""The static engines and the choice between them: StaticLlama (eyrie.decoding.static_llama), the fused fast path for
Llama-structured decoders, and StaticModules (eyrie.decoding.static_modules), any other family's own decoder layers on
the same static cache; transformers' decode where neither can run a target, with the reason."""

from __future__ import annotations

from eyrie.decoding.static_common import UnsupportedTargetError
from eyrie.decoding.static_llama import SUPPORTED_MODEL_TYPES, StaticLlama, check_supported, llama_reason
from eyrie.decoding.static_modules import StaticModules, modules_reason

__all__ = ["DECODERS", "SUPPORTED_MODEL_TYPES", "StaticLlama", "StaticModules", "check_supported", "llama_reason", "open_decoder",
           "open_engine", "unsupported_reason"]


def unsupported_reason(model) -> str | None:
    """Why no static engine (the Llama fast path or the target's own modules) can run `model`, or None when one can."""
    if llama_reason(model) is None:
        return None
    return modules_reason(model)


def open_engine(model, capacity: int = 512, cuda_graphs: bool | None = None, compile: bool = False, compile_mode: str = "default"):
    """The fastest static engine for `model`: StaticLlama for Llama-structured decoders, else StaticModules (the
    target's own decoder layers on the static cache; compile does not apply there). UnsupportedTargetError says why
    neither can run it. compile_mode: eyrie.decoding.static_common.COMPILE_MODES."""
    if llama_reason(model) is None:
        return StaticLlama(model, capacity=capacity, cuda_graphs=cuda_graphs, compile=compile, compile_mode=compile_mode)
    return StaticModules(model, capacity=capacity, cuda_graphs=cuda_graphs)


# --------------------------------------------------------------------------- choosing


DECODERS = ("auto", "static", "transformers")


def open_decoder(model, setting: str, capacity: int, cuda_graphs: bool | None = None, compile: str | bool = False,
                 compile_mode: str = "default"):
    """(what greedy_decode/speculative_decode take as target, decoder label, why no static engine ran or None; the label names the engine).

    compile: True/False, or "auto" = fuse the static decoder's steps on CUDA, where they are launch-bound
    (bf16 on an H200 at the default target's shape: 3.00 -> 1.72 ms per greedy token, benchmarks/decode_floor.py).
    """
    if setting not in DECODERS:
        raise UnsupportedTargetError(f"bench.decoder is {setting!r}; use one of {', '.join(DECODERS)}")
    if setting == "transformers":
        return model, "transformers", "bench.decoder: transformers"
    if compile == "auto":
        compile = next(model.parameters()).device.type == "cuda"
    try:
        engine = open_engine(model, capacity=capacity, cuda_graphs=cuda_graphs, compile=bool(compile), compile_mode=compile_mode)
    except UnsupportedTargetError as error:
        if setting == "static":
            raise
        return model, "transformers", str(error)
    return engine, engine.label, None
