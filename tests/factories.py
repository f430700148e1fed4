"""What many tests build: tiny targets, drafters and tokenizers, training inputs, workspaces with the readers that compare them,
a stub OpenAI server with a shard to regenerate through it, and the report's fake stage outputs.

Test modules import from here, never from each other. Each builder takes the shape and seed its callers need, so that a
test keeps the exact model it was written against.
"""

from __future__ import annotations

import html as html_lib
import itertools
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from conftest import REPO
from fault_server import FaultServer
from safetensors.torch import save_file

from eyrie import config as cfg
from eyrie.generation.conversations import COMPLETIONS_SCHEMA
from eyrie.generation.regenerate import regenerate_shard
from eyrie.plan import planned_outputs
from eyrie.tokens.shards import TOKENS_SCHEMA

TIMING_WORDS = ("second", "time", "elapsed", "per_s", "date", "digest")  # what may differ between two runs of the same job


def without_timings(value):
    if isinstance(value, dict):
        return {k: without_timings(v) for k, v in value.items() if not any(word in k.lower() for word in TIMING_WORDS)}
    if isinstance(value, list):
        return [without_timings(v) for v in value]
    return value


def content(path: Path):
    """What a file holds, timings aside: rows and eyrie metadata of a Parquet shard, tensors and manifest of a safetensors file."""
    if path.suffix == ".parquet":
        table = pq.read_table(path)
        meta = json.loads((table.schema.metadata or {}).get(b"eyrie", b"{}"))
        return table.replace_schema_metadata(None).to_pylist(), without_timings(meta)
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        manifest = json.loads((handle.metadata() or {}).get("manifest", "{}"))
    return {name: (t.dtype, t.shape, t.float().sum().item(), t.view(-1)[:64].tolist()) for name, t in tensors.items()}, without_timings(manifest)


def eyrie_verify(workdir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eyrie.cli", "verify", "-d", str(workdir)], capture_output=True, text=True, timeout=600)


def plans_of(workdir) -> tuple[set, set, set]:
    """(path, rule) of every result, as Snakemake's own DAG has them (`--summary`) and as eyrie.plan lists them, and
    those of eyrie.plan's that no job declares while nothing is lost (a dataset's prompt shards: Planned.declared_through)."""
    done = subprocess.run(  # noqa: PLW1510 -- the return code is asserted below
        [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(workdir), "--cores", "1", "--summary"],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split("\t") for line in done.stdout.splitlines()[1:] if "\t" in line]
    snakemake_plans = {(row[0], row[2]) for row in rows if not row[0].startswith("resources/")}
    planned = planned_outputs(cfg.load(workdir / "config.yaml"))
    return snakemake_plans, {(p.path, p.rule) for p in planned}, {(p.path, p.rule) for p in planned if p.declared_through}


# --------------------------------------------------------------------------- tiny targets

CAUSAL_LMS = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
              "mistral": ("MistralConfig", "MistralForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}


def llama_config(*, hidden=64, layers=8, vocab=300, heads=4, kv_heads=2, intermediate=None, positions=256, kind="llama", **extra):
    """A tiny decoder's config (Llama unless `kind` names another family of CAUSAL_LMS); `extra`: any other config field."""
    import transformers

    config_class = getattr(transformers, CAUSAL_LMS[kind][0])
    return config_class(hidden_size=hidden, intermediate_size=intermediate or 2 * hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                        num_hidden_layers=layers, vocab_size=vocab, max_position_embeddings=positions, **extra)


def tiny_llama(save_to: Path | None = None, *, seed: int | None = 0, kind="llama", **shape):
    """A random float32 causal LM of llama_config(**shape), in eval mode, its weights drawn after torch.manual_seed(seed)
    (None: from the generator as it stands); saved as an HF directory too when `save_to` is given."""
    import transformers

    config = llama_config(kind=kind, **shape)
    if seed is not None:
        torch.manual_seed(seed)
    model = getattr(transformers, CAUSAL_LMS[kind][1])(config).eval()
    if save_to is not None:
        model.save_pretrained(save_to)
    return model


def tiny_target_dir(path: Path, *, hidden=32, layers=8, vocab=120, heads=4, kv_heads=2, intermediate=64, tied=False, seed=0, norm_noise=0.1) -> Path:
    """A tiny Llama target as training reads it: config.json plus only the embeddings, the final norm (1 + norm_noise * noise)
    and, untied, the LM head, drawn in that order from a generator seeded with `seed`."""
    path.mkdir(parents=True, exist_ok=True)
    llama_config(hidden=hidden, layers=layers, vocab=vocab, heads=heads, kv_heads=kv_heads, intermediate=intermediate, positions=512,
                 head_dim=hidden // heads, tie_word_embeddings=tied).save_pretrained(path)
    g = torch.Generator().manual_seed(seed)
    tensors = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g)}
    tensors["model.norm.weight"] = 1 + norm_noise * torch.randn(hidden, generator=g) if norm_noise else torch.ones(hidden)
    if not tied:
        tensors["lm_head.weight"] = torch.randn(vocab, hidden, generator=g)
    save_file(tensors, str(path / "model.safetensors"))
    return path


def tree_target(vocab_size: int = 5, seed: int = 0):
    """A random float32 8-layer Llama of width 64; a vocabulary of 5 makes a random drafter's trees often hold the target's token."""
    return tiny_llama(seed=seed, vocab=vocab_size, positions=256, initializer_range=0.2)


def six_layer_target(kind: str = "llama", vocab_size: int = 300, initializer_range: float = 0.02, **changes):
    """A random float32 6-layer causal LM of width 64 of the given family (CAUSAL_LMS), small enough for seconds-long decoding tests."""
    return tiny_llama(kind=kind, hidden=64, layers=6, vocab=vocab_size, positions=256, initializer_range=initializer_range, **changes)


# --------------------------------------------------------------------------- tiny drafters


def tiny_drafter(config, draft_vocab: int | None = None, *, aux_layer_ids=(1, 3, 4), seed: int | None = 0, embeddings=None, norm_noise=0.0, **norms):
    """An EAGLE-3 drafter for a target of `config`, keeping every (V // draft_vocab)-th token (all by default): random
    embeddings drawn after torch.manual_seed(seed) unless `embeddings` are given, its 1-d weights moved by norm_noise * noise
    (all-ones norms would hide a swapped one). norms: DrafterShape's norm_before_fc / norm_output."""
    from eyrie.drafter.model import DrafterShape, Eagle3Drafter

    V, H = config.vocab_size, config.hidden_size
    draft_vocab = draft_vocab or V
    if seed is not None:
        torch.manual_seed(seed)
    draft_ids = torch.arange(0, V, V // draft_vocab)[:draft_vocab]
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[draft_ids] = True
    shape = DrafterShape.from_target(config, draft_vocab, list(aux_layer_ids), **norms)
    model = Eagle3Drafter(shape, torch.randn(V, H) if embeddings is None else embeddings, draft_ids - torch.arange(draft_vocab), t2d)
    if norm_noise:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 1:
                    p.add_(norm_noise * torch.randn_like(p))
    return model.eval()


def wide_drafter(model, aux_layer_ids=(0, 2, 3), scale: float = 0.2):
    """A random drafter over the target's whole vocabulary, its weights wide enough to disagree and agree with the target."""
    from eyrie.drafter.model import DrafterShape, Eagle3Drafter

    vocab = model.config.vocab_size
    shape = DrafterShape.from_target(model.config, vocab, list(aux_layer_ids))
    drafter = Eagle3Drafter(shape, model.get_input_embeddings().weight, torch.zeros(vocab, dtype=torch.long), torch.ones(vocab, dtype=torch.bool))
    torch.manual_seed(1)
    with torch.no_grad():
        for weight in drafter.parameters():
            if weight.dim() == 2:
                weight.normal_(0, scale)
    return drafter.eval()


def random_drafter(model, draft_vocab_size: int | None = None, scale: float | None = None, seed: int = 1):
    """Random EAGLE-3 drafter over a random part of the target's vocabulary (the whole of it by default), on the default aux layers."""
    from eyrie.drafter.model import DrafterShape, Eagle3Drafter
    from eyrie.target.aux_layers import default_aux_layer_ids

    torch.manual_seed(seed)
    vocab = model.config.vocab_size
    draft_vocab_size = draft_vocab_size or vocab
    kept = torch.sort(torch.randperm(vocab)[:draft_vocab_size]).values
    target_to_draft = torch.zeros(vocab, dtype=torch.bool)
    target_to_draft[kept] = True
    shape = DrafterShape.from_target(model.config, draft_vocab_size, default_aux_layer_ids(model.config.num_hidden_layers))
    drafter = Eagle3Drafter(shape, model.get_input_embeddings().weight, kept - torch.arange(draft_vocab_size), target_to_draft)
    if scale:  # wide weights: sharper draft distributions, so the tree's order means something
        with torch.no_grad():
            for weight in drafter.parameters():
                if weight.dim() == 2:
                    weight.normal_(0, scale)
    return drafter.eval()


TREE_SHAPES = [(3, 2, 4), (5, 4, 8), (4, 3, 10)]  # SGLang's (steps, topk, draft tokens), small enough for a tiny target


def check_tree_result(result, expected, steps):
    """A tree decode's tokens are `expected` and its counts add up: one target forward per round plus the prefill, depth d needs d - 1."""
    assert result.tokens == expected
    assert result.target_forwards == result.rounds + 1
    assert sum(result.acceptance_lengths) == len(result.tokens) - 1  # the prefill's token is not a round's
    assert all(1 <= length <= steps + 1 for length in result.acceptance_lengths)
    per_depth = result.accepted_per_position
    assert len(per_depth) == steps and all(a >= b for a, b in itertools.pairwise(per_depth))


# --------------------------------------------------------------------------- tiny tokenizers


def word_tokenizer(template: str, specials: list[str], *, words: list[str], eos: str, bos: str | None = None):
    """A word-level tokenizer over [UNK], `specials` and `words` with a real chat template: a random model over it ends turns often."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(["[UNK]", *specials, *words])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    others = [s for s in specials if s not in (eos, bos)]
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token=eos, bos_token=bos, pad_token=eos,
                                        additional_special_tokens=others)
    tokenizer.chat_template = template
    return tokenizer


# --------------------------------------------------------------------------- training inputs

TRAIN_TEMPLATE = "a" * 64  # the chat template's digest the training inputs below carry
TRAIN_FINGERPRINT = "f" * 64  # and the target's fingerprint


def training_drafter(V=120, H=32, Vd=None, seed=0, **norms):
    """The drafter training tests train: tiny_drafter of a width-H, 8-layer target over V tokens, norms moved by 0.1 * noise so
    that every weight matters. norms: DrafterShape's norm_before_fc / norm_output (drafter.*)."""
    config = llama_config(hidden=H, layers=8, vocab=V, intermediate=64, positions=512, head_dim=H // 4)
    return tiny_drafter(config, Vd, seed=seed, norm_noise=0.1, **norms)


def write_training_cache(path, samples, *, H, layers, aux_ids=None, template=TRAIN_TEMPLATE, fingerprint=TRAIN_FINGERPRINT, seed=0, aux_width=None, final_scale=1.0,
                sample_ids=None, states=None):
    """A hidden-state cache shard in eyrie.hidden.cache's format, with random states from a fixed seed (or `states`: (aux, final) rows)."""
    aux_ids = aux_ids or [1, layers // 2 - 1, layers - 4]
    g = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.as_tensor(s[0], dtype=torch.int32) for s in samples])
    mask = torch.cat([torch.as_tensor(s[1], dtype=torch.int8) for s in samples])
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor([len(s[0]) for s in samples]), 0)
    T = ids.numel()
    aux, final = states if states is not None else (torch.randn(T, aux_width or 3 * H, generator=g), final_scale * torch.randn(T, H, generator=g))
    tensors = {
        "aux_hidden": aux.to(torch.bfloat16),
        "final_hidden": final.to(torch.bfloat16),
        "input_ids": ids,
        "loss_mask": mask,
        "offsets": offsets,
    }
    manifest = {
        "format": "eyrie-hidden/1",
        "aux_layer_ids": aux_ids,
        "capture_indices": [i + 1 for i in aux_ids],
        "num_hidden_layers": layers,
        "hidden_size": H,
        "target_model_fingerprint": fingerprint,
        "template_sha256": template,
        "dtype": "bfloat16",
        "samples": len(samples),
        "tokens": T,
        "ids": sample_ids or [f"s{k}" for k in range(len(samples))],
    }
    save_file(tensors, str(path), metadata={"manifest": json.dumps(manifest)})
    return str(path)


def write_training_vocab(path, draft_ids, V, template=TRAIN_TEMPLATE):
    """A draft vocabulary file keeping `draft_ids` of V target tokens."""
    draft_ids = torch.as_tensor(sorted(draft_ids), dtype=torch.int64)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[draft_ids] = True
    tensors = {
        "d2t": draft_ids - torch.arange(draft_ids.numel()),
        "t2d": t2d,
        "counts": torch.ones(V, dtype=torch.int64),
        "draft_ids": draft_ids,
    }
    manifest = {"draft_vocab_size": draft_ids.numel(), "target_vocab_size": V, "template_sha256": template}
    save_file(tensors, str(path), metadata={"manifest": json.dumps(manifest)})
    return str(path)


def random_samples(n, length, V, seed=0):
    """n (ids, loss mask) samples of `length` tokens (or of each length of a list), the first two tokens unmasked."""
    g = torch.Generator().manual_seed(seed)
    lengths = [length] * n if isinstance(length, int) else length
    return [(torch.randint(0, V, (L,), generator=g).tolist(), [0] * 2 + [1] * (L - 2)) for L in lengths]


def tiny_setup(tmp_path, *, samples=None, V=120, H=32, layers=8, draft_ids=None, tied=False, **cache_kw):
    """train_drafter's inputs under tmp_path: a tiny target, one cache shard of `samples` (two of 24 tokens) and a vocabulary."""
    target = tiny_target_dir(tmp_path / "target", hidden=H, vocab=V, layers=layers, tied=tied)
    samples = samples or random_samples(2, 24, V)
    cache = write_training_cache(tmp_path / "hidden.safetensors", samples, H=H, layers=layers, **cache_kw)
    vocab = write_training_vocab(tmp_path / "vocab.safetensors", draft_ids if draft_ids is not None else range(V), V)
    return {"target_dir": str(target), "hidden_paths": [cache], "vocab_path": vocab}



def failing_compile(name):
    """A stand-in for a module's _compiled(name): the compiled piece raises as inductor would when it cannot lower."""
    def call(*args):
        raise RuntimeError("simulated inductor failure")

    return call


def assert_fused_job_follows_eager(tmp_path, setting: str) -> None:
    """train.<setting> true on the CPU: the same loss curve as with it false, and config.json records that it ran fused."""
    import pytest

    inputs = tiny_setup(tmp_path, samples=random_samples(4, 24, 120, seed=3))
    eager = train_tiny(tmp_path, inputs, "eager", train={setting: False, "epochs": 2, "batch_tokens": 48})
    fused = train_tiny(tmp_path, inputs, "fused", train={setting: True, "epochs": 2, "batch_tokens": 48})
    assert setting not in eager and fused[setting] == {"fused": True, "fallback": None}
    eager_losses, fused_losses = ([entry["loss"] for entry in json.loads((tmp_path / name / "training_log.json").read_text()) if "loss" in entry]
                                  for name in ("eager", "fused"))
    assert len(fused_losses) == len(eager_losses) > 1
    assert fused_losses == pytest.approx(eager_losses, rel=1e-5)
    config = json.loads((tmp_path / "fused" / "config.json").read_text())
    assert config["eyrie"]["metrics"][setting] == {"fused": True, "fallback": None}


def train_tiny(tmp_path, inputs, name="drafter", drafter=None, train=None, **kw):
    """train_drafter on `inputs` (tiny_setup's) into tmp_path/name: three TTT steps, one float32 epoch on the CPU unless changed."""
    from eyrie.training.train import train_drafter

    return train_drafter(
        **inputs,
        out_dir=str(tmp_path / name),
        state_dir=str(tmp_path / f"{name}.state"),
        drafter_cfg={"ttt_steps": 3, **(drafter or {})},
        train_cfg={"epochs": 1, "dtype": "float32", "device": "cpu", "log_every": 1, **(train or {})},
        template_sha256=TRAIN_TEMPLATE,
        target_fingerprint=TRAIN_FINGERPRINT,
        progress=False,
        **kw,
    )


def run_two_ranks(tmp_path, inputs, name, train):
    """train_drafter in two gloo ranks under torchrun (out_dir tmp_path / name), as the train job launches it."""
    import os

    args = {
        **inputs,
        "out_dir": str(tmp_path / name),
        "state_dir": str(tmp_path / f"{name}.state"),
        "drafter_cfg": {"ttt_steps": 3},
        "train_cfg": {"dtype": "float32", "device": "cpu", "log_every": 1, **train},
        "template_sha256": TRAIN_TEMPLATE,
        "target_fingerprint": TRAIN_FINGERPRINT,
        "progress": False,
    }
    (tmp_path / f"{name}.args.json").write_text(json.dumps(args))
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "eyrie.training.train",
         str(tmp_path / f"{name}.args.json")],
        capture_output=True, text=True, timeout=300, env=env,  # ~15 s alone; generous for a shared, loaded machine
    )
    assert done.returncode == 0, done.stderr[-4000:]


def without_seconds(evaluations):
    """Eval records less their wall time, the one figure that differs between runs."""
    if isinstance(evaluations, dict):
        return {k: v for k, v in evaluations.items() if k != "seconds"}
    return None if evaluations is None else [without_seconds(e) for e in evaluations]


def train_step_once(compile, attention="eager", recompute_mlp=False, use_bf16=False, B=2, L=13, seed=5, **norms):
    """One train_step on a tiny drafter (norms: training_drafter's): (result, gradients, the objective's CompiledLayers)."""
    from eyrie.training.objective import TTTObjective, train_step
    from eyrie.training.optimizer import make_optimizer

    model = training_drafter(Vd=40, **norms).train()
    g = torch.Generator().manual_seed(seed)
    H, V = 32, 120
    lengths = torch.tensor([L] + [max(3, L - 4)] * (B - 1))  # padded rows too
    batch = {
        "aux": torch.randn(B, L, 3 * H, generator=g), "final": 3 * torch.randn(B, L, H, generator=g),
        "input_ids": torch.randint(0, V, (B, L), generator=g), "loss_mask": torch.rand(B, L, generator=g) > 0.2,
        "lengths": lengths, "tokens": int(lengths.sum()),
    }
    objective = TTTObjective(model, 3, 0.8, attention=attention, recompute_mlp=recompute_mlp, compile=compile)
    optimizer = make_optimizer(model, 1e-2, 0.0)
    result = train_step(objective, optimizer, batch, target_lm_head=torch.randn(V, H, generator=g), draft_ids=torch.arange(40) + model.d2t,
                        t2d=model.t2d, max_grad_norm=1e6, use_bf16=use_bf16)  # no clipping: the raw gradients are compared
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return result, grads, objective.compiled


FAMILIES = ("qwen3", "qwen3_moe", "deepseek_v3", "gpt_oss", "gemma3_text", "gemma3", "mistral")  # tiny_family_config's names


def tiny_family_config(family: str, *, vocab: int, hidden: int = 64, layers: int = 8, window: int = 16, rope: dict | None = None,
                       initializer_range: float | None = None):
    """A random-weight target of a family at hidden 64: the family's own features kept (qk-norm, experts, MLA, sliding
    windows of `window` tokens, attention sinks, Gemma's (1 + w) norms and per-layer-type rope, a nested text config).

    rope: transformers' rope_parameters in place of the family's own; initializer_range: in place of the config's 0.02."""
    import transformers as t

    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4, max_position_embeddings=1024,
                  bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if initializer_range is not None:
        common["initializer_range"] = initializer_range
    if rope is not None:
        common["rope_parameters"] = rope
    attention = dict(num_key_value_heads=2, head_dim=hidden // 4)
    alternating = ["sliding_attention", "full_attention"] * (layers // 2)
    if family == "qwen3":
        return t.Qwen3Config(**common, **attention, intermediate_size=128, tie_word_embeddings=True)
    if family == "qwen3_moe":
        return t.Qwen3MoeConfig(**common, **attention, intermediate_size=128, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                decoder_sparse_step=1, tie_word_embeddings=False)
    if family == "deepseek_v3":
        return t.DeepseekV3Config(**common, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                  v_head_dim=16, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                                  n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1, tie_word_embeddings=False)
    if family == "gpt_oss":
        return t.GptOssConfig(**common, **attention, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=window,
                              layer_types=alternating, tie_word_embeddings=False)
    text = dict(**common, **attention, intermediate_size=128, sliding_window=window, layer_types=alternating)
    text.setdefault("rope_parameters", {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    if family == "gemma3_text":
        return t.Gemma3TextConfig(**text)
    if family == "gemma3":
        vision = t.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)
        return t.Gemma3Config(text_config=t.Gemma3TextConfig(**text), vision_config=vision, mm_tokens_per_image=4,
                              image_token_index=vocab - 1, boi_token_index=vocab - 2, eoi_token_index=vocab - 3)
    if family == "mistral":
        return t.MistralConfig(**common, **attention, intermediate_size=128, sliding_window=window, tie_word_embeddings=False)
    raise KeyError(f"no tiny {family!r} target; the families are {FAMILIES}")


def tiny_family_target(family: str, directory: Path, tokenizer_dir: Path | None = None, *, vocab: int | None = None, seed: int = 0,
                       norm_noise: float = 0.1, logit_scale: float = 1.0) -> Path:
    """tiny_family_config's target saved as an HF directory (safetensors), with the tokenizer of tokenizer_dir when given.

    Norm weights get noise: a random-init norm is all ones (or all zeros for Gemma's (1 + w)), which hides a norm copied
    wrongly. logit_scale multiplies the final norm's output, so the logits: at random init they are nearly flat (std
    about 0.16 at hidden 64), a next-token distribution whose entropy is within a few hundredths of ln(vocabulary), so
    nothing a drafter learns from it can show; a trained model's are peaked."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir) if tokenizer_dir is not None else None
    config = tiny_family_config(family, vocab=vocab or len(tokenizer))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.add_(norm_noise * torch.randn_like(parameter))
        if logit_scale != 1:
            final_norm = model.get_decoder().norm
            zero_centred = "Gemma" in type(final_norm).__name__  # Gemma's norm computes (1 + w) * x
            final_norm.weight.copy_(logit_scale * (1 + final_norm.weight) - 1 if zero_centred else logit_scale * final_norm.weight)
    model.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return directory


# --------------------------------------------------------------------------- reasoning and tool-calling chat templates

# Qwen3's shape, shortened: tools in the system turn, a think block only on assistant turns after the last user message
# (earlier turns' thinking dropped, as Qwen3's, DeepSeek-R1's and Kimi-K2-Thinking's templates do), calls in
# <tool_call> tags, tool results in a user turn.
THINKING_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_query = loop.index0 %}{% endif %}{% endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}\n<|im_start|>user\n{{ m.content }}<|im_end|>"
    "{%- elif m.role == 'assistant' %}\n<|im_start|>assistant\n"
    "{% if loop.index0 > ns.last_query and m.reasoning_content is defined %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ m.content }}{% if m.tool_calls is defined %}{% for c in m.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}{% endif %}<|im_end|>'
    "{%- elif m.role == 'tool' %}\n<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}\n<|im_start|>assistant\n{% endif %}"
)

# Hermes' shape: tools in the system turn, calls in <tool_call> tags, results in a `tool` turn; thinking is kept in every
# turn, so history renders stably.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call functions. <tools>{{ tools | tojson }}</tools>"
    "{% if messages[0].role == 'system' %}\n{{ messages[0].content }}{% endif %}<|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}<|im_start|>user\n{{ m.content }}<|im_end|>\n"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}"
    "{%- if m.tool_calls is defined %}{% for c in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}{% endif %}<|im_end|>\n'
    "{%- elif m.role == 'tool' %}<|im_start|>tool\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer(template: str, specials=("<|im_start|>", "<|im_end|>")):
    """A byte-level tokenizer (one token per byte, no merges) with `specials` and a chat template: exact offsets and
    round trips, so a test can compare tokens with text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab, [], unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=specials[-1], pad_token=specials[-1],
                                        additional_special_tokens=list(specials))
    tokenizer.chat_template = template
    return tokenizer


# --------------------------------------------------------------------------- a browser for the report

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").is_file() else None)
FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--hide-scrollbars",
)
WIDTH, HEIGHT = 1280, 12000  # tall enough for the whole page; the blank bottom is cropped off the artifact


def chromium(page: Path, profile: Path, *args: str) -> subprocess.CompletedProcess:
    """Headless Chromium on `page` with a fresh profile (its DOM or a screenshot, as `args` ask); a failure is an AssertionError."""
    done = subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", f"--window-size={WIDTH},{HEIGHT}", *args, page.as_uri()],
        capture_output=True, text=True, timeout=90,
    )
    if done.returncode != 0:
        raise AssertionError(f"chromium {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done


def page_text(dom: str) -> str:
    """The page's visible-ish text: tags dropped, entities decoded, whitespace collapsed."""
    body = re.sub(r"<(style|svg)\b.*?</\1>", " ", dom, flags=re.S | re.I)
    return re.sub(r"\s+", " ", html_lib.unescape(re.sub(r"<[^>]+>", " ", body)))


# --------------------------------------------------------------------------- a regeneration shard against the stub OpenAI server

# STUB_SERVER runs as its own script: written to a file (python stub_server.py --port N) or as a package's
# launch_server.py, the fake `python -m sglang.launch_server` the managed SGLang engine starts.
STUB_SETTINGS = {"max_new_tokens": 4, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_turns": 2, "max_prompt_tokens": 200, "seed": 0}

STUB_PROMPTS = [
    ("a", [{"role": "user", "content": "Name a fruit."}, {"role": "user", "content": "And a vegetable?"}]),
    ("b", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3+4?"}]),
    ("e", [{"role": "user", "content": "Say no."}]),
]


def write_prompts(path: Path, prompts) -> Path:
    rows = [{"id": pid, "dataset": "t", "messages": msgs, "n_user_turns": sum(m["role"] == "user" for m in msgs)} for pid, msgs in prompts]
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def run_shard(workdir: Path, engine, settings=STUB_SETTINGS, fingerprint="fp") -> dict:
    return regenerate_shard(
        prompts_path=str(workdir / "p.parquet"),
        out_path=str(workdir / "c.parquet"),
        partial_dir=str(workdir / "partial"),
        dataset="t",
        shard="0000",
        settings=settings,
        engine_settings={"max_batch_tokens": 2048, "max_batch_size": 4},
        engine=engine,
        model_fingerprint=fingerprint,
        template_sha256="tpl",
    )


STUB_SERVER = r'''
"""An OpenAI-compatible stub: canned, deterministic replies ("reply to <last user text>"), fast."""
import argparse, json, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ap = argparse.ArgumentParser()
ap.add_argument("--host", default="127.0.0.1")
ap.add_argument("--port", type=int, required=True)
ap.add_argument("--model", "--model-path", dest="model", default="stub-model")
ap.add_argument("--delay", type=float, default=0.0)
ap.add_argument("--fail-first", type=int, default=0)
ap.add_argument("--fail-status", type=int, default=503)
ap.add_argument("--context-words", type=int, default=10**9)
ap.add_argument("--api-key", default=None)
ap.add_argument("--requests-log", default=None)
args, _unknown = ap.parse_known_args()  # the fake sglang.launch_server gets SGLang's flags too

lock = threading.Lock()
state = {"requests": 0, "in_flight": 0, "max_in_flight": 0}
requests_log = open(args.requests_log, "a") if args.requests_log else None


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def send(self, status, obj):
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/health":
            return self.send(200, {"status": "ok"})
        if self.path == "/v1/models":
            return self.send(200, {"object": "list", "data": [{"id": args.model, "object": "model"}]})
        if self.path == "/stats":
            with lock:
                return self.send(200, dict(state))
        self.send(404, {"detail": "not found"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if args.api_key and self.headers.get("Authorization") != f"Bearer {args.api_key}":
            return self.send(401, {"error": {"message": "bad api key"}})
        with lock:
            state["requests"] += 1
            n = state["requests"]
            state["in_flight"] += 1
            state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
        try:
            if n <= args.fail_first:
                return self.send(args.fail_status, {"error": {"message": "busy, try again"}})
            if body["model"] != args.model:
                return self.send(400, {"error": {"message": f"model {body['model']!r} is not served"}})
            messages = body["messages"]
            words = sum(len(m["content"].split()) for m in messages)
            if words > args.context_words:
                return self.send(400, {"object": "error", "message": f"The input ({words} tokens) is longer than the model's context length ({args.context_words} tokens).", "code": 400})
            if args.delay:
                time.sleep(args.delay)
            out = ["reply", "to"] + messages[-1]["content"].split()
            reply = out[: body["max_tokens"]]
            if requests_log:
                with lock:
                    requests_log.write(json.dumps({"messages": messages, "seed": body.get("seed")}) + "\n")
                    requests_log.flush()
            self.send(200, {
                "id": f"stub-{n}", "object": "chat.completion", "model": args.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": " ".join(reply)},
                             "finish_reason": "length" if len(out) > len(reply) else "stop"}],
                "usage": {"prompt_tokens": words, "completion_tokens": len(reply), "total_tokens": words + len(reply)},
            })
        finally:
            with lock:
                state["in_flight"] -= 1


server = ThreadingHTTPServer((args.host, args.port), Handler)
server.daemon_threads = True
server.request_queue_size = 256
print(f"stub listening on {args.host}:{args.port}", flush=True)
server.serve_forever()
'''


# --------------------------------------------------------------------------- an OpenAI server that splits reasoning and tool calls

AGENT_CALL = {"id": "s1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
AGENT_REPLIES = {  # AgentServer's reply by what the turn asks: a user turn with tools, a tool result, a user turn without
    "call": {"content": None, "reasoning_content": "SERVER-THINK-1 I need the tool.", "tool_calls": [AGENT_CALL]},
    "tool": {"content": "SERVER-ANSWER-1 It rains.", "reasoning_content": "SERVER-THINK-2 The tool says rain."},
    "chat": {"content": "SERVER-ANSWER-2 Easy.", "reasoning_content": "SERVER-THINK-3 A sum."},
}


class AgentServer(FaultServer):
    """FaultServer's bounds (127.0.0.1, at most max_requests chat requests, closed after max_seconds or on leaving its
    `with`) answering as a server with reasoning and tool-call parsers does: AGENT_REPLIES, finish_reason "tool_calls"
    for a call. Each request is in `.requests` with its tools; `.sent(kind)` counts the replies of one kind."""

    def _answer(self, body: dict):
        messages = body["messages"]
        kind = "tool" if messages[-1]["role"] == "tool" else "call" if body.get("tools") else "chat"
        with self.lock:
            if len(self.requests) >= self.max_requests:
                return 503, {"error": {"message": "agent server: request limit reached"}}, None
            self.requests.append({"time": time.monotonic(), "messages": messages, "tools": body.get("tools"), "fault": kind})
        if body.get("model") != self.model:
            return 404, {"error": {"message": f"model {body.get('model')!r} is not served"}}, None
        choice = {"index": 0, "message": {"role": "assistant", **AGENT_REPLIES[kind]}, "finish_reason": "tool_calls" if kind == "call" else "stop"}
        return 200, {"id": f"agent-{len(self.requests)}", "object": "chat.completion", "model": self.model, "choices": [choice],
                     "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}, None


# --------------------------------------------------------------------------- SGLang's launch command


def sglang_argv(command: list[str]) -> list[str]:
    assert command[1:3] == ["-m", "sglang.launch_server"]
    return command[3:]  # what SGLang's parser (conftest's sglang_parser) reads


# --------------------------------------------------------------------------- the report's fake stage outputs

REPORT_SHA = "a" * 64
REPORT_SETTINGS = {"max_new_tokens": 256, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_turns": 2, "max_prompt_tokens": 1536, "seed": 0}
REPORT_XSS = "<script>alert(1)</script>"


# (id, first user message, completion tokens per turn, prompt tokens per turn, finish reason per turn, seconds)
REPORT_COMPLETIONS = {
    ("chat", "0000"): [
        ("c1", '<b>bold & "quoted"</b>', [100, 50], [20, 180], ["stop", "stop"], 1.5),
        ("c2", "hello", [64], [30], ["length"], 0.5),
        ("c3", "long one", [200, 0], [40, 1600], ["stop", "prompt_too_long"], 2.0),
    ],
    ("chat", "0001"): [],  # an empty shard
    ("sharegpt", "0000"): [
        ("s1", "hi", [64, 64], [10, 90], ["length", "length"], 1.0),
        ("s2", "yo", [64], [12], ["length"], 0.6),
    ],
    ("sharegpt", "0001"): [("s3", "hey", [30], [15], ["stop"], 0.4)],
}
# (id, n_tokens, n_assistant_tokens, truncated)
REPORT_TOKENS = {
    ("chat", "0000"): [("c1", 400, 150, False), ("c2", 120, 64, False), ("c3", 300, 200, True)],
    ("chat", "0001"): [],
    ("sharegpt", "0000"): [("s1", 240, 128, False), ("s2", 90, 64, False)],
    ("sharegpt", "0001"): [("s3", 60, 30, False)],
}
REPORT_DROPPED = {("chat", "0000"): {"empty": 1}, ("sharegpt", "0001"): {"no_assistant": 2, "empty": 1}}


def report_config() -> dict:
    return {
        "model": {"name": "tiny-llama", "path": "/models/tiny-llama", "dtype": "auto", "device": "auto", "trust_remote_code": False},
        "datasets": {
            "chat": {"source": {"file": "data/chat.jsonl"}, "format": "openai", "limit": None, "shards": 2, "heldout_fraction": 0.05, "on_bad_record": "error"},
            "sharegpt": {"source": {"file": "data/sg.json"}, "format": "sharegpt", "limit": 100, "shards": 2, "heldout_fraction": 0.05,
                         "on_bad_record": "skip", "generation": {"max_new_tokens": 64}},
        },
        "generation": dict(REPORT_SETTINGS),
        "engine": {"max_batch_tokens": 8192, "max_batch_size": 32},
        "tokenize": {"max_seq_len": 2048},
        "plan": {"guess_tokens_per_second": 50, "guess_completion_tokens": 300},
    }


def report_summary(dataset: str) -> dict:
    base = {"dataset": dataset, "format": "openai", "duplicates": 0, "limit": None, "roles_seen": {"user": 3, "assistant": 3}}
    if dataset == "chat":
        return {**base, "source": "data/chat.jsonl", "records_read": 3, "bad_records": {}, "bad_examples": [], "usable": 3,
                "used": 3, "heldout": 0, "train": 3, "shards": {"0000": 3, "0001": 0}, "truncation": None}
    return {**base, "source": "data/sg.json", "format": "sharegpt", "records_read": 783, "duplicates": 2, "limit": 100,
            "bad_records": {"missing_value": 2, "unknown_role": 1}, "bad_examples": [f"line 4: value {REPORT_XSS}", "line 9: role 'robot'"],
            "usable": 778, "used": 3, "heldout": 0, "train": 3, "shards": {"0000": 2, "0001": 1},
            "truncation": {"byte_offset": 123456, "line": 789, "records_before": 780}, "roles_seen": {"human": 780, "gpt": 779, "robot": 1}}


def report_completion_table(dataset: str, shard: str, rows: list, template: str, kept_replies: bool = False) -> pa.Table:
    records = [
        {
            "id": rid, "dataset": dataset,
            "messages": [m for i, n in enumerate(comp) for m in ({"role": "user", "content": user if i == 0 else "more"}, {"role": "assistant", "content": "x" * n})],
            "n_turns": len(comp), "finish_reason": why[-1], "finish_reasons": why,
            "prompt_tokens": prompt, "completion_tokens": comp, "seconds": secs,
        }
        for rid, user, comp, prompt, why, secs in rows
    ]
    settings = dict(REPORT_SETTINGS, max_new_tokens=64 if dataset == "sharegpt" else 256, **({"replies": "source"} if kept_replies else {}))
    stats = {"records": len(rows), "turns": sum(len(r[2]) for r in rows), "completion_tokens": sum(sum(r[2]) for r in rows),
             "prompt_tokens": sum(sum(r[3]) for r in rows), "generation_seconds": sum(r[5] for r in rows),
             "tokens_per_second": 0.0, "finish_reasons": {}, "resumed_turns": 0}
    meta = {"dataset": dataset, "shard": shard, "settings": settings, "model_fingerprint": "f" * 64, "template_sha256": template, "stats": stats}
    return pa.Table.from_pylist(records, schema=COMPLETIONS_SCHEMA).replace_schema_metadata({b"eyrie": json.dumps(meta).encode()})


def report_token_table(dataset: str, shard: str, rows: list, template: str) -> pa.Table:
    records = [
        {"id": rid, "dataset": dataset, "input_ids": list(range(n)), "loss_mask": [1] * a + [0] * (n - a),
         "n_tokens": n, "n_assistant_tokens": a, "truncated": trunc}
        for rid, n, a, trunc in rows
    ]
    dropped = REPORT_DROPPED.get((dataset, shard), {})
    stats = {"records": len(rows), "truncated": sum(r[3] for r in rows), "dropped": dropped,
             "tokens": sum(r[1] for r in rows), "assistant_tokens": sum(r[2] for r in rows)}
    meta = {"dataset": dataset, "shard": shard, "template_sha256": template, "max_seq_len": 2048, "stats": stats}
    return pa.Table.from_pylist(records, schema=TOKENS_SCHEMA).replace_schema_metadata({b"eyrie": json.dumps(meta).encode()})


def report_inputs(root: Path, token_templates: dict | None = None, kept_replies: tuple[str, ...] = ()) -> tuple[dict, list[str], list[str], list[str]]:
    """Fake stage outputs under root/results; token_templates overrides a token shard's template_sha256."""
    summaries, completions, tokens = [], [], []
    for dataset in ("chat", "sharegpt"):
        path = root / "results" / "prompts" / dataset / "summary.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(report_summary(dataset)))
        summaries.append(str(path))
    for (dataset, shard), rows in REPORT_COMPLETIONS.items():
        path = root / "results" / "completions" / dataset / f"{shard}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(report_completion_table(dataset, shard, rows, REPORT_SHA, dataset in kept_replies), path)
        completions.append(str(path))
    for (dataset, shard), rows in REPORT_TOKENS.items():
        path = root / "results" / "tokens" / dataset / f"{shard}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        template = (token_templates or {}).get((dataset, shard), REPORT_SHA)
        pq.write_table(report_token_table(dataset, shard, rows, template), path)
        tokens.append(str(path))
    return report_config(), summaries, completions, tokens


REPORT_HIDDEN = 64  # 8H+5 = 517 bytes per token in bf16
REPORT_LAYERS = 8
REPORT_AUX = [1, 3, 4]  # SGLang convention for 8 layers: [1, N//2-1, N-4]
REPORT_TARGET_FP = "c" * 64
REPORT_VOCAB_COUNTS = [0] * 24 + [50, 30, 10, 5, 3, 2]  # 30-token target vocab, 6 distinct assistant tokens
# (dataset, shard): (samples, tokens, assistant tokens, file bytes)
REPORT_HIDDEN_SHARDS = {
    ("chat", "0000"): (3, 820, 414, 440_000),
    ("sharegpt", "0000"): (2, 330, 192, 178_000),
    ("sharegpt", "0001"): (1, 60, 30, 34_000),
}
REPORT_TTT = 3
REPORT_LOG = [  # training_log.json entries as eyrie.training.train writes them
    {"step": s, "epoch": s / 20, "lr": 3e-4, "loss": loss, "loss_per_step": [loss * 0.8, loss, loss * 1.2],
     "acc_per_step": acc, "positions_per_step": [100, 90, 80], "tokens_per_second": 900.0}
    for s, loss, acc in [(10, 4.0, [0.2, 0.1, None]), (20, 3.0, [0.4, 0.3, 0.2]), (30, 2.5, [0.5, 0.4, 0.3]),
                         (40, 2.2, [0.55, 0.45, 0.35]), (50, 2.1, [0.6, 0.5, 0.4])]
]
REPORT_BENCH = {
    "sharegpt": {  # measured, slower than plain greedy, lossless
        "mean_acceptance_length": 2.37, "acceptance_rate_per_position": [0.71, 0.42, 0.18, 0.06], "rounds": 270,
        "greedy_tokens_per_s": 52.4, "spec_tokens_per_s": 43.5, "speedup": 43.5 / 52.4, "lossless": True, "prompts": 2, "error": None,
        "per_prompt": [{"id": "s9", "identical": True, "first_divergence": None, "acceptance_length_mean": 2.4},
                       {"id": "s8", "identical": True, "first_divergence": None, "acceptance_length_mean": 2.3}],
        "speedup_over_ngram": 43.5 / 40.1,
        "outside_draft_vocab": {"new_tokens": 640, "outside": 12, "fraction": 12 / 640, "prompts_with_any": 1,
                                "most_common": [{"id": 27, "text": " dove", "count": 9}, {"id": 28, "text": None, "count": 3}]},
        "float32_check": {"dtype": "float32", "checked": 2, "identical": 2, "different": [], "lossless": True},
        "agreement_in_timing_dtype": {"dtype": "bfloat16", "identical": 1, "checked": 2, "largest_margin_at_divergence": 0.0712},
        "floor": {"prompt": "s9", "prompt_tokens": 40, "new_tokens": 256, "compiled": True, "floor_ms_per_token": 1.475,
                  "floor_mode": "max-autotune-no-cudagraphs", "engine_mode": "max-autotune-no-cudagraphs",
                  "greedy_ms_per_token": 1.716, "ratio": 1.716 / 1.475, "capture_failures": [], "error": None},
        "parity": {"k": 4, "simulated": 2.6, "form": "walked_length", "measured": 2.37, "interval": [2.2, 2.55], "gap": 1 - 2.37 / 2.6,
                   "max_gap": 0.15,
                   "judged": True, "not_judged_because": None,
                   "source": "held-out cache samples", "eval_samples": 12, "error": None,
                   "heldout_prompts": {"measured": 2.37, "simulated": 2.5, "form": "walked_first_turn_length", "gap": 1 - 2.37 / 2.5,
                                       "dataset": "sharegpt", "eval_samples": 9}},
        "ngram": {  # the prompt-lookup baseline beside the drafter
            "method": "prompt lookup", "max_ngram": 3, "min_ngram": 1, "draft_tokens": 4, "mean_acceptance_length": 1.42,
            "acceptance_rate_per_position": [0.305, 0.087, 0.021, 0.007], "rounds": 450, "tokens_per_s": 40.1, "speedup": 40.1 / 52.4,
            "lossless": True, "new_tokens": 640,
            "by_draft_tokens": [{"draft_tokens": 4, "mean_acceptance_length": 1.42, "tokens_per_s": 40.1, "speedup": 40.1 / 52.4, "lossless": True},
                                {"draft_tokens": 8, "mean_acceptance_length": 1.61, "tokens_per_s": 37.2, "speedup": 37.2 / 52.4, "lossless": True}],
            "per_prompt": [{"id": "s9", "identical": True, "first_divergence": None, "acceptance_length_mean": 1.57, "tokens_per_s": 41.3},
                           {"id": "s8", "identical": True, "first_divergence": None, "acceptance_length_mean": 1.29, "tokens_per_s": 38.9}],
        },
    },
}
REPORT_BENCH["sharegpt"]["sweep"] = {  # the drafting settings measured beside the main chain; a tree is the fastest lossless one
    "lossless_checked_in": "float32",
    "settings": [
        {"label": "chain 3", "steps": 3, "topk": 1, "draft_tokens": 4, "mean_acceptance_length": 2.2, "acceptance_rate_per_depth": [0.7, 0.4, 0.1],
         "rounds": 290, "new_tokens": 640, "tokens_per_s": 41.0, "speedup": 41.0 / 52.4, "speedup_over_ngram": 41.0 / 40.1, "lossless": True,
         "different": [], "per_prompt": [{"id": "s9", "identical": True}, {"id": "s8", "identical": True}]},
        {"label": "tree 5-4-8", "steps": 5, "topk": 4, "draft_tokens": 8, "mean_acceptance_length": 2.91, "acceptance_rate_per_depth": [0.8, 0.55, 0.3, 0.2, 0.06],
         "rounds": 220, "new_tokens": 640, "tokens_per_s": 47.9, "speedup": 47.9 / 52.4, "speedup_over_ngram": 47.9 / 40.1, "lossless": True,
         "different": [], "per_prompt": [{"id": "s9", "identical": True, "tokens_per_s": 39.0, "acceptance_length_mean": 2.8},  # the n-gram: 41.3
                                         {"id": "s8", "identical": True, "tokens_per_s": 50.0, "acceptance_length_mean": 3.0}],  # 38.9
         "speedup_interval": [0.85, 0.97],
         "speedup_over_ngram_interval": [1.08, 1.31]},
    ],
    "main": {"label": "chain 4 (bench.draft_tokens)", "steps": 4, "topk": 1, "draft_tokens": 5, "mean_acceptance_length": 2.37, "tokens_per_s": 43.5,
             "speedup": 43.5 / 52.4, "speedup_over_ngram": 43.5 / 40.1, "lossless": True},
    "best": {"label": "tree 5-4-8", "steps": 5, "topk": 4, "draft_tokens": 8, "mean_acceptance_length": 2.91, "tokens_per_s": 47.9,
             "speedup": 47.9 / 52.4, "speedup_over_ngram": 47.9 / 40.1, "lossless": True, "main_chain": False,
             "within_noise": ["chain 4 (bench.draft_tokens)"]},
    "sglang_flags": "--speculative-algorithm EAGLE3 --speculative-num-steps 5 --speculative-eagle-topk 4 --speculative-num-draft-tokens 8",
}
REPORT_BENCH.update({
    "humaneval": {  # measured, the drafter not engaged: an error, and one prompt diverged
        "mean_acceptance_length": 1.013, "acceptance_rate_per_position": [0.013, 0.0, 0.0, 0.0], "rounds": 500,
        "greedy_tokens_per_s": 60.0, "spec_tokens_per_s": 31.0, "speedup": 31.0 / 60.0, "lossless": False, "prompts": 4,
        "error": "mean acceptance length 1.013 over 500 rounds is below bench.min_acceptance_length 1.05: the drafter is not engaged",
        "per_prompt": [{"id": f"HumanEval/{i}", "identical": i != 2, "first_divergence": 17 if i == 2 else None, "acceptance_length_mean": 1.0}
                       for i in range(4)],
    },
    "chat": {"mean_acceptance_length": None, "acceptance_rate_per_position": [], "rounds": 0, "greedy_tokens_per_s": None,
             "spec_tokens_per_s": None, "speedup": None, "lossless": True, "prompts": 0, "error": None, "per_prompt": []},
})


def save_report_safetensors(path: Path, tensors: dict, manifest: dict) -> str:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"manifest": json.dumps(manifest)})
    return str(path)


def report_hidden_manifest(samples: int, tokens: int, assistant: int, file_bytes: int, **override) -> dict:
    manifest = {
        "format": "eyrie-hidden/1", "aux_layer_ids": REPORT_AUX, "capture_indices": [i + 1 for i in REPORT_AUX], "num_hidden_layers": REPORT_LAYERS,
        "hidden_size": REPORT_HIDDEN, "target_model_fingerprint": REPORT_TARGET_FP, "template_sha256": REPORT_SHA, "dtype": "bfloat16",
        "compute_dtype": "float32", "samples": samples, "tokens": tokens, "assistant_tokens": assistant,
        "file_bytes": file_bytes, "bytes_per_token": round(file_bytes / tokens, 3),
    }
    return {**manifest, **override}


def report_drafter_config(template: str = REPORT_SHA, aux: list | None = None) -> dict:
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1, "hidden_size": REPORT_HIDDEN,
        "intermediate_size": 4 * REPORT_HIDDEN, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": len(REPORT_VOCAB_COUNTS),
        "draft_vocab_size": 8, "target_hidden_size": REPORT_HIDDEN, "max_position_embeddings": 2048, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux or REPORT_AUX, "use_aux_hidden_state": True},
        "eyrie": {
            "template_sha256": template, "target_fingerprint": REPORT_TARGET_FP, "drafter": {"ttt_steps": REPORT_TTT},
            "train": {"epochs": 2.5, "learning_rate": 3e-4, "batch_tokens": 4096},
            "vocab": {"draft_vocab_size": 8, "requested_draft_vocab_size": 8, "coverage": 1.0, "clipped": True},
            "metrics": {"accuracy_per_step": [0.612, 0.503, 0.391], "loss_per_step": [1.6, 2.1, 2.5], "loss": 2.15, "over_steps": [30, 50],
                        "steps": 50, "samples": 6, "tokens": 1210, "seconds": 12.5, "tokens_per_second": 96.8},
            "simulated_acceptance": {"eval_samples": 12, "copy": {"positions": 41, "drafter_accepted": [0.8, 1.1, 1.3], "lookup_accepted": 5.9,
                                                                  "lookup_k": 8, "min_lookup_drafts": 3}},
        },
    }


def report_back_half(root: Path, *, hidden_override: dict | None = None, drafter_template: str = REPORT_SHA, drafter_aux: list | None = None,
               ngram: dict | None = None, sweep: dict | None = None) -> dict:
    """Fake back-half outputs under root/results, as write_report's keyword arguments.

    ngram: per benchmark, a replacement n-gram block; {name: None} writes that JSON as before the baseline existed.
    sweep: per benchmark, a replacement sweep block; {name: None} writes that JSON as before the sweep existed.
    """
    import torch

    counts = torch.tensor(REPORT_VOCAB_COUNTS, dtype=torch.int64)
    kept = torch.cat([torch.tensor([0, 1]), torch.nonzero(counts).flatten()])  # the 6 seen ids padded to 8, as build_vocab does
    t2d = torch.zeros(len(REPORT_VOCAB_COUNTS), dtype=torch.bool)
    t2d[kept] = True
    vocab = save_report_safetensors(
        root / "results" / "vocab" / "draft_vocab.safetensors",
        {"d2t": kept - torch.arange(len(kept)), "t2d": t2d, "counts": counts, "draft_ids": kept},
        {"draft_vocab_size": 8, "requested_draft_vocab_size": 8, "target_vocab_size": len(REPORT_VOCAB_COUNTS), "assistant_tokens": 100,
         "distinct_assistant_tokens": 6, "coverage": 1.0, "template_sha256": REPORT_SHA, "clipped": True, "unseen_padding": 2, "shards": 4},
    )
    hidden = []
    for (dataset, shard), numbers in REPORT_HIDDEN_SHARDS.items():
        override = (hidden_override or {}).get((dataset, shard), {})
        path = root / "results" / "hidden" / dataset / f"{shard}.safetensors"
        hidden.append(save_report_safetensors(path, {"offsets": torch.zeros(numbers[0] + 1, dtype=torch.int64)}, report_hidden_manifest(*numbers, **override)))
    hidden.append(str(root / "results" / "hidden" / "chat" / "0001.safetensors"))  # not built yet
    drafter = root / "results" / "drafter"
    drafter.mkdir(parents=True)
    (drafter / "config.json").write_text(json.dumps(report_drafter_config(drafter_template, drafter_aux)))
    (drafter / "training_log.json").write_text(json.dumps(REPORT_LOG))
    (drafter / "model.safetensors").write_bytes(b"\0" * 4321)
    bench = []
    for name, result in REPORT_BENCH.items():
        path = root / "results" / "bench" / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        if name in (ngram or {}):
            result = {k: v for k, v in result.items() if k not in ("ngram", "speedup_over_ngram")}
            if ngram[name] is not None:
                result.update(ngram=ngram[name], speedup_over_ngram=result["spec_tokens_per_s"] / ngram[name]["tokens_per_s"])
        if name in (sweep or {}):
            result = {k: v for k, v in result.items() if k != "sweep"}
            if sweep[name] is not None:
                result["sweep"] = sweep[name]
        meta = {"benchmark": name, "draft_tokens": 4, "max_new_tokens": 128, "min_acceptance_length": 1.05, "dtype": "float32",
                "device": "cpu", "hardware": "CPU: test machine", "torch": "2.0", "template_sha256": REPORT_SHA, "new_tokens": 640}
        path.write_text(json.dumps({**meta, **result}))
        bench.append(str(path))
    bench.append(str(root / "results" / "bench" / "missing.json"))  # not built yet
    return {"vocab": vocab, "hidden": hidden, "drafter": str(drafter), "bench": bench}


# --------------------------------------------------------------------------- a random drafter over a real target


def random_target_drafter(model, draft_vocab: int = 2048):
    """A seeded random EAGLE-3 drafter for `model` (the default target in the benchmark tests): draft_vocab ids drawn at
    random, the target's own embeddings, the default aux layers."""
    import torch

    from eyrie.drafter.model import DrafterShape, Eagle3Drafter
    from eyrie.target.aux_layers import default_aux_layer_ids

    torch.manual_seed(0)
    vocab = model.config.vocab_size
    kept = torch.sort(torch.randperm(vocab)[:draft_vocab]).values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    shape = DrafterShape.from_target(model.config, draft_vocab, default_aux_layer_ids(model.config.num_hidden_layers))
    return Eagle3Drafter(shape, model.get_input_embeddings().weight, kept - torch.arange(draft_vocab), t2d).eval()
