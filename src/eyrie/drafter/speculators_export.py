"""The drafter in the speculators format: what `vllm serve <dir>` serves and speculators' Eagle3DraftModel loads.

The SGLang-layout drafter directory (eyrie.drafter.checkpoint) already serves both engines; this export is
vLLM's native format, read by vLLM 0.33's transformers_utils/configs/speculators (algos.update_eagle3,
base.SpeculatorsConfig) and by speculators 0.9.0 (models/eagle3: Eagle3SpeculatorConfig, Eagle3DraftModel):

    speculators_model_type  "eagle3" (how vLLM and speculators recognise the format), architectures ["Eagle3Speculator"]
    transformer_layer_config  the one draft layer as a Llama config (sizes, heads, head_dim, rope, the target's vocab)
    draft_vocab_size, target_hidden_size
    eagle_aux_hidden_state_layer_ids  vLLM's convention: the capture indices (eyrie.target.aux_layers.vllm_layer_ids)
    norm_before_residual  false, always written: vLLM reads an absent one as TRUE, which adds attention to the
                          normed state instead of the pre-norm one, and drafts wrongly without any error
    norm_before_fc, fc_norm, norm_output  the EAGLE-3.1 flags as trained
    speculators_config  algorithm eagle3, one greedy proposal of k tokens (vLLM's num_speculative_tokens), and the
                        verifier: the target as served (model.served_name: a hub id or an absolute path; by default the
                        absolute path of the target directory, so the export resolves from any directory)

Tensors: the drafter's, `midlayer.*` renamed `layers.0.*`, plus `embed_tokens.weight`, the target's frozen
embeddings. Without them speculators' from_pretrained (under transformers 5.19) leaves the embeddings randomly
initialised: its NaN sentinel, which load_verifier_weights() looks for to copy the target's, is overwritten by
transformers' weight init, so the model silently drafts from random embeddings. vLLM compares them with the
target's and shares the target's when equal. Every key and shape is checked before writing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from eyrie.core.atomic import READABLE, write_directory_atomically, write_json_atomically, write_safetensors_atomically
from eyrie.drafter.checkpoint import READABLE_DIRECTORY, CheckpointError, check_checkpoint, serving_config
from eyrie.drafter.model import ARCHITECTURE, DrafterShape
from eyrie.target.aux_layers import vllm_layer_ids

SPECULATORS_VERSION = "0.9.0"  # the speculators version whose format this follows (tests load the export with it)
ARCHITECTURES = ["Eagle3Speculator"]


def export_dir_for(drafter_dir: str | Path) -> Path:
    """Where the pipeline writes a drafter's export: results/drafter -> results/drafter-speculators (rules/speculators.smk)."""
    drafter_dir = Path(drafter_dir)
    return drafter_dir.with_name(drafter_dir.name + "-speculators")


def speculators_config(drafter_config: dict, verifier: str, verifier_architectures: list[str], speculative_tokens: int) -> dict:
    """config.json of the export, from the drafter's (SGLang-layout) config.json."""
    drafter_config = serving_config(drafter_config)
    shape = DrafterShape.from_sglang_config(drafter_config)
    if int(speculative_tokens) < 1:
        raise CheckpointError(f"speculative_tokens must be at least 1, got {speculative_tokens}")
    dtype = str(drafter_config.get("torch_dtype") or "bfloat16")
    rope = {"rope_type": "default", "rope_theta": float(shape.rope_theta), **(shape.rope_scaling or {})}
    layer = {
        "model_type": "llama",
        "vocab_size": shape.vocab_size,  # the target's: embed_tokens and t2d span it
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,  # explicit: speculators doubles hidden_size for its rotary config
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_parameters": rope,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "dtype": dtype,
    }
    return {
        "architectures": list(ARCHITECTURES),
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens), "verifier_accept_k": 1, "accept_tolerance": 0.0}
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": str(verifier), "architectures": list(verifier_architectures)},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": shape.draft_vocab_size,
        "target_hidden_size": shape.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": vllm_layer_ids(shape.aux_layer_ids),
        "norm_before_residual": False,
        "norm_before_fc": shape.norm_before_fc,
        "fc_norm": False,
        "norm_output": shape.norm_output,
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "dtype": dtype,
    }


def expected_tensors(shape: DrafterShape) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """Every tensor of the export with its shape (dtype None: the weight dtype): the drafter's, renamed, and embed_tokens."""
    renamed = {_rename(name): spec for name, spec in shape.expected_tensors().items()}
    return {**renamed, "embed_tokens.weight": ((shape.vocab_size, shape.hidden_size), None)}


def _rename(name: str) -> str:
    """SGLang's midlayer.* is speculators' (and vLLM's) first decoder layer, layers.0.*."""
    return "layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name


def speculators_tensors(tensors: dict[str, torch.Tensor], shape: DrafterShape, embed_tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """The export's tensors from the drafter's (checked first) and the target's embeddings, in the drafter's weight dtype."""
    check_checkpoint(tensors, shape)
    weight_dtype = tensors["fc.weight"].dtype
    if tuple(embed_tokens.shape) != (shape.vocab_size, shape.hidden_size):
        raise CheckpointError(
            f"the target's embeddings have shape {tuple(embed_tokens.shape)}, the drafter was trained for "
            f"({shape.vocab_size}, {shape.hidden_size}); export with the drafter's own target"
        )
    exported = {_rename(name): tensor.contiguous() for name, tensor in tensors.items()}
    exported["embed_tokens.weight"] = embed_tokens.detach().to(weight_dtype).contiguous()
    problems = []
    for name, (dims, dtype) in expected_tensors(shape).items():
        if name not in exported:
            problems.append(f"missing {name}")
        elif tuple(exported[name].shape) != dims or exported[name].dtype != (dtype or weight_dtype):
            problems.append(f"{name} is {tuple(exported[name].shape)} {exported[name].dtype}, expected {dims} {dtype or weight_dtype}")
    problems += [f"unexpected {name}" for name in sorted(set(exported) - set(expected_tensors(shape)))]
    if problems:
        raise CheckpointError("speculators export does not match Eagle3DraftModel's layout: " + "; ".join(problems))
    return exported


def export_speculators(drafter_dir: str | Path, target_dir: str | Path, out_dir: str | Path, speculative_tokens: int,
                       verifier: str | None = None, trust_remote_code: bool = False) -> dict:
    """Write the speculators-format directory (config.json, model.safetensors), swapped in whole; returns its config.

    verifier: the target as served, written into the export (what `vllm serve <out_dir>` serves and speculators' from_pretrained
    loads): a hub id or an absolute path; by default target_dir's absolute path, which resolves from any directory.
    """
    from safetensors.torch import load_file

    from eyrie.target.head import load_target_head, target_text_config

    drafter_dir, target_dir = Path(drafter_dir), Path(target_dir)
    config_path = drafter_dir / "config.json"
    try:
        drafter_config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{config_path}: cannot read the drafter's config ({err})") from None
    if drafter_config.get("architectures") != [ARCHITECTURE]:
        raise CheckpointError(f"{config_path}: architectures is {drafter_config.get('architectures')!r}, expected [{ARCHITECTURE!r}]")
    drafter_config = serving_config(drafter_config, config_path)
    shape = DrafterShape.from_sglang_config(drafter_config)
    target_config = target_text_config(target_dir, trust_remote_code)  # model.trust_remote_code, never a prompt
    target_architectures = json.loads((target_dir / "config.json").read_text(encoding="utf-8")).get("architectures") or []
    config = speculators_config(drafter_config, verifier or str(target_dir.resolve()), target_architectures, speculative_tokens)
    own = drafter_config.get("eyrie") or {}
    config["eyrie"] = {
        "drafter": str(drafter_dir),
        "embed_tokens": "the target's embeddings, frozen (speculators' from_pretrained would initialise them randomly)",
        **{key: own[key] for key in ("template_sha256", "target_fingerprint") if key in own},
    }
    tensors = speculators_tensors(load_file(str(drafter_dir / "model.safetensors")), shape,
                                  load_target_head(target_dir, target_config)["embed"])

    def write(directory: Path) -> None:
        write_json_atomically(directory / "config.json", config, indent=2)
        write_safetensors_atomically(tensors, directory / "model.safetensors", {"format": "pt"})
        for path in directory.iterdir():
            os.chmod(path, READABLE)
        os.chmod(directory, READABLE_DIRECTORY)

    write_directory_atomically(out_dir, write)
    return config


def main(argv: list[str] | None = None) -> int:
    """`python -m eyrie.drafter.speculators_export DRAFTER_DIR TARGET_DIR OUT_DIR --speculative-tokens K [--verifier PATH]`."""
    parser = argparse.ArgumentParser(prog="python -m eyrie.drafter.speculators_export", description=__doc__.split("\n")[0])
    parser.add_argument("drafter_dir")
    parser.add_argument("target_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--speculative-tokens", type=int, required=True, help="k: vLLM's num_speculative_tokens")
    parser.add_argument("--verifier", help="the target as served, a hub id or an absolute path (default: TARGET_DIR made absolute)")
    parser.add_argument("--trust-remote-code", action="store_true", help="run the target directory's own config code (model.trust_remote_code)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    config = export_speculators(args.drafter_dir, args.target_dir, args.out_dir, args.speculative_tokens, args.verifier, args.trust_remote_code)
    print(f"speculators export: wrote {args.out_dir} (eagle3, k={args.speculative_tokens}, "
          f"aux layers {config['eagle_aux_hidden_state_layer_ids']} in vLLM's convention, verifier {config['speculators_config']['verifier']['name_or_path']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
