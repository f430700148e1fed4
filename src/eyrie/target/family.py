"""What differs between target families, read from the target's transformers config: one place every stage asks.

A multimodal target (Gemma3ForConditionalGeneration, Llama-4, Qwen3-VL, Kimi-VL) nests its language model's
config (text_config); the drafter, the draft vocabulary and the LM head only ever see that part. Gemma's
RMSNorms scale by (1 + w) where every other family scales by w; Gemma 3 keeps one rope per layer type (its
full-attention layers' rope reaches across the whole context, the sliding layers' does not); MoE targets keep
their experts' width beside a dense one; MLA targets (DeepSeek-V3, Kimi-K2) have no single head size.
"""

from __future__ import annotations

import json
from pathlib import Path

from eyrie.core.errors import ConfigError, InputFileError

# Families whose RMSNorm computes x_normed * (1 + w) (transformers' Gemma*RMSNorm): the weight is stored zero-centred.
ZERO_CENTRED_NORM_TYPES = frozenset({"gemma", "gemma2", "gemma3", "gemma3_text", "gemma3n", "gemma3n_text", "qwen3_next"})
# Config fields that count routed experts, by family (Qwen3-MoE / Qwen2-MoE, DeepSeek-V2/V3 / Kimi-K2, gpt-oss / Mixtral).
EXPERT_COUNT_FIELDS = ("num_experts", "n_routed_experts", "num_local_experts")


class UnsupportedTargetError(ConfigError):
    """A target eyrie cannot train a drafter for, or cannot run as configured; the message says which part and why."""


def text_config(config):
    """The language model's part of a transformers config: itself for a text model, text_config for a multimodal one."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for field in ("vocab_size", "hidden_size", "num_hidden_layers"):
        if not isinstance(getattr(text, field, None), int):
            raise UnsupportedTargetError(
                f"the target's config ({getattr(config, 'model_type', type(config).__name__)}) has no text model with an integer {field}; "
                "eyrie trains drafters for decoder language models (or multimodal ones whose config nests one as text_config)"
            )
    return text


def target_config(model_dir: str | Path, trust_remote_code: bool = False):
    """The target directory's whole transformers config."""
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise InputFileError(f"{model_dir}: not an HF model directory (no config.json); set model.path to one")
    return AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)


def target_text_config(model_dir: str | Path, trust_remote_code: bool = False):
    """The target directory's text config (text_config(target_config(...)))."""
    return text_config(target_config(model_dir, trust_remote_code))


def norm_is_zero_centred(text) -> bool:
    """True when the target's RMSNorm scales by (1 + w): a copy of its weight must add 1 to serve as a plain RMSNorm's."""
    return str(getattr(text, "model_type", "")) in ZERO_CENTRED_NORM_TYPES


def full_attention_rope(text) -> dict:
    """The rope a full-attention layer of the target uses, as transformers' rope_parameters {rope_type, rope_theta, ...}.

    Gemma 3 (and others with layer_types) key rope_parameters by layer type; the drafter attends over the whole
    context like the target's full-attention layers, so it takes theirs.
    """
    rope = getattr(text, "rope_parameters", None) or {}
    if rope and all(isinstance(v, dict) for v in rope.values()):
        if "full_attention" not in rope:
            raise UnsupportedTargetError(
                f"the target ({text.model_type}) keys rope_parameters by layer type {sorted(rope)} but has no full_attention entry; "
                "the drafter needs the rope of a layer that attends over the whole context"
            )
        rope = rope["full_attention"]
    rope = dict(rope)
    rope.setdefault("rope_theta", getattr(text, "rope_theta", 10000.0))
    rope.setdefault("rope_type", "default")
    return rope


def expert_count(text) -> int:
    """The routed experts per MoE layer (0 for a dense target)."""
    for field in EXPERT_COUNT_FIELDS:
        value = getattr(text, field, None)
        if isinstance(value, int) and value > 1:
            return value
    return 0


def is_mla(text) -> bool:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): keys and values come from a compressed latent."""
    return isinstance(getattr(text, "kv_lora_rank", None), int) and isinstance(getattr(text, "v_head_dim", None), int)


def weight_bytes(model_dir: str | Path) -> dict[str, int]:
    """{tensor name: bytes} of every weight in the target's safetensors, read from their headers only."""
    import struct

    sizes: dict[str, int] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            try:
                header = json.loads(f.read(length))
            except ValueError as err:
                raise InputFileError(f"{path}: its safetensors header is not JSON ({err})") from None
        for name, entry in header.items():
            if name != "__metadata__":
                start, end = entry["data_offsets"]
                sizes[name] = int(end) - int(start)
    return sizes


def is_routed_expert(name: str) -> bool:
    """A routed expert's weight (not a shared expert's, not the router's): what the families name mlp.experts.*."""
    return ".experts." in name and "shared_expert" not in name
