"""The target model: build an HF directory from a GGUF, load it, and fingerprint it and its chat template."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from eyrie.core.atomic import write_directory_atomically
from eyrie.core.errors import InputFileError


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Dequantize a GGUF into a plain HF model directory (fp32 safetensors + tokenizer + chat template)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # A GGUF-loaded model refuses save_pretrained until its quantizer config is dropped;
    # the weights are already dense, so nothing is lost.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    if not model.config.architectures:
        model.config.architectures = [type(model).__name__]
    if not tokenizer.chat_template:
        raise InputFileError(f"{gguf_path}: carries no chat template; eyrie needs the target's own template")

    def save(temporary: Path) -> None:
        model.save_pretrained(temporary)
        tokenizer.save_pretrained(temporary)

    write_directory_atomically(out_dir, save)
    return out_dir


def check_model_dir(model_dir: str | Path) -> Path:
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise InputFileError(f"{model_dir}: not an HF model directory (no config.json); set model.path to one")
    return model_dir


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise InputFileError("model.device is 'cuda' but no CUDA device is visible; use 'auto' or 'cpu'")
    return device


def resolve_dtype(dtype: str, device: str):
    import torch

    if dtype == "auto":
        return torch.bfloat16 if str(device).split(":")[0] == "cuda" else torch.float32  # "cuda:1" too (a data-parallel rank)
    return getattr(torch, dtype)


def load_tokenizer(model_dir: str | Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(check_model_dir(model_dir), trust_remote_code=trust_remote_code)
    if not tokenizer.chat_template:
        raise InputFileError(f"{model_dir}: the tokenizer has no chat template; eyrie tokenizes with the target's own")
    return tokenizer


def load_model(model_dir: str | Path, dtype: str = "auto", device: str = "auto", trust_remote_code: bool = False):
    """The model alone, for inference (eval mode); weights come from safetensors only."""
    from transformers import AutoModelForCausalLM

    device = resolve_device(device)
    model = AutoModelForCausalLM.from_pretrained(
        check_model_dir(model_dir),
        dtype=resolve_dtype(dtype, device),
        trust_remote_code=trust_remote_code,
        use_safetensors=True,
    ).to(device)
    model.eval()
    return model


def load_target(model_dir: str | Path, dtype: str = "auto", device: str = "auto", trust_remote_code: bool = False):
    """Load (model, tokenizer) for inference; weights come from safetensors only."""
    return load_model(model_dir, dtype, device, trust_remote_code), load_tokenizer(model_dir, trust_remote_code)


def template_fingerprint(tokenizer) -> str:
    """sha256 of what decides how a conversation becomes tokens: the template and its special tokens."""
    payload = json.dumps(
        {
            "chat_template": tokenizer.chat_template,
            "bos": tokenizer.bos_token,
            "eos": tokenizer.eos_token,
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()


def model_fingerprint(model_dir: str | Path) -> str:
    """Cheap identity of a model directory: its config plus each weight file's size, head and tail bytes."""
    model_dir = check_model_dir(model_dir)
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    for weights in sorted(model_dir.glob("*.safetensors")):
        size = weights.stat().st_size
        digest.update(f"{weights.name}:{size}".encode())
        with open(weights, "rb") as f:
            digest.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            digest.update(f.read(1 << 20))
    return digest.hexdigest()
