"""The EAGLE-3 draft model, laid out exactly as SGLang's LlamaForCausalLMEagle3 loads it.

One step of the drafter at position t reads the target's fused aux hidden state (or its own
previous output) and the embedding of token t+1, and predicts token t+2:

    g    = fc(aux_hidden)                    # (B, T, 3H) -> (B, T, H), first step only (project_aux)
    x    = [input_layernorm(embed(t+1)), hidden_norm(g)]   # (B, T, 2H): q/k/v take 2H
    r    = g + attn(x)
    out  = r + mlp(post_attention_layernorm(r))            # fed back as g of the next step
    logits = lm_head(norm(out))             # over the draft vocabulary

Two optional norms (EAGLE-3.1; drafter.norm_before_fc, drafter.norm_output), laid out as SGLang
0.5.23's LlamaForCausalLMEagle3 reads them from config.json (python/sglang/srt/models/llama_eagle3.py):

    norm_before_fc   g = fc(input_norm(aux_hidden)): one RMSNorm over the whole concatenated 3H
                     (not one per aux layer, which is SGLang's fc_norm), tensor ``input_norm.weight``
                     [3H]; config.json ``norm_before_fc: true`` at the top level and in eagle_config
                     (SGLang reads eagle_config first, then the top level).
    norm_output      the state fed back as g of the next step is norm(out), the same normed state the
                     head reads (logits = lm_head(norm(out)) either way); config.json ``norm_output:
                     true`` at the top level; no new tensor.

Every path (training, decode, the decoders in eyrie.decoding) goes through project_aux,
layer_output and head, so the flags hold wherever the drafter runs.

The target's embeddings are frozen and never saved: SGLang shares the target's own. The checkpoint
(what is written, checked and loaded) is eyrie.drafter.checkpoint's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from eyrie.core.errors import ConfigError
from eyrie.drafter.rms_norm import RMSNorm
from eyrie.drafter.pointwise import EAGER_POINTWISE, apply_rotary, swiglu
from eyrie.target import family

ARCHITECTURE = "LlamaForCausalLMEagle3"  # what SGLang loads with --speculative-algorithm EAGLE3; load_drafter refuses any other


MOE_MLP_PER_HIDDEN = 6  # a MoE target's drafter MLP width per hidden unit: SpecForge's Qwen3-30B-A3B, Qwen3-235B-A22B, gpt-oss drafters
MLA_KV_GROUPS = 8  # key-value heads of an MLA target's drafter: SpecForge's DeepSeek-V3 drafter (56 query heads, 8 kv heads)

SHAPE_KEYS = ("intermediate_size", "head_dim", "num_attention_heads", "num_key_value_heads")  # the drafter: keys that size its layer


def default_layer_sizes(text) -> dict[str, int]:
    """The draft layer's sizes for a target's text config, per family (docs/DESIGN.md, "Drafter shapes per target family").

    Dense (Llama, Qwen3, Mistral, Gemma 3): the target's own attention and MLP, as the published drafters for them.
    MoE (Qwen3-MoE, gpt-oss, DeepSeek-V3): a dense MLP MOE_MLP_PER_HIDDEN x hidden wide; neither the target's expert
    width (768 for Qwen3-30B-A3B) nor its dense width (the shared or first layers', if any) is what a one-layer
    drafter needs. MLA (DeepSeek-V3, Kimi-K2): no head of its own fits a Llama layer (queries and keys are
    nope + rope wide, values v_head_dim), so heads v_head_dim wide, hidden / v_head_dim of them, MLA_KV_GROUPS kv heads.
    """
    hidden = int(text.hidden_size)
    if family.is_mla(text):
        head_dim = int(text.v_head_dim)
        heads = max(1, hidden // head_dim)
        kv_heads = math.gcd(heads, MLA_KV_GROUPS)
    else:
        heads = int(text.num_attention_heads)
        kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    dense = getattr(text, "intermediate_size", None)
    intermediate = MOE_MLP_PER_HIDDEN * hidden if family.expert_count(text) or not isinstance(dense, int) else int(dense)
    return {"intermediate_size": intermediate, "head_dim": head_dim, "num_attention_heads": heads, "num_key_value_heads": kv_heads}


def shape_settings(drafter_cfg: dict) -> dict:
    """from_target's keyword arguments from the config's drafter section."""
    return {key: drafter_cfg.get(key) for key in SHAPE_KEYS}


@dataclass
class DrafterShape:
    """Every size of the drafter, derived from the target's config and the draft vocabulary."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    max_position_embeddings: int
    aux_layer_ids: list[int]  # SGLang's convention: output of decoder layer i = hidden_states[i + 1]
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    target_num_hidden_layers: int = 0
    norm_before_fc: bool = False  # RMSNorm over the concatenated 3H aux states before fc (module docstring)
    norm_output: bool = False  # the normed output, not the pre-norm one, is fed to the next step
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_target(cls, target_config, draft_vocab_size: int, aux_layer_ids: list[int], *, norm_before_fc: bool = False,
                    norm_output: bool = False, intermediate_size: int | None = None, head_dim: int | None = None,
                    num_attention_heads: int | None = None, num_key_value_heads: int | None = None) -> "DrafterShape":
        """The drafter for this target (its text part, for a multimodal one), per family (default_layer_sizes); each of
        intermediate_size, head_dim, num_attention_heads, num_key_value_heads given replaces the family's choice. Only
        the drafter's own config.json carries them, and SGLang and vLLM build the draft layer from that file."""
        text = family.text_config(target_config)
        sizes = default_layer_sizes(text)
        for name, value in (("intermediate_size", intermediate_size), ("head_dim", head_dim),
                            ("num_attention_heads", num_attention_heads), ("num_key_value_heads", num_key_value_heads)):
            if value is not None:
                sizes[name] = int(value)
        if sizes["num_attention_heads"] % sizes["num_key_value_heads"]:
            raise ConfigError(
                f"drafter.num_key_value_heads {sizes['num_key_value_heads']} does not divide drafter.num_attention_heads "
                f"{sizes['num_attention_heads']}: each key-value head serves a whole group of query heads"
            )
        rope = family.full_attention_rope(text)
        rope_theta = rope.pop("rope_theta")
        # The drafter rotates its whole head (a Llama layer): a target's partial rotary stays the target's.
        rope.pop("partial_rotary_factor", None)
        rope_scaling = rope if rope.get("rope_type", "default") != "default" else None
        return cls(
            hidden_size=text.hidden_size,
            rms_norm_eps=text.rms_norm_eps,
            vocab_size=text.vocab_size,
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=text.hidden_size,
            max_position_embeddings=text.max_position_embeddings,
            aux_layer_ids=list(aux_layer_ids),
            hidden_act="silu",  # what DraftMLP computes, and the only activation SGLang's LlamaMLP takes
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            target_num_hidden_layers=text.num_hidden_layers,
            norm_before_fc=bool(norm_before_fc),
            norm_output=bool(norm_output),
            **sizes,
        )

    def sglang_config(self, torch_dtype: str = "bfloat16") -> dict:
        """config.json for `--speculative-algorithm EAGLE3 --speculative-draft-model-path <dir>`."""
        config = {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": False,
            "torch_dtype": torch_dtype,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids), "use_aux_hidden_state": True},
        }
        # Written only when on, so a default drafter's config.json is what it always was.
        if self.norm_before_fc:  # SGLang reads eagle_config's first, vLLM has read the top level's
            config["norm_before_fc"] = config["eagle_config"]["norm_before_fc"] = True
        if self.norm_output:  # SGLang reads only the top level's
            config["norm_output"] = True
        return config

    @classmethod
    def from_sglang_config(cls, config: dict) -> "DrafterShape":
        return cls(
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_attention_heads=config["num_attention_heads"],
            num_key_value_heads=config["num_key_value_heads"],
            head_dim=config["head_dim"],
            rms_norm_eps=config["rms_norm_eps"],
            vocab_size=config["vocab_size"],
            draft_vocab_size=config["draft_vocab_size"],
            target_hidden_size=config["target_hidden_size"],
            max_position_embeddings=config["max_position_embeddings"],
            aux_layer_ids=config["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
            hidden_act=config.get("hidden_act", "silu"),
            rope_theta=config.get("rope_theta", 10000.0),
            rope_scaling=config.get("rope_scaling"),
            # SGLang's precedence: eagle_config's norm_before_fc, then the top level's.
            norm_before_fc=bool((config.get("eagle_config") or {}).get("norm_before_fc", config.get("norm_before_fc", False))),
            norm_output=bool(config.get("norm_output", False)),
        )

    def expected_tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
        """Every tensor SGLang loads, with its shape; dtype None means the weight dtype."""
        H, I, hd = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_attention_heads * hd, self.num_key_value_heads * hd
        norms = {"input_norm.weight": ((3 * self.target_hidden_size,), None)} if self.norm_before_fc else {}
        return {
            **norms,
            "fc.weight": ((H, 3 * self.target_hidden_size), None),
            "midlayer.input_layernorm.weight": ((H,), None),
            "midlayer.hidden_norm.weight": ((H,), None),
            "midlayer.self_attn.q_proj.weight": ((q, 2 * H), None),
            "midlayer.self_attn.k_proj.weight": ((kv, 2 * H), None),
            "midlayer.self_attn.v_proj.weight": ((kv, 2 * H), None),
            "midlayer.self_attn.o_proj.weight": ((H, q), None),
            "midlayer.post_attention_layernorm.weight": ((H,), None),
            "midlayer.mlp.gate_proj.weight": ((I, H), None),
            "midlayer.mlp.up_proj.weight": ((I, H), None),
            "midlayer.mlp.down_proj.weight": ((H, I), None),
            "norm.weight": ((H,), None),
            "lm_head.weight": ((self.draft_vocab_size, H), None),
            "d2t": ((self.draft_vocab_size,), torch.int64),
            "t2d": ((self.vocab_size,), torch.bool),
        }


class Rotary(nn.Module):
    """Llama rotary embedding, built with transformers' own initialiser so every rope type matches the target."""

    def __init__(self, shape: DrafterShape):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        rope_parameters = {"rope_type": "default", "rope_theta": shape.rope_theta, **(shape.rope_scaling or {})}
        config = LlamaConfig(
            hidden_size=shape.hidden_size,
            num_attention_heads=shape.num_attention_heads,
            head_dim=shape.head_dim,
            max_position_embeddings=shape.max_position_embeddings,
            rope_parameters=rope_parameters,
        )
        self.rope = LlamaRotaryEmbedding(config)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rope(x, positions)  # (B, T, hd)
        return cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, hd): broadcast over heads


def apply_linears(modules, x: torch.Tensor) -> list[torch.Tensor]:
    """[m(x) for each of modules]: linears that read one input, each its own product."""
    return [m(x) for m in modules]


class DraftAttention(nn.Module):
    # How q, k and v are computed from their shared input: one product each here; train.fused_weight_grads swaps in one
    # product over a stacked copy of the three weights for a step (eyrie.training.weight_grads.StepWeights.stacked_linear).
    # A class attribute: no state, checkpoints unchanged.
    shared_input_linears = staticmethod(apply_linears)

    def __init__(self, shape: DrafterShape):
        super().__init__()
        H, hd = shape.hidden_size, shape.head_dim
        self.heads, self.kv_heads, self.head_dim = shape.num_attention_heads, shape.num_key_value_heads, hd
        self.q_proj = nn.Linear(2 * H, self.heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * H, self.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(2 * H, self.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.heads * hd, H, bias=False)
        self.pointwise_kernels = EAGER_POINTWISE  # a plain attribute (train.fused_pointwise): no state, checkpoints unchanged

    def project(self, x, cos, sin, repeat_kv: bool = True, qk_dtype=None):
        """q, k, v with rotary applied: q (B, h, T, hd); k, v (B, h, T, hd) with kv heads repeated for GQA,
        or (B, kv_h, T, hd) with repeat_kv=False (for kernels that take GQA natively). qk_dtype: q and k rotated into
        it (None: the dtype the product with cos and sin gives)."""
        q, k, v = self.shared_input_linears((self.q_proj, self.k_proj, self.v_proj), x)
        # v.contiguous(): where q, k, v are column slices of one product (train.fused_weight_grads), a v held across TTT
        # steps would hold q's and k's columns too (q and k are rotated into new tensors); a no-op on a product of its own
        return self.rotary_heads(q, k, v.contiguous(), cos, sin, repeat_kv, qk_dtype)

    def rotary_heads(self, q, k, v, cos, sin, repeat_kv: bool = True, qk_dtype=None):
        """project after its three matrix products: q, k, v (B, T, width) split into heads, rotary on q and k
        (elementwise only: train.compile fuses it, eyrie.training.compiled_layers)."""
        B, T, _ = q.shape
        q = q.view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, k, cos, sin, self.pointwise_kernels, qk_dtype)
        if not repeat_kv:
            return q, k, v
        repeat = self.heads // self.kv_heads
        return q, k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)

    def output(self, attended: torch.Tensor) -> torch.Tensor:
        """o_proj of the per-head outputs (B, h, T, hd)."""
        B, h, T, hd = attended.shape
        return self.o_proj(attended.transpose(1, 2).reshape(B, T, h * hd))

    def attend(self, q, blocks) -> torch.Tensor:
        """Softmax over several key blocks at once.

        blocks: list of (k, v, mask) where mask is a bool (B|1, 1, Tq, Tk) tensor (True = visible),
        or (k, v, None) for a "diagonal" block: query t sees only key t of that block. The diagonal
        blocks are the training-time-test steps: position t at step j sees its own earlier drafts.
        """
        scale = 1.0 / math.sqrt(self.head_dim)
        scores, values = [], []
        for k, v, mask in blocks:
            if mask is None:
                scores.append(((q * k).sum(-1, keepdim=True) * scale).float())  # (B, h, T, 1)
            else:
                s = (q @ k.transpose(-1, -2) * scale).float()
                scores.append(s.masked_fill(~mask, float("-inf")))
            values.append((v, mask is None))
        probs = torch.softmax(torch.cat(scores, dim=-1), dim=-1).to(q.dtype)
        out, start = 0, 0
        for (v, diagonal), s in zip(values, scores):
            width = s.shape[-1]
            p = probs[..., start : start + width]
            out = out + (p * v if diagonal else p @ v)
            start += width
        return self.output(out)


class DraftMLP(nn.Module):
    def __init__(self, shape: DrafterShape):
        super().__init__()
        self.gate_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.up_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=False)
        self.pointwise_kernels = EAGER_POINTWISE  # a plain attribute (train.fused_pointwise): no state, checkpoints unchanged

    def forward(self, x):
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), self.pointwise_kernels))


class MidLayer(nn.Module):
    def __init__(self, shape: DrafterShape):
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.hidden_norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = DraftAttention(shape)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = DraftMLP(shape)


class Eagle3Drafter(nn.Module):
    def __init__(self, shape: DrafterShape, target_embeddings: torch.Tensor, draft_to_target: torch.Tensor, target_to_draft: torch.Tensor):
        super().__init__()
        self.shape = shape
        # SGLang's name and place: model.input_norm, applied to the concatenated aux states before fc.
        self.input_norm = RMSNorm(3 * shape.target_hidden_size, shape.rms_norm_eps) if shape.norm_before_fc else None
        self.fc = nn.Linear(3 * shape.target_hidden_size, shape.hidden_size, bias=False)
        self.midlayer = MidLayer(shape)
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.lm_head = nn.Linear(shape.hidden_size, shape.draft_vocab_size, bias=False)
        self.rotary = Rotary(shape)
        # Frozen and not persistent: SGLang uses the target's own embeddings.
        self.register_buffer("embed_weight", target_embeddings.detach().clone(), persistent=False)
        self.register_buffer("d2t", draft_to_target.to(torch.int64))
        self.register_buffer("t2d", target_to_draft.to(torch.bool))

    def draft_ids_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def project_aux(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """The first step's g from the target's concatenated aux states (B, T, 3H) -> (B, T, H): fc, after input_norm
        with norm_before_fc. Callers use this, never fc alone."""
        if self.input_norm is not None:
            aux_hidden = self.input_norm(aux_hidden)
        return self.fc(aux_hidden)

    def layer_inputs(self, hidden: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor, rotary=None):
        """Normalised 2H input of the attention and the rotary tables for these positions. rotary: (cos, sin) (B, 1,
        T, hd) for these positions, from a caller that keeps tables of self.rotary (eyrie.decoding.static_drafter),
        else computed here."""
        layer = self.midlayer
        embeds = F.embedding(input_ids, self.embed_weight).to(hidden.dtype)
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)  # (B, T, 2H)
        cos, sin = self.rotary(x, positions) if rotary is None else rotary
        return x, cos.to(x.dtype), sin.to(x.dtype)

    def layer_output(self, hidden: torch.Tensor, attended: torch.Tensor, mlp=None) -> torch.Tensor:
        """Residuals and MLP after attention: the state fed to the next step (carried). mlp: a callable computing
        midlayer.mlp's values some other way (eyrie.decoding.static_drafter merges its gate and up products)."""
        residual = hidden + attended
        return self.carried(residual + (mlp or self.midlayer.mlp)(self.midlayer.post_attention_layernorm(residual)))

    def carried(self, out: torch.Tensor) -> torch.Tensor:
        """What the layer's output hands on, to the next step and to head: the pre-norm output, or norm(out) with norm_output."""
        return self.norm(out) if self.shape.norm_output else out

    def head_input(self, carried: torch.Tensor) -> torch.Tensor:
        """The normed state lm_head reads, from a carried state: norm(out) either way, normed only once."""
        return carried if self.shape.norm_output else self.norm(carried)

    def head(self, carried: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.head_input(carried))

    def finish(self, hidden: torch.Tensor, attended: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(draft logits, the state fed to the next step)."""
        out = self.layer_output(hidden, attended)
        return self.head(out), out

    def decode(self, hidden, input_ids, positions, cache: "DraftCache"):
        """Inference: extend the cache with these positions, attending causally to everything cached."""
        x, cos, sin = self.layer_inputs(hidden, input_ids, positions)
        q, k, v = self.midlayer.self_attn.project(x, cos, sin)
        keys, values, key_positions = cache.append(k, v, positions)
        mask = (key_positions[:, None, None, :] <= positions[:, None, :, None])  # (B, 1, Tq, Tk)
        attended = self.midlayer.self_attn.attend(q, [(keys, values, mask)])
        return self.finish(hidden, attended)


class DraftCache:
    """The drafter's KV cache for one batch; crop() drops rejected drafts."""

    def __init__(self):
        self.keys = self.values = self.positions = None

    def append(self, k, v, positions):
        if self.keys is None:
            self.keys, self.values, self.positions = k, v, positions
        else:
            self.keys = torch.cat([self.keys, k], dim=2)
            self.values = torch.cat([self.values, v], dim=2)
            self.positions = torch.cat([self.positions, positions], dim=1)
        return self.keys, self.values, self.positions

    def crop(self, length: int) -> None:
        if self.keys is not None:
            self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]
            self.positions = self.positions[:, :length]

    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]
