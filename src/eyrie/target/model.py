"""The target model: build an HF directory from a GGUF, load it, and fingerprint it and its chat template."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from eyrie.core.atomic import write_directory_atomically
from eyrie.core.errors import ConfigError, InputFileError
from eyrie.target import family


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
    align_special_tokens(tokenizer, model.generation_config, gguf_special_ids(gguf_path))

    def save(temporary: Path) -> None:
        model.save_pretrained(temporary)
        tokenizer.save_pretrained(temporary)

    write_directory_atomically(out_dir, save)
    return out_dir


GGUF_SPECIAL_TOKENS = {"bos": "bos_token_id", "eos": "eos_token_id", "pad": "padding_token_id", "unk": "unknown_token_id"}


def gguf_special_ids(gguf_path: str | Path) -> dict[str, int]:
    """The GGUF's own special token ids (its tokenizer.ggml.*_token_id fields), by tokenizer name, where it records them."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf_path)).fields
    ids = {}
    for name, key in GGUF_SPECIAL_TOKENS.items():
        field = fields.get(f"tokenizer.ggml.{key}")
        if field is not None and field.data:
            ids[name] = int(field.parts[field.data[0]][0])
    return ids


def align_special_tokens(tokenizer, generation_config, ids: dict[str, int]) -> None:
    """Set the tokenizer's and generation config's special tokens to the GGUF's ids.

    transformers' GGUF loader maps them differently across versions: under 5.17 SmolLM2's eos came out as
    <|im_start|> (id 1), under 5.24 as <|im_end|> (id 2, what the GGUF says). The eos decides where generation
    stops and is part of the template fingerprint, so a model converted on one machine must equal one converted
    on another.
    """
    for name, token_id in ids.items():
        if not 0 <= token_id < len(tokenizer):
            continue  # a GGUF naming an id outside its own vocabulary: leave transformers' choice
        setattr(tokenizer, f"{name}_token", tokenizer.convert_ids_to_tokens(token_id))
        if name in ("bos", "eos", "pad"):
            setattr(generation_config, f"{name}_token_id", token_id)


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


def load_model(model_dir: str | Path, dtype: str = "auto", device: str = "auto", trust_remote_code: bool = False, tensor_parallel: int = 1):
    """The model alone, for inference (eval mode); weights come from safetensors only.

    tensor_parallel > 1: this process's part of the model, as one of that many torchrun ranks, split by
    transformers' own tensor parallelism (the model's tp plan: attention heads and MLP columns over the
    ranks, each block's output all-reduced, so every rank holds the whole hidden states). Each rank
    reads only its shard of every weight.
    """
    from transformers import AutoModelForCausalLM

    device = resolve_device(device)
    parallel = tensor_parallel_settings(model_dir, tensor_parallel, device, trust_remote_code) if tensor_parallel > 1 else {}
    model = AutoModelForCausalLM.from_pretrained(
        check_model_dir(model_dir),
        dtype=resolve_dtype(dtype, device),
        trust_remote_code=trust_remote_code,
        use_safetensors=True,
        **parallel,
    )
    if not parallel:
        model = model.to(device)  # a tensor-parallel model is already on this rank's device
    model.eval()
    return model


def check_tensor_parallel(config, processes: int) -> None:
    """Refuse a target that transformers cannot split over `processes` ranks: it needs a tp plan, and each rank whole heads.

    transformers shards q/k/v by output width and does not check the heads: a split head fails the first
    forward with a reshape error, so it is checked here, before a rank starts.
    """
    text = family.text_config(config)
    if not (getattr(text, "base_model_tp_plan", None) or getattr(config, "base_model_tp_plan", None)):
        raise ConfigError(
            f"hidden.tensor_parallel: {processes}: transformers has no tensor-parallel plan for this target ({config.model_type}); set it to 1"
        )
    for name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(text, name, None)
        if isinstance(heads, int) and heads % processes:
            raise ConfigError(
                f"hidden.tensor_parallel: {processes} does not divide the target's {name} ({heads}); every rank must hold whole heads, "
                f"so use a divisor of {heads}"
            )


GIB = 1 << 30


def check_experts_split(model_dir: str | Path, config, processes: int) -> None:
    """Refuse an MoE target under tensor parallelism: transformers' tp plan splits attention and dense MLPs but
    replicates every routed expert on every rank, so the split gives an MoE target (where the experts are most of the
    weights) almost no memory relief. The message carries the bytes: expert weights per rank against the rest's share."""
    text = family.text_config(config)
    experts = family.expert_count(text)
    if not experts:
        return
    sizes = family.weight_bytes(model_dir)
    expert_bytes = sum(n for name, n in sizes.items() if family.is_routed_expert(name))
    rest = sum(sizes.values()) - expert_bytes
    whole = expert_bytes + rest
    per_rank = expert_bytes + rest / processes
    raise family.UnsupportedTargetError(
        f"hidden.tensor_parallel: {processes} on an MoE target ({text.model_type}, {experts} routed experts per layer): transformers' "
        f"tensor-parallel plan replicates every routed expert, so each rank would hold all {expert_bytes / GIB:.3g} GiB of expert weights "
        f"beside 1/{processes} of the other {rest / GIB:.3g} GiB: {per_rank / GIB:.3g} GiB per rank of {whole / GIB:.3g} GiB in all "
        f"({per_rank / whole:.0%}), where a real split would hold {whole / processes / GIB:.3g} GiB. Set hidden.tensor_parallel: 1 and "
        "extract on one device that holds the whole target"
    )


def check_tensor_parallel_device(device: str, processes: int) -> None:
    """Refuse a device that transformers' tensor parallelism would not use: it binds each rank to the accelerator torch was
    built for (CUDA for a CUDA build, one GPU per LOCAL_RANK, even with no GPU visible), and to the CPU over gloo only
    with a CPU build of torch, whatever model.device says."""
    import torch

    accelerator = torch.accelerator.current_accelerator()  # the build's accelerator, None for a CPU build
    placed = accelerator.type if accelerator is not None else "cpu"
    if placed != torch.device(device).type:
        raise ConfigError(
            f"hidden.tensor_parallel: {processes} with model.device {device}: transformers' tensor parallelism puts the ranks on "
            f"{placed}, the accelerator this torch was built for; "
            + ("run it on GPUs (model.device: cuda), or with a CPU build of torch" if placed != "cpu" else "set model.device: cpu")
        )
    if placed == "cuda" and torch.cuda.device_count() < processes:
        raise ConfigError(f"hidden.tensor_parallel: {processes} ranks, one GPU each, but this machine shows {torch.cuda.device_count()} CUDA devices")


def tensor_parallel_settings(model_dir: str | Path, processes: int, device: str, trust_remote_code: bool = False) -> dict:
    """from_pretrained's arguments for this torchrun rank's part of a `processes`-way split target, once the target and
    the device are checked (check_tensor_parallel, check_tensor_parallel_device)."""
    from transformers import AutoConfig
    from transformers.distributed import DistributedConfig

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != processes or "RANK" not in os.environ:
        raise ConfigError(
            f"hidden.tensor_parallel: {processes}, but this process is not one of {processes} torchrun ranks (WORLD_SIZE={world}); "
            "the extract job launches them (eyrie.hidden.parallel)"
        )
    config = AutoConfig.from_pretrained(check_model_dir(model_dir), trust_remote_code=trust_remote_code)
    check_tensor_parallel(config, processes)
    check_experts_split(model_dir, config, processes)
    check_tensor_parallel_device(device, processes)
    return {"distributed_config": DistributedConfig(tp_size=processes)}


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
