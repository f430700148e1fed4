"""The drafter each target family gets (eyrie.drafter.model.default_layer_sizes), the text config of a multimodal target,
Gemma's (1 + w) norm and full-attention rope, and the MoE refusal under tensor parallelism."""

from __future__ import annotations

import math

import pytest
import torch
import transformers as t
from factories import tiny_family_config, tiny_family_target

from eyrie.core.errors import ConfigError
from eyrie.drafter.model import DrafterShape
from eyrie.target.family import UnsupportedTargetError, target_text_config
from eyrie.target.head import load_target_head
from eyrie.target.model import check_experts_split

# Published drafters for these targets (SpecForge's configs/): (heads, kv heads, head_dim, MLP width).
PUBLISHED = {
    "Qwen3-8B": (t.Qwen3Config(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=12288), (32, 8, 128, 12288)),
    "Qwen3-30B-A3B": (t.Qwen3MoeConfig(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                                       moe_intermediate_size=768, num_experts=128), (32, 4, 128, 12288)),
    "gpt-oss-20b": (t.GptOssConfig(hidden_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64, intermediate_size=2880,
                                   num_local_experts=32), (64, 8, 64, 17280)),
    "Gemma-3-1B": (t.Gemma3TextConfig(hidden_size=1152, num_attention_heads=4, num_key_value_heads=1, head_dim=256, intermediate_size=6912), (4, 1, 256, 6912)),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_dense_and_moe_targets_get_the_published_drafters_layer(name):
    config, expected = PUBLISHED[name]
    s = DrafterShape.from_target(config, 32000, [1, 2, 3])
    assert (s.num_attention_heads, s.num_key_value_heads, s.head_dim, s.intermediate_size) == expected
    assert s.hidden_act == "silu" and s.sglang_config()["hidden_act"] == "silu"  # Gemma's gelu is not what the draft layer computes


def test_mla_targets_get_whole_value_heads_not_hidden_over_heads():
    """DeepSeek-V3 / Kimi-K2: hidden_size // heads would be 64-wide heads x 128 (Kimi-K2: 64) kv heads; the drafter takes
    v_head_dim-wide heads, 8 kv heads (SpecForge's DeepSeek-V3 drafter: 56 x 128, 8 kv heads) and the MoE MLP width."""
    for heads in (128, 64):  # DeepSeek-V3, Kimi-K2
        config = t.DeepseekV3Config(hidden_size=7168, num_attention_heads=heads, v_head_dim=128, intermediate_size=18432, n_routed_experts=256)
        s = DrafterShape.from_target(config, 32000, [1, 29, 57])
        assert (s.num_attention_heads, s.num_key_value_heads, s.head_dim, s.intermediate_size) == (56, 8, 128, 6 * 7168)
        assert s.expected_tensors()["midlayer.self_attn.q_proj.weight"][0] == (56 * 128, 2 * 7168)


def test_the_config_names_each_size_and_a_bad_group_is_refused():
    config = t.Qwen3Config(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=12288)
    s = DrafterShape.from_target(config, 32000, [1, 2, 3], head_dim=64, num_attention_heads=16, num_key_value_heads=4, intermediate_size=8192)
    written = s.sglang_config()
    assert (written["head_dim"], written["num_attention_heads"], written["num_key_value_heads"], written["intermediate_size"]) == (64, 16, 4, 8192)
    assert DrafterShape.from_sglang_config(written).expected_tensors() == s.expected_tensors()
    with pytest.raises(ConfigError, match="num_key_value_heads 3 does not divide drafter.num_attention_heads 16"):
        DrafterShape.from_target(config, 32000, [1, 2, 3], num_attention_heads=16, num_key_value_heads=3)


def test_gemma3_multimodal_target_gives_its_text_model_and_full_attention_rope(tmp_path):
    target = tiny_family_target("gemma3", tmp_path / "gemma3", vocab=300)
    text = target_text_config(target)
    assert type(text).__name__ == "Gemma3TextConfig" and text.vocab_size == 300
    s = DrafterShape.from_target(t.AutoConfig.from_pretrained(target), 64, [1, 3, 4])  # the whole multimodal config works too
    assert s.vocab_size == 300 and s.rope_theta == 1000000.0 and s.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_gemmas_zero_centred_norm_reaches_the_drafter_as_its_effective_weight(tmp_path):
    """Gemma's norm computes x_normed * (1 + w): a plain RMSNorm (the drafter's, SGLang's, vLLM's) needs 1 + w."""
    from safetensors import safe_open

    for family in ("gemma3_text", "gemma3", "qwen3"):
        target = tiny_family_target(family, tmp_path / family, vocab=300)
        head = load_target_head(target)
        with safe_open(str(target / "model.safetensors"), framework="pt") as f:
            prefix = min((k for k in f.keys() if k.endswith("embed_tokens.weight")), key=len)[: -len("embed_tokens.weight")]
            stored = f.get_tensor(prefix + "norm.weight").float()
        offset = 1.0 if family.startswith("gemma") else 0.0
        assert torch.equal(head["norm"], stored + offset)
        # The drafter's head computes what the target's final norm computes.
        model = t.AutoModelForCausalLM.from_pretrained(target)
        final_norm = model.model.language_model.norm if family == "gemma3" else model.model.norm
        eps = getattr(final_norm, "eps", None) or final_norm.variance_epsilon
        x = torch.randn(3, 64)
        plain = head["norm"] * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        assert torch.allclose(final_norm(x), plain, atol=1e-5)


def test_an_moe_target_under_tensor_parallel_is_refused_with_the_bytes(tmp_path):
    target = tiny_family_target("qwen3_moe", tmp_path / "moe", vocab=300)
    with pytest.raises(UnsupportedTargetError, match=r"replicates every routed expert.*GiB per rank of .* GiB in all \(\d+%\)"):
        check_experts_split(target, t.AutoConfig.from_pretrained(target), 2)
    dense = tiny_family_target("qwen3", tmp_path / "dense", vocab=300)
    check_experts_split(dense, t.AutoConfig.from_pretrained(dense), 2)  # a dense target splits as before


def test_tiny_family_configs_keep_their_family_features():
    assert tiny_family_config("deepseek_v3", vocab=300).kv_lora_rank == 16
    assert math.gcd(4, 8) == DrafterShape.from_target(tiny_family_config("deepseek_v3", vocab=300), 64, [1, 3, 4]).num_key_value_heads
