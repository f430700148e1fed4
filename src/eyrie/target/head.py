"""The target's embeddings, final norm and LM head read straight from its safetensors.

The drafter shares the target's embeddings (frozen) and starts its own head from the target's LM
head rows: reading these three tensors by name spares loading the whole target.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eyrie.core.errors import InputFileError
from eyrie.target.family import norm_is_zero_centred, target_text_config  # noqa: F401 (target_text_config: callers' import)


class TargetHeadError(InputFileError):
    """The target's safetensors lack the embeddings or LM head the drafter needs, or hold them misshapen."""


def _target_weight_files(target_dir: Path) -> dict[str, Path]:
    """tensor name -> safetensors file holding it (sharded or not)."""
    from safetensors import safe_open

    index = target_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: target_dir / file for name, file in weight_map.items()}
    files = sorted(target_dir.glob("*.safetensors"))
    if not files:
        raise TargetHeadError(f"{target_dir}: no *.safetensors weights; the drafter needs the target's embeddings and LM head")
    where = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                where[name] = file
    return where


def load_target_head(target_dir: str | Path, config=None, trust_remote_code: bool = False) -> dict[str, torch.Tensor]:
    """The target's embed_tokens, lm_head (= embed_tokens when tied) and final norm, float32; nothing else is read.

    norm is the effective weight a plain RMSNorm multiplies by (1 + w for a zero-centred Gemma norm). Without `config`
    the target's config is read with model.trust_remote_code as given (an explicit bool: transformers never prompts)."""
    from safetensors import safe_open

    target_dir = Path(target_dir)
    config = config if config is not None else target_text_config(target_dir, trust_remote_code)
    where = _target_weight_files(target_dir)
    embed_keys = sorted((k for k in where if k.endswith("embed_tokens.weight")), key=len)
    if not embed_keys:
        raise TargetHeadError(f"{target_dir}: no *embed_tokens.weight tensor in the target's safetensors")
    embed_key = embed_keys[0]
    prefix = embed_key[: -len("embed_tokens.weight")]  # "model." for Llama-like targets

    def read(name: str) -> torch.Tensor:
        with safe_open(str(where[name]), framework="pt") as f:
            return f.get_tensor(name).float()

    embed = read(embed_key)
    V, H = int(config.vocab_size), int(config.hidden_size)
    if tuple(embed.shape) != (V, H):
        raise TargetHeadError(f"{target_dir}: {embed_key} has shape {tuple(embed.shape)}, the config says ({V}, {H})")
    tied = bool(getattr(config, "tie_word_embeddings", False))
    head_keys = sorted((k for k in where if k.endswith("lm_head.weight")), key=len)
    if tied:
        lm_head = embed
    elif head_keys:
        lm_head = read(head_keys[0])
    else:
        raise TargetHeadError(f"{target_dir}: the target does not tie its embeddings but has no lm_head.weight")
    if tuple(lm_head.shape) != (V, H):
        raise TargetHeadError(f"{target_dir}: lm_head has shape {tuple(lm_head.shape)}, expected ({V}, {H})")
    norm = read(prefix + "norm.weight") if prefix + "norm.weight" in where else None
    if norm is not None and tuple(norm.shape) != (H,):
        norm = None
    if norm is not None and norm_is_zero_centred(config):
        norm = norm + 1.0  # the effective weight of Gemma's (1 + w) norm: the drafter's norm is a plain RMSNorm, as in SGLang and vLLM
    return {"embed": embed, "lm_head": lm_head, "norm": norm}
